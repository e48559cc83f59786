//! Rotary position embedding (RoPE) in place, in Hugging Face's `rotate_half` convention (Qwen3, Llama): the
//! pairs are `(j, j + head_dim/2)`, rotated by `position · θ^(−2j/head_dim)`.
//!
//! ```text
//!  q [rows, heads, head_dim], k [rows, kv_heads, head_dim] ──rope(positions)──▶ same buffers, rotated
//!                                                             └─(x16 non-null)─▶ their bf16 copy, same pass
//!  backward: the same kernel with `inverse` (a rotation's adjoint is its inverse)
//! ```
//!
//! The bf16 copy is the flash attention kernels' operand (CUDA at `bf16`): RoPE is the last kernel to touch q
//! and k before attention, so rounding here costs 2 written bytes per element instead of a pass of its own
//! (4 read, 2 written).
//!
//! The angle is computed in f32 as Hugging Face does (`inv_freq` in f32, `position · inv_freq` in f32), so its
//! error grows with the position like theirs (about `position · 2^-23` radians).

/// Rotates pair `j` of every head of row `row` by the row's angle for `j` (by minus the angle when `inverse`):
/// `x[j] ← x[j]·cos − x[j+h]·sin`, `x[j+h] ← x[j+h]·cos + x[j]·sin`, `h = head_dim / 2`, for the pair indices
/// `i = row · h + j` from `chunk · chunk_len` up to `min(n, (chunk + 1) · chunk_len)`, `n = rows · h`. Unless
/// `x16` is null, both rotated values are also stored rounded to bf16 (nearest even) at the same index of `x16`.
///
/// Launch: element range over the (row, pair) indices: the GPU one per thread (adjacent threads touch adjacent
/// elements of every head, and one `sin_cos` serves all heads), the host long chunks with one division each.
///
/// # Safety
/// `x` (and `x16` unless null) holds `rows · heads · head_dim` elements and `positions` `rows`; `head_dim` is
/// even; `x16` overlaps nothing.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn rope(
    x: *mut f32,
    x16: *mut u16,
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
        // SAFETY: `row < rows` indexes `positions`; every head's pair lies inside row `row` of `x` (and `x16`).
        unsafe {
            let angle = *positions.add(row) as f32 * inv_freq;
            let (sin, cos) = crate::math::sin_cos(angle);
            let sin = if inverse { -sin } else { sin };
            for head in 0..heads {
                let at = (row * heads + head) * head_dim + j;
                let base = x.add(at);
                let (a, b) = (*base, *base.add(half));
                let (a, b) = (a * cos - b * sin, b * cos + a * sin);
                *base = a;
                *base.add(half) = b;
                if !x16.is_null() {
                    let copy = x16.add(at);
                    *copy = crate::convert::f32_to_bf16_bits(a);
                    *copy.add(half) = crate::convert::f32_to_bf16_bits(b);
                }
            }
        }
        j += 1;
        if j == half {
            j = 0;
            row += 1;
        }
    }
}
