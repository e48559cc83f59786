//! The one place that names every model family: the plan's model (`ModelSpec`, the compiler's) to the
//! family's constructor ([`build`]) and to its spec-level facts ([`spec`]). A new family is its folder under
//! `model/` and one line in each of the two matches here.
//!
//! ```text
//!  ModelPlan ──build──▶ family::build::<Mlp │ Dflash │ Eagle3> (one path: FamilyModel's offsets, workspace,
//!                      allocate) ──▶ (Box<dyn Family<B>>, its WorkspaceLayout) ──▶ Drafter<B>
//!  ModelSpec ──spec───▶ &MlpSpec │ &DflashSpec │ &Eagle3Spec as &dyn FamilySpec ──▶ pipeline, checkpoint, eval, run
//! ```

use draftpipe_compiler::plan::ModelSpec;

use crate::backend::Backend;
use crate::model::dflash::Dflash;
use crate::model::eagle3::Eagle3;
use crate::model::family::{self, BuildError, Built, FamilyPlan};
use crate::model::mlp::Mlp;
use crate::model::serving::FamilySpec;

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
        ModelSpec::Mlp(_) => family::build::<B, Mlp<B>>(backend, plan),
        ModelSpec::Dflash(_) => family::build::<B, Dflash<B>>(backend, plan),
        ModelSpec::Eagle3(_) => family::build::<B, Eagle3<B>>(backend, plan),
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use draftpipe_compiler::compile_file;

    use super::spec;
    use crate::model::serving::ExportOptions;

    /// Every pipeline shipped, so a family's pipelines check its registry entry as soon as they exist: the
    /// entry answers to the plan's family name, and a serving config holds its architecture and a value for
    /// every structural key (a key it lacks would make every checkpoint's config "missing" it).
    #[test]
    fn every_shipped_pipeline_has_a_consistent_family_entry() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../pipelines");
        let mut checked = 0;
        for entry in std::fs::read_dir(&dir).expect("pipelines/") {
            let path = entry.expect("entry").path();
            if path.extension().is_none_or(|e| e != "pipe") {
                continue;
            }
            let plan = compile_file(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let family = spec(&plan.model.spec);
            assert_eq!(family.name(), plan.model.spec.kind(), "{}", path.display());
            let Some(config) = family.serving_config(ExportOptions::default()) else {
                assert!(family.structural_keys().is_empty(), "{}", path.display());
                continue;
            };
            let architecture = family
                .architecture()
                .expect("a config names its architecture");
            assert!(
                config["architectures"]
                    .as_array()
                    .is_some_and(|a| a.iter().any(|n| n == architecture)),
                "{}: architectures {} lack {architecture}",
                path.display(),
                config["architectures"]
            );
            for key in family.structural_keys() {
                let value = key.split('.').try_fold(&config, |v, k| v.get(k));
                assert!(
                    value.is_some_and(|v| !v.is_null()),
                    "{}: structural key {key} is not in the serving config",
                    path.display()
                );
            }
            checked += 1;
        }
        assert!(
            checked > 0,
            "no pipeline with a serving config in {}",
            dir.display()
        );
    }
}
