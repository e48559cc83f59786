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
//! Shared state lives in `shared.rs`, the error type in `error.rs`. The run ends
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
mod save;
mod shared;
mod spawn;
mod worker;

pub use error::RunError;
pub use host_memory::HostMemoryError;
pub use options::{DEFAULT_MAX_NONFINITE_IN_ROW, RunOptions, StopReason};
use shared::{OnPanic, Shared};

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use draftpipe_compiler::plan::{Device, Plan, SyncMode};

use crate::acceptance::AcceptanceMonitor;
use crate::allreduce::AllReduce;
use crate::backend::cpu::CpuBackend;
use crate::backend::cpu::HostThreads;
use crate::backend::cuda::GradientAllReduce;
use crate::batch::HsBatch;
use crate::checkpoint::{ProducerRecord, load_checkpoint, load_initial_weights};
use crate::drafter::DrafterError;
use crate::model::eagle3::vocab::{VocabMap, resolve_vocab_map};
use crate::model::registry;
use crate::params::FlatState;
use crate::queue::{HsQueue, QueueConfig, QueueStats, SeqLen};
use crate::source::{
    BatchPool, HsSource, Producer, SourceError, SourceStatusProbe, StreamStatus, open_sources,
};
use crate::target_weights::TargetWeights;
use crate::telemetry::{
    AcceptanceProbe, Diagnosis, DrafterRecorder, QueueSnapshot, Reporter, ReporterConfig,
    RunSummary, Telemetry,
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
fn queue_snapshot(shared: &Shared) -> QueueSnapshot {
    let stats: QueueStats = shared.queue.stats();
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
        rounds: stats.rounds,
        mixed_rounds: shared.mixed_rounds.load(Ordering::Relaxed),
    }
}

/// The replica every drafter starts from: fresh, `--init` weights, or a resumed checkpoint; and, for a family
/// that reads them (`dflash`), the target's frozen embedding and `lm_head`, loaded once for every worker.
struct Start {
    state: FlatState,
    step: u64,
    data_positions: Option<Vec<u64>>,
    /// A stream's producers by name, from the checkpoint resumed.
    stream_producers: Vec<ProducerRecord>,
    frozen: Option<TargetWeights>,
    /// For a family with a draft vocabulary (`eagle3`): the drafter's `vocab_map`, or the one its source's
    /// counts give (SpecForge's rule), computed once before training.
    vocab: Option<VocabMap>,
}

fn starting_state(plan: &Plan, options: &RunOptions) -> Result<Start, RunError> {
    let mut state = FlatState::init(&plan.model, options.init_seed);
    let frozen = if registry::spec(&plan.model.spec).reads_target_weights() {
        Some(TargetWeights::load(&plan.target)?)
    } else {
        None
    };
    let vocab = if plan.model.spec.takes_vocab_map() {
        let given = plan.drafter.vocab_map.as_deref().map(std::path::Path::new);
        Some(resolve_vocab_map(plan, given)?)
    } else {
        None
    };
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
            stream_producers: checkpoint.state.stream_producers,
            frozen,
            vocab,
        });
    }
    if let Some(file) = &options.init {
        state.params = load_initial_weights(file, &plan.model)?;
    }
    Ok(Start {
        state,
        step: 0,
        data_positions: None,
        stream_producers: Vec::new(),
        frozen,
        vocab,
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
    // The pool, the sources and the drafters' input slots all hold hidden states in this one precision.
    let plan = &crate::source::resolve_hs_dtype(plan)?;
    // The depth a `dflash` export writes as `num_target_layers`, read once from the target's `config.json`.
    let plan = &crate::target_depth::resolve_target_layers(plan)?;
    let _output_locks = outputs::prepare(options)?;
    let gpus = devices::ordinals(plan)?;
    let communicators = match &gpus {
        Some(ordinals) => devices::prepare(plan, ordinals)?,
        None => Vec::new(),
    };
    // After the devices: a plan for GPUs this machine lacks is first of all that, whatever its host memory.
    host_memory::check(plan)?;
    let start = starting_state(plan, options)?;
    let acceptance = plan
        .acceptance
        .as_ref()
        .map(|spec| AcceptanceMonitor::new(spec, options.run_dir.as_deref()).map(Arc::new))
        .transpose()?;
    let (producers, source_status, stream) = open_producers(plan, open, &start)?;
    let first_positions = start
        .data_positions
        .clone()
        .unwrap_or_else(|| (0..producers.len() as u64).collect());
    let queue_config = QueueConfig::from_spec(&plan.queue, plan_seed(plan) ^ start.step);
    // Data-parallel workers step in lockstep, so the queue hands them rounds of one bucket (not under `fifo`:
    // see `Plan::drafters_take_rounds`).
    let queue = if plan.drafters_take_rounds() {
        HsQueue::with_rounds(queue_config, plan.drafter.placement.workers.len())?
    } else {
        HsQueue::new(queue_config)?
    };
    let shared = Arc::new(Shared::new(
        queue,
        BatchPool::for_plan(plan)?,
        interrupt,
        first_positions,
        start.state.step,
        (stream, start.vocab.clone(), acceptance),
    ));
    let drafters = plan.drafter.placement.workers.len();
    let telemetry = Arc::new(Telemetry::new(
        producers.len(),
        drafters,
        options.trace.is_some(),
    ));
    let step_limit = options.steps.or(plan.drafter.steps);
    let reporter = reporter(
        plan,
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
    let threads = Threads {
        plan,
        options,
        shared: &shared,
        telemetry: &telemetry,
        start: &start,
        step_limit,
    };
    let (stop, step, reporter) = threads.run(producers, gpus, communicators, reporter)?;
    finish((plan, options), &shared, reporter, (stop, step, step_limit))
}

/// What [`open_producers`] opens: the producers, the status line's probe, a stream's names and counts.
type OpenedProducers = (
    Vec<Producer>,
    Option<SourceStatusProbe>,
    Option<StreamStatus>,
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
    Ok((
        sources.into_iter().map(Producer::new).collect(),
        source_status,
        stream,
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
    // The status line counts the steps of this run, so a resumed run's total is what is left of the limit.
    config.total_steps = step_limit.map(|limit| limit.saturating_sub(first_step));
    config.run_dir = options.run_dir.clone();
    config.trace_path = options.trace.clone();
    config.source_status = source_status;
    config.acceptance_status =
        acceptance.map(|monitor| AcceptanceProbe::new(move || monitor.status()));
    Ok(Reporter::new(config, Arc::clone(telemetry), out)?)
}

/// What every thread of a run is started with.
struct Threads<'a> {
    plan: &'a Plan,
    options: &'a RunOptions,
    shared: &'a Arc<Shared>,
    telemetry: &'a Arc<Telemetry>,
    start: &'a Start,
    step_limit: Option<u64>,
}

impl Threads<'_> {
    /// Runs the producers, the drafters and the telemetry until the drafters stop, then stops the others;
    /// returns the stop reason, the last step and the reporter (none when the telemetry thread failed).
    fn run<W: Write + Send>(
        &self,
        producers: Vec<Producer>,
        gpus: Option<Vec<usize>>,
        communicators: Vec<GradientAllReduce>,
        reporter: Reporter<W>,
    ) -> Result<(StopReason, u64, Option<Reporter<W>>), RunError> {
        let producer_recorders = (0..producers.len())
            .map(|worker| self.telemetry.producer(worker))
            .collect::<Result<Vec<_>, _>>()?;
        let drafters = self.plan.drafter.placement.workers.len();
        let drafter_recorders = (0..drafters)
            .map(|worker| self.telemetry.drafter(worker))
            .collect::<Result<Vec<_>, _>>()?;
        let shared = self.shared;
        let reporter_stop = AtomicBool::new(false);
        let spawner = spawn::Spawner::new(self.options.fail_spawn_after);
        Ok(std::thread::scope(|scope| {
            // A thread that cannot start fails the run and is released as if it had finished at once: an
            // unstarted producer counts as finished (the queue closes when the others are done), an unstarted
            // drafter leaves the groups, so the threads already running stop instead of waiting for it forever.
            let spawner = &spawner;
            let producer_handles: Vec<_> = producers
                .into_iter()
                .zip(producer_recorders)
                .enumerate()
                .filter_map(|(worker, (producer, recorder))| {
                    let thread_shared = Arc::clone(shared);
                    let keep_going = self.options.keep_going;
                    let max_rate = self.plan.target.max_rate;
                    let handle = spawned(
                        shared,
                        spawner.spawn(scope, format!("producer-{worker}"), move || {
                            let shared = thread_shared;
                            let _release = OnPanic(|| {
                                shared.fail(RunError::Panicked(format!("producer {worker}")));
                                shared.producer_finished();
                            });
                            producer::run(
                                worker, producer, &shared, &recorder, keep_going, max_rate,
                            )
                        }),
                    );
                    if handle.is_none() {
                        shared.producer_finished();
                    }
                    handle
                })
                .collect();
            let drafter_handles =
                self.spawn_drafters(scope, spawner, drafter_recorders, gpus, communicators);
            let telemetry_thread = {
                let reporter_stop = &reporter_stop;
                let mut reporter = reporter;
                spawned(
                    shared,
                    spawner.spawn(scope, "telemetry".into(), move || {
                        // A reporter that cannot write (say, stdout closed) stops the run rather than leaving
                        // it to train unobserved; the workers see the failure at their next step.
                        match reporter.run(reporter_stop, || queue_snapshot(shared)) {
                            Ok(()) => Some(reporter),
                            Err(error) => {
                                shared.fail(RunError::Telemetry(error));
                                None
                            }
                        }
                    }),
                )
            };

            // Panics were turned into the run's fatal error by the workers' guards; joining every thread
            // before acting on any result keeps one failure from leaving the others running.
            let finished: Vec<worker::Finished> = drafter_handles
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
            let step = finished
                .iter()
                .map(|f| f.step)
                .max()
                .unwrap_or(self.start.step);
            (stop, step, reporter)
        }))
    }

    /// One thread per drafter worker, each running the one worker loop on its backend: a GPU with its NCCL
    /// communicator, or the CPU with the host all-reduce of the gradients when synced.
    fn spawn_drafters<'scope>(
        &'scope self,
        scope: &'scope std::thread::Scope<'scope, '_>,
        spawner: &spawn::Spawner,
        recorders: Vec<DrafterRecorder>,
        gpus: Option<Vec<usize>>,
        communicators: Vec<GradientAllReduce>,
    ) -> Vec<std::thread::ScopedJoinHandle<'scope, worker::Finished>> {
        let plan = self.plan;
        let drafters = recorders.len();
        let synced = plan.drafter.sync == SyncMode::AllReduce;
        let round = Arc::new(AllReduce::new(drafters, worker::round_len(drafters)));
        let gradients = (synced && gpus.is_none())
            .then(|| Arc::new(AllReduce::new(drafters, plan.model.parameters)));
        let mut communicators = communicators.into_iter();
        recorders
            .into_iter()
            .enumerate()
            .filter_map(|(worker, recorder)| {
                let ordinal = gpus.as_ref().map(|ordinals| ordinals[worker]);
                let context = worker::WorkerContext {
                    worker,
                    device: ordinal.map_or(Device::Cpu, |o| Device::Gpu(o as u32)),
                    plan,
                    options: self.options,
                    shared: Arc::clone(self.shared),
                    round: Arc::clone(&round),
                    recorder,
                    first_step: self.start.step,
                    step_limit: self.step_limit,
                    nonfinite_limit: self.options.max_nonfinite_in_row.max(1),
                };
                let start = self.start.state.clone();
                let frozen = (self.start.frozen.as_ref(), self.start.vocab.as_ref());
                let communicator = ordinal.and_then(|_| communicators.next());
                let (shared, round, gradients) = (
                    Arc::clone(self.shared),
                    Arc::clone(&round),
                    gradients.clone(),
                );
                let (unstarted_round, unstarted_gradients) =
                    (Arc::clone(&round), gradients.clone());
                let handle = spawned(
                    self.shared,
                    spawner.spawn(scope, format!("drafter-{worker}"), move || {
                        let leave = || {
                            round.leave(|| true);
                            if let Some(group) = &gradients {
                                group.leave(|| true);
                            }
                        };
                        let _release = OnPanic(|| {
                            shared.fail(RunError::Panicked(format!("drafter {worker}")));
                            leave();
                        });
                        let finished = match ordinal {
                            Some(ordinal) => {
                                if let Some(communicator) = &communicator {
                                    let nccl = communicator.group_abort();
                                    round.on_abort(move || {
                                        // The run already carries the error that aborted the group.
                                        let _ = nccl.abort();
                                    });
                                }
                                worker::run(context, start, |state| {
                                    devices::open_gpu(plan, ordinal, communicator, (state, frozen))
                                })
                            }
                            None => match HostThreads::new(
                                &format!("drafter-{worker}"),
                                HostThreads::drafter_threads(),
                            ) {
                                Ok(threads) => threads.run(|| {
                                    worker::run(context, start, |state| {
                                        devices::open_cpu(plan, gradients.clone(), (state, frozen))
                                    })
                                }),
                                Err(refused) => worker::run::<CpuBackend>(context, start, |_| {
                                    Err(DrafterError::Threads(refused))
                                }),
                            },
                        };
                        leave();
                        finished
                    }),
                );
                if handle.is_none() {
                    unstarted_round.leave(|| true);
                    if let Some(group) = &unstarted_gradients {
                        group.leave(|| true);
                    }
                }
                handle
            })
            .collect()
    }
}

/// The run's outcome once every thread has stopped: its first fatal error (with where a last good state was
/// saved), or the summary with how the run ended, and the diagnosis.
fn finish<W: Write + Send>(
    (plan, options): (&Plan, &RunOptions),
    shared: &Shared,
    reporter: Option<Reporter<W>>,
    (stop, step, step_limit): (StopReason, u64, Option<u64>),
) -> Result<RunOutcome, RunError> {
    // The last check ends (or is killed) before the final status line, which then shows it.
    let acceptance = shared
        .acceptance
        .as_ref()
        .map(|monitor| monitor.finish(&shared.interrupt));
    let summary = reporter.map(|reporter| reporter.finish(&queue_snapshot(shared)));
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
        shared,
        stop,
        step,
        step_limit,
        summary.as_ref(),
        fatal.as_ref(),
        &producer_errors,
    );
    let nothing_trained = ending.reason == crate::telemetry::EndReason::NothingTrained;
    if let Some(summary) = summary.as_mut()
        && let Err(error) = ending::record(summary, (ending, acceptance), options)
    {
        fatal.get_or_insert(error);
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
