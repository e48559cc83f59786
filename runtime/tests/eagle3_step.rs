//! The `eagle3` step on every backend present, through `test_device!`: the loss at the initial weights, the
//! per-step accuracy and the gradient of every element of every trained tensor against the independent f64
//! reference (`eagle3_support`) and its central finite differences; evaluation (forward only) agreeing with the
//! step and training nothing; the loss falling and τ rising on a learnable task; and the trained tensors' names.
//!
//! Tolerances (the step against the f64 reference; gradients `err ≤ tol · (largest + own)`, with `largest` the
//! largest gradient norm over all tensors and `own` the tensor's): loss 1e-4 relative; gradients 1e-4 on the
//! CPU, 1e-3 on CUDA (its `ex2.approx`).

mod backends;
mod eagle3_support;

use backends::TestDevice;
use draftpipe_compiler::plan::{
    AdamWSpec, BucketPlan, Eagle3Spec, LossSpec, LrSchedule, ModelPlan, Precision,
};
use draftpipe_runtime::batch::HsBatch;
use draftpipe_runtime::params::FlatState;
use eagle3_support::{
    Dims, VocabMap, Weights, finite_differences, random_batch, reference, uniform,
};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

const SPEC: fn() -> Eagle3Spec = || Eagle3Spec {
    hidden: 8,
    taps: 3,
    tap_layers: vec![1, 2, 3],
    vocab: 16,
    draft_vocab: 10,
    heads: 2,
    kv_heads: 1,
    head_dim: 4,
    intermediate: 12,
    ttt: 3,
    rope_theta: 10000.0,
    rms_norm_eps: 1e-6,
};

const STEP_DECAY: f32 = 0.8;

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
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.0,
        clip_grad_norm: None,
        schedule: LrSchedule::CONSTANT,
    }
}

fn loss(chunk_tokens: usize) -> LossSpec {
    LossSpec {
        head_decay: 1.0,
        position_decay: None,
        step_decay: Some(STEP_DECAY),
        chunk_tokens,
    }
}

fn dims(spec: &Eagle3Spec) -> Dims {
    Dims {
        hidden: spec.hidden,
        vocab: spec.vocab,
        draft_vocab: spec.draft_vocab,
        heads: spec.heads,
        kv_heads: spec.kv_heads,
        head_dim: spec.head_dim,
        ttt: spec.ttt,
        rope_theta: f64::from(spec.rope_theta),
        eps: f64::from(spec.rms_norm_eps),
        step_decay: f64::from(STEP_DECAY),
    }
}

fn to_f64(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| f64::from(v)).collect()
}

fn to_f32(x: &[f64]) -> Vec<f32> {
    x.iter().map(|&v| v as f32).collect()
}

/// Every target token but a few (so the teacher's "argmax in the draft vocabulary" flag drops some rows).
fn vocab_map(spec: &Eagle3Spec) -> VocabMap {
    let tokens: Vec<usize> = (0..spec.vocab).step_by(2).chain([1, 3]).collect();
    let mut tokens: Vec<usize> = tokens.into_iter().take(spec.draft_vocab).collect();
    tokens.sort_unstable();
    VocabMap::of(&tokens, spec.vocab)
}

fn gradients_match_the_f64_reference<D: TestDevice>(device: &D) {
    let grad_tol = if D::NAME == "cpu" { 1e-4 } else { 1e-3 };
    let spec = SPEC();
    let model = ModelPlan::new(spec.clone());
    let (padded_len, sequences) = (6, 2);
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(7);
    let batch = random_batch(&mut rng, (padded_len, sequences), spec.hidden, spec.vocab);
    let frozen = spec.vocab * spec.hidden;
    let embed = to_f32(&uniform(&mut rng, frozen, 1.0));
    let target_head = to_f32(&uniform(&mut rng, frozen, 1.0));
    let map = vocab_map(&spec);
    let mut init = FlatState::init(&model, 5);
    // Norm weights away from 1 and projections a little larger than PyTorch's bound, so every tensor matters.
    for view in &model.layout {
        let noise = uniform(&mut rng, view.len(), 0.3);
        for (p, n) in init.params[view.range()].iter_mut().zip(noise) {
            *p = if view.shape.len() == 1 {
                1.0 + n as f32
            } else {
                *p * 2.0
            };
        }
    }
    // Chunks of 5 rows: each step's loss spans several logits chunks, one of them partial.
    let settings = (loss(5), adamw(1e-3), Precision::F32);
    let mut drafter = device.drafter(&model, settings, &[bucket(padded_len, sequences)]);
    drafter.upload_frozen(&embed, &target_head).expect("frozen");
    drafter
        .upload_vocab_map(&map.d2t, &map.t2d)
        .expect("vocab map");
    drafter.upload_state(&init).expect("upload");
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

    let d = dims(&spec);
    let (embed64, head64) = (to_f64(&embed), to_f64(&target_head));
    let layout = || {
        model
            .layout
            .iter()
            .map(|v| (v.name.clone(), v.offset, v.len()))
    };
    let loss_at = |params: &[f64]| {
        reference(
            &d,
            &Weights::new(layout(), params, &embed64, &head64),
            &map,
            &batch,
        )
    };
    let params = to_f64(&init.params);
    let expected = loss_at(&params);
    let got = f64::from(outcome.loss);
    assert!(
        (got - expected.loss).abs() <= 1e-4 * expected.loss.abs().max(1.0),
        "{}: loss {got} vs reference {}",
        D::NAME,
        expected.loss
    );
    assert!(
        expected.correct.iter().sum::<u32>() > 0 && expected.supervised.iter().all(|&n| n > 0),
        "the batch exercises the metrics: {expected:?}"
    );
    assert_eq!(
        evaluation.loss, outcome.loss,
        "evaluate computes the step's loss"
    );
    let metrics = outcome.blocks.expect("eagle3 metrics");
    assert_eq!(
        evaluation.blocks.as_ref(),
        Some(&metrics),
        "and its metrics"
    );
    for (k, acc) in metrics.slot_accuracy.iter().enumerate() {
        let want = f64::from(expected.correct[k]) / f64::from(expected.supervised[k]);
        assert!(
            (f64::from(*acc) - want).abs() < 1e-6,
            "{}: step {k} accuracy {acc} vs {want}",
            D::NAME
        );
    }
    // Every element of every trained tensor, against central differences of the f64 loss.
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
        assert!(norm(fd) > 0.0, "{name} matters to the loss");
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
        "{}: loss {got} vs {}, worst gradient error {worst:.2e} of (largest + own norm)",
        D::NAME,
        expected.loss
    );
}
test_device!(gradients_match_the_f64_reference);

/// A learnable task: each sequence counts up by one from a random start, the target's final hidden state of a
/// token is a fixed random vector of it (so the teacher at `t + 1` is a function of the id the draft embeds
/// there), and the tapped hidden states carry the current token's one-hot.
fn counting_batch(
    rng: &mut Xoshiro256PlusPlus,
    spec: &Eagle3Spec,
    (padded_len, sequences): (usize, usize),
    table: &[f32],
) -> HsBatch {
    let h = spec.hidden;
    let mut batch = HsBatch::zeroed(padded_len, sequences, 3 * h).with_last_hidden_states(h);
    for seq in 0..sequences {
        batch.seq_lens[seq] = padded_len as u32;
        let start = rng.random_range(0..spec.vocab);
        for p in 0..padded_len {
            let row = seq * padded_len + p;
            let id = (start + p) % spec.vocab;
            batch.input_ids[row] = id as u32;
            batch.loss_mask[row] = u8::from(p > 0);
            let mut hs = vec![0.0f32; 3 * h];
            hs[id % (3 * h)] = 1.0;
            batch.hs.store_f32(row * 3 * h, &hs);
            batch
                .last_hidden_states
                .as_mut()
                .expect("last hidden states")
                .store_f32(row * h, &table[id * h..(id + 1) * h]);
        }
    }
    batch
}

fn loss_falls_and_tau_rises<D: TestDevice>(device: &D) {
    let spec = SPEC();
    let model = ModelPlan::new(spec.clone());
    let shape = (8, 4);
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(11);
    let frozen = spec.vocab * spec.hidden;
    let embed = to_f32(&uniform(&mut rng, frozen, 1.0));
    let target_head = to_f32(&uniform(&mut rng, frozen, 2.0));
    let table = to_f32(&uniform(&mut rng, frozen, 1.0));
    let map = vocab_map(&spec);
    let mut drafter = device.drafter(
        &model,
        (loss(16), adamw(1e-2), Precision::F32),
        &[bucket(shape.0, shape.1)],
    );
    drafter.upload_frozen(&embed, &target_head).expect("frozen");
    drafter
        .upload_vocab_map(&map.d2t, &map.t2d)
        .expect("vocab map");
    drafter
        .upload_state(&FlatState::init(&model, 3))
        .expect("upload");
    let mut outcomes = Vec::new();
    for _ in 0..60 {
        let batch = counting_batch(&mut rng, &spec, shape, &table);
        drafter.stage(&batch).expect("stage");
        outcomes.extend(drafter.step().expect("step"));
    }
    outcomes.extend(drafter.finish().expect("finish"));
    let mean = |o: &[draftpipe_runtime::drafter::StepOutcome]| {
        let loss = o.iter().map(|o| f64::from(o.loss)).sum::<f64>() / o.len() as f64;
        let tau = o
            .iter()
            .map(|o| f64::from(o.blocks.as_ref().expect("metrics").tau_simulated))
            .sum::<f64>()
            / o.len() as f64;
        (loss, tau)
    };
    let (first_loss, first_tau) = mean(&outcomes[..5]);
    let (last_loss, last_tau) = mean(&outcomes[outcomes.len() - 5..]);
    println!(
        "{}: loss {first_loss:.4} → {last_loss:.4}, τ {first_tau:.3} → {last_tau:.3}",
        D::NAME
    );
    assert!(last_loss < 0.8 * first_loss, "{}: the loss falls", D::NAME);
    assert!(last_tau > first_tau + 0.2, "{}: τ rises", D::NAME);
}
test_device!(loss_falls_and_tau_rises);

#[test]
fn the_trained_tensors_have_sglangs_names() {
    let model = ModelPlan::new(SPEC());
    let names: Vec<&str> = model.layout.iter().map(|v| v.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "fc.weight",
            "midlayer.input_layernorm.weight",
            "midlayer.hidden_norm.weight",
            "midlayer.self_attn.q_proj.weight",
            "midlayer.self_attn.k_proj.weight",
            "midlayer.self_attn.v_proj.weight",
            "midlayer.self_attn.o_proj.weight",
            "midlayer.post_attention_layernorm.weight",
            "midlayer.mlp.gate_proj.weight",
            "midlayer.mlp.up_proj.weight",
            "midlayer.mlp.down_proj.weight",
            "norm.weight",
            "lm_head.weight",
        ]
    );
}

/// What `compile` reports is what a drafter allocates: the layout's buffers, the four flat state buffers and
/// the frozen tables, for f32 and bf16 batches (the bf16 slots hold `hs` and `last_hs` in 16 bits).
fn the_allocation_is_the_compiled_memory<D: TestDevice>(device: &D) {
    use draftpipe_compiler::plan::{BackendKind, HsDtype, WorkspaceLayout};
    let spec = SPEC();
    let model = ModelPlan::new(spec.clone());
    let buckets = [bucket(8, 2), bucket(16, 1)];
    let kind = if D::NAME == "cpu" {
        BackendKind::Cpu
    } else {
        BackendKind::Cuda
    };
    for hs in [HsDtype::F32, HsDtype::Bf16] {
        let precision = if hs == HsDtype::F32 {
            Precision::F32
        } else {
            Precision::Bf16
        };
        let settings = (loss(4), adamw(1e-3), precision);
        let drafter = device.drafter_for(&model, settings, &buckets, hs);
        let layout = WorkspaceLayout::of_model(&model.spec, &buckets, &settings.0, kind, precision)
            .and_then(|layout| layout.with_hs_dtype(kind, hs))
            .expect("layout");
        let expected =
            layout.bytes().unwrap() + 16 * model.parameters as u64 + spec.frozen_bytes().unwrap();
        assert_eq!(drafter.allocated_bytes(), expected, "{}: {hs:?}", D::NAME);
    }
}
test_device!(the_allocation_is_the_compiled_memory);

/// A bf16 batch (hidden states and last hidden states held in 16 bits through the slot, widened by the teacher's
/// shift and the `fc` product's tiles) trains as the f32 batch of the same values does.
fn a_bf16_batch_trains_as_its_f32_values<D: TestDevice>(device: &D) {
    use draftpipe_compiler::plan::HsDtype;
    let spec = SPEC();
    let model = ModelPlan::new(spec.clone());
    let shape = (6, 2);
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(5);
    let wide = random_batch(&mut rng, shape, spec.hidden, spec.vocab);
    let mut narrow = HsBatch::zeroed_in(HsDtype::Bf16, shape.0, shape.1, 3 * spec.hidden)
        .with_last_hidden_states(spec.hidden);
    narrow
        .hs
        .store_f32(0, &wide.hs.to_f32_vec(0..wide.hs.len()));
    let last = wide.last_hidden_states.as_ref().unwrap();
    narrow
        .last_hidden_states
        .as_mut()
        .unwrap()
        .store_f32(0, &last.to_f32_vec(0..last.len()));
    narrow.input_ids.clone_from(&wide.input_ids);
    narrow.seq_lens.clone_from(&wide.seq_lens);
    narrow.loss_mask.clone_from(&wide.loss_mask);
    // The f32 batch of exactly the bf16 values.
    let mut rounded = wide.clone();
    rounded
        .hs
        .store_f32(0, &narrow.hs.to_f32_vec(0..narrow.hs.len()));
    let nl = narrow.last_hidden_states.as_ref().unwrap();
    rounded
        .last_hidden_states
        .as_mut()
        .unwrap()
        .store_f32(0, &nl.to_f32_vec(0..nl.len()));
    let frozen = spec.vocab * spec.hidden;
    let embed = to_f32(&uniform(&mut rng, frozen, 1.0));
    let target_head = to_f32(&uniform(&mut rng, frozen, 1.0));
    let map = vocab_map(&spec);
    let init = FlatState::init(&model, 9);
    let run = |batch: &HsBatch, hs: HsDtype| {
        let settings = (loss(5), adamw(1e-3), Precision::F32);
        let mut drafter = device.drafter_for(&model, settings, &[bucket(shape.0, shape.1)], hs);
        drafter.upload_frozen(&embed, &target_head).expect("frozen");
        drafter.upload_vocab_map(&map.d2t, &map.t2d).expect("map");
        drafter.upload_state(&init).expect("upload");
        drafter.evaluate(batch).expect("evaluate").loss
    };
    let (got, want) = (run(&narrow, HsDtype::Bf16), run(&rounded, HsDtype::F32));
    assert!(
        (got - want).abs() <= 1e-6 * want.abs().max(1.0),
        "{}: bf16 {got} vs f32 {want}",
        D::NAME
    );
}
test_device!(a_bf16_batch_trains_as_its_f32_values);

/// A batch without the teacher's hidden states, and a drafter without a draft vocabulary, are refused with
/// errors that say what is missing (nothing trains on zeros).
fn missing_teacher_inputs_are_refused<D: TestDevice>(device: &D) {
    use draftpipe_runtime::drafter::{DrafterError, StepError};
    let spec = SPEC();
    let model = ModelPlan::new(spec.clone());
    let shape = (6, 2);
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(13);
    let batch = random_batch(&mut rng, shape, spec.hidden, spec.vocab);
    let settings = (loss(5), adamw(1e-3), Precision::F32);
    let mut drafter = device.drafter(&model, settings, &[bucket(shape.0, shape.1)]);
    let frozen = vec![0.5f32; spec.vocab * spec.hidden];
    drafter.upload_frozen(&frozen, &frozen).expect("frozen");
    let without = HsBatch {
        last_hidden_states: None,
        ..batch.clone()
    };
    match drafter.stage(&without) {
        Err(DrafterError::Batch(StepError::MissingLastHiddenStates { hidden })) => {
            assert_eq!(hidden, spec.hidden)
        }
        other => panic!("{}: {other:?}", D::NAME),
    }
    let refused = drafter.stage(&batch).expect_err("no draft vocabulary yet");
    assert!(refused.to_string().contains("vocab map"), "{refused}");
    let map = vocab_map(&spec);
    let mut bad = map.d2t.clone();
    bad[0] = -1;
    let refused = drafter
        .upload_vocab_map(&bad, &map.t2d)
        .expect_err("d2t out of range");
    assert!(refused.to_string().contains("d2t[0]"), "{refused}");
    drafter.upload_vocab_map(&map.d2t, &map.t2d).expect("map");
    drafter.stage(&batch).expect("stage");
}
test_device!(missing_teacher_inputs_are_refused);
