//! Fused AdamW (through `CpuDrafter::optimizer_step`) against an f64 reference written from PyTorch's documented
//! `torch.optim.AdamW` algorithm and `clip_grad_norm_`, over several steps with changing gradients, weight
//! decay and clipping; and the skip on a non-finite norm.
//!
//! Stated bound: after 8 steps every parameter is within `2e-6 · (1 + |p|)` of the reference, and every moment
//! within `1e-6` of the largest moment.

use draftpipe_compiler::plan::{AdamWSpec, LrSchedule, MlpSpec, ModelPlan};
use draftpipe_runtime::drafter::cpu::CpuDrafter;
use draftpipe_runtime::params::FlatState;
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

const SPEC: MlpSpec = MlpSpec {
    din: 16,
    hidden: 12,
    blocks: 2,
    intermediate: 20,
    heads: 2,
    vocab: 30,
};

/// PyTorch's AdamW, step by step as documented (single-tensor path), with `clip_grad_norm_` applied first.
struct ReferenceAdamW {
    params: Vec<f64>,
    m: Vec<f64>,
    v: Vec<f64>,
    step: i32,
}

impl ReferenceAdamW {
    fn step(&mut self, grads: &[f32], spec: &AdamWSpec) {
        let norm = grads
            .iter()
            .map(|&g| g as f64 * g as f64)
            .sum::<f64>()
            .sqrt();
        let clip = spec
            .clip_grad_norm
            .map_or(1.0, |max| (max as f64 / (norm + 1e-6)).min(1.0));
        self.step += 1;
        let (lr, b1, b2) = (spec.lr as f64, spec.beta1 as f64, spec.beta2 as f64);
        let bc1 = 1.0 - b1.powi(self.step);
        let bc2 = 1.0 - b2.powi(self.step);
        for (k, &grad) in grads.iter().enumerate() {
            let g = grad as f64 * clip;
            self.params[k] *= 1.0 - lr * spec.weight_decay as f64;
            self.m[k] = b1 * self.m[k] + (1.0 - b1) * g;
            self.v[k] = b2 * self.v[k] + (1.0 - b2) * g * g;
            let denom = self.v[k].sqrt() / bc2.sqrt() + spec.eps as f64;
            self.params[k] -= lr / bc1 * self.m[k] / denom;
        }
    }
}

fn setup(optimizer: AdamWSpec) -> (CpuDrafter, FlatState, ReferenceAdamW) {
    let model = ModelPlan::new(SPEC);
    let loss = draftpipe_compiler::plan::LossSpec {
        head_decay: 0.8,
        position_decay: None,
        step_decay: None,
        chunk_tokens: 8,
    };
    let drafter = CpuDrafter::new(&model, loss, optimizer, &[]);
    let state = FlatState::init(&model, 5);
    let n = state.params.len();
    let reference = ReferenceAdamW {
        params: state.params.iter().map(|&p| p as f64).collect(),
        m: vec![0.0; n],
        v: vec![0.0; n],
        step: 0,
    };
    (drafter, state, reference)
}

#[test]
fn adamw_matches_pytorch_algorithm_over_several_steps() {
    for (clip, weight_decay) in [(None, 0.0), (Some(0.5), 0.01), (Some(1e6), 0.1)] {
        let spec = AdamWSpec {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay,
            clip_grad_norm: clip,
            schedule: LrSchedule::CONSTANT,
        };
        let (mut drafter, mut state, mut reference) = setup(spec);
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(11);
        for step in 1..=8u64 {
            for g in &mut state.grads {
                *g = rng.random_range(-1.0f32..1.0) * if step % 3 == 0 { 10.0 } else { 0.1 };
            }
            let report = drafter.optimizer_step(&mut state);
            let norm = state
                .grads
                .iter()
                .map(|&g| g as f64 * g as f64)
                .sum::<f64>()
                .sqrt();
            reference.step(&state.grads, &spec);
            assert!(!report.skipped);
            assert_eq!(state.step, step);
            assert!(((report.grad_norm as f64 - norm) / norm).abs() < 1e-6);
            let clip_ref = clip.map_or(1.0, |max| (max as f64 / (norm + 1e-6)).min(1.0));
            assert!(
                ((report.clip_scale as f64 - clip_ref) / clip_ref).abs() < 1e-6,
                "{clip:?}"
            );
        }
        for k in 0..state.params.len() {
            let (p, r) = (state.params[k] as f64, reference.params[k]);
            assert!(
                (p - r).abs() < 2e-6 * (1.0 + r.abs()),
                "{clip:?} param {k}: {p} vs {r}"
            );
        }
        // Moments sum gradients of both signs, so compare them normwise (element error over the largest moment).
        for (ours, theirs, name) in [
            (&state.exp_avg, &reference.m, "exp_avg"),
            (&state.exp_avg_sq, &reference.v, "exp_avg_sq"),
        ] {
            let scale = theirs.iter().fold(0.0f64, |m, v| m.max(v.abs()));
            let worst = ours
                .iter()
                .zip(theirs)
                .map(|(&a, b)| (a as f64 - b).abs())
                .fold(0.0, f64::max);
            assert!(
                worst < 1e-6 * scale,
                "{clip:?} {name}: worst {worst} at scale {scale}"
            );
        }
    }
}

#[test]
fn non_finite_gradients_skip_the_step_without_touching_state() {
    let spec = AdamWSpec {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.99,
        eps: 1e-8,
        weight_decay: 0.1,
        clip_grad_norm: Some(1.0),
        schedule: LrSchedule::CONSTANT,
    };
    let (mut drafter, mut state, _) = setup(spec);
    state.grads.fill(0.01);
    assert!(!drafter.optimizer_step(&mut state).skipped);
    let before = state.clone();
    for bad in [f32::NAN, f32::INFINITY] {
        state.grads[3] = bad;
        let report = drafter.optimizer_step(&mut state);
        assert!(report.skipped && !report.grad_norm.is_finite());
        assert_eq!(state.step, 1);
        assert_eq!(state.params, before.params);
        assert_eq!(state.exp_avg, before.exp_avg);
        assert_eq!(state.exp_avg_sq, before.exp_avg_sq);
    }
}
