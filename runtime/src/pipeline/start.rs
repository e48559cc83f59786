//! Where a run's drafters start: fresh weights, `--init` weights or a resumed checkpoint (checked against the
//! plan), and what every replica reads beside them, loaded once before any thread starts: the target's frozen
//! tables and the draft vocabulary.

use draftpipe_compiler::plan::Plan;

use crate::checkpoint::{ProducerRecord, load_checkpoint, load_initial_weights};
use crate::model::eagle3::vocab::{VocabMap, resolve_vocab_map};
use crate::model::registry;
use crate::params::FlatState;
use crate::target_weights::TargetWeights;

use super::error::RunError;
use super::options::RunOptions;

/// The replica every drafter starts from: fresh, `--init` weights, or a resumed checkpoint; and, for a family
/// that reads them (`dflash`), the target's frozen embedding and `lm_head`, loaded once for every worker.
pub(super) struct Start {
    pub(super) state: FlatState,
    pub(super) step: u64,
    pub(super) data_positions: Option<Vec<u64>>,
    /// A stream's producers by name, from the checkpoint resumed.
    pub(super) stream_producers: Vec<ProducerRecord>,
    pub(super) frozen: Option<TargetWeights>,
    /// For a family with a draft vocabulary (`eagle3`): the drafter's `vocab_map`, or the one its source's
    /// counts give (SpecForge's rule), computed once before training.
    pub(super) vocab: Option<VocabMap>,
}

pub(super) fn starting_state(plan: &Plan, options: &RunOptions) -> Result<Start, RunError> {
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
        // A resumed run trains up to the limit: a checkpoint already there has nothing left to train, and a run
        // that started anyway would end at once having done nothing, with exit status 0.
        if let Some(limit) = options.step_limit(plan)
            && checkpoint.state.step >= limit
        {
            return Err(RunError::Resume {
                dir: dir.clone(),
                reason: format!(
                    "its step {} is already at or past the step limit {limit} (the limit counts from step 0, not \
                     from the checkpoint): nothing is left to train; ask for more with --steps",
                    checkpoint.state.step
                ),
            });
        }
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
        let left = options.step_limit(plan).map_or_else(String::new, |limit| {
            format!(
                ", {} steps left of the {limit} asked for",
                limit - checkpoint.state.step
            )
        });
        crate::log_line!(
            "resuming from step {} of {}{left}",
            checkpoint.state.step,
            dir.display()
        );
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
