//! The CPU backend: one full training step of the `mlp` drafter on the host, on the flat buffers of
//! [`FlatState`], with one preallocated workspace per distinct step size (`workspace.rs`).
//!
//! ```text
//!  HsBatch ──▶ CpuDrafter::forward_backward ──▶ state.grads ──(lead: all-reduce)──▶ CpuDrafter::optimizer_step
//!              forward │ fused loss │ backward                                       grad norm → clip → AdamW
//! ```
//!
//! Matrix products go through `matrixmultiply` (`gemm.rs`); every other operation is a kernel body of
//! `draftpipe-gpu-kernels`, the same source the CUDA backend compiles to PTX ([`kernels`]).

mod gemm;
pub mod kernels;
mod step;
mod workspace;

pub use gemm::{GEMM_THREADS_VAR, gemm_flops, gemm_threads};
pub use step::{HeadLoss, RMS_EPS, head_loss};

use crate::batch::HsBatch;
use crate::params::FlatState;
use draftpipe_compiler::plan::{AdamWSpec, BucketPlan, LossSpec, MlpSpec, ModelPlan};
use std::time::{Duration, Instant};
use step::Offsets;
use workspace::Workspace;

/// Elements per partial sum of the gradient norm.
const GRAD_NORM_CHUNK: usize = 1 << 14;

/// Wall-clock time of each phase of [`CpuDrafter::forward_backward`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PhaseTimes {
    /// Forward pass up to the heads' outputs.
    pub forward: Duration,
    /// Fused vocabulary loss, including its GEMMs and the `lm_head` gradient.
    pub loss: Duration,
    /// Backward from the heads to the first layer.
    pub backward: Duration,
}

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

/// A batch or state the drafter cannot train on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StepError {
    /// No bucket has this static shape.
    #[error("batch shape {sequences} sequences × {padded_len} tokens matches no bucket")]
    NoBucket {
        /// The batch's padded length.
        padded_len: usize,
        /// The batch's sequence count.
        sequences: usize,
    },
    /// The hidden-state width differs from the model's `din`.
    #[error("batch hidden-state width {got} differs from the model's din {expected}")]
    WrongDin {
        /// The model's input width.
        expected: usize,
        /// The batch's width.
        got: usize,
    },
    /// A buffer of the batch does not match its declared shape.
    #[error("batch buffer `{buffer}` has {got} elements, its shape needs {expected}")]
    BatchBuffer {
        /// Which buffer.
        buffer: &'static str,
        /// Elements the shape needs.
        expected: usize,
        /// Elements present.
        got: usize,
    },
    /// A sequence is longer than the padded length.
    #[error("sequence {sequence} has length {len}, longer than the padded length {padded_len}")]
    SequenceTooLong {
        /// Sequence index in the batch.
        sequence: usize,
        /// Its declared length.
        len: u32,
        /// The batch's padded length.
        padded_len: usize,
    },
    /// A token id inside a sequence is outside the vocabulary.
    #[error("token id {id} at position {position} is outside the vocabulary of {vocab}")]
    TokenOutOfRange {
        /// Flat position in the batch.
        position: usize,
        /// The id.
        id: u32,
        /// Vocabulary size.
        vocab: usize,
    },
    /// The state's buffers do not match the model.
    #[error("state has {got} parameters, the model {expected}")]
    StateSize {
        /// The model's parameter count.
        expected: usize,
        /// The state's buffer length.
        got: usize,
    },
    /// The model plan's layout is not the canonical `mlp` layout this backend computes with, or a dimension
    /// is zero.
    #[error("model layout differs from the canonical mlp layout or has an empty dimension")]
    Layout,
    /// The batch has no tokens.
    #[error("batch has no tokens")]
    EmptyBatch,
}

/// The CPU training step for one model, with one workspace per distinct step size (allocated on the first batch
/// of that size, then reused: no allocation by this crate in steady state).
///
/// # Examples
/// ```
/// use draftpipe_compiler::plan::{AdamWSpec, BucketPlan, LossSpec, MlpSpec, ModelPlan};
/// use draftpipe_runtime::{batch::HsBatch, cpu::CpuDrafter, params::FlatState};
///
/// let spec = MlpSpec { din: 8, hidden: 8, blocks: 1, intermediate: 16, heads: 2, vocab: 32 };
/// let model = ModelPlan::new(spec);
/// let bucket = BucketPlan { padded_len: 4, sequences: 2, tokens: 8, step_flops: 0, step_bytes: 0 };
/// let loss = LossSpec { head_decay: 0.8, chunk_tokens: 4 };
/// let adamw = AdamWSpec { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, clip_grad_norm: Some(1.0) };
/// let mut drafter = CpuDrafter::new(&model, loss, adamw, &[bucket]);
/// let mut state = FlatState::init(&model, 0);
///
/// let mut batch = HsBatch::zeroed(4, 2, 8);
/// batch.seq_lens.fill(4);
/// batch.loss_mask.fill(1);
/// batch.input_ids.iter_mut().enumerate().for_each(|(t, id)| *id = t as u32 % 32);
/// batch.hs.iter_mut().enumerate().for_each(|(k, v)| *v = (k % 5) as f32 - 2.0);
///
/// let out = drafter.forward_backward(&mut state, &batch)?;
/// assert!(out.loss > 0.0);
/// assert_eq!(drafter.valid_labels(), [6, 4]); // two sequences of 4: 3 labels each for head 0, 2 for head 1
/// let report = drafter.optimizer_step(&mut state);
/// assert!(!report.skipped && state.step == 1);
/// # Ok::<(), draftpipe_runtime::cpu::StepError>(())
/// ```
pub struct CpuDrafter {
    spec: MlpSpec,
    offsets: Option<Offsets>,
    loss: LossSpec,
    optimizer: AdamWSpec,
    buckets: Vec<BucketPlan>,
    /// One workspace per distinct token count: a workspace depends only on `T`, and buckets whose
    /// `sequences × padded_len` agree (every bucket, when `batch_tokens` is a multiple of each) share one, as the
    /// plan's memory model counts it.
    workspaces: Vec<Workspace>,
    /// The workspace of the last `forward_backward`, whose label counts [`CpuDrafter::valid_labels`] reports.
    last_workspace: Option<usize>,
    grad_norm_partials: Vec<f32>,
}

impl CpuDrafter {
    /// A drafter for `model`, training with `loss` and `optimizer` on batches shaped like `buckets`.
    pub fn new(
        model: &ModelPlan,
        loss: LossSpec,
        optimizer: AdamWSpec,
        buckets: &[BucketPlan],
    ) -> Self {
        let spec = model.spec;
        let MlpSpec {
            din,
            hidden,
            blocks: _,
            intermediate,
            heads,
            vocab,
        } = spec;
        let non_empty = [din, hidden, intermediate, heads, vocab]
            .iter()
            .all(|&d| d > 0);
        let canonical = non_empty
            && model.layout == spec.layout()
            && model.parameters == spec.parameter_count();
        Self {
            spec,
            offsets: if canonical { Offsets::new(&spec) } else { None },
            loss,
            optimizer,
            buckets: buckets.to_vec(),
            workspaces: Vec::with_capacity(buckets.len()),
            last_workspace: None,
            grad_norm_partials: vec![0.0; model.parameters.div_ceil(GRAD_NORM_CHUNK)],
        }
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
        if self.offsets.is_none() {
            return Err(StepError::Layout);
        }
        self.validate(state, batch)?;
        let offsets = self.offsets.as_ref().ok_or(StepError::Layout)?;
        let spec = self.spec;
        let tokens = batch.tokens();
        let index = match self.workspaces.iter().position(|ws| ws.tokens == tokens) {
            Some(index) => index,
            None => {
                self.workspaces
                    .push(Workspace::new(&spec, tokens, self.loss.chunk_tokens));
                self.workspaces.len() - 1
            }
        };
        self.last_workspace = Some(index);
        let ws = &mut self.workspaces[index];

        let started = Instant::now();
        step::forward(&spec, offsets, &state.params, batch, ws);
        let forward_done = Instant::now();
        let loss = step::loss(
            &spec,
            offsets,
            self.loss.head_decay,
            &state.params,
            &mut state.grads,
            batch,
            ws,
        );
        let loss_done = Instant::now();
        step::backward(&spec, offsets, &state.params, &mut state.grads, batch, ws);
        let backward_done = Instant::now();

        Ok(StepOutput {
            loss,
            times: PhaseTimes {
                forward: forward_done - started,
                loss: loss_done - forward_done,
                backward: backward_done - loss_done,
            },
        })
    }

    /// Valid labels per head (the denominators of the loss's means) of the last successful
    /// [`CpuDrafter::forward_backward`]; empty before the first.
    pub fn valid_labels(&self) -> &[u32] {
        self.last_workspace
            .map_or(&[], |index| &self.workspaces[index].counts)
    }

    /// Global gradient norm, clipping and one fused AdamW pass over `state`. Skips the update (and does not
    /// advance `state.step`) when the norm is not finite.
    pub fn optimizer_step(&mut self, state: &mut FlatState) -> OptimizerReport {
        let started = Instant::now();
        let AdamWSpec {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            clip_grad_norm,
        } = self.optimizer;
        let max_norm = clip_grad_norm.unwrap_or(0.0);
        let (grad_norm, clip_scale) = kernels::grad_norm(
            &state.grads,
            GRAD_NORM_CHUNK,
            &mut self.grad_norm_partials,
            max_norm,
        );
        let skipped = !grad_norm.is_finite();
        if !skipped {
            state.step += 1;
            let hyper =
                kernels::adamw_step_scalars(lr, beta1, beta2, eps, weight_decay, state.step);
            let FlatState {
                params,
                grads,
                exp_avg,
                exp_avg_sq,
                ..
            } = state;
            kernels::adamw_update(
                params, grads, exp_avg, exp_avg_sq, grad_norm, clip_scale, hyper,
            );
        }
        OptimizerReport {
            grad_norm,
            clip_scale,
            skipped,
            time: started.elapsed(),
        }
    }

    /// Checks `batch` and `state` against the model and buckets.
    fn validate(&self, state: &FlatState, batch: &HsBatch) -> Result<(), StepError> {
        let expected = self.spec.parameter_count();
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
        if !self
            .buckets
            .iter()
            .any(|b| b.padded_len == batch.padded_len && b.sequences == batch.sequences)
        {
            return Err(StepError::NoBucket {
                padded_len: batch.padded_len,
                sequences: batch.sequences,
            });
        }
        if batch.din != self.spec.din {
            return Err(StepError::WrongDin {
                expected: self.spec.din,
                got: batch.din,
            });
        }
        let tokens = batch.tokens();
        if tokens == 0 {
            return Err(StepError::EmptyBatch);
        }
        let sizes = [
            ("hs", tokens * batch.din, batch.hs.len()),
            ("input_ids", tokens, batch.input_ids.len()),
            ("loss_mask", tokens, batch.loss_mask.len()),
            ("seq_lens", batch.sequences, batch.seq_lens.len()),
        ];
        for (buffer, expected, got) in sizes {
            if expected != got {
                return Err(StepError::BatchBuffer {
                    buffer,
                    expected,
                    got,
                });
            }
        }
        for (sequence, &len) in batch.seq_lens.iter().enumerate() {
            if len as usize > batch.padded_len {
                return Err(StepError::SequenceTooLong {
                    sequence,
                    len,
                    padded_len: batch.padded_len,
                });
            }
            let start = sequence * batch.padded_len;
            for position in start..start + len as usize {
                let id = batch.input_ids[position];
                if id as usize >= self.spec.vocab {
                    return Err(StepError::TokenOutOfRange {
                        position,
                        id,
                        vocab: self.spec.vocab,
                    });
                }
            }
        }
        Ok(())
    }
}
