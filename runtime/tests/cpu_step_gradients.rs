//! The whole CPU step against an independent f64 reference: the loss value, every parameter's gradient against
//! central finite differences of the f64 loss, valid-label counts, determinism, and typed errors on bad input.

mod cpu_step_support;

use cpu_step_support::*;
use draftpipe_compiler::plan::MlpSpec;
use draftpipe_runtime::cpu::{CpuDrafter, StepError};
use draftpipe_runtime::params::FlatState;
use rand::SeedableRng;
use rand::rngs::Xoshiro256PlusPlus;

const SPEC: MlpSpec = MlpSpec {
    din: 6,
    hidden: 4,
    blocks: 2,
    intermediate: 5,
    heads: 3,
    vocab: 7,
};
const DECAY: f32 = 0.8;

#[test]
fn every_gradient_matches_finite_differences_of_the_f64_reference() {
    let model = model(SPEC);
    for seed in 0..3u64 {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(100 + seed);
        let batch = random_batch(&mut rng, 6, 3, SPEC.din, SPEC.vocab);
        let mut state = FlatState::init(&model, seed);
        // Norm weights away from 1 so their gradients are exercised off the identity.
        for (k, p) in state.params.iter_mut().enumerate() {
            *p *= 1.0 + 0.3 * ((k % 7) as f32 / 7.0);
        }
        // Chunks of 4 tokens over 18 tokens: the last chunk is partial.
        let mut drafter = CpuDrafter::new(&model, loss(DECAY, 4), adamw(1e-3), &[bucket(6, 3)]);
        state.grads.fill(f32::NAN);
        let out = drafter
            .forward_backward(&mut state, &batch)
            .expect("valid batch");

        let params64: Vec<f64> = state.params.iter().map(|&p| p as f64).collect();
        let reference = reference_loss(&SPEC, &params64, &batch, DECAY as f64);
        assert!(
            ((out.loss as f64 - reference) / reference).abs() < 2e-6,
            "loss {} vs f64 {reference}",
            out.loss
        );

        let mut worst = 0.0f64;
        let mut scale = 0.0f64;
        let step = 1e-5;
        for k in 0..params64.len() {
            let mut shifted = params64.clone();
            shifted[k] += step;
            let up = reference_loss(&SPEC, &shifted, &batch, DECAY as f64);
            shifted[k] -= 2.0 * step;
            let down = reference_loss(&SPEC, &shifted, &batch, DECAY as f64);
            let fd = (up - down) / (2.0 * step);
            worst = worst.max((state.grads[k] as f64 - fd).abs());
            scale = scale.max(fd.abs());
        }
        // Stated bound: every f32 gradient within 1e-4 of the largest gradient of its f64 finite difference.
        assert!(
            worst / scale < 1e-4,
            "seed {seed}: worst gradient error {worst} at scale {scale}"
        );
    }
}

#[test]
fn counts_match_the_label_definition_and_steps_are_deterministic() {
    let model = model(SPEC);
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(9);
    let batch = random_batch(&mut rng, 8, 2, SPEC.din, SPEC.vocab);
    let mut drafter = CpuDrafter::new(
        &model,
        loss(DECAY, 3),
        adamw(1e-3),
        &[bucket(4, 4), bucket(8, 2)],
    );
    let mut state = FlatState::init(&model, 1);
    let first = drafter.forward_backward(&mut state, &batch).unwrap();
    let valid_labels = drafter.valid_labels().to_vec();
    let grads = state.grads.clone();
    let second = drafter.forward_backward(&mut state, &batch).unwrap();
    assert_eq!(first.loss.to_bits(), second.loss.to_bits());
    assert_eq!(
        grads, state.grads,
        "same batch and parameters must give bitwise-equal gradients"
    );
    assert_eq!(valid_labels.len(), SPEC.heads);
    for (j, &count) in valid_labels.iter().enumerate() {
        let expected = (0..batch.tokens())
            .filter(|&t| reference_label(&batch, j, t).is_some())
            .count();
        assert_eq!(count as usize, expected, "head {j}");
    }
}

#[test]
fn bad_batches_are_typed_errors() {
    let model = model(SPEC);
    let mut drafter = CpuDrafter::new(&model, loss(DECAY, 4), adamw(1e-3), &[bucket(6, 3)]);
    let mut state = FlatState::init(&model, 0);
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(3);
    let good = random_batch(&mut rng, 6, 3, SPEC.din, SPEC.vocab);

    let other_shape = random_batch(&mut rng, 5, 3, SPEC.din, SPEC.vocab);
    assert_eq!(
        drafter.forward_backward(&mut state, &other_shape),
        Err(StepError::NoBucket {
            padded_len: 5,
            sequences: 3
        })
    );
    let wrong_din = random_batch(&mut rng, 6, 3, SPEC.din + 1, SPEC.vocab);
    assert_eq!(
        drafter.forward_backward(&mut state, &wrong_din),
        Err(StepError::WrongDin {
            expected: 6,
            got: 7
        })
    );

    let mut bad_id = good.clone();
    bad_id.input_ids[0] = SPEC.vocab as u32;
    assert!(matches!(
        drafter.forward_backward(&mut state, &bad_id),
        Err(StepError::TokenOutOfRange { .. })
    ));

    let mut too_long = good.clone();
    too_long.seq_lens[1] = 7;
    assert!(matches!(
        drafter.forward_backward(&mut state, &too_long),
        Err(StepError::SequenceTooLong { .. })
    ));

    let mut short_hs = good.clone();
    short_hs.hs.pop();
    assert!(matches!(
        drafter.forward_backward(&mut state, &short_hs),
        Err(StepError::BatchBuffer { buffer: "hs", .. })
    ));

    let mut small_state = state.clone();
    small_state.params.pop();
    assert!(matches!(
        drafter.forward_backward(&mut small_state, &good),
        Err(StepError::StateSize { .. })
    ));

    assert!(drafter.forward_backward(&mut state, &good).is_ok());

    let mut empty_drafter = CpuDrafter::new(&model, loss(DECAY, 4), adamw(1e-3), &[bucket(0, 3)]);
    let empty = draftpipe_runtime::batch::HsBatch::zeroed(0, 3, SPEC.din);
    assert_eq!(
        empty_drafter.forward_backward(&mut state, &empty),
        Err(StepError::EmptyBatch)
    );

    let no_vocab = MlpSpec { vocab: 0, ..SPEC };
    let mut bad_model = CpuDrafter::new(
        &cpu_step_support::model(no_vocab),
        loss(DECAY, 4),
        adamw(1e-3),
        &[bucket(6, 3)],
    );
    let mut bad_state = FlatState::init(&cpu_step_support::model(no_vocab), 0);
    let batch = random_batch(&mut rng, 6, 3, SPEC.din, 1);
    assert_eq!(
        bad_model.forward_backward(&mut bad_state, &batch),
        Err(StepError::Layout)
    );
}
