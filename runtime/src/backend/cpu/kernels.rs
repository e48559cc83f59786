//! Safe host launchers for the `draftpipe-gpu-kernels` bodies.
//!
//! ```text
//!  kernel table (gpu-kernels/src/table.rs) ──▶ launch::NAME(reads, writes, scalars): checks every slice against
//!                                             its declared length, then runs the launch shape on the host
//!                                         └──▶ run(Kernel): the CPU backend's `Backend::launch`, a match onto
//!                                             the launchers
//!  the functions below ──▶ the kernels over plain slices for the kernel tests and benches: sizes taken from the
//!                          slices, composite launches (two-pass sums); the backend's operations do the same
//!                          over its views (`backend/operations.rs`)
//! ```
//!
//! Host launch shapes: `threads(count)` is a loop over the indices, `planes(count)` runs a
//! [`HostPlane`] (the lanes as a loop) per index, `elements(n)` runs chunks of [`HOST_CHUNK`] elements so the
//! inner loops vectorise.
//!
//! Each generated launcher is compiled twice from its one body: for the baseline x86-64 target and for
//! AVX2 + FMA, picked at run time by what the CPU has. The kernels' `exp`/`rsqrt` polynomials are what bound the
//! loss and activation kernels, and twice the lanes nearly halve them. Both copies give bit-identical results:
//! the kernels fix their summation order in code, and Rust never fuses `a * b + c` into an FMA on its own, so the
//! wider target changes only how many lanes run at once (a test compares the two bit for bit).
//!
//! # Panics
//! Every launcher panics when a buffer is shorter than its shape needs: the step sizes all buffers from one
//! bucket shape, so a mismatch is a bug, and the check is what makes the `unsafe` kernel calls sound.

pub use draftpipe_gpu_kernels::adamw::AdamWStep;
pub use draftpipe_gpu_kernels::loss::IGNORE_LABEL;
use draftpipe_gpu_kernels::plane::HostPlane;
use draftpipe_gpu_kernels::reduce::partial_chunk_len;

use super::CpuBackend;
use crate::backend::Kernel;

/// Elements per call of an element-range kernel on the host.
pub const HOST_CHUNK: usize = 4096;

/// Whether the launchers take their AVX2 + FMA copies: the CPU has both (std detects them once and caches the
/// answer), and, in this crate's unit tests, the calling thread has not asked for the baseline.
#[cfg(target_arch = "x86_64")]
fn simd_available() -> bool {
    #[cfg(test)]
    if BASELINE_ONLY.with(std::cell::Cell::get) {
        return false;
    }
    std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
}

#[cfg(test)]
thread_local! {
    /// Launches that took the AVX2 + FMA copies on this thread (the bit-identity test checks they ran).
    pub(crate) static WIDE_LAUNCHES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    /// Set by a test to make the launchers take their baseline copies on its thread.
    pub(crate) static BASELINE_ONLY: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Generates [`launch`]: one host launcher per kernel of the table. A launcher checks every slice against its
/// declared length, splits the launch's indices into parts ([`for_each_part`]: over the current rayon pool when
/// it runs inside one), and runs each part over one body compiled twice: baseline, and inside a
/// `#[target_feature(enable = "avx2,fma")]` copy where the `#[inline(always)]` kernel bodies vectorise with 8
/// lanes. The copy runs when `simd_available` says the CPU has both features.
macro_rules! host_launchers {
    ($(
        $(#[$doc:meta])*
        $name:ident {
            reads: [$($read:ident: $read_ty:ty = $read_len:expr),* $(,)?],
            writes: [$($write:ident: $write_ty:ty = $write_len:expr),* $(,)?],
            scalars: [$($scalar:ident: $scalar_ty:ty),* $(,)?],
            launch: $shape:ident($($count:expr)?),
            body: |$($bind:ident),*| $body:expr,
        }
    )*) => {
        /// One launcher per kernel of the table, arguments in the table's order (reads, writes, scalars).
        pub mod launch {
            use super::*;
            $(
                $(#[$doc])*
                ///
                /// # Panics
                /// When a slice is shorter than the length the kernel table declares for it.
                #[allow(clippy::too_many_arguments)]
                pub fn $name(
                    $($read: &[$read_ty],)*
                    $($write: &mut [$write_ty],)*
                    $($scalar: $scalar_ty,)*
                ) {
                    $(assert!(
                        $read.len() >= $read_len,
                        concat!(stringify!($name), ": ", stringify!($read), " holds {} elements, needs {}"),
                        $read.len(),
                        $read_len
                    );)*
                    $(assert!(
                        $write.len() >= $write_len,
                        concat!(stringify!($name), ": ", stringify!($write), " holds {} elements, needs {}"),
                        $write.len(),
                        $write_len
                    );)*

                    // A scalar that only sizes the launch (`rows` of `planes(rows)`) is unused in the body.
                    #[allow(clippy::too_many_arguments, unused_variables)]
                    #[inline(always)]
                    fn baseline(
                        part: std::ops::Range<usize>,
                        $($read: *const $read_ty,)*
                        $($write: *mut $write_ty,)*
                        $($scalar: $scalar_ty,)*
                    ) {
                        host_launchers!(@run $shape(part) |$($bind),*| $body);
                    }

                    #[cfg(target_arch = "x86_64")]
                    #[allow(clippy::too_many_arguments)]
                    #[target_feature(enable = "avx2,fma")]
                    fn avx2_fma(
                        part: std::ops::Range<usize>,
                        $($read: *const $read_ty,)*
                        $($write: *mut $write_ty,)*
                        $($scalar: $scalar_ty,)*
                    ) {
                        baseline(part, $($read,)* $($write,)* $($scalar,)*)
                    }

                    #[cfg(target_arch = "x86_64")]
                    let wide = simd_available();
                    #[cfg(target_arch = "x86_64")]
                    #[cfg(test)]
                    if wide {
                        WIDE_LAUNCHES.with(|n| n.set(n.get() + 1));
                    }
                    $(let $read = SharedPtr($read.as_ptr());)*
                    $(let $write = SharedPtr($write.as_mut_ptr());)*
                    let count = host_launchers!(@count $shape($($count)?));
                    for_each_part(count, |part| {
                        $(let $read = $read.get();)*
                        $(let $write = $write.get();)*
                        #[cfg(target_arch = "x86_64")]
                        if wide {
                            // SAFETY: `simd_available` checked that this CPU has AVX2 and FMA.
                            return unsafe { avx2_fma(part, $($read,)* $($write,)* $($scalar,)*) };
                        }
                        baseline(part, $($read,)* $($write,)* $($scalar,)*)
                    });
                }
            )*
        }
    };
    (@count threads($count:expr)) => { $count };
    (@count planes($count:expr)) => { $count };
    (@count plane()) => { 1 };
    (@count elements($n:expr)) => { ($n).div_ceil(HOST_CHUNK) };
    // SAFETY (every arm): the lengths checked in the launcher cover every index of the launch; the writes are
    // unique borrows, so they overlap nothing; and no two indices of a launch touch the same output element
    // (the kernels' contract, which the GPU's parallel threads rely on too), so parts may run at once.
    (@run threads($part:ident) |$index:ident| $body:expr) => {
        for $index in $part {
            unsafe { $body };
        }
    };
    (@run planes($part:ident) |$plane:ident, $index:ident| $body:expr) => {
        for $index in $part {
            let $plane = HostPlane;
            unsafe { $body };
        }
    };
    (@run plane($part:ident) |$plane:ident| $body:expr) => {{
        let _ = $part;
        let $plane = HostPlane;
        unsafe { $body };
    }};
    (@run elements($part:ident) |$chunk_len:ident, $chunk:ident| $body:expr) => {
        let $chunk_len = HOST_CHUNK;
        for $chunk in $part {
            unsafe { $body };
        }
    };
}

/// A launch's buffer as the parts of a launch share it: every index touches its own elements (the kernels'
/// contract: on the GPU the indices are concurrent threads), so the pointer may cross to the pool's threads.
#[derive(Clone, Copy)]
pub(crate) struct SharedPtr<P>(pub(crate) P);

// SAFETY: see the type's docs; the launcher holds the slices' borrows for as long as any part runs.
unsafe impl<P> Send for SharedPtr<P> {}
// SAFETY: as above.
unsafe impl<P> Sync for SharedPtr<P> {}

impl<P: Copy> SharedPtr<P> {
    /// The pointer (a method, so a closure captures the whole wrapper and not its non-`Sync` field).
    #[inline(always)]
    pub(crate) fn get(self) -> P {
        self.0
    }
}

/// Parts per pool thread: the attention tiles of late anchors see more keys than early ones, so a launch split
/// into exactly one part per thread would wait for its slowest part.
const PARTS_PER_THREAD: usize = 4;

/// Runs `part` over `0..count` split into contiguous ranges: across the current rayon pool when the caller runs
/// inside one with two threads or more (a CPU drafter's step does, see [`super::HostThreads`]), on the calling
/// thread otherwise. Results do not depend on the split: each index is computed the same way wherever it runs.
pub(crate) fn for_each_part(count: usize, part: impl Fn(std::ops::Range<usize>) + Sync) {
    let threads = if rayon::current_thread_index().is_some() {
        rayon::current_num_threads()
    } else {
        1
    };
    if threads < 2 || count < 2 {
        return part(0..count);
    }
    let parts = (threads * PARTS_PER_THREAD).min(count);
    use rayon::prelude::*;
    (0..parts)
        .into_par_iter()
        .for_each(|p| part(p * count / parts..(p + 1) * count / parts));
}

draftpipe_gpu_kernels::kernel_table!(host_launchers);

/// Generates [`run`]: the CPU backend's [`Backend::launch`](crate::backend::Backend::launch), one arm per kernel
/// of the table calling its host launcher with the variant's fields in the table's order.
macro_rules! host_dispatch {
    ($(
        $(#[$doc:meta])*
        $name:ident {
            reads: [$($read:ident: $read_ty:ty = $read_len:expr),* $(,)?],
            writes: [$($write:ident: $write_ty:ty = $write_len:expr),* $(,)?],
            scalars: [$($scalar:ident: $scalar_ty:ty),* $(,)?],
            launch: $shape:ident($($count:expr)?),
            body: |$($bind:ident),*| $body:expr,
        }
    )*) => {
        /// Runs `kernel` through its host launcher ([`launch`]).
        ///
        /// # Panics
        /// As the launcher: when a slice is shorter than the table declares.
        pub(crate) fn run(kernel: Kernel<'_, CpuBackend>) {
            match kernel {
                $(Kernel::$name { $($read,)* $($write,)* $($scalar,)* } => {
                    launch::$name($($read,)* $($write,)* $($scalar,)*)
                })*
            }
        }
    };
}

draftpipe_gpu_kernels::kernel_table!(host_dispatch);

/// RMSNorm forward over `rows = x.len() / weight.len()` rows; `y = x / rms ⊙ weight`, `inv_rms[r] = 1/rms`.
pub fn rmsnorm_forward(x: &[f32], weight: &[f32], y: &mut [f32], inv_rms: &mut [f32], eps: f32) {
    let (rows, cols) = (inv_rms.len(), weight.len());
    assert!(
        x.len() == rows * cols && y.len() == rows * cols,
        "rmsnorm_forward: buffer sizes"
    );
    launch::rmsnorm_forward(x, weight, y, inv_rms, cols, eps, rows);
}

/// RMSNorm input gradient; `dx = ∂L/∂x` (or `dx += ∂L/∂x` with `accumulate`).
pub fn rmsnorm_backward_input(
    x: &[f32],
    weight: &[f32],
    inv_rms: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    accumulate: bool,
) {
    let (rows, cols) = (inv_rms.len(), weight.len());
    let n = rows * cols;
    assert!(
        x.len() == n && dy.len() == n && dx.len() == n,
        "rmsnorm_backward_input: buffer sizes"
    );
    launch::rmsnorm_backward_input(
        x,
        weight,
        inv_rms,
        dy,
        dx,
        cols,
        u32::from(accumulate),
        rows,
    );
}

/// RMSNorm weight gradient `dw[c] = Σ_r dy[r,c]·x[r,c]·inv_rms[r]` by the two-pass reduction, using
/// `partials` (at least `ceil(rows / rows_per_chunk) · cols` elements) as scratch.
pub fn rmsnorm_weight_grad(
    x: &[f32],
    inv_rms: &[f32],
    dy: &[f32],
    dw: &mut [f32],
    partials: &mut [f32],
    rows_per_chunk: usize,
) {
    let (rows, cols) = (inv_rms.len(), dw.len());
    assert!(rows_per_chunk > 0, "rmsnorm_weight_grad: empty chunk");
    assert!(
        x.len() == rows * cols && dy.len() == rows * cols,
        "rmsnorm_weight_grad: buffer sizes"
    );
    launch::rmsnorm_weight_grad_partials(x, inv_rms, dy, partials, rows, cols, rows_per_chunk);
    launch::column_sums(partials, dw, rows.div_ceil(rows_per_chunk), cols, 0);
}

/// SwiGLU forward: `act = silu(gate) ⊙ up` from `[gate | up]` rows of width `2 · inter`.
pub fn swiglu_forward(gate_up: &[f32], act: &mut [f32], inter: usize) {
    let n = act.len();
    assert_eq!(gate_up.len(), 2 * n, "swiglu_forward: buffer sizes");
    launch::swiglu_forward(gate_up, act, inter, n);
}

/// SwiGLU backward into the `[dgate | dup]` rows of `dgate_up`.
pub fn swiglu_backward(gate_up: &[f32], dact: &[f32], dgate_up: &mut [f32], inter: usize) {
    let n = dact.len();
    assert!(
        gate_up.len() == 2 * n && dgate_up.len() == 2 * n,
        "swiglu_backward: buffer sizes"
    );
    launch::swiglu_backward(gate_up, dact, dgate_up, inter, n);
}

/// Head residual forward `h = z + silu(a)`.
pub fn head_residual_forward(z: &[f32], a: &[f32], h: &mut [f32]) {
    let n = h.len();
    assert!(
        z.len() == n && a.len() == n,
        "head_residual_forward: buffer sizes"
    );
    launch::head_residual_forward(z, a, h, n);
}

/// Head residual backward: `da = dh · silu'(a)` (the gradient with respect to `a`) and `dz += dh`.
///
/// `da` is a separate buffer although the kernel allows `da = dh`: distinct buffers pass the compiler's runtime
/// overlap check, so the loop runs vectorised (in place it measured 4× slower).
pub fn head_residual_backward(a: &[f32], dh: &[f32], da: &mut [f32], dz: &mut [f32]) {
    let n = a.len();
    assert!(
        dh.len() == n && da.len() == n && dz.len() == n,
        "head_residual_backward: buffer sizes"
    );
    launch::head_residual_backward(a, dh, da, dz, n);
}

/// Labels of every head, `labels[j · tokens + t]` (see [`draftpipe_gpu_kernels::loss::build_labels`]).
pub fn build_labels(
    input_ids: &[u32],
    loss_mask: &[u8],
    seq_lens: &[u32],
    labels: &mut [i32],
    padded_len: usize,
    vocab: usize,
) {
    let tokens = input_ids.len();
    assert!(
        padded_len > 0 && tokens == seq_lens.len() * padded_len,
        "build_labels: shape"
    );
    assert!(
        loss_mask.len() == tokens && labels.len().is_multiple_of(tokens.max(1)),
        "build_labels: buffer sizes"
    );
    let heads = labels.len() / tokens.max(1);
    launch::build_labels(
        input_ids, loss_mask, seq_lens, labels, padded_len, tokens, vocab, heads,
    );
}

/// Valid-label counts and loss scales of every head.
pub fn head_loss_scales(labels: &[i32], head_decay: f32, counts: &mut [u32], scales: &mut [f32]) {
    let heads = counts.len();
    assert!(
        scales.len() == heads && heads > 0 && labels.len().is_multiple_of(heads),
        "head_loss_scales: buffer sizes"
    );
    launch::head_loss_scales(
        labels,
        counts,
        scales,
        labels.len() / heads,
        heads,
        head_decay,
    );
}

/// Fused cross-entropy over the rows of a logits chunk `[rows, vocab]`: per-row scaled loss into `row_loss`,
/// the scaled logits gradient in place. Labels must be `< vocab` or negative (ignored).
pub fn vocab_loss(
    logits: &mut [f32],
    labels: &[i32],
    scale: f32,
    row_loss: &mut [f32],
    vocab: usize,
) {
    let rows = labels.len();
    assert!(
        vocab > 0 && logits.len() == rows * vocab && row_loss.len() == rows,
        "vocab_loss: buffer sizes"
    );
    assert!(
        labels.iter().all(|&l| l < vocab as i32),
        "vocab_loss: label out of range"
    );
    launch::vocab_loss_row(labels, &[scale], logits, row_loss, vocab, rows);
}

/// Deterministic sum of `values` through `partials` (at least `ceil(n / chunk_len)` elements), in chunks of
/// `chunk_len` or longer ([`partial_chunk_len`]: at most `MAX_PARTIALS` of them).
pub fn sum(values: &[f32], chunk_len: usize, partials: &mut [f32]) -> f32 {
    assert!(chunk_len > 0, "sum: empty chunk");
    let chunk_len = partial_chunk_len(values.len(), chunk_len);
    let chunks = values.len().div_ceil(chunk_len);
    launch::sum_partials(values, partials, values.len(), chunk_len);
    let mut total = [0.0];
    launch::finish_sum(partials, &mut total, chunks);
    total[0]
}

/// Global L2 norm of `values` and the clip scale for `max_norm` (`≤ 0`: no clipping), by the deterministic
/// two-pass reduction through `partials` (at least `ceil(n / chunk_len)` elements), in chunks of `chunk_len` or
/// longer ([`partial_chunk_len`]).
pub fn grad_norm(
    values: &[f32],
    chunk_len: usize,
    partials: &mut [f32],
    max_norm: f32,
) -> (f32, f32) {
    assert!(chunk_len > 0, "grad_norm: empty chunk");
    let chunk_len = partial_chunk_len(values.len(), chunk_len);
    let chunks = values.len().div_ceil(chunk_len);
    launch::sum_squares_partials(values, partials, values.len(), chunk_len);
    let (mut norm, mut scale) = ([0.0], [0.0]);
    launch::finish_grad_norm(partials, &mut norm, &mut scale, chunks, max_norm);
    (norm[0], scale[0])
}

/// One fused AdamW pass over all parameters; a no-op when `grad_norm` is not finite.
#[allow(clippy::too_many_arguments)]
pub fn adamw_update(
    params: &mut [f32],
    grads: &[f32],
    exp_avg: &mut [f32],
    exp_avg_sq: &mut [f32],
    grad_norm: f32,
    clip_scale: f32,
    hyper: AdamWStep,
) {
    let n = params.len();
    assert!(
        grads.len() == n && exp_avg.len() == n && exp_avg_sq.len() == n,
        "adamw_update: buffer sizes"
    );
    launch::adamw_update(
        grads,
        &[grad_norm],
        &[clip_scale],
        &[hyper],
        params,
        exp_avg,
        exp_avg_sq,
        n,
    );
}

/// `out[r] = table[ids[r]]` for `rows = ids.len()` rows of `hidden = out.len() / rows` columns.
///
/// # Panics
/// When the sizes disagree or an id is outside the table (`table.len() / hidden` rows).
pub fn embedding_gather(table: &[f32], ids: &[u32], out: &mut [f32]) {
    let rows = ids.len();
    assert!(
        rows > 0 && out.len().is_multiple_of(rows),
        "embedding_gather: {} outputs for {rows} ids",
        out.len()
    );
    let hidden = out.len() / rows;
    assert!(
        hidden > 0 && table.len().is_multiple_of(hidden),
        "embedding_gather: table of {} is not a whole number of rows of {hidden}",
        table.len()
    );
    let vocab = table.len() / hidden;
    if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
        panic!("embedding_gather: token id {bad} outside a table of {vocab} rows");
    }
    launch::embedding_gather(table, ids, out, vocab, hidden, out.len());
}

/// Weighted fused cross-entropy over the rows of a logits chunk `[rows, vocab]` (see
/// [`draftpipe_gpu_kernels::loss::weighted_vocab_loss_row`]): gradient in place, `row_loss` and `correct`
/// per row; `norm` is `1 / Σ weights`.
///
/// # Panics
/// When the sizes disagree or a label is `≥ vocab`.
#[allow(clippy::too_many_arguments)]
pub fn weighted_vocab_loss(
    logits: &mut [f32],
    labels: &[i32],
    weights: &[f32],
    norm: f32,
    row_loss: &mut [f32],
    correct: &mut [f32],
    vocab: usize,
) {
    let rows = labels.len();
    assert!(
        vocab > 0
            && logits.len() == rows * vocab
            && weights.len() == rows
            && row_loss.len() == rows
            && correct.len() == rows,
        "weighted_vocab_loss: buffer sizes"
    );
    assert!(
        labels.iter().all(|&l| l < vocab as i32),
        "weighted_vocab_loss: label out of range"
    );
    launch::weighted_vocab_loss_row(
        labels,
        weights,
        &[norm],
        logits,
        row_loss,
        correct,
        vocab,
        rows,
    );
}

/// The AdamW scalars of step `step` (1-based, after incrementing), bias corrections computed in f64 as PyTorch
/// does in Python floats.
pub fn adamw_step_scalars(
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    weight_decay: f32,
    step: u64,
) -> AdamWStep {
    let t = step as f64;
    let bc1 = 1.0 - (beta1 as f64).powf(t);
    let bc2 = 1.0 - (beta2 as f64).powf(t);
    AdamWStep {
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        step_size: (lr as f64 / bc1) as f32,
        bias_correction2_sqrt: bc2.sqrt() as f32,
    }
}
