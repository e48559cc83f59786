//! The `config.json` rules: what SGLang's and vLLM's DFlash loaders require of the draft's config, and what they
//! do with the mask token, `target_layer_ids` and the block size.

use std::path::Path;

use serde_json::{Map, Value};

use super::{CheckOptions, Engine, Findings, Severity, TokenizerVocab};
use crate::checkpoint::CONFIG_FILE;
use crate::model::dflash::serving::DFLASH_ARCHITECTURE;
use crate::model::serving::{DEPTH_ASSUMED_KEY, DRAFTPIPE_KEY};

/// SGLang's mask token string when `dflash_config.mask_token` is absent (`DEFAULT_DFLASH_MASK_TOKEN`,
/// `python/sglang/srt/speculative/dflash_utils.py`).
const DEFAULT_MASK_TOKEN: &str = "<|MASK|>";

/// SGLang's block size when the config gives none (`DFlashDraftModel.__init__`, `resolve_block_size(default=16)`).
const SGLANG_DEFAULT_BLOCK: usize = 16;

/// What the tensor rules and the serving rules need from a config that parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DflashConfig {
    /// `hidden_size`.
    pub hidden: usize,
    /// `target_hidden_size`, else `hidden_size` (vLLM's `_get_dflash_fc_input_size`).
    pub target_hidden: usize,
    /// `num_hidden_layers` of the draft.
    pub layers: usize,
    /// `num_attention_heads`.
    pub heads: usize,
    /// `num_key_value_heads`.
    pub kv_heads: usize,
    /// `head_dim`, else `hidden_size / num_attention_heads`.
    pub head_dim: usize,
    /// `intermediate_size`.
    pub intermediate: usize,
    /// `attention_bias`: the projections then carry biases both loaders expect.
    pub attention_bias: bool,
    /// `len(target_layer_ids)` (0 when absent): the context features `fc` reads.
    pub context_features: usize,
    /// `block_size` (SGLang's default when absent).
    pub block_size: usize,
    /// `dflash_config.mask_token_id`, when given and a non-negative integer.
    pub mask_token_id: Option<u64>,
    /// `dflash_config.mask_token`, else SGLang's default.
    pub mask_token: String,
}

fn positive(config: &Map<String, Value>, key: &str) -> Option<usize> {
    config
        .get(key)?
        .as_u64()
        .filter(|&n| n > 0)
        .and_then(|n| usize::try_from(n).ok())
}

/// Reads `DIR/config.json` and applies the config rules; `None` when it is missing or unusable (already a
/// finding for both engines).
pub(super) fn check(dir: &Path, findings: &mut Findings) -> Option<DflashConfig> {
    let path = dir.join(CONFIG_FILE);
    let shown = path.display();
    // Both load the draft's `config.json` through transformers' `AutoConfig` (SGLang `ModelConfig`, vLLM
    // `get_config` in `vllm/transformers_utils/config.py`); without it neither builds the model.
    let text = match std::fs::read(&path) {
        Ok(text) => text,
        Err(error) => {
            findings.both(
                Severity::Fatal,
                format!("{shown}: {error}: the draft's config is read from here"),
            );
            return None;
        }
    };
    let value: Value = match serde_json::from_slice(&text) {
        Ok(value) => value,
        Err(error) => {
            findings.both(
                Severity::Fatal,
                format!(
                    "{shown}:{}:{}: not JSON: {error}",
                    error.line(),
                    error.column()
                ),
            );
            return None;
        }
    };
    let Some(config) = value.as_object() else {
        findings.both(Severity::Fatal, format!("{shown}: not a JSON object"));
        return None;
    };

    // SGLang dispatches on `architectures` to the class `EntryClass = DFlashDraftModel` names
    // (`python/sglang/srt/models/dflash.py`); vLLM's registry maps `DFlashDraftModel` to `qwen3_dflash`'s
    // `DFlashQwen3ForCausalLM` (`vllm/model_executor/models/registry.py`, `_SPECULATIVE_DECODING_MODELS`).
    let architectures: Vec<&str> = config
        .get("architectures")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    if !architectures.contains(&DFLASH_ARCHITECTURE) {
        findings.both(
            Severity::Fatal,
            format!(
                "{shown}: `architectures` is {}, expected [\"{DFLASH_ARCHITECTURE}\"]: the loaders pick the model \
                 class by this name",
                config.get("architectures").unwrap_or(&Value::Null)
            ),
        );
    }
    // Both build the config through transformers' `AutoConfig`, which needs `model_type`; the DFlash layers are
    // Qwen3's (`DFlashQwen3DecoderLayer(config: Qwen3Config)` in vLLM's `qwen3_dflash.py`; SGLang's mirror them).
    match config.get("model_type").and_then(Value::as_str) {
        Some("qwen3") => {}
        other => findings.both(
            Severity::Fatal,
            format!(
                "{shown}: `model_type` is {}, expected \"qwen3\": the DFlash layers are Qwen3 decoder layers \
                 built from a `Qwen3Config`",
                other.map_or("absent".to_owned(), |t| format!("\"{t}\""))
            ),
        ),
    }

    // The dimensions: SGLang reads them with `int(config.X)` (`DFlashAttention.__init__`, `DFlashMLP.__init__`:
    // `intermediate_size <= 0` is a ValueError), vLLM from the `Qwen3Config` attributes. An absent one falls
    // back to `Qwen3Config`'s default, which is not the trained model's, so every one must be written.
    let mut dims = [
        ("hidden_size", None),
        ("num_hidden_layers", None),
        ("num_attention_heads", None),
        ("num_key_value_heads", None),
        ("intermediate_size", None),
        ("vocab_size", None),
    ];
    for (key, value) in &mut dims {
        *value = positive(config, key);
        if value.is_none() {
            findings.both(
                Severity::Fatal,
                format!(
                    "{shown}: `{key}` is {}, expected a positive integer",
                    config.get(*key).unwrap_or(&Value::Null)
                ),
            );
        }
    }
    let [hidden, layers, heads, kv_heads, intermediate, vocab] = dims.map(|(_, v)| v);

    // Both accept only SiLU: SGLang `DFlashMLP.__init__` raises "Unsupported DFlash activation", vLLM's
    // `Qwen2MLP` (which `qwen3_dflash.py` imports as `Qwen3MLP`) raises "Unsupported activation".
    if let Some(act) = config.get("hidden_act")
        && act.as_str() != Some("silu")
    {
        findings.both(
            Severity::Fatal,
            format!("{shown}: `hidden_act` is {act}; only \"silu\" is supported"),
        );
    }

    let empty = Map::new();
    let dflash = match config.get("dflash_config") {
        Some(Value::Object(d)) => d,
        None => &empty,
        Some(other) => {
            // vLLM `DFlashQwen3Model.__init__`: `drafter_config.update(getattr(config, "dflash_config", {}))`.
            findings.both(
                Severity::Fatal,
                format!("{shown}: `dflash_config` is {other}, expected an object"),
            );
            &empty
        }
    };
    // SGLang `parse_dflash_draft_config` reads each DFlash key from `dflash_config` first, then the top level.
    let dflash_key = |key: &str| dflash.get(key).or_else(|| config.get(key));

    let mask_token_id = mask_token_id(&shown, dflash, vocab, findings);
    let mask_token = match dflash_key("mask_token") {
        None => DEFAULT_MASK_TOKEN.to_owned(),
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        Some(other) => {
            // `parse_dflash_draft_config`: "dflash_config.mask_token must be a non-empty string".
            findings.fatal(
                Engine::Sglang,
                format!(
                    "{shown}: `dflash_config.mask_token` is {other}, expected a non-empty string"
                ),
            );
            DEFAULT_MASK_TOKEN.to_owned()
        }
    };

    let target_layers = target_layers(&shown, config, dflash, findings);
    let context_features = target_layer_ids(&shown, dflash, target_layers, layers, findings);

    let block_size = match dflash_key("block_size") {
        // `parse_dflash_draft_config`: "Keep support for current checkpoints where block_size is top-level".
        Some(value) => match value.as_u64().filter(|&n| n > 0) {
            Some(n) => usize::try_from(n).unwrap_or(usize::MAX),
            None => {
                findings.fatal(
                    Engine::Sglang,
                    format!("{shown}: `block_size` is {value}, expected a positive integer"),
                );
                SGLANG_DEFAULT_BLOCK
            }
        },
        None => {
            findings.push(
                Engine::Sglang,
                Severity::Warning,
                format!(
                    "{shown}: no `block_size`: SGLang assumes {SGLANG_DEFAULT_BLOCK}, which may not be the block \
                     the drafter was trained on"
                ),
            );
            SGLANG_DEFAULT_BLOCK
        }
    };

    let (hidden, layers, heads) = (hidden?, layers?, heads?);
    Some(DflashConfig {
        hidden,
        target_hidden: positive(config, "target_hidden_size").unwrap_or(hidden),
        layers,
        heads,
        kv_heads: kv_heads?,
        head_dim: positive(config, "head_dim").unwrap_or(hidden / heads),
        intermediate: intermediate?,
        attention_bias: config
            .get("attention_bias")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        context_features,
        block_size,
        mask_token_id,
        mask_token,
    })
}

/// `dflash_config.mask_token_id`: required by vLLM, checked by SGLang, and within the vocabulary for both.
fn mask_token_id(
    shown: &impl std::fmt::Display,
    dflash: &Map<String, Value>,
    vocab: Option<usize>,
    findings: &mut Findings,
) -> Option<u64> {
    let Some(value) = dflash.get("mask_token_id") else {
        // vLLM `SpecDecodeBaseProposer._init_parallel_drafting_params` (`vllm/v1/spec_decode/llm_base_proposer.py`)
        // takes the mask slots' token from `dflash_config["mask_token_id"]` (or `pard_token` / `ptd_token_id`)
        // and raises ValueError without one.
        findings.fatal(
            Engine::Vllm,
            format!(
                "{shown}: no `dflash_config.mask_token_id`: vLLM needs it for the masked slots of a block"
            ),
        );
        // SGLang `DFlashWorker._resolve_mask_token_id` then looks `mask_token` up in the tokenizer by name, or
        // adds it: the id it finds need not be the one the drafter was trained with.
        findings.push(
            Engine::Sglang,
            Severity::Warning,
            format!(
                "{shown}: no `dflash_config.mask_token_id`: SGLang resolves the mask token by name in the \
                 tokenizer, which may give another id than the one the drafter was trained with"
            ),
        );
        return None;
    };
    // SGLang `parse_dflash_draft_config`: an integer (not a bool), non-negative.
    let Some(id) = value.as_u64() else {
        findings.both(
            Severity::Fatal,
            format!(
                "{shown}: `dflash_config.mask_token_id` is {value}, expected a non-negative integer"
            ),
        );
        return None;
    };
    if let Some(vocab) = vocab
        && id >= vocab as u64
    {
        // SGLang `DFlashWorker._resolve_mask_token_id`: "DFLASH mask_token_id is outside the target vocab size"
        // (ValueError). vLLM fills every masked slot with this id and embeds it with the target's
        // `VocabParallelEmbedding` of `vocab_size` rows (`DFlashProposer.set_inputs_first_pass`,
        // `parallel_drafting_token_id`; `DFlashQwen3Model.embed_input_ids`): there is no such row.
        findings.both(
            Severity::Fatal,
            format!(
                "{shown}: `dflash_config.mask_token_id` {id} is outside the vocabulary (`vocab_size` {vocab}, \
                 ids 0..={}): the target's embedding has no row for it",
                vocab - 1
            ),
        );
    }
    Some(id)
}

/// `num_target_layers` (from `dflash_config` or the top level), and whether draftpipe assumed it.
fn target_layers(
    shown: &impl std::fmt::Display,
    config: &Map<String, Value>,
    dflash: &Map<String, Value>,
    findings: &mut Findings,
) -> Option<usize> {
    let value = dflash
        .get("num_target_layers")
        .or_else(|| config.get("num_target_layers"))?;
    // `parse_dflash_draft_config`: `_parse_optional_int(..., min_value=1)`.
    let Some(layers) = value
        .as_u64()
        .filter(|&n| n > 0)
        .and_then(|n| usize::try_from(n).ok())
    else {
        findings.both(
            Severity::Fatal,
            format!("{shown}: `num_target_layers` is {value}, expected a positive integer"),
        );
        return None;
    };
    let assumed = config
        .get(DRAFTPIPE_KEY)
        .and_then(|d| d.get(DEPTH_ASSUMED_KEY))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    if assumed {
        findings.both(
            Severity::Warning,
            format!(
                "{shown}: `num_target_layers` {layers} is assumed (the least depth the taps allow), not the \
                 target's: the pipeline's target gave no `layers` and its weights no config.json; it loads on a \
                 target of at least {layers} layers"
            ),
        );
    }
    Some(layers)
}

/// `dflash_config.target_layer_ids` against the target's depth; returns how many there are.
fn target_layer_ids(
    shown: &impl std::fmt::Display,
    dflash: &Map<String, Value>,
    target_layers: Option<usize>,
    draft_layers: Option<usize>,
    findings: &mut Findings,
) -> usize {
    let Some(value) = dflash.get("target_layer_ids") else {
        // Without them SGLang picks evenly spaced layers (`build_target_layer_ids`) and vLLM the target model's
        // default aux layers (`get_eagle3_aux_layers_from_config` returns None): not the layers trained on.
        findings.both(
            Severity::Fatal,
            format!(
                "{shown}: no `dflash_config.target_layer_ids`: the engine would feed the drafter layers of its \
                 own choosing, not the ones it was trained on"
            ),
        );
        return 0;
    };
    // `parse_dflash_draft_config`: a non-empty list of ints.
    let ids: Option<Vec<i64>> = value
        .as_array()
        .filter(|a| !a.is_empty())
        .and_then(|a| a.iter().map(Value::as_i64).collect());
    let Some(ids) = ids else {
        findings.both(
            Severity::Fatal,
            format!(
                "{shown}: `dflash_config.target_layer_ids` is {value}, expected a non-empty list of integers"
            ),
        );
        return 0;
    };
    // SGLang `DFlashDraftConfig.resolve_target_layer_ids` (`dflash_utils.py`) checks each id against
    // `num_target_layers`, or the draft's own `num_hidden_layers` when that is absent (`DFlashDraftModel.__init__`).
    let sglang_depth = target_layers.or(draft_layers);
    for (index, &id) in ids.iter().enumerate() {
        if let Some(depth) = sglang_depth
            && (id < 0 || id as u64 >= depth as u64)
        {
            let whose = if target_layers.is_some() {
                "`num_target_layers`"
            } else {
                "the draft's `num_hidden_layers` (there is no `num_target_layers`)"
            };
            findings.fatal(
                Engine::Sglang,
                format!(
                    "{shown}: `target_layer_ids[{index}]` = {id} is out of range for {depth} target layers \
                     ({whose}): SGLang requires 0 <= id < {depth}"
                ),
            );
        }
        // vLLM `get_eagle3_aux_layers_from_config` (`vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py`)
        // captures target layer `id` as aux layer `id + 1`, which the target's layer loop takes before running
        // that layer (`if idx in self.aux_hidden_state_layers`, `Qwen2Model.forward` / `LlamaModel.forward`,
        // adding the residual, which does not exist yet before layer 0): an aux layer outside 1..depth−1 is never
        // captured, and `DFlashQwen3ForCausalLM.combine_hidden_states` raises on the missing features.
        if let Some(depth) = target_layers
            && (id < 0 || (id + 1) as u64 >= depth as u64)
        {
            findings.fatal(
                Engine::Vllm,
                format!(
                    "{shown}: `target_layer_ids[{index}]` = {id} is beyond what vLLM captures from a {depth}-layer \
                     target: it takes layer id's output before layer id + 1 runs, so 0 <= id <= {}",
                    depth.saturating_sub(2)
                ),
            );
        }
    }
    if target_layers.is_none() {
        findings.fatal(
            Engine::Vllm,
            format!(
                "{shown}: no `num_target_layers`: nothing says the target is deep enough for `target_layer_ids`"
            ),
        );
    }
    ids.len()
}

/// The rules that depend on how the export is served: the speculative token count and the target's tokenizer.
pub(super) fn check_serving(
    config: &DflashConfig,
    options: &CheckOptions,
    tokenizer: Option<&TokenizerVocab>,
    findings: &mut Findings,
) {
    let block = config.block_size;
    if let Some(tokens) = options.speculative_tokens {
        // vLLM's `DFlashProposer` drafts `1 + num_speculative_tokens` query slots per request (the bonus token,
        // then mask tokens: `num_query_per_req`); SGLang's `DFlashWorker.__init__` uses
        // `--speculative-num-draft-tokens` as the block size and only warns when it differs from the config's.
        let slots = tokens + 1;
        if slots > block {
            findings.both(
                Severity::Fatal,
                format!(
                    "{tokens} speculative tokens draft blocks of {slots} slots, but the drafter was trained on \
                     blocks of {block}: the slots past {block} were never trained (use at most {})",
                    block - 1
                ),
            );
        } else if slots < block {
            findings.both(
                Severity::Warning,
                format!(
                    "{tokens} speculative tokens draft blocks of {slots} slots, the drafter was trained on {block}: \
                     it loads (SGLang warns \"DFLASH block size mismatch\") and drafts fewer tokens than it can"
                ),
            );
        }
    }
    let (Some(tokenizer), Some(id)) = (tokenizer, config.mask_token_id) else {
        return;
    };
    // SGLang `DFlashWorker._resolve_mask_token_id`: when the tokenizer's vocabulary holds `mask_token`, its id
    // must be `mask_token_id` ("config mismatch: dflash_config.mask_token_id conflicts with tokenizer vocab id").
    if let Some(found) = tokenizer.id_of(&config.mask_token)
        && found != id
    {
        findings.fatal(
            Engine::Sglang,
            format!(
                "{}: the tokenizer has `{}` as id {found}, but `dflash_config.mask_token_id` is {id}",
                tokenizer.path().display(),
                config.mask_token
            ),
        );
    }
    // The id must be a token the tokenizer knows, or the one SGLang's name lookup would add next
    // (`tokenizer.add_special_tokens({"mask_token": ...})` takes id `len(tokenizer)`, as z-lab's Qwen3 drafters
    // expect: 151669 for Qwen3's tokenizer).
    let size = tokenizer.len() as u64;
    if id > size {
        findings.both(
            Severity::Warning,
            format!(
                "{}: `dflash_config.mask_token_id` {id} is no token of the tokenizer ({size} tokens) nor the id a \
                 new `{}` would get ({size}): its embedding row is one no token of the target uses",
                tokenizer.path().display(),
                config.mask_token
            ),
        );
    }
}
