//! What every family's step shares with the drafter above it: the step's shape, the phase times a step
//! reports, the allocation of the workspace's buffers by name (input slots included) and the errors of
//! reading a plan's layout. Families (`model::mlp`, `model::dflash`, …) and the drafter import these; nothing
//! here names a family or a backend's type.

use std::time::Duration;

use draftpipe_compiler::plan::WorkspaceLayout;
use draftpipe_compiler::workspace::Dtype;

use crate::backend::{Backend, BackendError, Buf, Element, HsBuf, InputSlot};

/// Tokens and sequences of one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepShape {
    /// Padded length of every sequence.
    pub padded_len: usize,
    /// Sequences.
    pub sequences: usize,
}

impl StepShape {
    /// Tokens of the step.
    pub fn tokens(&self) -> usize {
        self.padded_len * self.sequences
    }
}

/// Host wall-clock time of each phase of a forward/backward pass (on CUDA only the enqueueing).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PhaseTimes {
    /// Forward pass up to the final norm.
    pub forward: Duration,
    /// Heads, fused vocabulary loss and the heads' backward, including their GEMMs and the `lm_head` gradient.
    pub loss: Duration,
    /// Backward from the final norm to the first layer.
    pub backward: Duration,
}

/// Allocates the buffer `name` of `layout` on `backend`, at the length the layout gives it.
///
/// # Errors
/// [`MissingBuffer`] when the layout has no such buffer; backend failures.
pub fn take_buffer<B: Backend, T: Element>(
    backend: &mut B,
    layout: &WorkspaceLayout,
    name: &str,
) -> Result<Buf<B, T>, AllocateError> {
    let len = layout
        .elements(name)
        .ok_or_else(|| MissingBuffer(name.to_owned()))?;
    Ok(backend.alloc(len)?)
}

/// The model plan cannot be trained by this step.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// A tensor is missing, has another shape, or `up` does not follow `gate`.
    #[error("model layout: tensor {0} missing or mis-shaped")]
    Tensor(String),
    /// A dimension is zero.
    #[error("model layout: a dimension is zero")]
    EmptyDimension,
    /// The plan's model family is not the one this step trains.
    #[error("model `{0}` cannot be trained by this build yet (only `mlp` can)")]
    Unsupported(&'static str),
    /// The parameter count differs from the layout's.
    #[error("model has {got} parameters, its layout {expected}")]
    Parameters {
        /// From the layout.
        expected: usize,
        /// From the plan.
        got: usize,
    },
}

/// The workspace layout lacks a buffer the step uses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("workspace layout has no buffer `{0}`")]
pub struct MissingBuffer(pub String);

/// Allocates input slot `slot` of `layout` (every model's batch buffers; the hidden states in the layout's
/// dtype of `input{slot}.hs`, and `input{slot}.last_hs` in its dtype when the layout has it).
///
/// # Errors
/// When the layout lacks a buffer or the backend cannot allocate.
pub fn input_slot<B: Backend>(
    backend: &mut B,
    layout: &WorkspaceLayout,
    slot: usize,
) -> Result<InputSlot<B>, AllocateError> {
    let last = format!("input{slot}.last_hs");
    Ok(InputSlot {
        hs: take_hs_buffer(backend, layout, &format!("input{slot}.hs"))?,
        last_hidden_states: match layout.elements(&last) {
            Some(_) => Some(take_hs_buffer(backend, layout, &last)?),
            None => None,
        },
        input_ids: take_buffer(backend, layout, &format!("input{slot}.input_ids"))?,
        seq_lens: take_buffer(backend, layout, &format!("input{slot}.seq_lens"))?,
        loss_mask: take_buffer(backend, layout, &format!("input{slot}.loss_mask"))?,
    })
}

/// Allocates the hidden-state buffer `name` of `layout` in the dtype the layout gives it.
fn take_hs_buffer<B: Backend>(
    backend: &mut B,
    layout: &WorkspaceLayout,
    name: &str,
) -> Result<HsBuf<B>, AllocateError> {
    let dtype = layout
        .buffers
        .iter()
        .find(|b| b.name == name)
        .map(|b| b.dtype);
    Ok(match dtype {
        Some(Dtype::Bf16) => HsBuf::Bf16(take_buffer(backend, layout, name)?),
        Some(Dtype::F16) => HsBuf::F16(take_buffer(backend, layout, name)?),
        _ => HsBuf::F32(take_buffer(backend, layout, name)?),
    })
}

/// Why a model's buffers could not be allocated.
#[derive(Debug, thiserror::Error)]
pub enum AllocateError {
    /// The layout lacks a buffer.
    #[error(transparent)]
    Missing(#[from] MissingBuffer),
    /// The backend failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
}
