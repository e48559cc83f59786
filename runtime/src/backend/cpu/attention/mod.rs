//! Attention on the host over slices, after checking every range against its key set, so a wrong block plan
//! fails with a message instead of reading the wrong rows. Two implementations of the same mathematics:
//!
//! ```text
//!  HostKernels::Lanes   lanes.rs: a tile of rows is the CPU's vector (what the CPU backend's step runs)
//!  HostKernels::Planes  the kernel table's bodies (draftpipe_gpu_kernels::attention), the GPU's code, through
//!                       the generated host launchers (what the kernel tests also check on the host)
//! ```

mod lanes;

use super::kernels::launch;
use crate::backend::attention::{
    AttentionShape, AttentionSizes, check_backward_lens, check_forward_lens,
};

/// What attention reads, as host slices (see [`crate::backend::attention::AttentionInputs`]).
#[derive(Clone, Copy)]
pub struct AttentionSlices<'a> {
    /// Queries `[Q, heads, head_dim]`.
    pub q: &'a [f32],
    /// Context keys `[T, kv_heads, head_dim]`.
    pub k_ctx: &'a [f32],
    /// Context values.
    pub v_ctx: &'a [f32],
    /// Block keys `[Q, kv_heads, head_dim]`.
    pub k_blk: &'a [f32],
    /// Block values.
    pub v_blk: &'a [f32],
    /// `[Q, 4]` key ranges per query.
    pub query_ranges: &'a [u32],
}

impl AttentionSlices<'_> {
    fn sizes(&self, shape: &AttentionShape) -> AttentionSizes {
        let sizes = shape.sizes([
            self.q.len(),
            self.k_ctx.len(),
            self.v_ctx.len(),
            self.k_blk.len(),
            self.v_blk.len(),
            self.query_ranges.len(),
        ]);
        for (r, range) in self.query_ranges.chunks_exact(4).enumerate() {
            assert!(
                range[0] <= range[1]
                    && range[1] as usize <= sizes.context
                    && range[2] <= range[3]
                    && range[3] as usize <= sizes.queries,
                "attention: query {r} has key ranges {range:?} outside {} context and {} block rows",
                sizes.context,
                sizes.queries
            );
        }
        sizes
    }
}

/// The attention backward's outputs, as host slices (overwritten).
pub struct AttentionGradSlices<'a> {
    /// `[Q, heads, head_dim]`.
    pub dq: &'a mut [f32],
    /// `[T, kv_heads, head_dim]`.
    pub dk_ctx: &'a mut [f32],
    /// `[T, kv_heads, head_dim]`.
    pub dv_ctx: &'a mut [f32],
    /// `[Q, kv_heads, head_dim]`.
    pub dk_blk: &'a mut [f32],
    /// `[Q, kv_heads, head_dim]`.
    pub dv_blk: &'a mut [f32],
}

/// Which attention code runs on the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostKernels {
    /// Vectorised over a tile of rows (`lanes.rs`): the CPU backend's.
    Lanes,
    /// The kernel table's bodies, which the GPU runs.
    Planes,
}

impl AttentionSlices<'_> {
    fn lanes(&self, shape: AttentionShape, sizes: AttentionSizes) -> lanes::Inputs {
        lanes::Inputs {
            q: self.q.as_ptr(),
            k: [self.k_ctx.as_ptr(), self.k_blk.as_ptr()],
            v: [self.v_ctx.as_ptr(), self.v_blk.as_ptr()],
            query_ranges: self.query_ranges.as_ptr(),
            keys: [sizes.context, sizes.queries],
            queries: sizes.queries,
            shape,
        }
    }
}

/// Attention forward: `out [Q, heads, head_dim]` and `lse [Q, heads]`.
///
/// # Panics
/// On sizes that disagree with `shape` or a key range outside its key set.
pub fn attention_forward(
    kernels: HostKernels,
    inputs: AttentionSlices<'_>,
    shape: AttentionShape,
    out: &mut [f32],
    lse: &mut [f32],
) {
    let sizes = inputs.sizes(&shape);
    let AttentionSizes { queries, context } = sizes;
    check_forward_lens(&shape, sizes, inputs.q.len(), out.len(), lse.len());
    if kernels == HostKernels::Lanes {
        // SAFETY: `sizes` checked every input against `shape`, and the outputs' lengths above; the outputs are
        // unique borrows.
        unsafe {
            lanes::forward(
                inputs.lanes(shape, sizes),
                out.as_mut_ptr(),
                lse.as_mut_ptr(),
            )
        };
        return;
    }
    let AttentionShape {
        heads,
        kv_heads,
        head_dim,
        scale,
    } = shape;
    launch::attention_forward(
        inputs.q,
        inputs.k_ctx,
        inputs.v_ctx,
        inputs.k_blk,
        inputs.v_blk,
        inputs.query_ranges,
        out,
        lse,
        queries,
        context,
        heads,
        kv_heads,
        head_dim,
        scale,
    );
}

/// Attention backward: `delta = rowsum(dout ∘ out)` into the scratch `delta [Q, heads]`, then the query-major
/// pass for `dq` and the key-major pass over each key set for its key and value gradients.
///
/// # Panics
/// On sizes that disagree with `shape`, a key range outside its key set, or a key range that disagrees with
/// the query ranges (a query that sees a key must be in that key's range and the converse: checked at the
/// ranges' two ends).
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    kernels: HostKernels,
    inputs: AttentionSlices<'_>,
    shape: AttentionShape,
    out: &[f32],
    dout: &[f32],
    lse: &[f32],
    key_ranges_ctx: &[u32],
    key_ranges_blk: &[u32],
    delta: &mut [f32],
    grads: AttentionGradSlices<'_>,
) {
    let sizes = inputs.sizes(&shape);
    let AttentionSizes { queries, context } = sizes;
    check_backward_lens(
        &shape,
        sizes,
        [
            out.len(),
            dout.len(),
            lse.len(),
            key_ranges_ctx.len(),
            key_ranges_blk.len(),
        ],
        delta.len(),
        [
            grads.dq.len(),
            grads.dk_ctx.len(),
            grads.dv_ctx.len(),
            grads.dk_blk.len(),
            grads.dv_blk.len(),
        ],
    );
    check_key_ranges(inputs.query_ranges, 0, key_ranges_ctx, "context");
    check_key_ranges(inputs.query_ranges, 2, key_ranges_blk, "block");
    let AttentionShape {
        heads,
        kv_heads,
        head_dim,
        scale,
    } = shape;
    launch::attention_delta(out, dout, delta, head_dim, queries * heads);
    if kernels == HostKernels::Lanes {
        let saved = lanes::Saved {
            dout: dout.as_ptr(),
            lse: lse.as_ptr(),
            delta: delta.as_ptr(),
            key_ranges: [key_ranges_ctx.as_ptr(), key_ranges_blk.as_ptr()],
        };
        // SAFETY: `check_backward_lens` checked every buffer against `shape`; the gradients are unique borrows.
        unsafe {
            lanes::backward(
                inputs.lanes(shape, sizes),
                saved,
                grads.dq.as_mut_ptr(),
                [
                    (grads.dk_ctx.as_mut_ptr(), grads.dv_ctx.as_mut_ptr()),
                    (grads.dk_blk.as_mut_ptr(), grads.dv_blk.as_mut_ptr()),
                ],
            );
        }
        return;
    }
    launch::attention_backward_q(
        inputs.q,
        inputs.k_ctx,
        inputs.v_ctx,
        inputs.k_blk,
        inputs.v_blk,
        inputs.query_ranges,
        dout,
        lse,
        delta,
        grads.dq,
        queries,
        context,
        heads,
        kv_heads,
        head_dim,
        scale,
    );
    for (keys, k, v, ranges, dk, dv) in [
        (
            context,
            inputs.k_ctx,
            inputs.v_ctx,
            key_ranges_ctx,
            grads.dk_ctx,
            grads.dv_ctx,
        ),
        (
            queries,
            inputs.k_blk,
            inputs.v_blk,
            key_ranges_blk,
            grads.dk_blk,
            grads.dv_blk,
        ),
    ] {
        launch::attention_backward_kv(
            inputs.q, dout, lse, delta, k, v, ranges, dk, dv, keys, queries, heads, kv_heads,
            head_dim, scale,
        );
    }
}

/// Checks each key's query range against the query ranges (`set` 0: context, 2: block columns of
/// `query_ranges`): every query of the range sees the key, and the queries just outside it do not.
fn check_key_ranges(query_ranges: &[u32], set: usize, key_ranges: &[u32], what: &str) {
    let queries = query_ranges.len() / 4;
    let sees = |r: usize, key: usize| {
        let range = &query_ranges[4 * r + set..][..2];
        (range[0] as usize..range[1] as usize).contains(&key)
    };
    for (key, range) in key_ranges.chunks_exact(2).enumerate() {
        let (start, end) = (range[0] as usize, range[1] as usize);
        let consistent = start <= end
            && end <= queries
            && (start..end).all(|r| sees(r, key))
            && (start == 0 || !sees(start - 1, key))
            && (end == queries || !sees(end, key));
        assert!(
            consistent,
            "attention_backward: {what} key {key} has query range {start}..{end}, which disagrees with the \
             query ranges"
        );
    }
}
