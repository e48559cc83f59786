//! RMSNorm `y = x / sqrt(mean(x²) + eps) ⊙ w`: forward, input gradient, and the weight gradient as a
//! deterministic two-pass reduction over rows: a thread per (chunk of rows, column) writes partials, then a plane
//! per column adds them (its lanes split the partial rows, the butterfly joins the lanes), so neither pass runs
//! one thread down a long column (a q/k-norm weight gradient has head_dim columns, 64 or 128, over up to 16k rows per head).
//!
//! The forward keeps `1/rms` per row so the backward does not recompute it. The row kernels run on a
//! [`Plane`]: a warp per row on the GPU, the lanes as a loop on the host.

use crate::plane::Plane;

/// RMSNorm forward of one row: `y[row] = x[row] · inv_rms[row] ⊙ weight`, storing `inv_rms[row]`; when `y16`
/// is not null, also `y[row]` rounded to bfloat16 (nearest even) in the same pass: the 16-bit operand of the
/// products that read the norm's output at `bf16` precision, while `y` stays f32 for the backward.
///
/// Launch: one plane per row (`rows` planes); the lanes split the columns, so reads are coalesced.
///
/// # Safety
/// `x` and `y` (and `y16` unless null) hold at least `(row + 1) · cols` elements, `weight` `cols`, `inv_rms`
/// `row + 1`; `y` may equal `x` (in place) but must not overlap it otherwise; `y16` overlaps nothing.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn rmsnorm_forward(
    x: *const f32,
    weight: *const f32,
    y: *mut f32,
    y16: *mut u16,
    inv_rms: *mut f32,
    cols: usize,
    eps: f32,
    plane: impl Plane,
    row: usize,
) {
    // SAFETY: the caller guarantees the row lies inside every buffer; every lane has read its `x` values for
    // the sum (the reduction's shuffles wait for all lanes) before any lane writes `y`.
    unsafe {
        let x = x.add(row * cols);
        let y = y.add(row * cols);
        let sum_sq = plane.sum(cols, |c| *x.add(c) * *x.add(c));
        let r = crate::math::rsqrt(sum_sq / cols as f32 + eps);
        if plane.is_leader() {
            *inv_rms.add(row) = r;
        }
        if y16.is_null() {
            plane.for_each(cols, |c| *y.add(c) = *x.add(c) * r * *weight.add(c));
        } else {
            let y16 = y16.add(row * cols);
            plane.for_each(cols, |c| {
                let value = *x.add(c) * r * *weight.add(c);
                *y.add(c) = value;
                *y16.add(c) = crate::convert::f32_to_bf16_bits(value);
            });
        }
    }
}

/// RMSNorm input gradient of one row:
/// `dx = r·(w ⊙ dy) − x · r³/cols · Σ_k w_k dy_k x_k` with `r = inv_rms[row]`; written to `dx` when
/// `accumulate` is false, added to it when true (a residual stream's gradient). When `dx16` is not null it also
/// receives the final `dx` (after the addition) rounded to bfloat16 (nearest even) in the same pass: the
/// gradient's 16-bit operand of the backward products that read it at `bf16` precision, while `dx` stays f32
/// for the residual stream and the norms.
///
/// Launch: one plane per row (`rows` planes).
///
/// # Safety
/// `x`, `dy`, `dx` (and `dx16` unless null) hold at least `(row + 1) · cols` elements, `weight` `cols`,
/// `inv_rms` `row + 1`; `dx` does not overlap `x`, `dy` or `weight`; `dx16` overlaps nothing.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn rmsnorm_backward_input(
    x: *const f32,
    weight: *const f32,
    inv_rms: *const f32,
    dy: *const f32,
    dx: *mut f32,
    dx16: *mut u16,
    cols: usize,
    accumulate: bool,
    plane: impl Plane,
    row: usize,
) {
    // SAFETY: the caller guarantees the row lies inside every buffer and `dx` overlaps no input.
    unsafe {
        let x = x.add(row * cols);
        let dy = dy.add(row * cols);
        let dx = dx.add(row * cols);
        let r = *inv_rms.add(row);
        let dot = plane.sum(cols, |c| *weight.add(c) * *dy.add(c) * *x.add(c));
        let coeff = r * r * r * dot / cols as f32;
        let grad = |c: usize| r * *weight.add(c) * *dy.add(c) - *x.add(c) * coeff;
        // Four loops rather than branches inside one: the host vectorises each, and the GPU's lanes take the
        // same branch anyway (the flags are launch scalars).
        match (accumulate, dx16.is_null()) {
            (true, true) => plane.for_each(cols, |c| *dx.add(c) += grad(c)),
            (false, true) => plane.for_each(cols, |c| *dx.add(c) = grad(c)),
            (true, false) => {
                let dx16 = dx16.add(row * cols);
                plane.for_each(cols, |c| {
                    let value = *dx.add(c) + grad(c);
                    *dx.add(c) = value;
                    *dx16.add(c) = crate::convert::f32_to_bf16_bits(value);
                });
            }
            (false, false) => {
                let dx16 = dx16.add(row * cols);
                plane.for_each(cols, |c| {
                    let value = grad(c);
                    *dx.add(c) = value;
                    *dx16.add(c) = crate::convert::f32_to_bf16_bits(value);
                });
            }
        }
    }
}

/// First pass of the RMSNorm weight gradient `dw[c] = Σ_rows dy[r,c] · x[r,c] · inv_rms[r]`: one partial sum
/// per (chunk of `rows_per_chunk` rows, column), `partials[chunk · cols + col]`.
///
/// Launch: `index = chunk · cols + col`, `ceil(rows / rows_per_chunk) · cols` indices (columns fastest, so GPU
/// threads of a warp read adjacent columns). Finish with [`column_sums`] over the `ceil(rows / rows_per_chunk)`
/// partial rows. The order of additions is fixed, so the result is bitwise reproducible.
///
/// # Safety
/// `x`, `dy` hold `rows · cols` elements, `inv_rms` `rows`, `partials` `ceil(rows / rows_per_chunk) · cols`;
/// `rows_per_chunk > 0`; `index` is inside the launch.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn rmsnorm_weight_grad_partials(
    x: *const f32,
    inv_rms: *const f32,
    dy: *const f32,
    partials: *mut f32,
    rows: usize,
    cols: usize,
    rows_per_chunk: usize,
    index: usize,
) {
    // A zero divisor means an empty launch; returning keeps the device path free of the division panic.
    if cols == 0 {
        return;
    }
    let chunk = index / cols;
    let col = index % cols;
    let start = chunk * rows_per_chunk;
    let end = if start + rows_per_chunk < rows {
        start + rows_per_chunk
    } else {
        rows
    };
    let mut sum = 0.0f32;
    // SAFETY: rows in `start..end` are inside `x`, `dy`, `inv_rms`; `index` is inside `partials`.
    unsafe {
        for r in start..end {
            sum += *dy.add(r * cols + col) * *x.add(r * cols + col) * *inv_rms.add(r);
        }
        *partials.add(index) = sum;
    }
}

/// Sums a row-major `[rows, cols]` matrix over its rows: `out[col] = Σ_r values[r · cols + col]`, by a tree:
/// lane `l` of the plane adds rows `l, l + 32, …` in ascending order, the butterfly adds the 32 lane sums
/// (deterministic). Written to `out` when `accumulate` is false, added to it when true.
///
/// Launch: one plane per column (`cols` planes).
///
/// # Safety
/// `values` holds `rows · cols` elements and `out` `cols`; `col < cols`.
#[inline(always)]
pub unsafe fn column_sums(
    values: *const f32,
    out: *mut f32,
    rows: usize,
    cols: usize,
    accumulate: bool,
    plane: impl Plane,
    col: usize,
) {
    // SAFETY: every `r · cols + col` with `r < rows` is inside `values`; `col` is inside `out`.
    unsafe {
        let sum = plane.sum(rows, |r| *values.add(r * cols + col));
        if plane.is_leader() {
            if accumulate {
                *out.add(col) += sum;
            } else {
                *out.add(col) = sum;
            }
        }
    }
}
