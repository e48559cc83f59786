//! The CUDA backend: buffers are device allocations addressed by raw pointers, every step-path operation is
//! enqueued on the compute stream (cuBLAS for the products, our PTX kernels for the rest) and nothing on it
//! syncs or allocates, so a part of the step can be captured once as a graph and replayed. Every stream
//! synchronisation and allocation the backend makes is counted where it falls on the step path
//! ([`CudaBackend::step_path_counts`], `step_path.rs`).
//!
//! ```text
//!  host   stage(slot): wait slot_free[slot] ─▶ pinned copy ─▶ copy stream: H2D into the slot ─▶ copied[slot]
//!         stage_upload(slot): the family's plan ─▶ the slot's pinned arena ─▶ copy stream: H2D ─▶ copied[slot]
//!  device begin_step: compute waits copied[slot], start[ring] ─▶ graph A (bucket, slot) ─▶ NCCL average (eager)
//!         ─▶ graph B (update) ─▶ stop[ring], slot_free[slot] ─▶ D2H [grad_norm, clip, loss] ─▶ done[ring]
//!  host   read_results(ring): wait done[ring] (blocking-sync event: the thread sleeps, no core spins)
//! ```
//!
//! Why the gradient average sits between two graphs: NCCL requires every rank to launch a captured collective
//! from the same capture, but graphs here are captured lazily per (bucket, input slot), and with
//! `random_in_bucket` the ranks reach a bucket's first batch at different steps. Outside the graphs, every rank
//! enqueues the same eager all-reduce every step whatever bucket it trains on, and the graphs hold no
//! collective. The cost is one eager NCCL launch per step (a few µs of host time).
//!
//! Precision: `bf16` and `tf32` run the f32 GEMMs with cuBLAS's compute types `CUBLAS_COMPUTE_32F_FAST_16BF`
//! and `CUBLAS_COMPUTE_32F_FAST_TF32`: the tensor cores round both f32 operands and accumulate in f32 into an f32
//! output; the master weights, gradients and AdamW moments stay f32. Where the workspace keeps bf16 copies of
//! both operands (the DFlash forward at `bf16`: weights written by AdamW, activations by the kernels that
//! produce them, `docs/gpu.md`), `gemm_hs` reads those instead, one `cublasGemmEx` on bf16 inputs.
//!
//! Hidden states held in 16 bits stay so on the device at `bf16` precision: the input slots hold them in bf16
//! (the host→device copy moves 16-bit values; f16 batches are rounded to bf16 while staging), and the two
//! products that read them (the `fc` forward and its weight gradient) are `cublasGemmEx` with bf16 inputs, f32
//! accumulation and an f32 output. cuBLAS multiplies bf16 only by bf16, so the other operand (the f32 `fc`
//! weight, or the f32 upstream gradient) is first rounded to bf16 by the `round_to_half` kernel into the
//! layout's `gemm_hs_operand`: the value the tensor cores would have used at `bf16` precision anyway. Not f16
//! for f16 batches: the weight gradient's upstream gradient (1e-8 to 1e-5 at real vocabularies) would underflow
//! in f16, where bf16 keeps f32's exponent range. At f32 or TF32 the layout keeps f32 slots and the host widens
//! while staging (cuBLAS has no 16-bit × f32 product).
//!
//! What the backend is made of lives beside it, all through `cudarc`: device discovery ([`discover_devices`],
//! never panics without a driver), the kernels' PTX (built from `gpu-kernels` by `build.rs`, loaded as one
//! [`KernelModule`]) and their generated [`Launcher`] (with `Launcher::launch`, this backend's `launch`), cuBLAS
//! ([`Gemm`]), NCCL ([`GradientAllReduce`]), the captured graphs and the pinned staging of an input slot.
//!
//! ```text
//!  build.rs ──▶ embedded PTX ──▶ KernelModule (one CUmodule, a CudaFunction per kernel) ──▶ Launcher
//!  device discovery ──▶ CudaContext ──▶ CudaBackend (the drafter on it: `crate::drafter::cuda`)
//! ```
//!
//! Everything loads at run time (`cudarc` with `dynamic-loading`, CUDA 13.0 library names): a binary built
//! here runs on a machine without CUDA and answers with [`CudaError::NoDriver`] instead of failing to start.
//! See `docs/gpu.md` for the PTX build, the checks and the GPU machine script.
//!
//! None of this has run on a GPU yet (the session that wrote it had none); `scripts/gpu-check.sh` runs it.

mod allreduce;
mod blas;
mod device;
pub(super) mod error;
mod graphs;
mod launch;
mod module;
mod nccl;
mod staging;
mod step_path;

pub use allreduce::{GradientAllReduce, GroupAbort};
pub use blas::{Gemm, HalfType, Op};
pub use device::{CudaDeviceInfo, discover_devices, open_device};
pub use error::CudaError;

use graphs::{PartGraphs, StepGraph};
pub use launch::{
    BLOCK_THREADS, DevicePtr, FLASH_KERNEL_NAMES, FLASH_LAUNCH_ARGUMENT_WIDTHS, FlashLauncher,
    KERNEL_NAMES, LAUNCH_ARGUMENT_WIDTHS, Launcher,
};
pub use module::{EMBEDDED_PTX, KernelModule, embedded_ptx};
use staging::{PinnedInput, PlanStaging, SlotHs, SlotPointers, plan_staging_bytes};
pub use step_path::{CallCounts, StepPathCounts};
use step_path::{StepPathCall, StepPathCounter};

use std::sync::Arc;

use cudarc::driver::result as driver;
use cudarc::driver::sys::{CUdeviceptr, CUevent_flags};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr as _, PinnedHostSlice,
};
use draftpipe_compiler::plan::{BackendKind, LaunchMode, WorkspaceLayout};
use draftpipe_compiler::workspace::{CUBLAS_WORKSPACE_BYTES, Dtype, STEP_SCALARS};
use draftpipe_gpu_kernels::convert::FORMAT_BF16;

use super::{
    Backend, BackendError, BackendResult, Buf, Dst, Element, FlashKernel, HostBatch, HsBuf,
    HsOperand, HsSrc, InputSlot, Kernel, Operand, Precision, Reinterpret, Src, StepPart,
    StepResults, gemm_shape, missing_last_hidden_states,
};
use crate::batch::HsDtype;

/// A device allocation and its address (taken once: event tracking is off, so the address is all we need).
pub struct DeviceBuffer<T> {
    _slice: CudaSlice<T>,
    ptr: CUdeviceptr,
}

/// The typed device pointer of a read view: its first element and its length.
pub(crate) fn ptr<T: Element>(view: Src<'_, CudaBackend, T>) -> DevicePtr<T> {
    let (raw, start, len) = view.parts();
    // SAFETY: a view lies inside its buffer's allocation (checked when the view was made).
    unsafe { DevicePtr::from_raw(raw.ptr + (start * size_of::<T>()) as CUdeviceptr, len) }
}

/// The typed device pointer of a write view.
pub(crate) fn ptr_mut<T: Element>(view: Dst<'_, CudaBackend, T>) -> DevicePtr<T> {
    let (raw, start, len) = view.parts();
    // SAFETY: as for `ptr`.
    unsafe { DevicePtr::from_raw(raw.ptr + (start * size_of::<T>()) as CUdeviceptr, len) }
}

/// The hidden-state dtype of the layout's buffer `name`, when it has one of the three.
fn hs_dtype(layout: &WorkspaceLayout, name: &str) -> Option<HsDtype> {
    match layout.buffers.iter().find(|b| b.name == name)?.dtype {
        Dtype::F32 => Some(HsDtype::F32),
        Dtype::Bf16 => Some(HsDtype::Bf16),
        Dtype::F16 => Some(HsDtype::F16),
        _ => None,
    }
}

/// The 16-bit copy of a product's f32 operand when the other holds 16-bit hidden states (the layout's
/// `gemm_hs_operand`), and the 16-bit type it holds.
struct HalfOperand {
    buffer: DeviceBuffer<u16>,
    len: usize,
    dtype: HsDtype,
}

/// One CUDA device as a backend. See the module docs.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    copy: Arc<CudaStream>,
    kernels: Launcher,
    flash: FlashLauncher,
    gemm: Gemm,
    launch: LaunchMode,
    graphs: PartGraphs<StepPart, StepGraph>,
    pinned: Vec<PinnedInput>,
    plan_staging: Vec<PlanStaging>,
    copied: Vec<CudaEvent>,
    slot_free: Vec<CudaEvent>,
    readback: [PinnedHostSlice<f32>; 2],
    start: [CudaEvent; 2],
    stop: [CudaEvent; 2],
    done: [CudaEvent; 2],
    all_reduce: Option<GradientAllReduce>,
    half_operand: Option<HalfOperand>,
    allocated: u64,
    step_path: StepPathCounter,
}

impl CudaBackend {
    /// Device `ordinal` with streams, kernels, cuBLAS (with the layout's `cublas_workspace`) and the pinned
    /// staging of `layout`'s input slots; graphs per step part when `launch` is [`LaunchMode::Graph`].
    ///
    /// # Errors
    /// [`CudaError::NoDriver`], [`CudaError::NoSuchDevice`], [`CudaError::BuiltWithoutKernels`],
    /// [`CudaError::NoCublas`] and driver failures.
    pub fn new(
        ordinal: usize,
        launch: LaunchMode,
        layout: &WorkspaceLayout,
    ) -> Result<Self, CudaError> {
        let ctx = open_device(ordinal)?;
        // SAFETY: every buffer is used through raw addresses on `compute`/`copy`, ordered by our own events;
        // cudarc's per-slice events would otherwise be recorded inside stream capture.
        unsafe { ctx.disable_event_tracking() };
        let module = KernelModule::load(&ctx)?;
        let compute = ctx.new_stream()?;
        let copy = ctx.new_stream()?;
        let kernels = Launcher::new(&module, compute.clone())?;
        let flash = FlashLauncher::new(&module, compute.clone())?;
        let cublas_bytes = layout
            .elements("cublas_workspace")
            .unwrap_or(CUBLAS_WORKSPACE_BYTES);
        let gemm = Gemm::with_workspace(compute.clone(), cublas_bytes)?;
        let (tokens, sequences) = (layout.tokens, layout.sequences);
        let din = layout.elements("input0.hs").unwrap_or(0) / tokens.max(1);
        let slot_hs = hs_dtype(layout, "input0.hs").unwrap_or(HsDtype::F32);
        let last_hidden = layout
            .elements("input0.last_hs")
            .map(|len| len / tokens.max(1));
        let pinned = (0..layout.input_slots)
            .map(|_| PinnedInput::new(&ctx, slot_hs, (tokens, din, sequences), last_hidden))
            .collect::<Result<Vec<_>, _>>()?;
        let plan_staging = (0..layout.input_slots)
            .map(|_| PlanStaging::new(&ctx, plan_staging_bytes(layout)))
            .collect::<Result<Vec<_>, _>>()?;
        let half_operand = match (
            hs_dtype(layout, "gemm_hs_operand"),
            layout.elements("gemm_hs_operand"),
        ) {
            (Some(dtype), Some(len)) => {
                let slice = compute.alloc_zeros::<u16>(len.max(1))?;
                let (ptr, _) = slice.device_ptr(&compute);
                let buffer = DeviceBuffer { _slice: slice, ptr };
                Some(HalfOperand { buffer, len, dtype })
            }
            _ => None,
        };
        let half_bytes = half_operand.as_ref().map_or(0, |h| 2 * h.len as u64);
        // Events the host waits on sleep instead of spinning a core for the whole step.
        let host_waited = || ctx.new_event(Some(CUevent_flags::CU_EVENT_BLOCKING_SYNC));
        let timing = || ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT));
        let stream_only = || ctx.new_event(None);
        // SAFETY: read-back buffers must be cached host memory (not write-combined): flags 0.
        let scalars = layout.elements("step_scalars").unwrap_or(STEP_SCALARS);
        let readback = || unsafe { ctx.alloc_pinned_with_flags::<f32>(scalars, 0) };
        let backend = Self {
            copied: (0..layout.input_slots)
                .map(|_| stream_only())
                .collect::<Result<_, _>>()?,
            slot_free: (0..layout.input_slots)
                .map(|_| host_waited())
                .collect::<Result<_, _>>()?,
            readback: [readback()?, readback()?],
            start: [timing()?, timing()?],
            stop: [timing()?, timing()?],
            done: [host_waited()?, host_waited()?],
            pinned,
            plan_staging,
            graphs: PartGraphs::new(),
            ctx,
            compute,
            copy,
            kernels,
            flash,
            gemm,
            launch,
            all_reduce: None,
            half_operand,
            allocated: cublas_bytes as u64 + half_bytes,
            step_path: StepPathCounter::default(),
        };
        backend.compute.synchronize()?;
        Ok(backend)
    }

    /// Averages the gradients with the other ranks of `all_reduce`'s group every step.
    pub fn with_all_reduce(mut self, all_reduce: GradientAllReduce) -> Self {
        self.all_reduce = Some(all_reduce);
        self
    }

    /// The device context (for benchmarks that time other work on the same device).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The synchronisations and allocations made on the step path so far (see `step_path.rs`): after a
    /// bucket's first step, `steady` stays 0.
    pub fn step_path_counts(&self) -> StepPathCounts {
        self.step_path.counts()
    }

    /// A pinned, cached host buffer of `len` elements (transfers outside the step path; counted).
    fn pinned_buffer<T: Element>(&mut self, len: usize) -> Result<PinnedHostSlice<T>, CudaError> {
        self.step_path.record(StepPathCall::PinnedAlloc);
        // SAFETY: plain numbers; flags 0 gives cached memory, readable by the host.
        Ok(unsafe { self.ctx.alloc_pinned_with_flags::<T>(len.max(1), 0) }?)
    }

    /// Waits for everything queued on the compute stream (outside the step path; counted).
    fn synchronize_compute(&mut self) -> Result<(), CudaError> {
        self.step_path.record(StepPathCall::Sync);
        Ok(self.compute.synchronize()?)
    }

    /// `c ← alpha · a · b + beta · c` where `half` (a when `half_is_a`, else b) holds 16-bit hidden states and
    /// `wide` is f32: `wide` is rounded into the 16-bit operand copy, then one `cublasGemmEx` with 16-bit inputs
    /// and f32 accumulation and output.
    fn gemm_half(
        &mut self,
        c: Dst<'_, Self, f32>,
        (half, half_is_a): (HsOperand<'_, Self>, bool),
        wide: Operand<'_, Self>,
        (m, n, k): (usize, usize, usize),
        (alpha, beta): (f32, f32),
        precision: Precision,
    ) -> BackendResult {
        let half_addr = match half.data {
            HsSrc::Bf16(view) => ptr(view).addr(),
            // The layout holds f16 batches in bf16 slots: an f16 copy of the weight gradient's upstream gradient
            // (1e-8..1e-5) would underflow (`WorkspaceLayout::with_hs_dtype`).
            HsSrc::F16(_) => {
                return Err(BackendError::Unsupported(
                    "a CUDA product of f16 hidden states (the layout holds them in bf16 input slots, since \
                     an f16 copy of the upstream gradient underflows)"
                        .to_owned(),
                ));
            }
            HsSrc::F32(_) => unreachable!("gemm_half: the hidden-state operand is f32"),
        };
        let (input, dtype) = (HalfType::Bf16, HsDtype::Bf16);
        if precision != Precision::Bf16 {
            return Err(BackendError::Unsupported(format!(
                "a {precision:?} product with {} hidden states on CUDA (their input slots hold f32 at f32 and \
                 TF32 precision)",
                dtype.name()
            )));
        }
        let copy = match &self.half_operand {
            Some(copy) if copy.dtype == dtype && copy.len >= wide.data.len() => copy,
            _ => {
                return Err(BackendError::Unsupported(format!(
                    "the workspace has no {}-element {} `gemm_hs_operand` for this product",
                    wide.data.len(),
                    dtype.name()
                )));
            }
        };
        let n_wide = wide.data.len();
        // SAFETY: the copy's allocation holds `copy.len ≥ n_wide` u16s.
        let rounded = unsafe { DevicePtr::<u16>::from_raw(copy.buffer.ptr, copy.len) };
        self.kernels
            .round_to_half(ptr(wide.data), rounded, n_wide, FORMAT_BF16)?;
        let op = |transposed: bool| if transposed { Op::T } else { Op::N };
        let half_side = (op(half.transposed), half_addr);
        let wide_side = (op(wide.transposed), rounded.addr());
        let (a, b) = if half_is_a {
            (half_side, wide_side)
        } else {
            (wide_side, half_side)
        };
        // SAFETY: both inputs hold their stated shapes in 16-bit elements (the hidden states' view, checked by
        // `Matrix::new`; the copy's first `n_wide` elements, just written on the same stream); `c` is a write
        // view of `m · n` f32s, so it overlaps neither.
        unsafe {
            self.gemm
                .row_major_16(a, b, ptr_mut(c).addr(), (m, n, k), (alpha, beta), input)
        }?;
        Ok(())
    }
}

impl Drop for CudaBackend {
    /// Tear-down waits for both streams before the buffers, graphs and events are freed: memory that a kernel,
    /// copy or graph in flight still reads must not be released under it (a stream-ordered free would not
    /// wait). A failure here is past reporting: the step that caused it has already returned its error.
    fn drop(&mut self) {
        let _ = self.copy.synchronize();
        let _ = self.compute.synchronize();
    }
}

/// The device address of the first `n` hidden states of `slot`, in their precision.
fn slot_hs_pointer(slot: &mut HsBuf<CudaBackend>, n: usize) -> SlotHs {
    match slot {
        HsBuf::F32(b) => SlotHs::F32(ptr_mut(b.at_mut(0, n))),
        HsBuf::Bf16(b) => SlotHs::Bf16(ptr_mut(b.at_mut(0, n))),
        HsBuf::F16(b) => SlotHs::F16(ptr_mut(b.at_mut(0, n))),
    }
}

impl Backend for CudaBackend {
    type Raw<T: Element> = DeviceBuffer<T>;
    type Read<'a, T: 'a> = DevicePtr<T>;
    type Write<'a, T: 'a> = DevicePtr<T>;

    fn kind(&self) -> BackendKind {
        BackendKind::Cuda
    }

    fn asynchronous(&self) -> bool {
        true
    }

    fn alloc<T: Element>(&mut self, len: usize) -> BackendResult<Buf<Self, T>> {
        self.step_path.record(StepPathCall::DeviceAlloc);
        // cudarc refuses empty allocations; a zero-length buffer holds one element nobody reads.
        let slice = self
            .compute
            .alloc_zeros::<T>(len.max(1))
            .map_err(CudaError::from)?;
        let (ptr, _) = slice.device_ptr(&self.compute);
        self.allocated += (len * size_of::<T>()) as u64;
        Ok(Buf::from_raw(DeviceBuffer { _slice: slice, ptr }, len))
    }

    fn allocated_bytes(&self) -> u64 {
        self.allocated
    }

    fn upload<T: Element>(&mut self, dst: Dst<'_, Self, T>, src: &[T]) -> BackendResult {
        assert_eq!(dst.len(), src.len(), "upload: lengths differ");
        let mut pinned = self.pinned_buffer::<T>(src.len())?;
        pinned.as_mut_slice().map_err(CudaError::from)?[..src.len()].copy_from_slice(src);
        let stream = self.compute.cu_stream();
        // SAFETY: the destination holds `src.len()` elements; the pinned source lives until the stream has
        // drained below, and the copy is ordered on the compute stream with every step.
        unsafe {
            driver::memcpy_htod_async(
                ptr_mut(dst).addr(),
                &pinned.as_slice().map_err(CudaError::from)?[..src.len()],
                stream,
            )
        }
        .map_err(CudaError::from)?;
        self.synchronize_compute()?;
        Ok(())
    }

    fn download<T: Element>(&mut self, src: Src<'_, Self, T>, dst: &mut [T]) -> BackendResult {
        assert_eq!(src.len(), dst.len(), "download: lengths differ");
        let mut pinned = self.pinned_buffer::<T>(dst.len())?;
        let n = dst.len();
        // SAFETY: the source holds `n` elements; the copy is ordered after every step on the compute stream,
        // and the pinned buffer is read only after the stream drained.
        unsafe {
            driver::memcpy_dtoh_async(
                &mut pinned.as_mut_slice().map_err(CudaError::from)?[..n],
                ptr(src).addr(),
                self.compute.cu_stream(),
            )
        }
        .map_err(CudaError::from)?;
        self.synchronize_compute()?;
        dst.copy_from_slice(&pinned.as_slice().map_err(CudaError::from)?[..n]);
        Ok(())
    }

    fn stage(
        &mut self,
        slot: usize,
        batch: HostBatch<'_>,
        input: &mut InputSlot<Self>,
    ) -> BackendResult {
        self.step_path.staging();
        // The slot's previous step must have consumed it before its pinned copy is overwritten.
        self.slot_free[slot]
            .synchronize()
            .map_err(CudaError::from)?;
        self.plan_staging[slot].reset();
        let tokens = batch.input_ids.len();
        let n = batch.hs.len();
        let last_hidden_states = match (&mut input.last_hidden_states, batch.last_hidden_states) {
            (Some(slot), Some(last)) => Some(slot_hs_pointer(slot, last.len())),
            (Some(_), None) => return Err(missing_last_hidden_states()),
            // A family that does not read them leaves them on the host.
            (None, _) => None,
        };
        let slot_pointers = SlotPointers {
            hs: slot_hs_pointer(&mut input.hs, n),
            last_hidden_states,
            input_ids: ptr_mut(input.input_ids.at_mut(0, tokens)),
            seq_lens: ptr_mut(input.seq_lens.at_mut(0, batch.seq_lens.len())),
            loss_mask: ptr_mut(input.loss_mask.at_mut(0, batch.loss_mask.len())),
        };
        // SAFETY: `slot_free[slot]` (recorded after the last step that read this slot) has passed, so the
        // staging buffers and the slot are free; the destinations hold the batch (the views above, from the
        // largest bucket's shape, which the caller checked); `begin_step` makes the compute stream wait for
        // `copied[slot]` before a step reads the slot.
        unsafe {
            self.pinned[slot].enqueue(batch, slot_pointers, self.copy.cu_stream())?;
        }
        self.copied[slot]
            .record(&self.copy)
            .map_err(CudaError::from)?;
        Ok(())
    }

    fn stage_upload<T: Element>(
        &mut self,
        slot: usize,
        dst: Dst<'_, Self, T>,
        src: &[T],
    ) -> BackendResult {
        // SAFETY: `stage(slot)` waited for `slot_free[slot]` and reset the arena, so its earlier copies have run;
        // `dst` is a view of the layout's buffer (at least `src.len()` long, checked in `enqueue`), which outlives
        // the copy; `copied[slot]`, recorded after it below, orders it before the step that reads the slot.
        unsafe {
            self.plan_staging[slot].enqueue("plan", src, ptr_mut(dst), self.copy.cu_stream())?;
        }
        self.copied[slot]
            .record(&self.copy)
            .map_err(CudaError::from)?;
        Ok(())
    }

    fn begin_step(&mut self, slot: usize, ring: usize) -> BackendResult {
        self.step_path.began();
        self.compute
            .wait(&self.copied[slot])
            .map_err(CudaError::from)?;
        self.start[ring]
            .record(&self.compute)
            .map_err(CudaError::from)?;
        Ok(())
    }

    fn run_part(
        &mut self,
        part: StepPart,
        body: &mut dyn FnMut(&mut Self) -> BackendResult,
    ) -> BackendResult {
        graphs::run_part(self, part, body)
    }

    fn end_step(&mut self, slot: usize, ring: usize, scalars: Src<'_, Self, f32>) -> BackendResult {
        self.stop[ring]
            .record(&self.compute)
            .map_err(CudaError::from)?;
        self.slot_free[slot]
            .record(&self.compute)
            .map_err(CudaError::from)?;
        let readback = &mut self.readback[ring];
        assert_eq!(
            scalars.len(),
            readback.len(),
            "end_step: the step scalars are the layout's"
        );
        // SAFETY: `scalars` holds as many f32s as the pinned destination, which is read only after `done[ring]`.
        unsafe {
            driver::memcpy_dtoh_async(
                readback.as_mut_slice().map_err(CudaError::from)?,
                ptr(scalars).addr(),
                self.compute.cu_stream(),
            )
        }
        .map_err(CudaError::from)?;
        self.done[ring]
            .record(&self.compute)
            .map_err(CudaError::from)?;
        Ok(())
    }

    fn read_results(&mut self, ring: usize) -> BackendResult<StepResults> {
        self.done[ring].synchronize().map_err(CudaError::from)?;
        self.step_path.read();
        let values = self.readback[ring].as_slice().map_err(CudaError::from)?;
        if values.len() < STEP_SCALARS {
            return Err(CudaError::LengthMismatch {
                what: "readback",
                got: values.len(),
                expected: STEP_SCALARS,
            }
            .into());
        }
        let scalars = [values[0], values[1], values[2]];
        let extra = values[STEP_SCALARS..].to_vec();
        let device_ms = self.start[ring]
            .elapsed_ms(&self.stop[ring])
            .map_err(CudaError::from)?;
        Ok(StepResults {
            scalars,
            extra,
            device_ms: Some(device_ms),
        })
    }

    fn fill(&mut self, dst: Dst<'_, Self, f32>, value: f32) -> BackendResult {
        let n = dst.len();
        // SAFETY: `dst` holds `n` f32s; the memset is ordered on the compute stream.
        let result = unsafe {
            cudarc::driver::sys::cuMemsetD32Async(
                ptr_mut(dst).addr(),
                value.to_bits(),
                n,
                self.compute.cu_stream(),
            )
        };
        result.result().map_err(CudaError::from)?;
        Ok(())
    }

    fn copy(&mut self, dst: Dst<'_, Self, f32>, src: Src<'_, Self, f32>) -> BackendResult {
        assert_eq!(dst.len(), src.len(), "copy: lengths differ");
        let bytes = src.len() * size_of::<f32>();
        // SAFETY: both views hold `bytes`; distinct buffers (a `Dst` and a `Src` cannot alias).
        unsafe {
            driver::memcpy_dtod_async(
                ptr_mut(dst).addr(),
                ptr(src).addr(),
                bytes,
                self.compute.cu_stream(),
            )
        }
        .map_err(CudaError::from)?;
        Ok(())
    }

    fn gemm(
        &mut self,
        c: Dst<'_, Self, f32>,
        a: Operand<'_, Self>,
        b: Operand<'_, Self>,
        alpha: f32,
        beta: f32,
        precision: Precision,
    ) -> BackendResult {
        let mnk = gemm_shape(c.len(), &a, &b);
        let op = |o: &Operand<'_, Self>| if o.transposed { Op::T } else { Op::N };
        // SAFETY: the views are inside their buffers and hold the stated shapes (checked by `gemm_shape` and
        // `Operand::new`); `c` is a write view, so it overlaps neither input.
        unsafe {
            self.gemm.row_major_at(
                (op(&a), ptr(a.data).addr()),
                (op(&b), ptr(b.data).addr()),
                ptr_mut(c).addr(),
                mnk,
                (alpha, beta),
                precision,
            )
        }?;
        Ok(())
    }

    fn gemm_hs(
        &mut self,
        c: Dst<'_, Self, f32>,
        a: HsOperand<'_, Self>,
        b: HsOperand<'_, Self>,
        alpha: f32,
        beta: f32,
        precision: Precision,
    ) -> BackendResult {
        let mnk = gemm_shape(c.len(), &a, &b);
        match (a.as_f32(), b.as_f32()) {
            (Some(a), Some(b)) => self.gemm(c, a, b, alpha, beta, precision),
            (None, Some(b)) => self.gemm_half(c, (a, true), b, mnk, (alpha, beta), precision),
            (Some(a), None) => self.gemm_half(c, (b, false), a, mnk, (alpha, beta), precision),
            (None, None) => match (a.data, b.data) {
                // Both 16-bit copies (weights from AdamW, activations from the kernels that wrote them): one
                // `cublasGemmEx` on bf16 inputs, nothing rounded here.
                (HsSrc::Bf16(a_data), HsSrc::Bf16(b_data)) if precision == Precision::Bf16 => {
                    let op = |transposed: bool| if transposed { Op::T } else { Op::N };
                    // SAFETY: both views hold their stated shapes in bf16 (checked by `Matrix::new` and
                    // `gemm_shape`); `c` is a write view of `m · n` f32s, so it overlaps neither.
                    unsafe {
                        self.gemm.row_major_16(
                            (op(a.transposed), ptr(a_data).addr()),
                            (op(b.transposed), ptr(b_data).addr()),
                            ptr_mut(c).addr(),
                            mnk,
                            (alpha, beta),
                            HalfType::Bf16,
                        )
                    }?;
                    Ok(())
                }
                _ => Err(BackendError::Unsupported(format!(
                    "a {precision:?} CUDA product of two 16-bit operands other than bf16 at bf16 precision"
                ))),
            },
        }
    }

    fn average_gradients(&mut self, grads: Dst<'_, Self, f32>) -> BackendResult {
        if let Some(all_reduce) = &self.all_reduce {
            let n = grads.len();
            // SAFETY: `grads` holds `n` f32s on this communicator's device; every rank enqueues the same call
            // once per step, outside any graph.
            unsafe {
                all_reduce.enqueue_average(ptr_mut(grads).addr(), n, self.compute.cu_stream())
            }?;
        }
        Ok(())
    }

    fn launch(&mut self, kernel: Kernel<'_, Self>) -> BackendResult {
        self.kernels.launch(kernel)?;
        Ok(())
    }

    fn launch_flash(&mut self, kernel: FlashKernel<'_, Self>) -> BackendResult {
        self.flash.launch(kernel)?;
        Ok(())
    }

    fn read<'a, T: Element>(view: Src<'a, Self, T>) -> DevicePtr<T> {
        ptr(view)
    }

    fn write<'a, T: Element>(view: Dst<'a, Self, T>) -> DevicePtr<T> {
        ptr_mut(view)
    }

    fn split_write<'a, T: 'a>(view: DevicePtr<T>, mid: usize) -> (DevicePtr<T>, DevicePtr<T>) {
        view.split_at(mid)
            .unwrap_or_else(|| panic!("split at {mid} of a {}-element view", view.len()))
    }

    fn reinterpret_read<'a, T: Reinterpret<U> + 'a, U: 'a>(view: DevicePtr<T>) -> DevicePtr<U> {
        // SAFETY: `Reinterpret` promises that whole `U`s of `T`s are valid and need no stricter alignment.
        unsafe { view.cast() }
    }

    fn reinterpret_write<'a, T: Reinterpret<U> + 'a, U: 'a>(view: DevicePtr<T>) -> DevicePtr<U> {
        // SAFETY: as in `reinterpret_read`.
        unsafe { view.cast() }
    }
}
