//! Where a run's drafters start: fresh weights, `--init` weights or a resumed checkpoint (checked against the
//! plan), and what every replica reads beside them, loaded once before any thread starts: the target's frozen
//! tables and the draft vocabulary.

use std::path::{Path, PathBuf};

use draftpipe_compiler::plan::Plan;

use crate::checkpoint::{
    CheckpointError, MODEL_FILE, ProducerRecord, load_checkpoint, load_initial_weights,
    resolve_checkpoint_dir,
};
use crate::model::eagle3::vocab::{D2T, VocabMap, resolve_vocab_map};
use crate::model::registry;
use crate::params::FlatState;
use crate::target_weights::TargetWeights;
use crate::tensor_file::TensorFile;

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
    /// For a family with a draft vocabulary (`eagle3`): the resumed checkpoint's, else the drafter's
    /// `vocab_map`, or the one its source's counts give (SpecForge's rule), computed once before training.
    pub(super) vocab: Option<VocabMap>,
}

pub(super) fn starting_state(plan: &Plan, options: &RunOptions) -> Result<Start, RunError> {
    let mut state = FlatState::init(&plan.model, options.init_seed);
    let frozen = if registry::spec(&plan.model.spec).reads_target_weights() {
        Some(TargetWeights::load(&plan.target)?)
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
        let vocab = draft_vocabulary(plan, Some(dir))?;
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
    let vocab = draft_vocabulary(plan, None)?;
    Ok(Start {
        state,
        step: 0,
        data_positions: None,
        stream_producers: Vec::new(),
        frozen,
        vocab,
    })
}

/// The draft vocabulary of a family that takes one (`takes_vocab_map`; `None` for the others). A resumed run
/// keeps the one its checkpoint was trained with: the frozen `d2t`/`t2d` the checkpoint's weights file holds
/// win over a fresh count, and a different `vocab_map` given by the pipeline is an error naming both files
/// (the trained head scores the checkpoint's draft ids; another map would pair it with other tokens). A fresh
/// run, or a checkpoint without the tables, takes the pipeline's `vocab_map` or the count.
fn draft_vocabulary(plan: &Plan, resumed: Option<&Path>) -> Result<Option<VocabMap>, RunError> {
    if !plan.model.spec.takes_vocab_map() {
        return Ok(None);
    }
    let given = plan.drafter.vocab_map.as_deref().map(Path::new);
    let kept = match resumed {
        Some(dir) => kept_vocabulary(dir, plan)?,
        None => None,
    };
    let (Some(dir), Some((weights, kept))) = (resumed, kept) else {
        return Ok(Some(resolve_vocab_map(plan, given)?));
    };
    if let Some(given) = given {
        let asked = resolve_vocab_map(plan, Some(given))?;
        if asked != kept {
            let differing = asked
                .t2d
                .iter()
                .zip(&kept.t2d)
                .filter(|(a, b)| a != b)
                .count();
            return Err(RunError::Resume {
                dir: dir.to_path_buf(),
                reason: format!(
                    "the pipeline's vocab_map {} is another draft vocabulary than the one the checkpoint \
                     was trained with ({}: t2d differs at {differing} of {} target ids); a resumed run keeps \
                     the checkpoint's: remove vocab_map from the pipeline, or name that file",
                    given.display(),
                    weights.display(),
                    kept.t2d.len()
                ),
            });
        }
    }
    Ok(Some(kept))
}

/// The draft vocabulary a checkpoint's weights file keeps (`d2t`, `t2d`), with that file; `None` when it
/// holds none (a checkpoint written before they were saved).
fn kept_vocabulary(dir: &Path, plan: &Plan) -> Result<Option<(PathBuf, VocabMap)>, RunError> {
    let weights = resolve_checkpoint_dir(dir)?.join(MODEL_FILE);
    let holds_tables = TensorFile::open(&weights)
        .map_err(CheckpointError::from)?
        .info(D2T)
        .is_some();
    if !holds_tables {
        return Ok(None);
    }
    let sizes = plan
        .model
        .spec
        .as_eagle3()
        .map(|e| (e.draft_vocab, e.vocab));
    let map = VocabMap::read(&weights, sizes)?;
    Ok(Some((weights, map)))
}
