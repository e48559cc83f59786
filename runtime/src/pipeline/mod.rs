//! `draftpipe run`: the whole pipeline for one [`Plan`], wired from the runtime's parts.
//!
//! ```text
//!  producer threads ──Box<HsBatch>──▶ HsQueue ──▶ drafter threads ──all-reduce──▶ AdamW
//!     ▲ BatchPool ◀──────── buffers go back after each step ───────────┘      │
//!     └─ telemetry thread: status lines, depth samples, trace ◀── recorders ──┘ checkpoints (worker 0)
//! ```
//!
//! Producers run one per target worker, drafters one per drafter worker (data-parallel replicas that average
//! their gradients every step when `sync = allreduce`), each running the one worker loop (`worker.rs`) on its
//! backend: the CPU, or a GPU when the drafter stage is placed on GPUs (`devices.rs`, NCCL between the GPUs).
//! Where the drafters start is `start.rs`; starting and joining the threads is `threads.rs`; shared state lives
//! in `shared.rs`, the error type in `error.rs`. The run ends
//! when the step limit is reached, the sources are exhausted, a fault stops it, or the caller's interrupt flag
//! is raised; in every case the drafters finish the step in hand, worker 0 writes the final checkpoint (when
//! asked), and the telemetry writes its summary, so [`Diagnosis`] can explain the run.

pub(crate) mod devices;
mod ending;
mod error;
mod host_memory;
mod options;
mod outputs;
mod producer;
mod queue_plan;
mod save;
mod shared;
mod spawn;
mod start;
mod threads;
mod worker;

pub use error::RunError;
pub use host_memory::HostMemoryError;
pub use options::{DEFAULT_MAX_NONFINITE_IN_ROW, RunOptions, StopReason};
pub use queue_plan::queue_config;
use shared::Shared;
use start::{Start, starting_state};
use threads::Threads;

use std::io::Write;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use draftpipe_compiler::plan::Plan;

use crate::acceptance::AcceptanceMonitor;
use crate::batch::HsBatch;
use crate::queue::{HsQueue, SeqLen};
use crate::source::{
    BatchPool, HsSource, MaskProbe, Producer, SourceError, SourceStatusProbe, StreamStatus,
    open_sources,
};
use crate::telemetry::{
    AcceptanceProbe, Diagnosis, LearningRate, Reporter, ReporterConfig, RunSummary, Telemetry,
};

impl SeqLen for Box<HsBatch> {
    fn seq_len(&self) -> usize {
        self.longest_sequence()
    }
}

/// What a finished run reports.
#[derive(Debug)]
pub struct RunOutcome {
    /// Why it stopped.
    pub stop: StopReason,
    /// Training steps taken in this run (skipped steps included), counted from the start or the resumed step.
    pub step: u64,
    /// The telemetry summary (also in the run directory).
    pub summary: RunSummary,
    /// The diagnosis of the summary.
    pub diagnosis: Diagnosis,
    /// Producer failures tolerated under `keep_going`.
    pub producer_errors: Vec<String>,
}

/// Runs `plan` until its step limit, the end of its data, a fault, or `interrupt`; status lines go to `out`.
///
/// # Errors
/// [`RunError`] when the plan cannot run here, a source or checkpoint cannot be opened, a producer or drafter
/// fails, or the loss stays non-finite. A run refused before any thread started is [`RunError::NotStarted`]
/// (and removes the directories it had made); a run stopped by an error still writes its summary when it can.
/// A telemetry file that cannot be written is a warning, never the run's error.
pub fn run(
    plan: &Plan,
    options: &RunOptions,
    interrupt: Arc<AtomicBool>,
    out: impl Write + Send,
) -> Result<RunOutcome, RunError> {
    run_with_sources(plan, options, open_sources, interrupt, out)
}

/// [`run`], with the producers' sources opened by `open` (one per target worker, in worker order) instead of
/// [`open_sources`]: for a source the plan language does not name, such as a test's.
///
/// # Errors
/// As [`run`]; also when `open` gives a number of sources other than the target stage's workers.
pub fn run_with_sources(
    plan: &Plan,
    options: &RunOptions,
    open: impl FnOnce(&Plan) -> Result<Vec<Box<dyn HsSource>>, SourceError>,
    interrupt: Arc<AtomicBool>,
    out: impl Write + Send,
) -> Result<RunOutcome, RunError> {
    // A run that cannot start leaves nothing behind: the directories it made for its outputs go again.
    let new_directories = outputs::NewDirectories::of(options);
    let prepared = match prepare(plan, options, open, interrupt, out) {
        Ok(prepared) => prepared,
        Err(error) => {
            new_directories.remove();
            return Err(RunError::NotStarted(Box::new(error)));
        }
    };
    let Prepared {
        plan,
        _output_locks,
        gpus,
        communicators,
        start,
        producers,
        shared,
        telemetry,
        step_limit,
        reporter,
    } = prepared;
    let threads = Threads {
        plan: &plan,
        options,
        shared: &shared,
        telemetry: &telemetry,
        start: &start,
        step_limit,
    };
    let (stop, step, reporter) = threads.run(producers, gpus, communicators, reporter)?;
    finish(
        (&plan, options),
        (&shared, &telemetry),
        reporter,
        (stop, step, step_limit),
    )
}

/// Everything a run holds once it has started: checked, locked, loaded and opened, before any thread runs.
struct Prepared<W: Write + Send> {
    /// The plan with the hidden states' dtype and the target's depth resolved.
    plan: Plan,
    /// Held until the run ends.
    _output_locks: outputs::OutputLocks,
    gpus: Option<Vec<usize>>,
    communicators: Vec<crate::backend::cuda::GradientAllReduce>,
    start: Start,
    producers: Vec<Producer>,
    shared: Arc<Shared>,
    telemetry: Arc<Telemetry>,
    step_limit: Option<u64>,
    reporter: Reporter<W>,
}

/// The start of a run: every check, lock, load and open that can refuse it before a thread runs.
fn prepare<W: Write + Send>(
    plan: &Plan,
    options: &RunOptions,
    open: impl FnOnce(&Plan) -> Result<Vec<Box<dyn HsSource>>, SourceError>,
    interrupt: Arc<AtomicBool>,
    out: W,
) -> Result<Prepared<W>, RunError> {
    // The pool, the sources and the drafters' input slots all hold hidden states in this one precision.
    let plan = crate::source::resolve_hs_dtype(plan)?;
    // The depth a `dflash` export writes as `num_target_layers`, read once from the target's `config.json`.
    let plan = crate::target_depth::resolve_target_layers(&plan)?;
    let output_locks = outputs::prepare(&plan, options)?;
    let gpus = devices::ordinals(&plan)?;
    let communicators = match &gpus {
        Some(ordinals) => devices::prepare(&plan, ordinals)?,
        None => Vec::new(),
    };
    // After the devices: a plan for GPUs this machine lacks is first of all that, whatever its host memory.
    host_memory::check(&plan)?;
    let start = starting_state(&plan, options)?;
    let acceptance = plan
        .acceptance
        .as_ref()
        .map(|spec| AcceptanceMonitor::new(spec, options.run_dir.as_deref()).map(Arc::new))
        .transpose()?;
    let (producers, source_status, stream, masks) = open_producers(&plan, open, &start)?;
    let first_positions = start
        .data_positions
        .clone()
        .unwrap_or_else(|| (0..producers.len() as u64).collect());
    let queue_config = queue_config(&plan.queue, plan_seed(&plan) ^ start.step);
    // Data-parallel workers step in lockstep, so the queue hands them rounds of one bucket (not under `fifo`:
    // see `Plan::drafters_take_rounds`).
    let queue = if plan.drafters_take_rounds() {
        HsQueue::with_rounds(queue_config, plan.drafter.placement.workers.len())?
    } else {
        HsQueue::new(queue_config)?
    };
    let shared = Arc::new(Shared::new(
        queue,
        BatchPool::for_plan(&plan)?,
        interrupt,
        first_positions,
        start.state.step,
        (stream, start.vocab.clone(), acceptance, masks),
    ));
    let drafters = plan.drafter.placement.workers.len();
    let telemetry = Arc::new(Telemetry::new(
        producers.len(),
        drafters,
        options.trace.is_some(),
    ));
    let step_limit = options.step_limit(&plan);
    let reporter = reporter(
        &plan,
        options,
        &telemetry,
        (
            step_limit,
            start.step,
            source_status,
            shared.acceptance.clone(),
        ),
        out,
    )?;
    Ok(Prepared {
        plan,
        _output_locks: output_locks,
        gpus,
        communicators,
        start,
        producers,
        shared,
        telemetry,
        step_limit,
        reporter,
    })
}

/// What [`open_producers`] opens: the producers, the status line's probe, a stream's names and counts.
type OpenedProducers = (
    Vec<Producer>,
    Option<SourceStatusProbe>,
    Option<StreamStatus>,
    Option<MaskProbe>,
);

/// The producers, one per target worker, each source moved to the resumed position, and the first source's
/// status probe for the status line (a stream source's connections) and stream handle (its producers' names
/// and counts, given back from the checkpoint here and saved with each checkpoint).
fn open_producers(
    plan: &Plan,
    open: impl FnOnce(&Plan) -> Result<Vec<Box<dyn HsSource>>, SourceError>,
    start: &Start,
) -> Result<OpenedProducers, RunError> {
    let mut sources = open(plan)?;
    let workers = plan.target.placement.workers.len();
    if sources.len() != workers {
        return Err(RunError::Unsupported(format!(
            "{} sources for the {workers} workers of target stage `{}`",
            sources.len(),
            plan.target.name
        )));
    }
    if let Some(positions) = &start.data_positions {
        for (source, position) in sources.iter_mut().zip(positions) {
            source.seek(*position)?;
        }
    }
    let source_status = sources.first().and_then(|source| source.status_probe());
    let stream = sources.first().and_then(|source| source.stream_status());
    if let Some(stream) = &stream {
        stream.restore(&start.stream_producers);
    }
    let masks = sources.first().and_then(|source| source.mask_probe());
    Ok((
        sources.into_iter().map(Producer::new).collect(),
        source_status,
        stream,
        masks,
    ))
}

/// The status reporter of this run.
fn reporter<W: Write + Send>(
    plan: &Plan,
    options: &RunOptions,
    telemetry: &Arc<Telemetry>,
    (step_limit, first_step, source_status, acceptance): (
        Option<u64>,
        u64,
        Option<SourceStatusProbe>,
        Option<Arc<AcceptanceMonitor>>,
    ),
    out: W,
) -> Result<Reporter<W>, RunError> {
    let mut config = ReporterConfig::new(
        plan.name.clone(),
        Duration::from_millis(plan.telemetry.every_ms),
        plan.queue.capacity,
        plan.queue.min_ready,
    );
    config.mode = options.output;
    // The status line counts on from a resumed checkpoint's step, up to the limit (both from step 0).
    config.total_steps = step_limit;
    config.first_step = first_step;
    config.run_dir = options.run_dir.clone();
    config.trace_path = options.trace.clone();
    config.source_status = source_status;
    config.acceptance_status =
        acceptance.map(|monitor| AcceptanceProbe::new(move || monitor.status()));
    config.tensorboard_dir = options.tensorboard.clone();
    config.learning_rate = Some(LearningRate {
        lr: f64::from(plan.drafter.optimizer.lr),
        schedule: plan.drafter.optimizer.schedule,
        schedule_total: plan.drafter.steps.unwrap_or(0),
    });
    Ok(Reporter::new(config, Arc::clone(telemetry), out)?)
}

/// The run's outcome once every thread has stopped: its first fatal error (with where a last good state was
/// saved), or the summary with how the run ended, and the diagnosis.
fn finish<W: Write + Send>(
    (plan, options): (&Plan, &RunOptions),
    (shared, telemetry): (&Shared, &Telemetry),
    reporter: Option<Reporter<W>>,
    (stop, step, step_limit): (StopReason, u64, Option<u64>),
) -> Result<RunOutcome, RunError> {
    // The last check ends (or is killed) before the final status line, which then shows it.
    let acceptance = shared
        .acceptance
        .as_ref()
        .map(|monitor| monitor.finish(&shared.interrupt));
    let summary = reporter.map(|reporter| reporter.finish(&shared.queue_snapshot()));
    let producer_errors = std::mem::take(
        &mut *shared
            .producer_errors
            .lock()
            .unwrap_or_else(PoisonError::into_inner),
    );
    let mut fatal = shared
        .fatal
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take();
    if fatal.is_none()
        && !producer_errors.is_empty()
        && producer_errors.len() == plan.target.placement.workers.len()
    {
        fatal = Some(RunError::AllProducersFailed(producer_errors.join("; ")));
    }
    let mut summary = match summary {
        Some(Ok(summary)) => Some(summary),
        Some(Err(error)) => {
            fatal.get_or_insert(RunError::Telemetry(error));
            None
        }
        None => None,
    };
    let ending = ending::ending(
        plan,
        shared,
        (stop, step, step_limit),
        summary.as_ref(),
        fatal.as_ref(),
        &producer_errors,
    );
    let nothing_trained = ending.reason == crate::telemetry::EndReason::NothingTrained;
    if let Some(summary) = summary.as_mut() {
        summary.masks = shared.masks.as_ref().map(MaskProbe::read);
        ending::record(summary, (ending, acceptance), options, telemetry.files());
    }
    if let Some(error) = fatal {
        return Err(ending::with_saved_state(error, shared));
    }
    if nothing_trained {
        return Err(RunError::NothingTrained { step });
    }
    let summary = summary.ok_or_else(|| RunError::Panicked("telemetry".into()))?;
    let diagnosis = Diagnosis::from_summary(&summary);
    Ok(RunOutcome {
        stop,
        step,
        summary,
        diagnosis,
        producer_errors,
    })
}

/// The seed the plan's randomness derives from (the synthetic source's seed; 0 for file sources).
fn plan_seed(plan: &Plan) -> u64 {
    match plan.target.source {
        draftpipe_compiler::plan::SourceSpec::Synthetic { seed, .. } => seed,
        draftpipe_compiler::plan::SourceSpec::Safetensors { .. }
        | draftpipe_compiler::plan::SourceSpec::Stream { .. } => 0,
    }
}
