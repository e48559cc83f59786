//! The tail reductions as trees, on the host plane against f64: the gradient norm (and the loss sum) over more
//! values than `MAX_PARTIALS` chunks of the requested length hold, so the chunks grow and the second pass reads
//! a bounded number of partials; and the norm weight gradient's column sums, a plane per column, over partial
//! rows fewer than, equal to and past a warp's 32 lanes. Outputs and spare partials start as NaN (poisoned), so a
//! value a kernel fails to write, or a partial it writes out of range, shows. Each test also runs a deliberate
//! mistake (the last partial or row dropped) and checks the comparison catches it.

use draftpipe_gpu_kernels::norm::{column_sums, rmsnorm_weight_grad_partials};
use draftpipe_gpu_kernels::plane::{HostPlane, WIDTH};
use draftpipe_gpu_kernels::reduce::{
    MAX_PARTIALS, finish_grad_norm, finish_sum, partial_chunk_len, sum_partials,
    sum_squares_partials,
};

/// Deterministic values in [-1, 1) (a 64-bit LCG; the tests need no statistics, only variety).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

#[test]
fn chunk_length_bounds_the_partials_and_never_outgrows_the_buffer() {
    for min_chunk_len in [1usize, 32, 1024] {
        for n in [
            0usize,
            1,
            1000,
            MAX_PARTIALS * min_chunk_len,
            MAX_PARTIALS * min_chunk_len + 1,
            1_000_000_007,
        ] {
            let chunk_len = partial_chunk_len(n, min_chunk_len);
            assert!(chunk_len >= min_chunk_len, "n {n}");
            assert!(
                n.div_ceil(chunk_len) <= MAX_PARTIALS,
                "n {n}: too many partials"
            );
            assert!(
                n.div_ceil(chunk_len) <= n.div_ceil(min_chunk_len),
                "n {n}: more partials than a buffer for {min_chunk_len} holds"
            );
            if chunk_len > min_chunk_len {
                assert_eq!(
                    chunk_len % WIDTH,
                    0,
                    "n {n}: grown chunks are whole lane rounds"
                );
            }
        }
    }
    // A 1B-parameter gradient at the runtime's chunks of 1024: 8192 partials instead of 976 563.
    let chunk_len = partial_chunk_len(1_000_000_000, 1024);
    assert_eq!(1_000_000_000usize.div_ceil(chunk_len), 8192);
}

/// First and second pass over `v` with chunks of at least `min_chunk_len`, into poisoned buffers:
/// `(Σ v, ‖v‖, clip scale, partials used)`; `drop_last` leaves the last partial out of the second pass.
fn two_pass(v: &[f32], min_chunk_len: usize, drop_last: bool) -> (f32, f32, f32, usize) {
    let n = v.len();
    let chunk_len = partial_chunk_len(n, min_chunk_len);
    let chunks = n.div_ceil(chunk_len);
    // Sized as the workspace sizes it (for `min_chunk_len`): the spare tail must stay untouched.
    let spare = n.div_ceil(min_chunk_len);
    let (mut sums, mut squares) = (vec![f32::NAN; spare], vec![f32::NAN; spare]);
    for chunk in 0..chunks {
        // SAFETY: `v` holds `n` values, the partials at least `chunks`.
        unsafe {
            sum_partials(
                v.as_ptr(),
                sums.as_mut_ptr(),
                n,
                chunk_len,
                HostPlane,
                chunk,
            );
            sum_squares_partials(
                v.as_ptr(),
                squares.as_mut_ptr(),
                n,
                chunk_len,
                HostPlane,
                chunk,
            );
        }
    }
    assert!(
        sums[chunks..].iter().all(|p| p.is_nan()),
        "a partial past the chunks was written"
    );
    assert!(
        squares[..chunks].iter().all(|p| p.is_finite()),
        "a partial was not written"
    );
    let count = if drop_last { chunks - 1 } else { chunks };
    let (mut total, mut norm, mut clip) = (f32::NAN, f32::NAN, f32::NAN);
    // SAFETY: the partials hold `count ≤ chunks` written values; each output is one element.
    unsafe {
        finish_sum(sums.as_ptr(), &mut total, count, HostPlane);
        finish_grad_norm(
            squares.as_ptr(),
            &mut norm,
            &mut clip,
            count,
            1.0,
            HostPlane,
        );
    }
    (total, norm, clip, chunks)
}

#[test]
fn gradient_norm_past_the_partial_bound_matches_f64() {
    // Chunks of 32 asked for: 3 × MAX_PARTIALS × 32 + 77 values would make 24 579 partials; the chunks grow to
    // 128 values (the multiple of 32 above n / MAX_PARTIALS), 6145 partials, the last of 77 values.
    let n = 3 * MAX_PARTIALS * 32 + 77;
    let v = values(n, 19);
    let exact_sum: f64 = v.iter().map(|&x| x as f64).sum();
    let exact_norm = v.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt();

    let (total, norm, clip, chunks) = two_pass(&v, 32, false);
    assert!(chunks <= MAX_PARTIALS, "{chunks} partials");
    let norm_error = (norm as f64 - exact_norm).abs() / exact_norm;
    assert!(
        norm_error < 1e-6,
        "norm {norm} vs {exact_norm} (relative {norm_error:e})"
    );
    // The f64 sum cancels to about √n; the f32 partials each round at 2^-24 of their chunk's size.
    let sum_error = (total as f64 - exact_sum).abs();
    assert!(sum_error < 1e-3, "sum {total} vs {exact_sum}");
    assert_eq!(clip, (1.0 / (norm + 1e-6)).min(1.0), "clip scale");
    assert_eq!(
        two_pass(&v, 32, false),
        (total, norm, clip, chunks),
        "bitwise repeatable"
    );

    // The mistake: the last partial left out. 77 values of about 1/3 each move the norm by about 1e-5.
    let (_, dropped, _, _) = two_pass(&v, 32, true);
    let dropped_error = (dropped as f64 - exact_norm).abs() / exact_norm;
    assert!(
        dropped_error > 1e-6,
        "dropping a partial went unnoticed ({dropped_error:e})"
    );
}

/// `column_sums` over `[rows, cols]` on the host plane into a poisoned `out` (`accumulate`: onto `base`).
fn column_sums_host(values: &[f32], rows: usize, cols: usize, base: Option<&[f32]>) -> Vec<f32> {
    let mut out = base.map_or_else(|| vec![f32::NAN; cols], <[f32]>::to_vec);
    for col in 0..cols {
        // SAFETY: `values` holds `rows · cols` elements, `out` `cols`.
        unsafe {
            column_sums(
                values.as_ptr(),
                out.as_mut_ptr(),
                rows,
                cols,
                base.is_some(),
                HostPlane,
                col,
            )
        };
    }
    out
}

#[test]
fn column_sums_tree_matches_f64_for_short_and_long_columns() {
    let cols = 5;
    for rows in [1usize, 7, 31, 32, 33, 100, 8195] {
        let v = values(rows * cols, rows as u64);
        let exact =
            |col: usize, rows: usize| -> f64 { (0..rows).map(|r| v[r * cols + col] as f64).sum() };
        let got = column_sums_host(&v, rows, cols, None);
        let base = values(cols, 3);
        let added = column_sums_host(&v, rows, cols, Some(&base));
        for col in 0..cols {
            let tolerance = 1e-6 * (rows as f64).sqrt() + 1e-7;
            let err = (got[col] as f64 - exact(col, rows)).abs();
            assert!(
                err < tolerance,
                "rows {rows} col {col}: {} vs {}",
                got[col],
                exact(col, rows)
            );
            let err = (added[col] as f64 - (base[col] as f64 + exact(col, rows))).abs();
            assert!(err < tolerance + 1e-7, "accumulate: rows {rows} col {col}");
        }
        assert_eq!(
            column_sums_host(&v, rows, cols, None),
            got,
            "bitwise repeatable"
        );
        if rows > 1 {
            // The mistake: the last row left out (a lane that skips its final element).
            let short = column_sums_host(&v[..(rows - 1) * cols], rows - 1, cols, None);
            let caught = (0..cols).any(|col| (short[col] as f64 - exact(col, rows)).abs() > 1e-6);
            assert!(caught, "rows {rows}: dropping the last row went unnoticed");
        }
    }
}

#[test]
fn norm_weight_gradient_over_a_long_column_matches_f64() {
    // A q_norm at head_dim 64 over 16 384 rows: 256 partial rows per column, 8 per lane of the second pass.
    let (rows, cols, rows_per_chunk) = (16_384, 64, 64);
    let (x, dy) = (values(rows * cols, 5), values(rows * cols, 6));
    let inv: Vec<f32> = values(rows, 7).iter().map(|v| 1.0 + 0.5 * v).collect();
    let chunks = rows.div_ceil(rows_per_chunk);
    let mut partials = vec![f32::NAN; chunks * cols];
    for index in 0..chunks * cols {
        // SAFETY: inputs hold `rows · cols` (and `rows`) values, `partials` `chunks · cols`.
        unsafe {
            rmsnorm_weight_grad_partials(
                x.as_ptr(),
                inv.as_ptr(),
                dy.as_ptr(),
                partials.as_mut_ptr(),
                rows,
                cols,
                rows_per_chunk,
                index,
            )
        };
    }
    let dw = column_sums_host(&partials, chunks, cols, None);
    for col in 0..cols {
        let terms =
            (0..rows).map(|r| x[r * cols + col] as f64 * dy[r * cols + col] as f64 * inv[r] as f64);
        let (exact, scale) = terms.fold((0.0, 0.0), |(s, a), t| (s + t, a + t.abs()));
        assert!(
            (dw[col] as f64 - exact).abs() <= 1e-6 * scale,
            "col {col}: {} vs {exact}",
            dw[col]
        );
    }
}
