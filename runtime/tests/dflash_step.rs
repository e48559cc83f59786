//! The `dflash` step on every backend present, through `test_device!`: the loss and the gradient of every
//! trained tensor against the independent f64 reference (`dflash_support`) and its central finite differences,
//! the per-slot accuracy against the reference's, evaluation (forward only) agreeing with the step and training
//! nothing, and the loss and τ improving on a learnable task.
//!
//! Tolerances (the step against f64 finite differences; `err ≤ tol · (largest + own)`, with `largest` the
//! largest gradient norm over all tensors and `own` the tensor's; measured on the CPU, stated with a
//! margin; CUDA's as mlp's, for the device's `ex2.approx`):
//!
//! | precision | loss (relative) | gradients CPU | gradients CUDA |
//! | --- | --- | --- | --- |
//! | f32  | 1e-5 (measured 3.4e-8) | 1e-5 (measured 1.6e-7) | 1e-3 |
//! | bf16 | 2e-3 (measured 1.2e-4) | 2e-2 (measured 4.9e-3) | 3e-2 |

mod backends;
mod dflash_support;

use backends::TestDevice;
use dflash_support::{Dims, Weights, finite_differences, random_batch, reference, uniform};
use draftpipe_compiler::plan::{
    AdamWSpec, BucketPlan, DFLASH_RMS_NORM_EPS, DflashSpec, LossSpec, LrSchedule, ModelPlan,
    Precision,
};
use draftpipe_runtime::batch::HsBatch;
use draftpipe_runtime::model::dflash::{BlockGeometry, BlockPlan, PlanInput};
use draftpipe_runtime::params::FlatState;
use rand::SeedableRng;
use rand::rngs::Xoshiro256PlusPlus;

const SPEC: fn() -> DflashSpec = || DflashSpec {
    hidden: 8,
    taps: 2,
    tap_layers: vec![1, 2],
    vocab: 24,
    layers: 2,
    heads: 4,
    kv_heads: 2,
    head_dim: 4,
    intermediate: 12,
    block: 3,
    anchors: 3,
    mask_token: 23,
    rope_theta: 10000.0,
    rms_norm_eps: DFLASH_RMS_NORM_EPS,
};

fn bucket(padded_len: usize, sequences: usize) -> BucketPlan {
    BucketPlan {
        padded_len,
        sequences,
        tokens: padded_len * sequences,
        step_flops: 0,
        step_bytes: 0,
    }
}

fn adamw(lr: f32) -> AdamWSpec {
    AdamWSpec {
        lr,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
        clip_grad_norm: None,
        schedule: LrSchedule::CONSTANT,
    }
}

fn loss(position_decay: f32, chunk_tokens: usize) -> LossSpec {
    LossSpec {
        head_decay: 1.0,
        position_decay: Some(position_decay),
        step_decay: None,
        chunk_tokens,
    }
}

fn dims(spec: &DflashSpec, position_decay: f64) -> Dims {
    Dims {
        hidden: spec.hidden,
        taps: spec.taps,
        vocab: spec.vocab,
        layers: spec.layers,
        heads: spec.heads,
        kv_heads: spec.kv_heads,
        head_dim: spec.head_dim,
        intermediate: spec.intermediate,
        block: spec.block,
        mask_token: spec.mask_token,
        rope_theta: f64::from(spec.rope_theta),
        position_decay,
    }
}

/// The present anchors of each sequence the drafter draws for `batch` at `step` of a run seeded `seed`.
fn anchors_of(spec: &DflashSpec, batch: &HsBatch, seed: u64, step: u64) -> Vec<Vec<usize>> {
    let geometry = BlockGeometry {
        block: spec.block,
        anchors: spec.block_slots(batch.padded_len),
        mask_token: spec.mask_token,
        position_decay: 0.0,
    };
    let mut plan = BlockPlan::default();
    let input = PlanInput {
        padded_len: batch.padded_len,
        input_ids: &batch.input_ids,
        loss_mask: &batch.loss_mask,
        seq_lens: &batch.seq_lens,
    };
    plan.build(&geometry, input, seed, step);
    (0..batch.sequences)
        .map(|seq| {
            let a = geometry.anchors;
            plan.anchors[seq * a..seq * a + plan.present[seq] as usize]
                .iter()
                .map(|&x| x as usize)
                .collect()
        })
        .collect()
}

fn to_f64(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| f64::from(v)).collect()
}

/// One step's loss, gradients and slot accuracy against the f64 reference and its finite differences, at f32.
fn gradients_match_the_f64_reference<D: TestDevice>(device: &D) {
    let grad_tol = if D::NAME == "cpu" { 1e-5 } else { 1e-3 };
    check_against_reference(device, Precision::F32, 1e-5, grad_tol);
}
test_device!(gradients_match_the_f64_reference);

/// The same with the matrix products' operands rounded to bf16 (emulated on the CPU), at the tolerance the
/// module docs state.
fn bf16_gradients_stay_close_to_the_f64_reference<D: TestDevice>(device: &D) {
    let grad_tol = if D::NAME == "cpu" { 2e-2 } else { 3e-2 };
    check_against_reference(device, Precision::Bf16, 2e-3, grad_tol);
}
test_device!(bf16_gradients_stay_close_to_the_f64_reference);

fn check_against_reference<D: TestDevice>(
    device: &D,
    precision: Precision,
    loss_tol: f64,
    grad_tol: f64,
) {
    let spec = SPEC();
    let model = ModelPlan::new(spec.clone());
    let gamma = 2.0f32;
    let (padded_len, sequences, seed) = (9, 2, 11);
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(3);
    let din = spec.taps * spec.hidden;
    let batch = random_batch(&mut rng, padded_len, sequences, din, spec.vocab);
    let frozen = spec.vocab * spec.hidden;
    let embed: Vec<f32> = uniform(&mut rng, frozen, 1.0)
        .iter()
        .map(|&x| x as f32)
        .collect();
    let lm: Vec<f32> = uniform(&mut rng, frozen, 1.0)
        .iter()
        .map(|&x| x as f32)
        .collect();
    let mut init = FlatState::init(&model, 5);
    // Norm weights away from 1 and projections a little larger than PyTorch's bound, so every tensor matters.
    for view in &model.layout {
        let noise = uniform(&mut rng, view.len(), 0.3);
        for (p, n) in init.params[view.range()].iter_mut().zip(noise) {
            *p = if view.shape.len() == 1 {
                1.0 + n as f32
            } else {
                *p * 1.5
            };
        }
    }
    // Chunks of 4 rows: the loss spans several logits chunks.
    let settings = (loss(gamma, 4), adamw(1e-3), precision);
    let mut drafter = device.drafter(&model, settings, &[bucket(padded_len, sequences)]);
    drafter.upload_frozen(&embed, &lm).expect("frozen");
    drafter.upload_state(&init).expect("upload");
    drafter.seed_sampler(seed, 0);
    // Evaluation first: forward and loss only, the parameters untouched.
    let evaluation = drafter.evaluate(&batch).expect("evaluate");
    let mut untouched = init.clone();
    drafter.download_state(&mut untouched).expect("download");
    assert_eq!(untouched.params, init.params, "evaluate trains nothing");
    drafter.stage(&batch).expect("stage");
    let mut outcomes: Vec<_> = drafter.step().expect("step").into_iter().collect();
    outcomes.extend(drafter.finish().expect("finish"));
    let outcome = outcomes.pop().expect("one outcome");
    let mut after = init.clone();
    after.grads.fill(f32::NAN);
    drafter.download_state(&mut after).expect("download");

    let anchors = anchors_of(&spec, &batch, seed, 0);
    assert!(
        anchors.iter().all(|a| !a.is_empty()),
        "every sequence trains"
    );
    let d = dims(&spec, f64::from(gamma));
    let (embed64, lm64) = (to_f64(&embed), to_f64(&lm));
    let layout = || {
        model
            .layout
            .iter()
            .map(|v| (v.name.clone(), v.offset, v.len()))
    };
    let loss_at = |params: &[f64]| {
        reference(
            &d,
            &Weights::new(layout(), params, &embed64, &lm64),
            &batch,
            &anchors,
        )
    };
    let params = to_f64(&init.params);
    let expected = loss_at(&params);
    let got = f64::from(outcome.loss);
    assert!(
        (got - expected.loss).abs() <= loss_tol * expected.loss.abs().max(1.0),
        "{}: loss {got} vs reference {}",
        D::NAME,
        expected.loss
    );
    assert_eq!(
        evaluation.loss, outcome.loss,
        "evaluate computes the step's loss"
    );
    assert_eq!(evaluation.blocks, outcome.blocks, "and its metrics");
    // Per-slot accuracy against the reference's argmax counts (at f32: rounding could flip a near tie).
    let blocks = outcome.blocks.expect("dflash metrics");
    let exact_argmax = precision == Precision::F32;
    for (k, acc) in blocks
        .slot_accuracy
        .iter()
        .enumerate()
        .filter(|_| exact_argmax)
    {
        let slot = k + 1;
        let want = f64::from(expected.slot_correct[slot]) / f64::from(expected.slot_labels[slot]);
        assert!(
            (f64::from(*acc) - want).abs() < 1e-6,
            "slot {slot}: {acc} vs {want}"
        );
    }
    // Every element of every trained tensor (1,536 here), against central differences of the f64 loss.
    let mut tensors = Vec::new();
    for view in &model.layout {
        let at: Vec<usize> = view.range().collect();
        let fd = finite_differences(&params, &at, 1e-5, |p| loss_at(p).loss);
        let analytic: Vec<f64> = at.iter().map(|&i| f64::from(after.grads[i])).collect();
        tensors.push((view.name.clone(), fd, analytic));
    }
    let norm = |x: &[f64]| x.iter().map(|v| v * v).sum::<f64>().sqrt();
    let largest = tensors
        .iter()
        .map(|(_, fd, _)| norm(fd))
        .fold(0.0, f64::max);
    assert!(largest > 1e-3, "the gradient is not trivial");
    let mut worst = 0.0f64;
    for (name, fd, analytic) in &tensors {
        let diff: Vec<f64> = fd.iter().zip(analytic).map(|(a, b)| a - b).collect();
        let err = norm(&diff);
        worst = worst.max(err / (largest + norm(fd)));
        assert!(
            err <= grad_tol * (largest + norm(fd)),
            "{}: {name}: |analytic − fd| = {err:.3e} (fd {fd:?}, analytic {analytic:?})",
            D::NAME
        );
    }
    println!(
        "{} {}: loss {got} vs {}, worst gradient error {worst:.2e} of (largest + own norm)",
        D::NAME,
        precision.name(),
        expected.loss
    );
}

/// A learnable task: every sequence counts up by one from a random start, so the token at `a + k` is the
/// anchor's plus `k` (mod the vocabulary less the mask token); hidden states carry the token's one-hot.
fn counting_batch(rng: &mut Xoshiro256PlusPlus, spec: &DflashSpec, padded_len: usize) -> HsBatch {
    use rand::RngExt;
    let sequences = 4;
    let din = spec.taps * spec.hidden;
    let ring = spec.vocab as u32 - 1;
    let mut batch = HsBatch::zeroed(padded_len, sequences, din);
    for seq in 0..sequences {
        let start = rng.random_range(0..ring);
        batch.seq_lens[seq] = padded_len as u32;
        for p in 0..padded_len {
            let row = seq * padded_len + p;
            let id = (start + p as u32) % ring;
            batch.input_ids[row] = id;
            batch.loss_mask[row] = 1;
            batch.hs.as_f32_mut().expect("an f32 batch")[row * din + id as usize % din] = 1.0;
        }
    }
    batch
}

/// Loss falls and τ rises on the counting task within 60 steps.
fn loss_and_tau_improve<D: TestDevice>(device: &D) {
    let spec = DflashSpec {
        hidden: 32,
        vocab: 16,
        mask_token: 15,
        head_dim: 8,
        intermediate: 48,
        block: 4,
        anchors: 6,
        ..SPEC()
    };
    let model = ModelPlan::new(spec.clone());
    let padded_len = 12;
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(9);
    let frozen = spec.vocab * spec.hidden;
    let embed: Vec<f32> = uniform(&mut rng, frozen, 1.0)
        .iter()
        .map(|&x| x as f32)
        .collect();
    let lm: Vec<f32> = uniform(&mut rng, frozen, 1.0)
        .iter()
        .map(|&x| x as f32)
        .collect();
    let settings = (loss(4.0, 64), adamw(1e-2), Precision::F32);
    let mut drafter = device.drafter(&model, settings, &[bucket(padded_len, 4)]);
    drafter.upload_frozen(&embed, &lm).expect("frozen");
    drafter
        .upload_state(&FlatState::init(&model, 1))
        .expect("upload");
    let mut outcomes = Vec::new();
    for _ in 0..60 {
        drafter
            .stage(&counting_batch(&mut rng, &spec, padded_len))
            .expect("stage");
        outcomes.extend(drafter.step().expect("step"));
    }
    outcomes.extend(drafter.finish().expect("finish"));
    assert_eq!(outcomes.len(), 60);
    let mean = |xs: &[f32]| xs.iter().sum::<f32>() / xs.len() as f32;
    let losses: Vec<f32> = outcomes.iter().map(|o| o.loss).collect();
    let taus: Vec<f32> = outcomes
        .iter()
        .map(|o| o.blocks.as_ref().expect("dflash metrics").tau_simulated)
        .collect();
    let (loss_first, loss_last) = (mean(&losses[..5]), mean(&losses[55..]));
    let (tau_first, tau_last) = (mean(&taus[..5]), mean(&taus[55..]));
    println!(
        "{}: loss {loss_first:.3} → {loss_last:.3}, τ {tau_first:.3} → {tau_last:.3}",
        D::NAME
    );
    assert!(loss_last < 0.5 * loss_first, "loss did not fall");
    assert!(tau_last > tau_first + 0.5, "τ did not rise");
}
test_device!(loss_and_tau_improve);

/// A resumed drafter (a new one seeded with the run's seed and the step reached, loading the state) draws the
/// same anchors and ends bit-identical to the uninterrupted run.
fn a_resume_draws_the_same_anchors<D: TestDevice>(device: &D) {
    let spec = SPEC();
    let model = ModelPlan::new(spec.clone());
    let (padded_len, sequences, seed) = (16, 2, 21);
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(4);
    let din = spec.taps * spec.hidden;
    // Long sequences with more valid anchors than block slots, so every step draws.
    let batches: Vec<HsBatch> = (0..4)
        .map(|_| random_batch(&mut rng, padded_len, sequences, din, spec.vocab))
        .collect();
    let frozen = spec.vocab * spec.hidden;
    let embed: Vec<f32> = uniform(&mut rng, frozen, 1.0)
        .iter()
        .map(|&x| x as f32)
        .collect();
    let lm: Vec<f32> = uniform(&mut rng, frozen, 1.0)
        .iter()
        .map(|&x| x as f32)
        .collect();
    let settings = (loss(2.0, 8), adamw(1e-2), Precision::F32);
    let buckets = [bucket(padded_len, sequences)];
    let run = |state: &FlatState, first_step: u64, batches: &[HsBatch]| {
        let mut drafter = device.drafter(&model, settings, &buckets);
        drafter.upload_frozen(&embed, &lm).expect("frozen");
        drafter.upload_state(state).expect("upload");
        drafter.seed_sampler(seed, first_step);
        for batch in batches {
            drafter.stage(batch).expect("stage");
            drafter.step().expect("step");
        }
        drafter.finish().expect("finish");
        let mut out = state.clone();
        drafter.download_state(&mut out).expect("download");
        out
    };
    let init = FlatState::init(&model, 2);
    let straight = run(&init, 0, &batches);
    let halfway = run(&init, 0, &batches[..2]);
    let resumed = run(&halfway, 2, &batches[2..]);
    assert_eq!(resumed.step, 4);
    assert_eq!(resumed.params, straight.params, "resume is exact");
    // And the draw matters: seeding the second half as if it were the first changes the result.
    let misaligned = run(&halfway, 0, &batches[2..]);
    assert_ne!(misaligned.params, straight.params);
}
test_device!(a_resume_draws_the_same_anchors);

/// The CPU drafter's kernel launches split over its threads (`HostThreads`) when the step runs inside them: the
/// split must change nothing, so 5 steps on 3 threads end bit-identical to 5 on the calling thread (losses,
/// metrics, and every parameter and moment).
#[test]
fn a_step_split_over_the_drafters_threads_equals_one_on_a_single_thread() {
    use backends::Cpu;
    use draftpipe_runtime::backend::cpu::HostThreads;

    let spec = DflashSpec {
        hidden: 32,
        vocab: 40,
        mask_token: 39,
        head_dim: 16,
        intermediate: 48,
        block: 4,
        anchors: 12,
        ..SPEC()
    };
    let model = ModelPlan::new(spec.clone());
    let padded_len = 40;
    let seed = {
        use rand::RngExt;
        rand::rng().random::<u64>()
    };
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let frozen = spec.vocab * spec.hidden;
    let tables: Vec<Vec<f32>> = (0..2)
        .map(|_| {
            uniform(&mut rng, frozen, 1.0)
                .iter()
                .map(|&x| x as f32)
                .collect()
        })
        .collect();
    let batches: Vec<HsBatch> = (0..5)
        .map(|_| counting_batch(&mut rng, &spec, padded_len))
        .collect();
    let train = || {
        let settings = (loss(4.0, 64), adamw(1e-2), Precision::F32);
        let mut drafter = Cpu.drafter(&model, settings, &[bucket(padded_len, 4)]);
        drafter
            .upload_frozen(&tables[0], &tables[1])
            .expect("frozen");
        drafter
            .upload_state(&FlatState::init(&model, 3))
            .expect("upload");
        let mut outcomes = Vec::new();
        for batch in &batches {
            drafter.stage(batch).expect("stage");
            outcomes.extend(drafter.step().expect("step"));
        }
        outcomes.extend(drafter.finish().expect("finish"));
        let mut state = FlatState::init(&model, 0);
        drafter.download_state(&mut state).expect("download");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let trace: Vec<_> = outcomes
            .iter()
            .map(|o| (o.loss.to_bits(), format!("{:?}", o.blocks)))
            .collect();
        (
            trace,
            bits(&state.params),
            bits(&state.exp_avg),
            bits(&state.exp_avg_sq),
        )
    };
    let single = train();
    let threads = HostThreads::new("test", 3).expect("threads");
    assert_eq!(threads.threads(), 3);
    let split = threads.run(train);
    assert_eq!(single.0.len(), 5);
    assert!(
        single == split,
        "seed {seed}: the step split over 3 threads differs from the single-threaded step"
    );
}
