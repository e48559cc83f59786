//! The end of a run: the final checkpoint (the last good state when an error stopped the run and left the
//! weights valid), and the record of how the run ended that goes into the summary and the diagnosis.

use std::path::PathBuf;
use std::sync::PoisonError;
use std::sync::atomic::Ordering;

use draftpipe_compiler::plan::Plan;

use crate::checkpoint::{TrainingState, save_last_good_checkpoint};
use crate::drafter::DrafterError;
use crate::params::FlatState;
use crate::telemetry::{
    AcceptanceSummary, EndReason, RunEnding, RunSummary, SUMMARY_FILE, TelemetryFiles,
    UntrainedBucket, write_summary,
};

use super::error::RunError;
use super::options::{RunOptions, StopReason};
use super::save::save;
use super::shared::Shared;

/// The error text with its causes, on one line.
fn describe(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// True for errors after which the replica's weights are still the result of whole, finite steps: a data,
/// output or non-finite error stops the run between steps. A panic or a device fault may have left them half
/// updated.
fn leaves_weights_valid(error: &RunError) -> bool {
    !matches!(
        error,
        RunError::Panicked(_)
            | RunError::Step {
                source: DrafterError::Backend(_),
                ..
            }
    )
}

/// Worker 0's final save, called once by the drafter loop after it stops. Nothing is saved when the run applied
/// no step (every step skipped leaves the weights untrained, and a checkpoint of them would replace a good one).
/// After an error that left the weights valid, the state is saved as the last good one, marked so in
/// `state.json`; other errors save nothing.
pub(super) fn save_at_end(
    plan: &Plan,
    options: &RunOptions,
    shared: &Shared,
    state: &FlatState,
    step: u64,
    data_positions: Vec<u64>,
) {
    let Some(dir) = &options.save_dir else { return };
    if state.step == shared.end.first_optimizer_step {
        return;
    }
    if !shared.fatal_raised.load(Ordering::Acquire) {
        save(plan, options, shared, state, step, data_positions);
        return;
    }
    let stopped_by = {
        let fatal = shared.fatal.lock().unwrap_or_else(PoisonError::into_inner);
        match fatal.as_ref() {
            Some(error) if leaves_weights_valid(error) => describe(error),
            _ => return,
        }
    };
    let training = TrainingState {
        step,
        optimizer_step: state.step,
        plan_name: plan.name.clone(),
        rng_state: vec![options.init_seed],
        data_positions,
        stream_producers: shared.stream_producers(),
    };
    let saved = save_last_good_checkpoint(
        dir,
        &plan.model,
        [&state.params, &state.exp_avg, &state.exp_avg_sq],
        &training,
        &stopped_by,
        super::save::export_options(plan, options, shared),
    );
    if saved.is_ok() {
        *shared
            .end
            .saved_after_error
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some((step, dir.clone()));
    }
}

/// How the run ended, from the drafters' stop and the summary's counts: a run whose data ended before the step
/// limit, or before a first step when no limit was asked for, ended early (exit status 3), and what the data left
/// in the queue (batches too few to fill a lockstep round) is named per bucket.
pub(super) fn ending(
    plan: &Plan,
    shared: &Shared,
    (stop, step, step_limit): (StopReason, u64, Option<u64>),
    summary: Option<&RunSummary>,
    fatal: Option<&RunError>,
    producer_errors: &[String],
) -> RunEnding {
    let nothing_trained =
        summary.is_some_and(|s| s.skipped_nonfinite > 0 && s.drafters.iter().all(|d| d.steps == 0));
    let steps_this_run = summary.map_or(0, |s| s.steps);
    let reason = match (fatal, stop) {
        (Some(_), _) => EndReason::Error,
        _ if nothing_trained => EndReason::NothingTrained,
        (None, StopReason::Interrupted) => EndReason::Interrupted,
        (None, StopReason::StepLimit) => EndReason::StepLimit,
        (None, StopReason::SourcesExhausted) => match step_limit {
            Some(limit) if step < limit => EndReason::DataExhaustedEarly,
            None if steps_this_run == 0 => EndReason::DataExhaustedEarly,
            _ => EndReason::DataExhausted,
        },
    };
    // When the data ended, whatever is still queued was never handed out: under rounds, fewer batches of a
    // bucket than the group (see `queue::rounds`, "End of data").
    let untrained = if stop == StopReason::SourcesExhausted && fatal.is_none() {
        let queued = shared.queue_snapshot().per_bucket;
        plan.queue
            .buckets
            .iter()
            .zip(queued)
            .filter(|&(_, batches)| batches > 0)
            .map(|(&padded_len, batches)| UntrainedBucket {
                padded_len,
                batches,
            })
            .collect()
    } else {
        Vec::new()
    };
    let mut failed_producers = producer_errors.to_vec();
    if let Some(RunError::Producer { .. }) = fatal {
        failed_producers.extend(fatal.map(|e| describe(e)));
    }
    RunEnding {
        reason,
        step_limit,
        step,
        failed_producers,
        error: fatal.map(|e| describe(e)),
        saved_after_error: saved_after_error(shared)
            .map(|(step, dir)| (step, dir.display().to_string())),
        steps_this_run,
        round_members: plan
            .drafters_take_rounds()
            .then_some(plan.drafter.placement.workers.len()),
        untrained,
    }
}

/// The last good state saved after an error, if one was.
pub(super) fn saved_after_error(shared: &Shared) -> Option<(u64, PathBuf)> {
    shared
        .end
        .saved_after_error
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone()
}

/// Puts `ending` and the acceptance record into the summary and rewrites `summary.json` with them, through the
/// telemetry's `files` (a summary that cannot be written is a warning, once; the run's outcome stands).
pub(super) fn record(
    summary: &mut RunSummary,
    (ending, acceptance): (RunEnding, Option<AcceptanceSummary>),
    options: &RunOptions,
    files: &TelemetryFiles,
) {
    summary.ending = Some(ending);
    summary.acceptance = acceptance;
    if let Some(dir) = &options.run_dir {
        files.write(&dir.join(SUMMARY_FILE), || {
            write_summary(dir, summary).map(drop)
        });
    }
}

/// The run's error, wrapped with where its last good state was saved (when it was).
pub(super) fn with_saved_state(error: RunError, shared: &Shared) -> RunError {
    match saved_after_error(shared) {
        Some((step, dir)) => RunError::StoppedAfterSave {
            step,
            dir,
            source: Box::new(error),
        },
        None => error,
    }
}
