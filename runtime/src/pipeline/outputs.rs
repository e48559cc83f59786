//! Everything a run will write, checked and locked before it trains: a `--save` path that cannot hold a
//! checkpoint, an unwritable trace path, or a directory another run is using is an error at the start, not after
//! hours of training. A run refused at its start removes the directories it made for its outputs
//! ([`NewDirectories`]), so a failed start leaves no empty run directory behind.

use std::path::{Component, Path, PathBuf};

use draftpipe_compiler::plan::Plan;

use crate::checkpoint::check_save_target;
use crate::lock::{DirLock, LockPlace};
use crate::output_file::{OutputKind, check_output, plan_inputs};

use super::error::RunError;
use super::options::RunOptions;

/// The locks a run holds on its checkpoint and run directories until it ends.
#[derive(Debug)]
pub(super) struct OutputLocks {
    _save: Option<DirLock>,
    _run_dir: Option<DirLock>,
}

/// Checks the checkpoint directory, the run directory and the trace path of `options` (the output rule of
/// `output_file`: never one of the run's inputs, a regular file or a new path, a trace unless forced), and locks
/// both directories for this process.
pub(super) fn prepare(plan: &Plan, options: &RunOptions) -> Result<OutputLocks, RunError> {
    if let (Some(save), Some(run_dir)) = (&options.save_dir, &options.run_dir) {
        check_apart(save, run_dir)?;
    }
    let save = match &options.save_dir {
        Some(dir) => {
            check_save_target(dir)?;
            // Creating the lock beside the directory proves its parent writable as well.
            Some(DirLock::acquire(
                dir,
                "the checkpoint directory",
                LockPlace::Beside,
            )?)
        }
        None => None,
    };
    let run_dir = match &options.run_dir {
        Some(dir) => Some(DirLock::acquire(
            dir,
            "the run directory",
            LockPlace::Inside,
        )?),
        None => None,
    };
    if let Some(trace) = &options.trace {
        let mut inputs = plan_inputs(plan);
        inputs.extend(options.inputs.iter().cloned());
        inputs.extend(options.resume.iter().cloned());
        inputs.extend(options.init.iter().cloned());
        check_output(trace, OutputKind::Trace, &inputs, options.force_outputs)?;
    }
    Ok(OutputLocks {
        _save: save,
        _run_dir: run_dir,
    })
}

/// The directories a run's outputs need that do not exist before it starts (the run directory and its missing
/// parents, the missing parents of the checkpoint's lock and of the trace), noted before anything is created so
/// that a run refused at its start can remove exactly what it made.
#[derive(Debug, Default)]
pub(super) struct NewDirectories {
    /// The run directory, when this run creates it: everything in it is this run's.
    run_dir: Option<PathBuf>,
    /// Missing parents, deepest first: removed only when empty, since another process may have written there.
    parents: Vec<PathBuf>,
}

impl NewDirectories {
    /// Notes which of `options`' output directories are missing now.
    pub(super) fn of(options: &RunOptions) -> Self {
        let mut noted = Self::default();
        if let Some(dir) = &options.run_dir
            && !dir.exists()
        {
            noted.run_dir = Some(dir.clone());
            noted.note_missing_parents(dir);
        }
        // The checkpoint's lock goes beside it, and the trace check creates the trace's parent.
        for file in [&options.save_dir, &options.trace].into_iter().flatten() {
            noted.note_missing_parents(file);
        }
        noted
    }

    fn note_missing_parents(&mut self, path: &Path) {
        for parent in path.ancestors().skip(1) {
            if parent.as_os_str().is_empty() || parent.exists() {
                break;
            }
            if !self.parents.iter().any(|noted| noted == parent) {
                self.parents.push(parent.to_path_buf());
            }
        }
    }

    /// Removes what was noted, after a refused start (its locks already released). Failures are ignored: this
    /// only tidies up after the error the user is shown.
    pub(super) fn remove(self) {
        if let Some(dir) = &self.run_dir {
            let _ = std::fs::remove_dir_all(dir);
        }
        let mut parents = self.parents;
        // Deepest first, so a parent is empty by the time its turn comes.
        parents.sort_by_key(|dir| std::cmp::Reverse(dir.components().count()));
        for dir in parents {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// Fails when saving to `save` would move or remove `run_dir`: a checkpoint is written into `SAVE.tmp`, and the
/// one in place is renamed to `SAVE.prev` then removed, so `run_dir` may be neither `SAVE` nor inside it, nor
/// one of those two siblings.
fn check_apart(save: &Path, run_dir: &Path) -> Result<(), RunError> {
    let (save_at, run_at) = (resolved(save), resolved(run_dir));
    let conflict = |reason| RunError::OutputConflict {
        save: save.to_path_buf(),
        run_dir: run_dir.to_path_buf(),
        reason,
    };
    if run_at.starts_with(&save_at) {
        return Err(conflict(
            "the run directory is the checkpoint directory or inside it, and each save replaces that directory",
        ));
    }
    let sibling = |suffix: &str| {
        save_at.file_name().map(|name| {
            let mut name = name.to_os_string();
            name.push(suffix);
            save_at.with_file_name(name)
        })
    };
    if [sibling(".tmp"), sibling(".prev")].contains(&Some(run_at)) {
        return Err(conflict(
            "the run directory is named like the checkpoint's SAVE.tmp or SAVE.prev, which each save removes",
        ));
    }
    Ok(())
}

/// `path` made absolute, with `.` and `..` resolved and symbolic links followed as far as the path exists, so two
/// spellings of one directory compare equal.
fn resolved(path: &Path) -> PathBuf {
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let mut lexical = PathBuf::new();
    for component in absolute.components() {
        match component {
            Component::ParentDir => {
                lexical.pop();
            }
            Component::CurDir => {}
            other => lexical.push(other),
        }
    }
    let existing = lexical
        .ancestors()
        .find_map(|ancestor| Some((ancestor, ancestor.canonicalize().ok()?)));
    match existing {
        Some((ancestor, real)) => match lexical.strip_prefix(ancestor) {
            Ok(rest) if !rest.as_os_str().is_empty() => real.join(rest),
            _ => real,
        },
        None => lexical,
    }
}
