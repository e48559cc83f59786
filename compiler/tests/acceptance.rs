//! The `acceptance` section: the plan's `AcceptanceSpec` with its defaults, spanned errors for bad keys and
//! values, and the refusal for a family the draft-and-verify loop cannot draft with.

use draftpipe_compiler::plan::{AcceptanceSpec, Plan};
use draftpipe_compiler::summary::Summary;
use draftpipe_compiler::{DEFAULT_MAX_NEW_TOKENS, DEFAULT_TIMEOUT_MS, compile_source};

const DFLASH: &str = "dflash(layers = 1, heads = 2, kv_heads = 1, head_dim = 16, intermediate = 64, \
                      block = 4, anchors = 8, mask_token = 511, rope_theta = 10000)";
const MLP: &str = "mlp(hidden = 32, blocks = 1, intermediate = 64, heads = 2)";
const EAGLE3: &str = "eagle3(heads = 2, kv_heads = 1, head_dim = 16, intermediate = 64, draft_vocab = 100, \
                      rope_theta = 10000)";

/// A small pipeline on a synthetic target with `model` and an `acceptance` section of `settings`.
fn pipeline(model: &str, settings: &str) -> String {
    format!(
        r#"pipeline "acceptance"
target t on cpu {{
    hidden       = 64
    tap_layers   = [1, 2, 3]
    vocab        = 512
    batch_tokens = 256
    source       = synthetic(seed = 1, lengths = 8..64)
}}
queue q from t to d {{ capacity = 4  buckets = [64] }}
drafter d on cpu {{
    model = {model}
    steps = 100
}}
acceptance {{
{settings}
}}
"#
    )
}

fn compile(text: &str) -> Plan {
    compile_source("acceptance.pipe", text).unwrap_or_else(|d| panic!("{d}"))
}

fn errors(text: &str) -> String {
    compile_source("acceptance.pipe", text)
        .expect_err("the file is invalid")
        .to_string()
}

#[test]
fn the_section_becomes_the_plans_acceptance_spec_with_its_defaults() {
    let plan = compile(&pipeline(
        DFLASH,
        r#"target = "runs/walk/target"  prompts = "runs/walk/eval.jsonl"  every = 200"#,
    ));
    assert_eq!(
        plan.acceptance,
        Some(AcceptanceSpec {
            target: "runs/walk/target".into(),
            prompts: "runs/walk/eval.jsonl".into(),
            every: 200,
            max_new_tokens: DEFAULT_MAX_NEW_TOKENS,
            python: None,
            timeout_ms: DEFAULT_TIMEOUT_MS,
        })
    );
    let full = compile(&pipeline(
        DFLASH,
        r#"target = "t"  prompts = "p.jsonl"  every = 5  max_new_tokens = 24  python = "venv/bin/python"
           timeout = 90s"#,
    ));
    let spec = full.acceptance.as_ref().expect("acceptance");
    assert_eq!(
        (spec.max_new_tokens, spec.python.as_deref(), spec.timeout_ms),
        (24, Some("venv/bin/python"), 90_000)
    );
    let summary = Summary(&full).to_string();
    assert!(
        summary
            .contains("acceptance: every 5 steps, the draft-and-verify loop against t on p.jsonl"),
        "{summary}"
    );
    // The plan's JSON round-trips, and a plan without the section has none.
    let json = serde_json::to_string(&full).unwrap();
    assert_eq!(serde_json::from_str::<Plan>(&json).unwrap(), full);
    let without = compile(&pipeline(DFLASH, "").replace("acceptance {\n\n}\n", ""));
    assert_eq!(without.acceptance, None);
}

#[test]
fn bad_keys_and_values_are_spanned_errors() {
    let text = pipeline(
        DFLASH,
        r#"target = ""  prompts = 3  every = 0  max_new_tokens = -1  timeout = 5  promts = "x""#,
    );
    let out = errors(&text);
    for expected in [
        "acceptance.pipe:15:10",
        "`target` must not be empty",
        "acceptance.pipe:15:24",
        "`prompts` expects a string",
        "`every` must be at least 1",
        "`max_new_tokens` must be at least 1",
        "`timeout` expects a duration",
        "unknown key `promts` in `acceptance`",
        "did you mean `prompts`?",
    ] {
        assert!(out.contains(expected), "missing {expected:?} in:\n{out}");
    }
    let missing = errors(&pipeline(DFLASH, r#"target = "t""#));
    for expected in [
        "missing required key `prompts` in `acceptance`",
        "missing required key `every` in `acceptance`",
    ] {
        assert!(
            missing.contains(expected),
            "missing {expected:?} in:\n{missing}"
        );
    }
    let twice = errors(&format!(
        "{}acceptance {{ target = \"t\" prompts = \"p\" every = 1 }}\n",
        pipeline(DFLASH, r#"target = "t" prompts = "p" every = 1"#)
    ));
    assert!(
        twice.contains("a pipeline has one `acceptance` section"),
        "{twice}"
    );
}

#[test]
fn a_family_without_a_draft_and_verify_loop_is_refused_at_the_section() {
    let settings = r#"target = "t"  prompts = "p.jsonl"  every = 10"#;
    for (model, name) in [(MLP, "mlp"), (EAGLE3, "eagle3")] {
        let mut text = pipeline(model, settings);
        if name == "mlp" {
            text = text.replace("tap_layers   = [1, 2, 3]", "tap_layers   = [1, 2]");
        }
        let out = errors(&text);
        for expected in [
            format!(
                "the acceptance loop drafts with `dflash` exports only; this drafter is `{name}`"
            ),
            "acceptance.pipe:14:1".to_owned(),
            format!("model is `{name}`"),
            "EAGLE-3's tree loop is not written".to_owned(),
        ] {
            assert!(out.contains(&expected), "missing {expected:?} in:\n{out}");
        }
    }
}
