//! The `mlp` drafter's cost: FLOPs and bytes of one step (its memory is the model's [`WorkspaceLayout::mlp`]
//! and the state buffers, counted in [`crate::cost::device_memory`]).
//!
//! Notation: `T` tokens in a step (sequences × padded length of the bucket), `din` the drafter's input width
//! (target hidden × tapped layers), `H` drafter hidden, `I` intermediate, `L` blocks, `heads`, `V` vocabulary,
//! `P` the parameter count ([`MlpSpec::parameter_count`]), `A` activation floats per token. All tensors are f32.
//!
//! **FLOPs of one step**: `6·T·(H·din + L·3·I·H + heads·H² + heads·H·V) − 2·T·H·din + 4·T·heads·V + 12·P`
//! (GEMMs forward and backward, the first layer needs no input gradient, the fused loss's max/exp/sum/gradient
//! per logit, AdamW's arithmetic per parameter). Norms and SwiGLU are O(T·H) and left out (under 1%).
//!
//! **Bytes of one step** (lower bound): `4·(10·P + 2·T·A + 2·T·heads·V)`: parameters read forward and
//! backward, gradients written, AdamW reading p, g, m, v and writing p, m, v; activations written once and read
//! once; every logit chunk written once and read once.
//!
//! [`WorkspaceLayout::mlp`]: crate::workspace::WorkspaceLayout::mlp

use crate::cost::arith::{F32, fit, wide};
use crate::family::mlp::MlpSpec;

/// Activation floats per token kept for the backward pass (`A` above).
pub fn activation_floats_per_token(spec: &MlpSpec) -> Option<u64> {
    let MlpSpec {
        din,
        hidden: h,
        blocks,
        intermediate: i,
        heads,
        ..
    } = *spec;
    let (din, h, blocks, i, heads) = (wide(din), wide(h), wide(blocks), wide(i), wide(heads));
    fit(din + blocks * (2 * h + 3 * i) + h + heads * 2 * h)
}

/// FLOPs of one training step of `tokens` tokens (formula in the module docs).
pub fn step_flops(spec: &MlpSpec, tokens: usize) -> Option<u64> {
    let MlpSpec {
        din,
        hidden: h,
        blocks,
        intermediate: i,
        heads,
        vocab: v,
    } = *spec;
    let (din, h, blocks, i, heads, v) = (
        wide(din),
        wide(h),
        wide(blocks),
        wide(i),
        wide(heads),
        wide(v),
    );
    let (t, p) = (wide(tokens), wide(spec.parameter_count()));
    let gemm = h * din + blocks * 3 * i * h + heads * h * h + heads * h * v;
    fit(6 * t * gemm - 2 * t * h * din + 4 * t * heads * v + 12 * p)
}

/// Bytes one training step moves through memory, a lower bound (formula in the module docs).
pub fn step_bytes(spec: &MlpSpec, tokens: usize) -> Option<u64> {
    let (t, p) = (wide(tokens), wide(spec.parameter_count()));
    let activations = u128::from(activation_floats_per_token(spec)?);
    fit(F32 * (10 * p + 2 * t * activations + 2 * t * wide(spec.heads) * wide(spec.vocab)))
}
