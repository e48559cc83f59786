//! The head over the labelled rows only (`backend::head`), on the CPU: the batch's labelled rows (a synchronous
//! backend's head) and the bucket's bound (what a captured CUDA step runs) give the same loss, gradients and
//! per-slot hits on a batch that drops rows every way a batch can, with every head buffer poisoned (NaN)
//! before the step. The step against the f64 reference and finite differences is `tests/dflash_step.rs`.

use draftpipe_compiler::plan::{
    AdamWSpec, BucketPlan, DFLASH_RMS_NORM_EPS, DflashSpec, LossSpec, LrSchedule, ModelPlan,
    Precision,
};
use draftpipe_compiler::workspace::{BackendKind, WorkspaceLayout};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

use super::{Dflash, DflashOffsets};
use crate::backend::cpu::CpuBackend;
use crate::backend::{Backend, HostBatch};
use crate::batch::HsBatch;
use crate::model::family::Family;
use crate::model::step::StepShape;
use crate::params::FlatState;

fn spec() -> DflashSpec {
    DflashSpec {
        hidden: 8,
        taps: 2,
        tap_layers: vec![1, 2],
        vocab: 24,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 4,
        intermediate: 12,
        block: 4,
        anchors: 3,
        mask_token: 23,
        rope_theta: 10000.0,
        rms_norm_eps: DFLASH_RMS_NORM_EPS,
    }
}

/// Three sequences of 10: one short (slots past its end), one with a dropped stretch of its loss mask, one
/// with a single valid anchor (absent blocks).
fn batch(din: usize, vocab: u32) -> HsBatch {
    let (s, n) = (10, 3);
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(17);
    let mut batch = HsBatch::zeroed(s, n, din);
    let lens = [6, 10, 10];
    let hs = batch.hs.as_f32_mut().expect("an f32 batch");
    for (seq, &len) in lens.iter().enumerate() {
        for p in 0..len {
            let row = seq * s + p;
            for x in &mut hs[row * din..(row + 1) * din] {
                *x = rng.random_range(-1.0..1.0);
            }
        }
    }
    for (seq, &len) in lens.iter().enumerate() {
        batch.seq_lens[seq] = len as u32;
        for p in 0..len {
            let row = seq * s + p;
            batch.input_ids[row] = rng.random_range(0..vocab - 1);
            batch.loss_mask[row] = u8::from(match seq {
                0 => p >= 1,
                1 => !(4..7).contains(&p),
                _ => p == 2 || p == 3,
            });
        }
    }
    batch
}

/// What one step leaves: the loss, the gradients and the per-slot correct counts, and the head rows it ran.
struct Outcome {
    loss: f32,
    grads: Vec<f32>,
    correct: Vec<f32>,
    head_rows: usize,
    /// The step's accepted prefixes (its read-back) and a brute-force count of them from its per-row flags.
    accepted: (f32, f64),
}

fn step(bucket_head: bool) -> Outcome {
    let spec = spec();
    let model = ModelPlan::new(spec.clone());
    let bucket = BucketPlan {
        padded_len: 10,
        sequences: 3,
        tokens: 30,
        step_flops: 0,
        step_bytes: 0,
    };
    let loss = LossSpec {
        head_decay: 1.0,
        position_decay: Some(2.0),
        step_decay: None,
        chunk_tokens: 4,
    };
    let adamw = AdamWSpec {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
        clip_grad_norm: None,
        schedule: LrSchedule::CONSTANT,
    };
    let layout = WorkspaceLayout::dflash(&spec, &[bucket], &loss, BackendKind::Cpu, Precision::F32)
        .expect("layout");
    let mut be = CpuBackend::new(&layout);
    let offsets = DflashOffsets::new(&model).expect("offsets");
    let mut d = Dflash::new(
        &mut be,
        (&model, offsets),
        loss,
        adamw,
        Precision::F32,
        &layout,
    )
    .expect("model");
    d.bucket_head = bucket_head;
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(4);
    let frozen = spec.vocab * spec.hidden;
    let mut table = || -> Vec<f32> { (0..frozen).map(|_| rng.random_range(-1.0..1.0)).collect() };
    let (embed, lm) = (table(), table());
    be.upload(d.ws.embed.all_mut(), &embed).expect("embed");
    be.upload(d.ws.lm_head.all_mut(), &lm).expect("lm_head");
    let init = FlatState::init(&model, 5);
    be.upload(d.state.params.all_mut(), &init.params)
        .expect("params");
    let batch = batch(spec.taps * spec.hidden, spec.vocab as u32);
    be.stage(0, HostBatch::from(&batch), &mut d.ws.inputs[0])
        .expect("stage batch");
    d.stage(&mut be, 0, &batch, (9, 0)).expect("stage plan");
    let ws = &mut d.ws;
    let super::buffers::HeadBuffers::F32 { z: head_z } = &mut ws.head else {
        panic!("the CPU's head reads f32 operands");
    };
    for buf in [
        head_z,
        &mut ws.head_dz,
        &mut ws.logits,
        &mut ws.row_loss,
        &mut ws.head_correct,
        &mut ws.correct,
        &mut ws.dz,
    ] {
        be.fill(buf.all_mut(), f32::NAN).expect("poison");
    }
    be.fill(d.state.grads.all_mut(), f32::NAN).expect("poison");
    let shape = StepShape {
        padded_len: batch.padded_len,
        sequences: batch.sequences,
    };
    d.forward_backward(&mut be, shape, 0).expect("step");
    let mut grads = vec![0.0; model.parameters];
    be.download(d.state.grads.all(), &mut grads).expect("grads");
    let mut scalars = vec![0.0; d.ws.step_scalars.len()];
    be.download(d.ws.step_scalars.all(), &mut scalars)
        .expect("scalars");
    let mut flags = vec![0.0; d.ws.correct.len()];
    be.download(d.ws.correct.all(), &mut flags)
        .expect("correct");
    let rows = 3 * spec.block_slots(10) * spec.block;
    let brute_force: usize = flags[..rows]
        .chunks(spec.block)
        .map(|block| block[1..].iter().take_while(|&&c| c == 1.0).count())
        .sum();
    Outcome {
        accepted: (scalars[3 + spec.block], brute_force as f64),
        loss: scalars[2],
        grads,
        correct: scalars[3..3 + spec.block].to_vec(),
        head_rows: d.staged_head_rows[0],
    }
}

#[test]
fn the_labelled_rows_and_the_buckets_bound_give_the_same_step() {
    let labelled = step(false);
    let bound = step(true);
    let spec = spec();
    let blocks = 3 * spec.block_slots(10);
    // The bucket's bound is N·A·(B − 1) + 1; this batch labels far fewer rows (the head's saving).
    assert_eq!(bound.head_rows, blocks * (spec.block - 1) + 1);
    assert!(
        labelled.head_rows < bound.head_rows * 2 / 3,
        "{} labelled head rows of a bound of {}",
        labelled.head_rows,
        bound.head_rows
    );
    assert!(labelled.loss.is_finite() && labelled.loss > 0.0);
    assert!(
        (labelled.loss - bound.loss).abs() <= 1e-6 * bound.loss,
        "loss {} vs {}",
        labelled.loss,
        bound.loss
    );
    assert_eq!(labelled.correct, bound.correct, "per-slot hits");
    assert_eq!(labelled.correct[0], 0.0, "slot 0 has no label");
    for outcome in [&labelled, &bound] {
        let (read_back, brute_force) = outcome.accepted;
        assert_eq!(f64::from(read_back), brute_force, "accepted prefixes");
    }
    let norm = |x: &[f32]| x.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>().sqrt();
    assert!(
        labelled.grads.iter().all(|g| g.is_finite()),
        "every gradient written"
    );
    let diff: Vec<f32> = labelled
        .grads
        .iter()
        .zip(&bound.grads)
        .map(|(a, b)| a - b)
        .collect();
    assert!(norm(&bound.grads) > 1e-3, "the gradient is not trivial");
    assert!(
        norm(&diff) <= 1e-6 * norm(&bound.grads),
        "gradients differ by {:.3e} of {:.3e}",
        norm(&diff),
        norm(&bound.grads)
    );
}
