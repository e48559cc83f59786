//! One drafter thread on a GPU: the CPU worker's loop (`drafter.rs`) driven through [`CudaDrafter`].
//!
//! ```text
//!  pop ─▶ stage (pinned copy, async H2D) ─▶ buffer back to the pool ─▶ host round (all ready? stop after?)
//!      ─▶ step(): launch this batch's step, read the previous step's outcome ─▶ telemetry, non-finite count
//!      ─▶ checkpoint (worker 0): finish, download, the CPU path's `save`
//! ```
//!
//! Outcomes lag one step (the host never waits for the step it has just launched), so a step's loss, skip and
//! device time are accounted one iteration later, and [`CudaDrafter::finish`] collects the last one before a
//! checkpoint and at the end.
//!
//! Data-parallel workers average their gradients with NCCL inside the step. An NCCL collective waits until
//! every rank has launched it, so no worker may launch a step that another will not: the CPU path's answer,
//! [`AllReduce::leave`] and carrying on with fewer members, would hang the others' NCCL call. So every step
//! begins with a round of the host [`AllReduce`] over a single number, 0 from a worker holding a staged batch
//! and 1 from one without (out of data): the step is launched only when the mean is 0 over all workers. A
//! worker that leaves (after an error, or when it stops) makes the next round short, which stops the others
//! before they launch. The round also carries the shared decision to stop after this step, as on the CPU.
//! Without `sync = allreduce` the workers are independent and skip the round.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use draftpipe_compiler::plan::{Device, Plan, SyncMode};

use crate::allreduce::AllReduce;
use crate::cuda::{
    CudaDrafter, CudaError, GradientAllReduce, StepOutcome, embedded_ptx, open_device,
};
use crate::params::FlatState;
use crate::telemetry::{DrafterPhase, DrafterRecorder};

use super::drafter::{DrafterContext, Finished, save};
use super::{RunError, RunOptions, Shared, StopReason};

/// Length of the GPU workers' host [`AllReduce`] group: the readiness number (gradients go through NCCL).
pub(super) const ROUND_LEN: usize = 1;

/// The device one GPU drafter thread trains on.
pub(super) struct GpuDevice {
    pub(super) ordinal: usize,
    /// This worker's NCCL communicator, when the workers average gradients.
    pub(super) all_reduce: Option<GradientAllReduce>,
}

/// The drafter workers' GPU ordinals, or `None` when the drafter stage runs on the CPU.
pub(super) fn ordinals(plan: &Plan) -> Result<Option<Vec<usize>>, RunError> {
    let workers = &plan.drafter.placement.workers;
    let gpus: Vec<usize> = workers
        .iter()
        .filter_map(|device| match device {
            Device::Gpu(ordinal) => Some(*ordinal as usize),
            Device::Cpu => None,
        })
        .collect();
    if gpus.is_empty() {
        Ok(None)
    } else if gpus.len() == workers.len() {
        Ok(Some(gpus))
    } else {
        Err(RunError::Unsupported(format!(
            "drafter stage `{}` mixes cpu and gpu workers; place it on cpus or on gpus only",
            plan.drafter.name
        )))
    }
}

/// Checks, before any thread starts, that every device opens and the kernels are built in, then creates one
/// NCCL communicator per worker when they average gradients (none otherwise).
pub(super) fn prepare(plan: &Plan, ordinals: &[usize]) -> Result<Vec<GradientAllReduce>, RunError> {
    let unavailable = |source| RunError::Gpu {
        stage: plan.drafter.name.clone(),
        devices: ordinals
            .iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join(", "),
        source,
    };
    for &ordinal in ordinals {
        open_device(ordinal).map_err(unavailable)?;
    }
    embedded_ptx().map_err(unavailable)?;
    if plan.drafter.sync == SyncMode::AllReduce && ordinals.len() > 1 {
        GradientAllReduce::for_devices(ordinals).map_err(unavailable)
    } else {
        Ok(Vec::new())
    }
}

/// One host round of `workers` data-parallel GPU workers before a launch (see the module docs): whether all
/// of them hold a staged batch and are still in the group, so that each may launch, and the shared decision to
/// stop after this step (`stop_after`, evaluated once per round).
fn launch_round(
    group: &AllReduce,
    workers: usize,
    staged: bool,
    stop_after: impl FnOnce() -> bool,
) -> (bool, bool) {
    let mut missing = [if staged { 0.0 } else { 1.0 }];
    let outcome = group.mean(&mut missing, stop_after);
    (
        outcome.participants == workers && missing[0] == 0.0,
        outcome.stop,
    )
}

/// Trains on `device` until the step limit, the end of the data, an interrupt or a fault; worker 0
/// checkpoints. The same contract as the CPU worker's `run`.
pub(super) fn run(context: DrafterContext<'_>, device: GpuDevice) -> Finished {
    let ordinal = device.ordinal;
    match open(&context, device) {
        Ok(drafter) => Training::new(context, drafter, ordinal).run(),
        Err(source) => {
            context.shared.fail(RunError::GpuStep {
                worker: context.worker,
                ordinal,
                source,
            });
            if context.plan.drafter.sync == SyncMode::AllReduce {
                // The others may already wait in a collective this rank will never join.
                context.group.abort();
            }
            Finished {
                stop: StopReason::Interrupted,
                step: context.first_step,
            }
        }
    }
}

/// The drafter on `device`, with its communicator attached and the starting state uploaded.
fn open(context: &DrafterContext<'_>, device: GpuDevice) -> Result<CudaDrafter, CudaError> {
    let stage = &context.plan.drafter;
    let mut drafter = CudaDrafter::new(
        device.ordinal,
        &context.plan.model,
        stage.loss,
        stage.optimizer,
        &context.plan.buckets,
        stage.launch,
    )?;
    if let Some(all_reduce) = device.all_reduce {
        let group = all_reduce.group_abort();
        context.group.on_abort(move || {
            // Nothing is left to report to: the run already carries the error that aborted the group.
            let _ = group.abort();
        });
        drafter.attach_all_reduce(all_reduce)?;
    }
    drafter.upload_state(&context.state)?;
    Ok(drafter)
}

/// One GPU worker's training loop and its bookkeeping.
struct Training<'a> {
    worker: usize,
    ordinal: usize,
    plan: &'a Plan,
    options: &'a RunOptions,
    shared: Arc<Shared>,
    group: Arc<AllReduce>,
    recorder: DrafterRecorder,
    /// The host copy of the replica: the starting state, then the target of checkpoint downloads.
    state: FlatState,
    drafter: CudaDrafter,
    synced: bool,
    saves: bool,
    first_step: u64,
    step: u64,
    step_limit: Option<u64>,
    nonfinite_limit: u32,
    nonfinite_in_row: u32,
    /// Tokens of the launched step whose outcome has not been read yet.
    in_flight: Option<u64>,
    /// Start of the next host phase.
    since: Instant,
    /// End of the latest span recorded on this worker's timeline (see [`Self::record`]).
    recorded_until: Instant,
}

impl<'a> Training<'a> {
    fn new(context: DrafterContext<'a>, drafter: CudaDrafter, ordinal: usize) -> Self {
        let DrafterContext {
            worker,
            plan,
            options,
            shared,
            group,
            recorder,
            state,
            first_step,
            step_limit,
            nonfinite_limit,
        } = context;
        Self {
            worker,
            ordinal,
            plan,
            options,
            shared,
            group,
            recorder,
            state,
            drafter,
            synced: plan.drafter.sync == SyncMode::AllReduce,
            saves: worker == 0 && options.save_dir.is_some(),
            first_step,
            step: first_step,
            step_limit,
            nonfinite_limit,
            nonfinite_in_row: 0,
            in_flight: None,
            since: Instant::now(),
            recorded_until: Instant::now(),
        }
    }

    fn limit_reached(&self, step: u64) -> bool {
        self.step_limit.is_some_and(|limit| step >= limit)
    }

    fn fail(&self, source: CudaError) {
        self.shared.fail(RunError::GpuStep {
            worker: self.worker,
            ordinal: self.ordinal,
            source,
        });
    }

    fn run(mut self) -> Finished {
        let stop = match self.train() {
            Ok(stop) => {
                if self.synced {
                    // Leaving shortens the others' next round so they stop before launching.
                    self.group.leave(|| true);
                }
                stop
            }
            Err(source) => {
                self.fail(source);
                if self.synced {
                    // A failed rank aborts the group: the others' NCCL collectives end instead of waiting for it.
                    self.group.abort();
                }
                StopReason::Interrupted
            }
        };
        if let Err(source) = self.collect_last() {
            self.fail(source);
        }
        if self.saves
            && !self.shared.fatal_raised.load(Ordering::Acquire)
            && self.step > self.first_step
            && let Err(source) = self.checkpoint()
        {
            self.fail(source);
        }
        Finished {
            stop,
            step: self.step,
        }
    }

    /// Records `start..end` as `phase`, less any part already recorded. The host's data wait, staging and
    /// round overlap the step in flight on the device (the overlap staging exists for); clipping keeps this
    /// worker's phases within its wall time, so busy and wait percentages mean what they mean for the CPU.
    fn record(&mut self, phase: DrafterPhase, start: Instant, end: Instant) {
        let start = start.max(self.recorded_until);
        if end > start {
            self.recorder.record(phase, start, end);
            self.recorded_until = end;
        }
    }

    /// Records the host's time since the previous phase as `phase`.
    fn lap(&mut self, phase: DrafterPhase) {
        let now = Instant::now();
        self.record(phase, self.since, now);
        self.since = now;
    }

    /// The loop. The host time inside `step()` is not recorded as a phase of its own: it is the launch (a few
    /// µs) and the wait for the previous step, whose device time [`Self::account`] records from its events.
    fn train(&mut self) -> Result<StopReason, CudaError> {
        loop {
            if self.limit_reached(self.step) {
                return Ok(StopReason::StepLimit);
            }
            if !self.synced && self.shared.should_stop() {
                return Ok(StopReason::Interrupted);
            }
            self.recorder.waiting(self.since);
            let batch = self.shared.queue.pop();
            self.lap(DrafterPhase::DataWait);
            let staged = match batch {
                Some(batch) => {
                    self.recorder.begin_step(batch.padded_len);
                    let staged = self.drafter.stage(&batch);
                    let taken = (batch.tokens() as u64, batch.source_position);
                    if let Err(error) = self.shared.pool.give_back(batch) {
                        self.shared.fail(RunError::Source(error));
                    }
                    staged?;
                    Some(taken)
                }
                None => None,
            };
            self.lap(DrafterPhase::Copy);
            let (all_ready, stop_after) = self.round(staged.is_some());
            if self.synced {
                self.lap(DrafterPhase::AllReduce);
            }
            let Some((tokens, source_position)) = staged.filter(|_| all_ready) else {
                return Ok(StopReason::SourcesExhausted);
            };
            self.shared.consume(source_position);
            let outcome = self.drafter.step()?;
            self.since = Instant::now();
            if let Some(done) = outcome.zip(self.in_flight.replace(tokens)) {
                self.account(done, self.since);
            }
            self.step += 1;

            if self.saves
                && !stop_after
                && self
                    .options
                    .save_every
                    .is_some_and(|every| every > 0 && self.step.is_multiple_of(every))
            {
                self.checkpoint()?;
                self.lap(DrafterPhase::Other);
            }
            if stop_after || self.shared.fatal_raised.load(Ordering::Acquire) {
                return Ok(if self.limit_reached(self.step) {
                    StopReason::StepLimit
                } else {
                    StopReason::Interrupted
                });
            }
        }
    }

    /// Whether to launch (every worker holds a staged batch) and whether to stop after this step.
    fn round(&self, staged: bool) -> (bool, bool) {
        let stop_after = || self.limit_reached(self.step + 1) || self.shared.should_stop();
        if self.synced {
            let workers = self.plan.drafter.placement.workers.len();
            launch_round(&self.group, workers, staged, stop_after)
        } else {
            (staged, stop_after())
        }
    }

    /// Accounts a finished step whose completion the host saw at `seen`. Its device time (CUDA events) is
    /// recorded as ending there, not as starting at the launch: a launch queues behind the step in flight, so
    /// the launch instant says little about when the device began. The span is recorded as
    /// [`DrafterPhase::DeviceStep`]: the events bracket the whole step (forward, loss, backward, NCCL all-reduce
    /// and AdamW in one graph), so a GPU drafter's busy time is measured but its split into those phases is not.
    /// Skips follow the device: AdamW skips exactly when the
    /// gradient norm is not finite.
    fn account(&mut self, (outcome, tokens): (StepOutcome, u64), seen: Instant) {
        let device_time = Duration::try_from_secs_f32(outcome.device_ms / 1e3).unwrap_or_default();
        let began = seen.checked_sub(device_time).unwrap_or(self.recorded_until);
        self.record(DrafterPhase::DeviceStep, began, seen);
        if outcome.grad_norm.is_finite() {
            self.recorder.step_done(tokens, f64::from(outcome.loss));
            self.nonfinite_in_row = 0;
        } else {
            self.recorder.step_skipped();
            self.nonfinite_in_row += 1;
            if self.nonfinite_in_row >= self.nonfinite_limit {
                self.shared.fail(RunError::NonFinite {
                    count: self.nonfinite_in_row,
                    step: self.first_step + outcome.index + 1,
                });
            }
        }
    }

    /// Waits for the step in flight, if any, and accounts it.
    fn collect_last(&mut self) -> Result<(), CudaError> {
        if let Some(done) = self.drafter.finish()?.zip(self.in_flight.take()) {
            self.account(done, Instant::now());
        }
        Ok(())
    }

    /// Writes the replica as it is after every launched step.
    fn checkpoint(&mut self) -> Result<(), CudaError> {
        self.collect_last()?;
        self.drafter.download_state(&mut self.state)?;
        save(
            self.plan,
            self.options,
            &self.shared,
            &self.state,
            self.step,
            self.shared.consumed_positions(),
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use draftpipe_compiler::compile_file;

    use super::*;

    fn plan(file: &str) -> Plan {
        compile_file(
            &Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../pipelines")
                .join(file),
        )
        .unwrap()
    }

    #[test]
    fn placements_choose_the_backend() {
        assert_eq!(ordinals(&plan("quickstart.pipe")).unwrap(), None);
        let mut dflash = plan("dflash-5x3.pipe");
        assert_eq!(ordinals(&dflash).unwrap(), Some(vec![5, 6, 7]));
        dflash.drafter.placement.workers[1] = Device::Cpu;
        let error = ordinals(&dflash).unwrap_err().to_string();
        assert!(error.contains("mixes cpu and gpu"), "{error}");
    }

    /// Runs one round for workers that hold a batch or not (`None`: the worker has left the group).
    fn round(members: &[Option<bool>]) -> Vec<(bool, bool)> {
        let group = AllReduce::new(members.len(), ROUND_LEN);
        std::thread::scope(|scope| {
            let handles: Vec<_> = members
                .iter()
                .map(|member| {
                    let group = &group;
                    scope.spawn(move || match member {
                        Some(staged) => Some(launch_round(group, members.len(), *staged, || true)),
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
    fn a_launch_needs_every_worker_ready_and_present() {
        assert_eq!(round(&[Some(true); 3]), vec![(true, true); 3]);
        assert_eq!(
            round(&[Some(true), Some(false), Some(true)]),
            vec![(false, true); 3]
        );
        let after_a_leave = round(&[Some(true), None, Some(true)]);
        assert_eq!(after_a_leave.len(), 2);
        assert!(after_a_leave.iter().all(|&(launch, _)| !launch));
    }
}
