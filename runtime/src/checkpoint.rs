//! Checkpoints: the flat parameter and AdamW buffers as named safetensors tensors, plus the training state.
//!
//! ```text
//!  flat buffers + TrainingState ──save_checkpoint──▶ DIR/{config.json, model.safetensors}            (engines)
//!                                                      DIR/training_state/{optimizer.safetensors, state.json} (--resume)
//!  DIR ──load_checkpoint──▶ flat buffers + TrainingState (--resume)     FILE ──load_weights──▶ params (--init)
//! ```
//!
//! **Layout.** The top of `DIR` holds only what serving engines read ([`layout`]): vLLM loads every
//! `*.safetensors` file at the top of a draft model's directory and stops on the optimizer's names, and SGLang would
//! read the optimizer state (gigabytes) only to skip it. The training state lives in [`TRAINING_STATE_DIR`], which
//! `--resume` reads; a checkpoint of the older layout (all four files at the top) still loads.
//!
//! `model.safetensors` holds one tensor per entry of the plan's layout, under its PyTorch name and shape, so
//! `safetensors.torch.load_file` gives a `state_dict` for the PyTorch version of the model: F32 by default, BF16
//! with [`WeightsDtype::Bf16`] (`--save-dtype bf16`). A `dflash` drafter's checkpoint also holds `config.json`
//! ([`hf`]), which with `model.safetensors` is what z-lab's `DFlashDraftModel` and SGLang's and vLLM's DFlash
//! loaders read. `optimizer.safetensors` holds `exp_avg.NAME` and `exp_avg_sq.NAME` for each tensor, and, when
//! the weights file is not F32, the exact weights as `master.NAME`, so a resume never starts from rounded
//! weights. `state.json` holds the step, RNG state, data positions, and the plan name and parameter count that
//! loading checks.
//!
//! **Atomicity.** A checkpoint is written into the sibling directory `DIR.tmp`, every file and the directory are
//! fsynced, then `DIR` is renamed to `DIR.prev`, `DIR.tmp` to `DIR`, and `DIR.prev` removed (the parent
//! directory fsynced after each rename). A process killed at any moment leaves a complete checkpoint: `DIR`, or
//! `DIR.prev` when it died between the two renames, which loading falls back to. Directories that hold anything
//! but checkpoint files are never replaced or removed.
//!
//! **Validity.** A checkpoint whose weights or moments hold a NaN or an infinity is never written (the one in
//! place is kept, and the error says so), and loading checks every field: each tensor's values (finite, second
//! moments not negative, weights small enough that their square is finite: a larger one cannot take a step),
//! and the counters of `state.json` (`optimizer_step ≤ step ≤` [`MAX_STEP`]), so a
//! corrupt or hand-edited file is an error naming what is wrong instead of a run of NaN weights.

use std::collections::{HashMap, HashSet};
use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use draftpipe_compiler::plan::ModelPlan;
use serde::{Deserialize, Serialize};

use crate::model::registry;
use crate::tensor_file::{
    F32Tensor, TensorFile, TensorFileError, TensorProblem, TensorRead, decode_floats,
    is_float_dtype, write_f32_tensors, write_tensors_as,
};

pub mod hf;
mod layout;

pub use hf::{CONFIG_FILE, ExportOptions, WeightsDtype};
pub use layout::{TRAINING_STATE_DIR, training_state_dir};
use layout::{holds_only_checkpoint_files, state_dir_of};

/// The weights file inside a checkpoint directory.
pub const MODEL_FILE: &str = "model.safetensors";
/// The AdamW moments file.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// The training-state file.
pub const STATE_FILE: &str = "state.json";
/// Prefix of first-moment tensor names in the optimizer file.
pub const EXP_AVG_PREFIX: &str = "exp_avg.";
/// Prefix of second-moment tensor names.
pub const EXP_AVG_SQ_PREFIX: &str = "exp_avg_sq.";
/// Prefix, in the optimizer file, of the exact f32 weights when `model.safetensors` holds rounded ones.
pub const MASTER_PREFIX: &str = "master.";
/// Version of the `state.json` layout.
pub const FORMAT_VERSION: u32 = 1;
/// The largest step count a checkpoint may hold (2^48: ten million years at one step a second). Larger counts
/// can only come from corruption, and near 2^64 they would wrap to 0 in the optimizer's bias correction.
pub const MAX_STEP: u64 = 1 << 48;

/// Why saving or loading a checkpoint failed.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A tensor file is unreadable, or a tensor is missing, unexpected or mis-shaped for the plan.
    #[error(transparent)]
    Tensor(#[from] TensorFileError),
    /// The family's own export (`eagle3`'s weights, vocabulary tensors and config) could not be written.
    #[error("{}: the {family} export could not be written: {source}", dir.display())]
    Export {
        /// The directory being written.
        dir: PathBuf,
        /// The family.
        family: &'static str,
        /// The cause.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A filesystem operation failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The path concerned.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// `state.json` is unreadable or of another format version.
    #[error("{}: {message}", path.display())]
    State {
        /// The state file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The checkpoint or the buffers do not fit the plan's model.
    #[error("checkpoint does not match the plan: {0}")]
    Mismatch(String),
    /// Neither the directory nor its fallback holds a checkpoint.
    #[error("no checkpoint in {}", path.display())]
    NotFound {
        /// The directory given.
        path: PathBuf,
    },
    /// A buffer about to be saved holds a NaN or an infinity (or a negative second moment): the checkpoint is
    /// not written and the one in place is kept.
    #[error(
        "refusing to write a checkpoint to {}: {buffer} tensor `{tensor}` holds {value} at element {at}; \
         the checkpoint already there (if any) is kept",
        dir.display()
    )]
    NonFinite {
        /// The checkpoint directory.
        dir: PathBuf,
        /// `params`, `exp_avg` or `exp_avg_sq`.
        buffer: &'static str,
        /// The layout tensor holding the value.
        tensor: String,
        /// The value.
        value: f32,
        /// Its element within the tensor.
        at: usize,
    },
    /// A `config.json` is unreadable or not a JSON object (`path` may end in `:line:col`).
    #[error("{}: {message}", path.display())]
    Config {
        /// The config file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A `config.json` describes another model than the plan's.
    #[error("{}: `{key}` {message}", path.display())]
    ConfigKey {
        /// The config file.
        path: PathBuf,
        /// The key, dotted for nested ones (`dflash_config.mask_token_id`).
        key: String,
        /// What it holds and what the plan expects.
        message: String,
    },
    /// Writing the checkpoint's files failed (a full disk, a file-size limit, an I/O error); the checkpoint
    /// in place, if any, is untouched.
    #[error(
        "cannot write the checkpoint for {}: {source}{hint}; {}",
        dir.display(),
        match kept {
            Some(kept) => format!("the previous checkpoint is kept in {}", kept.display()),
            None => "there is no earlier checkpoint".to_string(),
        }
    )]
    NotWritten {
        /// The checkpoint directory.
        dir: PathBuf,
        /// Where the checkpoint saved before is, if there is one.
        kept: Option<PathBuf>,
        /// Why the write failed, in words an operator can act on (or empty).
        hint: &'static str,
        /// The failed operation.
        source: Box<CheckpointError>,
    },
    /// The target path exists and holds something other than a checkpoint, so it is left alone.
    #[error("{} exists and is not a checkpoint directory; refusing to replace it", path.display())]
    NotACheckpoint {
        /// The path.
        path: PathBuf,
    },
}

fn io_error(path: &Path) -> impl FnOnce(io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Creates (or truncates) `path`, writes `bytes` and fsyncs it.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let mut out = File::create(path).map_err(io_error(path))?;
    out.write_all(bytes)
        .and_then(|()| out.sync_all())
        .map_err(io_error(path))
}

/// Everything besides the tensors that a resumed run needs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrainingState {
    /// Optimizer steps taken.
    pub step: u64,
    /// AdamW's own step count (bias correction); lower than `step` by the steps skipped for non-finite values.
    #[serde(default)]
    pub optimizer_step: u64,
    /// Name of the pipeline that wrote the checkpoint.
    pub plan_name: String,
    /// Seeds the run was started with (`draftpipe run` records the drafter's initial-weight seed), for the record:
    /// every other random choice derives from the plan's seed, the step and the data positions.
    pub rng_state: Vec<u64>,
    /// Per producer worker, the global position of the next batch it must produce.
    pub data_positions: Vec<u64>,
    /// A stream source's producers by name: the slot each held and how many of its messages were
    /// acknowledged, so a producer of a resumed run goes on where its acknowledged messages end (empty for
    /// other sources and for checkpoints written before it was kept).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stream_producers: Vec<ProducerRecord>,
}

/// One stream producer's name, its slot (`None`: it had given its slot to another name) and the messages of it
/// acknowledged.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProducerRecord {
    /// The name its hello gave.
    pub name: String,
    /// The producer slot it held last, if it still held one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slot: Option<usize>,
    /// Its messages acknowledged, over reconnects.
    pub delivered: u64,
}

impl TrainingState {
    /// What is wrong with the counters, if anything (see the module's **Validity**).
    fn problem(&self) -> Option<String> {
        if self.step > MAX_STEP {
            return Some(format!("step {} exceeds {MAX_STEP}", self.step));
        }
        if self.optimizer_step > self.step {
            return Some(format!(
                "optimizer_step {} exceeds step {} (it counts the steps applied, which cannot be more than \
                 the steps taken)",
                self.optimizer_step, self.step
            ));
        }
        if self.data_positions.iter().any(|&p| p > MAX_DATA_POSITION) {
            return Some(format!(
                "a data position exceeds {MAX_DATA_POSITION}: {:?}",
                self.data_positions
            ));
        }
        None
    }
}

/// The largest `state.json` read (1 MiB; a real one is a few hundred bytes plus 20 per producer).
const MAX_STATE_BYTES: u64 = 1 << 20;

/// The largest data position a checkpoint may hold: a position counts batches, and 2^52 of them is far beyond any
/// dataset; a larger one can only come from corruption.
const MAX_DATA_POSITION: u64 = 1 << 52;

/// The on-disk `state.json`.
#[derive(Debug, Serialize, Deserialize)]
struct StateFile {
    format_version: u32,
    parameters: usize,
    #[serde(flatten)]
    training: TrainingState,
    /// Set on a checkpoint saved after an error stopped the run: the last good state, and why the run stopped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    stopped_by: Option<String>,
}

/// A loaded checkpoint: the three flat buffers (in the plan's layout order) and the training state.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    /// Parameters.
    pub params: Vec<f32>,
    /// AdamW first moments.
    pub exp_avg: Vec<f32>,
    /// AdamW second moments.
    pub exp_avg_sq: Vec<f32>,
    /// Step, RNG and data positions.
    pub state: TrainingState,
    /// For the last good state saved after an error: the error that stopped the run.
    pub stopped_by: Option<String>,
}

/// The sibling paths used while writing `dir`: `(DIR.tmp, DIR.prev)`.
fn sibling_paths(dir: &Path) -> Result<(PathBuf, PathBuf), CheckpointError> {
    let name = dir
        .file_name()
        .ok_or_else(|| CheckpointError::NotACheckpoint {
            path: dir.to_path_buf(),
        })?;
    let with_suffix = |suffix: &str| {
        let mut sibling = name.to_os_string();
        sibling.push(suffix);
        dir.with_file_name(sibling)
    };
    Ok((with_suffix(".tmp"), with_suffix(".prev")))
}

/// Removes `dir` if it exists, refusing when it holds anything but checkpoint files.
fn remove_checkpoint_dir(dir: &Path) -> Result<(), CheckpointError> {
    if !dir.exists() {
        return Ok(());
    }
    if !holds_only_checkpoint_files(dir)? {
        return Err(CheckpointError::NotACheckpoint {
            path: dir.to_path_buf(),
        });
    }
    fs::remove_dir_all(dir).map_err(io_error(dir))
}

/// Fsyncs a directory so the renames and creations inside it are durable.
fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_error(dir))
}

fn parent_of(dir: &Path) -> &Path {
    dir.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

/// Checks that a flat buffer has the plan's parameter count and that the layout tiles it.
fn check_buffer(model: &ModelPlan, what: &str, len: usize) -> Result<(), CheckpointError> {
    if len != model.parameters {
        return Err(CheckpointError::Mismatch(format!(
            "{what} has {len} values, the plan {}",
            model.parameters
        )));
    }
    if let Some(view) = model.layout.iter().find(|v| v.range().end > len) {
        return Err(CheckpointError::Mismatch(format!(
            "layout tensor `{}` ends past the buffer",
            view.name
        )));
    }
    Ok(())
}

/// A checkpoint whose files are written and fsynced in `DIR.tmp` but not yet in place.
#[derive(Debug)]
#[must_use = "a staged checkpoint is not saved until `commit` is called"]
pub struct StagedCheckpoint {
    dir: PathBuf,
    staging: PathBuf,
    previous: PathBuf,
}

/// Fails on the first value that must not be saved: a NaN or an infinity, a negative second moment, or a
/// weight too large to train.
fn check_values(
    dir: &Path,
    model: &ModelPlan,
    buffer: &'static str,
    values: &[f32],
) -> Result<(), CheckpointError> {
    // The rules loading applies, so every checkpoint written can be resumed.
    let bad = |v: f32| {
        !v.is_finite()
            || (buffer == "exp_avg_sq" && v < 0.0)
            || (buffer == "params" && !is_trainable(v))
    };
    if !values.iter().copied().any(bad) {
        return Ok(());
    }
    for view in &model.layout {
        if let Some((at, &value)) = values[view.range()]
            .iter()
            .enumerate()
            .find(|(_, v)| bad(**v))
        {
            return Err(CheckpointError::NonFinite {
                dir: dir.to_path_buf(),
                buffer,
                tensor: view.name.clone(),
                value,
                at,
            });
        }
    }
    Ok(())
}

/// Fails unless `dir` can receive a checkpoint: absent, or a directory holding only checkpoint files. Checked by
/// `draftpipe run` before it trains, so a `--save` path that cannot work is found at once, not after hours.
/// The siblings `DIR.tmp` and `DIR.prev` are checked the same way: every save removes them, so one that holds
/// something else would fail the first save after training, not the start.
pub fn check_save_target(dir: &Path) -> Result<(), CheckpointError> {
    let (staging, previous) = sibling_paths(dir)?;
    for path in [dir, &staging, &previous] {
        if path.exists() && !holds_only_checkpoint_files(path)? {
            return Err(CheckpointError::NotACheckpoint {
                path: path.to_path_buf(),
            });
        }
    }
    Ok(())
}

/// Writes the checkpoint files into `DIR.tmp` (replacing a stale one) and fsyncs them, without touching `dir`.
/// [`StagedCheckpoint::commit`] puts it in place; [`save_checkpoint`] does both. Buffers holding a non-finite
/// value are refused before anything is written.
pub fn stage_checkpoint(
    dir: &Path,
    model: &ModelPlan,
    params: &[f32],
    exp_avg: &[f32],
    exp_avg_sq: &[f32],
    state: &TrainingState,
) -> Result<StagedCheckpoint, CheckpointError> {
    stage_marked(
        dir,
        model,
        [params, exp_avg, exp_avg_sq],
        state,
        None,
        ExportOptions::default(),
    )
}

fn stage_marked(
    dir: &Path,
    model: &ModelPlan,
    [params, exp_avg, exp_avg_sq]: [&[f32]; 3],
    state: &TrainingState,
    stopped_by: Option<&str>,
    export: ExportOptions,
) -> Result<StagedCheckpoint, CheckpointError> {
    for (what, buffer) in [
        ("params", params),
        ("exp_avg", exp_avg),
        ("exp_avg_sq", exp_avg_sq),
    ] {
        check_buffer(model, what, buffer.len())?;
        check_values(dir, model, what, buffer)?;
    }
    if let Some(problem) = state.problem() {
        return Err(CheckpointError::Mismatch(format!(
            "refusing to save the training state: {problem}"
        )));
    }
    let (staging, previous) = sibling_paths(dir)?;
    check_save_target(dir)?;
    remove_checkpoint_dir(&staging)?;
    let written = write_staged(
        &staging,
        model,
        [params, exp_avg, exp_avg_sq],
        (state, stopped_by),
        export,
    );
    if let Err(source) = written {
        // A full disk or a file-size limit (`ulimit -f`) leaves a partial `DIR.tmp`: removed to give the space
        // back; `dir` was not touched.
        let _ = remove_checkpoint_dir(&staging);
        return Err(CheckpointError::NotWritten {
            dir: dir.to_path_buf(),
            kept: resolve_checkpoint_dir(dir).ok(),
            hint: io_hint(&source),
            source: Box::new(source),
        });
    }
    Ok(StagedCheckpoint {
        dir: dir.to_path_buf(),
        staging,
        previous,
    })
}

/// Writes and fsyncs every file of a checkpoint into `staging`: the engines' files at its top, the training
/// state in its training-state directory.
fn write_staged(
    staging: &Path,
    model: &ModelPlan,
    [params, exp_avg, exp_avg_sq]: [&[f32]; 3],
    (state, stopped_by): (&TrainingState, Option<&str>),
    export: ExportOptions,
) -> Result<(), CheckpointError> {
    let weights = export.dtype;
    let staged_state = training_state_dir(staging);
    fs::create_dir_all(&staged_state).map_err(io_error(&staged_state))?;

    let metadata = export_metadata(state.step, &state.plan_name);
    write_engine_files(staging, model, params, export, metadata.clone())?;

    let names: Vec<(String, String, String)> = model
        .layout
        .iter()
        .map(|v| {
            (
                format!("{EXP_AVG_PREFIX}{}", v.name),
                format!("{EXP_AVG_SQ_PREFIX}{}", v.name),
                format!("{MASTER_PREFIX}{}", v.name),
            )
        })
        .collect();
    // All first moments, then all second moments (then the master weights, if any): each part of the file
    // mirrors the flat buffer it came from.
    let mut optimizer_tensors = Vec::with_capacity(3 * model.layout.len());
    for (view, (avg_name, _, _)) in model.layout.iter().zip(&names) {
        optimizer_tensors.push(F32Tensor {
            name: avg_name,
            shape: &view.shape,
            data: &exp_avg[view.range()],
        });
    }
    for (view, (_, sq_name, _)) in model.layout.iter().zip(&names) {
        optimizer_tensors.push(F32Tensor {
            name: sq_name,
            shape: &view.shape,
            data: &exp_avg_sq[view.range()],
        });
    }
    if weights != WeightsDtype::F32 {
        for (view, (_, _, master_name)) in model.layout.iter().zip(&names) {
            optimizer_tensors.push(F32Tensor {
                name: master_name,
                shape: &view.shape,
                data: &params[view.range()],
            });
        }
    }
    write_f32_tensors(
        &staged_state.join(OPTIMIZER_FILE),
        &optimizer_tensors,
        metadata,
    )?;

    let state_path = staged_state.join(STATE_FILE);
    let file = StateFile {
        format_version: FORMAT_VERSION,
        parameters: model.parameters,
        training: state.clone(),
        stopped_by: stopped_by.map(str::to_owned),
    };
    let json = serde_json::to_vec_pretty(&file).map_err(|e| CheckpointError::State {
        path: state_path.clone(),
        message: e.to_string(),
    })?;
    write_synced(&state_path, &json)?;
    sync_dir(&staged_state)?;
    sync_dir(staging)
}

/// The safetensors metadata of a save's files: the step and the plan that wrote them.
fn export_metadata(step: u64, plan_name: &str) -> HashMap<String, String> {
    HashMap::from([
        ("format".to_string(), "pt".to_string()),
        ("step".to_string(), step.to_string()),
        ("plan".to_string(), plan_name.to_string()),
    ])
}

/// Writes what engines read of a save into `dir`: the family's own export (`write_export`) or the weights file
/// and `config.json`.
fn write_engine_files(
    dir: &Path,
    model: &ModelPlan,
    params: &[f32],
    export: ExportOptions,
    metadata: HashMap<String, String>,
) -> Result<(), CheckpointError> {
    let model_tensors: Vec<F32Tensor<'_>> = model
        .layout
        .iter()
        .map(|v| F32Tensor {
            name: &v.name,
            shape: &v.shape,
            data: &params[v.range()],
        })
        .collect();
    let family = registry::spec(&model.spec);
    match family.write_export(dir, &model_tensors, export) {
        Some(written) => written.map_err(|source| CheckpointError::Export {
            dir: dir.to_path_buf(),
            family: family.name(),
            source,
        }),
        None => {
            write_tensors_as(
                &dir.join(MODEL_FILE),
                &model_tensors,
                export.dtype.dtype(),
                metadata,
            )?;
            hf::write_config(&dir.join(CONFIG_FILE), family, export).map(|_| ())
        }
    }
}

/// Writes only the engines' files of `params` (what `--save` puts at the top of its directory: `config.json`
/// and the weights, no optimizer state) into `dir`, created when absent: the export the acceptance check
/// loads. Non-finite weights are refused before anything is written.
pub fn write_export(
    dir: &Path,
    model: &ModelPlan,
    params: &[f32],
    (step, plan_name): (u64, &str),
    export: ExportOptions,
) -> Result<(), CheckpointError> {
    check_buffer(model, "params", params.len())?;
    check_values(dir, model, "params", params)?;
    fs::create_dir_all(dir).map_err(io_error(dir))?;
    write_engine_files(dir, model, params, export, export_metadata(step, plan_name))
}

/// What an operator can do about a write that failed for want of room: the disk is full, or the process's
/// file-size limit (`ulimit -f`, which batch systems set) is below a checkpoint file.
fn io_hint(error: &CheckpointError) -> &'static str {
    let kind = match error {
        CheckpointError::Io { source, .. } => Some(source.kind()),
        CheckpointError::Tensor(TensorFileError {
            problem: TensorProblem::Io(source),
            ..
        }) => Some(source.kind()),
        _ => None,
    };
    match kind {
        Some(io::ErrorKind::StorageFull) => " (the disk is full)",
        Some(io::ErrorKind::FileTooLarge) => {
            " (a file would exceed this process's file-size limit: `ulimit -f`)"
        }
        _ => "",
    }
}

impl StagedCheckpoint {
    /// Moves the staged checkpoint into place (see the module docs for the rename order) and removes the one
    /// it replaces.
    pub fn commit(self) -> Result<(), CheckpointError> {
        let parent = parent_of(&self.dir);
        if self.dir.exists() {
            // `dir` exists, so a leftover `DIR.prev` is older than it and no longer needed as a fallback.
            remove_checkpoint_dir(&self.previous)?;
            fs::rename(&self.dir, &self.previous).map_err(io_error(&self.dir))?;
            sync_dir(parent)?;
        }
        fs::rename(&self.staging, &self.dir).map_err(io_error(&self.staging))?;
        sync_dir(parent)?;
        remove_checkpoint_dir(&self.previous)?;
        sync_dir(parent)
    }

    /// Where the checkpoint will be.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// Saves a checkpoint of `model` to `dir` atomically (see the module docs).
///
/// # Examples
///
/// ```no_run
/// # use draftpipe_runtime::checkpoint::{save_checkpoint, load_checkpoint, TrainingState};
/// # fn demo(model: &draftpipe_compiler::plan::ModelPlan, p: &[f32], m: &[f32], v: &[f32]) -> Result<(), Box<dyn std::error::Error>> {
/// let state = TrainingState { step: 100, optimizer_step: 98, plan_name: "quickstart".into(), rng_state: vec![7], data_positions: vec![200, 201], stream_producers: Vec::new() };
/// save_checkpoint("runs/ckpt".as_ref(), model, p, m, v, &state)?;
/// let restored = load_checkpoint("runs/ckpt".as_ref(), model)?;
/// assert_eq!(restored.state, state);
/// # Ok(()) }
/// ```
pub fn save_checkpoint(
    dir: &Path,
    model: &ModelPlan,
    params: &[f32],
    exp_avg: &[f32],
    exp_avg_sq: &[f32],
    state: &TrainingState,
) -> Result<(), CheckpointError> {
    stage_checkpoint(dir, model, params, exp_avg, exp_avg_sq, state)?.commit()
}

/// [`save_checkpoint`] with the weights file stored as `export.dtype` (`--save-dtype`) and `config.json` naming
/// the target's depth.
pub fn save_checkpoint_as(
    dir: &Path,
    model: &ModelPlan,
    [params, exp_avg, exp_avg_sq]: [&[f32]; 3],
    state: &TrainingState,
    export: ExportOptions,
) -> Result<(), CheckpointError> {
    stage_marked(
        dir,
        model,
        [params, exp_avg, exp_avg_sq],
        state,
        None,
        export,
    )?
    .commit()
}

/// [`save_checkpoint`] for the last good state of a run that an error stopped: `state.json` records the error
/// (`stopped_by`), so whoever resumes from it knows why the run ended there.
pub fn save_last_good_checkpoint(
    dir: &Path,
    model: &ModelPlan,
    [params, exp_avg, exp_avg_sq]: [&[f32]; 3],
    state: &TrainingState,
    stopped_by: &str,
    export: ExportOptions,
) -> Result<(), CheckpointError> {
    stage_marked(
        dir,
        model,
        [params, exp_avg, exp_avg_sq],
        state,
        Some(stopped_by),
        export,
    )?
    .commit()
}

/// The directory that holds the complete checkpoint for `dir`: `dir` itself, or `DIR.prev` after a save that
/// died between its two renames (in either layout).
pub fn resolve_checkpoint_dir(dir: &Path) -> Result<PathBuf, CheckpointError> {
    if state_dir_of(dir).is_some() {
        return Ok(dir.to_path_buf());
    }
    let (_, previous) = sibling_paths(dir)?;
    if state_dir_of(&previous).is_some() {
        return Ok(previous);
    }
    Err(CheckpointError::NotFound {
        path: dir.to_path_buf(),
    })
}

/// Loads the checkpoint in `dir` (or its fallback), checking it against `model`: the weights from the top, the
/// training state from [`TRAINING_STATE_DIR`], or from the top in a checkpoint of the older layout.
pub fn load_checkpoint(dir: &Path, model: &ModelPlan) -> Result<Checkpoint, CheckpointError> {
    let given = dir;
    let dir = resolve_checkpoint_dir(given)?;
    let state_dir = state_dir_of(&dir).ok_or_else(|| CheckpointError::NotFound {
        path: given.to_path_buf(),
    })?;
    let state_path = state_dir.join(STATE_FILE);
    let size = fs::metadata(&state_path)
        .map_err(io_error(&state_path))?
        .len();
    if size > MAX_STATE_BYTES {
        return Err(CheckpointError::State {
            path: state_path,
            message: format!(
                "{size} bytes, over the limit of {MAX_STATE_BYTES} for a training state"
            ),
        });
    }
    let bytes = fs::read(&state_path).map_err(io_error(&state_path))?;
    let file: StateFile = serde_json::from_slice(&bytes).map_err(|e| CheckpointError::State {
        path: state_path.clone(),
        message: e.to_string(),
    })?;
    if file.format_version != FORMAT_VERSION {
        let message = format!(
            "format version {} (this build reads {FORMAT_VERSION})",
            file.format_version
        );
        return Err(CheckpointError::State {
            path: state_path,
            message,
        });
    }
    if file.parameters != model.parameters {
        return Err(CheckpointError::Mismatch(format!(
            "{} has {} parameters, the plan {}",
            state_path.display(),
            file.parameters,
            model.parameters
        )));
    }
    if let Some(message) = file.training.problem() {
        return Err(CheckpointError::State {
            path: state_path,
            message,
        });
    }
    check_config_beside(&dir, model)?;
    let mut params = load_weights(&dir.join(MODEL_FILE), model)?;
    let optimizer_path = state_dir.join(OPTIMIZER_FILE);
    let mut optimizer = TensorFile::open(&optimizer_path)?;
    let mut exp_avg = vec![0.0; model.parameters];
    let mut exp_avg_sq = vec![0.0; model.parameters];
    let mut expected = read_layout(&mut optimizer, model, EXP_AVG_PREFIX, &mut exp_avg)?;
    expected.extend(read_layout(
        &mut optimizer,
        model,
        EXP_AVG_SQ_PREFIX,
        &mut exp_avg_sq,
    )?);
    // A weights file in a reduced dtype comes with the exact weights, which are the ones to resume from.
    let has_master = model.layout.first().is_some_and(|v| {
        optimizer
            .info(&format!("{MASTER_PREFIX}{}", v.name))
            .is_some()
    });
    if has_master {
        expected.extend(read_layout(
            &mut optimizer,
            model,
            MASTER_PREFIX,
            &mut params,
        )?);
    }
    reject_unexpected(&optimizer, &expected)?;
    if let Some(view) = model
        .layout
        .iter()
        .find(|v| exp_avg_sq[v.range()].iter().any(|&x| x < 0.0))
    {
        let at = exp_avg_sq[view.range()]
            .iter()
            .position(|&x| x < 0.0)
            .unwrap_or(0);
        let problem = TensorProblem::OutOfRange {
            value: exp_avg_sq[view.range()][at] as i64,
            at: format!("element {at}"),
            allowed: "second moments are not negative".into(),
        };
        let name = format!("{EXP_AVG_SQ_PREFIX}{}", view.name);
        return Err(TensorFileError::tensor(&optimizer_path, &name, problem).into());
    }
    Ok(Checkpoint {
        params,
        exp_avg,
        exp_avg_sq,
        state: file.training,
        stopped_by: file.stopped_by,
    })
}

/// Checks `DIR/config.json` against the plan when the file is there and the plan's family exports one (an
/// `mlp` checkpoint has none).
fn check_config_beside(dir: &Path, model: &ModelPlan) -> Result<(), CheckpointError> {
    let config = dir.join(CONFIG_FILE);
    if config.is_file() {
        hf::check_config(&config, registry::spec(&model.spec))
    } else {
        Ok(())
    }
}

/// The weights `--init` starts from: `path` is a checkpoint or Hugging Face directory (its `model.safetensors`)
/// or a weights file. A `config.json` beside the weights is checked against the plan first, so a drafter of
/// other dimensions is named by the key that differs rather than by a tensor shape.
pub fn load_initial_weights(path: &Path, model: &ModelPlan) -> Result<Vec<f32>, CheckpointError> {
    let (file, dir) = if path.is_dir() {
        (path.join(MODEL_FILE), path)
    } else {
        (path.to_path_buf(), parent_of(path))
    };
    check_config_beside(dir, model)?;
    load_weights(&file, model)
}

/// Loads the parameters from a weights file (a checkpoint's `model.safetensors`, or one written from PyTorch
/// with the plan's names; F32, BF16 or F16), checking every name and shape against `model` and every value for
/// NaN and infinity (the error names the tensor and the element).
pub fn load_weights(file: &Path, model: &ModelPlan) -> Result<Vec<f32>, CheckpointError> {
    let mut weights = TensorFile::open(file)?;
    let mut params = vec![0.0; model.parameters];
    check_buffer(model, "the parameter buffer", params.len())?;
    let mut expected = read_layout(&mut weights, model, "", &mut params)?;
    // The family's frozen export tensors (`eagle3`'s `d2t`/`t2d`) are not part of the replica.
    expected.extend(
        registry::spec(&model.spec)
            .export_extra_tensors()
            .iter()
            .map(|name| name.to_string()),
    );
    reject_unexpected(&weights, &expected)?;
    Ok(params)
}

/// Whether a weight can take a step: finite, and its square too (|w| < 2^64), since the forward multiplies
/// weights with each other and with activations and AdamW squares their gradients. A larger weight can only
/// come from a corrupt or edited file; its first step would be blamed on the learning rate.
fn is_trainable(weight: f32) -> bool {
    (weight * weight).is_finite()
}

/// Reads every layout tensor, named `PREFIX + name`, into its range of `out` (each value finite, each weight
/// [trainable](is_trainable): the error names the tensor and the element); returns the names read.
fn read_layout(
    file: &mut TensorFile,
    model: &ModelPlan,
    prefix: &str,
    out: &mut [f32],
) -> Result<HashSet<String>, CheckpointError> {
    let mut bytes = Vec::new();
    let mut names = HashSet::with_capacity(model.layout.len());
    for view in &model.layout {
        let name = format!("{prefix}{}", view.name);
        let info = file.require(&name)?;
        let bad = |problem| TensorFileError::tensor(file.path(), &name, problem);
        if !is_float_dtype(info.dtype) {
            return Err(bad(TensorProblem::WrongDtype {
                found: info.dtype,
                expected: "F32, BF16 or F16",
            })
            .into());
        }
        if info.shape != view.shape {
            let expected = format!("{:?} (the plan's layout)", view.shape);
            return Err(bad(TensorProblem::WrongShape {
                found: info.shape.clone(),
                expected,
            })
            .into());
        }
        let dtype = file.read_tensor_elements(&name, 0..view.len(), &mut bytes)?;
        let values = &mut out[view.range()];
        decode_floats(dtype, &bytes, values);
        if let Some((at, &value)) = values.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            let problem = TensorProblem::NonFinite { value, at };
            return Err(TensorFileError::tensor(file.path(), &name, problem).into());
        }
        let holds_weights = prefix.is_empty() || prefix == MASTER_PREFIX;
        if holds_weights
            && let Some((at, &value)) = values.iter().enumerate().find(|(_, v)| !is_trainable(**v))
        {
            let problem = TensorProblem::Untrainable { value, at };
            return Err(TensorFileError::tensor(file.path(), &name, problem).into());
        }
        names.insert(name);
    }
    Ok(names)
}

/// Fails on the first tensor of `file` (in sorted order) that is not in `expected`.
fn reject_unexpected(file: &TensorFile, expected: &HashSet<String>) -> Result<(), CheckpointError> {
    match file.names().into_iter().find(|n| !expected.contains(n)) {
        Some(name) => {
            Err(TensorFileError::tensor(file.path(), &name, TensorProblem::Unexpected).into())
        }
        None => Ok(()),
    }
}
