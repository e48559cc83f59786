//! What the drafter asks of a model family's step, so that the drafter, the worker loop, evaluation and the
//! tools are written once for every family: [`Family`], implemented by each family's folder (`model::mlp`,
//! `model::dflash`, …) and built by name in [`registry`](super::registry).
//!
//! ```text
//!  Drafter<B> ── stage: input slot (generic) ─▶ Family::stage (dflash: its block plan) ─▶ labelled rows
//!             ── step:  Family::forward_backward ─▶ gradient average ─▶ shared update on Family::update_parts
//!             ── read-back [grad_norm, clip, loss, extra…] ─▶ Family::metrics(extra, labelled) ─▶ telemetry
//! ```
//!
//! The drafter holds its family as a `Box<dyn Family<B>>`: a step calls it once per part (forward/backward,
//! update, staging), never per kernel, so the virtual call costs nothing measurable, while a new family needs
//! no new type parameter nor a new arm in every caller. The kernels inside a part stay statically dispatched on
//! `B`.

use std::any::Any;
use std::time::Instant;

use draftpipe_compiler::plan::{
    AdamWSpec, BackendKind, BucketPlan, LossSpec, ModelPlan, Precision, WorkspaceLayout,
};

use crate::backend::{Backend, BackendResult, Buf, InputSlot};
use crate::batch::{HsBatch, HsDtype};
use crate::model::step::{AllocateError, LayoutError, PhaseTimes, StepShape};
use crate::model::update::{FlatBuffers, Optimizer, UpdateParts};

/// What a family's constructor is given: the model, its training settings, the buckets its workspace is
/// sized for and the precision the input slots hold hidden states in.
#[derive(Clone, Copy)]
pub struct FamilyPlan<'a> {
    /// The plan's model (spec, layout, parameter count).
    pub model: &'a ModelPlan,
    /// The loss settings.
    pub loss: LossSpec,
    /// AdamW's settings.
    pub optimizer: AdamWSpec,
    /// The matrix products' precision.
    pub precision: Precision,
    /// The buckets the workspace is sized for.
    pub buckets: &'a [BucketPlan],
    /// The hidden states' precision in the input slots.
    pub hs_dtype: HsDtype,
}

/// The [`Family`] methods every family writes alike, over the fields every family has by the same names:
/// `self.optimizer`, `self.state`, and in `self.ws` the update buffers (`grad_norm_partials`,
/// `step_scalars`, `adamw_step`, `adamw_state`) and the input slots (`inputs`). Used inside a family's
/// `impl Family<B>`, so a new family writes only what is its own.
macro_rules! family_state_parts {
    () => {
        fn update_parts(&mut self) -> $crate::model::update::UpdateParts<'_, B> {
            let ws = &mut self.ws;
            (
                &self.optimizer,
                &mut self.state,
                $crate::model::update::UpdateBuffers {
                    grad_norm_partials: &mut ws.grad_norm_partials,
                    step_scalars: &mut ws.step_scalars,
                    adamw_step: &mut ws.adamw_step,
                    adamw_state: &mut ws.adamw_state,
                },
            )
        }

        fn optimizer(&self) -> &$crate::model::update::Optimizer {
            &self.optimizer
        }

        fn optimizer_mut(&mut self) -> &mut $crate::model::update::Optimizer {
            &mut self.optimizer
        }

        fn state(&self) -> &$crate::model::update::FlatBuffers<B> {
            &self.state
        }

        fn state_mut(
            &mut self,
        ) -> (
            &mut $crate::model::update::FlatBuffers<B>,
            &mut $crate::backend::Buf<B, f64>,
        ) {
            (&mut self.state, &mut self.ws.adamw_state)
        }

        fn step_scalars(&self) -> &$crate::backend::Buf<B, f32> {
            &self.ws.step_scalars
        }

        fn inputs(&self) -> &[$crate::backend::InputSlot<B>] {
            &self.ws.inputs
        }

        fn input_mut(&mut self, slot: usize) -> &mut $crate::backend::InputSlot<B> {
            &mut self.ws.inputs[slot]
        }
    };
}
pub(crate) use family_state_parts;

/// A family built on a backend, with the workspace layout its buffers were allocated from.
pub type Built<B> = (Box<dyn Family<B>>, WorkspaceLayout);

/// What the registry's one [`build`] asks of a family's model type: its parameter offsets checked against the
/// plan's layout, its workspace from the compiler's memory model, and its allocation over both.
pub trait FamilyModel<B: Backend>: Family<B> + Sized {
    /// The family's parameter offsets in the flat buffers.
    type Offsets;

    /// The offsets of `model`'s parameters, or why its layout is not this family's.
    ///
    /// # Errors
    /// [`LayoutError`].
    fn offsets(model: &ModelPlan) -> Result<Self::Offsets, LayoutError>;

    /// The compiler's workspace layout of this family for `plan` on `kind`; `None` when its sizes overflow.
    fn workspace(
        offsets: &Self::Offsets,
        plan: &FamilyPlan<'_>,
        kind: BackendKind,
    ) -> Option<WorkspaceLayout>;

    /// The model with every buffer of `layout` allocated on `backend`.
    ///
    /// # Errors
    /// [`AllocateError`].
    fn allocate(
        backend: &mut B,
        plan: &FamilyPlan<'_>,
        offsets: Self::Offsets,
        layout: &WorkspaceLayout,
    ) -> Result<Self, AllocateError>;
}

/// Family `F` of `plan` on `backend`, with its workspace (allocated here, once): the registry's one path for
/// every family.
///
/// # Errors
/// [`BuildError`] when the plan's layout is not `F`'s, the workspace overflows or a buffer cannot be allocated.
pub fn build<B: Backend, F: FamilyModel<B>>(
    backend: &mut B,
    plan: FamilyPlan<'_>,
) -> Result<Built<B>, BuildError> {
    let kind = backend.kind();
    let offsets = F::offsets(plan.model)?;
    let layout = F::workspace(&offsets, &plan, kind)
        .and_then(|layout| layout.with_hs_dtype(kind, plan.hs_dtype))
        .ok_or(BuildError::WorkspaceTooLarge)?;
    let model = F::allocate(backend, &plan, offsets, &layout)?;
    Ok((Box::new(model), layout))
}

/// Why a model could not be built.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// The plan's layout is not the one the step trains.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// A buffer could not be allocated.
    #[error(transparent)]
    Allocate(#[from] AllocateError),
    /// The workspace's sizes overflow.
    #[error("the workspace of this plan overflows the address space")]
    WorkspaceTooLarge,
}

/// The buffers of the target's frozen embedding and `lm_head`, in that order.
pub type FrozenTables<'a, B> = (&'a mut Buf<B, f32>, &'a mut Buf<B, f32>);

/// One model family's training step on backend `B`: its forward, loss, backward and the buffers the shared
/// update and the drafter read. See the module docs.
pub trait Family<B: Backend>: Send + Any {
    /// The family's name as the plan writes it (`mlp`, `dflash`, …).
    fn name(&self) -> &'static str;

    /// The forward of the batch in input slot `slot`: every activation the loss and the backward read.
    fn forward(&mut self, be: &mut B, shape: StepShape, slot: usize) -> BackendResult;

    /// The training loss after [`Family::forward`]: the loss into `step_scalars[2]` (and the family's further
    /// read-back values after it) and the gradient the backward starts from.
    fn loss(&mut self, be: &mut B, shape: StepShape, slot: usize) -> BackendResult;

    /// The backward after [`Family::loss`]: overwrites every gradient.
    fn backward(&mut self, be: &mut B, shape: StepShape, slot: usize) -> BackendResult;

    /// The evaluation loss after [`Family::forward`]: the same read-back values as [`Family::loss`]; a family
    /// whose loss can skip its gradient for evaluation says so here (the default is the training loss, whose
    /// gradient then belongs to no step).
    fn evaluation_loss(&mut self, be: &mut B, shape: StepShape, slot: usize) -> BackendResult {
        self.loss(be, shape, slot)
    }

    /// Forward, loss and backward of the batch in input slot `slot`, timed per phase: the host time of each
    /// (what the CPU spends; on CUDA only the enqueueing). Written once here for every family.
    fn forward_backward(
        &mut self,
        be: &mut B,
        shape: StepShape,
        slot: usize,
    ) -> BackendResult<PhaseTimes> {
        let started = Instant::now();
        self.forward(be, shape, slot)?;
        let forward_done = Instant::now();
        self.loss(be, shape, slot)?;
        let loss_done = Instant::now();
        self.backward(be, shape, slot)?;
        Ok(PhaseTimes {
            forward: forward_done - started,
            loss: loss_done - forward_done,
            backward: loss_done.elapsed(),
        })
    }

    /// Forward and loss only (evaluation): the loss into `step_scalars[2]`, no step's gradient.
    fn forward_loss(&mut self, be: &mut B, shape: StepShape, slot: usize) -> BackendResult {
        self.forward(be, shape, slot)?;
        self.evaluation_loss(be, shape, slot)
    }

    /// The optimizer, state and buffers the shared update ([`Optimizer::update`]) runs on.
    fn update_parts(&mut self) -> UpdateParts<'_, B>;

    /// AdamW's settings and schedule.
    fn optimizer(&self) -> &Optimizer;

    /// AdamW's settings and schedule, to set the schedule's length.
    fn optimizer_mut(&mut self) -> &mut Optimizer;

    /// The flat state buffers.
    fn state(&self) -> &FlatBuffers<B>;

    /// The flat state and AdamW's device state `[steps, β1^steps, β2^steps]`, to load or save.
    fn state_mut(&mut self) -> (&mut FlatBuffers<B>, &mut Buf<B, f64>);

    /// The step's read-back scalars: `[grad_norm, clip, loss]`, then the family's own values (see
    /// [`Family::metrics`]).
    fn step_scalars(&self) -> &Buf<B, f32>;

    /// The input slots batches are staged into.
    fn inputs(&self) -> &[InputSlot<B>];

    /// Input slot `slot`, to stage into.
    fn input_mut(&mut self, slot: usize) -> &mut InputSlot<B>;

    /// Width of one token's hidden state the model reads, and its vocabulary.
    fn input_width_and_vocab(&self) -> (usize, usize);

    /// Width of one token's `last_hidden_states` (the target's final-norm output) the family reads, when it reads
    /// them (`eagle3`'s teacher); `None` (the default) otherwise.
    fn last_hidden_width(&self) -> Option<usize> {
        None
    }

    /// The buffers of the target's frozen embedding and `lm_head` (`[vocab, hidden]` each, uploaded once
    /// before the first step), when the family reads them; `None` (the default) when it reads none.
    fn frozen_mut(&mut self) -> Option<FrozenTables<'_, B>> {
        None
    }

    /// Called once the frozen tables of [`Family::frozen_mut`] hold the target's tensors, to derive what the
    /// family keeps of them (dflash: `lm_head`'s bf16 copy on CUDA at `bf16`); the default derives nothing.
    ///
    /// # Errors
    /// Backend failures.
    fn frozen_uploaded(&mut self, _be: &mut B) -> BackendResult {
        Ok(())
    }

    /// The family's own staging of `batch`, after its tensors are in input slot `slot`, with the run's
    /// `(seed, step)` for anything drawn at random. Returns the rows each of its metric positions labels
    /// (dflash: per block slot), or `None` (the default) for a family without position metrics.
    ///
    /// # Errors
    /// Backend failures.
    fn stage(
        &mut self,
        _be: &mut B,
        _slot: usize,
        _batch: &HsBatch,
        _draw: (u64, u64),
    ) -> BackendResult<Option<Vec<u32>>> {
        Ok(None)
    }

    /// The position metrics of a step from its read-back values after the first three (`extra`: the correct
    /// rows per position, then the accepted prefixes summed) and the labelled rows [`Family::stage`] returned.
    fn metrics(&self, extra: &[f32], labelled: &[u32]) -> BlockMetrics {
        BlockMetrics::new(extra, labelled, extra[labelled.len()])
    }

    /// The precision the input slots hold hidden states in.
    fn input_hs_dtype(&self) -> HsDtype {
        self.inputs()[0].hs.dtype()
    }

    /// The shared update, on this family's buffers.
    ///
    /// # Errors
    /// Backend failures.
    fn update(&mut self, be: &mut B) -> BackendResult {
        let (optimizer, state, ws) = self.update_parts();
        optimizer.update(be, state, ws)
    }
}

/// A step's position metrics: SpecForge's per-position accuracy (dflash: per block slot), the simulated
/// acceptance length over those accuracies, and the exact one over the blocks' accepted prefixes.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockMetrics {
    /// Accuracy of positions `1..` (argmax = label over the position's labelled rows; 0 for a position without
    /// one).
    pub slot_accuracy: Vec<f32>,
    /// `τ_simulated = 1 + Σ_k Π_{j≤k} acc_j`: SpecForge's simulated acceptance length over the marginal
    /// accuracies, bonus token counted. It multiplies marginals, so misses that fall on the same blocks (the
    /// usual case) make it differ from [`Self::tau_exact`].
    pub tau_simulated: f32,
    /// `τ_exact = 1 + accepted / blocks`: the mean over the counted blocks of the drafted prefix that matches
    /// the labels (the first miss or the first slot without a label ends it), plus the bonus token; 1 without a
    /// counted block.
    pub tau_exact: f32,
    /// The accepted prefixes summed over the blocks (the device's `accepted_prefix_sum`).
    pub accepted: f32,
    /// The blocks counted: those whose first drafted position has a label (SpecForge's `valid_blocks`).
    pub blocks: u32,
}

impl BlockMetrics {
    /// The metrics from the correct rows of every position (position 0 included, never labelled), the labelled
    /// rows of every position and the accepted prefixes summed over the blocks. The blocks counted are the
    /// labelled rows of position 1: a block's prefix starts there, and a block without that label has none.
    pub fn new(correct: &[f32], labelled: &[u32], accepted: f32) -> Self {
        let slot_accuracy: Vec<f32> = correct
            .iter()
            .zip(labelled)
            .skip(1)
            .map(|(&c, &n)| if n == 0 { 0.0 } else { c / n as f32 })
            .collect();
        let chained: f32 = slot_accuracy
            .iter()
            .scan(1.0f32, |chain, &acc| {
                *chain *= acc;
                Some(*chain)
            })
            .sum();
        let blocks = labelled.get(1).copied().unwrap_or(0);
        Self {
            slot_accuracy,
            tau_simulated: 1.0 + chained,
            tau_exact: exact_tau(f64::from(accepted), u64::from(blocks)) as f32,
            accepted,
            blocks,
        }
    }
}

/// `1 + accepted / blocks`, 1 without a block: the exact acceptance length from its two sums (one step's, or
/// `draftpipe eval`'s over many batches).
pub fn exact_tau(accepted: f64, blocks: u64) -> f64 {
    if blocks == 0 {
        1.0
    } else {
        1.0 + accepted / blocks as f64
    }
}

#[cfg(test)]
mod tests {
    use super::BlockMetrics;

    /// SpecForge's simulated acceptance length over the per-slot accuracies, plus the bonus token; a slot
    /// without labels counts as never accepted (the chain stops there).
    #[test]
    fn tau_is_one_plus_the_sum_of_accuracy_prefix_products() {
        let metrics = BlockMetrics::new(&[0.0, 8.0, 4.0, 3.0], &[0, 10, 8, 6], 12.0);
        assert_eq!(metrics.slot_accuracy, [0.8, 0.5, 0.5]);
        let expected = 1.0 + 0.8 + 0.8 * 0.5 + 0.8 * 0.5 * 0.5;
        assert!((metrics.tau_simulated - expected).abs() < 1e-6);
        let unlabelled = BlockMetrics::new(&[0.0, 5.0, 0.0, 2.0], &[0, 5, 0, 2], 5.0);
        assert_eq!(unlabelled.slot_accuracy, [1.0, 0.0, 1.0]);
        assert!((unlabelled.tau_simulated - 2.0).abs() < 1e-6);
    }

    /// The exact figure divides the accepted prefixes by the blocks labelled at position 1 and adds the bonus
    /// token; no counted block gives 1 (nothing accepted), never a division by zero.
    #[test]
    fn exact_tau_is_one_plus_the_accepted_prefixes_per_counted_block() {
        let metrics = BlockMetrics::new(&[0.0, 8.0, 4.0, 3.0], &[0, 10, 8, 6], 12.0);
        assert_eq!(metrics.blocks, 10);
        assert!((metrics.tau_exact - 2.2).abs() < 1e-6);
        let none = BlockMetrics::new(&[0.0, 0.0], &[0, 0], 0.0);
        assert_eq!((none.blocks, none.tau_exact), (0, 1.0));
    }
}
