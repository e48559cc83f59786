//! The `dflash` drafter's cost: FLOPs and bytes of one step, and the activations it keeps for the backward pass.
//!
//! Notation (one bucket): `N` sequences of padded length `S`, `T = N·S` context rows, `A = min(anchors, S − 1)`
//! blocks per sequence (an anchor needs a token after it), `B` slots per block, `Q = N·A·B` block rows (the
//! queries), `R = N·A·(B − 1)` rows with a label (slot 0 is the clean anchor and predicts nothing), `H` width,
//! `Lt` tapped layers, `Ly` decoder layers, `nh`/`kv` query/key-value heads of width `hd`, `I` intermediate,
//! `V` vocabulary, `P` trained parameters.
//!
//! **Attention pairs.** A query of block `j` sees the context keys before its anchor `a_j` and the `B` keys of
//! its own block. Anchors are drawn uniformly from the valid positions `0..S−1`, so a block sees
//! `(S − 2)/2` context keys on average: `pairs = Q·((S − 2)/2 + B)` (query, key) pairs per head, against
//! `Q·(T + Q)` for a dense mask. The score matrix is never stored: only its log-sum-exp, `Q·nh` floats.
//!
//! **FLOPs of one step.** Matrix products, forward: `fc` `2·T·Lt·H·H`; per layer the context's `k_proj` and
//! `v_proj` `2·T·H·2·kv·hd`, the block rows' `q/k/v/o` `2·Q·H·(2·nh + 2·kv)·hd` and SwiGLU `2·Q·3·I·H`;
//! attention `4·hd·nh·pairs` (scores and values); the frozen `lm_head` `2·R·H·V`. Backward: twice the
//! forward for every trained matrix, less the input gradients nobody needs (of `fc`, whose input is data, and
//! of layer 0's block-row `q/k/v`, whose input is the frozen embedding); attention `2.5×` its forward (scores
//! recomputed from the log-sum-exp, then `dV`, `dP`, `dQ`, `dK`); the `lm_head` only its input gradient (its
//! weight is frozen). The fused loss costs `4·R·V` (max, exp, sum, gradient per logit) and AdamW `12·P`.
//! Norms, RoPE and SwiGLU's element-wise work are `O((T + Q)·H)` and left out.
//!
//! **Bytes of one step** (lower bound): parameters read forward and backward, gradients written, AdamW
//! reading `p, g, m, v` and writing `p, m, v` (`10·P`); the frozen embedding rows gathered (`Q·H`) and the
//! `lm_head` read once per logits chunk pass, forward and backward (`2·V·H`); activations written once and read
//! once; every logit chunk written once and read once (`2·R·V`). All f32.
//!
//! **Activations kept for the backward pass** (until the model's workspace layout describes them buffer by
//! buffer, this is the memory figure's workspace): the context `fc` output, its norm and inverse RMS
//! (`T·(2·H + 1)`); per layer, for the context rows, `k` before and after its norm and RoPE, `v` and the `k_norm`
//! inverse RMS (`T·(3·kv·hd + kv)`), for the block rows the residual in and after attention, both norms'
//! outputs (`4·H`), `q` before and after norm and RoPE and the attention output (`3·nh·hd`), the block's `k`
//! and `v` (`3·kv·hd`), SwiGLU's `gate|up` and activation (`3·I`), the log-sum-exp and the four inverse RMS
//! (`2·nh + kv + 2`); after the last layer the residual, the final norm and its inverse RMS (`Q·(2·H + 1)`);
//! the embedded block rows (`Q·H`). The backward scratch is one layer's worth of the block rows' gradients
//! (`Q·(4·H + 3·nh·hd + 3·kv·hd + 3·I)`) and the context's `dk`, `dv` and the gradient flowing into the
//! context (`T·(2·kv·hd + 2·H)`); the fused loss holds one `C × V` logits chunk (`C = min(chunk_tokens, R)`)
//! and per-row labels, weights and losses (`3·R`); the block plan holds token ids, positions, query ranges and
//! key ranges (`Q·8 + T·3` `u32`). The input slots are the queue item's tensors (`T·(Lt·H + 2) + N`), one on
//! the CPU and two on CUDA, and CUDA adds cuBLAS's workspace.

use super::{F32, fit, wide};
use crate::plan::{DflashSpec, LossSpec};
use crate::workspace::{BackendKind, CUBLAS_WORKSPACE_BYTES};

/// The shape of one bucket's step, in `u128` so no product overflows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DflashShape {
    /// Context rows `T = N·S`.
    pub context_rows: u128,
    /// Blocks per sequence `A = min(anchors, S − 1)`.
    pub blocks_per_sequence: u128,
    /// Block rows (queries) `Q = N·A·B`.
    pub block_rows: u128,
    /// Rows with a label `R = N·A·(B − 1)`.
    pub label_rows: u128,
    /// Unmasked (query, key) pairs per head, `Q·((S − 2)/2 + B)` (context keys averaged over anchors).
    pub attention_pairs: u128,
}

impl DflashShape {
    /// The step of `sequences` sequences of padded length `padded_len`.
    pub fn new(spec: &DflashSpec, padded_len: usize, sequences: usize) -> Self {
        let (n, s, b) = (wide(sequences), wide(padded_len), wide(spec.block));
        let a = wide(spec.anchors).min(s.saturating_sub(1));
        let q = n * a * b;
        Self {
            context_rows: n * s,
            blocks_per_sequence: a,
            block_rows: q,
            label_rows: n * a * (b - 1),
            // `(S − 2)/2` context keys per block, kept exact by doubling before halving.
            attention_pairs: q * (s.saturating_sub(2) + 2 * b) / 2,
        }
    }
}

/// FLOPs of one training step (module docs).
pub fn step_flops(spec: &DflashSpec, padded_len: usize, sequences: usize) -> Option<u64> {
    let shape = DflashShape::new(spec, padded_len, sequences);
    let (t, q, r) = (shape.context_rows, shape.block_rows, shape.label_rows);
    let (h, lt, ly) = (wide(spec.hidden), wide(spec.taps), wide(spec.layers));
    let (nh, kv, hd, i, v) = (
        wide(spec.heads),
        wide(spec.kv_heads),
        wide(spec.head_dim),
        wide(spec.intermediate),
        wide(spec.vocab),
    );
    let fc = 2 * t * lt * h * h;
    let context_kv = 2 * t * h * 2 * kv * hd;
    let block_qkvo = 2 * q * h * (2 * nh + 2 * kv) * hd;
    let block_mlp = 2 * q * 3 * i * h;
    let trained_forward = fc + ly * (context_kv + block_qkvo + block_mlp);
    let unneeded_input_grads = fc + 2 * q * h * (nh + 2 * kv) * hd;
    let attention = 4 * hd * nh * shape.attention_pairs;
    let lm_head = 2 * r * h * v;
    let p = wide(spec.parameter_count());
    let flops = 3 * trained_forward - unneeded_input_grads
        + ly * attention * 7 / 2
        + 2 * lm_head
        + 4 * r * v
        + 12 * p;
    fit(flops)
}

/// Bytes one training step moves through memory, a lower bound (module docs).
pub fn step_bytes(
    spec: &DflashSpec,
    padded_len: usize,
    sequences: usize,
    loss: &LossSpec,
) -> Option<u64> {
    let shape = DflashShape::new(spec, padded_len, sequences);
    let p = wide(spec.parameter_count());
    let (h, v) = (wide(spec.hidden), wide(spec.vocab));
    let activations = activation_floats(spec, &shape, loss);
    fit(F32
        * (10 * p + shape.block_rows * h + 2 * v * h + 2 * activations + 2 * shape.label_rows * v))
}

/// Floats of the activations kept for the backward pass, the backward scratch and the loss (module docs).
fn activation_floats(spec: &DflashSpec, shape: &DflashShape, loss: &LossSpec) -> u128 {
    let (t, q, r) = (shape.context_rows, shape.block_rows, shape.label_rows);
    let (h, ly) = (wide(spec.hidden), wide(spec.layers));
    let (nh, kv, hd, i, v) = (
        wide(spec.heads),
        wide(spec.kv_heads),
        wide(spec.head_dim),
        wide(spec.intermediate),
        wide(spec.vocab),
    );
    let context = t * (2 * h + 1);
    let per_layer_context = t * (3 * kv * hd + kv);
    let per_layer_block = q * (4 * h + 3 * nh * hd + 3 * kv * hd + 3 * i + 2 * nh + kv + 2);
    let final_rows = q * (2 * h + 1) + q * h;
    let scratch = q * (4 * h + 3 * nh * hd + 3 * kv * hd + 3 * i) + t * (2 * kv * hd + 2 * h);
    let chunk = wide(loss.chunk_tokens).clamp(1, r.max(1));
    let loss_floats = chunk * v + 3 * r;
    context + ly * (per_layer_context + per_layer_block) + final_rows + scratch + loss_floats
}

/// Bytes of one worker's workspace for the largest of `buckets` (`(padded_len, sequences)` pairs): activations,
/// scratch, loss, block plan and input slots, plus cuBLAS's workspace on CUDA (module docs).
pub fn workspace_bytes(
    spec: &DflashSpec,
    buckets: &[(usize, usize)],
    loss: &LossSpec,
    backend: BackendKind,
) -> Option<u64> {
    let mut most = 0u128;
    let slots = match backend {
        BackendKind::Cpu => 1,
        BackendKind::Cuda => 2,
    };
    for &(padded_len, sequences) in buckets {
        let shape = DflashShape::new(spec, padded_len, sequences);
        let (t, q) = (shape.context_rows, shape.block_rows);
        let input = t * (F32 * wide(spec.taps) * wide(spec.hidden) + 4 + 1) + 4 * wide(sequences);
        let block_plan = 4 * (q * 8 + t * 3);
        let bytes = F32 * activation_floats(spec, &shape, loss) + block_plan + slots * input;
        most = most.max(bytes);
    }
    if backend == BackendKind::Cuda {
        most += wide(CUBLAS_WORKSPACE_BYTES);
    }
    fit(most)
}

/// Bytes of the frozen embedding and `lm_head`, held as f32 whatever the checkpoint's dtype (a tied `lm_head`
/// is a second copy, so the figure does not depend on the checkpoint).
pub fn frozen_bytes(spec: &DflashSpec) -> Option<u64> {
    fit(2 * F32 * wide(spec.vocab) * wide(spec.hidden))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::DFLASH_RMS_NORM_EPS;

    fn spec() -> DflashSpec {
        DflashSpec {
            hidden: 64,
            taps: 3,
            tap_layers: vec![1, 2, 3],
            vocab: 512,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            intermediate: 128,
            block: 4,
            anchors: 8,
            mask_token: 511,
            rope_theta: 10000.0,
            rms_norm_eps: DFLASH_RMS_NORM_EPS,
        }
    }

    #[test]
    fn attention_counts_only_the_unmasked_pairs() {
        // 2 sequences of 10: anchors capped at 8 per sequence, Q = 2·8·4 = 64; each block sees (10 − 2)/2 = 4
        // context keys on average and its 4 own keys.
        let shape = DflashShape::new(&spec(), 10, 2);
        assert_eq!(shape.block_rows, 64);
        assert_eq!(shape.label_rows, 48);
        assert_eq!(shape.attention_pairs, 64 * (4 + 4));
        // Fewer positions than anchors: one block per valid anchor position.
        assert_eq!(DflashShape::new(&spec(), 5, 1).blocks_per_sequence, 4);
        assert_eq!(DflashShape::new(&spec(), 1, 3).block_rows, 0);
    }

    #[test]
    fn activations_grow_linearly_with_the_context_at_fixed_anchors() {
        let loss = LossSpec {
            head_decay: 1.0,
            position_decay: Some(7.0),
            chunk_tokens: 1024,
        };
        let bytes = |len: usize| {
            workspace_bytes(&spec(), &[(len, 1)], &loss, BackendKind::Cpu).unwrap() as i128
        };
        // Past `anchors + 1` positions the blocks stop growing: equal steps in length add equal bytes.
        let (a, b, c) = (bytes(1000), bytes(2000), bytes(3000));
        assert_eq!(b - a, c - b);
        assert!(b > a);
    }
}
