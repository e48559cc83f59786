//! The batch's `last_hidden_states` seam, on every backend present (`test_device!`): an input slot built from
//! an `eagle3` workspace holds them in the batch's dtype (`input{slot}.last_hs`), `Backend::stage` copies them
//! exactly (bf16 as it is, f32 as it is), a batch without them is refused by the backend (the slot would keep
//! the previous batch's teacher), and a slot of a family that does not read them stages a batch that has them.

mod backends;

use backends::TestDevice;
use draftpipe_compiler::plan::{
    BackendKind, BucketPlan, Eagle3Spec, HsDtype, LossSpec, MlpSpec, Precision, WorkspaceLayout,
};
use draftpipe_runtime::backend::{Backend, BackendError, HostBatch, HsBuf};
use draftpipe_runtime::batch::HsBatch;
use draftpipe_runtime::model::step::input_slot;

const SPEC: Eagle3Spec = Eagle3Spec {
    hidden: 8,
    taps: 3,
    tap_layers: Vec::new(),
    vocab: 32,
    draft_vocab: 12,
    heads: 2,
    kv_heads: 1,
    head_dim: 4,
    intermediate: 12,
    ttt: 2,
    rope_theta: 1e4,
    rms_norm_eps: 1e-6,
};

const BUCKET: BucketPlan = BucketPlan {
    padded_len: 6,
    sequences: 2,
    tokens: 12,
    step_flops: 0,
    step_bytes: 0,
};

const LOSS: LossSpec = LossSpec {
    head_decay: 1.0,
    position_decay: None,
    step_decay: Some(0.8),
    chunk_tokens: 4,
};

/// A batch of `BUCKET`'s shape in `dtype` whose hidden states and last hidden states are distinct values
/// (exact in bf16: small integers over 8).
fn batch(dtype: HsDtype) -> HsBatch {
    let mut batch = HsBatch::zeroed_in(dtype, BUCKET.padded_len, BUCKET.sequences, 3 * SPEC.hidden)
        .with_last_hidden_states(SPEC.hidden);
    let hs: Vec<f32> = (0..batch.hs.len()).map(|i| (i % 97) as f32 / 8.0).collect();
    batch.hs.store_f32(0, &hs);
    let last = batch
        .last_hidden_states
        .as_mut()
        .expect("last hidden states");
    let values: Vec<f32> = (0..last.len()).map(|i| -((i % 89) as f32) / 8.0).collect();
    last.store_f32(0, &values);
    batch
        .input_ids
        .iter_mut()
        .enumerate()
        .for_each(|(i, id)| *id = i as u32 % 32);
    batch.seq_lens.fill(6);
    batch.loss_mask.fill(1);
    batch
}

fn download_hs<B: Backend>(backend: &mut B, buf: &HsBuf<B>) -> Vec<f32> {
    match buf {
        HsBuf::F32(b) => {
            let mut out = vec![0.0; b.len()];
            backend.download(b.all(), &mut out).expect("download");
            out
        }
        HsBuf::Bf16(b) => {
            let mut out = vec![half::bf16::ZERO; b.len()];
            backend.download(b.all(), &mut out).expect("download");
            out.iter().map(|x| x.to_f32()).collect()
        }
        HsBuf::F16(b) => {
            let mut out = vec![half::f16::ZERO; b.len()];
            backend.download(b.all(), &mut out).expect("download");
            out.iter().map(|x| x.to_f32()).collect()
        }
    }
}

fn last_hidden_states_are_staged_exactly<D: TestDevice>(device: &D) {
    let kind = if D::NAME == "cpu" {
        BackendKind::Cpu
    } else {
        BackendKind::Cuda
    };
    for dtype in [HsDtype::F32, HsDtype::Bf16] {
        let layout = WorkspaceLayout::eagle3(&SPEC, &[BUCKET], &LOSS, kind, Precision::Bf16)
            .and_then(|layout| layout.with_hs_dtype(kind, dtype))
            .expect("layout");
        let mut backend = device.backend(&layout);
        let mut slot = input_slot(&mut backend, &layout, 0).expect("slot");
        let last = slot
            .last_hidden_states
            .as_ref()
            .expect("an eagle3 slot holds them");
        assert_eq!(last.len(), BUCKET.tokens * SPEC.hidden);
        assert_eq!(
            last.dtype(),
            slot.hs.dtype(),
            "{}: in the batch's dtype",
            D::NAME
        );

        let batch = batch(slot.hs.dtype());
        backend
            .stage(0, HostBatch::from(&batch), &mut slot)
            .expect("stage");
        backend.begin_step(0, 0).expect("begin");
        let want = batch.last_hidden_states.as_ref().unwrap();
        let got = download_hs(&mut backend, slot.last_hidden_states.as_ref().unwrap());
        assert_eq!(
            got,
            want.to_f32_vec(0..want.len()),
            "{}: {dtype:?}",
            D::NAME
        );
        assert_eq!(
            download_hs(&mut backend, &slot.hs),
            batch.hs.to_f32_vec(0..batch.hs.len()),
            "{}: the hidden states beside them",
            D::NAME
        );

        let without = HsBatch {
            last_hidden_states: None,
            ..batch.clone()
        };
        let refused = backend.stage(1 % layout.input_slots, HostBatch::from(&without), &mut slot);
        assert!(
            matches!(&refused, Err(BackendError::Unsupported(m)) if m.contains("last_hidden_states")),
            "{}: {:?}",
            D::NAME,
            refused.err()
        );
    }
}
test_device!(last_hidden_states_are_staged_exactly);

fn a_family_without_them_ignores_them<D: TestDevice>(device: &D) {
    let kind = if D::NAME == "cpu" {
        BackendKind::Cpu
    } else {
        BackendKind::Cuda
    };
    let spec = MlpSpec {
        din: 3 * SPEC.hidden,
        hidden: 8,
        blocks: 1,
        intermediate: 12,
        heads: 1,
        vocab: 32,
    };
    let layout =
        WorkspaceLayout::mlp(&spec, &[BUCKET], &LOSS, kind, Precision::F32).expect("layout");
    let mut backend = device.backend(&layout);
    let mut slot = input_slot(&mut backend, &layout, 0).expect("slot");
    assert!(slot.last_hidden_states.is_none());
    let batch = batch(HsDtype::F32);
    backend
        .stage(0, HostBatch::from(&batch), &mut slot)
        .expect("stage");
    backend.begin_step(0, 0).expect("begin");
    assert_eq!(
        download_hs(&mut backend, &slot.hs),
        batch.hs.to_f32_vec(0..batch.hs.len())
    );
}
test_device!(a_family_without_them_ignores_them);
