//! The threads of a run: one producer per target worker, one drafter per drafter worker (each the one worker loop
//! on its backend, with the all-reduce groups of its replicas) and the telemetry; started together, joined
//! together, and released as if finished when one cannot start, so no thread waits forever for another.

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use draftpipe_compiler::plan::{Device, Plan, SyncMode};

use crate::allreduce::AllReduce;
use crate::backend::cpu::{CpuBackend, HostThreads};
use crate::backend::cuda::GradientAllReduce;
use crate::drafter::DrafterError;
use crate::source::Producer;
use crate::telemetry::{DrafterRecorder, Reporter, Telemetry};

use super::error::RunError;
use super::options::{RunOptions, StopReason};
use super::shared::{OnPanic, Shared};
use super::start::Start;
use super::{devices, producer, spawn, worker};

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

/// What every thread of a run is started with.
pub(super) struct Threads<'a> {
    pub(super) plan: &'a Plan,
    pub(super) options: &'a RunOptions,
    pub(super) shared: &'a Arc<Shared>,
    pub(super) telemetry: &'a Arc<Telemetry>,
    pub(super) start: &'a Start,
    pub(super) step_limit: Option<u64>,
}

impl Threads<'_> {
    /// Runs the producers, the drafters and the telemetry until the drafters stop, then stops the others;
    /// returns the stop reason, the last step and the reporter (none when the telemetry thread failed).
    pub(super) fn run<W: Write + Send>(
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
                        match reporter.run(reporter_stop, || shared.queue_snapshot()) {
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
        // A lone CPU drafter's mean is its own gradient: a group of one would only copy every gradient three
        // times a step (into the round's sum, the result, and back), 7 ms a step at 7 M parameters.
        let gradients = (synced && gpus.is_none() && drafters > 1)
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
