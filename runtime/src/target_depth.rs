//! The target's depth, which a `dflash` export writes as `num_target_layers`: the pipeline's `layers`, or the
//! `num_hidden_layers` of the Hugging Face `config.json` beside the target's `weights`.
//!
//! ```text
//!  target `layers = N` ─────────────────────────────┐
//!  weights = safetensors(path = DIR | DIR/FILE | DIR/GLOB) ──DIR/config.json num_hidden_layers──┴─▶ plan.target.layers
//! ```
//!
//! Both given must agree; a tap the config's depth cannot hold is an error here, as the compiler reports one
//! beyond `layers`: a `depth`-layer target's hidden-states tuple has `depth + 1` entries (0: the embeddings,
//! `depth`: the last layer's output), so taps run from 0 to `depth`. A `config.json` that describes a draft model
//! (a DFlash or EAGLE-3 export, by its `architectures`) is refused: its `num_hidden_layers` is the drafter's
//! depth, not the target's. Neither given: `plan.target.layers` stays `None` and the export says its depth is
//! assumed.

use std::path::{Path, PathBuf};

use draftpipe_compiler::plan::{Plan, WeightsSpec};
use serde_json::Value;

/// The Hugging Face config file of a model directory.
const TARGET_CONFIG_FILE: &str = "config.json";

/// The largest `config.json` read (a real one is a few kilobytes).
const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// Why the target's depth could not be settled.
#[derive(Debug, thiserror::Error)]
pub enum TargetDepthError {
    /// The target's `config.json` is unreadable, not JSON, or has no usable `num_hidden_layers`.
    #[error("{}: {message}", path.display())]
    Config {
        /// The config file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The pipeline's `layers` and the target's `config.json` disagree.
    #[error(
        "{}: `num_hidden_layers` is {found}, but the pipeline's target says `layers = {pipeline}`",
        path.display()
    )]
    Disagrees {
        /// The config file.
        path: PathBuf,
        /// Its `num_hidden_layers`.
        found: usize,
        /// The pipeline's `layers`.
        pipeline: usize,
    },
    /// A tap needs a deeper target than the config describes.
    #[error(
        "tap {tap} is beyond the target's {depth} layers ({} `num_hidden_layers`): tap t is entry t of the \
         hidden states, which has {} entries (0: the embeddings, {depth}: the last layer's output), so the \
         deepest tap this target has is {depth}",
        path.display(),
        depth + 1
    )]
    TapBeyond {
        /// The tap.
        tap: u32,
        /// The config's depth.
        depth: usize,
        /// The config file.
        path: PathBuf,
    },
    /// The `config.json` beside the weights describes a draft model, not the target.
    #[error(
        "{}: `architectures` is {architectures}, a draft model's config ({kind}), not the target's: its \
         `num_hidden_layers` is the drafter's depth. Point the target's `weights` at the target model's \
         directory (the one its `config.json` names as a causal LM)",
        path.display()
    )]
    DraftConfig {
        /// The config file.
        path: PathBuf,
        /// Its `architectures`, as written.
        architectures: String,
        /// Which kind of drafter: `a DFlash export` or `an EAGLE export`.
        kind: &'static str,
    },
}

/// The `config.json` that sits beside the target's weights: in the directory given, or in the directory of the
/// file or glob given (a glob in a directory name is not looked into). `None` when there is none.
pub fn target_config_path(weights: &WeightsSpec) -> Option<PathBuf> {
    let WeightsSpec::Safetensors { path } = weights;
    let path = Path::new(path);
    let dir = if path.is_dir() {
        path
    } else {
        path.parent()
            .filter(|d| !d.to_string_lossy().contains(['*', '?', '[']))?
    };
    let config = dir.join(TARGET_CONFIG_FILE);
    config.is_file().then_some(config)
}

/// The decoder depth a Hugging Face `config.json` gives: `num_hidden_layers`, or `text_config.num_hidden_layers`
/// for a multimodal model.
///
/// # Errors
/// [`TargetDepthError::Config`] when the file is unreadable, too large, not JSON, or has no positive integer there;
/// [`TargetDepthError::DraftConfig`] when its `architectures` name a draft model.
pub fn read_target_depth(path: &Path) -> Result<usize, TargetDepthError> {
    let error = |message: String| TargetDepthError::Config {
        path: path.to_path_buf(),
        message,
    };
    let size = std::fs::metadata(path)
        .map_err(|e| error(e.to_string()))?
        .len();
    if size > MAX_CONFIG_BYTES {
        return Err(error(format!(
            "{size} bytes, over the limit of {MAX_CONFIG_BYTES} for a model config"
        )));
    }
    let text = std::fs::read(path).map_err(|e| error(e.to_string()))?;
    let config: Value = serde_json::from_slice(&text)
        .map_err(|e| error(format!("line {}, column {}: {e}", e.line(), e.column())))?;
    if let Some(kind) = draft_kind(&config) {
        return Err(TargetDepthError::DraftConfig {
            path: path.to_path_buf(),
            architectures: config["architectures"].to_string(),
            kind,
        });
    }
    let layers = config
        .get("num_hidden_layers")
        .or_else(|| config.get("text_config")?.get("num_hidden_layers"));
    match layers {
        Some(value) => value
            .as_u64()
            .filter(|&n| n > 0)
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| {
                error(format!(
                    "`num_hidden_layers` is {value}, expected a positive integer"
                ))
            }),
        None => Err(error(
            "no `num_hidden_layers` (nor `text_config.num_hidden_layers`): the target's depth is unknown"
                .to_owned(),
        )),
    }
}

/// The kind of drafter a config's `architectures` name, if any: draftpipe's own exports write
/// `DFlashDraftModel` and `LlamaForCausalLMEagle3`, and the other EAGLE exports name `Eagle` in theirs
/// (`Eagle3LlamaForCausalLM`, `EagleLlamaForCausalLM`).
fn draft_kind(config: &Value) -> Option<&'static str> {
    let names = config.get("architectures")?.as_array()?;
    names.iter().filter_map(Value::as_str).find_map(|name| {
        let name = name.to_ascii_lowercase();
        if name.contains("dflash") {
            Some("a DFlash export")
        } else if name.contains("eagle") {
            Some("an EAGLE export")
        } else {
            None
        }
    })
}

/// `plan` with `target.layers` settled: the pipeline's, checked against the target's `config.json` when the
/// weights have one, or that config's depth when the pipeline gives none.
///
/// # Errors
/// [`TargetDepthError`]: the config is unusable, disagrees with `layers`, or is too shallow for a tap.
pub fn resolve_target_layers(plan: &Plan) -> Result<Plan, TargetDepthError> {
    let mut resolved = plan.clone();
    let Some(path) = plan.target.weights.as_ref().and_then(target_config_path) else {
        return Ok(resolved);
    };
    let depth = read_target_depth(&path)?;
    if let Some(pipeline) = plan.target.layers
        && pipeline != depth
    {
        return Err(TargetDepthError::Disagrees {
            path,
            found: depth,
            pipeline,
        });
    }
    if let Some(&tap) = plan.target.tap_layers.iter().find(|&&t| t as usize > depth) {
        return Err(TargetDepthError::TapBeyond { tap, depth, path });
    }
    resolved.target.layers = Some(depth);
    Ok(resolved)
}
