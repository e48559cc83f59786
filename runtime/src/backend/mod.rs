//! The backend trait: what a model step needs from a device, so that every model is written once
//! (`crate::model`) and runs on the CPU and on CUDA alike.
//!
//! ```text
//!  model::mlp, dflash, eagle3 ──calls──▶ Backend's operations ──▶ Backend::launch(Kernel) ──▶ CpuBackend  (host
//!  (forward, loss, backward,             (provided here and in       (one generated match      launchers; runs at
//!   update)                               `eagle3.rs`, once)          per backend)              once)
//!                                                                                         └──▶ CudaBackend (PTX
//!                                                                                              on the compute
//!                                                                                              stream; enqueue only)
//! ```
//!
//! A backend owns device buffers ([`Buf`]); the model borrows views of them ([`Src`] to read, [`Dst`] to write),
//! so Rust's borrow rules forbid on every backend the aliasing a kernel does not support. A kernel of the table
//! is reached through one entry point, [`Backend::launch`] of a [`Kernel`]: the operations the model calls
//! (`rmsnorm_forward`, the two-pass `sum`, the losses, …) are provided by the trait over it, so a backend writes
//! no method per kernel. Every operation on the step path (matrix products, kernel launches, `fill`, `copy`, the
//! gradient average) only enqueues on CUDA, so one step's calls can be captured as a graph
//! ([`Backend::run_part`]); on the CPU each runs at once. Scalars a step produces (loss, gradient norm, AdamW's
//! step count) stay in device buffers: nothing on the step path reads back.

pub mod attention;
pub mod cpu;
pub mod cuda;
pub mod eagle3;
pub mod flash;
pub mod head;
mod kernel;
mod operations;
mod views;

use draftpipe_compiler::plan::BackendKind;
pub use draftpipe_compiler::plan::Precision;
use draftpipe_compiler::workspace::{NORM_ROWS_PER_CHUNK, REDUCE_CHUNK};
use draftpipe_gpu_kernels::adamw::AdamWStep;
use draftpipe_gpu_kernels::reduce::partial_chunk_len;

use attention::AttentionSizes;
pub use attention::{AttentionGrads, AttentionInputs, AttentionSaved, AttentionShape};
pub use draftpipe_gpu_kernels::adamw::{
    SCHEDULE_CONSTANT, SCHEDULE_COSINE, SCHEDULE_LINEAR, Schedule,
};
pub use kernel::{FlashKernel, Kernel, Reinterpret};
pub use views::{
    Buf, Dst, Element, HsBuf, HsOperand, HsSrc, Matrix, MatrixData, Operand, Src, gemm_shape,
};

use crate::batch::{HsBatch, HsData, HsSlice};

/// The floats of an [`AdamWStep`] as a step buffer holds them.
const ADAMW_STEP_FLOATS: usize = size_of::<AdamWStep>() / size_of::<f32>();

/// Why a backend operation failed (the CPU backend never fails; its shape checks panic, since the model sizes
/// every buffer from one layout and a mismatch is a bug).
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The device failed: the implementation's own error (the CUDA backend's `CudaError`: no driver, a launch,
    /// cuBLAS, …), converted by that implementation, so this trait's error names none of them. A caller that
    /// knows which backend it drives reads the error back with [`BackendError::device_error`].
    #[error(transparent)]
    Device(Box<dyn std::error::Error + Send + Sync + 'static>),
    /// The backend has no path for this operation's operand types (e.g. a CUDA product of bf16 hidden states at
    /// f32 precision, whose layout holds them in f32).
    #[error("not supported by this backend: {0}")]
    Unsupported(String),
}

impl BackendError {
    /// The device error of a backend implementation, typed as that implementation's error when it is one
    /// (`err.device_error::<CudaError>()`), `None` for another kind or another implementation's.
    pub fn device_error<E: std::error::Error + 'static>(&self) -> Option<&E> {
        match self {
            BackendError::Device(source) => source.downcast_ref(),
            BackendError::Unsupported(_) => None,
        }
    }
}

/// The error of staging a batch without `last_hidden_states` into a slot whose family reads them (the drafter's
/// batch checks refuse such a batch first; this keeps a slot from training on the previous batch's teacher).
pub(crate) fn missing_last_hidden_states() -> BackendError {
    BackendError::Unsupported(
        "a batch without last_hidden_states into an input slot that reads them (eagle3's teacher)"
            .to_owned(),
    )
}

/// Result of a backend operation.
pub type BackendResult<T = ()> = Result<T, BackendError>;

/// AdamW's constant hyper-parameters, as the device's step-advance kernel takes them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWHyper {
    /// Learning rate.
    pub lr: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Denominator epsilon.
    pub eps: f32,
    /// Decoupled weight decay.
    pub weight_decay: f32,
    /// Schedule kind: [`SCHEDULE_CONSTANT`], [`SCHEDULE_LINEAR`] or [`SCHEDULE_COSINE`] (Hugging Face's
    /// `get_*_schedule_with_warmup`; the factor applies to the step after `s` applied steps).
    pub schedule_kind: u32,
    /// Warmup steps.
    pub warmup: f32,
    /// Total steps of the schedule (the drafter's `steps`).
    pub total: f32,
}

impl AdamWHyper {
    /// The schedule part, as the kernel takes it.
    pub fn schedule(&self) -> Schedule {
        Schedule {
            kind: self.schedule_kind,
            warmup: self.warmup,
            total: self.total,
        }
    }

    /// The constant part, as the kernel takes it.
    pub fn constants(&self) -> draftpipe_gpu_kernels::adamw::AdamWConstants {
        draftpipe_gpu_kernels::adamw::AdamWConstants {
            lr: self.lr,
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            weight_decay: self.weight_decay,
        }
    }
}

/// A part of a step that a graph-capable backend may capture once and replay: the same key must always
/// enqueue the same operations on the same buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StepPart {
    /// Forward, fused loss and backward of one bucket reading one input slot.
    ForwardBackward {
        /// Bucket index.
        bucket: usize,
        /// Input slot.
        slot: usize,
    },
    /// Gradient norm, clipping and AdamW (shape-independent).
    Update,
}

/// The host-side view of a finished step: what [`Backend::read_results`] returns.
#[derive(Debug, Clone, PartialEq)]
pub struct StepResults {
    /// `[grad_norm, clip_scale, loss]`.
    pub scalars: [f32; 3],
    /// The model's further read-back values after those three (`dflash`: correct rows per block slot; empty
    /// for `mlp`).
    pub extra: Vec<f32>,
    /// Device time of the step, when the backend measures it (CUDA events); `None` on the CPU.
    pub device_ms: Option<f32>,
}

/// A batch's host buffers, as [`Backend::stage`] copies them.
#[derive(Clone, Copy)]
pub struct HostBatch<'a> {
    /// Hidden states, in the batch's precision.
    pub hs: HsSlice<'a>,
    /// The target's final-norm output `[tokens, hidden]` in the precision of `hs`, when the batch has it.
    pub last_hidden_states: Option<HsSlice<'a>>,
    /// Token ids.
    pub input_ids: &'a [u32],
    /// Sequence lengths.
    pub seq_lens: &'a [u32],
    /// Label mask.
    pub loss_mask: &'a [u8],
}

impl<'a> From<&'a HsBatch> for HostBatch<'a> {
    fn from(batch: &'a HsBatch) -> Self {
        Self {
            hs: batch.hs.as_slice(),
            last_hidden_states: batch.last_hidden_states.as_ref().map(HsData::as_slice),
            input_ids: &batch.input_ids,
            seq_lens: &batch.seq_lens,
            loss_mask: &batch.loss_mask,
        }
    }
}

/// One batch's buffers on the device.
pub struct InputSlot<B: Backend> {
    /// Hidden states `[tokens, din]`, in the layout's precision for them.
    pub hs: HsBuf<B>,
    /// The target's final-norm output `[tokens, hidden]` (`input{slot}.last_hs`), in the precision of `hs`;
    /// `None` when the layout has none (the family does not read it).
    pub last_hidden_states: Option<HsBuf<B>>,
    /// Token ids `[tokens]`.
    pub input_ids: Buf<B, u32>,
    /// Sequence lengths `[sequences]`.
    pub seq_lens: Buf<B, u32>,
    /// Label mask `[tokens]`.
    pub loss_mask: Buf<B, u8>,
}

/// The operations a model step is written with. See the module docs for the execution model.
///
/// What a backend implements is what differs between devices: memory, staging, the step's framing, `fill` and
/// `copy`, the products, the gradient average, and [`Backend::launch`], one generated match over [`Kernel`].
/// Every other operation is provided here once, over `launch`: it derives the kernel's sizes from the views,
/// checks them (a mismatch is a bug in the model: it panics, on every backend alike) and launches the table's
/// kernels. A backend with its own body for an operation overrides it; which do is declared beside the kernel
/// table (`draftpipe_gpu_kernels::table::HOST_BODIES`).
pub trait Backend: Sized + Send + 'static {
    /// A raw allocation of `T`s.
    type Raw<T: Element>: Send;

    /// A kernel's read argument (CPU: a slice; CUDA: a typed device pointer).
    type Read<'a, T: 'a>: Copy;

    /// A kernel's write argument (CPU: a mutable slice; CUDA: a typed device pointer).
    type Write<'a, T: 'a>;

    /// Which backend this is (the workspace layout differs per backend).
    fn kind(&self) -> BackendKind;

    /// Whether a step's results are known only later ([`Backend::read_results`] of the previous step while the
    /// current one runs), as on CUDA; on the CPU they are ready when the step call returns.
    fn asynchronous(&self) -> bool;

    /// A zeroed buffer of `len` elements (not on the step path).
    fn alloc<T: Element>(&mut self, len: usize) -> BackendResult<Buf<Self, T>>;

    /// Bytes allocated through [`Backend::alloc`] and by the backend itself, as the workspace layout counts
    /// them (requested sizes).
    fn allocated_bytes(&self) -> u64;

    /// Copies host data into a buffer and waits for it (not on the step path).
    fn upload<T: Element>(&mut self, dst: Dst<'_, Self, T>, src: &[T]) -> BackendResult;

    /// Copies a buffer to the host after the work queued so far (not on the step path).
    fn download<T: Element>(&mut self, src: Src<'_, Self, T>, dst: &mut [T]) -> BackendResult;

    /// Copies `batch` into input slot `slot` (on CUDA through pinned memory on the copy stream, ordered before
    /// the next step that reads the slot). The caller has checked the batch against the slot's shape.
    fn stage(
        &mut self,
        slot: usize,
        batch: HostBatch<'_>,
        input: &mut InputSlot<Self>,
    ) -> BackendResult;

    /// Copies `src` into `dst`, a buffer the next step reading input slot `slot` needs beside the batch (what a
    /// family builds on the host per batch: `dflash`'s block plan), after [`Backend::stage`] of that slot and
    /// ordered like the batch: on CUDA through the slot's pinned plan staging on the copy stream, before the next
    /// step that reads the slot, never waiting nor allocating. The default copies at once ([`Backend::upload`]),
    /// right for a synchronous backend.
    fn stage_upload<T: Element>(
        &mut self,
        slot: usize,
        dst: Dst<'_, Self, T>,
        src: &[T],
    ) -> BackendResult {
        let _ = slot;
        self.upload(dst, src)
    }

    /// Marks the start of the step reading `slot` (CUDA: the compute stream waits for the slot's copy and
    /// records the step's start event in `ring`).
    fn begin_step(&mut self, slot: usize, ring: usize) -> BackendResult;

    /// Runs `body` as step part `part`: at once on the CPU; on CUDA eagerly, or captured into a graph the
    /// first time `part` is seen and replayed after, when the backend launches graphs.
    fn run_part(
        &mut self,
        part: StepPart,
        body: &mut dyn FnMut(&mut Self) -> BackendResult,
    ) -> BackendResult;

    /// Marks the end of the step reading `slot` and queues the read-back of its `scalars` into `ring` (the
    /// layout's whole `step_scalars` buffer).
    fn end_step(&mut self, slot: usize, ring: usize, scalars: Src<'_, Self, f32>) -> BackendResult;

    /// Waits for the step in `ring` and returns its scalars.
    fn read_results(&mut self, ring: usize) -> BackendResult<StepResults>;

    /// `dst ← value`.
    fn fill(&mut self, dst: Dst<'_, Self, f32>, value: f32) -> BackendResult;

    /// `dst ← src` (same length).
    fn copy(&mut self, dst: Dst<'_, Self, f32>, src: Src<'_, Self, f32>) -> BackendResult;

    /// `c ← alpha · a · b + beta · c`, with the operands rounded to `precision` and f32 accumulation. With
    /// `beta = 0`, `c` is not read.
    fn gemm(
        &mut self,
        c: Dst<'_, Self, f32>,
        a: Operand<'_, Self>,
        b: Operand<'_, Self>,
        alpha: f32,
        beta: f32,
        precision: Precision,
    ) -> BackendResult;

    /// [`Backend::gemm`] where an operand may hold hidden states in their own precision (at most one of `a` and
    /// `b` is not f32): the first layer's products read a bf16 batch without an f32 copy of it (the CPU widens
    /// a tile of rows at a time into the layout's `hs_tile`; CUDA multiplies it as a 16-bit GEMM input against a
    /// 16-bit copy of the other operand in the layout's `gemm_hs_operand`, at `bf16` precision only). On CUDA at
    /// `bf16` both may be bf16 copies an f32 operand's writer kept beside it ([`HsOperand::with_copy`]): the
    /// product then reads only 16-bit operands from memory.
    #[allow(clippy::too_many_arguments)]
    fn gemm_hs(
        &mut self,
        c: Dst<'_, Self, f32>,
        a: HsOperand<'_, Self>,
        b: HsOperand<'_, Self>,
        alpha: f32,
        beta: f32,
        precision: Precision,
    ) -> BackendResult;

    /// Averages `grads` over the data-parallel replicas, when the backend has a group (CPU: the host
    /// all-reduce; CUDA: NCCL, enqueued between the captured parts, never inside a graph).
    fn average_gradients(&mut self, grads: Dst<'_, Self, f32>) -> BackendResult;

    /// Launches one kernel of the table: on the CPU at once (its host launcher), on CUDA enqueued on the compute
    /// stream. The table's launchers check every argument against the length the table declares.
    fn launch(&mut self, kernel: Kernel<'_, Self>) -> BackendResult;

    /// Launches one kernel of the flash-attention table (`flash_kernel_table!`): on CUDA a grid of thread
    /// blocks of warps on the compute stream, on the CPU each block through the warp model (no CPU step takes
    /// this path; see `backend/flash.rs`). Lengths are checked against the table as for [`Backend::launch`].
    fn launch_flash(&mut self, kernel: FlashKernel<'_, Self>) -> BackendResult;

    /// A read view as a kernel argument.
    fn read<'a, T: Element>(view: Src<'a, Self, T>) -> Self::Read<'a, T>;

    /// A write view as a kernel argument.
    fn write<'a, T: Element>(view: Dst<'a, Self, T>) -> Self::Write<'a, T>;

    /// A write argument split into its first `mid` elements and the rest (two outputs of one kernel in one
    /// small buffer, such as `[norm, clip]`).
    ///
    /// # Panics
    /// When `mid` is past the argument's end.
    fn split_write<'a, T: 'a>(
        view: Self::Write<'a, T>,
        mid: usize,
    ) -> (Self::Write<'a, T>, Self::Write<'a, T>);

    /// A read argument's elements as the kernel's element type `U` (see [`Reinterpret`]).
    fn reinterpret_read<'a, T: Reinterpret<U> + 'a, U: 'a>(
        view: Self::Read<'a, T>,
    ) -> Self::Read<'a, U>;

    /// A write argument's elements as the kernel's element type `U` (see [`Reinterpret`]).
    fn reinterpret_write<'a, T: Reinterpret<U> + 'a, U: 'a>(
        view: Self::Write<'a, T>,
    ) -> Self::Write<'a, U>;

    // The operations over the table's kernels every family shares (`backend::operations`).
    crate::backend::operations::kernel_operations!();

    // EAGLE-3's operations (`backend::eagle3`).
    crate::backend::eagle3::eagle3_operations!();

    // DFlash attention on the flash kernels (`backend::flash`).
    crate::backend::flash::flash_operations!();

    // The frozen head over the labelled rows only (`backend::head`).
    crate::backend::head::head_operations!();
}
