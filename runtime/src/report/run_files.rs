//! The run directory as the report reads it: every status line of `status.jsonl` (a last line cut short by a
//! crash or read while being written is left out and said), `summary.json` when the run got that far, and
//! whether the run is still going (its `draftpipe.lock` held) or stopped without a summary.
//!
//! ```text
//!  RUN_DIR/status.jsonl ─┐
//!  RUN_DIR/summary.json ─┼─▶ RunRecord::load ─▶ charts (report::charts) and the words (report::page)
//!  RUN_DIR/draftpipe.lock┘
//! ```

use std::fs::{self, File, TryLockError};
use std::io;
use std::path::{Path, PathBuf};

use super::ReportError;
use crate::lock::INSIDE_LOCK_FILE;
use crate::telemetry::{RunSummary, STATUS_FILE, SUMMARY_FILE, StatusLine, load_summary};

/// Where the run stands, as its directory shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunState {
    /// `summary.json` is written: the run ended (its ending says how).
    Ended,
    /// No summary, and another process holds the run directory's lock: the run is still going.
    Running,
    /// No summary and no process holds the lock: the run stopped before writing one (a crash, a kill).
    StoppedWithoutSummary,
}

/// Everything the report draws from.
#[derive(Debug, Clone)]
pub struct RunRecord {
    /// The run directory.
    pub dir: PathBuf,
    /// Every complete status line, in file order.
    pub status: Vec<StatusLine>,
    /// The 1-based line number of a last line that was cut short (no newline and not valid JSON), if any.
    pub truncated_line: Option<usize>,
    /// The summary, once the run wrote it.
    pub summary: Option<RunSummary>,
    /// Where the run stands.
    pub state: RunState,
}

/// The exact teacher-forced τ a status line carries (each block's drafted prefix matching its labels, plus the
/// bonus token); lines of builds before it have none.
pub fn teacher_forced_tau(line: &StatusLine) -> Option<f64> {
    line.tau_exact
}

/// SpecForge's simulated τ over per-slot accuracies (`tau` in older status files), drawn beside the exact one.
pub fn simulated_tau(line: &StatusLine) -> Option<f64> {
    line.tau_simulated
}

impl RunRecord {
    /// Reads the run directory `dir`.
    ///
    /// # Errors
    /// [`ReportError::NotARunDirectory`] when `dir` holds neither file; [`ReportError::StatusLine`] naming the
    /// line and column of a status line that is not one (other than a last line cut short);
    /// [`ReportError::Read`] and [`ReportError::Summary`] for files that cannot be read.
    pub fn load(dir: &Path) -> Result<Self, ReportError> {
        let status_path = dir.join(STATUS_FILE);
        let summary_path = dir.join(SUMMARY_FILE);
        if !status_path.is_file() && !summary_path.is_file() {
            return Err(ReportError::NotARunDirectory {
                dir: dir.to_path_buf(),
            });
        }
        let (status, truncated_line) = if status_path.is_file() {
            let text = fs::read_to_string(&status_path).map_err(|source| ReportError::Read {
                path: status_path.clone(),
                source,
            })?;
            parse_status_lines(&status_path, &text)?
        } else {
            (Vec::new(), None)
        };
        let summary = if summary_path.is_file() {
            Some(load_summary(dir).map_err(|source| ReportError::Summary {
                source: Box::new(source),
            })?)
        } else {
            None
        };
        let state = if summary.is_some() {
            RunState::Ended
        } else if lock_is_held(&dir.join(INSIDE_LOCK_FILE)).map_err(|source| ReportError::Read {
            path: dir.join(INSIDE_LOCK_FILE),
            source,
        })? {
            RunState::Running
        } else {
            RunState::StoppedWithoutSummary
        };
        Ok(Self {
            dir: dir.to_path_buf(),
            status,
            truncated_line,
            summary,
            state,
        })
    }
}

/// Parses `status.jsonl`'s text. Only the last line may be cut short (a writer killed mid-line, or a line being
/// written while the report reads): one without its newline that does not parse is left out and numbered.
pub fn parse_status_lines(
    path: &Path,
    text: &str,
) -> Result<(Vec<StatusLine>, Option<usize>), ReportError> {
    let mut lines = Vec::new();
    let complete = text.ends_with('\n');
    let all: Vec<&str> = text.lines().collect();
    for (index, line) in all.iter().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<StatusLine>(line) {
            Ok(status) => lines.push(status),
            Err(_) if index + 1 == all.len() && !complete => return Ok((lines, Some(index + 1))),
            Err(source) => {
                return Err(ReportError::StatusLine {
                    path: path.to_path_buf(),
                    line: index + 1,
                    column: source.column(),
                    source,
                });
            }
        }
    }
    Ok((lines, None))
}

/// Whether another process holds the lock file at `path` (false when there is none). A shared lock taken and
/// dropped at once tells, without writing the file.
fn lock_is_held(path: &Path) -> io::Result<bool> {
    let file = match File::open(path) {
        Ok(file) => file,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(error) => return Err(error),
    };
    match file.try_lock_shared() {
        Ok(()) => {
            file.unlock()?;
            Ok(false)
        }
        Err(TryLockError::WouldBlock) => Ok(true),
        Err(TryLockError::Error(error)) => Err(error),
    }
}
