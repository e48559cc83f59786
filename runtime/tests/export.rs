//! The export a `dflash` save writes, as serving engines see it: only engine files at the top (vLLM's directory
//! rule), the training state below (and the older layout still resuming), the target's depth from its
//! `config.json`, and `export-check` on a good export and on broken ones, each with its reason.

mod source_support;

use std::path::Path;

use draftpipe_compiler::plan::{DFLASH_RMS_NORM_EPS, DflashSpec, ModelPlan};
use draftpipe_runtime::checkpoint::*;
use draftpipe_runtime::export_check::{
    CheckOptions, Engine, ExportReport, Severity, Verdict, check_export,
};
use draftpipe_runtime::target_depth::{TargetDepthError, resolve_target_layers};
use safetensors::Dtype;
use source_support::{temp_dir, write_file};

/// The depth of the target the drafter's taps (up to 4) are read from.
const TARGET_LAYERS: usize = 6;

fn spec() -> DflashSpec {
    DflashSpec {
        hidden: 16,
        taps: 3,
        tap_layers: vec![1, 2, 4],
        vocab: 96,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 8,
        intermediate: 24,
        block: 4,
        anchors: 8,
        mask_token: 95,
        rope_theta: 10_000.0,
        rms_norm_eps: DFLASH_RMS_NORM_EPS,
    }
}

fn training_state(step: u64) -> TrainingState {
    TrainingState {
        step,
        optimizer_step: step,
        plan_name: "dflash-export".into(),
        rng_state: vec![1],
        data_positions: vec![step],
        stream_producers: Vec::new(),
    }
}

fn buffers(n: usize) -> [Vec<f32>; 3] {
    [
        (0..n).map(|i| (i as f32 * 0.37).sin()).collect(),
        (0..n).map(|i| (i as f32 * 0.11).cos() * 1e-3).collect(),
        (0..n).map(|i| (i % 7) as f32 * 1e-6).collect(),
    ]
}

/// Saves a `dflash` export of [`spec`] to `dir` (bf16 weights, as served) and returns its buffers.
fn save(dir: &Path, model: &ModelPlan, target_layers: Option<usize>) -> [Vec<f32>; 3] {
    let b = buffers(model.parameters);
    save_checkpoint_as(
        dir,
        model,
        [&b[0], &b[1], &b[2]],
        &training_state(5),
        ExportOptions {
            dtype: WeightsDtype::Bf16,
            target_layers,
            vocab_map: None,
        },
    )
    .unwrap();
    b
}

fn top_level(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    names
}

fn check(dir: &Path) -> ExportReport {
    check_export(dir, &CheckOptions::default()).unwrap()
}

/// The fatal messages `report` has for `engine`.
fn fatal(report: &ExportReport, engine: Engine) -> Vec<String> {
    report
        .findings_for(engine)
        .filter(|f| f.severity == Severity::Fatal)
        .map(|f| f.message.clone())
        .collect()
}

fn rewrite_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join(CONFIG_FILE);
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(&path, serde_json::to_vec_pretty(&config).unwrap()).unwrap();
}

#[test]
fn the_top_level_holds_only_what_engines_load_and_both_load_it() {
    let root = temp_dir("export-layout");
    let dir = root.join("ckpt");
    let model = ModelPlan::new(spec());
    save(&dir, &model, Some(TARGET_LAYERS));
    // vLLM loads every `*.safetensors` at the top of the directory: the weights must be the only one.
    assert_eq!(
        top_level(&dir),
        ["config.json", "model.safetensors", TRAINING_STATE_DIR]
    );
    assert_eq!(
        top_level(&training_state_dir(&dir)),
        ["optimizer.safetensors", "state.json"]
    );
    let report = check(&dir);
    for engine in Engine::ALL {
        assert_eq!(
            report.verdict(engine),
            Verdict::Loads,
            "{engine:?}: {report}"
        );
    }
    let text = report.to_string();
    assert!(
        text.contains("SGLang: loads") && text.contains("vLLM:   loads"),
        "{text}"
    );
    assert!(
        text.contains("--speculative-num-draft-tokens 4")
            && text.contains("\"num_speculative_tokens\": 3"),
        "{text}"
    );
}

#[test]
fn a_checkpoint_of_the_older_layout_still_resumes_and_is_rewritten_in_the_new_one() {
    let root = temp_dir("export-old-layout");
    let dir = root.join("ckpt");
    let model = ModelPlan::new(spec());
    let b = save(&dir, &model, Some(TARGET_LAYERS));
    // The layout every earlier draftpipe wrote: all four files at the top.
    for file in [OPTIMIZER_FILE, STATE_FILE] {
        std::fs::rename(training_state_dir(&dir).join(file), dir.join(file)).unwrap();
    }
    std::fs::remove_dir(training_state_dir(&dir)).unwrap();
    let loaded = load_checkpoint(&dir, &model).unwrap();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    // bf16 weights come with the exact f32 ones in the optimizer file, so the resume is exact.
    assert_eq!(bits(&loaded.params), bits(&b[0]));
    assert_eq!(bits(&loaded.exp_avg), bits(&b[1]));
    assert_eq!(bits(&loaded.exp_avg_sq), bits(&b[2]));
    assert_eq!(loaded.state, training_state(5));
    // vLLM would refuse the old layout: its optimizer file is read as weights.
    let old = check(&dir);
    assert!(
        fatal(&old, Engine::Vllm)
            .iter()
            .any(|m| m.contains("exp_avg.") && m.contains("There is no module or parameter named")),
        "{old}"
    );
    assert_eq!(
        old.verdict(Engine::Sglang),
        Verdict::LoadsWithWarnings,
        "{old}"
    );

    // Saving over it (the next `--save` of the resumed run) writes the new layout and nothing of the old.
    save_checkpoint(&dir, &model, &b[0], &b[1], &b[2], &training_state(6)).unwrap();
    assert_eq!(
        top_level(&dir),
        ["config.json", "model.safetensors", TRAINING_STATE_DIR]
    );
    assert_eq!(load_checkpoint(&dir, &model).unwrap().state.step, 6);
}

#[test]
fn without_a_known_depth_the_export_says_its_depth_is_assumed() {
    let root = temp_dir("export-assumed");
    let dir = root.join("ckpt");
    save(&dir, &ModelPlan::new(spec()), None);
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join(CONFIG_FILE)).unwrap()).unwrap();
    // The deepest tap (4) is captured before layer 4, so the least depth is 5.
    assert_eq!(config["num_target_layers"], 5);
    assert_eq!(config["draftpipe"]["num_target_layers_assumed"], true);
    let report = check(&dir);
    for engine in Engine::ALL {
        assert_eq!(
            report.verdict(engine),
            Verdict::LoadsWithWarnings,
            "{report}"
        );
    }
    assert!(report.to_string().contains("is assumed"), "{report}");
}

#[test]
fn a_renamed_tensor_is_skipped_by_sglang_and_refused_by_vllm() {
    let root = temp_dir("export-renamed");
    let dir = root.join("ckpt");
    let model = ModelPlan::new(spec());
    save(&dir, &model, Some(TARGET_LAYERS));
    // Rewrite the weights with one name changed (`gate_proj` → `gate`), as a hand conversion might.
    let path = dir.join(MODEL_FILE);
    let tensors: Vec<(String, Vec<usize>)> = model
        .layout
        .iter()
        .map(|v| {
            (
                v.name
                    .replace("layers.1.mlp.gate_proj", "layers.1.mlp.gate"),
                v.shape.clone(),
            )
        })
        .collect();
    let owned: Vec<(&str, Dtype, Vec<usize>, Vec<f64>)> = tensors
        .iter()
        .map(|(n, s)| {
            let len = s.iter().product();
            (n.as_str(), Dtype::BF16, s.clone(), vec![0.5; len])
        })
        .collect();
    write_file(&path, &owned);
    let report = check(&dir);
    assert_eq!(
        report.verdict(Engine::Sglang),
        Verdict::DoesNotLoad,
        "{report}"
    );
    assert_eq!(
        report.verdict(Engine::Vllm),
        Verdict::DoesNotLoad,
        "{report}"
    );
    let sglang = fatal(&report, Engine::Sglang).join("\n");
    assert!(
        sglang.contains("no tensor for parameter `layers.1.mlp.gate_proj.weight`")
            && sglang.contains("uninitialised"),
        "{sglang}"
    );
    assert!(
        report
            .findings_for(Engine::Sglang)
            .any(|f| f.severity == Severity::Warning
                && f.message.contains("layers.1.mlp.gate.weight")),
        "{report}"
    );
    let vllm = fatal(&report, Engine::Vllm).join("\n");
    assert!(
        vllm.contains("tensor `layers.1.mlp.gate.weight`")
            && vllm
                .contains("There is no module or parameter named 'model.layers.1.mlp.gate.weight'"),
        "{vllm}"
    );
}

#[test]
fn a_mask_token_outside_the_vocabulary_is_refused_by_both() {
    let root = temp_dir("export-mask");
    let dir = root.join("ckpt");
    save(&dir, &ModelPlan::new(spec()), Some(TARGET_LAYERS));
    rewrite_config(&dir, |c| c["dflash_config"]["mask_token_id"] = 96.into());
    let report = check(&dir);
    for engine in Engine::ALL {
        let messages = fatal(&report, engine).join("\n");
        assert!(
            messages.contains(
                "`dflash_config.mask_token_id` 96 is outside the vocabulary (`vocab_size` 96"
            ),
            "{engine:?}: {report}"
        );
    }
    assert!(!report.all_load());
}

#[test]
fn a_layer_id_beyond_the_targets_depth_is_refused_by_both() {
    let root = temp_dir("export-depth");
    let dir = root.join("ckpt");
    save(&dir, &ModelPlan::new(spec()), Some(TARGET_LAYERS));
    // Target layer 5 is the last of 6: SGLang accepts it (< 6), vLLM cannot capture it (it would need layer 6).
    rewrite_config(&dir, |c| {
        c["dflash_config"]["target_layer_ids"] = serde_json::json!([0, 1, 5])
    });
    let report = check(&dir);
    assert_eq!(report.verdict(Engine::Sglang), Verdict::Loads, "{report}");
    let vllm = fatal(&report, Engine::Vllm).join("\n");
    assert!(
        vllm.contains(
            "`target_layer_ids[2]` = 5 is beyond what vLLM captures from a 6-layer target"
        ),
        "{vllm}"
    );
    // Layer 6 does not exist at all: both refuse.
    rewrite_config(&dir, |c| {
        c["dflash_config"]["target_layer_ids"] = serde_json::json!([0, 1, 6])
    });
    let report = check(&dir);
    let sglang = fatal(&report, Engine::Sglang).join("\n");
    assert!(
        sglang.contains("`target_layer_ids[2]` = 6 is out of range for 6 target layers"),
        "{sglang}"
    );
    assert_eq!(
        report.verdict(Engine::Vllm),
        Verdict::DoesNotLoad,
        "{report}"
    );
}

#[test]
fn the_speculative_token_count_and_the_tokenizer_are_checked_when_given() {
    let root = temp_dir("export-serving");
    let dir = root.join("ckpt");
    save(&dir, &ModelPlan::new(spec()), Some(TARGET_LAYERS));
    let with = |tokens: Option<usize>, tokenizer: Option<&Path>| {
        check_export(
            &dir,
            &CheckOptions {
                tokenizer: tokenizer.map(Path::to_path_buf),
                speculative_tokens: tokens,
            },
        )
        .unwrap()
    };
    assert!(with(Some(3), None).findings.is_empty());
    let long = with(Some(4), None);
    assert!(
        fatal(&long, Engine::Vllm)
            .join("\n")
            .contains("4 speculative tokens draft blocks of 5 slots, but the drafter was trained on blocks of 4"),
        "{long}"
    );
    assert_eq!(
        with(Some(2), None).verdict(Engine::Sglang),
        Verdict::LoadsWithWarnings
    );

    // A tokenizer that has SGLang's `<|MASK|>` as another id than the config's: SGLang refuses.
    let tokenizer = root.join("tokenizer.json");
    let write_tokenizer = |mask_id: u64| {
        let vocab: serde_json::Map<String, serde_json::Value> =
            (0..95u64).map(|i| (format!("t{i}"), i.into())).collect();
        let json = serde_json::json!({
            "model": { "type": "BPE", "vocab": vocab },
            "added_tokens": [{ "id": mask_id, "content": "<|MASK|>", "special": true }],
        });
        std::fs::write(&tokenizer, json.to_string()).unwrap();
    };
    write_tokenizer(95);
    assert!(with(None, Some(&tokenizer)).findings.is_empty());
    write_tokenizer(94);
    let conflict = with(None, Some(&tokenizer));
    assert!(
        fatal(&conflict, Engine::Sglang).join("\n").contains(
            "the tokenizer has `<|MASK|>` as id 94, but `dflash_config.mask_token_id` is 95"
        ),
        "{conflict}"
    );
    assert_eq!(conflict.verdict(Engine::Vllm), Verdict::Loads);
    // An unreadable tokenizer is an error naming the file, line and column.
    std::fs::write(&tokenizer, "{\"model\": ").unwrap();
    let error = check_export(
        &dir,
        &CheckOptions {
            tokenizer: Some(tokenizer.clone()),
            speculative_tokens: None,
        },
    )
    .unwrap_err()
    .to_string();
    assert!(
        error.contains("tokenizer.json") && error.contains("line 1, column 10"),
        "{error}"
    );
}

#[test]
fn the_targets_depth_comes_from_the_config_beside_its_weights() {
    let root = temp_dir("export-target-config");
    let weights = root.join("target");
    std::fs::create_dir_all(&weights).unwrap();
    let pipe = |layers: &str| {
        format!(
            r#"
pipeline "depth"
target t on cpu {{
    hidden       = 16
    {layers}
    tap_layers   = [1, 2, 4]
    vocab        = 96
    batch_tokens = 64
    source       = synthetic(seed = 1, lengths = 8..32)
    weights      = safetensors(path = "{}")
}}
queue q from t to d {{ capacity = 4  buckets = [32] }}
drafter d on cpu {{
    model = dflash(layers = 2, heads = 4, kv_heads = 2, head_dim = 8, intermediate = 24, block = 4, anchors = 8, mask_token = 95, rope_theta = 10000)
    steps = 1
}}
"#,
            weights.display()
        )
    };
    let compile =
        |layers: &str| draftpipe_compiler::compile_source("depth.pipe", &pipe(layers)).unwrap();
    std::fs::write(weights.join("config.json"), r#"{"num_hidden_layers": 36}"#).unwrap();
    assert_eq!(
        resolve_target_layers(&compile("")).unwrap().target.layers,
        Some(36)
    );
    assert_eq!(
        resolve_target_layers(&compile("layers = 36"))
            .unwrap()
            .target
            .layers,
        Some(36)
    );
    let disagree = resolve_target_layers(&compile("layers = 28")).unwrap_err();
    assert!(
        matches!(
            disagree,
            TargetDepthError::Disagrees {
                found: 36,
                pipeline: 28,
                ..
            }
        ),
        "{disagree}"
    );
    std::fs::write(
        weights.join("config.json"),
        r#"{"text_config": {"num_hidden_layers": 3}}"#,
    )
    .unwrap();
    let shallow = resolve_target_layers(&compile("")).unwrap_err().to_string();
    assert!(
        shallow.contains("tap 4 is beyond the target's 3 layers"),
        "{shallow}"
    );
    std::fs::write(
        weights.join("config.json"),
        "{\"num_hidden_layers\": \"36\"}",
    )
    .unwrap();
    let bad = resolve_target_layers(&compile("")).unwrap_err().to_string();
    assert!(
        bad.contains("config.json") && bad.contains("expected a positive integer"),
        "{bad}"
    );
}
