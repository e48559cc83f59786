//! Attention with two key ranges per query (DFlash's mask), grouped-query heads, a tiled online softmax and
//! the log-sum-exp saved for the backward: the `[queries × keys]` score matrix never exists, and keys outside
//! a query tile's ranges are never read.
//!
//! ```text
//!  forward    attention_forward     plane per (query tile, head): keys of both ranges one by one, online
//!                                   softmax (running max m, sum l, accumulator), out = acc / l, lse = m + ln l
//!  backward   attention_delta       plane per (query, head): delta = Σ dout ∘ out
//!             attention_backward_q  plane per (query tile, head): dq = scale · Σ_k p (dout·v − delta) k
//!             attention_backward_kv plane per (key tile, kv head), once for the context keys and once for the
//!                                   block keys: dv = Σ_q p dout, dk = scale · Σ_q p (dout·v − delta) q
//! ```
//!
//! Layouts (row-major, f32): queries `q [Q, heads, head_dim]`; context keys and values `[T, kv_heads,
//! head_dim]`; block keys and values `[Q, kv_heads, head_dim]` (one per query row: a DFlash block's rows are
//! its queries and its own keys); `query_ranges [Q, 4]`: query `r` sees context keys
//! `query_ranges[r][0]..query_ranges[r][1]` and block keys `query_ranges[r][2]..query_ranges[r][3]`; head `h`
//! reads kv head `h / (heads / kv_heads)`. The backward's key-major pass reads, per key, the contiguous range of
//! query rows that see it (`key_ranges [keys, 2]`), which the caller derives from the same mask.
//!
//! Probabilities are `p = exp(scale · q·k − lse)`; the backward recomputes the scores with the same operations in
//! the same order as the forward, so `p` sums to 1 over a query's keys up to the rounding of `lse`. Every output
//! element is written by exactly one plane (no atomics): the results are deterministic. A query with no key
//! at all outputs zeros, `lse = −∞` and zero gradients.
//!
//! A plane keeps its rows in registers ([`Plane::Row`]), so `head_dim ≤ MAX_ROW` (128); the launchers reject
//! larger heads.

use crate::plane::{MAX_ROW, Plane};

/// Query rows per plane in the query-major kernels: their key loads are shared (a DFlash block's rows have the
/// same ranges, so a tile inside a block wastes nothing).
pub const QUERY_TILE: usize = 8;

/// Keys per plane in the key-major kernel.
pub const KEY_TILE: usize = 4;

/// Runs `body` once per query of a tile with `t` bound to the constants `0..QUERY_TILE`: written out, not a
/// loop, so a tile's per-query rows are indexed by constants and stay in registers on the GPU (LLVM does not
/// fully unroll a loop whose body holds a warp reduction, and the arrays would go to local memory).
macro_rules! each_query {
    (|$t:ident| $body:block) => {{
        const _: () = assert!(QUERY_TILE == 8);
        each_query!(@ [0, 1, 2, 3, 4, 5, 6, 7] |$t| $body)
    }};
    (@ [$($i:literal),*] |$t:ident| $body:block) => {{
        $({
            let $t: usize = $i;
            $body
        })*
    }};
}

/// As `each_query!`, over the keys of a key tile.
macro_rules! each_key {
    (|$t:ident| $body:block) => {{
        const _: () = assert!(KEY_TILE == 4);
        each_query!(@ [0, 1, 2, 3] |$t| $body)
    }};
}

/// `[start, end)` of a range pair at `ranges`, clamped so `start ≤ end ≤ limit` (the device must not read
/// outside a buffer whatever the ranges say; the host launchers check them).
///
/// # Safety
/// `ranges` points at two readable `u32`s.
#[inline(always)]
unsafe fn range_at(ranges: *const u32, limit: usize) -> (usize, usize) {
    // SAFETY: the caller's contract.
    let (start, end) = unsafe { (*ranges as usize, *ranges.add(1) as usize) };
    let end = if end < limit { end } else { limit };
    (if start < end { start } else { end }, end)
}

/// Whether the sizes are ones the kernels handle (checked by the launchers; a body returns early otherwise,
/// so a bad launch leaves its outputs untouched instead of reading out of bounds or dividing by zero).
#[inline(always)]
fn valid_heads(heads: usize, kv_heads: usize, head_dim: usize) -> bool {
    heads > 0 && kv_heads > 0 && heads.is_multiple_of(kv_heads) && head_dim <= MAX_ROW
}

/// Widens `(lo, hi)` to hold the range `(start, end)` when it is not empty (start from `(usize::MAX, 0)`;
/// an empty union stays `lo ≥ hi`, which a `lo..hi` loop skips).
#[inline(always)]
fn widen(union: &mut (usize, usize), (start, end): (usize, usize)) {
    if start < end {
        union.0 = if start < union.0 { start } else { union.0 };
        union.1 = if end > union.1 { end } else { union.1 };
    }
}

/// Query rows of a tile, each with its two ranges, its scaled query row and its online-softmax state.
struct ForwardTile<P: Plane> {
    ranges: [[(usize, usize); QUERY_TILE]; 2],
    unions: [(usize, usize); 2],
    q: [P::Row; QUERY_TILE],
    max: [f32; QUERY_TILE],
    sum: [f32; QUERY_TILE],
    acc: [P::Row; QUERY_TILE],
}

/// Folds the keys `lo..hi` of one key set into a tile's online softmax, query `t` taking key `j` only when `j`
/// lies in its range of this set.
///
/// # Safety
/// `keys` and `values` hold `hi` rows of `kv_heads · head_dim`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn forward_keys<P: Plane>(
    tile: &mut ForwardTile<P>,
    set: usize,
    keys: *const f32,
    values: *const f32,
    kv_heads: usize,
    group: usize,
    head_dim: usize,
    plane: P,
) {
    let (lo, hi) = tile.unions[set];
    let (mut k, mut v) = (plane.row_zero(), plane.row_zero());
    for j in lo..hi {
        let offset = (j * kv_heads + group) * head_dim;
        // SAFETY: `j < hi` rows; the kv head's row lies inside it.
        unsafe {
            plane.row_load_into(&mut k, head_dim, |d| *keys.add(offset + d));
            plane.row_load_into(&mut v, head_dim, |d| *values.add(offset + d));
        }
        each_query!(|t| {
            let (start, end) = tile.ranges[set][t];
            if start <= j && j < end {
                let s = plane.row_dot(&tile.q[t], &k, head_dim);
                // One `exp` per key: rescale only when the maximum grows (`s` is the same on every lane, so
                // the branch is uniform across a warp). A NaN score takes the second branch and poisons the row.
                if s > tile.max[t] {
                    let alpha = crate::math::exp(tile.max[t] - s);
                    tile.sum[t] = tile.sum[t] * alpha + 1.0;
                    plane.row_scale_add(&mut tile.acc[t], alpha, 1.0, &v, head_dim);
                    tile.max[t] = s;
                } else {
                    let p = crate::math::exp(s - tile.max[t]);
                    tile.sum[t] += p;
                    plane.row_scale_add(&mut tile.acc[t], 1.0, p, &v, head_dim);
                }
            }
        });
    }
}

/// Attention forward of query tile `tile` and head `head` (`index = tile · heads + head`): for each query row
/// `r` of the tile, `out[r, head] = Σ_k softmax_k(scale · q·k) v_k` over its keys (see the module docs) and
/// `lse[r, head] = log Σ_k e^(scale · q·k)`.
///
/// Launch: one plane per (tile of [`QUERY_TILE`] query rows, head): `ceil(Q / QUERY_TILE) · heads` planes.
///
/// # Safety
/// Buffers hold the module's layouts for `queries` rows, `context` context rows and these head counts.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn attention_forward<P: Plane>(
    q: *const f32,
    k_ctx: *const f32,
    v_ctx: *const f32,
    k_blk: *const f32,
    v_blk: *const f32,
    query_ranges: *const u32,
    out: *mut f32,
    lse: *mut f32,
    queries: usize,
    context: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    scale: f32,
    plane: P,
    index: usize,
) {
    if !valid_heads(heads, kv_heads, head_dim) {
        return;
    }
    let (first, head) = ((index / heads) * QUERY_TILE, index % heads);
    let group = head / (heads / kv_heads);
    let mut tile = ForwardTile::<P> {
        ranges: [[(0, 0); QUERY_TILE]; 2],
        unions: [(usize::MAX, 0); 2],
        q: [plane.row_zero(); QUERY_TILE],
        max: [f32::NEG_INFINITY; QUERY_TILE],
        sum: [0.0; QUERY_TILE],
        acc: [plane.row_zero(); QUERY_TILE],
    };
    // SAFETY: rows below `queries` lie inside `q`, `query_ranges`, `out` and `lse`; the ranges are clamped to
    // the key sets' lengths.
    unsafe {
        each_query!(|t| {
            let r = first + t;
            if r < queries {
                tile.ranges[0][t] = range_at(query_ranges.add(4 * r), context);
                tile.ranges[1][t] = range_at(query_ranges.add(4 * r + 2), queries);
                widen(&mut tile.unions[0], tile.ranges[0][t]);
                widen(&mut tile.unions[1], tile.ranges[1][t]);
                let row = q.add((r * heads + head) * head_dim);
                tile.q[t] = plane.row_load(head_dim, |d| *row.add(d) * scale);
            }
        });
        forward_keys(&mut tile, 0, k_ctx, v_ctx, kv_heads, group, head_dim, plane);
        forward_keys(&mut tile, 1, k_blk, v_blk, kv_heads, group, head_dim, plane);
        each_query!(|t| {
            let r = first + t;
            if r < queries {
                let sum = tile.sum[t];
                let inv = if sum > 0.0 { 1.0 / sum } else { 0.0 };
                let row = out.add((r * heads + head) * head_dim);
                plane.row_store(&tile.acc[t], head_dim, |d, a| *row.add(d) = a * inv);
                if plane.is_leader() {
                    *lse.add(r * heads + head) = if sum > 0.0 {
                        tile.max[t] + crate::math::ln(sum)
                    } else {
                        f32::NEG_INFINITY
                    };
                }
            }
        });
    }
}

/// `delta[i] = Σ_d dout[i, d] · out[i, d]` for row `i` of `[Q · heads, head_dim]` (the softmax backward's
/// row term).
///
/// Launch: one plane per (query, head): `Q · heads` planes.
///
/// # Safety
/// `out`, `dout` hold `(index + 1) · head_dim` elements, `delta` `index + 1`.
#[inline(always)]
pub unsafe fn attention_delta(
    out: *const f32,
    dout: *const f32,
    delta: *mut f32,
    head_dim: usize,
    plane: impl Plane,
    index: usize,
) {
    // SAFETY: the caller's contract.
    unsafe {
        let (o, g) = (out.add(index * head_dim), dout.add(index * head_dim));
        let value = plane.sum(head_dim, |d| *o.add(d) * *g.add(d));
        if plane.is_leader() {
            *delta.add(index) = value;
        }
    }
}

/// Query rows of a tile in the query gradient pass.
struct QueryGradTile<P: Plane> {
    ranges: [[(usize, usize); QUERY_TILE]; 2],
    unions: [(usize, usize); 2],
    q: [P::Row; QUERY_TILE],
    dout: [P::Row; QUERY_TILE],
    lse: [f32; QUERY_TILE],
    delta: [f32; QUERY_TILE],
    dq: [P::Row; QUERY_TILE],
}

/// Adds the keys `lo..hi` of one key set to a tile's query gradients.
///
/// # Safety
/// As [`forward_keys`].
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn query_grad_keys<P: Plane>(
    tile: &mut QueryGradTile<P>,
    set: usize,
    keys: *const f32,
    values: *const f32,
    kv_heads: usize,
    group: usize,
    head_dim: usize,
    plane: P,
) {
    let (lo, hi) = tile.unions[set];
    let (mut k, mut v) = (plane.row_zero(), plane.row_zero());
    for j in lo..hi {
        let offset = (j * kv_heads + group) * head_dim;
        // SAFETY: as in `forward_keys`.
        unsafe {
            plane.row_load_into(&mut k, head_dim, |d| *keys.add(offset + d));
            plane.row_load_into(&mut v, head_dim, |d| *values.add(offset + d));
        }
        each_query!(|t| {
            let (start, end) = tile.ranges[set][t];
            if start <= j && j < end {
                let p = crate::math::exp(plane.row_dot(&tile.q[t], &k, head_dim) - tile.lse[t]);
                let ds = p * (plane.row_dot(&tile.dout[t], &v, head_dim) - tile.delta[t]);
                plane.row_scale_add(&mut tile.dq[t], 1.0, ds, &k, head_dim);
            }
        });
    }
}

/// Query gradient of tile `tile` and head `head` (`index = tile · heads + head`):
/// `dq[r, head] = scale · Σ_k p_k (dout·v_k − delta) k_k` over the query's keys, overwritten.
///
/// Launch: as [`attention_forward`].
///
/// # Safety
/// As [`attention_forward`]; `dout`, `dq` hold `q`'s layout, `lse` and `delta` `[Q, heads]`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn attention_backward_q<P: Plane>(
    q: *const f32,
    k_ctx: *const f32,
    v_ctx: *const f32,
    k_blk: *const f32,
    v_blk: *const f32,
    query_ranges: *const u32,
    dout: *const f32,
    lse: *const f32,
    delta: *const f32,
    dq: *mut f32,
    queries: usize,
    context: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    scale: f32,
    plane: P,
    index: usize,
) {
    if !valid_heads(heads, kv_heads, head_dim) {
        return;
    }
    let (first, head) = ((index / heads) * QUERY_TILE, index % heads);
    let group = head / (heads / kv_heads);
    let mut tile = QueryGradTile::<P> {
        ranges: [[(0, 0); QUERY_TILE]; 2],
        unions: [(usize::MAX, 0); 2],
        q: [plane.row_zero(); QUERY_TILE],
        dout: [plane.row_zero(); QUERY_TILE],
        lse: [0.0; QUERY_TILE],
        delta: [0.0; QUERY_TILE],
        dq: [plane.row_zero(); QUERY_TILE],
    };
    // SAFETY: as in `attention_forward`.
    unsafe {
        each_query!(|t| {
            let r = first + t;
            if r < queries {
                tile.ranges[0][t] = range_at(query_ranges.add(4 * r), context);
                tile.ranges[1][t] = range_at(query_ranges.add(4 * r + 2), queries);
                widen(&mut tile.unions[0], tile.ranges[0][t]);
                widen(&mut tile.unions[1], tile.ranges[1][t]);
                let at = (r * heads + head) * head_dim;
                tile.q[t] = plane.row_load(head_dim, |d| *q.add(at + d) * scale);
                tile.dout[t] = plane.row_load(head_dim, |d| *dout.add(at + d));
                tile.lse[t] = *lse.add(r * heads + head);
                tile.delta[t] = *delta.add(r * heads + head);
            }
        });
        query_grad_keys(&mut tile, 0, k_ctx, v_ctx, kv_heads, group, head_dim, plane);
        query_grad_keys(&mut tile, 1, k_blk, v_blk, kv_heads, group, head_dim, plane);
        each_query!(|t| {
            let r = first + t;
            if r < queries {
                let row = dq.add((r * heads + head) * head_dim);
                plane.row_store(&tile.dq[t], head_dim, |d, g| *row.add(d) = g * scale);
            }
        });
    }
}

/// Key and value gradients of key tile `tile` and kv head `group` (`index = tile · kv_heads + group`) of one
/// key set (the context keys, or the block keys): for each key `j` of the tile and each query row `r` in
/// `key_ranges[j]` and head `h` of the group, with `p = exp(scale · q·k − lse[r, h])`:
/// `dv[j] = Σ p · dout[r, h]`, `dk[j] = scale · Σ p (dout[r, h]·v_j − delta[r, h]) q[r, h]`, overwritten.
///
/// Launch: one plane per (tile of [`KEY_TILE`] keys, kv head): `ceil(keys / KEY_TILE) · kv_heads` planes.
///
/// # Safety
/// `q`, `dout` hold `[queries, heads, head_dim]`, `lse`, `delta` `[queries, heads]`, `k`, `v`, `dk`, `dv`
/// `[keys, kv_heads, head_dim]`, `key_ranges` `[keys, 2]`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn attention_backward_kv<P: Plane>(
    q: *const f32,
    dout: *const f32,
    lse: *const f32,
    delta: *const f32,
    k: *const f32,
    v: *const f32,
    key_ranges: *const u32,
    dk: *mut f32,
    dv: *mut f32,
    keys: usize,
    queries: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    scale: f32,
    plane: P,
    index: usize,
) {
    if !valid_heads(heads, kv_heads, head_dim) {
        return;
    }
    let (first, group) = ((index / kv_heads) * KEY_TILE, index % kv_heads);
    let per_group = heads / kv_heads;
    let mut ranges = [(0usize, 0usize); KEY_TILE];
    let mut k_rows = [plane.row_zero(); KEY_TILE];
    let mut v_rows = [plane.row_zero(); KEY_TILE];
    let mut dk_rows = [plane.row_zero(); KEY_TILE];
    let mut dv_rows = [plane.row_zero(); KEY_TILE];
    // SAFETY: keys below `keys` lie inside `k`, `v`, `dk`, `dv`, `key_ranges`; query rows are clamped to
    // `queries`, inside `q`, `dout`, `lse`, `delta`.
    unsafe {
        let mut union = (usize::MAX, 0);
        each_key!(|t| {
            let j = first + t;
            if j < keys {
                ranges[t] = range_at(key_ranges.add(2 * j), queries);
                widen(&mut union, ranges[t]);
                let at = (j * kv_heads + group) * head_dim;
                k_rows[t] = plane.row_load(head_dim, |d| *k.add(at + d));
                v_rows[t] = plane.row_load(head_dim, |d| *v.add(at + d));
            }
        });
        let (lo, hi) = union;
        let (mut q_row, mut dout_row) = (plane.row_zero(), plane.row_zero());
        for head in group * per_group..(group + 1) * per_group {
            for r in lo..hi {
                let at = (r * heads + head) * head_dim;
                plane.row_load_into(&mut q_row, head_dim, |d| *q.add(at + d) * scale);
                plane.row_load_into(&mut dout_row, head_dim, |d| *dout.add(at + d));
                let (row_lse, row_delta) =
                    (*lse.add(r * heads + head), *delta.add(r * heads + head));
                each_key!(|t| {
                    let (start, end) = ranges[t];
                    if start <= r && r < end {
                        let p =
                            crate::math::exp(plane.row_dot(&q_row, &k_rows[t], head_dim) - row_lse);
                        plane.row_scale_add(&mut dv_rows[t], 1.0, p, &dout_row, head_dim);
                        let ds = p * (plane.row_dot(&dout_row, &v_rows[t], head_dim) - row_delta);
                        // `q_row` holds scale · q, so this adds the `scale` of dk's formula.
                        plane.row_scale_add(&mut dk_rows[t], 1.0, ds, &q_row, head_dim);
                    }
                });
            }
        }
        each_key!(|t| {
            let j = first + t;
            if j < keys {
                let at = (j * kv_heads + group) * head_dim;
                plane.row_store(&dk_rows[t], head_dim, |d, g| *dk.add(at + d) = g);
                plane.row_store(&dv_rows[t], head_dim, |d, g| *dv.add(at + d) = g);
            }
        });
    }
}
