//! The `dflash` step's memory grows linearly with the context length at fixed anchors, never with
//! `queries × keys`: a drafter's actual allocation (every buffer the step touches, equal to the compiled
//! layout) at three context lengths grows by equal steps, and the growth per context token does not depend on
//! how many block rows (queries) there are.

mod backends;

use backends::TestDevice;
use draftpipe_compiler::plan::{
    AdamWSpec, BackendKind, BucketPlan, DFLASH_RMS_NORM_EPS, DflashSpec, LossSpec, LrSchedule,
    ModelPlan, Precision, WorkspaceLayout,
};

fn spec(anchors: usize) -> DflashSpec {
    DflashSpec {
        hidden: 64,
        taps: 3,
        tap_layers: vec![1, 2, 3],
        vocab: 512,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        intermediate: 128,
        block: 4,
        anchors,
        mask_token: 511,
        rope_theta: 10000.0,
        rms_norm_eps: DFLASH_RMS_NORM_EPS,
    }
}

fn settings(precision: Precision) -> (LossSpec, AdamWSpec, Precision) {
    (
        LossSpec {
            head_decay: 1.0,
            position_decay: Some(7.0),
            step_decay: None,
            chunk_tokens: 256,
        },
        AdamWSpec {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            clip_grad_norm: None,
            schedule: LrSchedule::CONSTANT,
        },
        precision,
    )
}

/// Bytes a drafter allocates for one sequence of `len` tokens at `anchors`, checked against the layout.
fn allocated<D: TestDevice>(device: &D, anchors: usize, len: usize) -> i128 {
    allocated_at(device, (anchors, len), Precision::F32)
}

/// [`allocated`] at `precision` (on CUDA at bf16 the layout adds the 16-bit operand copies, and the drafter
/// must allocate exactly those).
fn allocated_at<D: TestDevice>(
    device: &D,
    (anchors, len): (usize, usize),
    precision: Precision,
) -> i128 {
    let model = ModelPlan::new(spec(anchors));
    let bucket = BucketPlan {
        padded_len: len,
        sequences: 2,
        tokens: 2 * len,
        step_flops: 0,
        step_bytes: 0,
    };
    let drafter = device.drafter(&model, settings(precision), std::slice::from_ref(&bucket));
    let kind = if D::NAME == "cpu" {
        BackendKind::Cpu
    } else {
        BackendKind::Cuda
    };
    let layout = WorkspaceLayout::of_model(
        &model.spec,
        &[bucket],
        &settings(precision).0,
        kind,
        precision,
    )
    .expect("layout");
    let frozen = 2 * 4 * 512 * 64;
    let expected = layout.bytes().unwrap() + 16 * model.parameters as u64 + frozen;
    assert_eq!(
        drafter.allocated_bytes(),
        expected,
        "allocation is the layout"
    );
    i128::from(drafter.allocated_bytes())
}

fn memory_is_linear_in_the_context<D: TestDevice>(device: &D) {
    for anchors in [16, 32] {
        let (a, b, c) = (
            allocated(device, anchors, 512),
            allocated(device, anchors, 1024),
            allocated(device, anchors, 1536),
        );
        println!("{}: anchors {anchors}: {a} / {b} / {c} B", D::NAME);
        assert!(b > a, "a longer context needs more memory");
        assert_eq!(b - a, c - b, "equal steps in length add equal bytes");
    }
    // Per context token the step needs the same bytes whether a sequence has 16 or 32 blocks: nothing is
    // sized by queries × context keys.
    let per_token = |anchors| allocated(device, anchors, 1024) - allocated(device, anchors, 512);
    assert_eq!(per_token(16), per_token(32));
    // At bf16 the allocation is the layout's too, with its 16-bit copies where the backend keeps them.
    let model = ModelPlan::new(spec(16));
    let extra = allocated_at(device, (16, 512), Precision::Bf16) - allocated(device, 16, 512);
    println!("{}: bf16 adds {extra} B", D::NAME);
    if D::NAME == "cuda" {
        // At least the parameters' copy (2·P) on CUDA, whose products read bf16 operands from memory.
        assert!(extra >= 2 * model.parameters as i128, "{extra} B");
    }
}
test_device!(memory_is_linear_in_the_context);
