//! EAGLE-3's export: the trained tensors and the draft vocabulary as the directory SGLang's
//! `LlamaForCausalLMEagle3` and vLLM's `Eagle3LlamaForCausalLM` load (`config.json` and `model.safetensors`).
//!
//! ```text
//!  (Eagle3Spec, trained tensors in the layout's names, VocabMap) ──write_eagle3_export──▶ DIR/config.json
//!                                                                                      └─▶ DIR/model.safetensors
//! ```
//!
//! The tensors keep the plan's names (SpecForge's state dict, which both loaders read: `fc.weight`,
//! `midlayer.*`, `norm.weight`, `lm_head.weight`), in `--save-dtype`; `d2t` goes in as int64 (SGLang adds
//! `arange` to it for its hot-token ids, vLLM loads it into a `long` parameter) and `t2d` as bool (both skip it;
//! SpecForge ships it). The frozen embedding is not saved: both engines take the target's. The config is a Llama
//! config of one decoder layer with `draft_vocab_size`, `target_hidden_size` and the tapped layers in each
//! engine's convention: SGLang reads `eagle_config.eagle_aux_hidden_state_layer_ids` as layer outputs and adds
//! one (`set_eagle3_layers_to_capture`), so it gets `tap − 1`; vLLM reads a top-level
//! `eagle_aux_hidden_state_layer_ids` as the residual stream entering that layer
//! (`get_eagle3_aux_layers_from_config`, used as is), which is the hidden-states index the plan's taps already
//! are. Both describe the same layers. `draftpipe.tap_layers` and `draftpipe.ttt` record what was trained, for
//! `export-check`.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use draftpipe_compiler::plan::Eagle3Spec;
use safetensors::Dtype;
use safetensors::tensor::{Metadata, TensorInfo};
use serde_json::{Value, json};

use super::vocab::{D2T, T2D, VocabMap};
use crate::checkpoint::{CONFIG_FILE, WeightsDtype};
use crate::model::serving::DRAFTPIPE_KEY;
use crate::tensor_file::{F32Tensor, TensorFileError, TensorProblem};

/// The architecture SGLang's `EntryClass` and vLLM's registry dispatch on.
pub const EAGLE3_ARCHITECTURE: &str = "LlamaForCausalLMEagle3";

/// `max_position_embeddings` written to the config: the draft's RoPE table in the engines, which must cover the
/// target's context; the plan does not know the target's, so this is Qwen3's (8B and its siblings), as SpecForge's
/// `configs/qwen3-8b-eagle3.json` has it.
const MAX_POSITION_EMBEDDINGS: u64 = 40_960;

/// The weights file both engines glob.
pub const WEIGHTS_FILE: &str = "model.safetensors";

/// Elements converted per chunk when streaming a tensor to disk.
const WRITE_CHUNK: usize = 16 * 1024;

/// Why an export could not be written.
#[derive(Debug, thiserror::Error)]
pub enum Eagle3ExportError {
    /// The tensors given are not the spec's layout (names, order and shapes).
    #[error(
        "tensor {index} is `{found}` {found_shape:?}, the eagle3 layout has `{expected}` {expected_shape:?} there"
    )]
    Layout {
        /// Position in the list.
        index: usize,
        /// Name given (empty when the list is short).
        found: String,
        /// Shape given.
        found_shape: Vec<usize>,
        /// The layout's name.
        expected: String,
        /// The layout's shape.
        expected_shape: Vec<usize>,
    },
    /// More tensors than the layout has.
    #[error("{extra} tensors more than the eagle3 layout's {layout}")]
    ExtraTensors {
        /// How many more.
        extra: usize,
        /// The layout's count.
        layout: usize,
    },
    /// The vocabulary map is not the spec's size.
    #[error(
        "the vocabulary map has draft_vocab {draft} and vocab {target}; the drafter has {spec_draft} and {spec_target}"
    )]
    MapSizes {
        /// The map's draft vocabulary.
        draft: usize,
        /// The map's target vocabulary.
        target: usize,
        /// The spec's draft vocabulary.
        spec_draft: usize,
        /// The spec's target vocabulary.
        spec_target: usize,
    },
    /// Writing a file failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The weights file could not be laid out.
    #[error(transparent)]
    File(#[from] TensorFileError),
}

/// SGLang's `eagle_config.eagle_aux_hidden_state_layer_ids`: the target layer whose output each tap is (`tap − 1`;
/// the plan's taps index the hidden-states tuple, whose entry 0 is the embeddings).
pub fn sglang_aux_layer_ids(spec: &Eagle3Spec) -> Vec<i64> {
    spec.tap_layers.iter().map(|&tap| tap as i64 - 1).collect()
}

/// vLLM's top-level `eagle_aux_hidden_state_layer_ids`: the layer each tap is captured entering, the tap itself.
pub fn vllm_aux_layer_ids(spec: &Eagle3Spec) -> Vec<i64> {
    spec.tap_layers.iter().map(|&tap| tap as i64).collect()
}

/// A float as JSON through its shortest decimal form (`1e-6_f32` is written `1e-6`).
fn json_f32(value: f32) -> Value {
    value
        .to_string()
        .parse::<f64>()
        .ok()
        .and_then(serde_json::Number::from_f64)
        .map_or(Value::Null, Value::Number)
}

/// The `config.json` of an `eagle3` drafter with `spec`'s dimensions, its weights stored in `dtype`. Keys follow
/// SpecForge's `configs/qwen3-8b-eagle3.json` (a Llama config of one layer) plus the aux layer ids each engine
/// reads (module docs).
pub fn eagle3_config(spec: &Eagle3Spec, dtype: WeightsDtype) -> Value {
    json!({
        "architectures": [EAGLE3_ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": spec.hidden,
        "target_hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": 1,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "attention_bias": false,
        "attention_dropout": 0.0,
        "mlp_bias": false,
        "rope_theta": json_f32(spec.rope_theta),
        "rope_scaling": null,
        "rms_norm_eps": json_f32(spec.rms_norm_eps),
        "vocab_size": spec.vocab,
        "draft_vocab_size": spec.draft_vocab,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "tie_word_embeddings": false,
        "initializer_range": 0.02,
        "use_cache": true,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": sglang_aux_layer_ids(spec),
            "use_aux_hidden_state": true,
        },
        "eagle_aux_hidden_state_layer_ids": vllm_aux_layer_ids(spec),
        "torch_dtype": dtype.torch_name(),
        DRAFTPIPE_KEY: {
            "tap_layers": spec.tap_layers,
            "ttt": spec.ttt,
        },
    })
}

/// One tensor of the weights file and how its elements are stored.
enum Stored<'a> {
    /// Trained floats, in the export's dtype.
    Floats(&'a [f32]),
    /// Integers, int64.
    Ids(&'a [i64]),
    /// Bools, one byte each.
    Bools(&'a [bool]),
}

/// Writes `spec`'s export into the existing directory `dir`: `config.json` and `model.safetensors` holding
/// `weights` (the spec's layout, in order: names and shapes are checked) in `dtype`, `d2t` and `t2d`.
///
/// # Errors
/// [`Eagle3ExportError`]: tensors that are not the layout, a map of other sizes, a failed write.
pub fn write_eagle3_export(
    dir: &Path,
    spec: &Eagle3Spec,
    weights: &[F32Tensor<'_>],
    map: &VocabMap,
    dtype: WeightsDtype,
) -> Result<(), Eagle3ExportError> {
    check_layout(spec, weights)?;
    if (map.draft_vocab(), map.target_vocab()) != (spec.draft_vocab, spec.vocab) {
        return Err(Eagle3ExportError::MapSizes {
            draft: map.draft_vocab(),
            target: map.target_vocab(),
            spec_draft: spec.draft_vocab,
            spec_target: spec.vocab,
        });
    }
    // d2t first and t2d last keep every tensor's offset a multiple of its element size.
    let mut tensors: Vec<(&str, Vec<usize>, Stored<'_>)> = Vec::with_capacity(weights.len() + 2);
    tensors.push((D2T, vec![map.draft_vocab()], Stored::Ids(&map.d2t)));
    tensors.extend(
        weights
            .iter()
            .map(|t| (t.name, t.shape.to_vec(), Stored::Floats(t.data))),
    );
    tensors.push((T2D, vec![map.target_vocab()], Stored::Bools(&map.t2d)));
    write_weights(&dir.join(WEIGHTS_FILE), &tensors, dtype.dtype())?;

    let path = dir.join(CONFIG_FILE);
    let io = |source| Eagle3ExportError::Io {
        path: path.clone(),
        source,
    };
    let mut text = serde_json::to_vec_pretty(&eagle3_config(spec, dtype))
        .map_err(|e| io(std::io::Error::other(e)))?;
    text.push(b'\n');
    let mut file = File::create(&path).map_err(io)?;
    file.write_all(&text)
        .and_then(|()| file.sync_all())
        .map_err(io)
}

/// `weights` are the spec's layout: the same names, in order, with the same shapes and data lengths.
fn check_layout(spec: &Eagle3Spec, weights: &[F32Tensor<'_>]) -> Result<(), Eagle3ExportError> {
    let layout = spec.layout();
    for (index, view) in layout.iter().enumerate() {
        let given = weights.get(index);
        let fits = given.is_some_and(|t| {
            t.name == view.name && t.shape == view.shape.as_slice() && t.data.len() == view.len()
        });
        if !fits {
            return Err(Eagle3ExportError::Layout {
                index,
                found: given.map_or_else(String::new, |t| t.name.to_string()),
                found_shape: given.map_or_else(Vec::new, |t| t.shape.to_vec()),
                expected: view.name.clone(),
                expected_shape: view.shape.clone(),
            });
        }
    }
    if weights.len() > layout.len() {
        return Err(Eagle3ExportError::ExtraTensors {
            extra: weights.len() - layout.len(),
            layout: layout.len(),
        });
    }
    Ok(())
}

/// Streams `tensors` into one safetensors file at `path` (floats as `floats`, F32 or BF16), then fsyncs it.
fn write_weights(
    path: &Path,
    tensors: &[(&str, Vec<usize>, Stored<'_>)],
    floats: Dtype,
) -> Result<(), Eagle3ExportError> {
    let bad_header = |e: String| TensorFileError::file(path, TensorProblem::BadHeader(e));
    let mut infos = Vec::with_capacity(tensors.len());
    let mut offset = 0;
    for (name, shape, stored) in tensors {
        let (dtype, len) = match stored {
            Stored::Floats(v) => (floats, v.len()),
            Stored::Ids(v) => (Dtype::I64, v.len()),
            Stored::Bools(v) => (Dtype::BOOL, v.len()),
        };
        let bytes = len * dtype.bitsize() / 8;
        infos.push((
            name.to_string(),
            TensorInfo {
                dtype,
                shape: shape.clone(),
                data_offsets: (offset, offset + bytes),
            },
        ));
        offset += bytes;
    }
    let metadata = Metadata::new(Some(HashMap::from([("format".into(), "pt".into())])), infos)
        .map_err(|e| bad_header(e.to_string()))?;
    let mut header = serde_json::to_vec(&metadata).map_err(|e| bad_header(e.to_string()))?;
    // Padded with spaces to 8 bytes, as the reference writer does, so the data that follows is aligned.
    header.resize(header.len().next_multiple_of(8), b' ');

    let io = |source| Eagle3ExportError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut out = BufWriter::with_capacity(1 << 20, File::create(path).map_err(io)?);
    out.write_all(&(header.len() as u64).to_le_bytes())
        .and_then(|()| out.write_all(&header))
        .map_err(io)?;
    let mut chunk = Vec::with_capacity(WRITE_CHUNK * 8);
    for (_, _, stored) in tensors {
        match stored {
            Stored::Floats(values) => {
                for part in values.chunks(WRITE_CHUNK) {
                    chunk.clear();
                    if floats == Dtype::BF16 {
                        chunk.extend(
                            part.iter()
                                .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()),
                        );
                    } else {
                        chunk.extend(part.iter().flat_map(|v| v.to_le_bytes()));
                    }
                    out.write_all(&chunk).map_err(io)?;
                }
            }
            Stored::Ids(values) => {
                chunk.clear();
                chunk.extend(values.iter().flat_map(|v| v.to_le_bytes()));
                out.write_all(&chunk).map_err(io)?;
            }
            Stored::Bools(values) => {
                chunk.clear();
                chunk.extend(values.iter().map(|&b| u8::from(b)));
                out.write_all(&chunk).map_err(io)?;
            }
        }
    }
    let file = out.into_inner().map_err(|e| io(e.into_error()))?;
    file.sync_all().map_err(io)
}
