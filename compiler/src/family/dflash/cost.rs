//! The `dflash` drafter's cost: FLOPs and bytes of one step, and the frozen tables' memory. Its workspace is
//! the model's [`WorkspaceLayout::dflash`], which the memory figure, the bytes bound below and both allocators
//! read.
//!
//! Notation (one bucket): `N` sequences of padded length `S`, `T = N·S` context rows, `A` blocks per sequence
//! ([`DflashSpec::block_slots`]: `anchors`, fewer when the bucket has fewer anchor positions), `B` slots per
//! block, `Q = N·A·B` block rows (the queries), `H` width, `Lt` tapped layers, `Ly` decoder layers, `nh`/`kv`
//! query/key-value heads of width `hd`, `I` intermediate, `V` vocabulary, `P` trained parameters, `C` rows per
//! logits chunk.
//!
//! **Attention pairs.** A query of block `j` sees the context keys before its anchor `a_j` and the `B` keys of
//! its own block. Anchors are drawn uniformly from the valid positions `0..S−1`, so a block sees
//! `(S − 2)/2` context keys on average: `pairs = Q·((S − 2)/2 + B)` (query, key) pairs per head, against
//! `Q·(T + Q)` for a dense mask. The score matrix is never stored: only its log-sum-exp, `Q·nh` floats.
//!
//! **FLOPs of one step.** Matrix products, forward: `fc` `2·T·Lt·H·H`; per layer the context's `k_proj` and
//! `v_proj` `2·T·H·2·kv·hd`, the block rows' `q/k/v/o` `2·Q·H·(2·nh + 2·kv)·hd` and SwiGLU `2·Q·3·I·H`;
//! attention `4·hd·nh·pairs` (scores and values); the frozen `lm_head` `2·Q·H·V` (every block row goes through
//! it; slot 0's rows have no label and get no gradient). Backward: twice the forward for every trained matrix,
//! less the input gradients nobody needs (of `fc`, whose input is data, and of layer 0's block-row `q/k/v`,
//! whose input is the frozen embedding); attention `2.5×` its forward (scores recomputed from the log-sum-exp,
//! then `dV`, `dP`, `dQ`, `dK`); the `lm_head` only its input gradient (its weight is frozen). The fused loss
//! costs `4·Q·V` (max, exp, sum, gradient per logit) and AdamW `12·P`. Norms, RoPE and SwiGLU's element-wise
//! work are `O((T + Q)·H)` and left out.
//!
//! **Bytes of one step** (lower bound): parameters read forward and backward, gradients written, AdamW reading
//! `p, g, m, v` and writing `p, m, v` (`10·P` floats); the gathered embedding rows (`Q·H`); the `lm_head` read
//! whole once per logits chunk, forward and backward (`2·⌈Q/C⌉·V·H`); every workspace buffer of the bucket
//! written once and read once; every logit chunk written once and read once (`2·Q·V`). All f32.
//!
//! **Frozen tables.** The target's embedding and `lm_head` are held as f32 whatever the checkpoint's dtype, two
//! `V × H` tables per worker (a tied head is a second copy, so the figure does not depend on the checkpoint).

use crate::cost::arith::{F32, fit, wide};
use crate::family::dflash::DflashSpec;
use crate::plan::derived::BucketPlan;
use crate::plan::stages::{LossSpec, Precision};
use crate::workspace::{BackendKind, WorkspaceLayout};

/// The shape of one bucket's step, in `u128` so no product overflows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DflashShape {
    /// Context rows `T = N·S`.
    pub context_rows: u128,
    /// Blocks per sequence `A`.
    pub blocks_per_sequence: u128,
    /// Block rows (queries) `Q = N·A·B`.
    pub block_rows: u128,
    /// Unmasked (query, key) pairs per head, `Q·((S − 2)/2 + B)` (context keys averaged over anchors).
    pub attention_pairs: u128,
}

impl DflashShape {
    /// The step of `sequences` sequences of padded length `padded_len`.
    pub fn new(spec: &DflashSpec, padded_len: usize, sequences: usize) -> Self {
        let (n, s, b) = (wide(sequences), wide(padded_len), wide(spec.block));
        let a = wide(spec.block_slots(padded_len));
        let q = n * a * b;
        Self {
            context_rows: n * s,
            blocks_per_sequence: a,
            block_rows: q,
            // `(S − 2)/2` context keys per block, kept exact by doubling before halving.
            attention_pairs: q * (s.saturating_sub(2) + 2 * b) / 2,
        }
    }
}

/// FLOPs of one training step (module docs).
pub fn step_flops(spec: &DflashSpec, padded_len: usize, sequences: usize) -> Option<u64> {
    let shape = DflashShape::new(spec, padded_len, sequences);
    let (t, q) = (shape.context_rows, shape.block_rows);
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
    let lm_head = 2 * q * h * v;
    let p = wide(spec.parameter_count());
    let flops = 3 * trained_forward - unneeded_input_grads
        + ly * attention * 7 / 2
        + 2 * lm_head
        + 4 * q * v
        + 12 * p;
    fit(flops)
}

/// Bytes one training step of `bucket` moves through memory, a lower bound (module docs).
pub fn step_bytes(spec: &DflashSpec, bucket: &BucketPlan, loss: &LossSpec) -> Option<u64> {
    let shape = DflashShape::new(spec, bucket.padded_len, bucket.sequences);
    let q = shape.block_rows;
    let p = wide(spec.parameter_count());
    let (h, v) = (wide(spec.hidden), wide(spec.vocab));
    let layout = WorkspaceLayout::dflash(
        spec,
        std::slice::from_ref(bucket),
        loss,
        BackendKind::Cpu,
        Precision::F32,
    )?;
    let workspace = u128::from(layout.bytes()?);
    let chunks = q.div_ceil(wide(layout.chunk_rows).max(1));
    fit(F32 * (10 * p + q * h + 2 * chunks * v * h + 2 * q * v) + 2 * workspace)
}

/// Bytes of the frozen embedding and `lm_head`, held as f32 (module docs).
pub fn frozen_bytes(spec: &DflashSpec) -> Option<u64> {
    fit(2 * F32 * wide(spec.vocab) * wide(spec.hidden))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::family::dflash::DFLASH_RMS_NORM_EPS;

    /// The small spec the cost tests and the GPU kernel list's tests (`super::super::gpu`) count by hand.
    pub(crate) fn spec() -> DflashSpec {
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
        assert_eq!(shape.attention_pairs, 64 * (4 + 4));
        // Fewer positions than anchors: one block per anchor position.
        assert_eq!(DflashShape::new(&spec(), 5, 1).blocks_per_sequence, 4);
    }

    #[test]
    fn attention_flops_grow_linearly_with_the_context_at_fixed_anchors() {
        // Past `anchors + 1` positions the blocks stop growing: only the context terms (fc, context K/V and
        // the attention's context keys) grow, each linearly in S.
        let flops = |len: usize| i128::from(step_flops(&spec(), len, 1).unwrap());
        let (a, b, c) = (flops(1000), flops(2000), flops(3000));
        assert_eq!(b - a, c - b);
        assert!(b > a);
    }
}
