//! The drafter's workspace layout, described once: every device buffer one worker allocates besides the four
//! flat state buffers, with its element type and count.
//!
//! ```text
//!  family spec + buckets + loss + backend + precision ──▶ WorkspaceLayout ──┬─▶ cost model (DeviceMemory.workspaces)
//!                  (Family::workspace)                                      ├─▶ CPU allocator  (runtime::model)
//!                                                                           └─▶ CUDA allocator (runtime::model)
//! ```
//!
//! This module holds what every family's layout shares (the buffer list, element types, the reduction and
//! optimizer constants, the 16-bit hidden-state variant); each family builds its own list in its module
//! ([`WorkspaceLayout::mlp`], [`WorkspaceLayout::dflash`]). The runtime allocates each buffer by its name from
//! this list and nothing else, and a test checks that the bytes it allocates equal [`WorkspaceLayout::bytes`]
//! for the shipped pipelines on both backends, so the memory `compile` reports is the memory `run` takes.
//! Buckets run one at a time on a worker, so one workspace sized for the largest bucket serves them all.

use serde::{Deserialize, Serialize};

use crate::plan::stages::{Device, HsDtype, Precision};

/// Elements per partial sum of the loss total and of the gradient norm (first pass of both reductions).
pub const REDUCE_CHUNK: usize = 1024;
/// Rows per partial sum of an RMSNorm weight gradient (first pass).
pub const NORM_ROWS_PER_CHUNK: usize = 64;
/// Bytes of the workspace given to cuBLAS so it never allocates (stream capture forbids it); NVIDIA recommends
/// 32 MiB on Hopper.
pub const CUBLAS_WORKSPACE_BYTES: usize = 32 << 20;
/// `f32`s of AdamW's per-step scalars (`AdamWStep` in `gpu-kernels`, `repr(C)`).
pub const ADAMW_STEP_FLOATS: usize = 7;
/// `f64`s of AdamW's device state: steps applied, `β1^step`, `β2^step`.
pub const ADAMW_STATE_DOUBLES: usize = 3;
/// `f32`s of a step's results read back by the host: gradient norm, clip scale, loss.
pub const STEP_SCALARS: usize = 3;

/// Where a worker's workspace lives; the CUDA layout adds a second input slot (the next batch lands while the
/// current step runs) and cuBLAS's workspace; the CPU layout adds the rounding buffers of emulated precisions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum BackendKind {
    /// The host.
    Cpu,
    /// A CUDA device.
    Cuda,
}

impl BackendKind {
    /// The backend a worker on `device` runs on.
    pub fn of(device: Device) -> Self {
        match device {
            Device::Cpu => BackendKind::Cpu,
            Device::Gpu(_) => BackendKind::Cuda,
        }
    }
}

/// Rows of hidden states the CPU converts to f32 at a time for a matrix product (`matrixmultiply`'s depth panel,
/// the CPU's GEMM when this was set; the `gemm` crate blocks the depth by 512 or more, so along the depth each
/// tile is one more pass over the output).
pub const HS_TILE_ROWS: usize = 256;

/// [`WorkspaceLayout::hs_operand_elements`]: on CUDA at `bf16` precision, the larger of the `fc` weight
/// (`fc_weight` elements) and its upstream gradient (`upstream` elements); 0 elsewhere.
pub(crate) fn hs_operand_elements(
    backend: BackendKind,
    precision: Precision,
    fc_weight: usize,
    upstream: usize,
) -> usize {
    match (backend, precision) {
        (BackendKind::Cuda, Precision::Bf16) => fc_weight.max(upstream),
        _ => 0,
    }
}

/// Element type of a workspace buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Dtype {
    /// `f32`.
    F32,
    /// `f64`.
    F64,
    /// `i32`.
    I32,
    /// `u32`.
    U32,
    /// `u8`.
    U8,
    /// bfloat16 (hidden states held as they arrive).
    Bf16,
    /// IEEE half (hidden states held as they arrive).
    F16,
}

impl Dtype {
    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            Dtype::F64 => 8,
            Dtype::F32 | Dtype::I32 | Dtype::U32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
            Dtype::U8 => 1,
        }
    }
}

/// One named buffer of the workspace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkspaceBuffer {
    /// The name the runtime allocates it by.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Elements.
    pub elements: usize,
}

impl WorkspaceBuffer {
    /// Bytes of the buffer (`None` on overflow).
    pub fn bytes(&self) -> Option<u64> {
        let bytes = (self.elements as u128).checked_mul(self.dtype.bytes() as u128)?;
        u64::try_from(bytes).ok()
    }
}

/// Every buffer of one worker's workspace, in allocation order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkspaceLayout {
    /// Tokens of the largest bucket (the workspace's row count).
    pub tokens: usize,
    /// Sequences of the largest bucket.
    pub sequences: usize,
    /// Rows of the fused loss's logits chunk.
    pub chunk_rows: usize,
    /// Input slots (batches on the device at once).
    pub input_slots: usize,
    /// Elements of the 16-bit copy a CUDA product needs of its f32 operand when the other holds 16-bit hidden
    /// states (the larger of the `fc` weight and its upstream gradient, `[T, H]`), which
    /// [`WorkspaceLayout::with_hs_dtype`] adds as `gemm_hs_operand`; 0 where the products never read 16-bit
    /// hidden states directly (the CPU converts tiles of them instead; CUDA at f32 or TF32, whose products must
    /// not round the f32 operand to 16 bits).
    pub hs_operand_elements: usize,
    /// The buffers.
    pub buffers: Vec<WorkspaceBuffer>,
}

impl WorkspaceLayout {
    /// The layout for hidden states held in `hs` ([`HsDtype`]). On the CPU the input slots hold them in that
    /// dtype and the first layer's products convert [`HS_TILE_ROWS`] rows at a time into `hs_tile`, so no f32
    /// copy of the batch exists. On CUDA at `bf16` precision the slots hold them in that dtype too (the
    /// host→device copy moves 16-bit values) and the products read them as 16-bit GEMM inputs against a 16-bit
    /// copy of the other operand, `gemm_hs_operand` ([`WorkspaceLayout::hs_operand_elements`]); at f32 or TF32
    /// the CUDA slots stay f32 and the host widens while filling the pinned staging buffer, since cuBLAS has no
    /// product of 16-bit by f32 operands.
    ///
    /// f16 hidden states on CUDA are held in bf16 slots (the host rounds them while staging) and
    /// `gemm_hs_operand` is bf16: cuBLAS multiplies f16 only by f16, and an f16 copy of the `fc` weight
    /// gradient's upstream gradient (1e-8 to 1e-5 at real vocabularies, below f16's normal range from 6.1e-5)
    /// would lose its bits or become zero, where bf16 keeps f32's range. A bf16 product rounds the hidden states
    /// to bf16 anyway, so nothing else changes; the CPU's tiles round at the same points. EAGLE-3's
    /// `last_hs`, which no 16-bit product reads, stays f16. `None` on overflow.
    pub fn with_hs_dtype(mut self, backend: BackendKind, hs: HsDtype) -> Option<Self> {
        let dtype = match hs {
            // FP8 batches are dequantised into f32 slots when they are staged (no product reads FP8).
            HsDtype::F32 | HsDtype::Fp8E4m3 => return Some(self),
            HsDtype::Bf16 => Dtype::Bf16,
            HsDtype::F16 => Dtype::F16,
        };
        if backend == BackendKind::Cuda && self.hs_operand_elements == 0 {
            return Some(self);
        }
        let product_dtype = match backend {
            BackendKind::Cuda => Dtype::Bf16,
            BackendKind::Cpu => dtype,
        };
        let mut din = 0;
        for buffer in &mut self.buffers {
            // `input{slot}.last_hs` (EAGLE-3's teacher input) arrives in the batch's dtype too.
            if buffer.name.starts_with("input") && buffer.name.ends_with(".last_hs") {
                buffer.dtype = dtype;
            } else if buffer.name.starts_with("input") && buffer.name.ends_with(".hs") {
                buffer.dtype = product_dtype;
                din = buffer.elements / self.tokens.max(1);
            }
        }
        let (name, dtype, elements) = match backend {
            BackendKind::Cpu => (
                "hs_tile",
                Dtype::F32,
                HS_TILE_ROWS.min(self.tokens).checked_mul(din)?,
            ),
            BackendKind::Cuda => ("gemm_hs_operand", product_dtype, self.hs_operand_elements),
        };
        self.buffers.push(WorkspaceBuffer {
            name: name.to_owned(),
            dtype,
            elements,
        });
        Some(self)
    }

    /// Elements of the buffer called `name`.
    pub fn elements(&self, name: &str) -> Option<usize> {
        self.buffers
            .iter()
            .find(|b| b.name == name)
            .map(|b| b.elements)
    }

    /// Bytes of every buffer together (`None` on overflow).
    pub fn bytes(&self) -> Option<u64> {
        self.buffers
            .iter()
            .try_fold(0u64, |sum, b| sum.checked_add(b.bytes()?))
    }
}
