//! What the acceptance check (`acceptance { ... }` in the pipeline) reports into the telemetry: one
//! measurement per check of the draft-and-verify loop, the status line's column and the summary's record.
//!
//! ```text
//!  acceptance::AcceptanceMonitor ──child's --json──▶ AcceptanceMeasurement ──▶ AcceptanceSummary (summary.json)
//!                               └──status()──▶ AcceptanceStatus ──▶ StatusLine column `accept τ 2.310 @ step 400`
//! ```

use std::fmt;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// One check: the draft-and-verify loop's figures for the export of one step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AcceptanceMeasurement {
    /// The optimizer step whose weights were exported.
    pub step: u64,
    /// Mean accepted length per verifying target forward, the bonus token counted (the real τ).
    pub tau: f64,
    /// SpecForge's simulated teacher-forced τ of the same drafter on the same sequences, when the command
    /// reports it (`teacher_forced_tau` in summaries written before the exact figure existed).
    #[serde(
        default,
        alias = "teacher_forced_tau",
        skip_serializing_if = "Option::is_none"
    )]
    pub teacher_forced_tau_simulated: Option<f64>,
    /// The exact teacher-forced τ (each block's drafted prefix matching its labels, plus the bonus token).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub teacher_forced_tau_exact: Option<f64>,
    /// `1 − τ / teacher-forced τ`: the train/serve gap, when the command reports it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gap: Option<f64>,
    /// Per drafted slot `k` (1 ..), the share of blocks whose slot `k` was accepted.
    pub acceptance_by_position: Vec<f64>,
    /// Target forwards (prefills and verifies) per generated token; plain decoding needs 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_forwards_per_token: Option<f64>,
    /// Prompts decoded.
    pub prompts: u64,
    /// Tokens generated over every prompt.
    pub generated_tokens: u64,
    /// Wall time of the check, from the child's start to its exit.
    pub wall_s: f64,
    /// The export the loop loaded (its weights are kept for the newest check only).
    pub export: PathBuf,
}

/// A check that gave no measurement, and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AcceptanceFailure {
    /// The step whose export it checked.
    pub step: u64,
    /// What went wrong, with the command and the tail of its output.
    pub reason: String,
}

/// The acceptance record of a run, in `summary.json`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AcceptanceSummary {
    /// Steps between two checks.
    pub every: u64,
    /// Every check that finished, in step order.
    pub measurements: Vec<AcceptanceMeasurement>,
    /// Steps whose check was skipped because the previous one was still running.
    pub skipped_busy: Vec<u64>,
    /// Checks that failed, timed out or were killed at the end of the run.
    pub failures: Vec<AcceptanceFailure>,
}

/// The acceptance column of a status line.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AcceptanceStatus {
    /// The newest measurement's τ and step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tau: Option<f64>,
    /// The step of that measurement.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<u64>,
    /// The newest measurement's simulated teacher-forced τ.
    #[serde(
        default,
        alias = "teacher_forced_tau",
        skip_serializing_if = "Option::is_none"
    )]
    pub teacher_forced_tau_simulated: Option<f64>,
    /// The newest measurement's exact teacher-forced τ.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub teacher_forced_tau_exact: Option<f64>,
    /// The step whose check is running now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub running: Option<u64>,
    /// Checks skipped so far because the previous one was still running.
    pub skipped: u64,
    /// Checks failed so far.
    pub failed: u64,
}

impl fmt::Display for AcceptanceStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.tau, self.step) {
            (Some(tau), Some(step)) => write!(f, "accept τ {tau:.3} @ step {step}")?,
            _ => write!(f, "accept τ -")?,
        }
        if let Some(step) = self.running {
            write!(f, " (checking step {step})")?;
        }
        if self.skipped > 0 {
            write!(f, " skipped {}", self.skipped)?;
        }
        if self.failed > 0 {
            write!(f, " failed {}", self.failed)?;
        }
        Ok(())
    }
}

impl AcceptanceSummary {
    /// The status-line column this record gives, with `running` the step being checked now.
    pub fn status(&self, running: Option<u64>) -> AcceptanceStatus {
        let latest = self.measurements.last();
        AcceptanceStatus {
            tau: latest.map(|m| m.tau),
            step: latest.map(|m| m.step),
            teacher_forced_tau_simulated: latest.and_then(|m| m.teacher_forced_tau_simulated),
            teacher_forced_tau_exact: latest.and_then(|m| m.teacher_forced_tau_exact),
            running,
            skipped: self.skipped_busy.len() as u64,
            failed: self.failures.len() as u64,
        }
    }
}
