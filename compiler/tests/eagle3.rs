//! The `eagle3` drafter in the language: the spec the checker builds from `model = eagle3(...)`, the loss's
//! `step_decay` (SpecForge's 0.8 when absent), the draft vocabulary map, the shipped pipelines and the Qwen3-8B
//! config they must agree with.

use std::path::Path;

use draftpipe_compiler::plan::*;
use draftpipe_compiler::summary::Summary;
use draftpipe_compiler::{DEFAULT_STEP_DECAY, compile_file, compile_source};

/// A small eagle3 drafter on a synthetic target, with `LOSS` and `EXTRA` drafter lines filled in by each test.
fn pipeline(loss: &str, extra: &str) -> String {
    format!(
        r#"
pipeline "eagle3-example"
target t on cpu {{
    hidden       = 64
    tap_layers   = [1, 2, 3]
    vocab        = 512
    batch_tokens = 256
    source       = synthetic(seed = 1, lengths = 8..64)
}}
queue q from t to d {{ capacity = 4  buckets = [64] }}
drafter d on cpu {{
    model = eagle3(heads = 4, kv_heads = 2, head_dim = 16, intermediate = 128, ttt = 5, draft_vocab = 200, rope_theta = 10000)
    {loss}
    {extra}
    steps = 100
}}
"#
    )
}

fn compile(text: &str) -> Plan {
    compile_source("eagle3.pipe", text).unwrap_or_else(|d| panic!("{d}"))
}

#[test]
fn the_checker_builds_the_spec_from_the_arguments_and_the_target() {
    let plan = compile(&pipeline("", ""));
    assert_eq!(
        plan.model.spec.as_eagle3(),
        Some(&Eagle3Spec {
            hidden: 64,
            taps: 3,
            tap_layers: vec![1, 2, 3],
            vocab: 512,
            draft_vocab: 200,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            intermediate: 128,
            ttt: 5,
            rope_theta: 10000.0,
            rms_norm_eps: EAGLE3_RMS_NORM_EPS,
        })
    );
    assert_eq!(plan.model.spec.kind(), "eagle3");
    assert!(plan.model.spec.reads_target_weights());
    assert!(plan.model.spec.takes_vocab_map());
    assert_eq!(plan.model.parameters, plan.model.spec.parameter_count());
    assert!(
        plan.buckets
            .iter()
            .all(|b| b.step_flops > 0 && b.step_bytes > 0)
    );
    // The frozen embedding and lm_head are counted on the drafter's device.
    assert!(plan.memory[0].frozen_weights > 0);
}

#[test]
fn ttt_defaults_to_specforges_seven() {
    let text = pipeline("", "").replace("ttt = 5, ", "");
    assert_eq!(
        compile(&text).model.spec.as_eagle3().unwrap().ttt,
        EAGLE3_DEFAULT_TTT
    );
}

#[test]
fn step_decay_is_specforges_when_absent_and_as_written_otherwise() {
    let absent = compile(&pipeline("", "")).drafter.loss;
    assert_eq!(absent.step_decay, Some(DEFAULT_STEP_DECAY));
    assert_eq!(DEFAULT_STEP_DECAY, 0.8);
    let no_decay_key = compile(&pipeline("loss = cross_entropy(chunk_tokens = 32)", ""));
    assert_eq!(no_decay_key.drafter.loss.step_decay, Some(0.8));
    assert_eq!(no_decay_key.drafter.loss.chunk_tokens, 32);
    let written = compile(&pipeline("loss = cross_entropy(step_decay = 0.7)", ""));
    assert_eq!(written.drafter.loss.step_decay, Some(0.7));
    // The other families have none.
    let mlp = compile(
        &pipeline("", "").replace(
            "model = eagle3(heads = 4, kv_heads = 2, head_dim = 16, intermediate = 128, ttt = 5, draft_vocab = 200, rope_theta = 10000)",
            "model = mlp(hidden = 32, blocks = 1, intermediate = 64, heads = 2)",
        ),
    );
    assert_eq!(mlp.drafter.loss.step_decay, None);
}

#[test]
fn the_vocabulary_map_is_the_drafters_and_absent_from_json_when_not_given() {
    let given = compile(&pipeline("", r#"vocab_map = "maps/draft.safetensors""#));
    assert_eq!(
        given.drafter.vocab_map.as_deref(),
        Some("maps/draft.safetensors")
    );
    let summary = Summary(&given).to_string();
    assert!(
        summary.contains("draft vocabulary map (d2t, t2d) from `maps/draft.safetensors`"),
        "{summary}"
    );
    let counted = compile(&pipeline("", ""));
    assert_eq!(counted.drafter.vocab_map, None);
    let json = serde_json::to_string(&counted.drafter).unwrap();
    assert!(!json.contains("vocab_map"), "{json}");
    assert!(
        Summary(&counted)
            .to_string()
            .contains("counted from the source's data before training")
    );
}

#[test]
fn the_summary_names_the_family_and_its_unroll() {
    let summary = Summary(&compile(&pipeline("", ""))).to_string();
    assert!(
        summary.contains("model eagle3: hidden 64 × 3 taps, 4/2 heads × 16, intermediate 128, ttt 5, draft vocab 200 of 512"),
        "{summary}"
    );
    assert!(
        summary.contains("cross_entropy(step_decay 0.8"),
        "{summary}"
    );
}

fn repo() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

#[test]
fn the_quickstart_compiles_to_a_small_cpu_eagle3_drafter() {
    let plan = compile_file(&repo().join("pipelines/eagle3-quickstart.pipe")).unwrap();
    let spec = plan.model.spec.as_eagle3().unwrap();
    assert_eq!((spec.hidden, spec.ttt, spec.draft_vocab), (64, 7, 256));
    assert_eq!(plan.drafter.loss.step_decay, Some(0.8));
    assert!(
        plan.drafter
            .placement
            .workers
            .iter()
            .all(|d| *d == Device::Cpu)
    );
}

/// `pipelines/eagle3-qwen3-8b.pipe` is SpecForge's Qwen3-8B EAGLE-3 shape as `configs/qwen3-8b-eagle3.json`
/// writes it, taps included (`eagle_aux_hidden_state_layer_ids` = taps − 1), and compiles with memory and FLOPs.
#[test]
fn the_qwen3_8b_pipeline_matches_its_config_and_has_memory_and_flops() {
    let plan = compile_file(&repo().join("pipelines/eagle3-qwen3-8b.pipe")).unwrap();
    let spec = plan.model.spec.as_eagle3().unwrap();
    let text = std::fs::read_to_string(repo().join("configs/qwen3-8b-eagle3.json")).unwrap();
    let config: serde_json::Value = serde_json::from_str(&text).unwrap();
    let number = |key: &str| config[key].as_f64().unwrap_or_else(|| panic!("{key}"));
    assert_eq!(config["architectures"][0], "LlamaForCausalLMEagle3");
    assert_eq!(number("hidden_size"), spec.hidden as f64);
    assert_eq!(number("target_hidden_size"), spec.hidden as f64);
    assert_eq!(number("num_attention_heads"), spec.heads as f64);
    assert_eq!(number("num_key_value_heads"), spec.kv_heads as f64);
    assert_eq!(number("head_dim"), spec.head_dim as f64);
    assert_eq!(number("intermediate_size"), spec.intermediate as f64);
    assert_eq!(number("vocab_size"), spec.vocab as f64);
    assert_eq!(number("draft_vocab_size"), spec.draft_vocab as f64);
    assert_eq!(number("rope_theta"), f64::from(spec.rope_theta));
    assert_eq!(number("rms_norm_eps") as f32, spec.rms_norm_eps);
    assert_eq!(number("ttt_length"), spec.ttt as f64);
    assert_eq!(
        number("num_target_layers"),
        plan.target.layers.unwrap() as f64
    );
    let layer_ids: Vec<u64> = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|id| id.as_u64().unwrap())
        .collect();
    let taps: Vec<u64> = spec.tap_layers.iter().map(|&t| t as u64 - 1).collect();
    assert_eq!(layer_ids, taps);
    // SpecForge's default capture for a 36-layer target: [1, L/2 − 1, L − 4].
    assert_eq!(layer_ids, [1, 17, 32]);
    assert!(plan.buckets.iter().all(|b| b.step_flops > 0));
    assert!(
        plan.memory
            .iter()
            .all(|m| m.workspaces > 0 && m.frozen_weights > 0)
    );
    assert!(plan.host_memory.hs_pool() > 0);
}
