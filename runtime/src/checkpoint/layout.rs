//! Where each file of a checkpoint directory lives: what serving engines read at the top, the training state in
//! a subdirectory.
//!
//! ```text
//!  DIR/config.json, DIR/model.safetensors                        what vLLM, SGLang and z-lab's code load
//!  DIR/training_state/{optimizer.safetensors, state.json}        what --resume reads
//!  DIR/{model,optimizer}.safetensors, DIR/{state,config}.json    the older layout: still loads, never written
//! ```
//!
//! vLLM's loader takes every `*.safetensors` file at the top of a draft model's directory (when there is no
//! `model.safetensors.index.json` naming the shards), so an optimizer file beside the weights stops it with
//! `There is no module or parameter named 'exp_avg'`; SGLang skips unknown names but still reads the file. The
//! training state therefore sits one level down, under a name no engine globs.

use std::fs;
use std::path::{Path, PathBuf};

use super::{CONFIG_FILE, CheckpointError, MODEL_FILE, OPTIMIZER_FILE, STATE_FILE, io_error};

/// The subdirectory of a checkpoint that holds the training state (`optimizer.safetensors`, `state.json`).
pub const TRAINING_STATE_DIR: &str = "training_state";

/// The files at the top of a checkpoint: the engines' files, and the training state's in the older layout.
const TOP_FILES: [&str; 4] = [MODEL_FILE, CONFIG_FILE, OPTIMIZER_FILE, STATE_FILE];

/// The files inside [`TRAINING_STATE_DIR`].
const STATE_FILES: [&str; 2] = [OPTIMIZER_FILE, STATE_FILE];

/// The training-state directory of the checkpoint `dir` as this build writes it.
pub fn training_state_dir(dir: &Path) -> PathBuf {
    dir.join(TRAINING_STATE_DIR)
}

/// The directory holding `dir`'s `state.json`: [`TRAINING_STATE_DIR`], or `dir` itself for the older layout;
/// `None` when neither has one.
pub(super) fn state_dir_of(dir: &Path) -> Option<PathBuf> {
    let current = training_state_dir(dir);
    if current.join(STATE_FILE).is_file() {
        return Some(current);
    }
    dir.join(STATE_FILE).is_file().then(|| dir.to_path_buf())
}

/// True when `dir` is a directory holding only `names` (possibly none of them) and, when `state_dir` allows it,
/// a [`TRAINING_STATE_DIR`] that itself holds only training-state files.
fn holds_only(dir: &Path, names: &[&str], state_dir: bool) -> Result<bool, CheckpointError> {
    for entry in fs::read_dir(dir).map_err(io_error(dir))? {
        let entry = entry.map_err(io_error(dir))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else {
            return Ok(false);
        };
        let path = entry.path();
        let allowed = if state_dir && name == TRAINING_STATE_DIR && path.is_dir() {
            holds_only(&path, &STATE_FILES, false)?
        } else {
            names.contains(&name) && path.is_file()
        };
        if !allowed {
            return Ok(false);
        }
    }
    Ok(true)
}

/// True when `dir` is a directory holding only checkpoint files, in either layout (possibly none): the test
/// before a save replaces or removes it.
pub(super) fn holds_only_checkpoint_files(dir: &Path) -> Result<bool, CheckpointError> {
    if !dir.is_dir() {
        return Ok(false);
    }
    holds_only(dir, &TOP_FILES, true)
}
