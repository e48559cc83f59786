//! The tensor rules: which safetensors files each engine reads from the directory, which names its DFlash loader
//! maps to a parameter, which it skips or rejects, and the shapes it expects; and the load both families'
//! checks walk (this one and `eagle3.rs`): each tensor through an engine's name rule, then the parameters left
//! without one.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use safetensors::Dtype;
use serde_json::Value;

use super::config::DflashConfig;
use super::{Engine, Findings, Severity};
use crate::tensor_file::{TensorFile, is_float_dtype};

/// The shard index both loaders honour.
const INDEX_FILE: &str = "model.safetensors.index.json";

/// One tensor of the files an engine reads: its name, dtype, shape, bytes and file.
pub(super) struct Header {
    pub(super) name: String,
    pub(super) dtype: Dtype,
    pub(super) shape: Vec<usize>,
    pub(super) float: bool,
    pub(super) bytes: u64,
    pub(super) file: PathBuf,
}

/// An engine model's parameters by the names its loader maps checkpoint names to, with their shapes.
pub(super) type Parameters = BTreeMap<String, Vec<usize>>;

/// The safetensors files an engine reads from `dir`. Both loaders glob `*.safetensors` at the top of the model
/// directory (vLLM `DefaultModelLoader._prepare_weights`, `vllm/model_executor/model_loader/default_loader.py`;
/// SGLang's `DefaultModelLoader._prepare_weights` in `python/sglang/srt/model_loader/loader.py`, derived from it)
/// and, when `model.safetensors.index.json` is there, keep only the files its `weight_map` names
/// (`filter_duplicate_safetensors_files`). Subdirectories are not looked into.
fn weight_files(dir: &Path, findings: &mut Findings) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = match std::fs::read_dir(dir) {
        Ok(entries) => entries
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.is_file() && p.extension().is_some_and(|e| e == "safetensors"))
            .collect(),
        Err(error) => {
            findings.both(Severity::Fatal, format!("{}: {error}", dir.display()));
            return Vec::new();
        }
    };
    files.sort();
    let index = dir.join(INDEX_FILE);
    if let Ok(text) = std::fs::read(&index) {
        let named: Option<BTreeSet<String>> =
            serde_json::from_slice::<Value>(&text).ok().and_then(|v| {
                v.get("weight_map")?.as_object().map(|m| {
                    m.values()
                        .filter_map(Value::as_str)
                        .map(str::to_owned)
                        .collect()
                })
            });
        match named {
            Some(named) => files.retain(|f| {
                f.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| named.contains(n))
            }),
            None => findings.both(
                Severity::Fatal,
                format!(
                    "{}: not a shard index (no `weight_map` object)",
                    index.display()
                ),
            ),
        }
    }
    files
}

/// Reads the headers of `files`; an unreadable file is a finding for both engines.
fn headers(files: &[PathBuf], findings: &mut Findings) -> Vec<Header> {
    let mut out = Vec::new();
    for path in files {
        let file = match TensorFile::open(path) {
            Ok(file) => file,
            Err(error) => {
                findings.both(Severity::Fatal, error.to_string());
                continue;
            }
        };
        for name in file.names() {
            let Some(info) = file.info(&name) else {
                continue;
            };
            let elements: u64 = info.shape.iter().map(|&d| d as u64).product();
            out.push(Header {
                bytes: elements * (info.dtype.bitsize() as u64 / 8),
                dtype: info.dtype,
                float: is_float_dtype(info.dtype),
                shape: info.shape.clone(),
                file: path.clone(),
                name,
            });
        }
    }
    out
}

/// The parameters an engine's DFlash model has, under the checkpoint's (z-lab's) names, with their shapes:
/// SGLang `DFlashDraftModel` (`layers.*`, `fc`, `hidden_norm`, `norm`; no embedding, no head), vLLM
/// `DFlashQwen3Model` the same under `model.` (its own `embed_tokens` and `lm_head` only when the checkpoint
/// ships them). `q_proj`/`k_proj`/`v_proj` and `gate_proj`/`up_proj` load as shards of the fused `qkv_proj` and
/// `gate_up_proj` (both loaders' stacked-parameter mappings), so each keeps its own shape here.
fn parameters(config: &DflashConfig, engine: Engine) -> Parameters {
    let (h, hd, i) = (config.hidden, config.head_dim, config.intermediate);
    let (q, kv) = (config.heads * hd, config.kv_heads * hd);
    // The context projection reads `len(target_layer_ids)` features of the target's width: SGLang
    // `DFlashDraftModel.__init__` (`num_context_features * hidden_size`), vLLM `_get_dflash_fc_input_size`
    // (`target_hidden_size or hidden_size`, times the aux layers).
    let fc_in = config.context_features
        * match engine {
            Engine::Sglang => h,
            Engine::Vllm => config.target_hidden,
        };
    let mut params = BTreeMap::from([
        ("fc.weight".to_owned(), vec![h, fc_in]),
        ("hidden_norm.weight".to_owned(), vec![h]),
        ("norm.weight".to_owned(), vec![h]),
    ]);
    for l in 0..config.layers {
        let p = format!("layers.{l}");
        for (name, shape) in [
            ("input_layernorm.weight", vec![h]),
            ("post_attention_layernorm.weight", vec![h]),
            ("self_attn.q_proj.weight", vec![q, h]),
            ("self_attn.k_proj.weight", vec![kv, h]),
            ("self_attn.v_proj.weight", vec![kv, h]),
            ("self_attn.o_proj.weight", vec![h, q]),
            ("self_attn.q_norm.weight", vec![hd]),
            ("self_attn.k_norm.weight", vec![hd]),
            ("mlp.gate_proj.weight", vec![i, h]),
            ("mlp.up_proj.weight", vec![i, h]),
            ("mlp.down_proj.weight", vec![h, i]),
        ] {
            params.insert(format!("{p}.{name}"), shape);
        }
        if config.attention_bias {
            // `attention_bias` gives the q/k/v projections a bias, and `o_proj` one too (both loaders).
            for (name, len) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv), ("o_proj", h)] {
                params.insert(format!("{p}.self_attn.{name}.bias"), vec![len]);
            }
        }
    }
    params
}

/// What an engine's loader does with one checkpoint name.
pub(super) enum Mapped {
    /// Loads into the parameter of that name.
    Param(String),
    /// Skipped by design, or loaded as something the model may carry but the export need not (an own embedding
    /// or head, a draft-vocabulary map): not checked further.
    Optional,
    /// Read by a rule of the family's own (EAGLE-3's `d2t`): handed back by [`load`].
    Aside,
    /// Skipped without a word.
    Skipped,
    /// Refused: the load fails with this message.
    Rejected(String),
}

/// SGLang `DFlashDraftModel.load_weights` (`python/sglang/srt/models/dflash.py`): a name resolves to a
/// parameter as written, without a leading `model.`, or with one added (`resolve_param_name`); anything else is
/// skipped ("Ignore unexpected weights").
fn sglang_map(name: &str, params: &Parameters) -> Mapped {
    let bare = name.strip_prefix("model.").unwrap_or(name);
    if params.contains_key(bare) {
        Mapped::Param(bare.to_owned())
    } else {
        Mapped::Skipped
    }
}

/// vLLM `DFlashQwen3ForCausalLM.load_weights` (`vllm/model_executor/models/qwen3_dflash.py`): `mask_hidden` is an
/// assertion failure, `t2d` is skipped, `d2t` loads as `draft_id_to_target_id`, every other name but `lm_head`'s
/// gets `model.` prepended and goes through `DFlashQwen3Model.hf_to_vllm_mapper` (`midlayer.` → `layers.0.`,
/// `encoder.fc.` → `fc.`, `encoder.output_norm_enc.` → `hidden_norm.`) into `AutoWeightsLoader`, which raises
/// "There is no module or parameter named …" for a name that reaches no parameter
/// (`AutoWeightsLoader._load_module`, `vllm/model_executor/models/utils.py`).
fn vllm_map(name: &str, params: &Parameters) -> Mapped {
    if name.contains("mask_hidden") {
        return Mapped::Rejected(
            "vLLM asserts a DFlash checkpoint ships no `mask_hidden` weight".to_owned(),
        );
    }
    if name.contains("t2d") {
        return Mapped::Skipped;
    }
    if name.contains("d2t") || name.contains("lm_head") || name.contains("embed_tokens") {
        return Mapped::Optional;
    }
    let mapped = name
        .replace("midlayer.", "layers.0.")
        .replace("encoder.output_norm_enc.", "hidden_norm.")
        .replace("encoder.fc.", "fc.");
    if params.contains_key(&mapped) {
        Mapped::Param(mapped)
    } else {
        Mapped::Rejected(format!(
            "vLLM raises \"There is no module or parameter named 'model.{mapped}'\" (it prepends `model.` to \
             every name but `lm_head`'s)"
        ))
    }
}

/// The headers of the weight files an engine reads from `dir`, or `None` (a fatal finding) when there are none.
pub(super) fn weight_headers(dir: &Path, findings: &mut Findings) -> Option<Vec<Header>> {
    let files = weight_files(dir, findings);
    if files.is_empty() {
        findings.both(
            Severity::Fatal,
            format!(
                "{}: no `*.safetensors` file at the top: there are no weights to load",
                dir.display()
            ),
        );
        return None;
    }
    Some(headers(&files, findings))
}

/// Applies the tensor rules of both engines to the weight files in `dir`.
pub(super) fn check(dir: &Path, config: Option<&DflashConfig>, findings: &mut Findings) {
    let Some(headers) = weight_headers(dir, findings) else {
        return;
    };
    let Some(config) = config else { return };
    for engine in Engine::ALL {
        let map = |name: &str, params: &Parameters| match engine {
            Engine::Sglang => sglang_map(name, params),
            Engine::Vllm => vllm_map(name, params),
        };
        load(engine, &headers, &parameters(config, engine), map, findings);
    }
}

/// One engine's load of `headers`, each named by `map`: a tensor for a parameter must be a float of its shape,
/// tensors skipped without a word are a warning (the bytes read for nothing), and a parameter no tensor reached
/// is fatal. Returns the headers `map` set aside for the family's own rules.
pub(super) fn load<'h>(
    engine: Engine,
    headers: &'h [Header],
    params: &Parameters,
    map: impl Fn(&str, &Parameters) -> Mapped,
    findings: &mut Findings,
) -> Vec<&'h Header> {
    let mut loaded = BTreeSet::new();
    let mut skipped: Vec<&Header> = Vec::new();
    let mut aside = Vec::new();
    for header in headers {
        let file = header.file.display();
        match map(&header.name, params) {
            Mapped::Param(param) => {
                let expected = &params[&param];
                if !header.float {
                    findings.fatal(
                        engine,
                        format!("{file}: tensor `{}` is not F32, BF16 or F16", header.name),
                    );
                } else if &header.shape != expected {
                    // SGLang raises "DFLASH fc.weight shape mismatch" for DFlash's `fc`, and its
                    // `default_weight_loader` asserts equal sizes for the rest; vLLM's weight loaders assert the
                    // same.
                    findings.fatal(
                        engine,
                        format!(
                            "{file}: tensor `{}` has shape {:?}, the config's model expects {expected:?}",
                            header.name, header.shape
                        ),
                    );
                }
                loaded.insert(param);
            }
            Mapped::Optional => {}
            Mapped::Aside => aside.push(header),
            Mapped::Skipped => skipped.push(header),
            Mapped::Rejected(why) => {
                findings.fatal(engine, format!("{file}: tensor `{}`: {why}", header.name))
            }
        }
    }
    if !skipped.is_empty() {
        let bytes: u64 = skipped.iter().map(|h| h.bytes).sum();
        let names: Vec<&str> = skipped.iter().take(3).map(|h| h.name.as_str()).collect();
        let more = skipped.len().saturating_sub(names.len());
        findings.push(
            engine,
            Severity::Warning,
            format!(
                "skips {} tensor{} it has no parameter for ({}{}), reading {bytes} bytes it does not use",
                skipped.len(),
                if skipped.len() == 1 { "" } else { "s" },
                names.join(", "),
                if more > 0 {
                    format!(" and {more} more")
                } else {
                    String::new()
                }
            ),
        );
    }
    let missing: Vec<&String> = params.keys().filter(|p| !loaded.contains(*p)).collect();
    if let Some(first) = missing.first() {
        let why = match engine {
            // SGLang's loader never checks that every parameter was loaded: the missing ones keep their
            // initial values and the drafter drafts from them.
            Engine::Sglang => "SGLang loads without it and drafts with an uninitialised parameter",
            // `DefaultModelLoader.load_weights`: "Following weights were not initialized from checkpoint".
            Engine::Vllm => {
                "vLLM raises \"Following weights were not initialized from checkpoint\""
            }
        };
        findings.fatal(
            engine,
            format!(
                "no tensor for parameter `{first}`{}: {why}",
                if missing.len() > 1 {
                    format!(" (and {} more)", missing.len() - 1)
                } else {
                    String::new()
                }
            ),
        );
    }
    aside
}
