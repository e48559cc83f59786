//! What the runtime asks of a model family without a backend, from the plan's spec alone: whether its step
//! reads the target's frozen tables, and the serving `config.json` its export writes (and a resumed or
//! evaluated checkpoint is checked against). Each family implements [`FamilySpec`] for its compiler spec in
//! its folder; [`registry::spec`](super::registry::spec) picks the plan's.
//!
//! ```text
//!  ModelSpec ──registry::spec──▶ &dyn FamilySpec ──▶ pipeline (target weights?) │ checkpoint (config.json) │ run
//! ```

use std::path::Path;

use safetensors::Dtype;
use serde_json::Value;

use crate::model::eagle3::vocab::VocabMap;
use crate::tensor_file::F32Tensor;

/// A family's facts the runtime reads from the plan's spec (see the module docs). The defaults describe a
/// family that reads no target tensors and exports no serving config (`mlp`).
pub trait FamilySpec {
    /// The family's name as the plan writes it (`mlp`, `dflash`, …).
    fn name(&self) -> &'static str;

    /// Whether the step reads the target's frozen embedding and `lm_head` (loaded once per run from the
    /// target's weights and uploaded to every drafter).
    fn reads_target_weights(&self) -> bool {
        false
    }

    /// Writes the family's whole export (weights and `config.json`) into `dir` itself, when its files are not
    /// the plain layout tensors plus [`FamilySpec::serving_config`] (`eagle3`: integer and boolean vocabulary
    /// tensors beside the weights); `None`: the checkpoint writes the plain form.
    fn write_export(
        &self,
        _dir: &Path,
        _weights: &[F32Tensor<'_>],
        _export: ExportOptions<'_>,
    ) -> Option<Result<(), Box<dyn std::error::Error + Send + Sync>>> {
        None
    }

    /// Tensors the family's `model.safetensors` holds besides the trained layout (frozen, not loaded into the
    /// replica), which a resume or `--init` accepts and skips.
    fn export_extra_tensors(&self) -> &'static [&'static str] {
        &[]
    }

    /// The serving `config.json` an export of this model writes beside `model.safetensors`, saved with
    /// `export`; `None` when the family exports none.
    fn serving_config(&self, _export: ExportOptions<'_>) -> Option<Value> {
        None
    }

    /// The architecture name serving engines dispatch on (`architectures` in the config), when the family
    /// exports a config.
    fn architecture(&self) -> Option<&'static str> {
        None
    }

    /// The config keys (dotted for nested ones) a loader's model depends on: a config found beside weights
    /// must give each the value [`FamilySpec::serving_config`] does, or it describes another model.
    fn structural_keys(&self) -> &'static [&'static str] {
        &[]
    }
}

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

/// What a save writes beside the buffers: the dtype of `model.safetensors`, the target's depth for
/// `config.json`'s `num_target_layers`, and the draft vocabulary of a family that has one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ExportOptions<'a> {
    /// The dtype `model.safetensors` is stored in (`--save-dtype`).
    pub dtype: WeightsDtype,
    /// The target's depth ([`TargetStage::layers`](draftpipe_compiler::plan::TargetStage::layers)); `None` when
    /// nothing says it.
    pub target_layers: Option<usize>,
    /// The run's draft vocabulary (`eagle3`: `d2t`/`t2d`, exported beside the weights); `None` for a family
    /// without one.
    pub vocab_map: Option<&'a VocabMap>,
}

/// The key, under [`DRAFTPIPE_KEY`], set to `true` when `num_target_layers` is the least depth the taps allow
/// rather than the target's own: `export-check` then cannot say whether the drafter fits the target.
pub const DEPTH_ASSUMED_KEY: &str = "num_target_layers_assumed";

/// The `config.json` object that carries draftpipe's own notes (engines ignore unknown keys).
pub const DRAFTPIPE_KEY: &str = "draftpipe";

/// A float as JSON through its shortest decimal form, so `1e-6_f32` is written `1e-6`, not the f64 widening
/// `9.999999974752427e-7`.
pub(crate) fn json_f32(value: f32) -> Value {
    value
        .to_string()
        .parse::<f64>()
        .ok()
        .and_then(serde_json::Number::from_f64)
        .map_or(Value::Null, Value::Number)
}
