//! The backend trait: what a model step needs from a device, so that every model is written once
//! (`crate::model`) and runs on the CPU and on CUDA alike.
//!
//! ```text
//!  model::mlp (forward, loss, backward, update) ──calls──▶ Backend ──▶ CpuBackend  (slices, matrixmultiply,
//!                                                            │                     host launchers; runs at once)
//!                                                            └──────▶ CudaBackend (cudarc on the compute
//!                                                                                  stream; enqueue only)
//! ```
//!
//! A backend owns device buffers ([`Buf`]); the model borrows views of them ([`Src`] to read, [`Dst`] to write),
//! so Rust's borrow rules forbid on every backend the aliasing a kernel does not support. Every operation on
//! the step path (matrix products, one method per kernel, `fill`, `copy`, the gradient average) only enqueues on
//! CUDA, so one step's calls can be captured as a graph ([`Backend::run_part`]); on the CPU each runs at once.
//! Scalars a step produces (loss, gradient norm, AdamW's step count) stay in device buffers: nothing on the step
//! path reads back.

pub mod attention;
pub mod cpu;
pub mod cuda;
pub mod eagle3;

use std::marker::PhantomData;

use draftpipe_compiler::plan::BackendKind;
pub use draftpipe_compiler::plan::Precision;

pub use attention::{AttentionGrads, AttentionInputs, AttentionSaved, AttentionShape};
pub use draftpipe_gpu_kernels::adamw::{
    SCHEDULE_CONSTANT, SCHEDULE_COSINE, SCHEDULE_LINEAR, Schedule,
};

use crate::batch::{HsBatch, HsData, HsDtype, HsSlice};
use cuda::error::CudaError;

/// What a device buffer can hold.
pub trait Element:
    Copy
    + Default
    + Send
    + Sync
    + 'static
    + cudarc::driver::DeviceRepr
    + cudarc::driver::ValidAsZeroBits
{
}
impl Element for f32 {}
impl Element for f64 {}
impl Element for i32 {}
impl Element for u32 {}
impl Element for u8 {}
impl Element for half::bf16 {}
impl Element for half::f16 {}

/// Why a backend operation failed (the CPU backend never fails; its shape checks panic, since the model sizes
/// every buffer from one layout and a mismatch is a bug).
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The CUDA backend failed.
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// The backend has no path for this operation's operand types (e.g. a CUDA product of bf16 hidden states at
    /// f32 precision, whose layout holds them in f32).
    #[error("not supported by this backend: {0}")]
    Unsupported(String),
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

/// A buffer of `len` elements on backend `B`.
pub struct Buf<B: Backend, T: Element> {
    raw: B::Raw<T>,
    len: usize,
}

impl<B: Backend, T: Element> Buf<B, T> {
    /// Wraps a backend's raw allocation of `len` elements.
    pub(crate) fn from_raw(raw: B::Raw<T>, len: usize) -> Self {
        Self { raw, len }
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Elements `start..start + len`, to read.
    ///
    /// # Panics
    /// When the range is outside the buffer (a bug in the model: it sizes views from the layout).
    #[track_caller]
    pub fn at(&self, start: usize, len: usize) -> Src<'_, B, T> {
        assert!(
            start.checked_add(len).is_some_and(|end| end <= self.len),
            "view {start}+{len} outside a buffer of {}",
            self.len
        );
        Src {
            raw: &self.raw,
            start,
            len,
            _backend: PhantomData,
        }
    }

    /// Every element, to read.
    pub fn all(&self) -> Src<'_, B, T> {
        self.at(0, self.len)
    }

    /// Elements `start..start + len`, to write.
    ///
    /// # Panics
    /// As [`Buf::at`].
    #[track_caller]
    pub fn at_mut(&mut self, start: usize, len: usize) -> Dst<'_, B, T> {
        assert!(
            start.checked_add(len).is_some_and(|end| end <= self.len),
            "view {start}+{len} outside a buffer of {}",
            self.len
        );
        Dst {
            raw: &mut self.raw,
            start,
            len,
            _backend: PhantomData,
        }
    }

    /// Every element, to write.
    pub fn all_mut(&mut self) -> Dst<'_, B, T> {
        let len = self.len;
        self.at_mut(0, len)
    }
}

/// A read view of a [`Buf`].
pub struct Src<'a, B: Backend, T: Element> {
    raw: &'a B::Raw<T>,
    start: usize,
    len: usize,
    _backend: PhantomData<fn() -> B>,
}

impl<B: Backend, T: Element> Clone for Src<'_, B, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: Backend, T: Element> Copy for Src<'_, B, T> {}

impl<'a, B: Backend, T: Element> Src<'a, B, T> {
    /// Elements in the view.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the view is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The backend's allocation, first element and length (for backend implementations).
    pub(crate) fn parts(&self) -> (&'a B::Raw<T>, usize, usize) {
        (self.raw, self.start, self.len)
    }
}

/// A write view of a [`Buf`].
pub struct Dst<'a, B: Backend, T: Element> {
    raw: &'a mut B::Raw<T>,
    start: usize,
    len: usize,
    _backend: PhantomData<fn() -> B>,
}

impl<'a, B: Backend, T: Element> Dst<'a, B, T> {
    /// Elements in the view.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the view is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The same elements, re-borrowed (to pass a view on without giving it up).
    pub fn reborrow(&mut self) -> Dst<'_, B, T> {
        Dst {
            raw: &mut *self.raw,
            start: self.start,
            len: self.len,
            _backend: PhantomData,
        }
    }

    /// The backend's allocation, first element and length (for backend implementations).
    pub(crate) fn parts(self) -> (&'a mut B::Raw<T>, usize, usize) {
        (self.raw, self.start, self.len)
    }
}

/// A view a [`Matrix`] can hold: something with a length.
pub trait MatrixData: Copy {
    /// Elements in the view.
    fn elements(&self) -> usize;
}

impl<B: Backend> MatrixData for Src<'_, B, f32> {
    fn elements(&self) -> usize {
        self.len()
    }
}

/// A row-major matrix operand of a product: `rows × cols` as stored, used transposed when `transposed`.
/// [`Operand`] holds f32 elements ([`Backend::gemm`]), [`HsOperand`] hidden states in their own precision
/// ([`Backend::gemm_hs`]).
#[derive(Clone, Copy)]
pub struct Matrix<D> {
    /// The stored elements (`rows · cols`).
    pub data: D,
    /// Stored rows.
    pub rows: usize,
    /// Stored columns.
    pub cols: usize,
    /// Whether the product uses the transpose.
    pub transposed: bool,
}

/// A matrix operand of [`Backend::gemm`].
pub type Operand<'a, B> = Matrix<Src<'a, B, f32>>;

impl<D: MatrixData> Matrix<D> {
    /// `data` as a row-major `[rows, cols]` matrix.
    ///
    /// # Panics
    /// When the view's length is not `rows · cols`.
    #[track_caller]
    pub fn new(data: D, rows: usize, cols: usize) -> Self {
        assert_eq!(
            data.elements(),
            rows * cols,
            "matrix view does not match its shape"
        );
        Self {
            data,
            rows,
            cols,
            transposed: false,
        }
    }

    /// The same matrix, used transposed.
    pub fn t(self) -> Self {
        Self {
            transposed: !self.transposed,
            ..self
        }
    }

    /// Rows and columns as used.
    pub fn shape(&self) -> (usize, usize) {
        if self.transposed {
            (self.cols, self.rows)
        } else {
            (self.rows, self.cols)
        }
    }
}

/// `(m, n, k)` of `c[m, n] = a[m, k] · b[k, n]`.
///
/// # Panics
/// When the shapes do not agree (a bug in the model).
#[track_caller]
pub fn gemm_shape<A: MatrixData, M: MatrixData>(
    c_len: usize,
    a: &Matrix<A>,
    b: &Matrix<M>,
) -> (usize, usize, usize) {
    let (m, k) = a.shape();
    let (kb, n) = b.shape();
    assert_eq!(k, kb, "inner dimensions differ");
    assert_eq!(
        c_len,
        m * n,
        "output view does not match the product's shape"
    );
    (m, n, k)
}

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

/// Hidden states on a backend, in the precision they are held in (the workspace layout's dtype of `input*.hs`).
pub enum HsBuf<B: Backend> {
    /// 32-bit floats.
    F32(Buf<B, f32>),
    /// bfloat16.
    Bf16(Buf<B, half::bf16>),
    /// IEEE half.
    F16(Buf<B, half::f16>),
}

impl<B: Backend> HsBuf<B> {
    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            Self::F32(b) => b.len(),
            Self::Bf16(b) => b.len(),
            Self::F16(b) => b.len(),
        }
    }

    /// True when the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The element type.
    pub fn dtype(&self) -> HsDtype {
        match self {
            Self::F32(_) => HsDtype::F32,
            Self::Bf16(_) => HsDtype::Bf16,
            Self::F16(_) => HsDtype::F16,
        }
    }

    /// Elements `start..start + len`, to read.
    ///
    /// # Panics
    /// As [`Buf::at`].
    #[track_caller]
    pub fn at(&self, start: usize, len: usize) -> HsSrc<'_, B> {
        match self {
            Self::F32(b) => HsSrc::F32(b.at(start, len)),
            Self::Bf16(b) => HsSrc::Bf16(b.at(start, len)),
            Self::F16(b) => HsSrc::F16(b.at(start, len)),
        }
    }
}

/// A read view of an [`HsBuf`].
pub enum HsSrc<'a, B: Backend> {
    /// 32-bit floats.
    F32(Src<'a, B, f32>),
    /// bfloat16.
    Bf16(Src<'a, B, half::bf16>),
    /// IEEE half.
    F16(Src<'a, B, half::f16>),
}

impl<B: Backend> Clone for HsSrc<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: Backend> Copy for HsSrc<'_, B> {}

impl<B: Backend> HsSrc<'_, B> {
    /// Elements in the view.
    pub fn len(&self) -> usize {
        match self {
            Self::F32(v) => v.len(),
            Self::Bf16(v) => v.len(),
            Self::F16(v) => v.len(),
        }
    }

    /// True when the view is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A matrix operand of [`Backend::gemm_hs`]: an [`Operand`] whose elements may be hidden states in their own
/// precision.
pub type HsOperand<'a, B> = Matrix<HsSrc<'a, B>>;

impl<B: Backend> MatrixData for HsSrc<'_, B> {
    fn elements(&self) -> usize {
        self.len()
    }
}

impl<'a, B: Backend> Matrix<HsSrc<'a, B>> {
    /// The operand as an f32 [`Operand`], when its elements are f32.
    pub fn as_f32(&self) -> Option<Operand<'a, B>> {
        match self.data {
            HsSrc::F32(data) => Some(Operand {
                data,
                rows: self.rows,
                cols: self.cols,
                transposed: self.transposed,
            }),
            _ => None,
        }
    }
}

impl<'a, B: Backend> From<Operand<'a, B>> for HsOperand<'a, B> {
    fn from(op: Operand<'a, B>) -> Self {
        Self {
            data: HsSrc::F32(op.data),
            rows: op.rows,
            cols: op.cols,
            transposed: op.transposed,
        }
    }
}

/// The operations a model step is written with. See the module docs for the execution model.
pub trait Backend: Sized + Send + 'static {
    /// A raw allocation of `T`s.
    type Raw<T: Element>: Send;

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
    /// 16-bit copy of the other operand in the layout's `gemm_hs_operand`, at `bf16` precision only).
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

    /// RMSNorm forward over `inv_rms.len()` rows of `weight.len()` columns.
    fn rmsnorm_forward(
        &mut self,
        x: Src<'_, Self, f32>,
        weight: Src<'_, Self, f32>,
        y: Dst<'_, Self, f32>,
        inv_rms: Dst<'_, Self, f32>,
        eps: f32,
    ) -> BackendResult;

    /// RMSNorm input gradient (`dx = …`, or `dx += …` with `accumulate`).
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_backward_input(
        &mut self,
        x: Src<'_, Self, f32>,
        weight: Src<'_, Self, f32>,
        inv_rms: Src<'_, Self, f32>,
        dy: Src<'_, Self, f32>,
        dx: Dst<'_, Self, f32>,
        accumulate: bool,
    ) -> BackendResult;

    /// RMSNorm weight gradient (overwritten) by the two-pass reduction through `partials`.
    fn rmsnorm_weight_grad(
        &mut self,
        x: Src<'_, Self, f32>,
        inv_rms: Src<'_, Self, f32>,
        dy: Src<'_, Self, f32>,
        dweight: Dst<'_, Self, f32>,
        partials: Dst<'_, Self, f32>,
    ) -> BackendResult;

    /// `act = silu(gate) ⊙ up` over rows `[gate | up]` of width `2·inter`.
    fn swiglu_forward(
        &mut self,
        gate_up: Src<'_, Self, f32>,
        act: Dst<'_, Self, f32>,
        inter: usize,
    ) -> BackendResult;

    /// Gradients of both SwiGLU inputs.
    fn swiglu_backward(
        &mut self,
        gate_up: Src<'_, Self, f32>,
        dact: Src<'_, Self, f32>,
        dgate_up: Dst<'_, Self, f32>,
        inter: usize,
    ) -> BackendResult;

    /// `h = z + silu(a)`.
    fn head_residual_forward(
        &mut self,
        z: Src<'_, Self, f32>,
        a: Src<'_, Self, f32>,
        h: Dst<'_, Self, f32>,
    ) -> BackendResult;

    /// `da = dh · silu'(a)` and `dz += dh`.
    fn head_residual_backward(
        &mut self,
        a: Src<'_, Self, f32>,
        dh: Src<'_, Self, f32>,
        da: Dst<'_, Self, f32>,
        dz: Dst<'_, Self, f32>,
    ) -> BackendResult;

    /// Labels `[heads, tokens]` from the batch's ids, mask and sequence lengths.
    #[allow(clippy::too_many_arguments)]
    fn build_labels(
        &mut self,
        input_ids: Src<'_, Self, u32>,
        loss_mask: Src<'_, Self, u8>,
        seq_lens: Src<'_, Self, u32>,
        labels: Dst<'_, Self, i32>,
        padded_len: usize,
        vocab: usize,
    ) -> BackendResult;

    /// Valid-label counts and loss scales per head.
    fn head_loss_scales(
        &mut self,
        labels: Src<'_, Self, i32>,
        head_decay: f32,
        counts: Dst<'_, Self, u32>,
        scales: Dst<'_, Self, f32>,
    ) -> BackendResult;

    /// Fused cross-entropy of a logits chunk, gradient in place; `scale` is one device scalar.
    fn vocab_loss(
        &mut self,
        logits: Dst<'_, Self, f32>,
        labels: Src<'_, Self, i32>,
        scale: Src<'_, Self, f32>,
        row_loss: Dst<'_, Self, f32>,
        vocab: usize,
    ) -> BackendResult;

    /// `out[0] = Σ values` (deterministic, two passes through `partials`).
    fn sum(
        &mut self,
        values: Src<'_, Self, f32>,
        partials: Dst<'_, Self, f32>,
        out: Dst<'_, Self, f32>,
    ) -> BackendResult;

    /// `norm_and_clip = [‖values‖₂, clip scale for max_norm]` (two passes through `partials`).
    fn grad_norm(
        &mut self,
        values: Src<'_, Self, f32>,
        partials: Dst<'_, Self, f32>,
        max_norm: f32,
        norm_and_clip: Dst<'_, Self, f32>,
    ) -> BackendResult;

    /// Advances AdamW's device state `[steps, β1^steps, β2^steps]` and writes the step's scalars when the
    /// gradient norm is finite; changes nothing on a skipped step.
    fn adamw_advance(
        &mut self,
        grad_norm: Src<'_, Self, f32>,
        hyper: AdamWHyper,
        state: Dst<'_, Self, f64>,
        step: Dst<'_, Self, f32>,
    ) -> BackendResult;

    /// One fused AdamW pass (a no-op when the norm is not finite).
    #[allow(clippy::too_many_arguments)]
    fn adamw_update(
        &mut self,
        params: Dst<'_, Self, f32>,
        grads: Src<'_, Self, f32>,
        exp_avg: Dst<'_, Self, f32>,
        exp_avg_sq: Dst<'_, Self, f32>,
        norm_and_clip: Src<'_, Self, f32>,
        step: Src<'_, Self, f32>,
    ) -> BackendResult;

    /// `out[r] = table[ids[r]]`: rows of a frozen embedding table `[vocab, hidden]` by token id
    /// (`hidden = out.len() / ids.len()`; no gradient).
    fn embedding_gather(
        &mut self,
        table: Src<'_, Self, f32>,
        ids: Src<'_, Self, u32>,
        out: Dst<'_, Self, f32>,
    ) -> BackendResult;

    /// RoPE in place over `x = [positions.len(), heads, head_dim]` (Hugging Face's `rotate_half` pairs
    /// `(j, j + head_dim/2)`, frequency `theta^(−2j/head_dim)`); `inverse` rotates back (the backward).
    fn rope(
        &mut self,
        x: Dst<'_, Self, f32>,
        positions: Src<'_, Self, u32>,
        theta: f32,
        heads: usize,
        head_dim: usize,
        inverse: bool,
    ) -> BackendResult;

    /// Weighted fused cross-entropy of a logits chunk `[rows, vocab]`: the gradient
    /// `weights[r] · norm · (softmax − onehot)` in place, `row_loss = weights[r] · norm · CE`, `correct = 1`
    /// where the row's argmax is its label (labels −1: zero gradient, loss and `correct`); `norm` is one
    /// device scalar, `1 / Σ weights`.
    #[allow(clippy::too_many_arguments)]
    fn weighted_vocab_loss(
        &mut self,
        logits: Dst<'_, Self, f32>,
        labels: Src<'_, Self, i32>,
        weights: Src<'_, Self, f32>,
        norm: Src<'_, Self, f32>,
        row_loss: Dst<'_, Self, f32>,
        correct: Dst<'_, Self, f32>,
        vocab: usize,
    ) -> BackendResult;

    /// Attention with two key ranges per query (see [`attention`]): `out [Q, heads, head_dim]` and the
    /// log-sum-exp `lse [Q, heads]` the backward reads (−∞ for a query without keys, whose output is 0).
    fn attention_forward(
        &mut self,
        inputs: AttentionInputs<'_, Self>,
        shape: AttentionShape,
        out: Dst<'_, Self, f32>,
        lse: Dst<'_, Self, f32>,
    ) -> BackendResult;

    /// Attention backward: every gradient of `grads` overwritten, deterministically (no atomics); `delta`
    /// is scratch of `[Q, heads]` (`rowsum(dout ∘ out)`).
    fn attention_backward(
        &mut self,
        inputs: AttentionInputs<'_, Self>,
        shape: AttentionShape,
        saved: AttentionSaved<'_, Self>,
        delta: Dst<'_, Self, f32>,
        grads: AttentionGrads<'_, Self>,
    ) -> BackendResult;

    /// Averages `grads` over the data-parallel replicas, when the backend has a group (CPU: the host
    /// all-reduce; CUDA: NCCL, enqueued between the captured parts, never inside a graph).
    fn average_gradients(&mut self, grads: Dst<'_, Self, f32>) -> BackendResult;

    // EAGLE-3's kernels (`backend::eagle3`).
    crate::backend::eagle3::eagle3_backend_methods!(declare);
}
