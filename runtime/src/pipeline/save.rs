//! The worker's save: what a save of the plan writes and where (worker 0's replica with the data positions its
//! weights contain). Used by the worker loop at `--save-every` and by the run's ending, so it sits below both.

use draftpipe_compiler::plan::Plan;

use crate::checkpoint::{ExportOptions, TrainingState, save_checkpoint_as};
use crate::params::FlatState;

use super::error::RunError;
use super::options::RunOptions;
use super::shared::Shared;

/// What a save of `plan` writes beside the buffers: the `--save-dtype`, the target's depth and the run's draft
/// vocabulary.
pub(super) fn export_options<'a>(
    plan: &Plan,
    options: &RunOptions,
    shared: &'a Shared,
) -> ExportOptions<'a> {
    ExportOptions {
        dtype: options.save_dtype,
        target_layers: plan.target.layers,
        vocab_map: shared.vocab_map.as_ref(),
    }
}

/// Writes worker 0's replica (every replica is identical under all-reduce) with the data positions of the
/// batches its weights contain, and says so on standard error.
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
        stream_producers: shared.stream_producers(),
    };
    match save_checkpoint_as(
        dir,
        &plan.model,
        [&state.params, &state.exp_avg, &state.exp_avg_sq],
        &training,
        export_options(plan, options, shared),
    ) {
        // One line per save, so a `--save-every` run shows what is on disk and a kill's loss is known.
        Ok(()) => crate::log_line!("saved the checkpoint at step {step} to {}", dir.display()),
        Err(error) => shared.fail(RunError::Checkpoint(error)),
    }
}
