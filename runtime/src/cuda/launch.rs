//! Typed launchers for the drafter kernels: one method per entry point of `gpu-kernels/src/ptx.rs`, taking raw
//! device addresses, so the same calls work eagerly and inside stream capture (no per-launch events).

use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};

use super::{CudaError, KernelModule};

/// Threads per block of every one-dimensional launch (one thread per index).
pub const BLOCK_THREADS: u32 = 256;

/// A device address of `f32`/`u32`/`i32`/`u8` elements, as the kernels take it.
pub type DevicePtr = CUdeviceptr;

fn config(count: usize) -> Result<LaunchConfig, CudaError> {
    let blocks = count.div_ceil(BLOCK_THREADS as usize);
    let blocks = u32::try_from(blocks.max(1)).map_err(|_| CudaError::LaunchTooLarge(count))?;
    Ok(LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (BLOCK_THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// The kernels of one [`KernelModule`] bound to a stream.
#[derive(Debug, Clone)]
pub struct Launcher {
    stream: Arc<CudaStream>,
    rmsnorm_forward: CudaFunction,
    rmsnorm_backward_input: CudaFunction,
    rmsnorm_weight_grad_partials: CudaFunction,
    column_sums: CudaFunction,
    swiglu_forward: CudaFunction,
    swiglu_backward: CudaFunction,
    head_residual_forward: CudaFunction,
    head_residual_backward: CudaFunction,
    build_labels: CudaFunction,
    head_loss_scales: CudaFunction,
    vocab_loss_row: CudaFunction,
    sum_partials: CudaFunction,
    sum_squares_partials: CudaFunction,
    finish_sum: CudaFunction,
    finish_grad_norm: CudaFunction,
    adamw_update: CudaFunction,
    adamw_advance: CudaFunction,
}

/// Pushes every argument, then launches on `count` indices.
macro_rules! launch {
    ($self:ident, $func:ident, $count:expr, [$($arg:expr),* $(,)?]) => {{
        let cfg = config($count)?;
        let mut builder = $self.stream.launch_builder(&$self.$func);
        $(builder.arg(&$arg);)*
        // SAFETY: the argument list matches the entry point's signature in gpu-kernels/src/ptx.rs; the
        // addresses and sizes are the caller's contract (see each method).
        unsafe { builder.launch(cfg) }?;
        Ok(())
    }};
}

impl Launcher {
    /// Resolves every kernel of `module` and binds them to `stream`.
    pub fn new(module: &KernelModule, stream: Arc<CudaStream>) -> Result<Self, CudaError> {
        Ok(Self {
            stream,
            rmsnorm_forward: module.function("rmsnorm_forward")?.clone(),
            rmsnorm_backward_input: module.function("rmsnorm_backward_input")?.clone(),
            rmsnorm_weight_grad_partials: module.function("rmsnorm_weight_grad_partials")?.clone(),
            column_sums: module.function("column_sums")?.clone(),
            swiglu_forward: module.function("swiglu_forward")?.clone(),
            swiglu_backward: module.function("swiglu_backward")?.clone(),
            head_residual_forward: module.function("head_residual_forward")?.clone(),
            head_residual_backward: module.function("head_residual_backward")?.clone(),
            build_labels: module.function("build_labels")?.clone(),
            head_loss_scales: module.function("head_loss_scales")?.clone(),
            vocab_loss_row: module.function("vocab_loss_row")?.clone(),
            sum_partials: module.function("sum_partials")?.clone(),
            sum_squares_partials: module.function("sum_squares_partials")?.clone(),
            finish_sum: module.function("finish_sum")?.clone(),
            finish_grad_norm: module.function("finish_grad_norm")?.clone(),
            adamw_update: module.function("adamw_update")?.clone(),
            adamw_advance: module.function("adamw_advance")?.clone(),
        })
    }

    /// The stream every launch goes to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// `y = rmsnorm(x) ⊙ w` and `inv_rms` per row of a `[rows, cols]` matrix.
    pub fn rmsnorm_forward(
        &self,
        (x, weight, y, inv_rms): (DevicePtr, DevicePtr, DevicePtr, DevicePtr),
        rows: usize,
        cols: usize,
        eps: f32,
    ) -> Result<(), CudaError> {
        launch!(
            self,
            rmsnorm_forward,
            rows,
            [x, weight, y, inv_rms, cols, eps, rows]
        )
    }

    /// Input gradient of RMSNorm (`dx = …`, or `dx += …` when `accumulate`).
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_backward_input(
        &self,
        (x, weight, inv_rms, dy, dx): (DevicePtr, DevicePtr, DevicePtr, DevicePtr, DevicePtr),
        rows: usize,
        cols: usize,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        let accumulate = u32::from(accumulate);
        launch!(
            self,
            rmsnorm_backward_input,
            rows,
            [x, weight, inv_rms, dy, dx, cols, accumulate, rows]
        )
    }

    /// First pass of the RMSNorm weight gradient: `ceil(rows / rows_per_chunk) · cols` partials.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_weight_grad_partials(
        &self,
        (x, inv_rms, dy, partials): (DevicePtr, DevicePtr, DevicePtr, DevicePtr),
        rows: usize,
        cols: usize,
        rows_per_chunk: usize,
    ) -> Result<(), CudaError> {
        let count = rows.div_ceil(rows_per_chunk) * cols;
        launch!(
            self,
            rmsnorm_weight_grad_partials,
            count,
            [x, inv_rms, dy, partials, rows, cols, rows_per_chunk, count]
        )
    }

    /// Column sums of a `[rows, cols]` matrix into `out` (added when `accumulate`).
    pub fn column_sums(
        &self,
        values: DevicePtr,
        out: DevicePtr,
        rows: usize,
        cols: usize,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        let accumulate = u32::from(accumulate);
        launch!(
            self,
            column_sums,
            cols,
            [values, out, rows, cols, accumulate]
        )
    }

    /// `act = silu(gate) ⊙ up` from rows `[gate | up]` of `gate_up` (`rows · inter` outputs).
    pub fn swiglu_forward(
        &self,
        gate_up: DevicePtr,
        act: DevicePtr,
        rows: usize,
        inter: usize,
    ) -> Result<(), CudaError> {
        let n = rows * inter;
        launch!(self, swiglu_forward, n, [gate_up, act, inter, n])
    }

    /// Gradients of both SwiGLU inputs into `dgate_up` (`[rows, 2·inter]`).
    pub fn swiglu_backward(
        &self,
        (gate_up, dact, dgate_up): (DevicePtr, DevicePtr, DevicePtr),
        rows: usize,
        inter: usize,
    ) -> Result<(), CudaError> {
        let n = rows * inter;
        launch!(
            self,
            swiglu_backward,
            n,
            [gate_up, dact, dgate_up, inter, n]
        )
    }

    /// `h = z + silu(a)` over `n` elements.
    pub fn head_residual_forward(
        &self,
        z: DevicePtr,
        a: DevicePtr,
        h: DevicePtr,
        n: usize,
    ) -> Result<(), CudaError> {
        launch!(self, head_residual_forward, n, [z, a, h, n])
    }

    /// `da = dh · silu'(a)` (may be in place over `dh`) and `dz += dh`, over `n` elements.
    pub fn head_residual_backward(
        &self,
        (a, dh, da, dz): (DevicePtr, DevicePtr, DevicePtr, DevicePtr),
        n: usize,
    ) -> Result<(), CudaError> {
        launch!(self, head_residual_backward, n, [a, dh, da, dz, n])
    }

    /// Labels `[heads, tokens]` from the batch's ids, mask and sequence lengths.
    #[allow(clippy::too_many_arguments)]
    pub fn build_labels(
        &self,
        (input_ids, loss_mask, seq_lens, labels): (DevicePtr, DevicePtr, DevicePtr, DevicePtr),
        padded_len: usize,
        tokens: usize,
        heads: usize,
        vocab: usize,
    ) -> Result<(), CudaError> {
        let count = heads * tokens;
        launch!(
            self,
            build_labels,
            count,
            [
                input_ids, loss_mask, seq_lens, labels, padded_len, tokens, vocab, count
            ]
        )
    }

    /// Valid-label counts and loss scales per head.
    pub fn head_loss_scales(
        &self,
        (labels, counts, scales): (DevicePtr, DevicePtr, DevicePtr),
        tokens: usize,
        heads: usize,
        head_decay: f32,
    ) -> Result<(), CudaError> {
        launch!(
            self,
            head_loss_scales,
            heads,
            [labels, tokens, heads, head_decay, counts, scales]
        )
    }

    /// Fused cross-entropy over `rows` logits rows of width `vocab`, gradient written in place.
    pub fn vocab_loss_row(
        &self,
        (logits, labels, scale, row_loss): (DevicePtr, DevicePtr, DevicePtr, DevicePtr),
        rows: usize,
        vocab: usize,
    ) -> Result<(), CudaError> {
        launch!(
            self,
            vocab_loss_row,
            rows,
            [logits, labels, scale, row_loss, vocab, rows]
        )
    }

    /// Partial sums of `n` values in chunks of `chunk_len` (`ceil(n / chunk_len)` partials).
    pub fn sum_partials(
        &self,
        values: DevicePtr,
        partials: DevicePtr,
        n: usize,
        chunk_len: usize,
    ) -> Result<(), CudaError> {
        let chunks = n.div_ceil(chunk_len);
        launch!(
            self,
            sum_partials,
            chunks,
            [values, n, chunk_len, partials, chunks]
        )
    }

    /// Partial sums of squares of `n` values in chunks of `chunk_len`.
    pub fn sum_squares_partials(
        &self,
        values: DevicePtr,
        partials: DevicePtr,
        n: usize,
        chunk_len: usize,
    ) -> Result<(), CudaError> {
        let chunks = n.div_ceil(chunk_len);
        launch!(
            self,
            sum_squares_partials,
            chunks,
            [values, n, chunk_len, partials, chunks]
        )
    }

    /// `out[0] = Σ partials[..count]`, in order.
    pub fn finish_sum(
        &self,
        partials: DevicePtr,
        count: usize,
        out: DevicePtr,
    ) -> Result<(), CudaError> {
        launch!(self, finish_sum, 1, [partials, count, out])
    }

    /// Gradient norm and clip scale from the squared partials (`max_norm ≤ 0`: no clipping).
    pub fn finish_grad_norm(
        &self,
        (partials, norm, clip_scale): (DevicePtr, DevicePtr, DevicePtr),
        count: usize,
        max_norm: f32,
    ) -> Result<(), CudaError> {
        launch!(
            self,
            finish_grad_norm,
            1,
            [partials, count, max_norm, norm, clip_scale]
        )
    }

    /// One fused AdamW update of `n` parameters; `hyper` holds the step's `AdamWStep` on the device.
    pub fn adamw_update(
        &self,
        (params, grads, exp_avg, exp_avg_sq): (DevicePtr, DevicePtr, DevicePtr, DevicePtr),
        (grad_norm, clip_scale, hyper): (DevicePtr, DevicePtr, DevicePtr),
        n: usize,
    ) -> Result<(), CudaError> {
        launch!(
            self,
            adamw_update,
            n,
            [
                params, grads, exp_avg, exp_avg_sq, grad_norm, clip_scale, hyper, n
            ]
        )
    }

    /// Advances AdamW's device state (`[steps, β1^steps, β2^steps]`, f64) and writes the step's `AdamWStep`
    /// when the gradient norm is finite; `hyper` is `[lr, β1, β2, eps, weight_decay]`.
    pub fn adamw_advance(
        &self,
        (grad_norm, state, step): (DevicePtr, DevicePtr, DevicePtr),
        hyper: [f32; 5],
    ) -> Result<(), CudaError> {
        let [lr, beta1, beta2, eps, weight_decay] = hyper;
        launch!(
            self,
            adamw_advance,
            1,
            [grad_norm, lr, beta1, beta2, eps, weight_decay, state, step]
        )
    }
}
