//! One acceptance check in flight: the child process, the thread that watches it (exit, timeout, kill), and
//! the reading of its figures (`--json`) or of why it failed (the tail of its output).
//!
//! ```text
//!  Watch::spawn ──Command (own process group, output to step-N.log)──▶ child
//!       watcher thread: try_wait / timeout / kill request ──▶ step-N.json ──parse──▶ measurement or failure
//! ```

use std::fs::File;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::Deserialize;

use crate::telemetry::{AcceptanceFailure, AcceptanceMeasurement, AcceptanceSummary};

/// How often the watcher looks at the child and at a kill request.
pub(super) const POLL: Duration = Duration::from_millis(20);

/// Lines of the child's output a failure quotes.
const TAIL_LINES: usize = 12;
/// Characters of the child's output a failure quotes at most.
const TAIL_CHARS: usize = 2000;

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

/// The figures of `python -m draftpipe_client.speculative --json` that the run records.
#[derive(Deserialize)]
struct LoopFigures {
    tau: f64,
    #[serde(default)]
    teacher_forced_tau: Option<f64>,
    #[serde(default)]
    gap: Option<f64>,
    acceptance_by_position: Vec<f64>,
    #[serde(default)]
    target_forwards_per_token: Option<f64>,
    prompts: u64,
    generated_tokens: u64,
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
        let log = File::create(&self.log)
            .and_then(|out| Ok((out.try_clone()?, out)))
            .map_err(|error| format!("cannot create {}: {error}", self.log.display()))?;
        let mut command = Command::new(&self.command[0]);
        command
            .args(&self.command[1..])
            .stdin(Stdio::null())
            .stdout(log.0)
            .stderr(log.1);
        // Its own process group: a Ctrl-C meant for the run reaches the run, which stops the child itself.
        #[cfg(unix)]
        std::os::unix::process::CommandExt::process_group(&mut command, 0);
        let _ = std::fs::remove_file(&self.json);
        let child = command.spawn().map_err(|error| {
            format!(
                "cannot start `{shown}`: {error} (name the interpreter with DRAFTPIPE_PYTHON or the \
                 acceptance section's `python`)"
            )
        })?;
        let started = Instant::now();
        let refused = format!("cannot start the thread that watches `{shown}`");
        std::thread::Builder::new()
            .name(format!("acceptance-{}", self.step))
            .spawn(move || {
                let outcome = self.watch(child, started, &kill, &shown);
                match outcome {
                    Ok(measurement) => {
                        crate::log_line!(
                            "acceptance: step {}: τ {:.3}{} on {} prompts ({:.1} s)",
                            measurement.step,
                            measurement.tau,
                            measurement
                                .teacher_forced_tau
                                .map_or(String::new(), |tf| format!(
                                    ", teacher-forced {tf:.3}, gap {:.1}%",
                                    100.0 * (1.0 - measurement.tau / tf)
                                )),
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

    /// Waits for the child (or its timeout, or a kill request) and reads its figures.
    fn watch(
        &self,
        mut child: Child,
        started: Instant,
        kill: &Mutex<Option<KillReason>>,
        shown: &str,
    ) -> Result<AcceptanceMeasurement, String> {
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break status,
                Ok(None) => {}
                Err(error) => return Err(format!("cannot wait for `{shown}`: {error}")),
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
                kill_group(&mut child);
                return Err(format!("`{shown}` was killed: {why}"));
            }
            std::thread::sleep(POLL);
        };
        let wall_s = started.elapsed().as_secs_f64();
        if !status.success() {
            return Err(format!(
                "`{shown}` {}; its output ends:\n{}",
                exited(status),
                self.tail()
            ));
        }
        let text = std::fs::read_to_string(&self.json).map_err(|error| {
            format!(
                "`{shown}` exited 0 but {} cannot be read ({error}); its output ends:\n{}",
                self.json.display(),
                self.tail()
            )
        })?;
        let figures: LoopFigures = serde_json::from_str(&text).map_err(|error| {
            format!(
                "{} is not the loop's figures ({error}): expected `tau`, `acceptance_by_position`, \
                 `prompts` and `generated_tokens`",
                self.json.display()
            )
        })?;
        Ok(AcceptanceMeasurement {
            step: self.step,
            tau: figures.tau,
            teacher_forced_tau: figures.teacher_forced_tau,
            gap: figures.gap,
            acceptance_by_position: figures.acceptance_by_position,
            target_forwards_per_token: figures.target_forwards_per_token,
            prompts: figures.prompts,
            generated_tokens: figures.generated_tokens,
            wall_s,
            export: self.export.clone(),
        })
    }

    /// The last lines of the child's output (stdout and stderr together).
    fn tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
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

/// Kills the child and every process it started (its process group: the interpreter's own children too),
/// then reaps it.
fn kill_group(child: &mut Child) {
    #[cfg(unix)]
    if let Ok(pid) = libc::pid_t::try_from(child.id()) {
        // SAFETY: `kill` only sends a signal; the group is the child's own (made with `process_group(0)`, so
        // its id is the child's pid), and the child is not reaped yet, so the id cannot have been reused.
        unsafe {
            libc::kill(-pid, libc::SIGKILL);
        }
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// How a child ended, in words.
fn exited(status: ExitStatus) -> String {
    match status.code() {
        Some(code) => format!("exited with status {code}"),
        None => {
            #[cfg(unix)]
            if let Some(signal) = std::os::unix::process::ExitStatusExt::signal(&status) {
                return format!("was killed by signal {signal}");
            }
            "ended without a status".to_owned()
        }
    }
}
