//! The serving-engine side of a `dflash` checkpoint: `config.json` (checked against a hand-written one for
//! `pipelines/dflash-5x3.pipe`), `model.safetensors` under z-lab's names in f32 (exact) and bf16 (rounded to
//! nearest even, with the exact weights kept for resume), and `--init` reading them back with errors that name
//! the file and the key or tensor.

mod source_support;

use std::path::{Path, PathBuf};

use draftpipe_compiler::plan::{DFLASH_RMS_NORM_EPS, DflashSpec, ModelPlan};
use draftpipe_runtime::checkpoint::hf::check_config;
use draftpipe_runtime::checkpoint::*;
use draftpipe_runtime::model::dflash::serving::dflash_config;
use safetensors::{Dtype, SafeTensors};
use source_support::{small_model, temp_dir};

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

/// Values of every magnitude and sign (normal floats: bf16 rounding is then checked on real numbers, and
/// ties to even come up among the low bits).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed;
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let bits = (state >> 32) as u32;
            let exponent = 100 + (bits >> 24) % 54; // 2^-27 .. 2^26
            f32::from_bits((bits & 0x807f_ffff) | (exponent << 23))
        })
        .collect()
}

/// The depth of the target `spec()`'s taps are read from.
const TARGET_LAYERS: usize = 6;

fn training_state() -> TrainingState {
    TrainingState {
        step: 3,
        optimizer_step: 3,
        plan_name: "dflash-test".into(),
        rng_state: vec![0],
        data_positions: vec![3],
        stream_producers: Vec::new(),
    }
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

fn save(dir: &Path, model: &ModelPlan, dtype: WeightsDtype) -> [Vec<f32>; 3] {
    let n = model.parameters;
    let buffers = [
        values(n, 1),
        values(n, 2),
        values(n, 3).iter().map(|v| v.abs()).collect(),
    ];
    save_checkpoint_as(
        dir,
        model,
        [&buffers[0], &buffers[1], &buffers[2]],
        &training_state(),
        ExportOptions {
            dtype,
            target_layers: Some(TARGET_LAYERS),
            vocab_map: None,
        },
    )
    .unwrap();
    buffers
}

/// The names, dtypes and shapes of a safetensors file, in the file's order.
fn header(path: &Path) -> Vec<(String, Dtype, Vec<usize>)> {
    let bytes = std::fs::read(path).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<_> = file
        .tensors()
        .into_iter()
        .map(|(name, view)| (name, view.dtype(), view.shape().to_vec()))
        .collect();
    tensors.sort_by_key(|(name, _, _)| name.clone());
    tensors
}

#[test]
fn f32_checkpoint_has_z_labs_names_and_round_trips_exactly() {
    let dir = temp_dir("hf-f32");
    let model = ModelPlan::new(spec());
    let [params, exp_avg, exp_avg_sq] = save(&dir, &model, WeightsDtype::F32);

    let mut expected: Vec<_> = model
        .layout
        .iter()
        .map(|v| (v.name.clone(), Dtype::F32, v.shape.clone()))
        .collect();
    expected.sort_by_key(|(name, _, _)| name.clone());
    assert_eq!(header(&dir.join(MODEL_FILE)), expected);
    for name in [
        "fc.weight",
        "hidden_norm.weight",
        "layers.1.self_attn.k_norm.weight",
        "layers.0.mlp.down_proj.weight",
        "norm.weight",
    ] {
        assert!(expected.iter().any(|(n, _, _)| n == name), "{name}");
    }

    let loaded = load_checkpoint(&dir, &model).unwrap();
    assert_eq!(bits(&loaded.params), bits(&params));
    assert_eq!(bits(&loaded.exp_avg), bits(&exp_avg));
    assert_eq!(bits(&loaded.exp_avg_sq), bits(&exp_avg_sq));
    // `--init` takes the directory or the file, and gives the same weights.
    assert_eq!(
        bits(&load_initial_weights(&dir, &model).unwrap()),
        bits(&params)
    );
    assert_eq!(
        bits(&load_initial_weights(&dir.join(MODEL_FILE), &model).unwrap()),
        bits(&params)
    );
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join(CONFIG_FILE)).unwrap()).unwrap();
    assert_eq!(config["torch_dtype"], "float32");
    // No master copy when the weights file is exact.
    assert!(
        header(&training_state_dir(&dir).join(OPTIMIZER_FILE))
            .iter()
            .all(|(name, _, _)| !name.starts_with(MASTER_PREFIX))
    );
}

#[test]
fn bf16_checkpoint_rounds_to_nearest_even_and_resumes_exactly() {
    let dir = temp_dir("hf-bf16");
    let model = ModelPlan::new(spec());
    let [params, exp_avg, _] = save(&dir, &model, WeightsDtype::Bf16);

    assert!(
        header(&dir.join(MODEL_FILE))
            .iter()
            .all(|(_, dtype, _)| *dtype == Dtype::BF16)
    );
    let rounded = load_initial_weights(&dir, &model).unwrap();
    for (&exact, &got) in params.iter().zip(&rounded) {
        // Round to nearest, ties to even, written out on the bits: add half an ulp of bf16 (minus one unless
        // the kept part is odd) and truncate.
        let b = exact.to_bits();
        let rounding = 0x7fff + ((b >> 16) & 1);
        let expected = f32::from_bits((b + rounding) & 0xffff_0000);
        assert_eq!(got.to_bits(), expected.to_bits(), "{exact:e}");
        assert!((got - exact).abs() <= exact.abs() * 2f32.powi(-8));
    }
    assert_ne!(bits(&rounded), bits(&params), "bf16 must round something");

    let resumed = load_checkpoint(&dir, &model).unwrap();
    assert_eq!(
        bits(&resumed.params),
        bits(&params),
        "resume uses the master weights"
    );
    assert_eq!(bits(&resumed.exp_avg), bits(&exp_avg));
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join(CONFIG_FILE)).unwrap()).unwrap();
    assert_eq!(config["torch_dtype"], "bfloat16");
    assert_eq!(config["dtype"], "bfloat16");
}

/// The drafter `pipelines/dflash-5x3.pipe` describes: Qwen3-8B's target (hidden 4096, vocabulary 151936, RoPE
/// base 10^6, `<|MASK|>` = 151669 as in z-lab's Qwen3 drafters), taps after target layers 1, 9, 17, 25, 33.
fn qwen3_8b_drafter() -> DflashSpec {
    DflashSpec {
        hidden: 4096,
        taps: 5,
        tap_layers: vec![2, 10, 18, 26, 34],
        vocab: 151_936,
        layers: 5,
        heads: 32,
        kv_heads: 8,
        head_dim: 128,
        intermediate: 12_288,
        block: 16,
        anchors: 512,
        mask_token: 151_669,
        rope_theta: 1e6,
        rms_norm_eps: DFLASH_RMS_NORM_EPS,
    }
}

#[test]
fn config_for_dflash_5x3_matches_the_hand_checked_file() {
    let pipe = Path::new(env!("CARGO_MANIFEST_DIR")).join("../pipelines/dflash-5x3.pipe");
    let plan = draftpipe_compiler::compile_file(&pipe).unwrap();
    let spec = qwen3_8b_drafter();
    assert_eq!(plan.model.spec.as_dflash(), Some(&spec));
    // The pipeline says the target's depth (`layers = 36`, Qwen3-8B's), which the export writes.
    assert_eq!(plan.target.layers, Some(36));
    let export = ExportOptions {
        dtype: WeightsDtype::Bf16,
        target_layers: plan.target.layers,
        vocab_map: None,
    };
    let generated = dflash_config(&spec, export);
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/dflash-5x3.config.json");
    let hand: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    assert_eq!(generated, hand);
    check_config(&path, &spec).unwrap();
    // Written without f64 widening noise.
    let text = serde_json::to_string(&generated).unwrap();
    assert!(text.contains("\"rms_norm_eps\":1e-6"), "{text}");
}

/// `config.json` of `spec()` with one key replaced.
fn config_with(dir: &Path, pointer: &str, value: serde_json::Value) -> PathBuf {
    let mut config = dflash_config(&spec(), ExportOptions::default());
    *config.pointer_mut(pointer).unwrap() = value;
    let path = dir.join(CONFIG_FILE);
    std::fs::write(&path, serde_json::to_vec_pretty(&config).unwrap()).unwrap();
    path
}

#[test]
fn a_config_of_another_model_is_named_by_file_and_key() {
    let dir = temp_dir("hf-config-mismatch");
    let model = ModelPlan::new(spec());
    save(&dir, &model, WeightsDtype::F32);
    for (pointer, value, key, says) in [
        (
            "/num_hidden_layers",
            serde_json::json!(3),
            "`num_hidden_layers`",
            "is 3, the plan's dflash drafter has 2",
        ),
        (
            "/dflash_config/target_layer_ids",
            serde_json::json!([1, 2, 4]),
            "`dflash_config.target_layer_ids`",
            "is [1,2,4], the plan's dflash drafter has [0,1,3]",
        ),
        (
            "/dflash_config/mask_token_id",
            serde_json::json!(7),
            "`dflash_config.mask_token_id`",
            "is 7",
        ),
        (
            "/architectures",
            serde_json::json!(["Qwen3ForCausalLM"]),
            "`architectures`",
            "expected [\"DFlashDraftModel\"]",
        ),
    ] {
        let path = config_with(&dir, pointer, value);
        for error in [
            load_initial_weights(&dir, &model).unwrap_err(),
            load_checkpoint(&dir, &model).unwrap_err(),
        ] {
            let text = error.to_string();
            assert!(text.starts_with(&path.display().to_string()), "{text}");
            assert!(text.contains(key) && text.contains(says), "{text}");
        }
    }
    // The same RoPE base written as an integer is the same model.
    config_with(&dir, "/rope_theta", serde_json::json!(10000));
    load_initial_weights(&dir, &model).unwrap();
}

#[test]
fn a_malformed_config_is_named_by_line_and_column() {
    let dir = temp_dir("hf-config-syntax");
    let model = ModelPlan::new(spec());
    save(&dir, &model, WeightsDtype::F32);
    let path = dir.join(CONFIG_FILE);
    std::fs::write(&path, "{\n  \"hidden_size\": 16,\n  \"block_size\" 4\n}\n").unwrap();
    let text = load_initial_weights(&dir, &model).unwrap_err().to_string();
    assert!(
        text.starts_with(&format!("{}:3:16: expected `:`", path.display())),
        "{text}"
    );
}

#[test]
fn a_weights_file_of_another_layout_is_named_by_file_and_tensor() {
    let dir = temp_dir("hf-wrong-tensor");
    let model = ModelPlan::new(spec());
    save(&dir, &model, WeightsDtype::F32);
    // Two fewer layers: the config says so first.
    let shallower = ModelPlan::new(DflashSpec {
        layers: 1,
        ..spec()
    });
    let text = load_initial_weights(&dir, &shallower)
        .unwrap_err()
        .to_string();
    assert!(text.contains("`num_hidden_layers` is 2"), "{text}");
    // Without the config, the first tensor the plan lacks is named.
    std::fs::remove_file(dir.join(CONFIG_FILE)).unwrap();
    let text = load_initial_weights(&dir, &shallower)
        .unwrap_err()
        .to_string();
    assert!(
        text.contains(&dir.join(MODEL_FILE).display().to_string()) && text.contains("layers.1."),
        "{text}"
    );
}

#[test]
fn an_mlp_checkpoint_has_no_config() {
    let dir = temp_dir("hf-mlp");
    let model = small_model(8, 16, 32);
    save(&dir, &model, WeightsDtype::Bf16);
    assert!(!dir.join(CONFIG_FILE).exists());
    let loaded = load_checkpoint(&dir, &model).unwrap();
    assert_eq!(bits(&loaded.params), bits(&values(model.parameters, 1)));
}
