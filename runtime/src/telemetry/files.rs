//! The telemetry's files, written beside the training and never in its way: `status.jsonl` at every status
//! line, the trace and `summary.json` at the end.
//!
//! ```text
//!  Reporter (status line, finish) ──┐
//!  pipeline ending (summary again) ─┴──▶ TelemetryFiles::write(path, …) ──▶ ok │ warning once, file given up
//! ```
//!
//! Every one of them is written through [`TelemetryFiles::write`], the one rule: a write that fails (a full
//! disk, `ulimit -f`, a directory removed under the run) is one warning naming the file and the cause, after
//! which that file is given up; the training, the checkpoints, the status lines on the output and the other
//! files go on. A file that cannot be created at the start is still an error then, before any training.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

use super::TelemetryError;

/// The files the telemetry has given up on after a failed write; shared by everything that writes one.
#[derive(Debug, Default)]
pub struct TelemetryFiles {
    given_up: Mutex<Vec<PathBuf>>,
}

impl TelemetryFiles {
    /// Runs `write` for the file at `path` unless that file was given up; a failure is warned about once (on
    /// standard error) and gives the file up. True when the file was written.
    pub fn write(&self, path: &Path, write: impl FnOnce() -> Result<(), TelemetryError>) -> bool {
        if self.given_up(path) {
            return false;
        }
        match write() {
            Ok(()) => true,
            Err(error) => {
                crate::log_line!(
                    "warning: {error}{}; {} is no longer written, the training, its checkpoints and the other \
                     telemetry go on",
                    room_hint(&error),
                    path.display()
                );
                self.given_up
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(path.to_path_buf());
                false
            }
        }
    }

    /// Whether a write of `path` failed earlier in this run.
    pub fn given_up(&self, path: &Path) -> bool {
        self.given_up
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .any(|file| file == path)
    }
}

/// What an operator can do about a write that failed for want of room (as the checkpoint's errors say it).
fn room_hint(error: &TelemetryError) -> &'static str {
    let TelemetryError::Io { source, .. } = error else {
        return "";
    };
    match source.kind() {
        std::io::ErrorKind::StorageFull => " (the disk is full)",
        std::io::ErrorKind::FileTooLarge => {
            " (the file would exceed this process's file-size limit: `ulimit -f`)"
        }
        _ => "",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failure(path: &Path) -> TelemetryError {
        TelemetryError::Io {
            action: "write",
            path: path.to_path_buf(),
            source: std::io::Error::from_raw_os_error(27), // EFBIG
        }
    }

    #[test]
    fn a_failed_file_is_given_up_and_the_others_are_still_written() {
        let files = TelemetryFiles::default();
        let (status, summary) = (Path::new("run/status.jsonl"), Path::new("run/summary.json"));
        assert!(!files.write(status, || Err(failure(status))));
        let mut tried_again = false;
        assert!(!files.write(status, || {
            tried_again = true;
            Ok(())
        }));
        assert!(!tried_again, "a file given up is not written again");
        assert!(files.write(summary, || Ok(())));
        assert!(files.given_up(status) && !files.given_up(summary));
    }
}
