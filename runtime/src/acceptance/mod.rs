//! The acceptance check of a run (`acceptance { ... }` in the pipeline): every `every` optimizer steps worker 0
//! exports the drafter and the real draft-and-verify loop (`python -m draftpipe_client.speculative`) measures
//! it against the target on held-out prompts, in a child process the drafters never wait for.
//!
//! ```text
//!  worker 0, step % every == 0 ──busy?──▶ skipped (counted, warned)
//!        └─ idle: write_export(RUN_DIR/acceptance/step-N/) ──▶ spawn PYTHON -m draftpipe_client.speculative
//!                                                                 --json RUN_DIR/acceptance/step-N.json
//!  watcher thread: output ──▶ step-N.log (capped), exit / timeout / kill request ──▶ the child's group killed
//!                  ──▶ step-N.json (bounded, range-checked) ──▶ measurement or failure (warned)
//!  telemetry thread: status() ──▶ status-line column          run end: finish() waits (bounded) or kills
//! ```
//!
//! A check that cannot start, fails, times out, writes no figures or impossible ones is a warning naming the
//! command and the tail of its output; the run goes on. The files of the newest [`KEPT_CHECKS`] checks stay.
//! The Python interpreter is `DRAFTPIPE_PYTHON` when set, else the section's `python`, else `python3`; it must
//! import `draftpipe_client` (installed, or on `PYTHONPATH`).

mod figures;
mod group;
mod output;
mod watcher;

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use draftpipe_compiler::plan::AcceptanceSpec;

use crate::checkpoint::CheckpointError;
use crate::telemetry::{AcceptanceFailure, AcceptanceStatus, AcceptanceSummary};

use watcher::{KillReason, Watch};

pub use figures::MAX_FIGURES_BYTES;
pub use group::kill_live_groups;
pub use output::{LOG_HEAD_BYTES, LOG_TAIL_BYTES};

/// The environment variable that names the Python interpreter of the acceptance check; it wins over the
/// pipeline's `python`.
pub const PYTHON_VAR: &str = "DRAFTPIPE_PYTHON";
/// The interpreter when neither `DRAFTPIPE_PYTHON` nor the pipeline names one.
pub const DEFAULT_PYTHON: &str = "python3";
/// The Python module that runs the draft-and-verify loop.
pub const LOOP_MODULE: &str = "draftpipe_client.speculative";
/// The acceptance check's directory under the run directory.
pub const ACCEPTANCE_DIR: &str = "acceptance";
/// The checks whose `step-N.log` and `step-N.json` are kept: an older check's are removed when a newer one
/// starts (its figures stay in the summary).
pub const KEPT_CHECKS: usize = 5;

/// Why the acceptance check cannot be set up: the pipeline names files this machine does not have.
#[derive(Debug, thiserror::Error)]
pub enum AcceptanceError {
    /// The target is not a `transformers` model directory.
    #[error(
        "the acceptance section's target `{}` is not a transformers model directory (no config.json in it)",
        path.display()
    )]
    NoTarget {
        /// The directory named.
        path: PathBuf,
    },
    /// The prompts file is missing or not a file.
    #[error("the acceptance section's prompts `{}` is not a file", path.display())]
    NoPrompts {
        /// The file named.
        path: PathBuf,
    },
    /// There is no run directory to write the exports and results into.
    #[error("the acceptance check writes into the run directory, and this run has none")]
    NoRunDir,
    /// The check's directory could not be made.
    #[error("cannot create {}: {source}", path.display())]
    Io {
        /// The directory.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
}

/// The check in flight: its step, how to stop it, and the thread that watches it.
struct Running {
    step: u64,
    kill: Arc<Mutex<Option<KillReason>>>,
    handle: JoinHandle<()>,
}

/// The acceptance check of one run, shared by worker 0 (which starts checks), the telemetry thread (which
/// shows them) and the run's end (which waits for the last one).
pub struct AcceptanceMonitor {
    spec: AcceptanceSpec,
    python: String,
    dir: PathBuf,
    running: Mutex<Option<Running>>,
    /// The newest export written: removed when the next one is.
    newest_export: Mutex<Option<PathBuf>>,
    /// The steps whose log and figures files are kept, oldest first.
    kept_checks: Mutex<VecDeque<u64>>,
    record: Arc<Mutex<AcceptanceSummary>>,
}

impl AcceptanceMonitor {
    /// The check of `spec` writing under `run_dir/acceptance/` (replaced: it holds the checks of this run
    /// only); the interpreter is `DRAFTPIPE_PYTHON`, else the spec's, else `python3`.
    ///
    /// # Errors
    /// [`AcceptanceError`] when the target or the prompts are missing, or the directory cannot be made.
    pub fn new(spec: &AcceptanceSpec, run_dir: Option<&Path>) -> Result<Self, AcceptanceError> {
        let target = Path::new(&spec.target);
        if !target.join("config.json").is_file() {
            return Err(AcceptanceError::NoTarget {
                path: target.to_path_buf(),
            });
        }
        let prompts = Path::new(&spec.prompts);
        if !prompts.is_file() {
            return Err(AcceptanceError::NoPrompts {
                path: prompts.to_path_buf(),
            });
        }
        let dir = run_dir
            .ok_or(AcceptanceError::NoRunDir)?
            .join(ACCEPTANCE_DIR);
        let io = |source| AcceptanceError::Io {
            path: dir.clone(),
            source,
        };
        if dir.exists() {
            std::fs::remove_dir_all(&dir).map_err(io)?;
        }
        std::fs::create_dir_all(&dir).map_err(io)?;
        let python = std::env::var(PYTHON_VAR)
            .ok()
            .filter(|p| !p.is_empty())
            .or_else(|| spec.python.clone())
            .unwrap_or_else(|| DEFAULT_PYTHON.to_owned());
        Ok(Self {
            record: Arc::new(Mutex::new(AcceptanceSummary {
                every: spec.every,
                ..AcceptanceSummary::default()
            })),
            spec: spec.clone(),
            python,
            dir,
            running: Mutex::new(None),
            newest_export: Mutex::new(None),
            kept_checks: Mutex::new(VecDeque::new()),
        })
    }

    /// The interpreter the checks run.
    pub fn python(&self) -> &str {
        &self.python
    }

    /// Whether the step just completed is one to check.
    pub fn due(&self, step: u64) -> bool {
        step > 0 && step.is_multiple_of(self.spec.every)
    }

    /// Where the export of `step` goes.
    pub fn export_dir(&self, step: u64) -> PathBuf {
        self.dir.join(format!("step-{step}"))
    }

    /// When a check is still running, records `step` as skipped (with a warning) and returns true: the caller
    /// then exports nothing.
    pub fn skip_if_busy(&self, step: u64) -> bool {
        let mut running = self.lock_running();
        let Some(busy) = Self::reap(&mut running) else {
            return false;
        };
        crate::log_line!(
            "warning: acceptance: the check of step {busy} is still running at step {step}; step {step} \
             is not checked"
        );
        self.lock_record().skipped_busy.push(step);
        true
    }

    /// Checks `step`: `export` writes the drafter's export into the directory it is given, then the loop runs
    /// on it in the background. A failed export is a warning and no check. Call after
    /// [`AcceptanceMonitor::skip_if_busy`] returned false (only one thread starts checks).
    pub fn start(&self, step: u64, export: impl FnOnce(&Path) -> Result<(), CheckpointError>) {
        if self.skip_if_busy(step) {
            return;
        }
        let mut running = self.lock_running();
        let dir = self.export_dir(step);
        let previous = self
            .newest_export
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .replace(dir.clone());
        if let Some(previous) = previous {
            // Only the newest export keeps its weights; the earlier checks' figures and logs stay.
            let _ = std::fs::remove_dir_all(previous);
        }
        if let Err(error) = export(&dir) {
            self.fail(step, format!("the export could not be written: {error}"));
            return;
        }
        let (json, log) = self.check_files(step);
        self.keep_newest_checks(step);
        let watch = Watch {
            step,
            command: self.command(&dir, &json),
            json,
            log,
            export: dir,
            timeout: Duration::from_millis(self.spec.timeout_ms),
        };
        let kill = Arc::new(Mutex::new(None));
        match watch.spawn(Arc::clone(&kill), Arc::clone(&self.record)) {
            Ok(handle) => *running = Some(Running { step, kill, handle }),
            Err(reason) => self.fail(step, reason),
        }
    }

    /// The status-line column now.
    pub fn status(&self) -> AcceptanceStatus {
        let running = Self::reap(&mut self.lock_running());
        self.lock_record().status(running)
    }

    /// The record so far.
    pub fn summary(&self) -> AcceptanceSummary {
        self.lock_record().clone()
    }

    /// At the end of the run: waits for a running check (its timeout bounds the wait), killing it at once when
    /// `interrupt` is or becomes raised, and returns the record.
    pub fn finish(&self, interrupt: &AtomicBool) -> AcceptanceSummary {
        let mut running = self.lock_running();
        if let Some(check) = running.take() {
            if !check.handle.is_finished() && !interrupt.load(Ordering::Acquire) {
                crate::log_line!(
                    "acceptance: waiting for the check of step {} (at most {:.0} s; a signal stops it)",
                    check.step,
                    self.spec.timeout_ms as f64 / 1e3
                );
            }
            while !check.handle.is_finished() {
                if interrupt.load(Ordering::Acquire) {
                    Self::kill(&check, KillReason::Interrupted);
                }
                std::thread::sleep(watcher::POLL);
            }
            let _ = check.handle.join();
        }
        drop(running);
        self.summary()
    }

    /// The figures and log files of the check of `step`.
    fn check_files(&self, step: u64) -> (PathBuf, PathBuf) {
        (
            self.dir.join(format!("step-{step}.json")),
            self.dir.join(format!("step-{step}.log")),
        )
    }

    /// Counts `step` among the kept checks and removes the files of those older than the newest
    /// [`KEPT_CHECKS`].
    fn keep_newest_checks(&self, step: u64) {
        let mut kept = self
            .kept_checks
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        kept.push_back(step);
        while kept.len() > KEPT_CHECKS {
            if let Some(old) = kept.pop_front() {
                let (json, log) = self.check_files(old);
                let _ = std::fs::remove_file(json);
                let _ = std::fs::remove_file(log);
            }
        }
    }

    /// The command line of the check of the export in `dir`.
    fn command(&self, dir: &Path, json: &Path) -> Vec<String> {
        [
            self.python.as_str(),
            "-m",
            LOOP_MODULE,
            "--draft",
            &dir.display().to_string(),
            "--target",
            &self.spec.target,
            "--prompts",
            &self.spec.prompts,
            "--max-new-tokens",
            &self.spec.max_new_tokens.to_string(),
            "--json",
            &json.display().to_string(),
        ]
        .map(str::to_owned)
        .to_vec()
    }

    fn fail(&self, step: u64, reason: String) {
        watcher::record_failure(&self.record, AcceptanceFailure { step, reason });
    }

    fn kill(check: &Running, reason: KillReason) {
        check
            .kill
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_or_insert(reason);
    }

    /// The step of the check still running, after joining one that has ended.
    fn reap(running: &mut Option<Running>) -> Option<u64> {
        if running.as_ref().is_some_and(|r| r.handle.is_finished())
            && let Some(done) = running.take()
        {
            let _ = done.handle.join();
        }
        running.as_ref().map(|r| r.step)
    }

    fn lock_running(&self) -> std::sync::MutexGuard<'_, Option<Running>> {
        self.running.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn lock_record(&self) -> std::sync::MutexGuard<'_, AcceptanceSummary> {
        self.record.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Drop for AcceptanceMonitor {
    /// A run that ends without [`AcceptanceMonitor::finish`] (an error) leaves no child behind.
    fn drop(&mut self) {
        if let Some(check) = self.lock_running().take() {
            Self::kill(&check, KillReason::RunEnded);
            let _ = check.handle.join();
        }
    }
}
