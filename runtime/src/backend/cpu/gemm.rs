//! Row-major matrix products on flat buffers, through `matrixmultiply::sgemm` (the backend `nalgebra` uses for
//! f32), split over the CPU drafter's threads ([`super::HostThreads`], thread count from `MATMUL_NUM_THREADS`).
//!
//! The drafter's tensors are row-major PyTorch `[out, in]` slices of the flat buffers. `sgemm` takes a row and
//! a column stride per operand, so a transposed operand is the same slice with swapped strides: no copies and
//! no column-major reinterpretation (which is all `nalgebra`'s `gemm` would add on top of the same call).

use super::kernels::SharedPtr;

/// The environment variable that sets a CPU drafter's thread count ([`super::HostThreads::drafter_threads`]);
/// matrixmultiply's own name for its thread count, kept so existing settings still apply.
pub const GEMM_THREADS_VAR: &str = "MATMUL_NUM_THREADS";

/// Threads per drafter so that `cpu_drafters` drafters running at once use `cores` cores without
/// oversubscribing them: `cores / cpu_drafters`, at least 1. Each drafter's pool would otherwise take every
/// core, and the drafters' pools would preempt each other.
///
/// On the 2-core build machine the quickstart (two CPU drafters) ran at 5268 tok/s with one GEMM thread, and at
/// 3924 tok/s with matrixmultiply's default of two (`--steps 40`, alternated).
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
        sgemm_on_threads(
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
        sgemm_on_threads(
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

/// Rows or columns per part are a multiple of this (the widest microkernel's tile), so no part gets a ragged
/// edge that a single call would not have.
const SPLIT_ALIGN: usize = 16;

/// `matrixmultiply::sgemm`, split over the current rayon pool when called inside one with two threads or
/// more (a CPU drafter's step, see [`super::HostThreads`]) and the product is large enough: the output's rows
/// (or columns, when it has more of them) in one block per thread, each a single-threaded `sgemm`. Every
/// element of `c` is computed by the same sequence of operations whatever the split, so results are identical.
///
/// The drafter's threads take the GEMMs too, instead of matrixmultiply's own pool: two pools of spinning threads
/// on the same cores (one for the GEMMs, one for the other kernels) spent a fifth of a DFlash step yielding to
/// each other.
///
/// # Safety
/// As `matrixmultiply::sgemm`: every strided access of the `m × k`, `k × n` and `m × n` operands lies inside
/// its buffer, and `c` overlaps neither input.
#[allow(clippy::too_many_arguments)]
unsafe fn sgemm_on_threads(
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
    let extent = if split_rows { m } else { n };
    let parts = threads.min(extent.div_ceil(SPLIT_ALIGN));
    if parts < 2 || m * k * n < SPLIT_WORK {
        // SAFETY: the caller's contract.
        return unsafe {
            matrixmultiply::sgemm(m, k, n, alpha, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc)
        };
    }
    let per_part = extent.div_ceil(SPLIT_ALIGN).div_ceil(parts) * SPLIT_ALIGN;
    let (a, b, c) = (SharedPtr(a), SharedPtr(b), SharedPtr(c));
    use rayon::prelude::*;
    (0..parts).into_par_iter().for_each(|part| {
        let start = (part * per_part).min(extent);
        let len = per_part.min(extent - start);
        if len == 0 {
            return;
        }
        let offset = start as isize;
        // SAFETY: a block of rows (columns) of `c` with the same rows of `a` (columns of `b`) is a smaller product
        // inside the same buffers; the blocks of `c` are disjoint.
        unsafe {
            if split_rows {
                let (a, c) = (a.get().offset(offset * rsa), c.get().offset(offset * rsc));
                matrixmultiply::sgemm(
                    len,
                    k,
                    n,
                    alpha,
                    a,
                    rsa,
                    csa,
                    b.get(),
                    rsb,
                    csb,
                    beta,
                    c,
                    rsc,
                    csc,
                );
            } else {
                let (b, c) = (b.get().offset(offset * csb), c.get().offset(offset * csc));
                matrixmultiply::sgemm(
                    m,
                    k,
                    len,
                    alpha,
                    a.get(),
                    rsa,
                    csa,
                    b,
                    rsb,
                    csb,
                    beta,
                    c,
                    rsc,
                    csc,
                );
            }
        }
    });
}

/// Floating-point operations of one `gemm` with these shapes (`2·m·k·n`).
pub fn gemm_flops(m: usize, k: usize, n: usize) -> u64 {
    2 * (m * k * n) as u64
}
