//! What the telemetry thread reads from the recorders: every counter of every worker at one instant, with the
//! part of a span still open counted up to that instant ([`TelemetrySnapshot`]), and the derived figures the
//! status line and the summary need.

use std::time::Duration;

use super::phase::{DrafterPhase, ProducerPhase};

/// Total time and number of spans of one phase.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PhaseCount {
    /// Sum of the recorded spans.
    pub total: Duration,
    /// Number of recorded spans.
    pub count: u64,
}

/// One drafter's counters at a snapshot.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DrafterCounts {
    /// Per phase, indexed by [`DrafterPhase::index`].
    pub phases: [PhaseCount; DrafterPhase::COUNT],
    /// Applied steps.
    pub steps: u64,
    /// Tokens trained on.
    pub tokens: u64,
    /// Steps skipped for a non-finite loss or gradient.
    pub skipped: u64,
    /// Sum of the finite losses passed to `step_done`.
    pub loss_sum: f64,
    /// Number of finite losses in `loss_sum`.
    pub loss_count: u64,
    /// The latest finite loss.
    pub last_loss: Option<f64>,
    /// `dflash`: sum of the steps' finite τ (simulated acceptance length, bonus token counted).
    pub tau_sum: f64,
    /// Number of τ in `tau_sum`.
    pub tau_count: u64,
    /// The latest τ.
    pub last_tau: Option<f64>,
    /// The latest step's accuracy of block slots `1..` (`dflash`; empty otherwise).
    pub last_slot_accuracy: Vec<f32>,
    /// The part of a step still under way at the snapshot (inside the step, not yet recorded).
    pub open_busy: Duration,
    /// The part of a data wait still under way at the snapshot.
    pub open_wait: Duration,
    /// Per phase, the time of warm-up steps (the first step of each bucket), included in `phases`.
    pub warmup_phases: [Duration; DrafterPhase::COUNT],
    /// Warm-up steps taken.
    pub warmup_steps: u64,
    /// Wall time of the warm-up steps (from the end of the step before to their end).
    pub warmup_wall: Duration,
    /// The longest step's wall time (from the end of the step before, so with its data wait).
    pub longest_step: Duration,
    /// When the latest step ended, since the epoch.
    pub last_step_end: Duration,
    /// Start of the first recorded span, since the epoch (`None` before any).
    pub first_span_start: Option<Duration>,
    /// End of the latest recorded span, since the epoch.
    pub last_span_end: Duration,
    /// Steady-state step times per bucket, in order of first appearance.
    pub buckets: Vec<BucketSteps>,
}

/// Running sums of one bucket's steady-state step times (the step's own time: its phases except the data
/// wait and the all-reduce, which also hold waiting for others).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct BucketSteps {
    /// The bucket's padded sequence length.
    pub padded_len: usize,
    /// Steady steps of this bucket.
    pub steps: u64,
    /// Sum of their times in seconds.
    pub sum_s: f64,
    /// Sum of their squared times.
    pub sum_squares_s2: f64,
}

impl DrafterCounts {
    /// Busy time up to the snapshot: recorded step phases plus the part of a step still under way.
    pub fn busy_so_far(&self) -> Duration {
        self.busy() + self.open_busy
    }

    /// Data-wait time up to the snapshot, including a wait still under way.
    pub fn wait_so_far(&self) -> Duration {
        self.phase(DrafterPhase::DataWait).total + self.open_wait
    }

    /// The counters of one phase.
    pub fn phase(&self, phase: DrafterPhase) -> PhaseCount {
        self.phases[phase.index()]
    }

    /// Time in every phase except waiting for data: the time the drafter was inside its step.
    pub fn busy(&self) -> Duration {
        DrafterPhase::ALL
            .iter()
            .filter(|&&p| p != DrafterPhase::DataWait)
            .map(|&p| self.phase(p).total)
            .sum()
    }
}

/// One producer's counters at a snapshot.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ProducerCounts {
    /// Per phase, indexed by [`ProducerPhase::index`].
    pub phases: [PhaseCount; ProducerPhase::COUNT],
    /// Items pushed.
    pub items: u64,
    /// Tokens in the pushed items.
    pub tokens: u64,
    /// Sum of the squared `produce` span lengths in seconds² (their spread).
    pub produce_squares_s2: f64,
}

impl ProducerCounts {
    /// The counters of one phase.
    pub fn phase(&self, phase: ProducerPhase) -> PhaseCount {
        self.phases[phase.index()]
    }
}

/// Every counter at one moment.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TelemetrySnapshot {
    /// Time since the telemetry epoch.
    pub elapsed: Duration,
    /// One entry per drafter.
    pub drafters: Vec<DrafterCounts>,
    /// One entry per producer.
    pub producers: Vec<ProducerCounts>,
    /// Spans overwritten in a full ring before the telemetry thread drained them.
    pub spans_dropped: u64,
}

impl TelemetrySnapshot {
    /// Steps every drafter has completed (data-parallel drafters step together, so this is the global step).
    pub fn step(&self) -> u64 {
        self.drafters.iter().map(|d| d.steps).min().unwrap_or(0)
    }

    /// Tokens trained on over all drafters.
    pub fn tokens(&self) -> u64 {
        self.drafters.iter().map(|d| d.tokens).sum()
    }

    /// Skipped non-finite steps over all drafters.
    pub fn skipped(&self) -> u64 {
        self.drafters.iter().map(|d| d.skipped).sum()
    }
}
