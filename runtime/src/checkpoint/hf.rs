//! The Hugging Face side of a checkpoint: the `config.json` that z-lab's `DFlashDraftModel` (and SGLang's and
//! vLLM's DFlash loaders) read beside `model.safetensors`, and the dtype that file is stored in.
//!
//! ```text
//!  DflashSpec ──dflash_config──▶ DIR/config.json ──check_dflash_config──▶ --init / --resume / eval (against the plan)
//! ```
//!
//! The tensors need no renaming: the plan's layout already uses z-lab's names and PyTorch's `[out, in]` shapes
//! (Contract 1), so `model.safetensors` is the layout written in order. The config carries what those names do
//! not: the block size, the mask token, which target layers feed `fc` (`target_layer_ids`), heads, RoPE base and
//! the norms' epsilon. Keys and values follow the configs z-lab publishes for its Qwen3 drafters (and SpecForge
//! writes, e.g. `configs/qwen3-8b-dflash.json`): `model_type` `qwen3`, architecture `DFlashDraftModel`,
//! `dflash_config { mask_token_id, target_layer_ids }` nested, the rest top-level Qwen3 keys.

use std::fs;
use std::path::{Path, PathBuf};

use draftpipe_compiler::plan::DflashSpec;
use safetensors::Dtype;
use serde_json::{Value, json};

use super::CheckpointError;

/// The config file inside a checkpoint directory (a `dflash` drafter's only).
pub const CONFIG_FILE: &str = "config.json";

/// The architecture name serving engines dispatch on.
pub const DFLASH_ARCHITECTURE: &str = "DFlashDraftModel";

/// `max_position_embeddings` written to the config: the draft's RoPE table size in serving engines, which must
/// cover the target's context. The plan does not know the target's; this is Qwen3's (8B and its siblings).
pub const MAX_POSITION_EMBEDDINGS: u64 = 40_960;

/// The dtype `model.safetensors` is stored in (`--save-dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightsDtype {
    /// f32, exactly the trained values.
    #[default]
    F32,
    /// bfloat16, rounded to nearest (ties to even): what serving engines load. The f32 values stay in
    /// `optimizer.safetensors` (`master.NAME`), so resuming from the checkpoint stays exact.
    Bf16,
}

impl WeightsDtype {
    /// The safetensors dtype.
    pub fn dtype(self) -> Dtype {
        match self {
            WeightsDtype::F32 => Dtype::F32,
            WeightsDtype::Bf16 => Dtype::BF16,
        }
    }

    /// PyTorch's name, as `config.json`'s `torch_dtype` spells it.
    pub fn torch_name(self) -> &'static str {
        match self {
            WeightsDtype::F32 => "float32",
            WeightsDtype::Bf16 => "bfloat16",
        }
    }
}

/// z-lab's `target_layer_ids`: the plan's `tap_layers` index the hidden-states tuple, whose entry 0 is the
/// embeddings, so target layer `i` is tap `i + 1` (z-lab's `extract_context_feature` adds the 1 back). A tap of 0
/// (the embeddings themselves) becomes −1, which z-lab's code reads correctly and engines may not.
pub fn target_layer_ids(spec: &DflashSpec) -> Vec<i64> {
    spec.tap_layers.iter().map(|&tap| tap as i64 - 1).collect()
}

/// What a save writes beside the buffers: the dtype of `model.safetensors` and the target's depth for
/// `config.json`'s `num_target_layers`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ExportOptions {
    /// The dtype `model.safetensors` is stored in (`--save-dtype`).
    pub dtype: WeightsDtype,
    /// The target's depth ([`TargetStage::layers`](draftpipe_compiler::plan::TargetStage::layers)); `None` when
    /// nothing says it.
    pub target_layers: Option<usize>,
}

/// The key, under [`DRAFTPIPE_KEY`], set to `true` when `num_target_layers` is the least depth the taps allow
/// rather than the target's own: `export-check` then cannot say whether the drafter fits the target.
pub const DEPTH_ASSUMED_KEY: &str = "num_target_layers_assumed";

/// The `config.json` object that carries draftpipe's own notes (engines ignore unknown keys).
pub const DRAFTPIPE_KEY: &str = "draftpipe";

/// The least target depth the taps allow: the deepest tap `t` is captured before target layer `t`, which must
/// exist (see the compiler's check of `tap_layers` against `layers`).
pub fn least_target_layers(spec: &DflashSpec) -> usize {
    spec.tap_layers.iter().copied().max().unwrap_or(0) + 1
}

/// A float as JSON through its shortest decimal form, so `1e-6_f32` is written `1e-6`, not the f64 widening
/// `9.999999974752427e-7`.
fn json_f32(value: f32) -> Value {
    value
        .to_string()
        .parse::<f64>()
        .ok()
        .and_then(serde_json::Number::from_f64)
        .map_or(Value::Null, Value::Number)
}

/// The `config.json` of a `dflash` drafter with `spec`'s dimensions, saved with `export`.
///
/// `num_target_layers` is the target's depth when `export` knows it. SGLang checks every `target_layer_ids`
/// entry against it (`DFlashDraftConfig.resolve_target_layer_ids`, falling back to the draft's own depth when
/// the key is absent) and z-lab's `DFlashDraftModel.__init__` reads it unconditionally, so it is always written:
/// when the depth is unknown, as [`least_target_layers`] with `draftpipe.num_target_layers_assumed = true`.
pub fn dflash_config(spec: &DflashSpec, export: ExportOptions) -> Value {
    let dtype = export.dtype;
    let mut config = json!({
        "architectures": [DFLASH_ARCHITECTURE],
        "model_type": "qwen3",
        "block_size": spec.block,
        "dflash_config": {
            "mask_token_id": spec.mask_token,
            "target_layer_ids": target_layer_ids(spec),
        },
        "num_target_layers": export.target_layers.unwrap_or_else(|| least_target_layers(spec)),
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "attention_bias": false,
        "attention_dropout": 0.0,
        "rope_theta": json_f32(spec.rope_theta),
        "rope_scaling": null,
        "rms_norm_eps": json_f32(spec.rms_norm_eps),
        "vocab_size": spec.vocab,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "layer_types": vec!["full_attention"; spec.layers],
        "max_window_layers": spec.layers,
        "use_sliding_window": false,
        "sliding_window": null,
        "tie_word_embeddings": false,
        "initializer_range": 0.02,
        "use_cache": true,
        "torch_dtype": dtype.torch_name(),
        "dtype": dtype.torch_name(),
    });
    if export.target_layers.is_none() {
        config[DRAFTPIPE_KEY] = json!({ DEPTH_ASSUMED_KEY: true });
    }
    config
}

/// Writes [`dflash_config`] to `path` (pretty-printed, keys sorted, newline-terminated) and fsyncs it.
pub fn write_dflash_config(
    path: &Path,
    spec: &DflashSpec,
    export: ExportOptions,
) -> Result<(), CheckpointError> {
    let mut text = serde_json::to_vec_pretty(&dflash_config(spec, export)).map_err(|e| {
        CheckpointError::Config {
            path: path.to_path_buf(),
            message: e.to_string(),
        }
    })?;
    text.push(b'\n');
    super::write_synced(path, &text)
}

/// The keys a loader's model depends on, with the plan's value of each: a config that differs in any of them
/// describes another model. `dtype`, `max_position_embeddings` and the rest are the serving engine's business.
fn structural_keys(spec: &DflashSpec) -> Vec<(&'static str, Value)> {
    let expected = dflash_config(spec, ExportOptions::default());
    let key = |path: &'static str| {
        let value = path
            .split('.')
            .try_fold(&expected, |v, k| v.get(k))
            .cloned()
            .unwrap_or(Value::Null);
        (path, value)
    };
    vec![
        key("hidden_size"),
        key("num_hidden_layers"),
        key("num_attention_heads"),
        key("num_key_value_heads"),
        key("head_dim"),
        key("intermediate_size"),
        key("vocab_size"),
        key("block_size"),
        key("dflash_config.mask_token_id"),
        key("dflash_config.target_layer_ids"),
        key("rope_theta"),
        key("rms_norm_eps"),
    ]
}

/// Equal as JSON, numbers compared by value at f32 precision (`1000000` and `1e6` are the same RoPE base).
fn same_value(found: &Value, expected: &Value) -> bool {
    match (found, expected) {
        (Value::Number(a), Value::Number(b)) => match (a.as_f64(), b.as_f64()) {
            (Some(a), Some(b)) => a as f32 == b as f32,
            _ => false,
        },
        (Value::Array(a), Value::Array(b)) => {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| same_value(x, y))
        }
        _ => found == expected,
    }
}

/// Reads a `config.json` and checks that it describes the model `spec` does: the architecture (when given),
/// and every structural key. The error names the file and the key, with the file's value and the plan's.
pub fn check_dflash_config(path: &Path, spec: &DflashSpec) -> Result<(), CheckpointError> {
    let config = read_config(path)?;
    let mismatch = |key: &str, message: String| CheckpointError::ConfigKey {
        path: path.to_path_buf(),
        key: key.to_string(),
        message,
    };
    if let Some(architectures) = config.get("architectures") {
        let names: Vec<&str> = architectures
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        if !names.contains(&DFLASH_ARCHITECTURE) {
            return Err(mismatch(
                "architectures",
                format!(
                    "is {architectures}, expected [\"{DFLASH_ARCHITECTURE}\"] for a dflash drafter"
                ),
            ));
        }
    }
    for (key, expected) in structural_keys(spec) {
        let found = key.split('.').try_fold(&config, |v, k| v.get(k));
        match found {
            None => {
                return Err(mismatch(
                    key,
                    format!("is missing; the plan's dflash drafter has {expected}"),
                ));
            }
            Some(found) if !same_value(found, &expected) => {
                return Err(mismatch(
                    key,
                    format!("is {found}, the plan's dflash drafter has {expected}"),
                ));
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// The largest `config.json` read (1 MiB; a real one is under 2 KiB).
const MAX_CONFIG_BYTES: u64 = 1 << 20;

fn read_config(path: &Path) -> Result<Value, CheckpointError> {
    let io = |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    };
    let size = fs::metadata(path).map_err(io)?.len();
    if size > MAX_CONFIG_BYTES {
        return Err(CheckpointError::Config {
            path: path.to_path_buf(),
            message: format!("{size} bytes, over the limit of {MAX_CONFIG_BYTES} for a config"),
        });
    }
    let bytes = fs::read(path).map_err(io)?;
    let value: Value = serde_json::from_slice(&bytes).map_err(|e| {
        // serde_json's text ends in " at line L column C", which the path now carries.
        let text = e.to_string();
        let message = text.split(" at line ").next().unwrap_or(&text).to_string();
        CheckpointError::Config {
            path: located(path, e.line(), e.column()),
            message,
        }
    })?;
    if !value.is_object() {
        return Err(CheckpointError::Config {
            path: path.to_path_buf(),
            message: "expected a JSON object".into(),
        });
    }
    Ok(value)
}

/// `path:line:col`, as errors name a place in a file.
fn located(path: &Path, line: usize, column: usize) -> PathBuf {
    PathBuf::from(format!("{}:{line}:{column}", path.display()))
}
