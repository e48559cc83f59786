//! RoPE as the CPU step runs it: the kernel table's arithmetic (`draftpipe_gpu_kernels::rope`: the same
//! `inv_freq`, angle, `sin_cos` and rotation expressions, so the results are bit-identical, which a test checks),
//! ordered for a CPU: a row's angles once, vectorised over its pairs, then every head of the row rotated with
//! them. The kernel table's order (one `(row, pair)` per GPU thread, every head inside) leaves the host one
//! scalar `sin_cos` per pair, the largest cost of the call.

use std::ops::Range;

use draftpipe_gpu_kernels::math::{exp, ln, sin_cos};

use super::kernels::{SharedPtr, for_each_part};

/// The largest `head_dim / 2` (the kernels' `MAX_ROW` head dimension).
const MAX_HALF: usize = draftpipe_gpu_kernels::plane::MAX_ROW / 2;

/// Rotates `x [rows, heads, head_dim]` in place by `positions[row] · θ^(−2j/head_dim)` (minus that when
/// `inverse`), in Hugging Face's `rotate_half` pairing `(j, j + head_dim/2)`.
///
/// # Panics
/// When the sizes disagree, `head_dim` is odd or above 128, or `theta ≤ 0`.
pub fn rope(
    x: &mut [f32],
    positions: &[u32],
    theta: f32,
    heads: usize,
    head_dim: usize,
    inverse: bool,
) {
    let rows = positions.len();
    assert!(
        x.len() == rows * heads * head_dim
            && head_dim.is_multiple_of(2)
            && head_dim / 2 <= MAX_HALF
            && theta > 0.0,
        "rope: {} elements for {rows} rows × {heads} heads × {head_dim} (even, ≤ 128), theta {theta} > 0",
        x.len()
    );
    let half = head_dim / 2;
    if half == 0 {
        return;
    }
    let ln_theta = ln(theta);
    let mut inv_freq = [0.0f32; MAX_HALF];
    for (j, f) in inv_freq.iter_mut().enumerate().take(half) {
        *f = exp(-((2 * j) as f32 / head_dim as f32) * ln_theta);
    }
    let shape = Shape {
        inv_freq,
        half,
        heads,
        inverse,
    };
    let (x, positions) = (SharedPtr(x.as_mut_ptr()), SharedPtr(positions.as_ptr()));
    #[cfg(target_arch = "x86_64")]
    let wide = std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma");
    for_each_part(rows, |part| {
        // SAFETY (both calls): the assert above sized `x` and `positions` for every row; parts are disjoint rows.
        #[cfg(target_arch = "x86_64")]
        if wide {
            return unsafe { rotate_rows_wide(part, &shape, x.get(), positions.get()) };
        }
        unsafe { rotate_rows(part, &shape, x.get(), positions.get()) }
    });
}

/// What every row's rotation shares.
struct Shape {
    inv_freq: [f32; MAX_HALF],
    half: usize,
    heads: usize,
    inverse: bool,
}

/// [`rotate_rows`] compiled for AVX2 + FMA (the expressions keep their separate multiplies and adds).
///
/// # Safety
/// As [`rotate_rows`], on a CPU with AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn rotate_rows_wide(rows: Range<usize>, shape: &Shape, x: *mut f32, positions: *const u32) {
    // SAFETY: the caller's contract.
    unsafe { rotate_rows(rows, shape, x, positions) }
}

/// Rotates rows `rows`.
///
/// # Safety
/// `x` holds `[rows.end, heads, 2 · half]` and `positions` `rows.end` elements.
#[inline(always)]
unsafe fn rotate_rows(rows: Range<usize>, shape: &Shape, x: *mut f32, positions: *const u32) {
    let Shape {
        inv_freq,
        half,
        heads,
        inverse,
    } = shape;
    let (half, heads) = (*half, *heads);
    let (mut sin, mut cos) = ([0.0f32; MAX_HALF], [0.0f32; MAX_HALF]);
    for row in rows {
        // SAFETY: `row < rows.end`.
        let position = unsafe { *positions.add(row) } as f32;
        // Whole groups of 8 pairs (the spare ones of the last group are computed and unused): a fixed trip
        // count is what lets the compiler run `sin_cos` 8 angles at a time.
        let groups = inv_freq
            .chunks_exact(8)
            .zip(sin.chunks_exact_mut(8))
            .zip(cos.chunks_exact_mut(8));
        for ((inv_freq, sin), cos) in groups.take(half.div_ceil(8)) {
            for j in 0..8 {
                let (s, c) = sin_cos(position * inv_freq[j]);
                (sin[j], cos[j]) = (if *inverse { -s } else { s }, c);
            }
        }
        for head in 0..heads {
            // SAFETY: head `head` of row `row` holds `2 · half` elements.
            let pair = unsafe {
                std::slice::from_raw_parts_mut(x.add((row * heads + head) * 2 * half), 2 * half)
            };
            let (first, second) = pair.split_at_mut(half);
            for (((x0, x1), &cos), &sin) in first.iter_mut().zip(second).zip(&cos).zip(&sin) {
                let (a, b) = (*x0, *x1);
                *x0 = a * cos - b * sin;
                *x1 = b * cos + a * sin;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::rngs::Xoshiro256PlusPlus;
    use rand::{RngExt, SeedableRng};

    /// Bit for bit the kernel table's body (through its host launcher), forward and inverse, on and off the
    /// drafter's threads.
    #[test]
    fn rope_equals_the_kernel_tables_body_bit_for_bit() {
        let seed = rand::rng().random::<u64>();
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
        let threads = crate::backend::cpu::HostThreads::new("test", 2).expect("threads");
        for trial in 0..8 {
            let (rows, heads) = (rng.random_range(1..300), rng.random_range(1..5));
            let head_dim = 2 * rng.random_range(1..=64);
            let theta = [10_000.0f32, 1_000_000.0][trial % 2];
            let inverse = trial % 4 >= 2;
            let positions: Vec<u32> = (0..rows).map(|_| rng.random_range(0..8192)).collect();
            let x: Vec<f32> = (0..rows * heads * head_dim)
                .map(|_| rng.random_range(-2.0f32..2.0))
                .collect();
            let mut table = x.clone();
            crate::backend::cpu::kernels::launch::rope(
                &positions,
                &mut table,
                rows,
                heads,
                head_dim,
                theta,
                u32::from(inverse),
            );
            let mut host = x.clone();
            super::rope(&mut host, &positions, theta, heads, head_dim, inverse);
            let mut pooled = x;
            threads.run(|| super::rope(&mut pooled, &positions, theta, heads, head_dim, inverse));
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let what = format!("seed {seed}, trial {trial}: {rows} × {heads} × {head_dim}");
            assert_eq!(
                bits(&host),
                bits(&table),
                "{what}: host vs the kernel table"
            );
            assert_eq!(
                bits(&pooled),
                bits(&table),
                "{what}: on the threads vs the kernel table"
            );
        }
    }
}
