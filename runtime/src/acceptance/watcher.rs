//! One acceptance check in flight: the child process, the thread that watches it (exit, timeout, kill), and
//! the reading of its figures (`--json`) or of why it failed (the tail of its output).
//!
//! ```text
//!  Watch::spawn ──Command (own process group, stdout+stderr into one pipe)──▶ child
//!       watcher thread: poll the pipe into step-N.log (capped), exit / timeout / kill request
//!         └─ the child ended: its group killed, it reaped ──▶ step-N.json ──LoopFigures::read──▶ measurement
//!                                                             or failure quoting the end of step-N.log
//! ```

use std::path::PathBuf;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::foreign_file;
use crate::telemetry::{AcceptanceFailure, AcceptanceMeasurement, AcceptanceSummary};

use super::figures::LoopFigures;
use super::group::ChildGroup;
use super::output::CappedLog;

/// How often the watcher looks at the child and at a kill request (output wakes it sooner).
pub(super) const POLL: Duration = Duration::from_millis(20);

/// Lines of the child's output a failure quotes.
const TAIL_LINES: usize = 12;
/// Characters of the child's output a failure quotes at most.
const TAIL_CHARS: usize = 2000;
/// Bytes read from the end of the log for the quote: enough for [`TAIL_LINES`] lines of [`TAIL_CHARS`]
/// characters in any UTF-8.
const TAIL_READ_BYTES: u64 = 4 * TAIL_CHARS as u64;

/// Why a check is stopped before it ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum KillReason {
    /// The run was interrupted (a signal).
    Interrupted,
    /// The run ended with an error.
    RunEnded,
}

/// What one check runs and where its files go.
pub(super) struct Watch {
    pub(super) step: u64,
    /// The program and its arguments.
    pub(super) command: Vec<String>,
    pub(super) json: PathBuf,
    pub(super) log: PathBuf,
    pub(super) export: PathBuf,
    pub(super) timeout: Duration,
}

/// Appends `failure` to the record, with a warning line.
pub(super) fn record_failure(record: &Mutex<AcceptanceSummary>, failure: AcceptanceFailure) {
    crate::log_line!(
        "warning: acceptance: the check of step {} gave no figures: {} (the run goes on)",
        failure.step,
        failure.reason
    );
    record
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .failures
        .push(failure);
}

impl Watch {
    /// Starts the child and its watcher thread, which records the outcome in `record`; a kill request in
    /// `kill` stops the child. Returns why not when the child or the thread cannot start.
    pub(super) fn spawn(
        self,
        kill: Arc<Mutex<Option<KillReason>>>,
        record: Arc<Mutex<AcceptanceSummary>>,
    ) -> Result<JoinHandle<()>, String> {
        let shown = self.command.join(" ");
        let cannot_log = |error| format!("cannot create {}: {error}", self.log.display());
        let (pipe, out) = std::io::pipe().map_err(cannot_log)?;
        let err = out.try_clone().map_err(cannot_log)?;
        let log = CappedLog::create(&self.log, pipe).map_err(cannot_log)?;
        let mut command = Command::new(&self.command[0]);
        command
            .args(&self.command[1..])
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        // Its own process group: a Ctrl-C meant for the run reaches the run, which stops the child itself, and
        // the group is what the watcher kills when the check ends, whichever way.
        std::os::unix::process::CommandExt::process_group(&mut command, 0);
        let _ = std::fs::remove_file(&self.json);
        let spawned = command.spawn();
        // The pipe's write ends now belong to the child alone: it ends when the child's group does.
        drop(command);
        let child = ChildGroup::register(spawned.map_err(|error| {
            format!(
                "cannot start `{shown}`: {error} (name the interpreter with DRAFTPIPE_PYTHON or the \
                 acceptance section's `python`)"
            )
        })?);
        let started = Instant::now();
        let refused = format!("cannot start the thread that watches `{shown}`");
        std::thread::Builder::new()
            .name(format!("acceptance-{}", self.step))
            .spawn(move || {
                let outcome = self.watch(child, log, started, &kill, &shown);
                match outcome {
                    Ok(measurement) => {
                        crate::log_line!(
                            "acceptance: step {}: τ {:.3}{} on {} prompts ({:.1} s)",
                            measurement.step,
                            measurement.tau,
                            measurement.teacher_forced_tau_simulated.map_or(
                                String::new(),
                                |tf| format!(
                                    ", teacher-forced {tf:.3} simulated, gap {:.1}%",
                                    100.0 * (1.0 - measurement.tau / tf)
                                )
                            ),
                            measurement.prompts,
                            measurement.wall_s
                        );
                        let mut record = record.lock().unwrap_or_else(PoisonError::into_inner);
                        record.measurements.push(measurement);
                    }
                    Err(reason) => record_failure(
                        &record,
                        AcceptanceFailure {
                            step: self.step,
                            reason,
                        },
                    ),
                }
            })
            .map_err(|error| format!("{refused}: {error}"))
    }

    /// Waits for the child (or its timeout, or a kill request) while its output goes to the log, kills what
    /// is left of its group, and reads its figures.
    fn watch(
        &self,
        mut child: ChildGroup,
        mut log: CappedLog,
        started: Instant,
        kill: &Mutex<Option<KillReason>>,
        shown: &str,
    ) -> Result<AcceptanceMeasurement, String> {
        let killed = loop {
            match child.has_exited() {
                Ok(true) => break None,
                Ok(false) => {}
                Err(error) => break Some(format!("cannot wait for `{shown}`: {error}")),
            }
            let requested = *kill.lock().unwrap_or_else(PoisonError::into_inner);
            let stop = match requested {
                Some(KillReason::Interrupted) => Some("the run was interrupted".to_owned()),
                Some(KillReason::RunEnded) => Some("the run ended with an error".to_owned()),
                None if started.elapsed() > self.timeout => Some(format!(
                    "it ran past the acceptance section's timeout ({:.0} s)",
                    self.timeout.as_secs_f64()
                )),
                None => None,
            };
            if let Some(why) = stop {
                break Some(format!("`{shown}` was killed: {why}"));
            }
            if let Err(error) = log.wait_and_drain(POLL) {
                break Some(format!("cannot write {}: {error}", self.log.display()));
            }
        };
        // Whatever the child started dies with it, whether it exited by itself or is being stopped.
        let status = child.kill_and_reap();
        let wall_s = started.elapsed().as_secs_f64();
        let logged = log.finish();
        if let Some(reason) = killed {
            return Err(reason);
        }
        let status = status.map_err(|error| format!("cannot wait for `{shown}`: {error}"))?;
        if let Err(error) = logged {
            return Err(format!("cannot write {}: {error}", self.log.display()));
        }
        if !status.success() {
            return Err(format!(
                "`{shown}` {}; its output ends:\n{}",
                exited(status),
                self.tail()
            ));
        }
        let figures = LoopFigures::read(&self.json).map_err(|problem| {
            format!(
                "`{shown}` exited 0 but its figures were refused: {problem}; its output ends:\n{}",
                self.tail()
            )
        })?;
        Ok(AcceptanceMeasurement {
            step: self.step,
            tau: figures.tau,
            teacher_forced_tau_simulated: figures.teacher_forced_tau_simulated,
            teacher_forced_tau_exact: figures.teacher_forced_tau_exact,
            gap: figures.gap,
            acceptance_by_position: figures.acceptance_by_position,
            target_forwards_per_token: figures.target_forwards_per_token,
            prompts: figures.prompts,
            generated_tokens: figures.generated_tokens,
            wall_s,
            export: self.export.clone(),
        })
    }

    /// The last lines of the child's output (stdout and stderr together), read from the end of its log and
    /// decoded lossily (a child may print any bytes).
    fn tail(&self) -> String {
        let bytes = foreign_file::read_tail(&self.log, TAIL_READ_BYTES).unwrap_or_default();
        let text = String::from_utf8_lossy(&bytes);
        let lines: Vec<&str> = text.lines().collect();
        let tail = lines[lines.len().saturating_sub(TAIL_LINES)..].join("\n");
        let skip = tail.chars().count().saturating_sub(TAIL_CHARS);
        let tail: String = tail.chars().skip(skip).collect();
        if tail.trim().is_empty() {
            "(nothing)".to_owned()
        } else {
            tail
        }
    }
}

/// How a child ended, in words.
fn exited(status: ExitStatus) -> String {
    match status.code() {
        Some(code) => format!("exited with status {code}"),
        None => {
            if let Some(signal) = std::os::unix::process::ExitStatusExt::signal(&status) {
                return format!("was killed by signal {signal}");
            }
            "ended without a status".to_owned()
        }
    }
}
