//! Every family answers through its `Family` the same as its spec does, for every shipped pipeline: the name
//! the file writes, the closed-form parameter count in both widths, the flat layout packed back to back, and a
//! plan that is plain serde data (its JSON reads back to the same plan).

use std::path::Path;

use draftpipe_compiler::compile_file;
use draftpipe_compiler::plan::Plan;

fn shipped() -> Vec<(String, Plan, String)> {
    let dir = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../pipelines"));
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "pipe"))
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|path| {
            let plan = compile_file(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let text = std::fs::read_to_string(&path).unwrap();
            (path.display().to_string(), plan, text)
        })
        .collect()
}

#[test]
fn every_family_answers_as_its_spec_for_every_shipped_pipeline() {
    let plans = shipped();
    let kinds: Vec<&str> = plans.iter().map(|(_, p, _)| p.model.spec.kind()).collect();
    for family in ["mlp", "dflash", "eagle3"] {
        assert!(
            kinds.contains(&family),
            "no shipped pipeline uses `{family}`"
        );
    }
    for (name, plan, text) in &plans {
        let family = plan.model.spec.family();
        assert_eq!(family.name(), plan.model.spec.kind(), "{name}");
        assert!(
            text.contains(&format!("model     = {}(", family.name())),
            "{name}: the file does not write `{}`",
            family.name()
        );
        assert_eq!(family.parameter_count(), plan.model.parameters, "{name}");
        assert_eq!(
            family.parameter_count_wide(),
            plan.model.parameters as u128,
            "{name}"
        );
        let mut offset = 0;
        for view in &plan.model.layout {
            assert_eq!(view.offset, offset, "{name}: {}", view.name);
            offset += view.len();
        }
        assert_eq!(offset, plan.model.parameters, "{name}");
        let workspace = plan.workspace_layout(plan.drafter.placement.workers[0]);
        assert!(workspace.and_then(|w| w.bytes()).is_some(), "{name}");
        let json = serde_json::to_string(plan).unwrap();
        let back: Plan = serde_json::from_str(&json).unwrap();
        assert_eq!(&back, plan, "{name}");
    }
}
