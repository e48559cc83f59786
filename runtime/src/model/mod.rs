//! Drafter models written once over the [`Backend`](crate::backend::Backend) trait: each family's forward,
//! loss, backward and update, and the buffers the compiler's workspace layout describes.
//!
//! ```text
//!  Plan (model, buckets, loss, precision) ──▶ model::mlp::Mlp<B>       ──calls──▶ B: CpuBackend │ CudaBackend
//!                                        └──▶ model::dflash::Dflash<B> ──┘
//! ```

pub mod dflash;
pub mod eagle3;
pub mod mlp;
pub mod step;
pub mod update;

use draftpipe_compiler::plan::{
    AdamWSpec, BucketPlan, LossSpec, ModelPlan, ModelSpec, Precision, WorkspaceLayout,
};

use crate::backend::{Backend, BackendResult, Buf, InputSlot};
use crate::batch::HsDtype;
use dflash::{Dflash, DflashOffsets};
use mlp::{Mlp, MlpOffsets};
use step::{AllocateError, LayoutError, PhaseTimes, StepShape};
use update::FlatBuffers;

/// Either model family, so the drafter and the worker loop are written once for both. An enum rather than a
/// trait object or a third type parameter: the families are a closed set the plan names, a step dispatches
/// once per part (not per kernel), and `Drafter<B>` keeps one type per backend for every caller.
pub enum Model<B: Backend> {
    /// `model = mlp(...)`.
    Mlp(Box<Mlp<B>>),
    /// `model = dflash(...)`.
    Dflash(Box<Dflash<B>>),
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
    /// The plan names a family whose step the runtime does not have yet.
    #[error("the runtime has no `{family}` step yet: plans of this family compile but cannot run")]
    NoStep {
        /// The family's `.pipe` name.
        family: &'static str,
    },
}

impl<B: Backend> Model<B> {
    /// The model `plan` describes on `backend`, with its workspace for `buckets` (allocated here, once) and
    /// input slots for hidden states held in `hs_dtype`.
    ///
    /// # Errors
    /// [`BuildError`].
    pub fn new(
        backend: &mut B,
        model: &ModelPlan,
        (loss, optimizer, precision): (LossSpec, AdamWSpec, Precision),
        buckets: &[BucketPlan],
        hs_dtype: HsDtype,
    ) -> Result<(Self, WorkspaceLayout), BuildError> {
        let kind = backend.kind();
        match &model.spec {
            ModelSpec::Mlp(_) => {
                let offsets = MlpOffsets::new(model)?;
                let layout = WorkspaceLayout::mlp(offsets.spec(), buckets, &loss, kind, precision)
                    .and_then(|layout| layout.with_hs_dtype(kind, hs_dtype))
                    .ok_or(BuildError::WorkspaceTooLarge)?;
                let mlp = Mlp::new(
                    backend,
                    (model, offsets),
                    loss,
                    optimizer,
                    precision,
                    &layout,
                )?;
                Ok((Model::Mlp(Box::new(mlp)), layout))
            }
            ModelSpec::Dflash(_) => {
                let offsets = DflashOffsets::new(model)?;
                let layout =
                    WorkspaceLayout::dflash(offsets.spec(), buckets, &loss, kind, precision)
                        .and_then(|layout| layout.with_hs_dtype(kind, hs_dtype))
                        .ok_or(BuildError::WorkspaceTooLarge)?;
                let dflash = Dflash::new(
                    backend,
                    (model, offsets),
                    loss,
                    optimizer,
                    precision,
                    &layout,
                )?;
                Ok((Model::Dflash(Box::new(dflash)), layout))
            }
            ModelSpec::Eagle3(_) => Err(BuildError::NoStep { family: "eagle3" }),
        }
    }

    /// Forward, loss and backward of input slot `slot` (see each family's `forward_backward`).
    pub fn forward_backward(
        &mut self,
        be: &mut B,
        shape: StepShape,
        slot: usize,
    ) -> BackendResult<PhaseTimes> {
        match self {
            Model::Mlp(m) => m.forward_backward(be, shape, slot),
            Model::Dflash(m) => m.forward_backward(be, shape, slot),
        }
    }

    /// Sets the step count the learning-rate schedule runs over.
    pub fn set_schedule_total(&mut self, total_steps: u64) {
        let optimizer = match self {
            Model::Mlp(m) => &mut m.optimizer,
            Model::Dflash(m) => &mut m.optimizer,
        };
        optimizer.set_schedule_total(total_steps);
    }

    /// Forward and loss only (evaluation).
    pub fn forward_loss(&mut self, be: &mut B, shape: StepShape, slot: usize) -> BackendResult {
        match self {
            Model::Mlp(m) => m.forward_loss(be, shape, slot),
            Model::Dflash(m) => m.forward_loss(be, shape, slot),
        }
    }

    /// The shared update.
    pub fn update(&mut self, be: &mut B) -> BackendResult {
        let (optimizer, state, ws) = match self {
            Model::Mlp(m) => m.update_parts(),
            Model::Dflash(m) => m.update_parts(),
        };
        optimizer.update(be, state, ws)
    }

    /// AdamW's device state for `steps` applied steps.
    pub fn adamw_state_for(&self, steps: u64) -> [f64; 3] {
        let optimizer = match self {
            Model::Mlp(m) => &m.optimizer,
            Model::Dflash(m) => &m.optimizer,
        };
        optimizer.adamw_state_for(steps)
    }

    /// The flat state buffers.
    pub fn state(&self) -> &FlatBuffers<B> {
        match self {
            Model::Mlp(m) => &m.state,
            Model::Dflash(m) => &m.state,
        }
    }

    /// The flat state and AdamW's device state `[steps, β1^steps, β2^steps]`, to load or save.
    pub fn state_mut(&mut self) -> (&mut FlatBuffers<B>, &mut Buf<B, f64>) {
        match self {
            Model::Mlp(m) => (&mut m.state, &mut m.ws.adamw_state),
            Model::Dflash(m) => (&mut m.state, &mut m.ws.adamw_state),
        }
    }

    /// The step's read-back scalars (`[grad_norm, clip, loss, …]`).
    pub fn step_scalars(&self) -> &Buf<B, f32> {
        match self {
            Model::Mlp(m) => &m.ws.step_scalars,
            Model::Dflash(m) => &m.ws.step_scalars,
        }
    }

    /// Input slot `slot`.
    pub fn input_mut(&mut self, slot: usize) -> &mut InputSlot<B> {
        match self {
            Model::Mlp(m) => &mut m.ws.inputs[slot],
            Model::Dflash(m) => &mut m.ws.inputs[slot],
        }
    }

    /// The precision the input slots hold hidden states in.
    pub fn input_hs_dtype(&self) -> HsDtype {
        match self {
            Model::Mlp(m) => m.ws.inputs[0].hs.dtype(),
            Model::Dflash(m) => m.ws.inputs[0].hs.dtype(),
        }
    }

    /// Width of one token's `last_hidden_states` (the target's final-norm output), when the family reads them.
    pub fn last_hidden_width(&self) -> Option<usize> {
        match self {
            Model::Mlp(_) | Model::Dflash(_) => None,
        }
    }

    /// Width of one token's hidden state the model reads, and its vocabulary.
    pub fn input_width_and_vocab(&self) -> (usize, usize) {
        match self {
            Model::Mlp(m) => (m.spec().din, m.spec().vocab),
            Model::Dflash(m) => (m.spec().taps * m.spec().hidden, m.spec().vocab),
        }
    }

    /// The `mlp`, when this is one.
    pub fn as_mlp(&self) -> Option<&Mlp<B>> {
        match self {
            Model::Mlp(m) => Some(m),
            Model::Dflash(_) => None,
        }
    }

    /// The `mlp`, to write, when this is one.
    pub fn as_mlp_mut(&mut self) -> Option<&mut Mlp<B>> {
        match self {
            Model::Mlp(m) => Some(m),
            Model::Dflash(_) => None,
        }
    }

    /// The `dflash`, when this is one.
    pub fn as_dflash_mut(&mut self) -> Option<&mut Dflash<B>> {
        match self {
            Model::Dflash(m) => Some(m),
            Model::Mlp(_) => None,
        }
    }
}
