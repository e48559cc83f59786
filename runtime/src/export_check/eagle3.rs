//! The `eagle3` export rules: what SGLang's `LlamaForCausalLMEagle3` (`python/sglang/srt/models/llama_eagle3.py`
//! at 03d5a77, `model_executor/model_runner.py`, `models/llama.py` `set_eagle3_layers_to_capture`) and vLLM's
//! `Eagle3LlamaForCausalLM` (`vllm/model_executor/models/llama_eagle3.py` at 00bd149,
//! `v1/worker/gpu/spec_decode/eagle/eagle3_utils.py` at 0cfdd2e) do with a draft directory's `config.json` and
//! tensors.
//!
//! ```text
//!  DIR/config.json ──config rules (architecture, one Llama layer, vocabularies, aux layer ids)──┐
//!  DIR/*.safetensors headers, d2t's values ──name mapping, shapes, d2t──────────────────────────┴──▶ findings
//! ```

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::Dtype;
use serde_json::{Map, Value};

use super::tensors::{Header, Mapped, Parameters, load, weight_headers};
use super::{CheckOptions, Engine, Findings, Severity};
use crate::checkpoint::CONFIG_FILE;
use crate::model::eagle3::export::EAGLE3_ARCHITECTURE;
use crate::model::eagle3::vocab::{D2T, T2D};
use crate::model::serving::DRAFTPIPE_KEY;
use crate::tensor_file::{TensorFile, TensorRead, decode_ids};

/// Tapped target layers both engines' `fc` reads (`hidden_size_in * 3`, `target_hidden_size * 3`).
const AUX_LAYERS: usize = 3;

/// What the tensor rules need from a config that parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Eagle3Config {
    hidden: usize,
    /// `target_hidden_size`, else `hidden_size` (both loaders).
    target_hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    intermediate: usize,
    vocab: usize,
    /// `draft_vocab_size`, else `vocab_size` (both loaders).
    draft_vocab: usize,
}

/// True when `DIR/config.json` names the EAGLE-3 architecture (the report then uses these rules).
pub(super) fn is_eagle3(dir: &Path) -> bool {
    std::fs::read(dir.join(CONFIG_FILE))
        .ok()
        .and_then(|text| serde_json::from_slice::<Value>(&text).ok())
        .and_then(|v| {
            v.get("architectures")?
                .as_array()
                .map(|a| a.iter().any(|n| n.as_str() == Some(EAGLE3_ARCHITECTURE)))
        })
        .unwrap_or(false)
}

/// Applies the config, tensor and serving rules of both engines to the export in `dir`.
pub(super) fn check(dir: &Path, options: &CheckOptions, findings: &mut Findings) {
    let path = dir.join(CONFIG_FILE);
    let config = std::fs::read(&path)
        .map_err(|e| e.to_string())
        .and_then(|text| {
            serde_json::from_slice::<Value>(&text)
                .map_err(|e| format!("{}:{}: not JSON: {e}", e.line(), e.column()))
        });
    let object = match &config {
        Ok(Value::Object(object)) => object,
        Ok(_) => {
            return findings.both(
                Severity::Fatal,
                format!("{}: not a JSON object", path.display()),
            );
        }
        Err(e) => return findings.both(Severity::Fatal, format!("{}: {e}", path.display())),
    };
    let parsed = check_config(&path.display().to_string(), object, options, findings);
    check_tensors(dir, parsed.as_ref(), findings);
}

fn positive(config: &Map<String, Value>, key: &str) -> Option<usize> {
    let n = config.get(key)?.as_u64().filter(|&n| n > 0)?;
    usize::try_from(n).ok()
}

/// A list of integers, or `None`.
fn int_list(value: &Value) -> Option<Vec<i64>> {
    value.as_array()?.iter().map(Value::as_i64).collect()
}

fn check_config(
    shown: &str,
    config: &Map<String, Value>,
    options: &CheckOptions,
    findings: &mut Findings,
) -> Option<Eagle3Config> {
    // Both build a `LlamaConfig` through transformers' `AutoConfig`, and the draft layer is a Llama decoder layer.
    match config.get("model_type").and_then(Value::as_str) {
        Some("llama") => {}
        other => findings.both(
            Severity::Fatal,
            format!(
                "{shown}: `model_type` is {}, expected \"llama\": `LlamaForCausalLMEagle3` is built from a \
                 `LlamaConfig`",
                other.map_or("absent".to_owned(), |t| format!("\"{t}\""))
            ),
        ),
    }
    // SGLang builds `num_hidden_layers − 1` more `BasicDecoderLayer`s, vLLM `num_hidden_layers` layers of which only
    // `layers.0` gets `midlayer.` weights: one layer is what both load from SpecForge's names.
    if config.get("num_hidden_layers").and_then(Value::as_u64) != Some(1) {
        findings.both(
            Severity::Fatal,
            format!(
                "{shown}: `num_hidden_layers` is {}, expected 1: the draft is one decoder layer (`midlayer`), and \
                 more layers would load no weights",
                config.get("num_hidden_layers").unwrap_or(&Value::Null)
            ),
        );
    }
    if let Some(act) = config.get("hidden_act").and_then(Value::as_str)
        && act != "silu"
    {
        findings.both(
            Severity::Fatal,
            format!(
                "{shown}: `hidden_act` is \"{act}\": both engines' `LlamaMLP` accept only \"silu\""
            ),
        );
    }
    for key in ["bias", "attention_bias", "mlp_bias"] {
        if config.get(key).and_then(Value::as_bool) == Some(true) {
            findings.both(
                Severity::Fatal,
                format!(
                    "{shown}: `{key}` is true: the engine's model gets bias parameters no EAGLE-3 export of \
                     SpecForge's form carries"
                ),
            );
        }
    }
    // SGLang: `tie_word_embeddings` makes `lm_head` the embedding, and the trained head is never loaded.
    if config.get("tie_word_embeddings").and_then(Value::as_bool) == Some(true) {
        findings.fatal(
            Engine::Sglang,
            format!("{shown}: `tie_word_embeddings` is true: SGLang drafts with the embedding as its head"),
        );
    }
    // SGLang: without `draft_vocab_size` it sets `load_lm_head_from_target` and replaces the trained head with the
    // target's (`LlamaForCausalLMEagle3.__init__`); vLLM falls back to `vocab_size`.
    if config.get("draft_vocab_size").is_none_or(Value::is_null) {
        findings.fatal(
            Engine::Sglang,
            format!(
                "{shown}: no `draft_vocab_size`: SGLang loads the target's `lm_head` in place of the trained one"
            ),
        );
    }
    if config.get("rope_scaling").is_some_and(|v| !v.is_null()) {
        findings.both(
            Severity::Warning,
            format!(
                "{shown}: `rope_scaling` is {}: the engine scales RoPE positions; a drafter trained without \
                 scaling then sees other positions",
                config["rope_scaling"]
            ),
        );
    }
    check_aux_layers(shown, config, findings);

    let trained_ttt = config
        .get(DRAFTPIPE_KEY)
        .and_then(|d| d.get("ttt"))
        .and_then(Value::as_u64);
    if let (Some(tokens), Some(ttt)) = (options.speculative_tokens, trained_ttt)
        && tokens as u64 > ttt
    {
        findings.both(
            Severity::Warning,
            format!(
                "{tokens} speculative tokens draft {} step{} past the {ttt} the drafter was unrolled for in \
                 training: those drafts come from inputs it never trained on",
                tokens as u64 - ttt,
                if tokens as u64 - ttt == 1 { "" } else { "s" }
            ),
        );
    }

    let mut required = |key: &str| {
        let value = positive(config, key);
        if value.is_none() {
            findings.both(
                Severity::Fatal,
                format!(
                    "{shown}: `{key}` is {}, expected a positive integer",
                    config.get(key).unwrap_or(&Value::Null)
                ),
            );
        }
        value
    };
    let (hidden, heads, intermediate, vocab) = (
        required("hidden_size"),
        required("num_attention_heads"),
        required("intermediate_size"),
        required("vocab_size"),
    );
    let (hidden, heads, intermediate, vocab) = (hidden?, heads?, intermediate?, vocab?);
    let draft_vocab = positive(config, "draft_vocab_size").unwrap_or(vocab);
    if draft_vocab > vocab {
        findings.both(
            Severity::Fatal,
            format!("{shown}: `draft_vocab_size` {draft_vocab} exceeds `vocab_size` {vocab}"),
        );
    }
    Some(Eagle3Config {
        hidden,
        target_hidden: positive(config, "target_hidden_size").unwrap_or(hidden),
        heads,
        kv_heads: positive(config, "num_key_value_heads").unwrap_or(heads),
        head_dim: positive(config, "head_dim").unwrap_or(hidden / heads),
        intermediate,
        vocab,
        draft_vocab,
    })
}

/// The tapped layers each engine feeds the drafter: SGLang `eagle_config.eagle_aux_hidden_state_layer_ids`
/// (layer outputs; it captures entering layer `id + 1`), vLLM the top-level key (the layer entered, as is).
/// Without its key an engine feeds its own default layers, not the trained ones. `draftpipe.tap_layers`, when
/// present, says what was trained.
fn check_aux_layers(shown: &str, config: &Map<String, Value>, findings: &mut Findings) {
    let trained: Option<Vec<i64>> = config
        .get(DRAFTPIPE_KEY)
        .and_then(|d| d.get("tap_layers"))
        .and_then(int_list);
    let sources = [
        (
            Engine::Sglang,
            "eagle_config.eagle_aux_hidden_state_layer_ids",
            config
                .get("eagle_config")
                .and_then(|e| e.get("eagle_aux_hidden_state_layer_ids")),
            1,
        ),
        (
            Engine::Vllm,
            "eagle_aux_hidden_state_layer_ids",
            config.get("eagle_aux_hidden_state_layer_ids"),
            0,
        ),
    ];
    for (engine, key, value, to_tap) in sources {
        let Some(value) = value.filter(|v| !v.is_null()) else {
            findings.fatal(
                engine,
                format!(
                    "{shown}: no `{key}`: {} feeds the drafter layers of its own choosing, not the ones it was \
                     trained on",
                    engine.name()
                ),
            );
            continue;
        };
        let Some(ids) =
            int_list(value).filter(|ids| ids.len() == AUX_LAYERS && ids.iter().all(|&i| i >= 0))
        else {
            findings.fatal(
                engine,
                format!(
                    "{shown}: `{key}` is {value}, expected {AUX_LAYERS} non-negative integers (`fc` reads \
                     {AUX_LAYERS} tapped layers)"
                ),
            );
            continue;
        };
        let taps: Vec<i64> = ids.iter().map(|id| id + to_tap).collect();
        if let Some(trained) = &trained
            && &taps != trained
        {
            findings.fatal(
                engine,
                format!(
                    "{shown}: `{key}` is {ids:?}: {} would feed hidden states {taps:?}, the drafter was trained on \
                     {trained:?} (`draftpipe.tap_layers`)",
                    engine.name()
                ),
            );
        }
    }
}

/// The parameters each engine's model has, under the names its loader maps checkpoint names to, with shapes.
/// `q/k/v_proj` and `gate/up_proj` load as shards of `qkv_proj` and `gate_up_proj`, so each keeps its own shape.
fn parameters(config: &Eagle3Config, engine: Engine) -> Parameters {
    let (h, i) = (config.hidden, config.intermediate);
    let (q, kv) = (
        config.heads * config.head_dim,
        config.kv_heads * config.head_dim,
    );
    let layer = match engine {
        Engine::Sglang => "model.midlayer",
        Engine::Vllm => "model.layers.0",
    };
    let mut params = BTreeMap::from([
        (
            "model.fc.weight".to_owned(),
            vec![h, AUX_LAYERS * config.target_hidden],
        ),
        ("model.norm.weight".to_owned(), vec![h]),
        ("lm_head.weight".to_owned(), vec![config.draft_vocab, h]),
    ]);
    for (name, shape) in [
        ("input_layernorm.weight", vec![h]),
        ("hidden_norm.weight", vec![h]),
        ("post_attention_layernorm.weight", vec![h]),
        // The first layer's q/k/v read `cat(embeds, hidden)`: `2 * hidden_size` wide.
        ("self_attn.q_proj.weight", vec![q, 2 * h]),
        ("self_attn.k_proj.weight", vec![kv, 2 * h]),
        ("self_attn.v_proj.weight", vec![kv, 2 * h]),
        ("self_attn.o_proj.weight", vec![h, q]),
        ("mlp.gate_proj.weight", vec![i, h]),
        ("mlp.up_proj.weight", vec![i, h]),
        ("mlp.down_proj.weight", vec![h, i]),
    ] {
        params.insert(format!("{layer}.{name}"), shape);
    }
    params
}

/// SGLang `LlamaForCausalLMEagle3.load_weights`: `d2t` becomes `hot_token_id`, `t2d` is skipped, any other name
/// loads as written or with `model.` added, and a name that reaches no parameter is silently skipped.
fn sglang_map(name: &str, params: &Parameters) -> Mapped {
    if name.contains(D2T) {
        return Mapped::Aside;
    }
    if name.contains(T2D) || name.ends_with("embed_tokens.weight") {
        return Mapped::Optional;
    }
    let prefixed = format!("model.{name}");
    if params.contains_key(name) {
        Mapped::Param(name.to_owned())
    } else if params.contains_key(&prefixed) {
        Mapped::Param(prefixed)
    } else {
        Mapped::Skipped
    }
}

/// vLLM `Eagle3LlamaForCausalLM.load_weights`: `t2d` is skipped, `d2t` loads as `draft_id_to_target_id`, every
/// name but `lm_head`'s gets `model.`, `LlamaModel.load_weights` maps `midlayer.` to `layers.0.` and indexes
/// `params_dict` (a `KeyError` for an unknown name), `AutoWeightsLoader` raises for an unknown top-level one.
fn vllm_map(name: &str, params: &Parameters) -> Mapped {
    if name.contains(T2D) {
        return Mapped::Optional;
    }
    if name.contains(D2T) {
        return Mapped::Aside;
    }
    let mapped = if name.contains("lm_head") {
        name.to_owned()
    } else {
        format!("model.{name}").replace("midlayer.", "layers.0.")
    };
    if mapped.ends_with("embed_tokens.weight") {
        return Mapped::Optional;
    }
    if params.contains_key(&mapped) {
        Mapped::Param(mapped)
    } else {
        Mapped::Rejected(format!(
            "vLLM has no parameter `{mapped}` for it (it prepends `model.` to every name but `lm_head`'s and maps \
             `midlayer.` to `layers.0.`), and its loader raises"
        ))
    }
}

/// Both engines' load of the weight files in `dir` under `config` (the shared walk of `tensors.rs`), then the
/// `d2t` each reads.
fn check_tensors(dir: &Path, config: Option<&Eagle3Config>, findings: &mut Findings) {
    let Some(headers) = weight_headers(dir, findings) else {
        return;
    };
    let Some(config) = config else { return };
    for engine in Engine::ALL {
        let map = |name: &str, params: &Parameters| match engine {
            Engine::Sglang => sglang_map(name, params),
            Engine::Vllm => vllm_map(name, params),
        };
        let aside = load(engine, &headers, &parameters(config, engine), map, findings);
        // Only `d2t` is set aside; a second one (in another shard) replaces the first, as a state dict's would.
        check_d2t(engine, aside.last().copied(), config, findings);
    }
}

/// `d2t`: present whenever the draft vocabulary is smaller than the target's (else both engines take draft ids
/// for target ids), `[draft_vocab]`, integers for SGLang (`hot_token_id = d2t + arange` indexes the vocabulary),
/// exact integers for vLLM (copied into a `long` parameter), and every `i + d2t[i]` inside the vocabulary.
fn check_d2t(engine: Engine, d2t: Option<&Header>, config: &Eagle3Config, findings: &mut Findings) {
    let Some(header) = d2t else {
        if config.draft_vocab < config.vocab {
            findings.fatal(
                engine,
                format!(
                    "no `d2t`: with draft_vocab_size {} < vocab_size {}, {} maps draft id i to target id i",
                    config.draft_vocab,
                    config.vocab,
                    engine.name()
                ),
            );
        }
        return;
    };
    let file = header.file.display();
    if header.shape != [config.draft_vocab] {
        return findings.fatal(
            engine,
            format!(
                "{file}: tensor `{}` has shape {:?}, expected [{}] (draft_vocab_size)",
                header.name, header.shape, config.draft_vocab
            ),
        );
    }
    match (engine, header.dtype) {
        (_, Dtype::I64 | Dtype::I32) => {}
        (Engine::Vllm, Dtype::F32 | Dtype::F64) => {
            return findings.push(
                engine,
                Severity::Warning,
                format!(
                    "{file}: tensor `{}` is {:?}: vLLM converts it to int64",
                    header.name, header.dtype
                ),
            );
        }
        (_, dtype) => {
            return findings.fatal(
                engine,
                format!(
                    "{file}: tensor `{}` is {dtype:?}, expected int64: {}",
                    header.name,
                    match engine {
                        Engine::Sglang => "SGLang indexes the vocabulary with `d2t + arange`",
                        Engine::Vllm =>
                            "a half-precision offset is rounded, mapping draft ids to other tokens",
                    }
                ),
            );
        }
    }
    let offsets = TensorFile::open(&header.file).and_then(|f| {
        let (dtype, bytes) = f.element_bytes(&header.name, 0..config.draft_vocab)?;
        let mut values = vec![0i64; config.draft_vocab];
        decode_ids(dtype, bytes, &mut values);
        Ok(values)
    });
    match offsets {
        Err(error) => findings.fatal(engine, error.to_string()),
        Ok(offsets) => {
            let outside = offsets
                .iter()
                .enumerate()
                .find(|&(i, &d)| i as i64 + d < 0 || i as i64 + d >= config.vocab as i64);
            if let Some((i, &d)) = outside {
                findings.fatal(
                    engine,
                    format!(
                        "{file}: `{}[{i}]` = {d} maps draft id {i} to target id {}, outside the vocabulary of {}",
                        header.name,
                        i as i64 + d,
                        config.vocab
                    ),
                );
            }
        }
    }
}
