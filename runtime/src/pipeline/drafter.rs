//! One drafter thread: pop a batch, train one step on its replica, average gradients, apply AdamW.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use draftpipe_compiler::plan::{Plan, SyncMode};

use crate::allreduce::AllReduce;
use crate::checkpoint::{TrainingState, save_checkpoint};
use crate::cpu::CpuDrafter;
use crate::params::FlatState;
use crate::telemetry::{DrafterPhase, DrafterRecorder};

use super::{RunError, RunOptions, Shared, StopReason};

/// What a drafter thread starts with.
pub(super) struct DrafterContext<'a> {
    pub(super) worker: usize,
    pub(super) plan: &'a Plan,
    pub(super) options: &'a RunOptions,
    pub(super) shared: Arc<Shared>,
    pub(super) group: Arc<AllReduce>,
    pub(super) recorder: DrafterRecorder,
    pub(super) state: FlatState,
    pub(super) first_step: u64,
    pub(super) step_limit: Option<u64>,
    pub(super) nonfinite_limit: u32,
}

/// How a drafter thread ended.
pub(super) struct Finished {
    pub(super) stop: StopReason,
    pub(super) step: u64,
}

/// Trains until the step limit, the end of the data, an interrupt or a fault; worker 0 checkpoints.
pub(super) fn run(context: DrafterContext<'_>) -> Finished {
    let DrafterContext {
        worker,
        plan,
        options,
        shared,
        group,
        recorder,
        mut state,
        first_step,
        step_limit,
        nonfinite_limit,
    } = context;
    let mut drafter = CpuDrafter::new(
        &plan.model,
        plan.drafter.loss,
        plan.drafter.optimizer,
        &plan.buckets,
    );
    let synced = plan.drafter.sync == SyncMode::AllReduce;
    let saves = worker == 0 && options.save_dir.is_some();
    let limit_reached = |step: u64| step_limit.is_some_and(|limit| step >= limit);
    // The decision of an all-reduce round at `step`, taken once by whichever worker completes it: by the last to
    // arrive in `mean`, or by a worker that leaves when the others are all waiting.
    let round_decision = |step: u64| {
        shared.mark_trained();
        limit_reached(step + 1) || shared.should_stop()
    };
    // Under all-reduce another worker may already hold its next batch when worker 0 saves; the positions of the
    // last round are the ones the saved weights contain.
    let positions = |shared: &Shared| {
        if synced {
            shared.trained_positions()
        } else {
            shared.consumed_positions()
        }
    };

    let mut step = first_step;
    let mut nonfinite_in_row = 0u32;
    let mut since = Instant::now();
    let stop = loop {
        if limit_reached(step) {
            break StopReason::StepLimit;
        }
        if !synced && shared.should_stop() {
            break StopReason::Interrupted;
        }
        recorder.waiting(since);
        let Some(batch) = shared.queue.pop() else {
            if synced {
                group.leave(|| round_decision(step));
            }
            break StopReason::SourcesExhausted;
        };
        recorder.lap(DrafterPhase::DataWait, &mut since);
        recorder.begin_step(batch.padded_len);
        shared.consume(batch.source_position);
        let output = drafter.forward_backward(&mut state, &batch);
        let tokens = batch.tokens() as u64;
        if let Err(error) = shared.pool.give_back(batch) {
            shared.fail(RunError::Source(error));
        }
        let output = match output {
            Ok(output) => output,
            Err(source) => {
                shared.fail(RunError::Step { worker, source });
                if synced {
                    group.leave(|| shared.should_stop());
                }
                break StopReason::Interrupted;
            }
        };
        let now = Instant::now();
        let mut phase_start = since;
        for (phase, duration) in [
            (DrafterPhase::Forward, output.times.forward),
            (DrafterPhase::Loss, output.times.loss),
            (DrafterPhase::Backward, output.times.backward),
        ] {
            recorder.record_duration(phase, phase_start, duration);
            phase_start += duration;
        }
        recorder.record(DrafterPhase::Other, phase_start, now.max(phase_start));
        since = now;

        if !output.loss.is_finite() {
            // A non-finite loss must skip the step on every replica alike; a NaN in the gradient survives the
            // average and makes every worker's optimizer skip the same step.
            state.grads[0] = f32::NAN;
        }
        let stop_after = if synced {
            let outcome = group.mean(&mut state.grads, || round_decision(step));
            recorder.lap(DrafterPhase::AllReduce, &mut since);
            outcome.stop
        } else {
            limit_reached(step + 1) || shared.should_stop()
        };
        let report = drafter.optimizer_step(&mut state);
        recorder.lap(DrafterPhase::Optimizer, &mut since);
        step += 1;

        if report.skipped {
            recorder.step_skipped();
            nonfinite_in_row += 1;
            if nonfinite_in_row >= nonfinite_limit {
                shared.fail(RunError::NonFinite {
                    count: nonfinite_in_row,
                    step,
                });
            }
        } else {
            recorder.step_done(tokens, f64::from(output.loss));
            nonfinite_in_row = 0;
        }
        if saves
            && !stop_after
            && options
                .save_every
                .is_some_and(|every| every > 0 && step % every == 0)
        {
            save(plan, options, &shared, &state, step, positions(&shared));
            recorder.lap(DrafterPhase::Other, &mut since);
        }
        if stop_after || shared.fatal_raised.load(Ordering::Acquire) {
            if synced && !limit_reached(step) {
                group.leave(|| shared.should_stop());
            }
            break if limit_reached(step) {
                StopReason::StepLimit
            } else {
                StopReason::Interrupted
            };
        }
    };
    if saves {
        super::ending::save_at_end(plan, options, &shared, &state, step, positions(&shared));
    }
    Finished { stop, step }
}

/// Writes worker 0's replica (every replica is identical under all-reduce) with the data positions of the
/// batches its weights contain. The GPU worker calls it too, on the state it downloads.
pub(super) fn save(
    plan: &Plan,
    options: &RunOptions,
    shared: &Shared,
    state: &FlatState,
    step: u64,
    data_positions: Vec<u64>,
) {
    let Some(dir) = &options.save_dir else { return };
    let training = TrainingState {
        step,
        optimizer_step: state.step,
        plan_name: plan.name.clone(),
        rng_state: vec![options.init_seed],
        data_positions,
    };
    if let Err(error) = save_checkpoint(
        dir,
        &plan.model,
        &state.params,
        &state.exp_avg,
        &state.exp_avg_sq,
        &training,
    ) {
        shared.fail(RunError::Checkpoint(error));
    }
}
