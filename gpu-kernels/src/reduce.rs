//! Deterministic two-pass reductions: per-chunk partial sums (first pass, many indices), then one index that
//! adds the partials in order (second pass). Used for the loss total and the global gradient norm.
//!
//! Partials accumulate in f64 inside a chunk and are stored as f32; the second pass adds them in f64.

/// First pass of a sum: `partials[chunk] = Σ values[chunk · chunk_len ..][..chunk_len]` (clipped to `n`).
///
/// Launch: one index per chunk, `ceil(n / chunk_len)` indices.
///
/// # Safety
/// `values` holds `n` elements and `partials` `chunk + 1`.
#[inline(always)]
pub unsafe fn sum_partials(
    values: *const f32,
    n: usize,
    chunk_len: usize,
    partials: *mut f32,
    chunk: usize,
) {
    let start = chunk * chunk_len;
    let end = if start + chunk_len < n {
        start + chunk_len
    } else {
        n
    };
    let mut sum = 0.0f64;
    // SAFETY: `start..end` is inside `values`; `chunk` is inside `partials`.
    unsafe {
        for i in start..end {
            sum += *values.add(i) as f64;
        }
        *partials.add(chunk) = sum as f32;
    }
}

/// First pass of a squared norm: `partials[chunk] = Σ values[i]²` over the chunk (clipped to `n`).
///
/// Launch: one index per chunk, `ceil(n / chunk_len)` indices.
///
/// # Safety
/// `values` holds `n` elements and `partials` `chunk + 1`.
#[inline(always)]
pub unsafe fn sum_squares_partials(
    values: *const f32,
    n: usize,
    chunk_len: usize,
    partials: *mut f32,
    chunk: usize,
) {
    let start = chunk * chunk_len;
    let end = if start + chunk_len < n {
        start + chunk_len
    } else {
        n
    };
    // Eight f32 lanes, then f64: vectorises on the host and keeps the rounding error at chunk scale.
    let mut lanes = [0.0f32; 8];
    let mut i = start;
    // SAFETY: every index read is in `start..end`, inside `values`; `chunk` is inside `partials`.
    unsafe {
        while i + 8 <= end {
            for (k, lane) in lanes.iter_mut().enumerate() {
                let v = *values.add(i + k);
                *lane += v * v;
            }
            i += 8;
        }
        let mut sum = 0.0f64;
        for lane in lanes {
            sum += lane as f64;
        }
        while i < end {
            let v = *values.add(i) as f64;
            sum += v * v;
            i += 1;
        }
        *partials.add(chunk) = sum as f32;
    }
}

/// Second pass of a sum: `out[0] = Σ partials[0..count]`, in order.
///
/// Launch: one index (index 0).
///
/// # Safety
/// `partials` holds `count` elements, `out` one.
#[inline(always)]
pub unsafe fn finish_sum(partials: *const f32, count: usize, out: *mut f32) {
    let mut sum = 0.0f64;
    // SAFETY: `0..count` is inside `partials`; `out` holds one element.
    unsafe {
        for i in 0..count {
            sum += *partials.add(i) as f64;
        }
        *out = sum as f32;
    }
}

/// Second pass of the global gradient norm: `norm[0] = sqrt(Σ partials)` and the clip factor PyTorch's
/// `clip_grad_norm_` uses, `clip_scale[0] = min(1, max_norm / (norm + 1e-6))`; `max_norm ≤ 0` means no clipping
/// (scale 1). A non-finite norm gives scale 1 and makes [`crate::adamw::adamw_update`] skip the step.
///
/// Launch: one index (index 0).
///
/// # Safety
/// `partials` holds `count` elements, `norm` and `clip_scale` one each.
#[inline(always)]
pub unsafe fn finish_grad_norm(
    partials: *const f32,
    count: usize,
    max_norm: f32,
    norm: *mut f32,
    clip_scale: *mut f32,
) {
    let mut sum = 0.0f64;
    // SAFETY: `0..count` is inside `partials`; the outputs hold one element each.
    unsafe {
        for i in 0..count {
            sum += *partials.add(i) as f64;
        }
        let total = crate::math::sqrt(sum as f32);
        *norm = total;
        *clip_scale = if max_norm > 0.0 && total.is_finite() {
            let c = max_norm / (total + 1e-6);
            if c < 1.0 { c } else { 1.0 }
        } else {
            1.0
        };
    }
}
