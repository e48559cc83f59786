//! What a drafter family provides, as two traits. [`Family`]: the facts of a compiled spec that the plan, the
//! cost model, the memory plan and the summary ask for (and the runtime may). `ModelArgs`: the checker of its
//! `model = NAME(...)` arguments, its rules against the target, and the spec it builds. A family module
//! implements both; the registry (`family/mod.rs`) lists it once.
//!
//! ```text
//!  model = NAME(...) ──ModelArgs::check──▶ args ──ModelArgs::spec (target known)──▶ spec ──Family──▶ plan figures
//! ```

use crate::ast::Call;
use crate::cost::gpu::Work;
use crate::diagnostic::Diagnostic;
use crate::plan::derived::{BucketPlan, TensorView};
use crate::plan::stages::{LossSpec, Precision, TargetStage, WeightsSpec};
use crate::workspace::{BackendKind, WorkspaceLayout};

/// The diagnostics a check records.
pub(crate) type Errs = Vec<Diagnostic>;

/// A compiled drafter family's facts: what the plan, cost model and summary need of its spec.
pub trait Family {
    /// The `.pipe` name (`mlp`, `dflash`, ...).
    fn name(&self) -> &'static str;

    /// The closed-form count of trained parameters (the flat buffer's length).
    fn parameter_count(&self) -> usize;

    /// [`Family::parameter_count`] in `u128`, safe to evaluate before the dimensions are known to fit.
    fn parameter_count_wide(&self) -> u128;

    /// The trained parameters' flat layout, in buffer order, with the export's names.
    fn layout(&self) -> Vec<TensorView>;

    /// One worker's workspace for `buckets` on `backend` at `precision` (`None` when a size overflows): the
    /// list of buffers both allocators allocate by name and the memory plan counts.
    fn workspace(
        &self,
        buckets: &[BucketPlan],
        loss: &LossSpec,
        backend: BackendKind,
        precision: Precision,
    ) -> Option<WorkspaceLayout>;

    /// FLOPs and bytes moved of one training step on `bucket` (its shape; its cost fields are not read);
    /// `None` when a figure overflows `u64`.
    fn step_cost(&self, bucket: &BucketPlan, loss: &LossSpec) -> Option<(u64, u64)>;

    /// The kernels the CUDA backend launches for one step of `bucket` at `precision`, each with its phase, for
    /// the GPU time model ([`crate::cost::gpu`]); `None` for a family that has no such list yet (`compile` then
    /// prints no GPU model for it).
    fn gpu_step(
        &self,
        _bucket: &BucketPlan,
        _loss: &LossSpec,
        _precision: Precision,
    ) -> Option<Vec<Work>> {
        None
    }

    /// Bytes of the target's frozen tensors one worker holds (embedding, `lm_head`); 0 by default.
    fn frozen_bytes(&self) -> Option<u64> {
        Some(0)
    }

    /// The summary's model line after `model NAME: `, ending with `parameters` (the count, already
    /// formatted); `weights` are the target's, for a family that reads them.
    fn summary(&self, parameters: &str, weights: Option<&WeightsSpec>) -> String;

    /// How the family's loss weighs its predictions, for the summary's loss line (`head_decay 0.8`).
    fn loss_summary(&self, loss: &LossSpec) -> String;
}

/// What the checker knows of the target when it applies a family's rules to it.
pub(crate) struct TargetFacts {
    /// The target's vocabulary, when it is valid.
    pub vocab: Option<usize>,
}

/// A family's checker: its registry facts, its `model = NAME(...)` arguments, its rules against the target,
/// and the spec it builds once the target is known.
pub(crate) trait ModelArgs: Sized + 'static {
    /// The `.pipe` name.
    const NAME: &'static str;
    /// `a` or `an`, as the name is read aloud (`an mlp`, `a dflash`).
    const ARTICLE: &'static str;
    /// The loss key that weighs this family's predictions, and what it weighs (`("head_decay", "the mlp's
    /// heads")`): the loss refuses the other families' keys and names this one instead.
    const WEIGHTING: (&'static str, &'static str);
    /// Whether the drafter reads the target's frozen embedding and `lm_head` (`weights`).
    const READS_TARGET_WEIGHTS: bool;
    /// How many tapped layers the family reads, when it fixes the number.
    const TAPS: Option<usize> = None;
    /// Whether the drafter section may give a draft vocabulary map (`vocab_map = "FILE.safetensors"`).
    const TAKES_VOCAB_MAP: bool = false;
    /// Whether the drafter reads the target's final-norm output (`last_hidden_states`, `[N, S, hidden]`) beside
    /// the tapped layers: the sources then carry it in every batch.
    const READS_LAST_HIDDEN_STATES: bool = false;
    /// Whether the Python client's draft-and-verify loop (`draftpipe_client.speculative`) drafts with this
    /// family's export, so a pipeline may name an `acceptance` check.
    const ACCEPTANCE_LOOP: bool = false;
    /// The spec the arguments and the target make.
    type Spec;

    /// Checks the call's arguments, recording every error; `None` when any was wrong.
    fn check(errs: &mut Errs, call: &Call) -> Option<Self>;

    /// Rules between the arguments and the target (a token id inside its vocabulary, ...).
    fn check_against_target(&self, _target: &TargetFacts, _errs: &mut Errs) {}

    /// The spec, from the arguments and the valid target.
    fn spec(&self, target: &TargetStage) -> Self::Spec;
}
