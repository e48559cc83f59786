//! The `dflash` drafter family (SpecForge's / z-lab's `DFlashDraftModel`): its spec and tensor table here,
//! its argument checks in `check`, its cost in [`cost`], its workspace in `workspace`.

use serde::{Deserialize, Serialize};

use crate::cost::gpu::Work;
use crate::family::interface::Family;
use crate::plan::derived::{BucketPlan, TensorView, pack};
use crate::plan::stages::{LossSpec, Precision, WeightsSpec};
use crate::workspace::{BackendKind, WorkspaceLayout};

mod check;
pub mod cost;
pub mod flash;
pub mod gpu;
mod workspace;

pub(crate) use check::DflashArgs;

/// Qwen3's RMSNorm epsilon, which z-lab's `DFlashDraftModel` config carries as `rms_norm_eps`.
pub const DFLASH_RMS_NORM_EPS: f32 = 1e-6;

/// Dimensions of the `dflash` drafter (SpecForge's / z-lab's `DFlashDraftModel`): a context projection of the
/// tapped target layers, `layers` Qwen3 decoder layers over blocks of `block` slots, the target's frozen
/// embedding and `lm_head` (not part of the trained parameters).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DflashSpec {
    /// The target's hidden size `H`, which is also the drafter's width.
    pub hidden: usize,
    /// Tapped target layers `L`; the context projection `fc` reads `L·H` per token.
    pub taps: usize,
    /// The target section's `tap_layers` as written: indices into the hidden-states tuple, whose entry 0 is the
    /// embeddings (target layer `i` is tap `i + 1`).
    pub tap_layers: Vec<usize>,
    /// The target's vocabulary (embedding and `lm_head` rows).
    pub vocab: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (grouped-query attention: `heads % kv_heads == 0`).
    pub kv_heads: usize,
    /// Width of one head (even: RoPE rotates pairs).
    pub head_dim: usize,
    /// SwiGLU intermediate size.
    pub intermediate: usize,
    /// Slots per block: the anchor token, then `block − 1` mask tokens to predict.
    pub block: usize,
    /// Most anchors (blocks) drawn per sequence.
    pub anchors: usize,
    /// The token id of the masked slots (`< vocab`).
    pub mask_token: u32,
    /// RoPE base.
    pub rope_theta: f32,
    /// RMSNorm epsilon of every norm ([`DFLASH_RMS_NORM_EPS`]).
    pub rms_norm_eps: f32,
}

impl DflashSpec {
    /// Block slots per sequence in a bucket of padded length `padded_len`: `anchors`, or the most anchor
    /// positions the bucket has (`padded_len − 1`, each needing a next token) when that is fewer; at least 1.
    pub fn block_slots(&self, padded_len: usize) -> usize {
        self.anchors.min(padded_len.saturating_sub(1)).max(1)
    }

    /// Rows the frozen `lm_head` processes in a step of `sequences` sequences of padded length `padded_len`
    /// when the step's shapes are the bucket's (a captured CUDA graph): the most labelled rows the bucket can
    /// have, `N·A·(B − 1)` (slot 0 of a block never has a label), plus one row that never has one, which the
    /// rows without a label read their zero gradient from. A synchronous backend processes the batch's
    /// labelled rows plus that one. `None` on overflow.
    pub fn head_rows(&self, padded_len: usize, sequences: usize) -> Option<usize> {
        sequences
            .checked_mul(self.block_slots(padded_len))?
            .checked_mul(self.block.saturating_sub(1))?
            .checked_add(1)
    }

    /// The closed-form count of trained parameters (frozen embedding and `lm_head` excluded).
    ///
    /// # Examples
    /// ```
    /// use draftpipe_compiler::plan::{DflashSpec, DFLASH_RMS_NORM_EPS};
    ///
    /// let spec = DflashSpec {
    ///     hidden: 64, taps: 3, tap_layers: vec![1, 2, 3], vocab: 512, layers: 2, heads: 4, kv_heads: 2,
    ///     head_dim: 16, intermediate: 128, block: 4, anchors: 64, mask_token: 511, rope_theta: 10000.0,
    ///     rms_norm_eps: DFLASH_RMS_NORM_EPS,
    /// };
    /// assert_eq!(spec.parameter_count(), spec.layout().iter().map(|v| v.len()).sum::<usize>());
    /// ```
    pub fn parameter_count(&self) -> usize {
        let h = self.hidden;
        let (q, kv) = (self.heads * self.head_dim, self.kv_heads * self.head_dim);
        h * self.taps * h + h + self.layers * self.layer_parameters(h, q, kv) + h
    }

    fn layer_parameters(&self, h: usize, q: usize, kv: usize) -> usize {
        2 * h + q * h + 2 * kv * h + 2 * self.head_dim + h * q + 3 * self.intermediate * h
    }

    /// The flat layout in z-lab's names and order, PyTorch `[out, in]` weight shapes.
    pub fn layout(&self) -> Vec<TensorView> {
        let (h, hd, i) = (self.hidden, self.head_dim, self.intermediate);
        let (q, kv) = (self.heads * hd, self.kv_heads * hd);
        let mut shapes: Vec<(String, Vec<usize>)> = vec![
            ("fc.weight".into(), vec![h, self.taps * h]),
            ("hidden_norm.weight".into(), vec![h]),
        ];
        for l in 0..self.layers {
            let p = format!("layers.{l}");
            shapes.extend([
                (format!("{p}.input_layernorm.weight"), vec![h]),
                (format!("{p}.self_attn.q_proj.weight"), vec![q, h]),
                (format!("{p}.self_attn.k_proj.weight"), vec![kv, h]),
                (format!("{p}.self_attn.v_proj.weight"), vec![kv, h]),
                (format!("{p}.self_attn.q_norm.weight"), vec![hd]),
                (format!("{p}.self_attn.k_norm.weight"), vec![hd]),
                (format!("{p}.self_attn.o_proj.weight"), vec![h, q]),
                (format!("{p}.post_attention_layernorm.weight"), vec![h]),
                (format!("{p}.mlp.gate_proj.weight"), vec![i, h]),
                (format!("{p}.mlp.up_proj.weight"), vec![i, h]),
                (format!("{p}.mlp.down_proj.weight"), vec![h, i]),
            ]);
        }
        shapes.push(("norm.weight".into(), vec![h]));
        pack(shapes)
    }
}

impl Family for DflashSpec {
    fn name(&self) -> &'static str {
        "dflash"
    }

    fn parameter_count(&self) -> usize {
        DflashSpec::parameter_count(self)
    }

    fn parameter_count_wide(&self) -> u128 {
        let w = |x: usize| x as u128;
        let (h, hd) = (w(self.hidden), w(self.head_dim));
        let (q, kv) = (w(self.heads) * hd, w(self.kv_heads) * hd);
        let layer = 2 * h + q * h + 2 * kv * h + 2 * hd + h * q + 3 * w(self.intermediate) * h;
        h * w(self.taps) * h + 2 * h + w(self.layers) * layer
    }

    fn layout(&self) -> Vec<TensorView> {
        DflashSpec::layout(self)
    }

    fn workspace(
        &self,
        buckets: &[BucketPlan],
        loss: &LossSpec,
        backend: BackendKind,
        precision: Precision,
    ) -> Option<WorkspaceLayout> {
        WorkspaceLayout::dflash(self, buckets, loss, backend, precision)
    }

    fn step_cost(&self, bucket: &BucketPlan, loss: &LossSpec) -> Option<(u64, u64)> {
        Some((
            cost::step_flops(self, bucket.padded_len, bucket.sequences)?,
            cost::step_bytes(self, bucket, loss)?,
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

    fn frozen_bytes(&self) -> Option<u64> {
        cost::frozen_bytes(self)
    }

    fn summary(&self, parameters: &str, weights: Option<&WeightsSpec>) -> String {
        format!(
            "hidden {} × {} taps, {} layers, {}/{} heads × {}, intermediate {}, block {}, {} anchors, mask_token {}, \
             rope_theta {}, vocab {}: {parameters} trained, frozen embedding and lm_head {}",
            self.hidden,
            self.taps,
            self.layers,
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.intermediate,
            self.block,
            self.anchors,
            self.mask_token,
            self.rope_theta,
            self.vocab,
            match weights {
                Some(WeightsSpec::Safetensors { path }) => format!("from `{path}`"),
                None => "generated by the synthetic target".to_owned(),
            },
        )
    }

    fn loss_summary(&self, loss: &LossSpec) -> String {
        match loss.position_decay {
            Some(gamma) => format!("position_decay {gamma}"),
            None => "no position_decay".to_owned(),
        }
    }
}
