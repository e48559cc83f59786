//! The phases a worker's time is split into: the vocabulary of counters, status lines, the trace and the
//! diagnosis.

use draftpipe_compiler::plan::StepPhase;
use serde::{Deserialize, Serialize};

/// Where a drafter worker's time goes within one training step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DrafterPhase {
    /// Blocked on the queue waiting for a batch (the time the drafter is idle for lack of data).
    DataWait,
    /// Host-to-device copy of the batch (or its CPU equivalent) that was not overlapped with compute.
    Copy,
    /// Forward pass up to the final norm and heads.
    Forward,
    /// Fused vocabulary loss and its gradient.
    Loss,
    /// Backward pass.
    Backward,
    /// Gradient all-reduce over the drafter workers (includes waiting for the slowest peer).
    AllReduce,
    /// Fused AdamW step.
    Optimizer,
    /// A whole step on a GPU, bracketed by CUDA events: forward, loss, backward, all-reduce and AdamW run as one
    /// graph, so the device time is measured whole and not split into the phases above.
    DeviceStep,
    /// Anything else inside the step the worker chose to measure (bookkeeping, loss read-back, checkpoints).
    Other,
}

impl DrafterPhase {
    /// Number of drafter phases (the length of per-phase counter arrays).
    pub const COUNT: usize = 9;
    /// Every phase, in step order; `ALL[p.index()] == p`.
    pub const ALL: [DrafterPhase; Self::COUNT] = [
        Self::DataWait,
        Self::Copy,
        Self::Forward,
        Self::Loss,
        Self::Backward,
        Self::AllReduce,
        Self::Optimizer,
        Self::DeviceStep,
        Self::Other,
    ];

    /// Position in [`Self::ALL`] (and in counter arrays).
    pub fn index(self) -> usize {
        self as usize
    }

    /// The snake_case name used in JSON, the trace and reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::DataWait => "data_wait",
            Self::Copy => "copy",
            Self::Forward => "forward",
            Self::Loss => "loss",
            Self::Backward => "backward",
            Self::AllReduce => "all_reduce",
            Self::Optimizer => "optimizer",
            Self::DeviceStep => "device_step",
            Self::Other => "other",
        }
    }

    /// Whether this phase is the device doing the model's arithmetic (forward, loss, backward, optimizer), as
    /// opposed to waiting, moving data or host bookkeeping.
    pub fn is_compute(self) -> bool {
        matches!(
            self,
            Self::Forward | Self::Loss | Self::Backward | Self::Optimizer | Self::DeviceStep
        )
    }
}

impl From<StepPhase> for DrafterPhase {
    fn from(phase: StepPhase) -> Self {
        match phase {
            StepPhase::Copy => Self::Copy,
            StepPhase::Forward => Self::Forward,
            StepPhase::Loss => Self::Loss,
            StepPhase::Backward => Self::Backward,
            StepPhase::AllReduce => Self::AllReduce,
            StepPhase::Optimizer => Self::Optimizer,
        }
    }
}

/// Where a producer's (target's) time goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProducerPhase {
    /// Producing one item: running the target or reading the file.
    Produce,
    /// Blocked pushing into a full queue (backpressure from the drafters).
    BlockedFull,
}

impl ProducerPhase {
    /// Number of producer phases.
    pub const COUNT: usize = 2;
    /// Every phase; `ALL[p.index()] == p`.
    pub const ALL: [ProducerPhase; Self::COUNT] = [Self::Produce, Self::BlockedFull];

    /// Position in [`Self::ALL`] (and in counter arrays).
    pub fn index(self) -> usize {
        self as usize
    }

    /// The snake_case name used in JSON, the trace and reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::Produce => "produce",
            Self::BlockedFull => "blocked_full",
        }
    }
}
