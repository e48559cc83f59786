//! The target's optional loss-mask settings: `end_of_turn` (a token of the vocabulary) and
//! `max_bad_mask_share` (a share in 0..1, default 1%), each error at its value's position.

use draftpipe_compiler::compile_source;
use draftpipe_compiler::plan::DEFAULT_MAX_BAD_MASK_SHARE;

fn plan_with(settings: &str) -> String {
    format!(
        r#"pipeline "p"
target t on cpu {{
    hidden = 8
    tap_layers = [0]
    vocab = 16
    batch_tokens = 64
    source = synthetic(seed = 1, lengths = 1..8)
    {settings}
}}
queue q from t to d {{ capacity = 2 buckets = [8] }}
drafter d on cpu {{ model = mlp(hidden = 4, blocks = 1, intermediate = 4, heads = 1) }}
"#
    )
}

#[test]
fn the_settings_are_optional_and_kept_in_the_plan() {
    let plan = compile_source("p.pipe", &plan_with("")).unwrap();
    assert_eq!(plan.target.masks.end_of_turn, None);
    assert_eq!(plan.target.masks.max_bad_share, DEFAULT_MAX_BAD_MASK_SHARE);
    let plan = compile_source(
        "p.pipe",
        &plan_with("end_of_turn = 15 max_bad_mask_share = 0.05"),
    )
    .unwrap();
    assert_eq!(plan.target.masks.end_of_turn, Some(15));
    assert_eq!(plan.target.masks.max_bad_share, 0.05);
    let json = serde_json::to_string(&plan).unwrap();
    assert!(json.contains("\"end_of_turn\":15"), "{json}");
    // A plan written before the settings existed reads back with the defaults.
    let mut value: serde_json::Value = serde_json::from_str(&json).unwrap();
    value["target"].as_object_mut().unwrap().remove("masks");
    let old: draftpipe_compiler::plan::Plan = serde_json::from_value(value).unwrap();
    assert_eq!(old.target.masks, Default::default());
}

#[test]
fn end_of_turn_must_be_a_token_of_the_vocabulary() {
    let error = compile_source("p.pipe", &plan_with("end_of_turn = 16"))
        .unwrap_err()
        .to_string();
    assert!(
        error.contains(
            "`end_of_turn` must be a token of the vocabulary (below `vocab` = 16), found 16"
        ),
        "{error}"
    );
    assert!(error.contains("p.pipe:8:19"), "{error}");
    let error = compile_source("p.pipe", &plan_with("end_of_turn = -1"))
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("`end_of_turn` must be at least 0"),
        "{error}"
    );
}

#[test]
fn max_bad_mask_share_must_be_a_share() {
    for value in ["1.5", "-0.1"] {
        let error = compile_source(
            "p.pipe",
            &plan_with(&format!("max_bad_mask_share = {value}")),
        )
        .unwrap_err()
        .to_string();
        assert!(
            error.contains("`max_bad_mask_share` must be a share between 0 and 1"),
            "{error}"
        );
        assert!(error.contains("p.pipe:8:26"), "{error}");
    }
    let error = compile_source("p.pipe", &plan_with("max_bad_mask_share = \"some\""))
        .unwrap_err()
        .to_string();
    assert!(error.contains("max_bad_mask_share"), "{error}");
}
