//! How a run ended, as the pipeline saw it: recorded in `summary.json` beside the measurements, so the
//! diagnosis (at the end of the run and from `draftpipe diagnose` later) says when data ran out early, when
//! nothing was trained, which producers failed, and which error stopped the run.

use serde::{Deserialize, Serialize};

/// Why a run stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EndReason {
    /// The step limit was reached.
    StepLimit,
    /// The data ended and no step limit was asked for.
    DataExhausted,
    /// The data ended before the step limit, or (with no limit asked for) before a first step.
    DataExhaustedEarly,
    /// Stopped by a signal (Ctrl-C, SIGTERM, SIGHUP) after the step in hand.
    Interrupted,
    /// Every step of the run was skipped for non-finite values: nothing was trained.
    NothingTrained,
    /// An error stopped the run.
    Error,
}

/// The end of a run, for the summary.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunEnding {
    /// Why it stopped.
    pub reason: EndReason,
    /// The step limit asked for, if any (counted from step 0, as the checkpoint's steps are).
    pub step_limit: Option<u64>,
    /// The step reached (a resumed run counts on from its checkpoint's step).
    pub step: u64,
    /// Producers that failed, each with its error (under `--keep-going` the run went on without them).
    #[serde(default)]
    pub failed_producers: Vec<String>,
    /// The error that stopped the run, with its causes.
    #[serde(default)]
    pub error: Option<String>,
    /// The last good state saved after that error: its step and directory.
    #[serde(default)]
    pub saved_after_error: Option<(u64, String)>,
    /// Steps this run trained (a resumed run's after its checkpoint's step).
    #[serde(default)]
    pub steps_this_run: u64,
    /// Lockstep drafters (`sync = allreduce`) take a round of one bucket, one batch each: this many.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub round_members: Option<usize>,
    /// What the data left untrained when it ended: the batches of each bucket too few to fill a round.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub untrained: Vec<UntrainedBucket>,
}

/// The batches of one bucket left untrained when the data ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct UntrainedBucket {
    /// The bucket's padded length.
    pub padded_len: usize,
    /// Its batches left in the queue.
    pub batches: usize,
}

impl RunEnding {
    /// One sentence per thing the user must know about how the run ended (none for a run that reached its
    /// step limit cleanly).
    pub fn notices(&self) -> Vec<String> {
        let mut notices = Vec::new();
        match (self.reason, self.step_limit) {
            (EndReason::DataExhaustedEarly, Some(limit)) => notices.push(format!(
                "the data ran out at step {} of the {limit} asked for: the run ended early{}",
                self.step,
                if self.steps_this_run == 0 {
                    "; nothing was trained and no checkpoint was written"
                } else {
                    ""
                }
            )),
            (EndReason::DataExhaustedEarly, None) => notices.push(format!(
                "the data ended at step {} before this run's first step: nothing was trained and no checkpoint \
                 was written",
                self.step
            )),
            (EndReason::NothingTrained, _) => notices.push(format!(
                "every step up to step {} was skipped for a non-finite loss or gradient: nothing was trained, \
                 and no checkpoint was written",
                self.step
            )),
            (EndReason::Error, _) => notices.push(format!(
                "the run stopped with an error at step {}: {}",
                self.step,
                self.error.as_deref().unwrap_or("unknown")
            )),
            _ => {}
        }
        if let Some(notice) = self.untrained_notice() {
            notices.push(notice);
        }
        for failure in &self.failed_producers {
            notices.push(format!("failed producer: {failure}"));
        }
        if let Some((step, dir)) = &self.saved_after_error {
            notices.push(format!(
                "the last good state (step {step}) was saved to {dir} before stopping"
            ));
        }
        notices
    }

    /// What the data left untrained, per bucket, and why: fewer batches of a bucket than a round needs.
    fn untrained_notice(&self) -> Option<String> {
        let batches: usize = self.untrained.iter().map(|bucket| bucket.batches).sum();
        if batches == 0 {
            return None;
        }
        let per_bucket = self
            .untrained
            .iter()
            .map(|bucket| format!("bucket {}: {}", bucket.padded_len, bucket.batches))
            .collect::<Vec<_>>()
            .join(", ");
        let why = self.round_members.map_or_else(String::new, |members| {
            format!(
                ": the {members} lockstep drafters step only on a round of {members} batches of one bucket, and \
                 the drafters waited for a round these could not fill"
            )
        });
        Some(format!(
            "{batches} batch(es) of the data were not trained ({per_bucket}){why}"
        ))
    }
}
