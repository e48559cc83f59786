//! One drafter thread, on any backend: the worker loop, written once.
//!
//! ```text
//!  pop ─▶ stage (checks, copy into an input slot; position consumed) ─▶ buffer back to the pool
//!      ─▶ round (synced workers: all staged? stop after this step? trained positions recorded)
//!      ─▶ step(): run/launch this batch's step, read back the step now complete ─▶ telemetry, non-finite count
//!      ─▶ checkpoint (worker 0): finish, download, save with the last round's positions
//! ```
//!
//! On the CPU a step's outcome is ready when `step` returns; on CUDA it lags one step (the host never waits for
//! the step it has just launched), and [`Drafter::finish`] collects the last one before a checkpoint and at the
//! end. Either way the loop accounts each outcome once, when it arrives.
//!
//! Data-parallel workers (`sync = allreduce`) average their gradients inside the step (the host all-reduce on
//! the CPU, NCCL on CUDA). A collective waits until every rank has entered it, so no worker may start a step
//! that another will not: every step begins with a round of the host [`AllReduce`] over a single number, 0 from
//! a worker holding a staged batch and 1 from one without (out of data); the step runs only when the mean is 0
//! over all workers. A worker that leaves (after an error, or when it stops) makes the next round short, which
//! stops the others before they start. The round also carries the shared decision to stop after this step, and
//! marks the data positions staged so far as the ones the step's update contains: the one checkpoint rule.
//! Without `sync = allreduce` the workers are independent and skip the round.
//!
//! Synced workers pull *rounds* from the queue ([`HsQueue::pop_round_unless`]): one bucket per round, one
//! batch of it per worker, so every replica of a step has the same padded length and none waits in the
//! all-reduce for a longer bucket. A worker waiting for its round's batch is waiting on the queue (its data
//! wait). The readiness round also carries each worker's padded length, and worker 0 counts a stepped round
//! whose replicas' lengths differ (`mixed_rounds` in the summary: never, while the queue hands out rounds).
//!
//! [`HsQueue::pop_round_unless`]: crate::queue::HsQueue::pop_round_unless

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use draftpipe_compiler::plan::{Device, Plan, SyncMode};

use super::save::{export_options, save};
use crate::allreduce::AllReduce;
use crate::backend::Backend;
use crate::checkpoint::write_export;
use crate::drafter::{Drafter, DrafterError, StepOutcome};
use crate::params::FlatState;
use crate::telemetry::{DrafterPhase, DrafterRecorder, StepTokens, Taus};

use super::error::RunError;
use super::options::{RunOptions, StopReason};
use super::shared::Shared;

/// How often a drafter waiting for data looks at the stop flags: a signal only raises the interrupt flag, and
/// nothing else would wake a pop parked below `min_ready` (a stream whose producers are idle or not connected).
const STOP_POLL: Duration = Duration::from_millis(50);

/// Length of the readiness round of `workers` workers: the readiness number, then one padded length per worker.
pub(super) fn round_len(workers: usize) -> usize {
    1 + workers
}

/// What a readiness round tells every worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct RoundView {
    /// Every worker holds a staged batch and is still in the group: step.
    pub(super) launch: bool,
    /// The shared decision to stop after this step.
    pub(super) stop: bool,
    /// Every worker's batch has the same padded length (meaningful when `launch`).
    pub(super) same_bucket: bool,
}

/// What a drafter thread starts with.
pub(super) struct WorkerContext<'a> {
    pub(super) worker: usize,
    pub(super) device: Device,
    pub(super) plan: &'a Plan,
    pub(super) options: &'a RunOptions,
    pub(super) shared: Arc<Shared>,
    /// The readiness round before each step (synced workers).
    pub(super) round: Arc<AllReduce>,
    pub(super) recorder: DrafterRecorder,
    pub(super) first_step: u64,
    pub(super) step_limit: Option<u64>,
    pub(super) nonfinite_limit: u32,
}

/// How a drafter thread ended.
pub(super) struct Finished {
    pub(super) stop: StopReason,
    pub(super) step: u64,
}

/// One round of `workers` data-parallel workers before a step (see the module docs): whether all of them hold
/// a staged batch and are still in the group, so that each may start the step, the shared decision to stop
/// after it (`decide`, evaluated once per round by whichever worker completes it), and whether their batches'
/// padded lengths agree. `worker` says which slot of `buffer` (of [`round_len`]) carries this worker's
/// `staged` padded length (`None`: no batch).
pub(super) fn launch_round(
    group: &AllReduce,
    (workers, worker): (usize, usize),
    buffer: &mut [f32],
    staged: Option<usize>,
    decide: impl FnOnce() -> bool,
) -> RoundView {
    buffer.fill(0.0);
    match staged {
        Some(padded_len) => buffer[1 + worker] = padded_len as f32,
        None => buffer[0] = 1.0,
    }
    let outcome = group.mean(buffer, decide);
    // A mean over all workers of one non-zero slot each: the slot times `workers` is that worker's length
    // (exact after rounding for any length below 2^24).
    let length = |mean: f32| (mean * workers as f32).round();
    let first = length(buffer[1]);
    RoundView {
        launch: outcome.participants == workers && buffer[0] == 0.0,
        stop: outcome.stop,
        same_bucket: buffer[1..].iter().all(|&mean| length(mean) == first),
    }
}

/// Trains with the drafter `open` builds on the starting replica `start` until the step limit, the end of the
/// data, an interrupt or a fault; worker 0 checkpoints. `start` is dropped once uploaded: the drafter's buffers
/// hold the state, and a checkpoint downloads it into a fresh host copy, so no second copy lives between saves.
pub(super) fn run<B: Backend>(
    context: WorkerContext<'_>,
    start: FlatState,
    open: impl FnOnce(&FlatState) -> Result<Drafter<B>, DrafterError>,
) -> Finished {
    let opened = open(&start).map(|mut drafter| {
        drafter.seed_sampler(context.options.init_seed, context.first_step);
        drafter.set_schedule_total(context.plan.drafter.steps.unwrap_or(0));
        drafter
    });
    drop(start);
    match opened {
        Ok(drafter) => Worker::new(context, drafter).run(),
        Err(source) => {
            context.shared.fail(RunError::Step {
                worker: context.worker,
                device: context.device,
                source,
            });
            abort_or_leave(&context);
            Finished {
                stop: StopReason::Interrupted,
                step: context.first_step,
            }
        }
    }
}

/// Takes a failed worker out of the round. A GPU worker aborts the group: its peers may already wait inside an
/// NCCL collective this rank will never join, and the abort hooks end those communicators. A CPU worker leaves,
/// which completes a round the others wait in.
fn abort_or_leave(context: &WorkerContext<'_>) {
    // A group short of a member cannot step together: the others take no more rounds from the queue.
    context.shared.queue.leave_rounds();
    if matches!(context.device, Device::Gpu(_)) && context.plan.drafter.sync == SyncMode::AllReduce
    {
        context.round.abort();
    } else {
        context.round.leave(|| true);
    }
}

/// One worker's training loop and its bookkeeping.
struct Worker<'a, B: Backend> {
    context: WorkerContext<'a>,
    drafter: Drafter<B>,
    synced: bool,
    saves: bool,
    step: u64,
    nonfinite_in_row: u32,
    /// Start of the next host phase.
    since: Instant,
    /// End of the latest span recorded on this worker's timeline (see [`Self::record`]).
    recorded_until: Instant,
    /// The token counts of the batches staged and stepped whose outcomes have not arrived, oldest first: on
    /// CUDA an outcome arrives a step late, and outcomes arrive in step order.
    pending_tokens: VecDeque<StepTokens>,
    /// The readiness round's buffer (synced workers), kept so a step allocates nothing.
    round_buffer: Vec<f32>,
}

impl<'a, B: Backend> Worker<'a, B> {
    fn new(context: WorkerContext<'a>, drafter: Drafter<B>) -> Self {
        let plan = context.plan;
        Self {
            synced: plan.drafter.sync == SyncMode::AllReduce,
            saves: context.worker == 0 && context.options.save_dir.is_some(),
            step: context.first_step,
            nonfinite_in_row: 0,
            since: Instant::now(),
            recorded_until: Instant::now(),
            pending_tokens: VecDeque::with_capacity(2),
            round_buffer: vec![0.0; round_len(plan.drafter.placement.workers.len())],
            context,
            drafter,
        }
    }

    fn limit_reached(&self, step: u64) -> bool {
        self.context.step_limit.is_some_and(|limit| step >= limit)
    }

    fn fail(&self, source: DrafterError) {
        self.context.shared.fail(RunError::Step {
            worker: self.context.worker,
            device: self.context.device,
            source,
        });
    }

    fn run(mut self) -> Finished {
        let stop = match self.train() {
            Ok(stop) => {
                // Leaving shortens the others' next round so they stop before a step, and ends the queue's
                // rounds, so they take no batch they could not train.
                self.context.shared.queue.leave_rounds();
                self.context.round.leave(|| true);
                stop
            }
            Err(source) => {
                self.fail(source);
                abort_or_leave(&self.context);
                StopReason::Interrupted
            }
        };
        if let Err(source) = self.collect_last() {
            self.fail(source);
        }
        if self.saves {
            // The final save, or the last good state after an error that left the weights valid
            // (`ending::save_at_end` decides; nothing when no step was applied).
            match self.replica() {
                Ok((state, positions)) => {
                    let context = &self.context;
                    super::ending::save_at_end(
                        context.plan,
                        context.options,
                        &context.shared,
                        &state,
                        self.step,
                        positions,
                    );
                }
                Err(source) => self.fail(source),
            }
        }
        Finished {
            stop,
            step: self.step,
        }
    }

    /// Records `start..end` as `phase`, less any part already recorded. On CUDA the host's data wait, staging
    /// and round overlap the step in flight on the device (the overlap staging exists for); clipping keeps the
    /// worker's phases within its wall time, so busy and wait percentages mean the same on every backend.
    fn record(&mut self, phase: DrafterPhase, start: Instant, end: Instant) {
        let start = start.max(self.recorded_until);
        if end > start {
            self.context.recorder.record(phase, start, end);
            self.recorded_until = end;
        }
    }

    /// Records the host's time since the previous phase as `phase`.
    fn lap(&mut self, phase: DrafterPhase) {
        let now = Instant::now();
        self.record(phase, self.since, now);
        self.since = now;
    }

    fn train(&mut self) -> Result<StopReason, DrafterError> {
        loop {
            if self.limit_reached(self.step) {
                return Ok(StopReason::StepLimit);
            }
            if !self.synced && self.context.shared.should_stop() {
                return Ok(StopReason::Interrupted);
            }
            self.context.recorder.waiting(self.since);
            let shared = &self.context.shared;
            let stop = || shared.should_stop();
            let batch = if shared.queue.round_members().is_some() {
                shared
                    .queue
                    .pop_round_unless(self.context.worker, stop, STOP_POLL)
                    .map(|round| round.item)
                    .ok()
            } else {
                shared.queue.pop_unless(stop, STOP_POLL).ok()
            };
            self.lap(DrafterPhase::DataWait);
            let padded_len = batch.as_ref().map(|batch| batch.padded_len);
            let staged = match batch {
                Some(batch) => {
                    self.context.recorder.begin_step(batch.padded_len);
                    let staged = self.drafter.stage(&batch);
                    if staged.is_ok() {
                        self.context.shared.consume(batch.source_position);
                        self.pending_tokens.push_back(StepTokens::of(&batch));
                    }
                    if let Err(error) = self.context.shared.pool.give_back(batch) {
                        self.context.shared.fail(RunError::Source(error));
                    }
                    staged?;
                    true
                }
                None => false,
            };
            self.lap(DrafterPhase::Copy);
            let (all_ready, stop_after) = self.round(padded_len.filter(|_| staged));
            if self.synced {
                self.lap(DrafterPhase::AllReduce);
            }
            if !(staged && all_ready) {
                return Ok(StopReason::SourcesExhausted);
            }
            let started = Instant::now();
            let outcome = self.drafter.step()?;
            let now = Instant::now();
            if let Some(outcome) = outcome {
                self.account(outcome, started, now);
            }
            self.since = now;
            self.step += 1;

            if self.saves
                && !stop_after
                && self
                    .context
                    .options
                    .save_every
                    .is_some_and(|every| every > 0 && self.step.is_multiple_of(every))
            {
                self.checkpoint()?;
                self.lap(DrafterPhase::Other);
            }
            if self.context.worker == 0 && !self.context.shared.should_stop() {
                self.acceptance_check()?;
            }
            if stop_after || self.context.shared.fatal_raised.load(Ordering::Acquire) {
                return Ok(if self.limit_reached(self.step) {
                    StopReason::StepLimit
                } else {
                    StopReason::Interrupted
                });
            }
        }
    }

    /// Whether to step (every worker holds a staged batch, of padded length `staged`) and whether to stop after
    /// this step.
    fn round(&mut self, staged: Option<usize>) -> (bool, bool) {
        let mut buffer = std::mem::take(&mut self.round_buffer);
        let shared = &self.context.shared;
        let stop_after = || self.limit_reached(self.step + 1) || shared.should_stop();
        if self.synced {
            let workers = self.context.plan.drafter.placement.workers.len();
            let view = launch_round(
                &self.context.round,
                (workers, self.context.worker),
                &mut buffer,
                staged,
                || {
                    shared.mark_trained();
                    stop_after()
                },
            );
            if view.launch && self.context.worker == 0 {
                shared.count_round(view.same_bucket);
            }
            self.round_buffer = buffer;
            (view.launch, view.stop)
        } else {
            (staged.is_some(), stop_after())
        }
    }

    /// Accounts a finished step whose outcome the host saw at `seen`, its call having begun at `started`. A
    /// synchronous backend reports host phase times, laid out from `started`; an asynchronous one the device
    /// time of the whole step (forward, loss, backward, all-reduce and AdamW), recorded as ending at `seen`
    /// since a launch queues behind the step in flight. Skips follow the device: AdamW skips exactly when the
    /// gradient norm is not finite.
    fn account(&mut self, outcome: StepOutcome, started: Instant, seen: Instant) {
        if let Some(phases) = outcome.phases {
            let mut at = started;
            for (phase, duration) in [
                (DrafterPhase::Forward, phases.compute.forward),
                (DrafterPhase::Loss, phases.compute.loss),
                (DrafterPhase::Backward, phases.compute.backward),
                (DrafterPhase::AllReduce, phases.all_reduce),
                (DrafterPhase::Optimizer, phases.optimizer),
            ] {
                self.record(phase, at, at + duration);
                at += duration;
            }
            self.record(DrafterPhase::Other, at, seen.max(at));
        } else if let Some(device_ms) = outcome.device_ms {
            let device_time = Duration::try_from_secs_f32(device_ms / 1e3).unwrap_or_default();
            let began = seen.checked_sub(device_time).unwrap_or(self.recorded_until);
            self.record(DrafterPhase::DeviceStep, began, seen);
        }
        // Every outcome is of a batch staged here, in order; were that ever broken, the step's slots still count
        // and no real token is claimed.
        let tokens = self.pending_tokens.pop_front().unwrap_or(StepTokens {
            slots: outcome.tokens,
            ..StepTokens::default()
        });
        let recorder = &self.context.recorder;
        if outcome.skipped() {
            recorder.step_skipped();
            self.nonfinite_in_row += 1;
            if self.nonfinite_in_row >= self.context.nonfinite_limit {
                self.context.shared.fail(RunError::NonFinite {
                    count: self.nonfinite_in_row,
                    step: self.context.first_step + outcome.index + 1,
                });
            }
        } else {
            if let Some(blocks) = &outcome.blocks {
                recorder.block_metrics(
                    Taus {
                        exact: f64::from(blocks.tau_exact),
                        simulated: f64::from(blocks.tau_simulated),
                    },
                    &blocks.slot_accuracy,
                );
            }
            recorder.grad_norm(f64::from(outcome.grad_norm));
            recorder.step_done(tokens, f64::from(outcome.loss));
            self.nonfinite_in_row = 0;
        }
    }

    /// Waits for the step in flight, if any, and accounts it.
    fn collect_last(&mut self) -> Result<(), DrafterError> {
        let started = Instant::now();
        if let Some(outcome) = self.drafter.finish()? {
            self.account(outcome, started, Instant::now());
        }
        Ok(())
    }

    /// The replica as it is after every step so far, and the data positions its weights contain: those of the
    /// last round when synced (another worker may already hold its next batch), else those consumed.
    fn replica(&mut self) -> Result<(FlatState, Vec<u64>), DrafterError> {
        self.collect_last()?;
        let mut state = FlatState::zeros(&self.context.plan.model);
        self.drafter.download_state(&mut state)?;
        let shared = &self.context.shared;
        let positions = if self.synced {
            shared.trained_positions()
        } else {
            shared.consumed_positions()
        };
        Ok((state, positions))
    }

    /// At a step the pipeline's `acceptance` check is due: exports the replica for it unless the previous
    /// check is still running (then the step is skipped); the check itself runs in the background.
    fn acceptance_check(&mut self) -> Result<(), DrafterError> {
        let Some(monitor) = self.context.shared.acceptance.clone() else {
            return Ok(());
        };
        if !monitor.due(self.step) || monitor.skip_if_busy(self.step) {
            return Ok(());
        }
        let (state, _) = self.replica()?;
        let context = &self.context;
        let export = export_options(context.plan, context.options, &context.shared);
        monitor.start(self.step, |dir| {
            write_export(
                dir,
                &context.plan.model,
                &state.params,
                (self.step, &context.plan.name),
                export,
            )
        });
        self.lap(DrafterPhase::Other);
        Ok(())
    }

    /// Writes a periodic checkpoint.
    fn checkpoint(&mut self) -> Result<(), DrafterError> {
        let (state, positions) = self.replica()?;
        let context = &self.context;
        save(
            context.plan,
            context.options,
            &context.shared,
            &state,
            self.step,
            positions,
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs one round for workers that hold a batch of this padded length or none (`Some(None)`), or have left
    /// the group (`None`); gives `(launch, stop, same_bucket)` per worker still in it.
    fn round(members: &[Option<Option<usize>>]) -> Vec<(bool, bool, bool)> {
        let workers = members.len();
        let group = AllReduce::new(workers, round_len(workers));
        std::thread::scope(|scope| {
            let handles: Vec<_> = members
                .iter()
                .enumerate()
                .map(|(worker, member)| {
                    let group = &group;
                    scope.spawn(move || match member {
                        Some(staged) => {
                            let mut buffer = vec![0.0; round_len(workers)];
                            let view = launch_round(
                                group,
                                (workers, worker),
                                &mut buffer,
                                *staged,
                                || true,
                            );
                            Some((view.launch, view.stop, view.same_bucket))
                        }
                        None => {
                            group.leave(|| true);
                            None
                        }
                    })
                })
                .collect();
            handles
                .into_iter()
                .filter_map(|h| h.join().unwrap())
                .collect()
        })
    }

    #[test]
    fn a_step_needs_every_worker_ready_and_present() {
        assert_eq!(round(&[Some(Some(64)); 3]), vec![(true, true, true); 3]);
        let one_without = round(&[Some(Some(64)), Some(None), Some(Some(64))]);
        assert!(one_without.iter().all(|&(launch, stop, _)| !launch && stop));
        let after_a_leave = round(&[Some(Some(64)), None, Some(Some(64))]);
        assert_eq!(after_a_leave.len(), 2);
        assert!(after_a_leave.iter().all(|&(launch, _, _)| !launch));
    }

    #[test]
    fn every_worker_sees_whether_the_rounds_buckets_agree() {
        // Lengths up to the largest bucket a plan allows stay exact through the mean.
        assert_eq!(
            round(&[Some(Some(65_536)), Some(Some(65_536)), Some(Some(65_536))]),
            vec![(true, true, true); 3]
        );
        assert_eq!(
            round(&[Some(Some(2048)), Some(Some(8192)), Some(Some(2048))]),
            vec![(true, true, false); 3]
        );
        assert_eq!(
            round(&[Some(Some(4096)), Some(Some(4095))]),
            vec![(true, true, false); 2]
        );
    }
}
