//! Row-major matrix products on flat buffers, through the `gemm` crate (the GEMM of `faer` and of candle's CPU
//! backend: AVX-512 kernels beside AVX2/FMA ones, chosen at run time), split over the CPU drafter's threads
//! ([`super::HostThreads`], thread count from `MATMUL_NUM_THREADS`).
//!
//! The drafter's tensors are row-major PyTorch `[out, in]` slices of the flat buffers. The crate takes a row and
//! a column stride per operand, so a transposed operand is the same slice with swapped strides: no copies and
//! no column-major reinterpretation.

use super::kernels::SharedPtr;

/// The environment variable that sets a CPU drafter's thread count ([`super::HostThreads::drafter_threads`]);
/// the name `matrixmultiply` (this module's GEMM before the `gemm` crate) reads, kept so existing settings apply.
pub const GEMM_THREADS_VAR: &str = "MATMUL_NUM_THREADS";

/// Threads per drafter so that `cpu_drafters` drafters running at once use `cores` cores without
/// oversubscribing them: `cores / cpu_drafters`, at least 1. Each drafter's pool would otherwise take every
/// core, and the drafters' pools would preempt each other.
///
/// On the 2-core build machine the quickstart (two CPU drafters) ran at 5268 tok/s with one GEMM thread, and at
/// 3924 tok/s with two (matrixmultiply's default then; `--steps 40`, alternated).
///
/// # Examples
/// ```
/// use draftpipe_runtime::backend::cpu::gemm_threads;
///
/// assert_eq!(gemm_threads(2, 2), 1);
/// assert_eq!(gemm_threads(16, 4), 4);
/// assert_eq!(gemm_threads(2, 3), 1);
/// assert_eq!(gemm_threads(8, 0), 8);
/// ```
pub fn gemm_threads(cores: usize, cpu_drafters: usize) -> usize {
    (cores / cpu_drafters.max(1)).max(1)
}

/// A read-only row-major matrix, optionally used transposed.
#[derive(Clone, Copy)]
pub(crate) struct Mat<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
    transposed: bool,
}

impl<'a> Mat<'a> {
    /// `data` as a row-major `[rows, cols]` matrix.
    pub(crate) fn new(data: &'a [f32], rows: usize, cols: usize) -> Self {
        assert_eq!(
            data.len(),
            rows * cols,
            "matrix buffer does not match its shape"
        );
        Self {
            data,
            rows,
            cols,
            transposed: false,
        }
    }

    /// The same buffer read as its transpose.
    pub(crate) fn t(self) -> Self {
        Self {
            transposed: !self.transposed,
            ..self
        }
    }

    /// Rows and columns as used (after the transpose).
    fn shape(&self) -> (usize, usize) {
        if self.transposed {
            (self.cols, self.rows)
        } else {
            (self.rows, self.cols)
        }
    }

    /// Row and column strides as used.
    fn strides(&self) -> (isize, isize) {
        if self.transposed {
            (1, self.cols as isize)
        } else {
            (self.cols as isize, 1)
        }
    }
}

/// `c = alpha · a · b + beta · c` with `c` row-major `[a.rows, b.cols]`. With `beta = 0`, `c` is not read (its
/// previous contents, NaN included, do not matter).
///
/// Panics when the shapes do not agree: callers size every buffer from the same bucket shape, so a mismatch is a
/// bug in this crate, not bad input.
pub(crate) fn gemm(c: &mut [f32], a: Mat<'_>, b: Mat<'_>, alpha: f32, beta: f32) {
    let (m, k) = a.shape();
    let (kb, n) = b.shape();
    assert_eq!(k, kb, "inner dimensions differ");
    assert_eq!(
        c.len(),
        m * n,
        "output buffer does not match the product's shape"
    );
    let (rsa, csa) = a.strides();
    let (rsb, csb) = b.strides();
    // SAFETY: the shape checks above make every strided access fall inside `a.data`, `b.data` and `c`; `c` is a
    // unique borrow, so it overlaps neither input.
    unsafe {
        product_on_threads(
            m,
            k,
            n,
            alpha,
            a.data.as_ptr(),
            rsa,
            csa,
            b.data.as_ptr(),
            rsb,
            csb,
            beta,
            c.as_mut_ptr(),
            n as isize,
            1,
        );
    }
}

/// A matrix as used by a product, inside a slice: element `(i, j)` is `data[offset + i·row_stride + j·col_stride]`.
#[derive(Clone, Copy)]
pub(crate) struct Strided<'a> {
    pub(crate) data: &'a [f32],
    pub(crate) offset: usize,
    pub(crate) row_stride: usize,
    pub(crate) col_stride: usize,
}

impl Strided<'_> {
    /// True when every element of a `rows × cols` matrix lies inside the slice.
    fn holds(&self, rows: usize, cols: usize, len: usize) -> bool {
        rows == 0
            || cols == 0
            || (rows - 1)
                .checked_mul(self.row_stride)
                .zip((cols - 1).checked_mul(self.col_stride))
                .and_then(|(r, c)| r.checked_add(c)?.checked_add(self.offset))
                .is_some_and(|last| last < len)
    }
}

/// `c = alpha · a · b + beta · c` on strided views (a block of rows or columns of larger matrices), `(m, k, n)`
/// as used. With `beta = 0`, `c` is not read.
///
/// # Panics
/// When a view reaches outside its slice (a bug in the caller's tiling).
pub(crate) fn gemm_strided(
    c: (&mut [f32], usize, usize, usize),
    a: Strided<'_>,
    b: Strided<'_>,
    (m, k, n): (usize, usize, usize),
    alpha: f32,
    beta: f32,
) {
    let (c_data, c_offset, c_rs, c_cs) = c;
    let c_view = Strided {
        data: &[],
        offset: c_offset,
        row_stride: c_rs,
        col_stride: c_cs,
    };
    assert!(
        a.holds(m, k, a.data.len())
            && b.holds(k, n, b.data.len())
            && c_view.holds(m, n, c_data.len()),
        "strided product outside its buffers"
    );
    if m == 0 || n == 0 {
        return;
    }
    // SAFETY: the assertion above keeps every strided access inside `a.data`, `b.data` and `c_data`; `c_data` is
    // a unique borrow, so it overlaps neither input.
    unsafe {
        product_on_threads(
            m,
            k,
            n,
            alpha,
            a.data.as_ptr().add(a.offset),
            a.row_stride as isize,
            a.col_stride as isize,
            b.data.as_ptr().add(b.offset),
            b.row_stride as isize,
            b.col_stride as isize,
            beta,
            c_data.as_mut_ptr().add(c_offset),
            c_rs as isize,
            c_cs as isize,
        );
    }
}

/// `c = a · b` for row-major operands, each optionally read transposed (`a` holds `[m, k]`, or `[k, m]` when
/// `a_transposed`; `b` holds `[k, n]`, or `[n, k]`): the product every CPU step GEMM is, split over the calling
/// drafter's threads the same way, for benchmarks that time the step's GEMMs bare.
///
/// # Examples
/// ```
/// let (a, b) = ([1.0, 2.0, 3.0, 4.0], [1.0, 0.0, 0.0, 1.0]);
/// let mut c = [0.0; 4];
/// draftpipe_runtime::backend::cpu::matmul(&mut c, (&a, false), (&b, true), (2, 2, 2));
/// assert_eq!(c, [1.0, 2.0, 3.0, 4.0]);
/// ```
///
/// # Panics
/// When a slice does not hold its operand's shape.
pub fn matmul(
    c: &mut [f32],
    (a, a_transposed): (&[f32], bool),
    (b, b_transposed): (&[f32], bool),
    (m, k, n): (usize, usize, usize),
) {
    let a = if a_transposed {
        Mat::new(a, k, m).t()
    } else {
        Mat::new(a, m, k)
    };
    let b = if b_transposed {
        Mat::new(b, n, k).t()
    } else {
        Mat::new(b, k, n)
    };
    gemm(c, a, b, 1.0, 0.0);
}

/// Multiply-adds (`m·k·n`) below which a product runs on one thread: splitting costs a few microseconds.
const SPLIT_WORK: usize = 1 << 18;

/// The fewest rows (or columns) a split hands one thread. The `gemm` crate blocks the depth `k` by a `kc` that
/// depends on `k` and the caches alone, except for products of at most 64 × 64 (`kc = min(k, 512)`): parts over
/// 64 keep the whole product's `kc`, so every element of `c` sums the same partial products in the same order.
const MIN_PART: usize = 65;

/// Part boundaries fall on multiples of this (the AVX-512 kernel's 16 lanes), so no part gets a ragged edge
/// inside a vector that the single call would not have.
const SPLIT_ALIGN: usize = 16;

/// The fewest columns (rows) beside a split of rows (columns): under it, or at a depth under 3, the crate takes
/// its matrix-vector, tiny-output (`m·n ≤ 256`) or depth-2 kernels, which sum in another order than its
/// blocked kernel; at this or more, the whole product and every part take the blocked kernel.
const MIN_OTHER: usize = 4;

/// One `gemm::gemm` call on the calling thread (`Parallelism::None`: the drafter's threads split products
/// themselves, see [`product_on_threads`]). The crate computes `dst = alpha·dst + beta·lhs·rhs`, the names
/// swapped against BLAS's; with `read_dst = false` (and with a zero `alpha`) it never reads `dst`, which is how
/// `beta = 0` keeps NaN in `c` from leaking.
///
/// # Safety
/// As [`product_on_threads`].
unsafe fn product(
    (m, k, n): (usize, usize, usize),
    alpha: f32,
    (a, rsa, csa): (*const f32, isize, isize),
    (b, rsb, csb): (*const f32, isize, isize),
    beta: f32,
    (c, rsc, csc): (*mut f32, isize, isize),
) {
    // SAFETY: the caller's contract; the crate reads `a` and `b` and writes `c` at exactly these strides.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c,
            csc,
            rsc,
            beta != 0.0,
            a,
            csa,
            rsa,
            b,
            csb,
            rsb,
            beta,
            alpha,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// `c = alpha · a · b + beta · c` through [`product`], split over the current rayon pool when called inside one
/// with two threads or more (a CPU drafter's step, see [`super::HostThreads`]) and the product is large enough:
/// the output's rows (or columns, when it has more of them) in one block per thread, each a single-threaded
/// product. Every block takes the same kernel and depth blocking as the whole ([`MIN_PART`], [`MIN_OTHER`]), so
/// every element of `c` is computed by the same sequence of operations whatever the split: results are identical.
///
/// The drafter's threads take the GEMMs too, instead of a pool of the GEMM's own: two pools of spinning threads
/// on the same cores (one for the GEMMs, one for the other kernels) spent a fifth of a DFlash step yielding to
/// each other.
///
/// # Safety
/// Every strided access of the `m × k`, `k × n` and `m × n` operands lies inside its buffer, and `c` overlaps
/// neither input.
#[allow(clippy::too_many_arguments)]
unsafe fn product_on_threads(
    m: usize,
    k: usize,
    n: usize,
    alpha: f32,
    a: *const f32,
    rsa: isize,
    csa: isize,
    b: *const f32,
    rsb: isize,
    csb: isize,
    beta: f32,
    c: *mut f32,
    rsc: isize,
    csc: isize,
) {
    let threads = if rayon::current_thread_index().is_some() {
        rayon::current_num_threads()
    } else {
        1
    };
    let split_rows = m >= n;
    let (extent, other) = if split_rows { (m, n) } else { (n, m) };
    // Parts of at least `extent / parts ≥ MIN_PART + SPLIT_ALIGN` before their starts are rounded down to
    // `SPLIT_ALIGN`, so each keeps more than `MIN_PART`.
    let parts = threads.min(extent / (MIN_PART + SPLIT_ALIGN));
    if parts < 2 || other < MIN_OTHER || k < 3 || m * k * n < SPLIT_WORK {
        // SAFETY: the caller's contract.
        return unsafe {
            product(
                (m, k, n),
                alpha,
                (a, rsa, csa),
                (b, rsb, csb),
                beta,
                (c, rsc, csc),
            )
        };
    }
    let start = |part: usize| part * extent / parts / SPLIT_ALIGN * SPLIT_ALIGN;
    let (a, b, c) = (SharedPtr(a), SharedPtr(b), SharedPtr(c));
    use rayon::prelude::*;
    (0..parts).into_par_iter().for_each(|part| {
        let first = start(part);
        let len = if part + 1 == parts {
            extent
        } else {
            start(part + 1)
        } - first;
        let offset = first as isize;
        // SAFETY: a block of rows (columns) of `c` with the same rows of `a` (columns of `b`) is a smaller product
        // inside the same buffers; the blocks of `c` are disjoint.
        unsafe {
            if split_rows {
                let (a, c) = (a.get().offset(offset * rsa), c.get().offset(offset * rsc));
                product(
                    (len, k, n),
                    alpha,
                    (a, rsa, csa),
                    (b.get(), rsb, csb),
                    beta,
                    (c, rsc, csc),
                );
            } else {
                let (b, c) = (b.get().offset(offset * csb), c.get().offset(offset * csc));
                product(
                    (m, k, len),
                    alpha,
                    (a.get(), rsa, csa),
                    (b, rsb, csb),
                    beta,
                    (c, rsc, csc),
                );
            }
        }
    });
}

/// Floating-point operations of one `gemm` with these shapes (`2·m·k·n`).
pub fn gemm_flops(m: usize, k: usize, n: usize) -> u64 {
    2 * (m * k * n) as u64
}

#[cfg(test)]
mod tests {
    use super::{Mat, Strided, gemm, gemm_strided};
    use crate::backend::cpu::HostThreads;

    /// `len` values in `[-1, 1)`, a different sequence per `seed` (a 64-bit LCG's high bits).
    fn values(len: usize, seed: u64) -> Vec<f32> {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    /// A row-major `[m, k]` operand stored as it is used, or stored `[k, m]` and read transposed.
    fn operand(data: &[f32], (rows, cols): (usize, usize), transposed: bool) -> Mat<'_> {
        if transposed {
            Mat::new(data, cols, rows).t()
        } else {
            Mat::new(data, rows, cols)
        }
    }

    /// Element `(i, j)` of an operand built by [`operand`].
    fn at(data: &[f32], (rows, cols): (usize, usize), transposed: bool, i: usize, j: usize) -> f64 {
        f64::from(if transposed {
            data[j * rows + i]
        } else {
            data[i * cols + j]
        })
    }

    /// Shapes `(m, k, n)` that reach each kernel the `gemm` crate picks: matrix-vector, depth 2, depth 0, tiny
    /// outputs, its small-matrix blocking (depth over 512), its blocked kernel with ragged tiles.
    const SHAPES: [(usize, usize, usize); 8] = [
        (1, 37, 9),
        (9, 37, 1),
        (5, 2, 6),
        (4, 0, 5),
        (3, 5, 7),
        (40, 600, 30),
        (130, 700, 97),
        (67, 64, 200),
    ];

    #[test]
    fn products_match_f64_for_every_transpose_alpha_and_beta() {
        for (case, &(m, k, n)) in SHAPES.iter().enumerate() {
            for (at_t, bt_t) in [(false, false), (false, true), (true, false), (true, true)] {
                for (alpha, beta) in [(1.0f32, 0.0f32), (-0.5, 0.0), (1.0, 1.0), (0.75, -0.25)] {
                    let seed = 4 * case as u64;
                    let (a, b) = (values(m * k, seed), values(k * n, seed + 1));
                    let before = values(m * n, seed + 2);
                    // With beta = 0 the product must not read `c`: NaN there would reach every element.
                    let mut c = if beta == 0.0 {
                        vec![f32::NAN; m * n]
                    } else {
                        before.clone()
                    };
                    let (ma, mb) = (operand(&a, (m, k), at_t), operand(&b, (k, n), bt_t));
                    gemm(&mut c, ma, mb, alpha, beta);
                    for i in 0..m {
                        for j in 0..n {
                            let (mut sum, mut size) = (0.0f64, 0.0f64);
                            for p in 0..k {
                                let term = at(&a, (m, k), at_t, i, p) * at(&b, (k, n), bt_t, p, j);
                                sum += term;
                                size += term.abs();
                            }
                            let old = if beta == 0.0 {
                                0.0
                            } else {
                                f64::from(before[i * n + j])
                            };
                            let want = f64::from(alpha) * sum + f64::from(beta) * old;
                            // f32 sums of k products and the update: within (k + 2) ulps of the terms' size.
                            let bound = (k as f64 + 2.0)
                                * f64::from(f32::EPSILON)
                                * (f64::from(alpha.abs()) * size
                                    + f64::from(beta.abs()) * old.abs());
                            let got = f64::from(c[i * n + j]);
                            assert!(
                                (got - want).abs() <= bound,
                                "{m}×{k}×{n} a^T={at_t} b^T={bt_t} alpha={alpha} beta={beta} ({i}, {j}): \
                                 {got} vs {want} (bound {bound:.2e})"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn strided_views_read_and_write_only_their_blocks() {
        // a: rows 2.. of a [12, 9] matrix, columns 1..8 (m = 10, k = 7); b: the transpose of a [6, 7] block of
        // a [6, 11] matrix at column 3 (k = 7, n = 6); c: columns 2..8 of a [10, 9] matrix.
        let (m, k, n) = (10, 7, 6);
        let (a, b) = (values(12 * 9, 1), values(6 * 11, 2));
        let av = Strided {
            data: &a,
            offset: 2 * 9 + 1,
            row_stride: 9,
            col_stride: 1,
        };
        let bv = Strided {
            data: &b,
            offset: 3,
            row_stride: 1,
            col_stride: 11,
        };
        let before = values(m * 9, 3);
        let mut c = before.clone();
        gemm_strided((&mut c, 2, 9, 1), av, bv, (m, k, n), 2.0, 0.5);
        for i in 0..m {
            for j in 0..9 {
                let got = c[i * 9 + j];
                if !(2..2 + n).contains(&j) {
                    assert_eq!(
                        got,
                        before[i * 9 + j],
                        "({i}, {j}) lies outside the view of c"
                    );
                    continue;
                }
                let sum: f64 = (0..k)
                    .map(|p| f64::from(a[(2 + i) * 9 + 1 + p]) * f64::from(b[(j - 2) * 11 + 3 + p]))
                    .sum();
                let want = 2.0 * sum + 0.5 * f64::from(before[i * 9 + j]);
                assert!(
                    (f64::from(got) - want).abs() <= 1e-5,
                    "({i}, {j}): {got} vs {want}"
                );
            }
        }
    }

    /// Splitting a product over a drafter's threads changes no bit of it, for splits of rows and of columns,
    /// including shapes whose halves would fall to the crate's small-matrix blocking (128 × 64 at depth 700:
    /// halves of 64 rows would block the depth by 512, the whole product by 350).
    #[test]
    fn a_split_over_threads_is_bit_identical_to_one_call() {
        let shapes = [
            (128, 700, 64),
            (130, 700, 97),
            (64, 600, 400),
            (500, 64, 8),
            (2000, 300, 3),
            (512, 513, 512),
        ];
        for threads in [2, 3, 4] {
            let pool = HostThreads::new("gemm-test", threads).expect("threads");
            for &(m, k, n) in &shapes {
                for (alpha, beta) in [(1.0f32, 0.0f32), (0.5, 1.0)] {
                    let (a, b) = (values(m * k, 7), values(n * k, 8));
                    let mut single = values(m * n, 9);
                    let mut split = single.clone();
                    let (ma, mb) = (Mat::new(&a, m, k), Mat::new(&b, n, k).t());
                    gemm(&mut single, ma, mb, alpha, beta);
                    pool.run(|| gemm(&mut split, ma, mb, alpha, beta));
                    let differ = single
                        .iter()
                        .zip(&split)
                        .filter(|(x, y)| x.to_bits() != y.to_bits())
                        .count();
                    assert_eq!(
                        differ, 0,
                        "{m}×{k}×{n} beta={beta} on {threads} threads: {differ} elements differ"
                    );
                }
            }
        }
    }
}
