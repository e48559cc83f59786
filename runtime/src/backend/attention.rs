//! The arguments of the attention operations ([`super::Backend::attention_forward`] and
//! [`super::Backend::attention_backward`]): head counts and scale, the read views of the queries and of both
//! key/value sets (f32, or the flash path's bf16 copies), the gradient views, and the size checks every
//! attention operation (f32 or flash, `operations.rs` and `flash.rs`) runs before a launch.
//!
//! ```text
//!  q [Q, heads, hd]            k_ctx, v_ctx [T, kv_heads, hd]    k_blk, v_blk [Q, kv_heads, hd]
//!  query_ranges [Q, 4]: query r sees context keys [r][0]..[r][1] and block keys [r][2]..[r][3]
//!  backward only: key_ranges_ctx [T, 2], key_ranges_blk [Q, 2]: the query rows that see each key
//! ```

use super::{Backend, Dst, Element, Src};

/// Head counts, head dimension and the score scale of an attention call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionShape {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (grouped-query attention: `heads / kv_heads` query heads share one).
    pub kv_heads: usize,
    /// Elements per head (at most [`MAX_HEAD_DIM`]).
    pub head_dim: usize,
    /// The score scale (`1/sqrt(head_dim)` for Qwen3).
    pub scale: f32,
}

/// The largest head dimension the attention kernels hold in registers.
pub const MAX_HEAD_DIM: usize = draftpipe_gpu_kernels::plane::MAX_ROW;

/// Query rows and context rows of an attention call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionSizes {
    /// Query rows `Q` (also the block key rows).
    pub queries: usize,
    /// Context key rows `T`.
    pub context: usize,
}

impl AttentionShape {
    /// The shape with Qwen3's scale `1/sqrt(head_dim)`.
    pub fn new(heads: usize, kv_heads: usize, head_dim: usize) -> Self {
        Self {
            heads,
            kv_heads,
            head_dim,
            scale: 1.0 / (head_dim as f32).sqrt(),
        }
    }

    /// The rows of a call from its buffer lengths `[q, k_ctx, v_ctx, k_blk, v_blk, query_ranges]`.
    ///
    /// # Panics
    /// When the head counts are not `heads = g · kv_heads` with `head_dim ≤ MAX_HEAD_DIM` even, or a length
    /// disagrees with the layout (a bug in the model, which sizes every view from one plan).
    #[track_caller]
    pub fn sizes(&self, lens: [usize; 6]) -> AttentionSizes {
        let Self {
            heads,
            kv_heads,
            head_dim,
            ..
        } = *self;
        assert!(
            heads > 0
                && kv_heads > 0
                && heads.is_multiple_of(kv_heads)
                && head_dim > 0
                && head_dim <= MAX_HEAD_DIM,
            "attention: {heads} heads over {kv_heads} kv heads of {head_dim} (at most {MAX_HEAD_DIM})"
        );
        let [q, k_ctx, v_ctx, k_blk, v_blk, ranges] = lens;
        let queries = ranges / 4;
        let kv_row = kv_heads * head_dim;
        let context = k_ctx / kv_row;
        assert!(
            ranges == 4 * queries
                && q == queries * heads * head_dim
                && k_ctx == context * kv_row
                && v_ctx == k_ctx
                && k_blk == queries * kv_row
                && v_blk == k_blk,
            "attention: views [q {q}, k_ctx {k_ctx}, v_ctx {v_ctx}, k_blk {k_blk}, v_blk {v_blk}, ranges \
             {ranges}] do not fit {heads}/{kv_heads} heads of {head_dim}"
        );
        AttentionSizes { queries, context }
    }
}

/// What attention reads: the queries, both key/value sets and each query's two key ranges; `T` is `f32` for
/// the f32 kernels and `half::bf16` for the flash kernels' copies (`backend/flash.rs`).
pub struct AttentionInputs<'a, B: Backend, T: Element = f32> {
    /// Queries `[Q, heads, head_dim]` (after RoPE).
    pub q: Src<'a, B, T>,
    /// Context keys `[T, kv_heads, head_dim]`.
    pub k_ctx: Src<'a, B, T>,
    /// Context values `[T, kv_heads, head_dim]`.
    pub v_ctx: Src<'a, B, T>,
    /// Block keys `[Q, kv_heads, head_dim]`.
    pub k_blk: Src<'a, B, T>,
    /// Block values `[Q, kv_heads, head_dim]`.
    pub v_blk: Src<'a, B, T>,
    /// `[Q, 4]`: context key range, then block key range, of each query (global row indices).
    pub query_ranges: Src<'a, B, u32>,
}

impl<B: Backend, T: Element> Clone for AttentionInputs<'_, B, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: Backend, T: Element> Copy for AttentionInputs<'_, B, T> {}

impl<B: Backend, T: Element> AttentionInputs<'_, B, T> {
    /// The lengths [`AttentionShape::sizes`] checks.
    pub fn lens(&self) -> [usize; 6] {
        [
            self.q.len(),
            self.k_ctx.len(),
            self.v_ctx.len(),
            self.k_blk.len(),
            self.v_blk.len(),
            self.query_ranges.len(),
        ]
    }
}

/// What the attention backward writes (overwritten, never accumulated).
pub struct AttentionGrads<'a, B: Backend> {
    /// `[Q, heads, head_dim]`.
    pub dq: Dst<'a, B, f32>,
    /// `[T, kv_heads, head_dim]`.
    pub dk_ctx: Dst<'a, B, f32>,
    /// `[T, kv_heads, head_dim]`.
    pub dv_ctx: Dst<'a, B, f32>,
    /// `[Q, kv_heads, head_dim]`.
    pub dk_blk: Dst<'a, B, f32>,
    /// `[Q, kv_heads, head_dim]`.
    pub dv_blk: Dst<'a, B, f32>,
}

/// What the attention backward reads besides the forward's inputs.
pub struct AttentionSaved<'a, B: Backend> {
    /// The forward's output `[Q, heads, head_dim]`.
    pub out: Src<'a, B, f32>,
    /// Its gradient `[Q, heads, head_dim]`.
    pub dout: Src<'a, B, f32>,
    /// The forward's log-sum-exp `[Q, heads]`.
    pub lse: Src<'a, B, f32>,
    /// `[T, 2]`: the contiguous range of query rows that see each context key.
    pub key_ranges_ctx: Src<'a, B, u32>,
    /// `[Q, 2]`: the contiguous range of query rows that see each block key.
    pub key_ranges_blk: Src<'a, B, u32>,
}

impl<B: Backend> Clone for AttentionSaved<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: Backend> Copy for AttentionSaved<'_, B> {}

/// Checks a forward call's outputs against its sizes: `out` as long as `q`, `lse` one per query row and head.
///
/// # Panics
/// When a length disagrees.
#[track_caller]
pub(crate) fn check_forward_lens(
    shape: &AttentionShape,
    sizes: AttentionSizes,
    q: usize,
    out: usize,
    lse: usize,
) {
    assert!(
        out == q && lse == sizes.queries * shape.heads,
        "attention forward: output sizes {out}, {lse} do not fit {sizes:?}, {shape:?}"
    );
}

/// Checks the backward's extra views against the sizes.
///
/// # Panics
/// When a length disagrees with the layout.
#[track_caller]
pub(crate) fn check_backward_lens(
    shape: &AttentionShape,
    sizes: AttentionSizes,
    saved: [usize; 5],
    delta: usize,
    grads: [usize; 5],
) {
    let AttentionSizes { queries, context } = sizes;
    let rows = queries * shape.heads;
    let q_len = rows * shape.head_dim;
    let kv_row = shape.kv_heads * shape.head_dim;
    assert!(
        saved == [q_len, q_len, rows, 2 * context, 2 * queries]
            && delta == rows
            && grads
                == [
                    q_len,
                    context * kv_row,
                    context * kv_row,
                    queries * kv_row,
                    queries * kv_row
                ],
        "attention_backward: views {saved:?}, delta {delta}, gradients {grads:?} do not fit {queries} queries, \
         {context} context rows, {shape:?}"
    );
}

/// The sizes of a forward call over views, its outputs checked ([`check_forward_lens`]).
///
/// # Panics
/// When a length disagrees with the layout (see [`AttentionShape::sizes`]).
#[track_caller]
pub(crate) fn check_forward<B: Backend, T: Element>(
    shape: &AttentionShape,
    inputs: &AttentionInputs<'_, B, T>,
    out: usize,
    lse: usize,
) -> AttentionSizes {
    let sizes = shape.sizes(inputs.lens());
    check_forward_lens(shape, sizes, inputs.q.len(), out, lse);
    sizes
}

/// The sizes of a backward call over views, every extra view checked ([`check_backward_lens`]).
///
/// # Panics
/// When a length disagrees with the layout.
#[track_caller]
pub(crate) fn check_backward<B: Backend, T: Element>(
    shape: &AttentionShape,
    inputs: &AttentionInputs<'_, B, T>,
    saved: &AttentionSaved<'_, B>,
    delta: usize,
    grads: &AttentionGrads<'_, B>,
) -> AttentionSizes {
    let sizes = shape.sizes(inputs.lens());
    check_backward_lens(
        shape,
        sizes,
        [
            saved.out.len(),
            saved.dout.len(),
            saved.lse.len(),
            saved.key_ranges_ctx.len(),
            saved.key_ranges_blk.len(),
        ],
        delta,
        [
            grads.dq.len(),
            grads.dk_ctx.len(),
            grads.dv_ctx.len(),
            grads.dk_blk.len(),
            grads.dv_blk.len(),
        ],
    );
    sizes
}
