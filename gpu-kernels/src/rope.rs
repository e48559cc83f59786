//! Rotary position embedding (RoPE) in place, in Hugging Face's `rotate_half` convention (Qwen3, Llama): the
//! pairs are `(j, j + head_dim/2)`, rotated by `position · θ^(−2j/head_dim)`.
//!
//! ```text
//!  q [rows, heads, head_dim], k [rows, kv_heads, head_dim] ──rope(positions)──▶ same buffers, rotated
//!  backward: the same kernel with `inverse` (a rotation's adjoint is its inverse)
//! ```
//!
//! The angle is computed in f32 as Hugging Face does (`inv_freq` in f32, `position · inv_freq` in f32), so its
//! error grows with the position like theirs (about `position · 2^-23` radians).

/// Rotates pair `j` of every head of row `row` by the row's angle for `j` (by minus the angle when `inverse`):
/// `x[j] ← x[j]·cos − x[j+h]·sin`, `x[j+h] ← x[j+h]·cos + x[j]·sin`, `h = head_dim / 2`, for the pair indices
/// `i = row · h + j` from `chunk · chunk_len` up to `min(n, (chunk + 1) · chunk_len)`, `n = rows · h`.
///
/// Launch: element range over the (row, pair) indices: the GPU one per thread (adjacent threads touch adjacent
/// elements of every head, and one `sin_cos` serves all heads), the host long chunks with one division each.
///
/// # Safety
/// `x` holds `rows · heads · head_dim` elements and `positions` `rows`; `head_dim` is even.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn rope(
    x: *mut f32,
    positions: *const u32,
    heads: usize,
    head_dim: usize,
    theta: f32,
    inverse: bool,
    n: usize,
    chunk_len: usize,
    chunk: usize,
) {
    let half = head_dim / 2;
    // A zero divisor means an empty launch; returning keeps the device path free of the division panic.
    if half == 0 {
        return;
    }
    let start = chunk * chunk_len;
    let end = if start + chunk_len < n {
        start + chunk_len
    } else {
        n
    };
    if start >= end {
        return;
    }
    let ln_theta = crate::math::ln(theta);
    let (mut row, mut j) = (start / half, start % half);
    for _ in start..end {
        let inv_freq = crate::math::exp(-((2 * j) as f32 / head_dim as f32) * ln_theta);
        // SAFETY: `row < rows` indexes `positions`; every head's pair lies inside row `row` of `x`.
        unsafe {
            let angle = *positions.add(row) as f32 * inv_freq;
            let (sin, cos) = crate::math::sin_cos(angle);
            let sin = if inverse { -sin } else { sin };
            for head in 0..heads {
                let base = x.add((row * heads + head) * head_dim + j);
                let (a, b) = (*base, *base.add(half));
                *base = a * cos - b * sin;
                *base.add(half) = b * cos + a * sin;
            }
        }
        j += 1;
        if j == half {
            j = 0;
            row += 1;
        }
    }
}
