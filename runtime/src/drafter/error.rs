//! Why a drafter call fails: a batch or state that does not fit the model ([`StepError`], the caller's to
//! report against the batch), and everything else a drafter can meet ([`DrafterError`]: the backend, the
//! model's buffers, the frozen tables, the call order).

use crate::backend::BackendError;
use crate::model::family::BuildError;
use crate::model::step::{AllocateError, LayoutError};

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
    /// The model plan's layout is not the canonical layout this step computes with, or a dimension is zero.
    #[error("model layout differs from the canonical layout or has an empty dimension")]
    Layout,
    /// The batch has no tokens.
    #[error("batch has no tokens")]
    EmptyBatch,
    /// The drafter reads the target's final-norm output (EAGLE-3's teacher) and the batch has none.
    #[error(
        "batch has no last_hidden_states; this drafter's teacher reads them ([tokens, {hidden}], the target's \
         final-norm output)"
    )]
    MissingLastHiddenStates {
        /// Their width per token.
        hidden: usize,
    },
    /// The batch's `last_hidden_states` are in another precision than its hidden states.
    #[error("batch last_hidden_states are {got}, its hidden states {expected}")]
    LastHiddenDtype {
        /// The hidden states' precision.
        expected: &'static str,
        /// The last hidden states' precision.
        got: &'static str,
    },
    /// The batch's hidden states are in a precision the input slots cannot hold without rounding.
    #[error("batch hidden states are {got}, the drafter's input slots hold {expected}")]
    HsDtype {
        /// The input slots' precision.
        expected: &'static str,
        /// The batch's precision.
        got: &'static str,
    },
}

/// Why a drafter call failed.
#[derive(Debug, thiserror::Error)]
pub enum DrafterError {
    /// The batch or state does not fit the model.
    #[error(transparent)]
    Batch(#[from] StepError),
    /// The backend failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// The model's buffers could not be set up.
    #[error(transparent)]
    Allocate(#[from] AllocateError),
    /// The model plan cannot be trained.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// The plan's workspace does not fit in memory sizes.
    #[error("the workspace of this plan overflows the address space")]
    WorkspaceTooLarge,
    /// The target's frozen tensors do not fit the model (or the model has none).
    #[error("frozen target weights: {0}")]
    Frozen(String),
    /// The CPU drafter's threads could not be started (the OS refused a thread).
    #[error("cannot start the CPU drafter's threads")]
    Threads(#[source] rayon::ThreadPoolBuildError),
    /// `step` was called without a staged batch.
    #[error("no batch staged: call stage() before step()")]
    NothingStaged,
    /// A step's outcome is still to be collected with `finish()`.
    #[error("a step is in flight: call finish() first")]
    StepInFlight,
}

impl From<BuildError> for DrafterError {
    fn from(error: BuildError) -> Self {
        match error {
            BuildError::Layout(e) => DrafterError::Layout(e),
            BuildError::Allocate(e) => DrafterError::Allocate(e),
            BuildError::WorkspaceTooLarge => DrafterError::WorkspaceTooLarge,
        }
    }
}
