//! Deterministic two-pass reductions, a tree of two levels: per-chunk partial sums (first pass, one plane per
//! chunk), then one plane that adds the partials (second pass). Used for the loss total and the global gradient
//! norm.
//!
//! ```text
//!  n values ──▶ ceil(n / chunk_len) ≤ MAX_PARTIALS planes, each a chunk ──▶ partials ──▶ one plane ──▶ result
//!               chunk_len = partial_chunk_len(n, REDUCE_CHUNK)                           ≤ 256 partials per lane
//! ```
//!
//! The fan-in of the second pass is bounded: past `MAX_PARTIALS · min_chunk_len` values the chunks grow instead
//! of their count, so the last pass never runs one warp over a million partials (a 1B-parameter gradient norm
//! at chunks of 1024 would), and the first pass still has enough planes to fill the GPU.
//!
//! The lanes of a plane read adjacent elements (coalesced on the GPU, a 32-wide vector loop on the host); the
//! lane split and the butterfly fix the order of additions, and the chunk length is a function of `n` alone, so
//! the same inputs give the same bits. Lane sums of the loss accumulate in f64, those of squared gradients in f32
//! (one chunk's share per lane), and both are combined across lanes and partials in f64.

use crate::plane::{Plane, WIDTH};

/// The most partial sums a first pass writes: 8192 planes are 8192 warps, about one resident wave of an H200
/// (132 SMs at 64 warps each), and the second pass's lanes then read at most 256 partials each.
pub const MAX_PARTIALS: usize = 8192;

/// The chunk length of a two-pass reduction over `n` values that asks for chunks of `min_chunk_len`: that
/// length while it gives at most [`MAX_PARTIALS`] chunks, otherwise the shortest multiple of the plane width
/// that does. `ceil(n / result) ≤ ceil(n / min_chunk_len)`, so a partials buffer sized for `min_chunk_len`
/// holds them.
#[inline(always)]
pub const fn partial_chunk_len(n: usize, min_chunk_len: usize) -> usize {
    let bounded = n.div_ceil(MAX_PARTIALS).next_multiple_of(WIDTH);
    if bounded > min_chunk_len {
        bounded
    } else {
        min_chunk_len
    }
}

/// The element range `[start, end)` of one chunk, clipped to `n`.
#[inline(always)]
fn chunk_range(n: usize, chunk_len: usize, chunk: usize) -> (usize, usize) {
    let start = chunk * chunk_len;
    let end = if start + chunk_len < n {
        start + chunk_len
    } else {
        n
    };
    (start, if start < end { end } else { start })
}

/// First pass of a sum: `partials[chunk] = Σ values[chunk · chunk_len ..][..chunk_len]` (clipped to `n`).
///
/// Launch: one plane per chunk, `ceil(n / chunk_len)` planes.
///
/// # Safety
/// `values` holds `n` elements and `partials` `chunk + 1`.
#[inline(always)]
pub unsafe fn sum_partials(
    values: *const f32,
    partials: *mut f32,
    n: usize,
    chunk_len: usize,
    plane: impl Plane,
    chunk: usize,
) {
    let (start, end) = chunk_range(n, chunk_len, chunk);
    // SAFETY: `start..end` is inside `values`; `chunk` is inside `partials`.
    unsafe {
        let values = values.add(start);
        let sum = plane.reduce(
            end - start,
            0.0f64,
            |acc, i| acc + *values.add(i) as f64,
            |acc| acc,
            |a, b| a + b,
        );
        if plane.is_leader() {
            *partials.add(chunk) = sum as f32;
        }
    }
}

/// First pass of a squared norm: `partials[chunk] = Σ values[i]²` over the chunk (clipped to `n`).
///
/// Launch: one plane per chunk, `ceil(n / chunk_len)` planes.
///
/// # Safety
/// `values` holds `n` elements and `partials` `chunk + 1`.
#[inline(always)]
pub unsafe fn sum_squares_partials(
    values: *const f32,
    partials: *mut f32,
    n: usize,
    chunk_len: usize,
    plane: impl Plane,
    chunk: usize,
) {
    let (start, end) = chunk_range(n, chunk_len, chunk);
    // SAFETY: `start..end` is inside `values`; `chunk` is inside `partials`.
    unsafe {
        let values = values.add(start);
        let sum = plane.reduce(
            end - start,
            0.0f32,
            |acc, i| acc + *values.add(i) * *values.add(i),
            |acc| acc as f64,
            |a, b| a + b,
        );
        if plane.is_leader() {
            *partials.add(chunk) = sum as f32;
        }
    }
}

/// `Σ partials[0..count]` in f64 over the lanes of one plane.
///
/// # Safety
/// `partials` holds `count` elements.
#[inline(always)]
unsafe fn sum_of_partials(partials: *const f32, count: usize, plane: impl Plane) -> f64 {
    // SAFETY: `0..count` is inside `partials`.
    plane.reduce(
        count,
        0.0f64,
        |acc, i| acc + unsafe { *partials.add(i) } as f64,
        |acc| acc,
        |a, b| a + b,
    )
}

/// Second pass of a sum: `out[0] = Σ partials[0..count]`.
///
/// Launch: one plane.
///
/// # Safety
/// `partials` holds `count` elements, `out` one.
#[inline(always)]
pub unsafe fn finish_sum(partials: *const f32, out: *mut f32, count: usize, plane: impl Plane) {
    // SAFETY: `0..count` is inside `partials`; `out` holds one element.
    unsafe {
        let sum = sum_of_partials(partials, count, plane);
        if plane.is_leader() {
            *out = sum as f32;
        }
    }
}

/// Second pass of the global gradient norm: `norm[0] = sqrt(Σ partials)` and the clip factor PyTorch's
/// `clip_grad_norm_` uses, `clip_scale[0] = min(1, max_norm / (norm + 1e-6))`; `max_norm ≤ 0` means no clipping
/// (scale 1). A non-finite norm gives scale 1 and makes [`crate::adamw::adamw_update`] skip the step.
///
/// Launch: one plane.
///
/// # Safety
/// `partials` holds `count` elements, `norm` and `clip_scale` one each.
#[inline(always)]
pub unsafe fn finish_grad_norm(
    partials: *const f32,
    norm: *mut f32,
    clip_scale: *mut f32,
    count: usize,
    max_norm: f32,
    plane: impl Plane,
) {
    // SAFETY: `0..count` is inside `partials`; the outputs hold one element each.
    unsafe {
        let total = crate::math::sqrt(sum_of_partials(partials, count, plane) as f32);
        if plane.is_leader() {
            *norm = total;
            *clip_scale = if max_norm > 0.0 && total.is_finite() {
                let c = max_norm / (total + 1e-6);
                if c < 1.0 { c } else { 1.0 }
            } else {
                1.0
            };
        }
    }
}
