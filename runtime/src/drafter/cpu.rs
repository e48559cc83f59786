//! The CPU drafter: the backend-generic `mlp` step ([`crate::model::mlp`]) on the [`CpuBackend`], driven one
//! phase at a time on a host [`FlatState`] (tests, benchmarks and tools that inspect gradients between the
//! backward pass and the update).
//!
//! ```text
//!  HsBatch ──▶ CpuDrafter::forward_backward ──▶ state.grads ──(caller: all-reduce)──▶ CpuDrafter::optimizer_step
//!              forward │ fused loss │ backward                                         grad norm → clip → AdamW
//! ```
//!
//! Matrix products go through the `gemm` crate; every other operation is a kernel body of
//! `draftpipe-gpu-kernels`, the same source the CUDA backend compiles to PTX
//! ([`kernels`](crate::backend::cpu::kernels)). The state's four
//! vectors are swapped into the backend's buffers for the call and back out (no copy), so the step stays free of
//! allocation in steady state.

use std::any::Any;
use std::time::{Duration, Instant};

use draftpipe_compiler::plan::{AdamWSpec, BucketPlan, LossSpec, ModelPlan, Precision};

use super::{Drafter, DrafterError, StepError};
use crate::backend::cpu::CpuBackend;
use crate::backend::{Backend, StepPart};
use crate::batch::HsBatch;
use crate::model::mlp::Mlp;
use crate::model::step::{PhaseTimes, StepShape};
use crate::params::FlatState;

/// What one forward/backward pass reports (the per-head label counts stay in the drafter:
/// [`CpuDrafter::valid_labels`], so that a step returns nothing that allocates).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepOutput {
    /// `Σ_j decay^j · CE_j / Σ_j decay^j`, each `CE_j` the mean over the head's valid labels.
    pub loss: f32,
    /// Phase times.
    pub times: PhaseTimes,
}

/// What one optimizer step reports.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OptimizerReport {
    /// Global L2 norm of the gradients (before clipping).
    pub grad_norm: f32,
    /// Factor the gradients were scaled by (1 without clipping).
    pub clip_scale: f32,
    /// True when the norm was not finite and no parameter changed.
    pub skipped: bool,
    /// Wall-clock time of the step.
    pub time: Duration,
}

/// The CPU training step for one model: one workspace, sized from the compiler's layout for the largest
/// bucket, allocated when the drafter is built (no allocation by this crate in steady state).
///
/// # Examples
/// ```
/// use draftpipe_compiler::plan::{AdamWSpec, BucketPlan, LossSpec, LrSchedule, MlpSpec, ModelPlan};
/// use draftpipe_runtime::{batch::HsBatch, drafter::cpu::CpuDrafter, params::FlatState};
///
/// let spec = MlpSpec { din: 8, hidden: 8, blocks: 1, intermediate: 16, heads: 2, vocab: 32 };
/// let model = ModelPlan::new(spec);
/// let bucket = BucketPlan { padded_len: 4, sequences: 2, tokens: 8, step_flops: 0, step_bytes: 0 };
/// let loss = LossSpec { head_decay: 0.8, position_decay: None, step_decay: None, chunk_tokens: 4 };
/// let adamw = AdamWSpec { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, clip_grad_norm: Some(1.0), schedule: LrSchedule::CONSTANT };
/// let mut drafter = CpuDrafter::new(&model, loss, adamw, &[bucket]);
/// let mut state = FlatState::init(&model, 0);
///
/// let mut batch = HsBatch::zeroed(4, 2, 8);
/// batch.seq_lens.fill(4);
/// batch.loss_mask.fill(1);
/// batch.input_ids.iter_mut().enumerate().for_each(|(t, id)| *id = t as u32 % 32);
/// let hs = batch.hs.as_f32_mut().expect("an f32 batch");
/// hs.iter_mut().enumerate().for_each(|(k, v)| *v = (k % 5) as f32 - 2.0);
///
/// let out = drafter.forward_backward(&mut state, &batch)?;
/// assert!(out.loss > 0.0);
/// assert_eq!(drafter.valid_labels(), [6, 4]); // two sequences of 4: 3 labels each for head 0, 2 for head 1
/// let report = drafter.optimizer_step(&mut state);
/// assert!(!report.skipped && state.step == 1);
/// # Ok::<(), draftpipe_runtime::drafter::StepError>(())
/// ```
pub struct CpuDrafter {
    /// `Err` when the model plan is not a canonical `mlp` layout: every step then answers
    /// [`StepError::Layout`], as a batch error, rather than failing construction.
    drafter: Result<Drafter<CpuBackend>, StepError>,
    /// Whether a successful `forward_backward` has filled the label counts.
    has_labels: bool,
}

impl CpuDrafter {
    /// A drafter for `model`, training with `loss` and `optimizer` on batches shaped like `buckets`, in f32.
    pub fn new(
        model: &ModelPlan,
        loss: LossSpec,
        optimizer: AdamWSpec,
        buckets: &[BucketPlan],
    ) -> Self {
        Self::with_precision(model, loss, optimizer, Precision::F32, buckets)
    }

    /// [`CpuDrafter::new`] with the matrix products at `precision` (bf16 and TF32 emulated by rounding).
    pub fn with_precision(
        model: &ModelPlan,
        loss: LossSpec,
        optimizer: AdamWSpec,
        precision: Precision,
        buckets: &[BucketPlan],
    ) -> Self {
        let drafter = model
            .spec
            .as_mlp()
            .and_then(|spec| {
                draftpipe_compiler::plan::WorkspaceLayout::mlp(
                    spec,
                    buckets,
                    &loss,
                    draftpipe_compiler::plan::BackendKind::Cpu,
                    precision,
                )
            })
            .ok_or(StepError::Layout)
            .and_then(|layout| {
                Drafter::new(
                    CpuBackend::new(&layout),
                    model,
                    (loss, optimizer, precision),
                    buckets,
                )
                .map_err(|_| StepError::Layout)
            });
        Self {
            drafter,
            has_labels: false,
        }
    }

    /// Bytes this drafter allocated (flat state and workspace), for the layout tests.
    pub fn allocated_bytes(&self) -> u64 {
        self.drafter.as_ref().map_or(0, Drafter::allocated_bytes)
    }

    /// Forward, fused loss and backward on `batch`; overwrites `state.grads` with the gradients of the loss.
    ///
    /// # Errors
    /// [`StepError`] when the batch's shape matches no bucket, its width is not `din`, its buffers, sequence
    /// lengths or token ids are inconsistent, or `state` does not fit the model.
    pub fn forward_backward(
        &mut self,
        state: &mut FlatState,
        batch: &HsBatch,
    ) -> Result<StepOutput, StepError> {
        let drafter = self.drafter.as_mut().map_err(|e| e.clone())?;
        let bucket = drafter.check_batch(batch)?;
        let shape = StepShape {
            padded_len: batch.padded_len,
            sequences: batch.sequences,
        };
        swap_state(drafter, state)?;
        let staged = drafter.stage(batch);
        let (be, model) = drafter.parts_mut();
        let mut times = PhaseTimes::default();
        let ran = staged.and_then(|()| {
            be.run_part(StepPart::ForwardBackward { bucket, slot: 0 }, &mut |be| {
                times = model.forward_backward(be, shape, 0)?;
                Ok(())
            })
            .map_err(DrafterError::from)
        });
        let loss = model.step_scalars().as_slice()[2];
        swap_state(drafter, state)?;
        ran.map_err(|error| match error {
            DrafterError::Batch(error) => error,
            other => unreachable!("the CPU backend cannot fail: {other}"),
        })?;
        self.has_labels = true;
        Ok(StepOutput { loss, times })
    }

    /// Valid labels per head (the denominators of the loss's means) of the last successful
    /// [`CpuDrafter::forward_backward`]; empty before the first.
    pub fn valid_labels(&self) -> &[u32] {
        match (&self.drafter, self.has_labels) {
            (Ok(drafter), true) => (drafter.model() as &dyn Any)
                .downcast_ref::<Mlp<CpuBackend>>()
                .map_or(&[], |mlp| mlp.ws.counts.as_slice()),
            _ => &[],
        }
    }

    /// Global gradient norm, clipping and one fused AdamW pass over `state`. Skips the update (and does not
    /// advance `state.step`) when the norm is not finite.
    ///
    /// # Panics
    /// When `state` does not fit the model (a [`CpuDrafter::forward_backward`] on it would have said so).
    pub fn optimizer_step(&mut self, state: &mut FlatState) -> OptimizerReport {
        let started = Instant::now();
        let drafter = self
            .drafter
            .as_mut()
            .expect("optimizer_step on a model forward_backward refused");
        swap_state(drafter, state).expect("optimizer_step on a state that does not fit the model");
        let (be, model) = drafter.parts_mut();
        let steps = model.optimizer().adamw_state_for(state.step);
        model.state_mut().1.as_mut_slice().copy_from_slice(&steps);
        be.run_part(StepPart::Update, &mut |be| model.update(be))
            .expect("the CPU backend cannot fail");
        let [grad_norm, clip_scale, _] = model.step_scalars().as_slice()[..] else {
            unreachable!("three step scalars")
        };
        state.step = model.state_mut().1.as_slice()[0] as u64;
        swap_state(drafter, state).expect("sizes checked above");
        OptimizerReport {
            grad_norm,
            clip_scale,
            skipped: !grad_norm.is_finite(),
            time: started.elapsed(),
        }
    }
}

/// Exchanges `state`'s four vectors with the drafter's flat buffers (a swap, no copy; calling it twice
/// restores both).
fn swap_state(drafter: &mut Drafter<CpuBackend>, state: &mut FlatState) -> Result<(), StepError> {
    let expected = drafter.model().state().params.len();
    for len in [
        state.params.len(),
        state.grads.len(),
        state.exp_avg.len(),
        state.exp_avg_sq.len(),
    ] {
        if len != expected {
            return Err(StepError::StateSize { expected, got: len });
        }
    }
    let flat = drafter.parts_mut().1.state_mut().0;
    flat.params.swap_vec(&mut state.params);
    flat.grads.swap_vec(&mut state.grads);
    flat.exp_avg.swap_vec(&mut state.exp_avg);
    flat.exp_avg_sq.swap_vec(&mut state.exp_avg_sq);
    Ok(())
}

#[cfg(test)]
mod tests {
    /// The host launchers' AVX2 + FMA copies, their baseline copies and a threaded run train bit for bit alike
    /// (a whole step, so every kernel the step launches is compared).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_baseline_and_threaded_launches_give_bit_identical_training_steps() {
        use super::CpuDrafter;
        use crate::backend::cpu::kernels::{BASELINE_ONLY, WIDE_LAUNCHES};
        use crate::batch::HsBatch;
        use crate::params::FlatState;
        use draftpipe_compiler::plan::{
            AdamWSpec, BucketPlan, LossSpec, LrSchedule, MlpSpec, ModelPlan,
        };
        use rand::rngs::Xoshiro256PlusPlus;
        use rand::{RngExt, SeedableRng};

        if !(std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")) {
            crate::log_line!(
                "skipped: this CPU has no AVX2 + FMA, so only the baseline copies run"
            );
            return;
        }
        // Odd sizes, so every kernel runs its vector body and its remainder.
        let spec = MlpSpec {
            din: 37,
            hidden: 44,
            blocks: 2,
            intermediate: 75,
            heads: 3,
            vocab: 301,
        };
        let model = ModelPlan::new(spec);
        let (padded_len, sequences) = (29, 5);
        let bucket = BucketPlan {
            padded_len,
            sequences,
            tokens: padded_len * sequences,
            step_flops: 0,
            step_bytes: 0,
        };
        let loss = LossSpec {
            head_decay: 0.8,
            position_decay: None,
            step_decay: None,
            chunk_tokens: 50,
        };
        let optimizer = AdamWSpec {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            clip_grad_norm: Some(0.5),
            schedule: LrSchedule::CONSTANT,
        };
        let seed = rand::rng().random::<u64>();
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
        let mut batch = HsBatch::zeroed(padded_len, sequences, spec.din);
        for s in 0..sequences {
            let len = rng.random_range(1..=padded_len);
            batch.seq_lens[s] = len as u32;
            for t in s * padded_len..s * padded_len + len {
                batch.input_ids[t] = rng.random_range(0..spec.vocab as u32);
                batch.loss_mask[t] = u8::from(rng.random_range(0..8) != 0);
            }
        }
        batch
            .hs
            .as_f32_mut()
            .expect("an f32 batch")
            .iter_mut()
            .for_each(|v| *v = rng.random_range(-2.0f32..2.0));

        let train = |baseline: bool| {
            BASELINE_ONLY.with(|only| only.set(baseline));
            let mut drafter =
                CpuDrafter::new(&model, loss, optimizer, std::slice::from_ref(&bucket));
            let mut state = FlatState::init(&model, seed);
            let mut trace = Vec::new();
            for _ in 0..3 {
                let out = drafter.forward_backward(&mut state, &batch).unwrap();
                let report = drafter.optimizer_step(&mut state);
                trace.push((out.loss.to_bits(), report.grad_norm.to_bits()));
                trace.extend(state.grads.iter().map(|g| (g.to_bits(), 0)));
            }
            BASELINE_ONLY.with(|only| only.set(false));
            let bits = |values: &[f32]| values.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            (trace, bits(&state.params), bits(&state.exp_avg_sq))
        };
        let wide_before = WIDE_LAUNCHES.with(std::cell::Cell::get);
        let wide = train(false);
        let wide_launches = WIDE_LAUNCHES.with(std::cell::Cell::get) - wide_before;
        let baseline = train(true);
        assert!(
            wide_launches > 0,
            "the AVX2 + FMA copies never ran, so the comparison below would be vacuous"
        );
        assert_eq!(
            WIDE_LAUNCHES.with(std::cell::Cell::get) - wide_before,
            wide_launches,
            "a baseline-only run took the AVX2 + FMA copies"
        );
        assert!(
            wide == baseline,
            "AVX2 and baseline steps differ (seed {seed})"
        );
        // The same steps with every launch and GEMM split over a drafter's threads.
        let threads = crate::backend::cpu::HostThreads::new("test", 3).expect("threads");
        let pooled = threads.run(|| train(false));
        assert!(
            wide == pooled,
            "steps split over 3 threads differ from one thread's (seed {seed})"
        );
    }
}
