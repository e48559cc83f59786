//! The one place that names every model family: the plan's model (`ModelSpec`, the compiler's) to the
//! family's constructor ([`build`]) and to its spec-level facts ([`spec`]). A new family is its folder under
//! `model/` and one line in each of the two matches here.
//!
//! ```text
//!  ModelPlan ──build──▶ mlp::build │ dflash::build ──▶ (Box<dyn Family<B>>, its WorkspaceLayout) ──▶ Drafter<B>
//!  ModelSpec ──spec───▶ &MlpSpec │ &DflashSpec as &dyn FamilySpec ──▶ pipeline, checkpoint, eval, run
//! ```

use draftpipe_compiler::plan::ModelSpec;

use crate::backend::Backend;
use crate::model::family::{BuildError, Built, FamilyPlan};
use crate::model::serving::FamilySpec;
use crate::model::{dflash, eagle3, mlp};

/// The family facts of the plan's model (what the runtime reads without a backend).
pub fn spec(spec: &ModelSpec) -> &dyn FamilySpec {
    match spec {
        ModelSpec::Mlp(spec) => spec,
        ModelSpec::Dflash(spec) => spec,
        ModelSpec::Eagle3(spec) => spec,
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
        ModelSpec::Eagle3(_) => eagle3::build(backend, plan),
    }
}
