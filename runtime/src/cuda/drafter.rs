//! The CUDA drafter: one device, flat buffers allocated once, a step per batch as one graph launch (or eager).
//!
//! ```text
//!  host   stage(batch n+1): pinned copy ─▶ copy stream: H2D into the free input slot ─▶ event copied[slot]
//!  host   step():  compute waits copied[slot] ─▶ H2D AdamW scalars ─▶ [start] graph(bucket, slot) [stop]
//!                  ─▶ D2H [grad_norm, clip, loss] into pinned ring ─▶ event done[k]
//!                  then waits done[k-1] (the previous step, long finished or about to be) and reports it
//! ```
//!
//! The host never waits for the step it just launched: the loss of step n is reported by the call that
//! launches step n + 1 (or by [`CudaDrafter::finish`]), so the device always has the next step queued.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::result as driver;
use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode_enum};
use cudarc::driver::{CudaContext, CudaEvent, CudaGraph, CudaStream, PinnedHostSlice};
use draftpipe_compiler::plan::{AdamWSpec, BucketPlan, LaunchMode, LossSpec, ModelPlan};

use super::blas::Gemm;
use super::launch::Launcher;
use super::step::{ParamOffsets, StepPlan, StepShape};
use super::workspace::{ADAMW_STEP_FLOATS, Activations, FlatBuffers, InputSlot};
use super::{CudaError, GradientAllReduce, KernelModule, open_device};
use crate::batch::HsBatch;
use crate::params::FlatState;

/// What one finished step reports (read back one step after its launch).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepOutcome {
    /// Index of the step since the drafter was created.
    pub index: u64,
    /// Its loss.
    pub loss: f32,
    /// Global gradient norm before clipping (non-finite: the update was skipped).
    pub grad_norm: f32,
    /// Device time between the step's first and last operation, milliseconds (CUDA events).
    pub device_ms: f32,
    /// Host time spent issuing it (`step()` up to, not including, the wait for the previous step), µs.
    pub host_us: f32,
}

/// A batch staged on the copy stream, waiting for its step.
#[derive(Debug, Clone, Copy)]
struct Staged {
    bucket: usize,
    slot: usize,
}

/// A launched step whose results are not read yet.
#[derive(Debug, Clone, Copy)]
struct InFlight {
    index: u64,
    ring: usize,
    host_us: f32,
}

/// A captured step. `CudaGraph` holds raw driver handles and so is not `Send`, but a graph exec may be launched
/// from any thread (cudarc binds the context on launch); the drafter owning it uses it from one thread at a time.
struct StepGraph(CudaGraph);

// SAFETY: see above; the graph is only reached through `&mut CudaDrafter` or its owner's thread.
unsafe impl Send for StepGraph {}

/// Pinned host staging for one input slot (write-combined: the host only writes it).
#[derive(Debug)]
struct PinnedInput {
    hs: PinnedHostSlice<f32>,
    input_ids: PinnedHostSlice<u32>,
    seq_lens: PinnedHostSlice<u32>,
    loss_mask: PinnedHostSlice<u8>,
}

/// The CUDA drafter on one device (see the module docs for the step pipeline).
pub struct CudaDrafter {
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    copy: Arc<CudaStream>,
    kernels: Launcher,
    gemm: Gemm,
    model: ModelPlan,
    offsets: ParamOffsets,
    loss: LossSpec,
    adamw: AdamWSpec,
    launch: LaunchMode,
    buckets: Vec<BucketPlan>,
    flat: FlatBuffers,
    act: Activations,
    inputs: [InputSlot; 2],
    pinned: [PinnedInput; 2],
    copied: [CudaEvent; 2],
    slot_free: [CudaEvent; 2],
    graphs: HashMap<(usize, usize), StepGraph>,
    readback: [PinnedHostSlice<f32>; 2],
    start: [CudaEvent; 2],
    stop: [CudaEvent; 2],
    done: [CudaEvent; 2],
    staged: Option<Staged>,
    next_slot: usize,
    in_flight: Option<InFlight>,
    launched: u64,
    applied_steps: u64,
    all_reduce: Option<GradientAllReduce>,
}

fn check_len(what: &'static str, got: usize, expected: usize) -> Result<(), CudaError> {
    if got == expected {
        Ok(())
    } else {
        Err(CudaError::LengthMismatch {
            what,
            got,
            expected,
        })
    }
}

impl CudaDrafter {
    /// A drafter on device `device_ordinal` for `model`, with workspaces for every bucket in `buckets`.
    /// Parameters start at zero: load them with [`CudaDrafter::upload_state`]. Mirrors
    /// [`CpuDrafter::new`](crate::cpu::CpuDrafter::new), plus the launch mode (graph per bucket or eager).
    pub fn new(
        device_ordinal: usize,
        model: &ModelPlan,
        loss: LossSpec,
        adamw: AdamWSpec,
        buckets: &[BucketPlan],
        launch: LaunchMode,
    ) -> Result<Self, CudaError> {
        let offsets = ParamOffsets::new(&model.spec, &model.layout)?;
        let ctx = open_device(device_ordinal)?;
        // SAFETY: every buffer below is used through raw addresses on `compute`/`copy`, ordered by our own
        // events; cudarc's per-slice events would otherwise be recorded inside stream capture.
        unsafe { ctx.disable_event_tracking() };
        let module = KernelModule::load(&ctx)?;
        let compute = ctx.new_stream()?;
        let copy = ctx.new_stream()?;
        let kernels = Launcher::new(&module, compute.clone())?;
        let gemm = Gemm::new(compute.clone())?;
        let spec = model.spec;
        let max_tokens = buckets.iter().map(|b| b.tokens).max().unwrap_or(0);
        let max_sequences = buckets.iter().map(|b| b.sequences).max().unwrap_or(0);
        let slot = || InputSlot::new(&compute, max_tokens, max_sequences, spec.din);
        let pinned = || -> Result<PinnedInput, CudaError> {
            // SAFETY: the pinned buffers are plain numbers, written by the host before each upload.
            unsafe {
                Ok(PinnedInput {
                    hs: ctx.alloc_pinned(max_tokens * spec.din)?,
                    input_ids: ctx.alloc_pinned(max_tokens)?,
                    seq_lens: ctx.alloc_pinned(max_sequences)?,
                    loss_mask: ctx.alloc_pinned(max_tokens)?,
                })
            }
        };
        // SAFETY: read-back buffers must be cached host memory (not write-combined): flags 0.
        let readback = || unsafe { ctx.alloc_pinned_with_flags::<f32>(3, 0) };
        let timing = || ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT));
        let plain = || ctx.new_event(None);
        let drafter = Self {
            flat: FlatBuffers::new(&compute, model.parameters)?,
            act: Activations::new(&compute, &spec, max_tokens, loss.chunk_tokens)?,
            inputs: [slot()?, slot()?],
            pinned: [pinned()?, pinned()?],
            copied: [plain()?, plain()?],
            slot_free: [plain()?, plain()?],
            readback: [readback()?, readback()?],
            start: [timing()?, timing()?],
            stop: [timing()?, timing()?],
            done: [plain()?, plain()?],
            graphs: HashMap::new(),
            ctx,
            compute,
            copy,
            kernels,
            gemm,
            model: model.clone(),
            offsets,
            loss,
            adamw,
            launch,
            buckets: buckets.to_vec(),
            staged: None,
            next_slot: 0,
            in_flight: None,
            launched: 0,
            applied_steps: 0,
            all_reduce: None,
        };
        drafter.compute.synchronize()?;
        Ok(drafter)
    }

    /// Copies `state`'s parameters, AdamW moments and step count to the device (waits for it: not a step-path
    /// call). Gradients are not copied: every step overwrites them.
    pub fn upload_state(&mut self, state: &FlatState) -> Result<(), CudaError> {
        let n = self.model.parameters;
        check_len("params", state.params.len(), n)?;
        check_len("exp_avg", state.exp_avg.len(), n)?;
        check_len("exp_avg_sq", state.exp_avg_sq.len(), n)?;
        self.compute.synchronize()?;
        // SAFETY: each destination holds `n` f32s; the copies are synchronous.
        unsafe {
            driver::memcpy_htod_sync(self.flat.params.ptr(), &state.params)?;
            driver::memcpy_htod_sync(self.flat.exp_avg.ptr(), &state.exp_avg)?;
            driver::memcpy_htod_sync(self.flat.exp_avg_sq.ptr(), &state.exp_avg_sq)?;
        }
        self.applied_steps = state.step;
        Ok(())
    }

    /// Copies parameters, gradients, AdamW moments and the applied step
    /// count into `state`. [`CudaError::StepInFlight`] until [`CudaDrafter::finish`] has collected the last
    /// step (whose outcome would otherwise be lost).
    pub fn download_state(&mut self, state: &mut FlatState) -> Result<(), CudaError> {
        if self.in_flight.is_some() {
            return Err(CudaError::StepInFlight);
        }
        let n = self.model.parameters;
        for (what, len) in [
            ("params", state.params.len()),
            ("grads", state.grads.len()),
            ("exp_avg", state.exp_avg.len()),
            ("exp_avg_sq", state.exp_avg_sq.len()),
        ] {
            check_len(what, len, n)?;
        }
        self.compute.synchronize()?;
        // SAFETY: each source holds `n` f32s; the copies are synchronous after the stream drained.
        unsafe {
            driver::memcpy_dtoh_sync(&mut state.params, self.flat.params.ptr())?;
            driver::memcpy_dtoh_sync(&mut state.grads, self.flat.grads.ptr())?;
            driver::memcpy_dtoh_sync(&mut state.exp_avg, self.flat.exp_avg.ptr())?;
            driver::memcpy_dtoh_sync(&mut state.exp_avg_sq, self.flat.exp_avg_sq.ptr())?;
        }
        state.step = self.applied_steps;
        Ok(())
    }

    /// Averages the gradients with the other replicas of `all_reduce`'s group every step (data parallelism).
    /// Must come before the first step, since graphs capture it; [`CudaError::LateAllReduce`] otherwise.
    ///
    /// # Examples
    /// ```no_run
    /// # use draftpipe_runtime::cuda::{CudaDrafter, CudaError, GradientAllReduce};
    /// # fn demo(mut drafters: Vec<CudaDrafter>) -> Result<(), CudaError> {
    /// let comms = GradientAllReduce::for_devices(&[0, 1])?;
    /// for (drafter, comm) in drafters.iter_mut().zip(comms) {
    ///     drafter.attach_all_reduce(comm)?;
    /// }
    /// # Ok(()) }
    /// ```
    pub fn attach_all_reduce(&mut self, all_reduce: GradientAllReduce) -> Result<(), CudaError> {
        if self.launched > 0 {
            return Err(CudaError::LateAllReduce);
        }
        self.all_reduce = Some(all_reduce);
        Ok(())
    }

    fn bucket_of(&self, batch: &HsBatch) -> Result<usize, CudaError> {
        self.buckets
            .iter()
            .position(|b| {
                b.padded_len == batch.padded_len
                    && b.sequences == batch.sequences
                    && batch.din == self.model.spec.din
            })
            .ok_or(CudaError::NoSuchBucket {
                padded_len: batch.padded_len,
                sequences: batch.sequences,
                din: batch.din,
            })
    }

    /// Copies `batch` into pinned memory and starts its upload on the copy stream, into the input slot the
    /// step before last used (waiting, if needed, until that step has consumed it).
    pub fn stage(&mut self, batch: &HsBatch) -> Result<(), CudaError> {
        let bucket = self.bucket_of(batch)?;
        let tokens = batch.tokens();
        check_len("hs", batch.hs.len(), tokens * batch.din)?;
        check_len("input_ids", batch.input_ids.len(), tokens)?;
        check_len("seq_lens", batch.seq_lens.len(), batch.sequences)?;
        check_len("loss_mask", batch.loss_mask.len(), tokens)?;
        let slot = self.next_slot;
        self.slot_free[slot].synchronize()?;
        let pinned = &mut self.pinned[slot];
        pinned.hs.as_mut_slice()?[..batch.hs.len()].copy_from_slice(&batch.hs);
        pinned.input_ids.as_mut_slice()?[..tokens].copy_from_slice(&batch.input_ids);
        pinned.seq_lens.as_mut_slice()?[..batch.sequences].copy_from_slice(&batch.seq_lens);
        pinned.loss_mask.as_mut_slice()?[..tokens].copy_from_slice(&batch.loss_mask);
        let (input, stream) = (&self.inputs[slot], self.copy.cu_stream());
        // SAFETY: sources are pinned and stay untouched until `slot_free[slot]` (recorded after the step that
        // reads this slot); destinations hold the bucket's largest shape.
        unsafe {
            driver::memcpy_htod_async(
                input.hs.ptr(),
                &pinned.hs.as_slice()?[..batch.hs.len()],
                stream,
            )?;
            driver::memcpy_htod_async(
                input.input_ids.ptr(),
                &pinned.input_ids.as_slice()?[..tokens],
                stream,
            )?;
            driver::memcpy_htod_async(
                input.seq_lens.ptr(),
                &pinned.seq_lens.as_slice()?[..batch.sequences],
                stream,
            )?;
            driver::memcpy_htod_async(
                input.loss_mask.ptr(),
                &pinned.loss_mask.as_slice()?[..tokens],
                stream,
            )?;
        }
        self.copied[slot].record(&self.copy)?;
        self.staged = Some(Staged { bucket, slot });
        self.next_slot = 1 - slot;
        Ok(())
    }

    fn step_plan(&self) -> StepPlan<'_> {
        StepPlan {
            spec: &self.model.spec,
            offsets: &self.offsets,
            loss: &self.loss,
            adamw: &self.adamw,
            kernels: &self.kernels,
            gemm: &self.gemm,
            flat: &self.flat,
            act: &self.act,
            all_reduce: self.all_reduce.as_ref(),
        }
    }

    /// Per-step AdamW scalars in `AdamWStep` order, assuming every launched step is applied (a skipped step,
    /// non-finite gradient norm, is only known one step later; the step after it then uses a bias correction one
    /// step ahead).
    fn adamw_scalars(&self) -> [f32; ADAMW_STEP_FLOATS] {
        let AdamWSpec {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            ..
        } = self.adamw;
        let step = (self.applied_steps + u64::from(self.in_flight.is_some()) + 1) as i32;
        let bias1 = 1.0 - f64::from(beta1).powi(step);
        let bias2 = 1.0 - f64::from(beta2).powi(step);
        [
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            (f64::from(lr) / bias1) as f32,
            bias2.sqrt() as f32,
        ]
    }

    /// Launches the step of the staged batch and returns the previous step's outcome, if there was one.
    pub fn step(&mut self) -> Result<Option<StepOutcome>, CudaError> {
        let begin = Instant::now();
        let Staged { bucket, slot } = self.staged.take().ok_or(CudaError::NothingStaged)?;
        let ring = (self.launched % 2) as usize;
        let compute = self.compute.clone();
        compute.wait(&self.copied[slot])?;
        let scalars = self.adamw_scalars();
        // SAFETY: `hyper` holds seven f32s; a pageable source is staged by the driver before this call returns.
        unsafe { driver::memcpy_htod_async(self.flat.hyper.ptr(), &scalars, compute.cu_stream()) }?;
        self.start[ring].record(&compute)?;
        let shape = StepShape {
            padded_len: self.buckets[bucket].padded_len,
            sequences: self.buckets[bucket].sequences,
        };
        match self.launch {
            LaunchMode::Eager => self.step_plan().enqueue(shape, &self.inputs[slot])?,
            LaunchMode::Graph => {
                if !self.graphs.contains_key(&(bucket, slot)) {
                    let graph = self.capture(shape, slot)?;
                    self.graphs.insert((bucket, slot), StepGraph(graph));
                }
                self.graphs[&(bucket, slot)].0.launch()?;
            }
        }
        self.stop[ring].record(&compute)?;
        self.slot_free[slot].record(&compute)?;
        let readback = &mut self.readback[ring];
        // SAFETY: `scalars` holds three f32s; the pinned destination is read only after `done[ring]`.
        unsafe {
            driver::memcpy_dtoh_async(
                readback.as_mut_slice()?,
                self.flat.scalars.ptr(),
                compute.cu_stream(),
            )
        }?;
        self.done[ring].record(&compute)?;
        let host_us = begin.elapsed().as_secs_f32() * 1e6;
        let previous = self.in_flight.replace(InFlight {
            index: self.launched,
            ring,
            host_us,
        });
        self.launched += 1;
        previous.map(|p| self.collect(p)).transpose()
    }

    /// Captures one step of `shape` reading input slot `slot` into a graph (first step of a bucket only).
    fn capture(&self, shape: StepShape, slot: usize) -> Result<CudaGraph, CudaError> {
        self.compute
            .begin_capture(CUstreamCaptureMode_enum::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let enqueued = self.step_plan().enqueue(shape, &self.inputs[slot]);
        let graph = self.compute.end_capture(CUgraphInstantiate_flags(0));
        enqueued?;
        let graph = graph?.ok_or(CudaError::EmptyCapture)?;
        graph.upload()?;
        Ok(graph)
    }

    /// Waits for a launched step and reads its scalars and device time.
    fn collect(&mut self, step: InFlight) -> Result<StepOutcome, CudaError> {
        self.done[step.ring].synchronize()?;
        let [grad_norm, _clip, loss] = <[f32; 3]>::try_from(self.readback[step.ring].as_slice()?)
            .map_err(|_| CudaError::LengthMismatch {
            what: "readback",
            got: 0,
            expected: 3,
        })?;
        if grad_norm.is_finite() {
            self.applied_steps += 1;
        }
        let device_ms = self.start[step.ring].elapsed_ms(&self.stop[step.ring])?;
        Ok(StepOutcome {
            index: step.index,
            loss,
            grad_norm,
            device_ms,
            host_us: step.host_us,
        })
    }

    /// Waits for the last launched step and returns its outcome.
    pub fn finish(&mut self) -> Result<Option<StepOutcome>, CudaError> {
        self.in_flight.take().map(|p| self.collect(p)).transpose()
    }

    /// The device context (for benchmarks that time other work on the same device).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}
