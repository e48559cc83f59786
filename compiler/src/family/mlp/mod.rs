//! The `mlp` drafter family: `fc` over the tapped hidden states, SwiGLU blocks, one projection per prediction
//! head and its own trained `lm_head`. Its spec and tensor table are here, its checks below, its cost in
//! [`cost`] and its workspace in [`workspace`].

use serde::{Deserialize, Serialize};

use crate::ast::Call;
use crate::check::fields::Fields;
use crate::check::values::{self, MAX_DIM, MAX_REPEATS};
use crate::cost::gpu::Work;
use crate::family::interface::{Errs, Family, ModelArgs};
use crate::plan::derived::{BucketPlan, TensorView, pack};
use crate::plan::stages::{LossSpec, Precision, TargetStage, WeightsSpec};
use crate::workspace::{BackendKind, WorkspaceLayout};

pub mod cost;
pub mod gpu;
mod workspace;

/// Dimensions of the `mlp` drafter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MlpSpec {
    /// Input width per token (target hidden × tapped layers).
    pub din: usize,
    /// Drafter hidden size.
    pub hidden: usize,
    /// Number of SwiGLU blocks.
    pub blocks: usize,
    /// SwiGLU intermediate size.
    pub intermediate: usize,
    /// Number of prediction heads.
    pub heads: usize,
    /// Vocabulary size.
    pub vocab: usize,
}

impl MlpSpec {
    /// The closed-form parameter count.
    pub fn parameter_count(&self) -> usize {
        let MlpSpec {
            din,
            hidden: h,
            blocks,
            intermediate: i,
            heads,
            vocab: v,
        } = *self;
        h * din + blocks * (h + 3 * i * h) + h + heads * h * h + v * h
    }

    /// The flat layout with PyTorch names and `[out, in]` weight shapes.
    pub fn layout(&self) -> Vec<TensorView> {
        let MlpSpec {
            din,
            hidden: h,
            blocks,
            intermediate: i,
            heads,
            vocab: v,
        } = *self;
        let mut shapes: Vec<(String, Vec<usize>)> = vec![("fc.weight".into(), vec![h, din])];
        for b in 0..blocks {
            shapes.push((format!("blocks.{b}.norm.weight"), vec![h]));
            shapes.push((format!("blocks.{b}.gate.weight"), vec![i, h]));
            shapes.push((format!("blocks.{b}.up.weight"), vec![i, h]));
            shapes.push((format!("blocks.{b}.down.weight"), vec![h, i]));
        }
        shapes.push(("norm.weight".into(), vec![h]));
        for j in 0..heads {
            shapes.push((format!("heads.{j}.weight"), vec![h, h]));
        }
        shapes.push(("lm_head.weight".into(), vec![v, h]));
        pack(shapes)
    }
}

impl Family for MlpSpec {
    fn name(&self) -> &'static str {
        MlpArgs::NAME
    }

    fn parameter_count(&self) -> usize {
        MlpSpec::parameter_count(self)
    }

    fn parameter_count_wide(&self) -> u128 {
        let w = |x: usize| x as u128;
        let (din, h, blocks, i, heads, v) = (
            w(self.din),
            w(self.hidden),
            w(self.blocks),
            w(self.intermediate),
            w(self.heads),
            w(self.vocab),
        );
        h * din + blocks * (h + 3 * i * h) + h + heads * h * h + v * h
    }

    fn layout(&self) -> Vec<TensorView> {
        MlpSpec::layout(self)
    }

    fn workspace(
        &self,
        buckets: &[BucketPlan],
        loss: &LossSpec,
        backend: BackendKind,
        precision: Precision,
    ) -> Option<WorkspaceLayout> {
        WorkspaceLayout::mlp(self, buckets, loss, backend, precision)
    }

    fn step_cost(&self, bucket: &BucketPlan, _loss: &LossSpec) -> Option<(u64, u64)> {
        Some((
            cost::step_flops(self, bucket.tokens)?,
            cost::step_bytes(self, bucket.tokens)?,
        ))
    }

    fn gpu_step(
        &self,
        bucket: &BucketPlan,
        loss: &LossSpec,
        precision: Precision,
    ) -> Option<Vec<Work>> {
        Some(gpu::step_work(self, bucket, loss, precision))
    }

    fn summary(&self, parameters: &str, _weights: Option<&WeightsSpec>) -> String {
        format!(
            "din {}, hidden {}, {} blocks, intermediate {}, {} heads, vocab {}: {parameters}",
            self.din, self.hidden, self.blocks, self.intermediate, self.heads, self.vocab,
        )
    }

    fn loss_summary(&self, loss: &LossSpec) -> String {
        format!("head_decay {}", loss.head_decay)
    }
}

/// The `mlp(...)` arguments a drafter section gives (input width and vocabulary come from the target).
#[derive(Debug, Clone, Copy)]
pub(crate) struct MlpArgs {
    hidden: usize,
    blocks: usize,
    intermediate: usize,
    heads: usize,
}

impl ModelArgs for MlpArgs {
    const NAME: &'static str = "mlp";
    const ARTICLE: &'static str = "an";
    const WEIGHTING: (&'static str, &'static str) = ("head_decay", "the mlp's heads");
    const READS_TARGET_WEIGHTS: bool = false;
    type Spec = MlpSpec;

    fn check(errs: &mut Errs, call: &Call) -> Option<Self> {
        let mut f = Fields::new(&call.args, "`mlp(...)`".to_owned(), call.span, errs);
        let mut dim = |key: &'static str, example: &str, max: u64, errs: &mut Errs| {
            f.required(key, example)
                .and_then(|v| values::count_in(errs, key, v, 1, max))
        };
        let hidden = dim("hidden", "1024", MAX_DIM, errs);
        let blocks = dim("blocks", "2", MAX_REPEATS, errs);
        let intermediate = dim("intermediate", "2816", MAX_DIM, errs);
        let heads = dim("heads", "4", MAX_REPEATS, errs);
        f.finish(errs);
        Some(MlpArgs {
            hidden: hidden?,
            blocks: blocks?,
            intermediate: intermediate?,
            heads: heads?,
        })
    }

    fn spec(&self, target: &TargetStage) -> MlpSpec {
        MlpSpec {
            din: target.hs_width(),
            hidden: self.hidden,
            blocks: self.blocks,
            intermediate: self.intermediate,
            heads: self.heads,
            vocab: target.vocab,
        }
    }
}
