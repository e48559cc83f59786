//! One training step of the `mlp` drafter as a sequence of stream operations: cuBLAS GEMMs and our kernels on
//! the flat buffers. The same sequence runs eagerly or is captured once per bucket into a CUDA graph, so it must
//! not sync, allocate or read anything back: every size is a bucket constant, every scalar lives on the device.
//!
//! ```text
//!  forward  x₀ = hs·fcᵀ; per block: u = rmsnorm(x), [g|u'] = u·[gate;up]ᵀ, x += swiglu·downᵀ; z = rmsnorm(x)
//!  per head a = z·Wⱼᵀ, h = z + silu(a); per chunk: logits = h·lmᵀ → fused CE (grad in place) → dh, dlm
//!           da = dh·silu'(a), dz += dh + da·Wⱼ, dWⱼ = daᵀ·z
//!  backward final norm, then per block (reverse): down, SwiGLU, gate/up, norm
//!  sync     NCCL average of the flat gradient buffer over replicas (when attached)
//!  update   loss total; grad norm (two-pass) and clip scale; fused AdamW
//! ```

use cudarc::driver::result as driver;
use draftpipe_compiler::plan::{AdamWSpec, LossSpec, MlpSpec, TensorView};
use draftpipe_gpu_kernels::adamw::AdamWStep;

use super::blas::{Gemm, Op};
use cudarc::driver::sys::CUdeviceptr as DevicePtr;

use super::launch::{DevicePtr as Typed, Launcher};
use super::workspace::{Activations, FlatBuffers, InputSlot, NORM_ROWS_PER_CHUNK, REDUCE_CHUNK};
use super::{CudaError, GradientAllReduce};

/// RMSNorm epsilon of the model (issue 4).
pub const RMS_EPS: f32 = 1e-6;

/// Element offsets of one SwiGLU block's tensors in the flat buffer.
#[derive(Debug, Clone, Copy)]
struct BlockOffsets {
    norm: usize,
    /// `gate.weight` directly followed by `up.weight`: one `[2·inter, hidden]` matrix.
    gate_up: usize,
    down: usize,
}

/// Where each tensor lives in the flat buffer, checked against the shapes the step assumes.
#[derive(Debug, Clone)]
pub struct ParamOffsets {
    fc: usize,
    blocks: Vec<BlockOffsets>,
    norm: usize,
    heads: Vec<usize>,
    lm_head: usize,
}

impl ParamOffsets {
    /// Reads the offsets from the model's layout; [`CudaError::Layout`] when a tensor is missing, has another
    /// shape, or `gate`/`up` are not adjacent.
    pub fn new(spec: &MlpSpec, layout: &[TensorView]) -> Result<Self, CudaError> {
        let find = |name: String, shape: &[usize]| -> Result<usize, CudaError> {
            match layout.iter().find(|v| v.name == name) {
                Some(v) if v.shape == shape => Ok(v.offset),
                _ => Err(CudaError::Layout(name)),
            }
        };
        let MlpSpec {
            din,
            hidden: h,
            blocks,
            intermediate: i,
            heads,
            vocab,
        } = *spec;
        let blocks = (0..blocks)
            .map(|b| {
                let gate_up = find(format!("blocks.{b}.gate.weight"), &[i, h])?;
                if find(format!("blocks.{b}.up.weight"), &[i, h])? != gate_up + i * h {
                    return Err(CudaError::Layout(format!(
                        "blocks.{b}.up.weight (must follow gate.weight)"
                    )));
                }
                Ok(BlockOffsets {
                    norm: find(format!("blocks.{b}.norm.weight"), &[h])?,
                    gate_up,
                    down: find(format!("blocks.{b}.down.weight"), &[h, i])?,
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            fc: find("fc.weight".into(), &[h, din])?,
            blocks,
            norm: find("norm.weight".into(), &[h])?,
            heads: (0..heads)
                .map(|j| find(format!("heads.{j}.weight"), &[h, h]))
                .collect::<Result<_, _>>()?,
            lm_head: find("lm_head.weight".into(), &[vocab, h])?,
        })
    }
}

/// Everything one step reads: the model, its buffers and the launchers.
pub struct StepPlan<'a> {
    /// Model dimensions.
    pub spec: &'a MlpSpec,
    /// Flat-buffer offsets.
    pub offsets: &'a ParamOffsets,
    /// Loss settings.
    pub loss: &'a LossSpec,
    /// Optimizer settings (only the clip norm is read here; the per-step scalars are on the device).
    pub adamw: &'a AdamWSpec,
    /// Kernel launchers (their stream is the step's stream).
    pub kernels: &'a Launcher,
    /// cuBLAS on the same stream.
    pub gemm: &'a Gemm,
    /// Flat buffers.
    pub flat: &'a FlatBuffers,
    /// Activations and scratch.
    pub act: &'a Activations,
    /// Gradient average over replicas, between backward and the optimizer (none with one replica).
    pub all_reduce: Option<&'a GradientAllReduce>,
}

/// Shape of the step: tokens and how they split into sequences.
#[derive(Debug, Clone, Copy)]
pub struct StepShape {
    /// Padded sequence length of the bucket.
    pub padded_len: usize,
    /// Sequences per batch.
    pub sequences: usize,
}

const F32: usize = std::mem::size_of::<f32>();

impl StepPlan<'_> {
    /// Enqueues one whole training step on the launchers' stream, reading the batch in `input`.
    pub fn enqueue(&self, shape: StepShape, input: &InputSlot) -> Result<(), CudaError> {
        let tokens = shape.padded_len * shape.sequences;
        self.forward(tokens, input)?;
        // The residual-stream gradient and the heads' contributions to dz start from zero every step.
        let stream = self.kernels.stream().cu_stream();
        // SAFETY: `dz` holds at least `tokens · hidden` f32s; the memset is ordered on the step's stream.
        unsafe {
            driver::memset_d8_async(
                self.act.dz.ptr(),
                0,
                tokens * self.spec.hidden * F32,
                stream,
            )
        }?;
        self.loss_and_heads(shape, input)?;
        self.backward(tokens, input)?;
        if let Some(all_reduce) = self.all_reduce {
            // SAFETY: `grads` holds every parameter's gradient; every replica enqueues the same step.
            unsafe {
                all_reduce.enqueue_average(self.flat.grads.ptr(), self.flat.grads.len(), stream)
            }?;
        }
        self.optimizer()
    }

    fn param(&self, at: usize) -> DevicePtr {
        self.flat.params.at(at)
    }

    fn grad(&self, at: usize) -> DevicePtr {
        self.flat.grads.at(at)
    }

    /// The parameters from `at` on, as a kernel argument.
    fn param_arg(&self, at: usize) -> Typed<f32> {
        self.flat.params.dev_at(at)
    }

    /// Row-major GEMM on the step's handle.
    #[allow(clippy::too_many_arguments)]
    fn mm(
        &self,
        a: (Op, DevicePtr),
        b: (Op, DevicePtr),
        c: DevicePtr,
        mnk: (usize, usize, usize),
        beta: f32,
    ) -> Result<(), CudaError> {
        // SAFETY: every call below passes buffers allocated for the bucket's largest shape (workspace.rs) and
        // parameter offsets checked against the layout (ParamOffsets::new).
        unsafe { self.gemm.row_major(a, b, c, mnk, 1.0, beta) }
    }

    fn forward(&self, t: usize, input: &InputSlot) -> Result<(), CudaError> {
        let MlpSpec {
            din,
            hidden: h,
            intermediate: i,
            ..
        } = *self.spec;
        let a = self.act;
        self.mm(
            (Op::N, input.hs.ptr()),
            (Op::T, self.param(self.offsets.fc)),
            a.xs.ptr(),
            (t, h, din),
            0.0,
        )?;
        for (b, block) in self.offsets.blocks.iter().enumerate() {
            let x = a.xs.at(b * t * h);
            let next = a.xs.at((b + 1) * t * h);
            let u = a.us.at(b * t * h);
            let gate_up = a.gate_up.at(b * t * 2 * i);
            let act = a.act.at(b * t * i);
            let k = self.kernels;
            k.rmsnorm_forward(
                a.xs.dev_at(b * t * h),
                self.param_arg(block.norm),
                a.us.dev_at(b * t * h),
                a.inv_rms.dev_at(b * t),
                h,
                RMS_EPS,
                t,
            )?;
            self.mm(
                (Op::N, u),
                (Op::T, self.param(block.gate_up)),
                gate_up,
                (t, 2 * i, h),
                0.0,
            )?;
            k.swiglu_forward(
                a.gate_up.dev_at(b * t * 2 * i),
                a.act.dev_at(b * t * i),
                i,
                t * i,
            )?;
            // x_{b+1} = x_b + act · downᵀ: copy the residual, then accumulate the product into it.
            // SAFETY: both ranges lie inside `xs` and do not overlap.
            unsafe { driver::memcpy_dtod_async(next, x, t * h * F32, k.stream().cu_stream()) }?;
            self.mm(
                (Op::N, act),
                (Op::T, self.param(block.down)),
                next,
                (t, h, i),
                1.0,
            )?;
        }
        let blocks = self.offsets.blocks.len();
        self.kernels.rmsnorm_forward(
            a.xs.dev_at(blocks * t * h),
            self.param_arg(self.offsets.norm),
            a.z.dev(),
            a.inv_rms.dev_at(blocks * t),
            h,
            RMS_EPS,
            t,
        )
    }

    /// Heads, fused loss and the heads' backward, one head at a time (one head's activations live at once).
    fn loss_and_heads(&self, shape: StepShape, input: &InputSlot) -> Result<(), CudaError> {
        let MlpSpec {
            hidden: h,
            heads,
            vocab: v,
            ..
        } = *self.spec;
        let t = shape.padded_len * shape.sequences;
        let (a, k) = (self.act, self.kernels);
        k.build_labels(
            input.input_ids.dev(),
            input.loss_mask.dev(),
            input.seq_lens.dev(),
            a.labels.dev(),
            shape.padded_len,
            t,
            v,
            heads,
        )?;
        k.head_loss_scales(
            a.labels.dev(),
            a.counts.dev(),
            a.scales.dev(),
            t,
            heads,
            self.loss.head_decay,
        )?;
        let chunk = self.loss.chunk_tokens.clamp(1, t);
        let lm = self.param(self.offsets.lm_head);
        let dlm = self.grad(self.offsets.lm_head);
        for (j, &w) in self.offsets.heads.iter().enumerate() {
            self.mm(
                (Op::N, a.z.ptr()),
                (Op::T, self.param(w)),
                a.head_a.ptr(),
                (t, h, h),
                0.0,
            )?;
            k.head_residual_forward(a.z.dev(), a.head_a.dev(), a.head_h.dev(), t * h)?;
            for start in (0..t).step_by(chunk) {
                let rows = chunk.min(t - start);
                let h_rows = a.head_h.at(start * h);
                self.mm(
                    (Op::N, h_rows),
                    (Op::T, lm),
                    a.logits.ptr(),
                    (rows, v, h),
                    0.0,
                )?;
                let row = j * t + start;
                k.vocab_loss_row(
                    a.labels.dev_at(row),
                    a.scales.dev_at(j),
                    a.logits.dev(),
                    a.row_loss.dev_at(row),
                    v,
                    rows,
                )?;
                self.mm(
                    (Op::N, a.logits.ptr()),
                    (Op::N, lm),
                    a.head_dh.at(start * h),
                    (rows, h, v),
                    0.0,
                )?;
                let beta = if j == 0 && start == 0 { 0.0 } else { 1.0 };
                self.mm(
                    (Op::T, a.logits.ptr()),
                    (Op::N, h_rows),
                    dlm,
                    (v, h, rows),
                    beta,
                )?;
            }
            // In place: head_dh becomes da; dz collects dh (identity path) here and da·Wⱼ just below.
            k.head_residual_backward(
                a.head_a.dev(),
                a.head_dh.dev(),
                a.head_dh.dev(),
                a.dz.dev(),
                t * h,
            )?;
            self.mm(
                (Op::N, a.head_dh.ptr()),
                (Op::N, self.param(w)),
                a.dz.ptr(),
                (t, h, h),
                1.0,
            )?;
            self.mm(
                (Op::T, a.head_dh.ptr()),
                (Op::N, a.z.ptr()),
                self.grad(w),
                (h, h, t),
                0.0,
            )?;
        }
        k.sum_partials(
            a.row_loss.dev(),
            a.loss_partials.dev(),
            heads * t,
            REDUCE_CHUNK,
        )?;
        k.finish_sum(
            a.loss_partials.dev(),
            self.flat.scalars.dev_at(2),
            (heads * t).div_ceil(REDUCE_CHUNK),
        )
    }

    /// `dx (+)= rmsnorm'(x; dy)` and the norm weight's gradient.
    fn norm_backward(
        &self,
        (x, inv_rms, dy): (Typed<f32>, Typed<f32>, Typed<f32>),
        weight: usize,
        t: usize,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        let (a, k, h) = (self.act, self.kernels, self.spec.hidden);
        k.rmsnorm_backward_input(
            x,
            self.param_arg(weight),
            inv_rms,
            dy,
            a.dx.dev(),
            h,
            u32::from(accumulate),
            t,
        )?;
        k.rmsnorm_weight_grad_partials(
            x,
            inv_rms,
            dy,
            a.norm_partials.dev(),
            t,
            h,
            NORM_ROWS_PER_CHUNK,
        )?;
        k.column_sums(
            a.norm_partials.dev(),
            self.flat.grads.dev_at(weight),
            t.div_ceil(NORM_ROWS_PER_CHUNK),
            h,
            0,
        )
    }

    fn backward(&self, t: usize, input: &InputSlot) -> Result<(), CudaError> {
        let MlpSpec {
            din,
            hidden: h,
            intermediate: i,
            ..
        } = *self.spec;
        let a = self.act;
        let blocks = self.offsets.blocks.len();
        let last = (
            a.xs.dev_at(blocks * t * h),
            a.inv_rms.dev_at(blocks * t),
            a.dz.dev(),
        );
        self.norm_backward(last, self.offsets.norm, t, false)?;
        for (b, block) in self.offsets.blocks.iter().enumerate().rev() {
            let act = a.act.at(b * t * i);
            let u = a.us.at(b * t * h);
            self.mm(
                (Op::N, a.dx.ptr()),
                (Op::N, self.param(block.down)),
                a.dact.ptr(),
                (t, i, h),
                0.0,
            )?;
            self.mm(
                (Op::T, a.dx.ptr()),
                (Op::N, act),
                self.grad(block.down),
                (h, i, t),
                0.0,
            )?;
            self.kernels.swiglu_backward(
                a.gate_up.dev_at(b * t * 2 * i),
                a.dact.dev(),
                a.dgate_up.dev(),
                i,
                t * i,
            )?;
            self.mm(
                (Op::N, a.dgate_up.ptr()),
                (Op::N, self.param(block.gate_up)),
                a.du.ptr(),
                (t, h, 2 * i),
                0.0,
            )?;
            self.mm(
                (Op::T, a.dgate_up.ptr()),
                (Op::N, u),
                self.grad(block.gate_up),
                (2 * i, h, t),
                0.0,
            )?;
            let norm_in = (a.xs.dev_at(b * t * h), a.inv_rms.dev_at(b * t), a.du.dev());
            self.norm_backward(norm_in, block.norm, t, true)?;
        }
        self.mm(
            (Op::T, a.dx.ptr()),
            (Op::N, input.hs.ptr()),
            self.grad(self.offsets.fc),
            (h, din, t),
            0.0,
        )
    }

    fn optimizer(&self) -> Result<(), CudaError> {
        let (f, k) = (self.flat, self.kernels);
        let n = f.params.len();
        k.sum_squares_partials(f.grads.dev(), f.norm_partials.dev(), n, REDUCE_CHUNK)?;
        let max_norm = self.adamw.clip_grad_norm.unwrap_or(0.0);
        k.finish_grad_norm(
            f.norm_partials.dev(),
            f.scalars.dev_at(0),
            f.scalars.dev_at(1),
            n.div_ceil(REDUCE_CHUNK),
            max_norm,
        )?;
        // SAFETY: `hyper` holds one `AdamWStep` (seven f32s, `repr(C)`), written by the drafter each step.
        let hyper = unsafe { f.hyper.dev().cast::<AdamWStep>() };
        k.adamw_update(
            f.grads.dev(),
            f.scalars.dev_at(0),
            f.scalars.dev_at(1),
            hyper,
            f.params.dev(),
            f.exp_avg.dev(),
            f.exp_avg_sq.dev(),
            n,
        )
    }
}
