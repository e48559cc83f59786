//! Telemetry: measure every worker's time at almost no cost, show it while the run goes, and explain it at
//! the end.
//!
//! ```text
//!  producer/drafter threads                 telemetry thread                         end of run
//!  ───────────────────────                  ────────────────                         ──────────
//!  recorder.record(phase, t0, t1) ──atomics──▶ Telemetry::snapshot ─▶ StatusLine ─▶ stdout, status.jsonl
//!                                 └─span ring─▶ TraceBuffer (last N per worker) ───▶ trace JSON
//!                                                              └──▶ tensorboard::EventWriter ─▶ DIR/events.out.tfevents.…
//!  queue stats ───────────────────────────────▶ depth histogram ─▶ RunSummary ─▶ summary.json ─▶ Diagnosis
//! ```
//!
//! The files (`status.jsonl`, the TensorBoard events, the trace, `summary.json`) are all written through [`TelemetryFiles`]: a write
//! that fails is a warning once and that file stops; the run goes on.
//!
//! The lead's wiring: make one `Arc<`[`Telemetry`]`>`, give each worker its recorder
//! ([`Telemetry::drafter`], [`Telemetry::producer`]), run [`Reporter::run`] on a telemetry thread with a
//! closure that maps the queue's stats to a [`QueueSnapshot`], and after the workers stop call
//! [`Reporter::finish`] and print [`Diagnosis::from_summary`]. `draftpipe diagnose RUN_DIR` is
//! [`load_summary`] then [`Diagnosis::from_summary`].

mod acceptance;
mod counts;
mod diagnosis;
mod ending;
mod files;
mod phase;
mod recorder;
mod reporter;
mod status;
mod summary;
pub mod tensorboard;
mod trace;
mod validate;

use std::path::PathBuf;

pub use acceptance::{
    AcceptanceFailure, AcceptanceMeasurement, AcceptanceStatus, AcceptanceSummary,
};
pub use counts::{
    BucketSteps, DrafterCounts, PhaseCount, ProducerCounts, StepTokens, Taus, TelemetrySnapshot,
};
pub use diagnosis::{
    Bottleneck, Diagnosis, DrafterBreakdown, HOST_GAP_BUSY_BELOW, HOST_GAP_IDLE_ABOVE,
    MIN_DEPTH_SAMPLES, OVERHEAD_SIGNIFICANT, PhaseShare, QueueEvidence, RAN_LOW_FRACTION,
    WAIT_SIGNIFICANT, Waits, WarmupEvidence,
};
pub use ending::{EndReason, RunEnding, UntrainedBucket};
pub use files::TelemetryFiles;
pub use phase::{DrafterPhase, ProducerPhase};
pub use recorder::{DrafterRecorder, FINAL_STEPS, MAX_BUCKET_STATS, ProducerRecorder, Telemetry};
pub use reporter::{
    AcceptanceProbe, BAR_WIDTH, LearningRate, OutputMode, Reporter, ReporterConfig,
};
pub use status::{DrafterStatus, QueueFill, QueueSnapshot, StatusLine, progress_bar};
pub use summary::{
    BucketStepTimes, DepthSample, DrafterSummary, DrafterTimeline, LossSample, PhaseTotal,
    ProducerSummary, QueueSummary, RunSummary, STATUS_FILE, SUMMARY_FILE, SUMMARY_FORMAT,
    load_summary, write_summary,
};
pub use trace::{DRAFTER_PID, PRODUCER_PID, TraceBuffer};
pub use validate::{InvalidSummary, validate_summary};

/// What can go wrong in telemetry: bad worker indices, and files that cannot be written or read back.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// A recorder was asked for a worker the telemetry was not set up for.
    #[error("no {role} {index}: telemetry was set up for {count} {role}s")]
    NoSuchWorker {
        /// `"drafter"` or `"producer"`.
        role: &'static str,
        /// The index asked for.
        index: usize,
        /// How many there are.
        count: usize,
    },
    /// A second recorder was asked for a worker whose recorder is still alive.
    #[error("{role} {index} already has a recorder (each worker's counters have a single writer)")]
    AlreadyClaimed {
        /// `"drafter"` or `"producer"`.
        role: &'static str,
        /// The index asked for.
        index: usize,
    },
    /// A file or directory operation failed.
    #[error("cannot {action} {}: {source}", path.display())]
    Io {
        /// What was being done.
        action: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The trace file could not be written.
    #[error(transparent)]
    TraceFile(#[from] crate::output_file::OutputError),
    /// A trace was asked for, but the telemetry keeps no spans.
    #[error("a trace to {} needs span rings: make the telemetry with `trace: true`", path.display())]
    TraceWithoutRings {
        /// The requested trace file.
        path: PathBuf,
    },
    /// Writing a status line to the output failed.
    #[error("cannot write the status line: {source}")]
    Output {
        /// The cause.
        source: std::io::Error,
    },
    /// Serialising to JSON failed.
    #[error("cannot encode JSON: {source}")]
    Encode {
        /// The cause.
        source: serde_json::Error,
    },
    /// A summary file is not valid JSON of the expected shape.
    #[error("{} is not a valid run summary: {source}", path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: serde_json::Error,
    },
    /// A summary file was written by a build with another summary format.
    #[error("{} has summary format {}, this build reads format {expected}", path.display(), found.map_or("none".to_string(), |f| f.to_string()))]
    Format {
        /// The file.
        path: PathBuf,
        /// The `format` field found, if any.
        found: Option<u64>,
        /// The format this build reads.
        expected: u32,
    },
}
