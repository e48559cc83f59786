//! `draftpipe eval`: a trained drafter's loss, per-slot accuracy and acceptance length on held-out data, with
//! the forward pass only (no gradient, no update).
//!
//! ```text
//!  CHECKPOINT (config.json + model.safetensors) ──load_initial_weights──▶ params ─┐ frozen_tables (pipeline)
//!  --data "…safetensors" ──eval_plan, SafetensorsDataset (the plan's buckets)──▶ HsBatch ──▶ ForwardOnly ──▶ EvalTotals
//!                                                  one pass, every batch, file order   │ per batch: on_progress
//! ```
//!
//! The totals are sums (weighted cross-entropy and its weights, correct and counted predictions per block slot),
//! so the metrics of the whole set are exact whatever the batch sizes: the loss is Σ w·CE / Σ w as in training,
//! slot `k`'s accuracy is correct / counted over every block, and the acceptance length is SpecForge's simulated
//! one, `Σ_k Π_{j≤k} acc_j` over slots `1..block`, with `τ` = 1 + that (the bonus token counted, as acceptance
//! lengths are quoted).

use std::path::Path;
use std::sync::Arc;

use draftpipe_compiler::plan::{Plan, SourceSpec};

use crate::backend::cpu::CpuBackend;
use crate::batch::HsBatch;
use crate::checkpoint::{CheckpointError, load_initial_weights};
use crate::drafter::{Drafter, DrafterError};
use crate::model::dflash::BlockGeometry;
use crate::params::FlatState;
use crate::pipeline::devices::open_cpu;
use crate::source::safetensors::{SafetensorsDataset, SafetensorsSource};
use crate::source::{BucketShapes, HsSource, SourceError, resolve_hs_dtype};
use crate::target_weights::{TargetWeights, TargetWeightsError};

/// Why an evaluation failed.
#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    /// The checkpoint cannot be read or does not fit the plan.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// The data cannot be read or does not fit the plan.
    #[error(transparent)]
    Source(#[from] SourceError),
    /// The plan's model has no forward-only evaluation.
    #[error("eval needs a dflash drafter; this pipeline's drafter is `{0}`")]
    Unsupported(&'static str),
    /// The target's frozen embedding and `lm_head` cannot be loaded.
    #[error(transparent)]
    TargetWeights(#[from] TargetWeightsError),
    /// The drafter cannot be built on this machine.
    #[error("cannot build the drafter: {0}")]
    Drafter(#[from] DrafterError),
    /// The model failed on a batch.
    #[error("batch {batch}: {message}")]
    Model {
        /// The batch's position in the data.
        batch: u64,
        /// What went wrong.
        message: String,
    },
}

/// What one batch's forward pass adds to the totals (sums, so batches combine exactly).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BatchMetrics {
    /// Σ w·CE over the batch's labelled slots.
    pub weighted_loss: f64,
    /// Σ w.
    pub weight: f64,
    /// Per block slot (index 0, the anchor, is never counted): predictions equal to their label.
    pub slot_correct: Vec<u64>,
    /// Per block slot: predictions that had a label.
    pub slot_counted: Vec<u64>,
    /// The blocks' accepted prefixes summed (the drafted slots right in a row, up to the first miss).
    pub accepted: u64,
    /// The blocks counted for the exact acceptance length (those with a label at their first drafted slot).
    pub blocks: u64,
}

/// A model that can run the forward pass and the loss on a batch without touching its weights.
pub trait ForwardOnly: Send {
    /// The metrics of `batch` under the current weights.
    fn evaluate(&mut self, batch: &HsBatch) -> Result<BatchMetrics, String>;
}

/// The sums over every batch evaluated so far.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EvalTotals {
    /// Batches evaluated.
    pub batches: u64,
    /// Sequences (with at least one kept token).
    pub sequences: u64,
    /// Real tokens (padding excluded).
    pub tokens: u64,
    /// The per-batch sums, added up.
    pub sums: BatchMetrics,
}

impl EvalTotals {
    /// Adds one batch.
    pub fn add(&mut self, batch: &HsBatch, metrics: &BatchMetrics) {
        self.batches += 1;
        self.sequences += batch.seq_lens.iter().filter(|&&l| l > 0).count() as u64;
        self.tokens += batch.seq_lens.iter().map(|&l| u64::from(l)).sum::<u64>();
        self.sums.weighted_loss += metrics.weighted_loss;
        self.sums.weight += metrics.weight;
        self.sums.accepted += metrics.accepted;
        self.sums.blocks += metrics.blocks;
        for (total, part) in [
            (&mut self.sums.slot_correct, &metrics.slot_correct),
            (&mut self.sums.slot_counted, &metrics.slot_counted),
        ] {
            if total.len() < part.len() {
                total.resize(part.len(), 0);
            }
            for (t, p) in total.iter_mut().zip(part) {
                *t += p;
            }
        }
    }

    /// Σ w·CE / Σ w, the training loss over the whole set (`None` when nothing had a label).
    pub fn loss(&self) -> Option<f64> {
        (self.sums.weight > 0.0).then(|| self.sums.weighted_loss / self.sums.weight)
    }

    /// Accuracy of slots `1..block` (`None` for a slot that never had a label).
    pub fn slot_accuracy(&self) -> Vec<Option<f64>> {
        self.sums
            .slot_correct
            .iter()
            .zip(&self.sums.slot_counted)
            .skip(1)
            .map(|(&c, &n)| (n > 0).then(|| c as f64 / n as f64))
            .collect()
    }

    /// SpecForge's simulated acceptance length, `Σ_k Π_{j≤k} acc_j`; a slot never labelled ends the sum.
    pub fn acceptance_length(&self) -> f64 {
        let mut product = 1.0;
        let mut sum = 0.0;
        for accuracy in self.slot_accuracy() {
            let Some(accuracy) = accuracy else { break };
            product *= accuracy;
            sum += product;
        }
        sum
    }

    /// `τ_simulated`: SpecForge's tokens per target forward, the simulated acceptance length plus the target's
    /// own (bonus) token.
    pub fn tau_simulated(&self) -> f64 {
        1.0 + self.acceptance_length()
    }

    /// `τ_exact`: the blocks' accepted prefixes over the whole set per counted block, plus the bonus token (1
    /// when no block was counted).
    pub fn tau_exact(&self) -> f64 {
        crate::model::family::exact_tau(self.sums.accepted as f64, self.sums.blocks)
    }
}

/// Progress of an evaluation, reported after each batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EvalProgress {
    /// Batches done.
    pub batches: u64,
    /// Batches in the data.
    pub total: u64,
    /// Real tokens done.
    pub tokens: u64,
}

/// The pipeline as `eval` runs it: `pattern`'s files as its source (one pass, in file order), hidden states held
/// in the pipeline's `hs_dtype` or, without one, in the files' (as `run` settles it).
pub fn eval_plan(plan: &Plan, pattern: &str) -> Result<Plan, EvalError> {
    let mut plan = plan.clone();
    plan.target.source = SourceSpec::Safetensors {
        pattern: pattern.to_string(),
        epochs: 1,
        shuffle_seed: None,
    };
    Ok(resolve_hs_dtype(&plan)?)
}

/// The held-out data of an [`eval_plan`], checked and cut into its buckets as the target would read it.
pub fn open_eval_data(eval_plan: &Plan) -> Result<SafetensorsDataset, EvalError> {
    let SourceSpec::Safetensors { pattern, .. } = &eval_plan.target.source else {
        return Err(EvalError::Source(SourceError::Config(
            "eval reads a safetensors source".into(),
        )));
    };
    Ok(SafetensorsDataset::open(
        pattern,
        &eval_plan.target,
        &BucketShapes::from_plan(eval_plan),
    )?)
}

/// Runs `model` over every batch of `data` once and returns the totals; `on_progress` is called after each batch.
pub fn evaluate_dataset(
    plan: &Plan,
    data: SafetensorsDataset,
    model: &mut dyn ForwardOnly,
    mut on_progress: impl FnMut(EvalProgress),
) -> Result<EvalTotals, EvalError> {
    let total = data.batches() as u64;
    let shapes = BucketShapes::from_plan(plan);
    let mut source = SafetensorsSource::new(Arc::new(data), 0, 1);
    let mut batch = shapes.buffer();
    let mut totals = EvalTotals::default();
    while let Some(bucket) = source.next_bucket()? {
        shapes.shape_for(&mut batch, bucket);
        source.fill_next(&mut batch)?;
        let metrics = model.evaluate(&batch).map_err(|message| EvalError::Model {
            batch: batch.source_position,
            message,
        })?;
        totals.add(&batch, &metrics);
        on_progress(EvalProgress {
            batches: totals.batches,
            total,
            tokens: totals.tokens,
        });
    }
    Ok(totals)
}

/// The plan's `dflash` drafter on the CPU with `params`, evaluating (the same [`Drafter`] a CPU worker trains,
/// through its forward-only [`Drafter::evaluate`]).
struct CpuEvaluator {
    drafter: Drafter<CpuBackend>,
    geometry: BlockGeometry,
}

impl ForwardOnly for CpuEvaluator {
    fn evaluate(&mut self, batch: &HsBatch) -> Result<BatchMetrics, String> {
        let evaluation = self.drafter.evaluate(batch).map_err(|e| e.to_string())?;
        // The batch's loss is Σ w·CE / Σ w; Σ w is the labelled rows of each slot times the slot's weight.
        let weight: f64 = evaluation
            .slot_counts
            .iter()
            .enumerate()
            .skip(1)
            .map(|(k, &(_, labelled))| {
                f64::from(labelled) * f64::from(self.geometry.slot_weight(k))
            })
            .sum();
        let loss = if weight > 0.0 {
            f64::from(evaluation.loss) * weight
        } else {
            0.0
        };
        Ok(BatchMetrics {
            weighted_loss: loss,
            weight,
            slot_correct: evaluation
                .slot_counts
                .iter()
                .map(|&(correct, _)| correct.round() as u64)
                .collect(),
            slot_counted: evaluation
                .slot_counts
                .iter()
                .map(|&(_, labelled)| u64::from(labelled))
                .collect(),
            accepted: evaluation
                .blocks
                .as_ref()
                .map_or(0, |b| b.accepted.round() as u64),
            blocks: evaluation
                .blocks
                .as_ref()
                .map_or(0, |b| u64::from(b.blocks)),
        })
    }
}

/// The target's frozen embedding and `lm_head`, from the pipeline as written (before [`eval_plan`] replaces
/// its source: a synthetic target's tables come from its seed).
pub fn frozen_tables(plan: &Plan) -> Result<TargetWeights, EvalError> {
    Ok(TargetWeights::load(&plan.target)?)
}

/// The plan's drafter, on the CPU, with `params` and the target's `frozen` tables, ready to evaluate.
pub fn forward_only_model(
    plan: &Plan,
    frozen: &TargetWeights,
    params: &[f32],
) -> Result<Box<dyn ForwardOnly>, EvalError> {
    let Some(spec) = plan.model.spec.as_dflash() else {
        return Err(EvalError::Unsupported(plan.model.spec.kind()));
    };
    let mut state = FlatState::init(&plan.model, 0);
    state.params.copy_from_slice(params);
    let drafter = open_cpu(plan, None, (&state, (Some(frozen), None)))?;
    let geometry = BlockGeometry {
        block: spec.block,
        anchors: spec.anchors,
        mask_token: spec.mask_token,
        position_decay: plan.drafter.loss.position_decay.unwrap_or(0.0),
    };
    Ok(Box::new(CpuEvaluator { drafter, geometry }))
}

/// The weights `draftpipe eval` evaluates: a checkpoint directory (its `config.json` checked against the plan)
/// or a weights file.
pub fn load_eval_weights(plan: &Plan, checkpoint: &Path) -> Result<Vec<f32>, EvalError> {
    if plan.model.spec.as_dflash().is_none() {
        return Err(EvalError::Unsupported(plan.model.spec.kind()));
    }
    Ok(load_initial_weights(checkpoint, &plan.model)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn totals(correct: &[u64], counted: &[u64]) -> EvalTotals {
        EvalTotals {
            sums: BatchMetrics {
                slot_correct: correct.to_vec(),
                slot_counted: counted.to_vec(),
                ..BatchMetrics::default()
            },
            ..EvalTotals::default()
        }
    }

    #[test]
    fn acceptance_length_is_the_sum_of_running_products() {
        // acc = 0.5, 0.5, 1.0 → 0.5 + 0.25 + 0.25.
        let t = totals(&[9, 5, 2, 4], &[9, 10, 4, 4]);
        assert_eq!(t.slot_accuracy(), vec![Some(0.5), Some(0.5), Some(1.0)]);
        assert!((t.acceptance_length() - 1.0).abs() < 1e-12);
        assert!((t.tau_simulated() - 2.0).abs() < 1e-12);
    }

    #[test]
    fn a_slot_without_labels_ends_the_acceptance_sum() {
        let t = totals(&[0, 8, 0, 3], &[0, 10, 0, 3]);
        assert_eq!(t.slot_accuracy(), vec![Some(0.8), None, Some(1.0)]);
        assert!((t.acceptance_length() - 0.8).abs() < 1e-12);
    }

    #[test]
    fn batches_add_up_exactly() {
        let mut batch = HsBatch::zeroed(4, 2, 1);
        batch.seq_lens = vec![3, 0];
        let mut t = EvalTotals::default();
        let metrics = BatchMetrics {
            weighted_loss: 3.0,
            weight: 2.0,
            slot_correct: vec![0, 1],
            slot_counted: vec![0, 2],
            accepted: 1,
            blocks: 2,
        };
        t.add(&batch, &metrics);
        t.add(&batch, &metrics);
        assert_eq!((t.batches, t.sequences, t.tokens), (2, 2, 6));
        assert_eq!(t.loss(), Some(1.5));
        assert_eq!(t.slot_accuracy(), vec![Some(0.5)]);
        assert_eq!((t.sums.accepted, t.sums.blocks), (2, 4));
        assert!((t.tau_exact() - 1.5).abs() < 1e-12);
        assert_eq!(EvalTotals::default().loss(), None);
        assert_eq!(EvalTotals::default().tau_exact(), 1.0);
    }
}
