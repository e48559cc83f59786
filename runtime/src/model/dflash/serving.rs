//! The `dflash` family's serving export: the `config.json` that z-lab's `DFlashDraftModel` (and SGLang's and
//! vLLM's DFlash loaders) read beside `model.safetensors`, and which of its keys define the model.
//!
//! The tensors need no renaming: the plan's layout already uses z-lab's names and PyTorch's `[out, in]` shapes
//! (Contract 1), so `model.safetensors` is the layout written in order. The config carries what those names do
//! not: the block size, the mask token, which target layers feed `fc` (`target_layer_ids`), heads, RoPE base and
//! the norms' epsilon. Keys and values follow the configs z-lab publishes for its Qwen3 drafters (and SpecForge
//! writes, e.g. `configs/qwen3-8b-dflash.json`): `model_type` `qwen3`, architecture `DFlashDraftModel`,
//! `dflash_config { mask_token_id, target_layer_ids }` nested, the rest top-level Qwen3 keys.

use draftpipe_compiler::plan::DflashSpec;
use serde_json::{Value, json};

use crate::model::serving::{
    DEPTH_ASSUMED_KEY, DRAFTPIPE_KEY, ExportOptions, FamilySpec, json_f32,
};

/// The architecture name serving engines dispatch on.
pub const DFLASH_ARCHITECTURE: &str = "DFlashDraftModel";

/// `max_position_embeddings` written to the config: the draft's RoPE table size in serving engines, which must
/// cover the target's context. The plan does not know the target's; this is Qwen3's (8B and its siblings).
pub const MAX_POSITION_EMBEDDINGS: u64 = 40_960;

/// z-lab's `target_layer_ids`: the plan's `tap_layers` index the hidden-states tuple, whose entry 0 is the
/// embeddings, so target layer `i` is tap `i + 1` (z-lab's `extract_context_feature` adds the 1 back). A tap of 0
/// (the embeddings themselves) becomes −1, which z-lab's code reads correctly and engines may not.
pub fn target_layer_ids(spec: &DflashSpec) -> Vec<i64> {
    spec.tap_layers.iter().map(|&tap| tap as i64 - 1).collect()
}

/// The least target depth the taps allow: the deepest tap `t` is captured before target layer `t`, which must
/// exist (see the compiler's check of `tap_layers` against `layers`).
pub fn least_target_layers(spec: &DflashSpec) -> usize {
    spec.tap_layers.iter().copied().max().unwrap_or(0) + 1
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

impl FamilySpec for DflashSpec {
    fn name(&self) -> &'static str {
        "dflash"
    }

    fn reads_target_weights(&self) -> bool {
        true
    }

    fn serving_config(&self, export: ExportOptions) -> Option<Value> {
        Some(dflash_config(self, export))
    }

    fn architecture(&self) -> Option<&'static str> {
        Some(DFLASH_ARCHITECTURE)
    }

    fn structural_keys(&self) -> &'static [&'static str] {
        &[
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "block_size",
            "dflash_config.mask_token_id",
            "dflash_config.target_layer_ids",
            "rope_theta",
            "rms_norm_eps",
        ]
    }
}
