//! Device memory of one drafter, allocated once: the four flat buffers, the activations and loss workspace
//! (sized for the largest bucket, reused by every bucket since steps run one after another on one stream), and
//! two input slots so the next batch can land while the current step runs.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr as _, DeviceRepr, ValidAsZeroBits};
use draftpipe_compiler::plan::MlpSpec;

use super::CudaError;
use cudarc::driver::sys::CUdeviceptr as DevicePtr;

/// Rows per partial sum of the RMSNorm weight gradient (first pass).
pub const NORM_ROWS_PER_CHUNK: usize = 64;
/// Elements per partial sum of the loss total and the gradient norm (first pass).
pub const REDUCE_CHUNK: usize = 1024;
/// `AdamWStep` is seven `f32`s (`gpu-kernels/src/adamw.rs`, `repr(C)`).
pub const ADAMW_STEP_FLOATS: usize = 7;

/// A device allocation and its address (taken once: event tracking is off, so the address is all we need).
#[derive(Debug)]
pub struct Buffer<T> {
    slice: CudaSlice<T>,
    ptr: DevicePtr,
}

impl<T: DeviceRepr + ValidAsZeroBits> Buffer<T> {
    pub(crate) fn zeros(stream: &Arc<CudaStream>, len: usize) -> Result<Self, CudaError> {
        let slice = stream.alloc_zeros::<T>(len.max(1))?;
        let (ptr, _) = slice.device_ptr(stream);
        Ok(Self { slice, ptr })
    }

    /// The address of element `index`.
    pub fn at(&self, index: usize) -> DevicePtr {
        self.ptr + (index * std::mem::size_of::<T>()) as DevicePtr
    }

    /// The base address.
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// Elements allocated.
    pub fn len(&self) -> usize {
        self.slice.len()
    }
}

/// Parameters, gradients, AdamW moments and the optimizer's scalars.
#[derive(Debug)]
pub struct FlatBuffers {
    /// Parameters in the model's flat layout.
    pub params: Buffer<f32>,
    /// Gradients, same layout.
    pub grads: Buffer<f32>,
    /// AdamW first moments.
    pub exp_avg: Buffer<f32>,
    /// AdamW second moments.
    pub exp_avg_sq: Buffer<f32>,
    /// This step's `AdamWStep`, written by a host-to-device copy before each step.
    pub hyper: Buffer<f32>,
    /// Squared-gradient partial sums.
    pub norm_partials: Buffer<f32>,
    /// `[grad_norm, clip_scale, loss]`: the last step's scalars, read back one step later.
    pub scalars: Buffer<f32>,
}

impl FlatBuffers {
    /// Zeroed buffers for `parameters` elements.
    pub fn new(stream: &Arc<CudaStream>, parameters: usize) -> Result<Self, CudaError> {
        Ok(Self {
            params: Buffer::zeros(stream, parameters)?,
            grads: Buffer::zeros(stream, parameters)?,
            exp_avg: Buffer::zeros(stream, parameters)?,
            exp_avg_sq: Buffer::zeros(stream, parameters)?,
            hyper: Buffer::zeros(stream, ADAMW_STEP_FLOATS)?,
            norm_partials: Buffer::zeros(stream, parameters.div_ceil(REDUCE_CHUNK))?,
            scalars: Buffer::zeros(stream, 3)?,
        })
    }
}

/// One batch on the device: what `HsBatch` carries, at the bucket's static shape.
#[derive(Debug)]
pub struct InputSlot {
    /// Hidden states `[tokens, din]`.
    pub hs: Buffer<f32>,
    /// Token ids `[tokens]`.
    pub input_ids: Buffer<u32>,
    /// Real length per sequence.
    pub seq_lens: Buffer<u32>,
    /// Label mask `[tokens]`.
    pub loss_mask: Buffer<u8>,
}

impl InputSlot {
    /// A slot for up to `tokens` tokens of `sequences` sequences.
    pub fn new(
        stream: &Arc<CudaStream>,
        tokens: usize,
        sequences: usize,
        din: usize,
    ) -> Result<Self, CudaError> {
        Ok(Self {
            hs: Buffer::zeros(stream, tokens * din)?,
            input_ids: Buffer::zeros(stream, tokens)?,
            seq_lens: Buffer::zeros(stream, sequences)?,
            loss_mask: Buffer::zeros(stream, tokens)?,
        })
    }
}

/// Activations kept for the backward pass and the scratch of the loss and the gradients.
#[derive(Debug)]
pub struct Activations {
    /// Residual stream before each block and after the last: `(blocks + 1) × [tokens, hidden]`.
    pub xs: Buffer<f32>,
    /// Normed block inputs: `blocks × [tokens, hidden]`.
    pub us: Buffer<f32>,
    /// `1 / rms` per row of each norm: `(blocks + 1) × [tokens]` (the last is the final norm).
    pub inv_rms: Buffer<f32>,
    /// Gate and up projections: `blocks × [tokens, 2·intermediate]`.
    pub gate_up: Buffer<f32>,
    /// SwiGLU outputs: `blocks × [tokens, intermediate]`.
    pub act: Buffer<f32>,
    /// Final norm output `[tokens, hidden]`.
    pub z: Buffer<f32>,
    /// Current head's pre-activation `[tokens, hidden]`.
    pub head_a: Buffer<f32>,
    /// Current head's output `[tokens, hidden]`.
    pub head_h: Buffer<f32>,
    /// Current head's output gradient, then (in place) its pre-activation gradient.
    pub head_dh: Buffer<f32>,
    /// One chunk of logits `[chunk_tokens, vocab]`, overwritten by their gradient.
    pub logits: Buffer<f32>,
    /// Labels `[heads, tokens]`.
    pub labels: Buffer<i32>,
    /// Valid labels per head.
    pub counts: Buffer<u32>,
    /// Loss scale per head.
    pub scales: Buffer<f32>,
    /// Scaled per-row losses `[heads, tokens]`.
    pub row_loss: Buffer<f32>,
    /// Partial sums of the loss.
    pub loss_partials: Buffer<f32>,
    /// Gradient of the final norm's output.
    pub dz: Buffer<f32>,
    /// Gradient of the residual stream.
    pub dx: Buffer<f32>,
    /// Gradient of a block's normed input.
    pub du: Buffer<f32>,
    /// Gradient of a block's SwiGLU output.
    pub dact: Buffer<f32>,
    /// Gradient of a block's gate and up projections.
    pub dgate_up: Buffer<f32>,
    /// Partial sums of an RMSNorm weight gradient.
    pub norm_partials: Buffer<f32>,
}

impl Activations {
    /// Buffers for steps of up to `tokens` tokens.
    pub fn new(
        stream: &Arc<CudaStream>,
        spec: &MlpSpec,
        tokens: usize,
        chunk_tokens: usize,
    ) -> Result<Self, CudaError> {
        let (t, h, i, b, j) = (
            tokens,
            spec.hidden,
            spec.intermediate,
            spec.blocks,
            spec.heads,
        );
        let f = |len: usize| Buffer::<f32>::zeros(stream, len);
        Ok(Self {
            xs: f((b + 1) * t * h)?,
            us: f(b * t * h)?,
            inv_rms: f((b + 1) * t)?,
            gate_up: f(b * t * 2 * i)?,
            act: f(b * t * i)?,
            z: f(t * h)?,
            head_a: f(t * h)?,
            head_h: f(t * h)?,
            head_dh: f(t * h)?,
            logits: f(chunk_tokens.clamp(1, t.max(1)) * spec.vocab)?,
            labels: Buffer::zeros(stream, j * t)?,
            counts: Buffer::zeros(stream, j)?,
            scales: f(j)?,
            row_loss: f(j * t)?,
            loss_partials: f((j * t).div_ceil(REDUCE_CHUNK))?,
            dz: f(t * h)?,
            dx: f(t * h)?,
            du: f(t * h)?,
            dact: f(t * i)?,
            dgate_up: f(t * 2 * i)?,
            norm_partials: f(t.div_ceil(NORM_ROWS_PER_CHUNK) * h)?,
        })
    }
}
