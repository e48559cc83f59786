//! The target's optional `max_rate`: items per second per producer worker, positive and finite.

use draftpipe_compiler::compile_source;

fn plan_with(max_rate: &str) -> String {
    format!(
        r#"pipeline "p"
target t on cpu {{
    hidden = 8
    tap_layers = [0]
    vocab = 16
    batch_tokens = 64
    source = synthetic(seed = 1, lengths = 1..8)
    {max_rate}
}}
queue q from t to d {{ capacity = 2 buckets = [8] }}
drafter d on cpu {{ model = mlp(hidden = 4, blocks = 1, intermediate = 4, heads = 1) }}
"#
    )
}

#[test]
fn max_rate_is_optional_and_kept_in_the_plan() {
    let plan = compile_source("p.pipe", &plan_with("")).unwrap();
    assert_eq!(plan.target.max_rate, None);
    let plan = compile_source("p.pipe", &plan_with("max_rate = 2.5")).unwrap();
    assert_eq!(plan.target.max_rate, Some(2.5));
    let json = serde_json::to_string(&plan).unwrap();
    assert!(json.contains("\"max_rate\":2.5"), "{json}");
}

#[test]
fn max_rate_must_be_a_positive_number() {
    for (value, found) in [("-2", "found -2"), ("0", "found 0")] {
        let error = compile_source("p.pipe", &plan_with(&format!("max_rate = {value}")))
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("`max_rate` must be a positive number of items per second"),
            "{error}"
        );
        assert!(error.contains(found), "{error}");
        assert!(error.contains("p.pipe:8:16"), "{error}");
    }
    let error = compile_source("p.pipe", &plan_with("max_rate = \"fast\""))
        .unwrap_err()
        .to_string();
    assert!(error.contains("max_rate"), "{error}");
}
