//! The `eagle3` family as the drafter sees it: [`Family`] and [`FamilyModel`] (what the registry builds) for
//! [`Eagle3`],
//! [`FamilySpec`] for the compiler's [`Eagle3Spec`], and the per-TTT-step metrics of its read-back values.

use std::path::Path;

use draftpipe_compiler::plan::{BackendKind, Eagle3Spec, ModelPlan, WorkspaceLayout};

use super::{Eagle3, Eagle3Offsets};
use crate::backend::{Backend, BackendResult};
use crate::batch::HsBatch;
use crate::model::family::{BlockMetrics, Family, FamilyModel, FamilyPlan, FrozenTables};
use crate::model::serving::{ExportOptions, FamilySpec};
use crate::model::step::{AllocateError, LayoutError, StepShape};
use crate::tensor_file::F32Tensor;

/// The architecture SGLang and vLLM load an EAGLE-3 draft as.
pub const ARCHITECTURE: &str = "LlamaForCausalLMEagle3";

/// An `eagle3` step's metrics from its read-back values after the first three, `[loss_k …, correct_k …,
/// supervised_k …, accepted]` for `steps` TTT steps: accuracy_k = correct_k / supervised_k (0 without a
/// supervised row), SpecForge's simulated acceptance length `τ = 1 + Σ_k Π_{j≤k} acc_j`, TTT step `k` standing
/// for draft position `k + 1`, and the exact one: the start rows supervised at step 0 are the blocks, `accepted`
/// their steps right in a row.
pub fn ttt_metrics(extra: &[f32], steps: usize) -> BlockMetrics {
    let (correct, supervised) = (&extra[steps..2 * steps], &extra[2 * steps..3 * steps]);
    let accepted = extra[3 * steps];
    // `BlockMetrics::new` skips position 0 (a DFlash block's anchor): prepend an empty one.
    let correct: Vec<f32> = std::iter::once(0.0)
        .chain(correct.iter().copied())
        .collect();
    let supervised: Vec<u32> = std::iter::once(0)
        .chain(supervised.iter().map(|&n| n as u32))
        .collect();
    BlockMetrics::new(&correct, &supervised, accepted)
}

impl<B: Backend> Family<B> for Eagle3<B> {
    fn name(&self) -> &'static str {
        "eagle3"
    }

    fn forward(&mut self, be: &mut B, shape: StepShape, slot: usize) -> BackendResult {
        Eagle3::forward(self, be, shape, slot)
    }

    fn loss(&mut self, be: &mut B, shape: StepShape, slot: usize) -> BackendResult {
        Eagle3::loss(self, be, shape, slot, true)
    }

    fn backward(&mut self, be: &mut B, shape: StepShape, slot: usize) -> BackendResult {
        Eagle3::backward(self, be, shape, slot)
    }

    /// The unroll's losses and counts without the logits' gradient.
    fn evaluation_loss(&mut self, be: &mut B, shape: StepShape, slot: usize) -> BackendResult {
        Eagle3::loss(self, be, shape, slot, false)
    }

    crate::model::family::family_state_parts!();

    fn input_width_and_vocab(&self) -> (usize, usize) {
        (self.spec().taps * self.spec().hidden, self.spec().vocab)
    }

    fn last_hidden_width(&self) -> Option<usize> {
        Some(self.spec().hidden)
    }

    /// The embedding and the whole `lm_head`; the teacher's rows of it are gathered again before the next step.
    fn frozen_mut(&mut self) -> Option<FrozenTables<'_, B>> {
        self.teacher_gathered = false;
        Some((&mut self.ws.frozen.embed, &mut self.ws.frozen.lm_head))
    }

    /// Gathers the teacher's rows when the tables or the draft vocabulary changed; every TTT step reports its
    /// metrics (the empty vector: their counts are on the device).
    fn stage(
        &mut self,
        be: &mut B,
        _slot: usize,
        _batch: &HsBatch,
        _draw: (u64, u64),
    ) -> BackendResult<Option<Vec<u32>>> {
        self.gather_teacher(be)?;
        Ok(Some(Vec::new()))
    }

    fn metrics(&self, extra: &[f32], _labelled: &[u32]) -> BlockMetrics {
        ttt_metrics(extra, self.spec().ttt)
    }
}

/// The `eagle3` family as the registry builds it.
impl<B: Backend> FamilyModel<B> for Eagle3<B> {
    type Offsets = Eagle3Offsets;

    fn offsets(model: &ModelPlan) -> Result<Eagle3Offsets, LayoutError> {
        Eagle3Offsets::new(model)
    }

    fn workspace(
        offsets: &Eagle3Offsets,
        plan: &FamilyPlan<'_>,
        kind: BackendKind,
    ) -> Option<WorkspaceLayout> {
        WorkspaceLayout::eagle3(
            offsets.spec(),
            plan.buckets,
            &plan.loss,
            kind,
            plan.precision,
        )
    }

    fn allocate(
        backend: &mut B,
        plan: &FamilyPlan<'_>,
        offsets: Eagle3Offsets,
        layout: &WorkspaceLayout,
    ) -> Result<Self, AllocateError> {
        Eagle3::new(
            backend,
            (plan.model, offsets),
            plan.loss,
            plan.optimizer,
            plan.precision,
            layout,
        )
    }
}

/// What the runtime reads of an `eagle3` plan: its step reads the target's embedding and `lm_head`. Its export
/// (SGLang's `LlamaForCausalLMEagle3` directory with `d2t`/`t2d`) is written by the checkpoint path, not by a
/// serving config here yet.
impl FamilySpec for Eagle3Spec {
    fn name(&self) -> &'static str {
        "eagle3"
    }

    fn reads_target_weights(&self) -> bool {
        true
    }

    fn architecture(&self) -> Option<&'static str> {
        Some(ARCHITECTURE)
    }

    /// SGLang's `LlamaForCausalLMEagle3` export ([`super::export::write_eagle3_export`]), when the save has the
    /// run's draft vocabulary.
    fn write_export(
        &self,
        dir: &Path,
        weights: &[F32Tensor<'_>],
        export: ExportOptions<'_>,
    ) -> Option<Result<(), Box<dyn std::error::Error + Send + Sync>>> {
        let map = export.vocab_map?;
        Some(
            super::export::write_eagle3_export(dir, self, weights, map, export.dtype)
                .map_err(Into::into),
        )
    }

    fn export_extra_tensors(&self) -> &'static [&'static str] {
        &[super::vocab::D2T, super::vocab::T2D]
    }
}
