//! The one place that names every model family: the plan's model (`ModelSpec`, the compiler's) to the
//! family's constructor ([`build`]) and to its spec-level facts ([`spec`]). A new family is its folder under
//! `model/` and one line in each of the two matches here.
//!
//! ```text
//!  ModelPlan ──build──▶ mlp::build │ dflash::build ──▶ (Box<dyn Family<B>>, its WorkspaceLayout) ──▶ Drafter<B>
//!  ModelSpec ──spec───▶ &MlpSpec │ &DflashSpec as &dyn FamilySpec ──▶ pipeline, checkpoint, eval, run
//! ```

use draftpipe_compiler::plan::{
    AdamWSpec, BucketPlan, LossSpec, ModelPlan, ModelSpec, Precision, WorkspaceLayout,
};

use crate::backend::Backend;
use crate::batch::HsDtype;
use crate::model::family::Family;
use crate::model::serving::FamilySpec;
use crate::model::step::{AllocateError, LayoutError};
use crate::model::{dflash, mlp};

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

/// A family built on a backend, with the workspace layout its buffers were allocated from.
pub type Built<B> = (Box<dyn Family<B>>, WorkspaceLayout);

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

/// The family facts of the plan's model (what the runtime reads without a backend).
pub fn spec(spec: &ModelSpec) -> &dyn FamilySpec {
    match spec {
        ModelSpec::Mlp(spec) => spec,
        ModelSpec::Dflash(spec) => spec,
    }
}

/// The family `plan.model` names, on `backend`, with its workspace (allocated here, once).
///
/// # Errors
/// [`BuildError`].
pub fn build<B: Backend>(backend: &mut B, plan: FamilyPlan<'_>) -> Result<Built<B>, BuildError> {
    match &plan.model.spec {
        ModelSpec::Mlp(_) => mlp::build(backend, plan),
        ModelSpec::Dflash(_) => dflash::build(backend, plan),
    }
}
