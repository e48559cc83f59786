//! Device entry points (nvptx64 build only): one `extern "ptx-kernel"` per kernel body, one thread per index.
//!
//! ```text
//!  runtime::cuda launches NAME(args..., count) on ceil(count / block) blocks
//!      └─▶ NAME computes index = blockIdx.x · blockDim.x + threadIdx.x, returns when index ≥ count,
//!          else calls the shared body (the one the CPU backend runs in a loop)
//! ```
//!
//! The exported names are the ones `runtime::cuda::KERNEL_NAMES` loads. Element-range bodies run with
//! `chunk_len = 1`, so `count` is their element count. Flags cross the kernel ABI as `u32` (non-zero is true)
//! and AdamW's per-step scalars through device memory, so the host passes only plain `DeviceRepr` values.

use core::arch::nvptx::{_block_dim_x, _block_idx_x, _thread_idx_x};

use crate::adamw::AdamWStep;
use crate::{activation, adamw, loss, norm, reduce};

/// This thread's index in a one-dimensional launch.
#[inline(always)]
fn global_index() -> usize {
    // SAFETY: reading the special registers has no preconditions inside a kernel.
    unsafe { _block_idx_x() as usize * _block_dim_x() as usize + _thread_idx_x() as usize }
}

/// Runs `body(index)` for this thread when `index < count`.
#[inline(always)]
fn for_index(count: usize, body: impl FnOnce(usize)) {
    let index = global_index();
    if index < count {
        body(index);
    }
}

/// [`norm::rmsnorm_forward`], one thread per row.
///
/// # Safety
/// As the body, for every row `< rows`.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn rmsnorm_forward(
    x: *const f32,
    weight: *const f32,
    y: *mut f32,
    inv_rms: *mut f32,
    cols: usize,
    eps: f32,
    rows: usize,
) {
    for_index(rows, |row| unsafe {
        norm::rmsnorm_forward(x, weight, y, inv_rms, cols, eps, row)
    });
}

/// [`norm::rmsnorm_backward_input`], one thread per row.
///
/// # Safety
/// As the body, for every row `< rows`.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn rmsnorm_backward_input(
    x: *const f32,
    weight: *const f32,
    inv_rms: *const f32,
    dy: *const f32,
    dx: *mut f32,
    cols: usize,
    accumulate: u32,
    rows: usize,
) {
    for_index(rows, |row| unsafe {
        norm::rmsnorm_backward_input(x, weight, inv_rms, dy, dx, cols, accumulate != 0, row)
    });
}

/// [`norm::rmsnorm_weight_grad_partials`], `ceil(rows / rows_per_chunk) · cols` threads.
///
/// # Safety
/// As the body, for every index `< count`.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn rmsnorm_weight_grad_partials(
    x: *const f32,
    inv_rms: *const f32,
    dy: *const f32,
    partials: *mut f32,
    rows: usize,
    cols: usize,
    rows_per_chunk: usize,
    count: usize,
) {
    for_index(count, |index| unsafe {
        norm::rmsnorm_weight_grad_partials(
            x,
            inv_rms,
            dy,
            partials,
            rows,
            cols,
            rows_per_chunk,
            index,
        )
    });
}

/// [`norm::column_sums`], one thread per column.
///
/// # Safety
/// As the body, for every column `< cols`.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn column_sums(
    values: *const f32,
    out: *mut f32,
    rows: usize,
    cols: usize,
    accumulate: u32,
) {
    for_index(cols, |col| unsafe {
        norm::column_sums(values, out, rows, cols, accumulate != 0, col)
    });
}

/// [`activation::swiglu_forward`], one thread per element of `[rows, inter]` (`n = rows · inter`).
///
/// # Safety
/// As the body with `chunk_len = 1`.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn swiglu_forward(
    gate_up: *const f32,
    act: *mut f32,
    inter: usize,
    n: usize,
) {
    for_index(n, |e| unsafe {
        activation::swiglu_forward(gate_up, act, inter, n, 1, e)
    });
}

/// [`activation::swiglu_backward`], one thread per element of `[rows, inter]`.
///
/// # Safety
/// As the body with `chunk_len = 1`.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn swiglu_backward(
    gate_up: *const f32,
    dact: *const f32,
    dgate_up: *mut f32,
    inter: usize,
    n: usize,
) {
    for_index(n, |e| unsafe {
        activation::swiglu_backward(gate_up, dact, dgate_up, inter, n, 1, e)
    });
}

/// [`activation::head_residual_forward`], one thread per element.
///
/// # Safety
/// As the body with `chunk_len = 1`.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn head_residual_forward(
    z: *const f32,
    a: *const f32,
    h: *mut f32,
    n: usize,
) {
    for_index(n, |e| unsafe {
        activation::head_residual_forward(z, a, h, n, 1, e)
    });
}

/// [`activation::head_residual_backward`], one thread per element.
///
/// # Safety
/// As the body with `chunk_len = 1`.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn head_residual_backward(
    a: *const f32,
    dh: *const f32,
    da: *mut f32,
    dz: *mut f32,
    n: usize,
) {
    for_index(n, |e| unsafe {
        activation::head_residual_backward(a, dh, da, dz, n, 1, e)
    });
}

/// [`loss::build_labels`], `heads · tokens` threads.
///
/// # Safety
/// As the body, for every index `< count`.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn build_labels(
    input_ids: *const u32,
    loss_mask: *const u8,
    seq_lens: *const u32,
    labels: *mut i32,
    padded_len: usize,
    tokens: usize,
    vocab: usize,
    count: usize,
) {
    for_index(count, |index| unsafe {
        loss::build_labels(
            input_ids, loss_mask, seq_lens, labels, padded_len, tokens, vocab, index,
        )
    });
}

/// [`loss::head_loss_scales`], one thread per head.
///
/// # Safety
/// As the body, for every head `< heads`.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn head_loss_scales(
    labels: *const i32,
    tokens: usize,
    heads: usize,
    head_decay: f32,
    counts: *mut u32,
    scales: *mut f32,
) {
    for_index(heads, |head| unsafe {
        loss::head_loss_scales(labels, tokens, heads, head_decay, counts, scales, head)
    });
}

/// [`loss::vocab_loss_row`], one thread per token row of the chunk.
///
/// # Safety
/// As the body, for every row `< rows`.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn vocab_loss_row(
    logits: *mut f32,
    labels: *const i32,
    scale: *const f32,
    row_loss: *mut f32,
    vocab: usize,
    rows: usize,
) {
    for_index(rows, |row| unsafe {
        loss::vocab_loss_row(logits, labels, scale, row_loss, vocab, row)
    });
}

/// [`reduce::sum_partials`], one thread per chunk (`ceil(n / chunk_len)` threads).
///
/// # Safety
/// As the body, for every chunk `< chunks`.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn sum_partials(
    values: *const f32,
    n: usize,
    chunk_len: usize,
    partials: *mut f32,
    chunks: usize,
) {
    for_index(chunks, |chunk| unsafe {
        reduce::sum_partials(values, n, chunk_len, partials, chunk)
    });
}

/// [`reduce::sum_squares_partials`], one thread per chunk.
///
/// # Safety
/// As the body, for every chunk `< chunks`.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn sum_squares_partials(
    values: *const f32,
    n: usize,
    chunk_len: usize,
    partials: *mut f32,
    chunks: usize,
) {
    for_index(chunks, |chunk| unsafe {
        reduce::sum_squares_partials(values, n, chunk_len, partials, chunk)
    });
}

/// [`reduce::finish_sum`], one thread.
///
/// # Safety
/// As the body.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn finish_sum(partials: *const f32, count: usize, out: *mut f32) {
    for_index(1, |_| unsafe { reduce::finish_sum(partials, count, out) });
}

/// [`reduce::finish_grad_norm`], one thread.
///
/// # Safety
/// As the body.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn finish_grad_norm(
    partials: *const f32,
    count: usize,
    max_norm: f32,
    norm: *mut f32,
    clip_scale: *mut f32,
) {
    for_index(1, |_| unsafe {
        reduce::finish_grad_norm(partials, count, max_norm, norm, clip_scale)
    });
}

/// [`adamw::adamw_update`], one thread per parameter. The per-step scalars are read from device memory
/// (`hyper` points at one [`AdamWStep`]) so that a captured CUDA graph picks up each step's bias corrections
/// from a small host-to-device copy instead of baking them in at capture.
///
/// # Safety
/// As the body with `chunk_len = 1`; `hyper` points at an initialised [`AdamWStep`].
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn adamw_update(
    params: *mut f32,
    grads: *const f32,
    exp_avg: *mut f32,
    exp_avg_sq: *mut f32,
    grad_norm: *const f32,
    clip_scale: *const f32,
    hyper: *const AdamWStep,
    n: usize,
) {
    for_index(n, |e| unsafe {
        adamw::adamw_update(
            params, grads, exp_avg, exp_avg_sq, grad_norm, clip_scale, *hyper, n, 1, e,
        )
    });
}

/// [`adamw::adamw_advance`], one thread.
///
/// # Safety
/// As the body.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "ptx-kernel" fn adamw_advance(
    grad_norm: *const f32,
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    weight_decay: f32,
    state: *mut f64,
    step: *mut AdamWStep,
) {
    for_index(1, |_| unsafe {
        adamw::adamw_advance(grad_norm, lr, beta1, beta2, eps, weight_decay, state, step)
    });
}

/// A device panic (unreachable by the bodies' contracts: they index by pointer arithmetic) traps the kernel, so
/// the host sees a launch error instead of wrong numbers.
#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    // SAFETY: `trap` aborts the kernel; it has no preconditions.
    unsafe { core::arch::nvptx::trap() }
}
