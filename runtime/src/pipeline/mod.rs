//! `draftpipe run`: the whole pipeline for one [`Plan`], wired from the runtime's parts.
//!
//! ```text
//!  producer threads ──Box<HsBatch>──▶ HsQueue ──▶ drafter threads ──all-reduce──▶ AdamW
//!     ▲ BatchPool ◀──────── buffers go back after each step ───────────┘      │
//!     └─ telemetry thread: status lines, depth samples, trace ◀── recorders ──┘ checkpoints (worker 0)
//! ```
//!
//! Producers run one per target worker, drafters one per drafter worker (data-parallel replicas that average
//! their gradients every step when `sync = allreduce`): on the CPU backend (`drafter.rs`), or on the CUDA
//! backend when the drafter stage is placed on GPUs (`gpu_drafter.rs`, NCCL between the GPUs). The run ends
//! when the step limit is reached, the sources are exhausted, a fault stops it, or the caller's interrupt flag
//! is raised; in every case the drafters finish the step in hand, worker 0 writes the final checkpoint (when
//! asked), and the telemetry writes its summary, so [`Diagnosis`] can explain the run.

mod drafter;
mod ending;
mod gpu_drafter;
mod host_memory;
mod outputs;
mod spawn;

pub use host_memory::HostMemoryError;
mod producer;

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use draftpipe_compiler::plan::Plan;

use crate::allreduce::AllReduce;
use crate::batch::HsBatch;
use crate::checkpoint::{CheckpointError, load_checkpoint, load_weights};
use crate::cpu::StepError;
use crate::cuda::CudaError;
use crate::params::FlatState;
use crate::queue::{HsQueue, QueueConfig, QueueConfigError, QueueStats, SeqLen};
use crate::source::{BatchPool, HsSource, Producer, SourceError, open_sources};
use crate::telemetry::{
    Diagnosis, OutputMode, QueueSnapshot, Reporter, ReporterConfig, RunSummary, Telemetry,
    TelemetryError,
};

impl SeqLen for Box<HsBatch> {
    fn seq_len(&self) -> usize {
        self.longest_sequence()
    }
}

/// How one run is driven, beyond what the plan says.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Step limit; overrides the plan's `steps`.
    pub steps: Option<u64>,
    /// Where checkpoints go.
    pub save_dir: Option<PathBuf>,
    /// Checkpoint every this many steps (and always at the end) when `save_dir` is set.
    pub save_every: Option<u64>,
    /// Continue from this checkpoint directory.
    pub resume: Option<PathBuf>,
    /// Start from these weights (a `model.safetensors`), with fresh optimizer state.
    pub init: Option<PathBuf>,
    /// How status lines are written.
    pub output: OutputMode,
    /// Where `status.jsonl` and `summary.json` go.
    pub run_dir: Option<PathBuf>,
    /// Where the trace goes (the plan's `telemetry.trace`, or none).
    pub trace: Option<PathBuf>,
    /// Keep running on the other producers when one fails.
    pub keep_going: bool,
    /// Stop after this many non-finite steps in a row.
    pub max_nonfinite_in_row: u32,
    /// Seed of the drafter's initial weights.
    pub init_seed: u64,
    /// Fault injection for tests: the run's thread spawns after this many fail as if the OS refused them
    /// (`None`, the default, never).
    pub fail_spawn_after: Option<usize>,
}

impl RunOptions {
    /// Options for `plan` with nothing overridden: plain status lines, no checkpoints, the plan's trace path.
    pub fn for_plan(plan: &Plan) -> Self {
        Self {
            steps: None,
            save_dir: None,
            save_every: None,
            resume: None,
            init: None,
            output: OutputMode::Plain,
            run_dir: None,
            trace: plan.telemetry.trace.as_ref().map(PathBuf::from),
            keep_going: false,
            max_nonfinite_in_row: DEFAULT_MAX_NONFINITE_IN_ROW,
            init_seed: 0,
            fail_spawn_after: None,
        }
    }
}

/// Non-finite steps in a row after which a run gives up: a few can be a bad batch, more mean the run diverged.
pub const DEFAULT_MAX_NONFINITE_IN_ROW: u32 = 5;

/// Why a run stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// The step limit was reached.
    StepLimit,
    /// Every source was exhausted and the queue drained.
    SourcesExhausted,
    /// The caller's interrupt flag was raised (Ctrl-C).
    Interrupted,
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
    /// A drafter could not train on a batch.
    #[error("drafter {worker} failed")]
    Step {
        /// Drafter index.
        worker: usize,
        /// The cause.
        #[source]
        source: StepError,
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
    /// A GPU drafter failed while training.
    #[error("drafter {worker} (gpu {ordinal}) failed")]
    GpuStep {
        /// Drafter index.
        worker: usize,
        /// Its device.
        ordinal: usize,
        /// The cause.
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
    /// A file the run will write cannot be created.
    #[error("cannot write {what} {}", path.display())]
    Output {
        /// What the file is for.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
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
    /// A worker thread panicked: a bug in draftpipe, not in the input.
    #[error(
        "the {0} thread panicked (a bug in draftpipe; please report it with the message above)"
    )]
    Panicked(String),
}

/// Runs `on_panic` if the thread unwinds through it: a panicking worker must still release the threads that
/// wait for it (the queue, the all-reduce group), or the run would hang instead of failing.
struct OnPanic<F: FnMut()>(F);

impl<F: FnMut()> Drop for OnPanic<F> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            (self.0)();
        }
    }
}

/// The handle of a started thread, or `None` after recording the refusal as the run's error.
fn spawned<T>(shared: &Shared, result: Result<T, RunError>) -> Option<T> {
    match result {
        Ok(handle) => Some(handle),
        Err(error) => {
            shared.fail(error);
            None
        }
    }
}

/// Converts the queue's statistics into the telemetry's view of them.
fn queue_snapshot(stats: QueueStats) -> QueueSnapshot {
    QueueSnapshot {
        depth: stats.depth,
        capacity: stats.capacity,
        min_ready: stats.min_ready,
        per_bucket: stats.per_bucket,
        pushes: stats.pushes,
        pops: stats.pops,
        producer_blocked: stats.producer_blocked,
        consumer_blocked: stats.consumer_blocked,
        seen_full: stats.seen_full,
        seen_below_watermark: stats.seen_below_watermark,
    }
}

/// State every worker thread reads: the queue, the pool, stop flags and the first fatal error.
struct Shared {
    queue: HsQueue<Box<HsBatch>>,
    pool: BatchPool,
    /// Raised by the caller (Ctrl-C): drafters finish the step in hand and stop.
    interrupt: Arc<AtomicBool>,
    /// Raised when the drafters are done: producers stop filling.
    producers_stop: AtomicBool,
    /// Producers still running; the last one to finish closes the queue so the drafters drain it.
    live_producers: AtomicU32,
    fatal: Mutex<Option<RunError>>,
    fatal_raised: AtomicBool,
    /// Per producer, the position after the newest batch a drafter has taken: where a resumed run restarts.
    consumed: Mutex<Vec<u64>>,
    /// `consumed` as it stood when the last all-reduce round completed: every batch it counts is in that round's
    /// update, and none taken since (a fast worker may already hold its next batch while worker 0 saves).
    trained: Mutex<Vec<u64>>,
    producer_errors: Mutex<Vec<String>>,
    /// What the end of the run needs: the final save's record of a last good state.
    end: ending::EndState,
}

impl Shared {
    fn fail(&self, error: RunError) {
        let mut fatal = self.fatal.lock().unwrap_or_else(PoisonError::into_inner);
        if fatal.is_none() {
            *fatal = Some(error);
        }
        self.fatal_raised.store(true, Ordering::Release);
        self.queue.close();
    }

    fn should_stop(&self) -> bool {
        self.interrupt.load(Ordering::Acquire) || self.fatal_raised.load(Ordering::Acquire)
    }

    /// Marks the batch at `source_position` as taken by a drafter: a resumed run restarts after it.
    fn consume(&self, source_position: u64) {
        let mut consumed = self.consumed.lock().unwrap_or_else(PoisonError::into_inner);
        let producers = consumed.len() as u64;
        let owner = (source_position % producers) as usize;
        consumed[owner] = consumed[owner].max(source_position + producers);
    }

    /// The data positions now (see `consumed`).
    fn consumed_positions(&self) -> Vec<u64> {
        self.consumed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Records `consumed` as trained; called once per all-reduce round, when every member has its batch.
    fn mark_trained(&self) {
        let positions = self.consumed_positions();
        *self.trained.lock().unwrap_or_else(PoisonError::into_inner) = positions;
    }

    /// The data positions of the last completed all-reduce round.
    fn trained_positions(&self) -> Vec<u64> {
        self.trained
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn producer_finished(&self) {
        if self.live_producers.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.queue.close();
        }
    }
}

/// The replica every drafter starts from: fresh, `--init` weights, or a resumed checkpoint.
struct Start {
    state: FlatState,
    step: u64,
    data_positions: Option<Vec<u64>>,
}

fn starting_state(plan: &Plan, options: &RunOptions) -> Result<Start, RunError> {
    let mut state = FlatState::init(&plan.model, options.init_seed);
    if let Some(dir) = &options.resume {
        let checkpoint = load_checkpoint(dir, &plan.model)?;
        if checkpoint.state.plan_name != plan.name {
            return Err(RunError::Resume {
                dir: dir.clone(),
                reason: format!(
                    "it was written by pipeline `{}`, this is `{}`",
                    checkpoint.state.plan_name, plan.name
                ),
            });
        }
        let producers = plan.target.placement.workers.len();
        if checkpoint.state.data_positions.len() != producers {
            return Err(RunError::Resume {
                dir: dir.clone(),
                reason: format!(
                    "it has data positions for {} producers, the plan has {producers}",
                    checkpoint.state.data_positions.len()
                ),
            });
        }
        state.params = checkpoint.params;
        state.exp_avg = checkpoint.exp_avg;
        state.exp_avg_sq = checkpoint.exp_avg_sq;
        state.step = checkpoint.state.optimizer_step;
        return Ok(Start {
            state,
            step: checkpoint.state.step,
            data_positions: Some(checkpoint.state.data_positions),
        });
    }
    if let Some(file) = &options.init {
        state.params = load_weights(file, &plan.model)?;
    }
    Ok(Start {
        state,
        step: 0,
        data_positions: None,
    })
}

/// Runs `plan` until its step limit, the end of its data, a fault, or `interrupt`; status lines go to `out`.
///
/// # Errors
/// [`RunError`] when the plan cannot run here, a source or checkpoint cannot be opened, a producer or drafter
/// fails, or the loss stays non-finite. A run stopped by an error still writes its summary when it can.
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
    host_memory::check(plan)?;
    let _output_locks = outputs::prepare(options)?;
    let gpus = gpu_drafter::ordinals(plan)?;
    let mut communicators = match &gpus {
        Some(ordinals) => gpu_drafter::prepare(plan, ordinals)?,
        None => Vec::new(),
    }
    .into_iter();
    let start = starting_state(plan, options)?;
    let step_limit = options.steps.or(plan.drafter.steps);

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
    let producers: Vec<Producer> = sources.into_iter().map(Producer::new).collect();
    let queue_seed = plan_seed(plan) ^ start.step;
    let first_positions = start
        .data_positions
        .clone()
        .unwrap_or_else(|| (0..producers.len() as u64).collect());
    let shared = Arc::new(Shared {
        queue: HsQueue::new(QueueConfig::from_spec(&plan.queue, queue_seed))?,
        pool: BatchPool::for_plan(plan)?,
        interrupt,
        producers_stop: AtomicBool::new(false),
        live_producers: AtomicU32::new(producers.len() as u32),
        fatal: Mutex::new(None),
        fatal_raised: AtomicBool::new(false),
        consumed: Mutex::new(first_positions.clone()),
        trained: Mutex::new(first_positions),
        producer_errors: Mutex::new(Vec::new()),
        end: ending::EndState::new(start.state.step),
    });

    let drafters = plan.drafter.placement.workers.len();
    let telemetry = Arc::new(Telemetry::new(
        producers.len(),
        drafters,
        options.trace.is_some(),
    ));
    let mut reporter_config = ReporterConfig::new(
        plan.name.clone(),
        Duration::from_millis(plan.telemetry.every_ms),
        plan.queue.capacity,
        plan.queue.min_ready,
    );
    reporter_config.mode = options.output;
    // The status line counts the steps of this run, so a resumed run's total is what is left of the limit.
    reporter_config.total_steps = step_limit.map(|limit| limit.saturating_sub(start.step));
    reporter_config.run_dir = options.run_dir.clone();
    reporter_config.trace_path = options.trace.clone();
    reporter_config.source_status = source_status;
    let reporter = Reporter::new(reporter_config, Arc::clone(&telemetry), out)?;

    let reporter_stop = AtomicBool::new(false);
    // CPU workers average their gradients through the group; GPU workers average theirs with NCCL and use the
    // group only to agree, before each launch, that every one of them launches.
    let group_len = if gpus.is_some() {
        gpu_drafter::ROUND_LEN
    } else {
        plan.model.parameters
    };
    let group = Arc::new(AllReduce::new(drafters, group_len));
    let nonfinite_limit = options.max_nonfinite_in_row.max(1);
    let producer_recorders = (0..producers.len())
        .map(|worker| telemetry.producer(worker))
        .collect::<Result<Vec<_>, _>>()?;
    let drafter_recorders = (0..drafters)
        .map(|worker| telemetry.drafter(worker))
        .collect::<Result<Vec<_>, _>>()?;
    let spawner = spawn::Spawner::new(options.fail_spawn_after);
    let outcome = std::thread::scope(|scope| {
        // A thread that cannot start fails the run and is released as if it had finished at once: an unstarted
        // producer counts as finished (the queue closes when the others are done), an unstarted drafter leaves
        // the all-reduce group, so the threads already running stop instead of waiting for it forever.
        let producer_handles: Vec<_> = producers
            .into_iter()
            .zip(producer_recorders)
            .enumerate()
            .filter_map(|(worker, (producer, recorder))| {
                let thread_shared = Arc::clone(&shared);
                let keep_going = options.keep_going;
                let max_rate = plan.target.max_rate;
                let handle = spawned(
                    &shared,
                    spawner.spawn(scope, format!("producer-{worker}"), move || {
                        let shared = thread_shared;
                        let _release = OnPanic(|| {
                            shared.fail(RunError::Panicked(format!("producer {worker}")));
                            shared.producer_finished();
                        });
                        producer::run(worker, producer, &shared, &recorder, keep_going, max_rate)
                    }),
                );
                if handle.is_none() {
                    shared.producer_finished();
                }
                handle
            })
            .collect();
        let drafter_handles: Vec<_> = drafter_recorders
            .into_iter()
            .enumerate()
            .filter_map(|(worker, recorder)| {
                let context = drafter::DrafterContext {
                    worker,
                    plan,
                    options,
                    shared: Arc::clone(&shared),
                    group: Arc::clone(&group),
                    recorder,
                    state: start.state.clone(),
                    first_step: start.step,
                    step_limit,
                    nonfinite_limit,
                };
                let gpu = gpus.as_ref().map(|ordinals| gpu_drafter::GpuDevice {
                    ordinal: ordinals[worker],
                    all_reduce: communicators.next(),
                });
                let (thread_shared, thread_group) = (Arc::clone(&shared), Arc::clone(&group));
                let handle = spawned(
                    &shared,
                    spawner.spawn(scope, format!("drafter-{worker}"), move || {
                        let (shared, group) = (thread_shared, thread_group);
                        let _release = OnPanic(|| {
                            shared.fail(RunError::Panicked(format!("drafter {worker}")));
                            group.leave(|| true);
                        });
                        match gpu {
                            Some(device) => gpu_drafter::run(context, device),
                            None => drafter::run(context),
                        }
                    }),
                );
                if handle.is_none() {
                    group.leave(|| true);
                }
                handle
            })
            .collect();
        let telemetry_thread = {
            let (shared, reporter_stop) = (&shared, &reporter_stop);
            let mut reporter = reporter;
            spawned(
                shared,
                spawner.spawn(scope, "telemetry".into(), move || {
                    // A reporter that cannot write (say, stdout closed) stops the run rather than leaving it to
                    // train unobserved; the workers see the failure at their next step.
                    match reporter.run(reporter_stop, || queue_snapshot(shared.queue.stats())) {
                        Ok(()) => Some(reporter),
                        Err(error) => {
                            shared.fail(RunError::Telemetry(error));
                            None
                        }
                    }
                }),
            )
        };

        // Panics were turned into the run's fatal error by the workers' guards; joining every thread before
        // acting on any result keeps one failure from leaving the others running.
        let finished: Vec<drafter::Finished> = drafter_handles
            .into_iter()
            .filter_map(|handle| handle.join().ok())
            .collect();
        shared.producers_stop.store(true, Ordering::Release);
        shared.queue.close();
        for handle in producer_handles {
            let _ = handle.join();
        }
        reporter_stop.store(true, Ordering::Release);
        let reporter = telemetry_thread.and_then(|t| t.join().ok().flatten());
        let stop = if shared.interrupt.load(Ordering::Acquire) {
            StopReason::Interrupted
        } else {
            finished
                .iter()
                .map(|f| f.stop)
                .next()
                .unwrap_or(StopReason::SourcesExhausted)
        };
        let step = finished.iter().map(|f| f.step).max().unwrap_or(start.step);
        (stop, step, reporter)
    });
    let (stop, step, reporter) = outcome;
    let summary = reporter.map(|reporter| reporter.finish(&queue_snapshot(shared.queue.stats())));
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
        &shared,
        stop,
        step,
        step_limit,
        summary.as_ref(),
        fatal.as_ref(),
        &producer_errors,
    );
    let nothing_trained = ending.reason == crate::telemetry::EndReason::NothingTrained;
    if let Some(summary) = summary.as_mut()
        && let Err(error) = ending::record(summary, ending, options)
    {
        fatal.get_or_insert(error);
    }
    if let Some(error) = fatal {
        return Err(ending::with_saved_state(error, &shared));
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
