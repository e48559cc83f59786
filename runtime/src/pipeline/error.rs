//! Why a run could not start or had to stop: the one error type of `pipeline`, shared by its workers.

use std::path::PathBuf;

use draftpipe_compiler::plan::Device;

use super::host_memory::HostMemoryError;
use crate::backend::cuda::CudaError;
use crate::checkpoint::CheckpointError;
use crate::drafter::DrafterError;
use crate::queue::QueueConfigError;
use crate::source::SourceError;
use crate::telemetry::TelemetryError;

/// Why a run could not start or had to stop.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The plan's stages cannot run on this machine.
    #[error("{0}")]
    Unsupported(String),
    /// The plan does not fit in this machine's memory.
    #[error(transparent)]
    HostMemory(#[from] HostMemoryError),
    /// The queue rejected the plan's queue block.
    #[error("queue: {0}")]
    Queue(#[from] QueueConfigError),
    /// A source could not be opened.
    #[error("source: {0}")]
    Source(#[from] SourceError),
    /// A producer failed while running.
    #[error("producer {worker} failed")]
    Producer {
        /// Producer index.
        worker: usize,
        /// The cause.
        #[source]
        source: SourceError,
    },
    /// The target's depth (`layers`, or its weights' `config.json`) is unusable or contradicts the pipeline.
    #[error("target depth: {0}")]
    TargetDepth(#[from] crate::target_depth::TargetDepthError),
    /// The target's frozen embedding and `lm_head` (a `dflash` drafter's) could not be had.
    #[error("target weights: {0}")]
    TargetWeights(#[from] crate::target_weights::TargetWeightsError),
    /// The `eagle3` drafter's draft vocabulary (its `vocab_map`, or the counts of its source) could not be had.
    #[error("draft vocabulary: {0}")]
    VocabMap(#[from] crate::model::eagle3::vocab::VocabMapError),
    /// The pipeline's `acceptance` check names files this machine does not have.
    #[error("acceptance: {0}")]
    Acceptance(#[from] crate::acceptance::AcceptanceError),
    /// A drafter failed: a batch it cannot train on, or its device failed.
    #[error("drafter {worker}{} failed", on_device(*device))]
    Step {
        /// Drafter index.
        worker: usize,
        /// Its device.
        device: Device,
        /// The cause.
        #[source]
        source: DrafterError,
    },
    /// The drafter stage's GPUs cannot be used (no driver, no such device, no kernels, no NCCL).
    #[error("drafter stage `{stage}` cannot run on gpu {devices}")]
    Gpu {
        /// The drafter stage's name.
        stage: String,
        /// The stage's device ordinals.
        devices: String,
        /// What is missing.
        #[source]
        source: CudaError,
    },
    /// The loss or the gradients stayed non-finite.
    #[error(
        "{count} steps in a row had a non-finite loss or gradient (stopped at step {step}); lower the learning rate or enable clip_grad_norm"
    )]
    NonFinite {
        /// Non-finite steps in a row.
        count: u32,
        /// The step it stopped at.
        step: u64,
    },
    /// Loading or saving a checkpoint failed.
    #[error("checkpoint: {0}")]
    Checkpoint(#[from] CheckpointError),
    /// A checkpoint is incompatible with this plan.
    #[error("cannot resume from {dir}: {reason}")]
    Resume {
        /// The checkpoint directory.
        dir: PathBuf,
        /// What does not match.
        reason: String,
    },
    /// Telemetry output failed.
    #[error("telemetry: {0}")]
    Telemetry(#[from] TelemetryError),
    /// Every producer failed under `--keep-going`: nothing was left to train on.
    #[error("every producer failed: {0}")]
    AllProducersFailed(String),
    /// A thread of the run could not be started (the OS refused: process or memory limits).
    #[error("cannot start the {thread} thread")]
    Spawn {
        /// The thread's name.
        thread: String,
        /// The OS's answer.
        #[source]
        source: std::io::Error,
    },
    /// A directory the run writes is in use by another run, or cannot be locked.
    #[error(transparent)]
    Lock(#[from] crate::lock::LockError),
    /// Two outputs of the run would overwrite each other (the checkpoint's renames would move the run directory).
    #[error("--save {} and the run directory {} conflict: {reason}", save.display(), run_dir.display())]
    OutputConflict {
        /// The checkpoint directory.
        save: PathBuf,
        /// The run directory.
        run_dir: PathBuf,
        /// How they collide.
        reason: &'static str,
    },
    /// A file the run will write may not be written there (the output rule of `output_file`).
    #[error("the trace file (the plan's telemetry.trace): {0}")]
    Output(#[from] crate::output_file::OutputError),
    /// Every step of the run was skipped for non-finite values, so nothing was trained.
    #[error(
        "every step up to step {step} was skipped for a non-finite loss or gradient: nothing was trained and no \
         checkpoint was written; lower the learning rate or enable clip_grad_norm"
    )]
    NothingTrained {
        /// The step the run reached.
        step: u64,
    },
    /// An error stopped the run after the last good state was saved.
    #[error(
        "stopped at step {step}; the last good state is saved in {} (its state.json says why)",
        dir.display()
    )]
    StoppedAfterSave {
        /// The step saved.
        step: u64,
        /// The checkpoint directory.
        dir: PathBuf,
        /// The error that stopped the run.
        #[source]
        source: Box<RunError>,
    },
    /// The run was refused before any thread started (a check, a lock, a checkpoint, a device, a source): it
    /// trained nothing, and the directories it had made for its outputs are removed again.
    #[error(transparent)]
    NotStarted(Box<RunError>),
    /// A worker thread panicked: a bug in draftpipe, not in the input.
    #[error(
        "the {0} thread panicked (a bug in draftpipe; please report it with the message above)"
    )]
    Panicked(String),
}

/// ` (gpu N)` for a drafter on a GPU, nothing on the CPU.
fn on_device(device: Device) -> String {
    match device {
        Device::Cpu => String::new(),
        Device::Gpu(ordinal) => format!(" (gpu {ordinal})"),
    }
}
