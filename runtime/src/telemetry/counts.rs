//! What the telemetry thread reads from the recorders: every counter of every worker at one instant, with the
//! part of a span still open counted up to that instant ([`TelemetrySnapshot`]), and the derived figures the
//! status line and the summary need.

use std::time::Duration;

use super::phase::{DrafterPhase, ProducerPhase};
use crate::batch::HsBatch;

/// A step's two teacher-forced acceptance lengths (or a sum of them over steps), the bonus token counted:
/// `exact`, the mean over its blocks of the drafted prefix that matches the labels, and `simulated`,
/// SpecForge's `1 + Σ_k Π_{j≤k} acc_j` over the per-slot marginal accuracies (`model::BlockMetrics`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Taus {
    /// The exact acceptance length.
    pub exact: f64,
    /// SpecForge's simulated acceptance length.
    pub simulated: f64,
}

impl Taus {
    /// Both figures divided by `n` (the mean of `n` steps' sum).
    pub fn per(self, n: u64) -> Self {
        Self {
            exact: self.exact / n as f64,
            simulated: self.simulated / n as f64,
        }
    }
}

impl std::ops::Add for Taus {
    type Output = Self;

    fn add(self, other: Self) -> Self {
        Self {
            exact: self.exact + other.exact,
            simulated: self.simulated + other.simulated,
        }
    }
}

impl std::ops::Sub for Taus {
    type Output = Self;

    fn sub(self, other: Self) -> Self {
        Self {
            exact: self.exact - other.exact,
            simulated: self.simulated - other.simulated,
        }
    }
}

/// What one step trained on, counted three ways: the batch's token slots (`sequences × padded_len`, padding
/// included: what a step costs), its real tokens (positions within the sequences' lengths: what `eval` counts)
/// and the real tokens whose loss mask is set (the positions a loss is computed at).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepTokens {
    /// Token slots, padding included.
    pub slots: u64,
    /// Real tokens.
    pub real: u64,
    /// Real tokens with the loss mask set.
    pub with_loss: u64,
}

impl StepTokens {
    /// The counts of `batch`.
    pub fn of(batch: &HsBatch) -> Self {
        let (mut real, mut with_loss) = (0u64, 0u64);
        for (sequence, &len) in batch.seq_lens.iter().enumerate() {
            let start = sequence * batch.padded_len;
            let len = (len as usize).min(batch.padded_len);
            real += len as u64;
            with_loss += batch.loss_mask[start..start + len]
                .iter()
                .filter(|&&m| m != 0)
                .count() as u64;
        }
        Self {
            slots: batch.tokens() as u64,
            real,
            with_loss,
        }
    }

    /// `n` slots, every one a real token with a loss (a batch without padding).
    pub fn unpadded(n: u64) -> Self {
        Self {
            slots: n,
            real: n,
            with_loss: n,
        }
    }
}

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
    /// Token slots trained on, padding included.
    pub token_slots: u64,
    /// Real tokens trained on.
    pub real_tokens: u64,
    /// Real tokens with the loss mask set.
    pub loss_tokens: u64,
    /// Steps skipped for a non-finite loss or gradient.
    pub skipped: u64,
    /// Sum of the finite losses passed to `step_done`.
    pub loss_sum: f64,
    /// Number of finite losses in `loss_sum`.
    pub loss_count: u64,
    /// The latest finite loss.
    pub last_loss: Option<f64>,
    /// `dflash`, `eagle3`: sum of the steps' finite τ, both kinds (bonus token counted).
    pub tau_sum: Taus,
    /// Number of steps in `tau_sum`.
    pub tau_count: u64,
    /// The latest step's τ.
    pub last_tau: Option<Taus>,
    /// The latest step's accuracy of block slots `1..` (`dflash`; empty otherwise).
    pub last_slot_accuracy: Vec<f32>,
    /// `dflash`: per block slot `1..`, the sum of the accuracies of the steps counted in `tau_count`.
    pub slot_accuracy_sum: Vec<f64>,
    /// Sum of the applied steps' gradient norms (before clipping).
    pub grad_norm_sum: f64,
    /// Number of norms in `grad_norm_sum`.
    pub grad_norm_count: u64,
    /// The latest applied step's gradient norm.
    pub last_grad_norm: Option<f64>,
    /// The finite losses of the last steps (up to [`FINAL_STEPS`](super::FINAL_STEPS), in no particular order).
    pub recent_losses: Vec<f64>,
    /// `dflash`: the τ of the last steps (up to [`FINAL_STEPS`](super::FINAL_STEPS)).
    pub recent_taus: Vec<Taus>,
    /// `dflash`: per block slot `1..`, the accuracy averaged over the steps of `recent_taus`.
    pub recent_slot_accuracy: Vec<f32>,
    /// The part of a step still under way at the snapshot (inside the step, not yet recorded).
    pub open_busy: Duration,
    /// The part of a data wait still under way at the snapshot.
    pub open_wait: Duration,
    /// The drafter's first data wait, once it has ended: waiting for the first producer, included in the
    /// `data_wait` phase but in no step (`None` while it lasts).
    pub first_data_wait: Option<Duration>,
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

    /// Token slots trained on over all drafters, padding included.
    pub fn token_slots(&self) -> u64 {
        self.drafters.iter().map(|d| d.token_slots).sum()
    }

    /// Real tokens trained on over all drafters.
    pub fn real_tokens(&self) -> u64 {
        self.drafters.iter().map(|d| d.real_tokens).sum()
    }

    /// Real tokens with a loss over all drafters.
    pub fn loss_tokens(&self) -> u64 {
        self.drafters.iter().map(|d| d.loss_tokens).sum()
    }

    /// Skipped non-finite steps over all drafters.
    pub fn skipped(&self) -> u64 {
        self.drafters.iter().map(|d| d.skipped).sum()
    }
}
