//! The Hugging Face side of a checkpoint: the serving `config.json` a family's export writes beside
//! `model.safetensors` (its content is the family's: [`FamilySpec::serving_config`]), the check of a config
//! found beside weights against the plan, and the dtype that file is stored in.
//!
//! ```text
//!  FamilySpec ──serving_config──▶ DIR/config.json ──check_config──▶ --init / --resume / eval (against the plan)
//! ```

use std::fs;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::CheckpointError;
pub use crate::model::serving::{ExportOptions, FamilySpec, WeightsDtype};

/// The config file inside a checkpoint directory (of a family that exports one: `dflash`).
pub const CONFIG_FILE: &str = "config.json";

/// Writes `spec`'s serving config, when its family has one, to `path` (pretty-printed, keys sorted,
/// newline-terminated) and fsyncs it. Returns whether a config was written.
///
/// # Errors
/// [`CheckpointError`] when the file cannot be written.
pub fn write_config(
    path: &Path,
    spec: &dyn FamilySpec,
    export: ExportOptions,
) -> Result<bool, CheckpointError> {
    let Some(config) = spec.serving_config(export) else {
        return Ok(false);
    };
    let mut text = serde_json::to_vec_pretty(&config).map_err(|e| CheckpointError::Config {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    text.push(b'\n');
    super::write_synced(path, &text)?;
    Ok(true)
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
/// and every structural key ([`FamilySpec::structural_keys`]). The error names the file and the key, with the
/// file's value and the plan's. A family without a serving config accepts any file.
///
/// # Errors
/// [`CheckpointError::ConfigKey`] for a key that differs; I/O and JSON errors.
pub fn check_config(path: &Path, spec: &dyn FamilySpec) -> Result<(), CheckpointError> {
    let Some(expected) = spec.serving_config(ExportOptions::default()) else {
        return Ok(());
    };
    let family = spec.name();
    let config = read_config(path)?;
    let mismatch = |key: &str, message: String| CheckpointError::ConfigKey {
        path: path.to_path_buf(),
        key: key.to_string(),
        message,
    };
    if let (Some(architectures), Some(architecture)) =
        (config.get("architectures"), spec.architecture())
    {
        let names: Vec<&str> = architectures
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        if !names.contains(&architecture) {
            return Err(mismatch(
                "architectures",
                format!("is {architectures}, expected [\"{architecture}\"] for a {family} drafter"),
            ));
        }
    }
    let at = |value: &Value, key: &str| key.split('.').try_fold(value, |v, k| v.get(k)).cloned();
    for &key in spec.structural_keys() {
        let expected = at(&expected, key).unwrap_or(Value::Null);
        match at(&config, key) {
            None => {
                return Err(mismatch(
                    key,
                    format!("is missing; the plan's {family} drafter has {expected}"),
                ));
            }
            Some(found) if !same_value(&found, &expected) => {
                return Err(mismatch(
                    key,
                    format!("is {found}, the plan's {family} drafter has {expected}"),
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
