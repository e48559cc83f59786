//! Everything a run will write, checked and locked before it trains: a `--save` path that cannot hold a
//! checkpoint, an unwritable trace path, or a directory another run is using is an error at the start, not after
//! hours of training.

use std::fs::OpenOptions;
use std::path::Path;

use crate::checkpoint::check_save_target;
use crate::lock::{DirLock, LockPlace};

use super::{RunError, RunOptions};

/// The locks a run holds on its checkpoint and run directories until it ends.
#[derive(Debug)]
pub(super) struct OutputLocks {
    _save: Option<DirLock>,
    _run_dir: Option<DirLock>,
}

/// Checks the checkpoint directory, the run directory and the trace path of `options`, and locks both
/// directories for this process.
pub(super) fn prepare(options: &RunOptions) -> Result<OutputLocks, RunError> {
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
        check_writable(trace)?;
    }
    Ok(OutputLocks {
        _save: save,
        _run_dir: run_dir,
    })
}

/// Fails unless `file` can be created or written; a file this check creates is removed again.
fn check_writable(file: &Path) -> Result<(), RunError> {
    let error = |source| RunError::Output {
        what: "the trace file",
        path: file.to_path_buf(),
        source,
    };
    if let Some(parent) = file.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(error)?;
    }
    let existed = file.exists();
    OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(file)
        .map_err(error)?;
    if !existed {
        std::fs::remove_file(file).map_err(error)?;
    }
    Ok(())
}
