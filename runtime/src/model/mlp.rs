//! The `mlp` drafter's training step, written once over [`Backend`]: forward, fused vocabulary loss, backward
//! and the AdamW update, on the flat state buffers and the workspace the compiler's layout describes.
//!
//! ```text
//!  forward   x₀ = hs·fcᵀ; per block: u = rmsnorm(x), [g|u'] = u·[gate;up]ᵀ, x' = x + swiglu·downᵀ; z = rmsnorm(x)
//!  loss      per head (one at a time): a = z·Wⱼᵀ, h = z + silu(a); per chunk of C tokens: logits = h·lmᵀ
//!            → fused CE (gradient in place) → dh, dlm; then da = dh·silu'(a), dz += dh + da·Wⱼ, dWⱼ = daᵀ·z
//!  backward  final norm, then per block (reverse): down, SwiGLU, gate/up, norm; dfc = dxᵀ·hs
//!  update    grad norm (two passes) and clip scale → AdamW step state advanced on the device → fused AdamW
//! ```
//!
//! Nothing here reads back or allocates: every size is the bucket's, every scalar (loss, norm, AdamW's step
//! count and bias corrections) lives in a device buffer, so the CUDA backend can capture each part as a graph.

use std::time::Instant;

use draftpipe_compiler::plan::{
    AdamWSpec, LossSpec, MlpSpec, ModelPlan, TensorView, WorkspaceLayout,
};

use crate::backend::{
    AdamWHyper, Backend, BackendResult, Buf, Element, InputSlot, Operand, Precision,
};
use crate::cpu::PhaseTimes;

/// RMSNorm epsilon of the model (inside the square root: `x / sqrt(mean(x²) + eps)`).
pub const RMS_EPS: f32 = 1e-6;

/// Element offsets of one SwiGLU block's tensors in the flat buffers.
#[derive(Debug, Clone, Copy)]
struct BlockOffsets {
    norm: usize,
    /// `gate.weight` directly followed by `up.weight`: one `[2I, H]` matrix.
    gate_up: usize,
    down: usize,
}

/// Where each tensor lives in the flat buffers, checked against the shapes the step assumes.
#[derive(Debug, Clone)]
pub struct MlpOffsets {
    fc: usize,
    blocks: Vec<BlockOffsets>,
    norm: usize,
    heads: Vec<usize>,
    lm_head: usize,
}

/// The model plan cannot be trained by this step.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// A tensor is missing, has another shape, or `up` does not follow `gate`.
    #[error("model layout: tensor {0} missing or mis-shaped")]
    Tensor(String),
    /// A dimension is zero.
    #[error("model layout: a dimension is zero")]
    EmptyDimension,
    /// The parameter count differs from the layout's.
    #[error("model has {got} parameters, its layout {expected}")]
    Parameters {
        /// From the layout.
        expected: usize,
        /// From the plan.
        got: usize,
    },
}

impl MlpOffsets {
    /// Reads the offsets from the model's layout.
    ///
    /// # Errors
    /// [`LayoutError`] when a tensor is missing or mis-shaped, `gate` and `up` are not adjacent (the fused
    /// `[gate | up]` product relies on it), or a dimension is zero.
    pub fn new(model: &ModelPlan) -> Result<Self, LayoutError> {
        let spec = &model.spec;
        let layout: &[TensorView] = &model.layout;
        let find = |name: String, shape: &[usize]| -> Result<usize, LayoutError> {
            match layout.iter().find(|v| v.name == name) {
                Some(v) if v.shape == shape => Ok(v.offset),
                _ => Err(LayoutError::Tensor(name)),
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
        if [din, h, i, heads, vocab].contains(&0) {
            return Err(LayoutError::EmptyDimension);
        }
        let expected: usize = layout.iter().map(TensorView::len).sum();
        if model.parameters != expected || layout.iter().any(|v| v.range().end > expected) {
            return Err(LayoutError::Parameters {
                expected,
                got: model.parameters,
            });
        }
        let blocks = (0..blocks)
            .map(|b| {
                let gate_up = find(format!("blocks.{b}.gate.weight"), &[i, h])?;
                if find(format!("blocks.{b}.up.weight"), &[i, h])? != gate_up + i * h {
                    return Err(LayoutError::Tensor(format!(
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

/// Parameters, gradients and AdamW moments, each one flat buffer in the model's layout order.
pub struct FlatBuffers<B: Backend> {
    /// Parameters.
    pub params: Buf<B, f32>,
    /// Gradients of the last step (overwritten each step).
    pub grads: Buf<B, f32>,
    /// AdamW first moments.
    pub exp_avg: Buf<B, f32>,
    /// AdamW second moments.
    pub exp_avg_sq: Buf<B, f32>,
}

/// Every buffer of [`WorkspaceLayout::mlp`], allocated by name.
pub struct MlpWorkspace<B: Backend> {
    /// Residual stream before each block and after the last, `L + 1` buffers of `[T, H]`.
    pub xs: Vec<Buf<B, f32>>,
    pub(crate) normed: Buf<B, f32>,
    pub(crate) inv_rms: Buf<B, f32>,
    pub(crate) gate_up: Buf<B, f32>,
    pub(crate) act: Buf<B, f32>,
    pub(crate) z: Buf<B, f32>,
    pub(crate) head_a: Buf<B, f32>,
    pub(crate) head_h: Buf<B, f32>,
    pub(crate) head_dh: Buf<B, f32>,
    pub(crate) head_da: Buf<B, f32>,
    pub(crate) logits: Buf<B, f32>,
    pub(crate) labels: Buf<B, i32>,
    /// Valid labels per head of the last step.
    pub counts: Buf<B, u32>,
    pub(crate) scales: Buf<B, f32>,
    pub(crate) row_loss: Buf<B, f32>,
    pub(crate) loss_partials: Buf<B, f32>,
    pub(crate) dz: Buf<B, f32>,
    pub(crate) dx: Buf<B, f32>,
    pub(crate) dnormed: Buf<B, f32>,
    pub(crate) dact: Buf<B, f32>,
    pub(crate) dgate_up: Buf<B, f32>,
    pub(crate) norm_partials: Buf<B, f32>,
    pub(crate) grad_norm_partials: Buf<B, f32>,
    /// `[grad_norm, clip_scale, loss]` of the last step.
    pub step_scalars: Buf<B, f32>,
    pub(crate) adamw_step: Buf<B, f32>,
    /// `[steps applied, β1^steps, β2^steps]`.
    pub adamw_state: Buf<B, f64>,
    /// The input slots.
    pub inputs: Vec<InputSlot<B>>,
}

/// The workspace layout lacks a buffer the step uses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("workspace layout has no buffer `{0}`")]
pub struct MissingBuffer(pub String);

impl<B: Backend> MlpWorkspace<B> {
    /// Allocates every buffer `layout` lists for this backend's step (the layout's backend-specific entries,
    /// cuBLAS's workspace or the CPU's rounding buffers, are the backend's own).
    pub fn allocate(backend: &mut B, layout: &WorkspaceLayout) -> Result<Self, AllocateError> {
        fn take<B: Backend, T: Element>(
            backend: &mut B,
            layout: &WorkspaceLayout,
            name: &str,
        ) -> Result<Buf<B, T>, AllocateError> {
            let len = layout
                .elements(name)
                .ok_or_else(|| MissingBuffer(name.to_owned()))?;
            Ok(backend.alloc(len)?)
        }
        let mut xs = Vec::new();
        while layout.elements(&format!("xs.{}", xs.len())).is_some() {
            xs.push(take(backend, layout, &format!("xs.{}", xs.len()))?);
        }
        let inputs = (0..layout.input_slots)
            .map(|slot| {
                Ok(InputSlot {
                    hs: take(backend, layout, &format!("input{slot}.hs"))?,
                    input_ids: take(backend, layout, &format!("input{slot}.input_ids"))?,
                    seq_lens: take(backend, layout, &format!("input{slot}.seq_lens"))?,
                    loss_mask: take(backend, layout, &format!("input{slot}.loss_mask"))?,
                })
            })
            .collect::<Result<_, AllocateError>>()?;
        Ok(Self {
            xs,
            normed: take(backend, layout, "normed")?,
            inv_rms: take(backend, layout, "inv_rms")?,
            gate_up: take(backend, layout, "gate_up")?,
            act: take(backend, layout, "act")?,
            z: take(backend, layout, "z")?,
            head_a: take(backend, layout, "head_a")?,
            head_h: take(backend, layout, "head_h")?,
            head_dh: take(backend, layout, "head_dh")?,
            head_da: take(backend, layout, "head_da")?,
            logits: take(backend, layout, "logits")?,
            labels: take(backend, layout, "labels")?,
            counts: take(backend, layout, "counts")?,
            scales: take(backend, layout, "scales")?,
            row_loss: take(backend, layout, "row_loss")?,
            loss_partials: take(backend, layout, "loss_partials")?,
            dz: take(backend, layout, "dz")?,
            dx: take(backend, layout, "dx")?,
            dnormed: take(backend, layout, "dnormed")?,
            dact: take(backend, layout, "dact")?,
            dgate_up: take(backend, layout, "dgate_up")?,
            norm_partials: take(backend, layout, "norm_partials")?,
            grad_norm_partials: take(backend, layout, "grad_norm_partials")?,
            step_scalars: take(backend, layout, "step_scalars")?,
            adamw_step: take(backend, layout, "adamw_step")?,
            adamw_state: take(backend, layout, "adamw_state")?,
            inputs,
        })
    }
}

/// Why a model's buffers could not be allocated.
#[derive(Debug, thiserror::Error)]
pub enum AllocateError {
    /// The layout lacks a buffer.
    #[error(transparent)]
    Missing(#[from] MissingBuffer),
    /// The backend failed.
    #[error(transparent)]
    Backend(#[from] crate::backend::BackendError),
}

/// Tokens and sequences of one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepShape {
    /// Padded length of every sequence.
    pub padded_len: usize,
    /// Sequences.
    pub sequences: usize,
}

impl StepShape {
    /// Tokens of the step.
    pub fn tokens(&self) -> usize {
        self.padded_len * self.sequences
    }
}

/// The `mlp` drafter on one backend: its settings, state buffers and workspace.
pub struct Mlp<B: Backend> {
    spec: MlpSpec,
    offsets: MlpOffsets,
    loss: LossSpec,
    optimizer: AdamWSpec,
    precision: Precision,
    chunk_rows: usize,
    /// The flat state.
    pub state: FlatBuffers<B>,
    /// The workspace.
    pub ws: MlpWorkspace<B>,
}

impl<B: Backend> Mlp<B> {
    /// The model of `plan` on `backend`, state zeroed, workspace allocated from `layout`.
    ///
    /// # Errors
    /// When the layout lacks a buffer or the backend cannot allocate.
    pub fn new(
        backend: &mut B,
        (model, offsets): (&ModelPlan, MlpOffsets),
        loss: LossSpec,
        optimizer: AdamWSpec,
        precision: Precision,
        layout: &WorkspaceLayout,
    ) -> Result<Self, AllocateError> {
        let p = model.parameters;
        let state = FlatBuffers {
            params: backend.alloc(p)?,
            grads: backend.alloc(p)?,
            exp_avg: backend.alloc(p)?,
            exp_avg_sq: backend.alloc(p)?,
        };
        Ok(Self {
            spec: model.spec,
            offsets,
            loss,
            optimizer,
            precision,
            chunk_rows: layout.chunk_rows,
            state,
            ws: MlpWorkspace::allocate(backend, layout)?,
        })
    }

    /// The model's dimensions.
    pub fn spec(&self) -> &MlpSpec {
        &self.spec
    }

    /// Forward, fused loss and backward of the batch in input slot `slot`: overwrites every gradient and
    /// writes the loss into `step_scalars[2]`. Returns the host time of each phase (what the CPU spends; on
    /// CUDA only the enqueueing).
    pub fn forward_backward(
        &mut self,
        be: &mut B,
        shape: StepShape,
        slot: usize,
    ) -> BackendResult<PhaseTimes> {
        let started = Instant::now();
        self.forward(be, shape, slot)?;
        let forward_done = Instant::now();
        self.loss_and_heads(be, shape, slot)?;
        let loss_done = Instant::now();
        self.backward(be, shape, slot)?;
        Ok(PhaseTimes {
            forward: forward_done - started,
            loss: loss_done - forward_done,
            backward: loss_done.elapsed(),
        })
    }

    fn forward(&mut self, be: &mut B, shape: StepShape, slot: usize) -> BackendResult {
        let MlpSpec {
            din,
            hidden: h,
            intermediate: i,
            ..
        } = self.spec;
        let (t, p, at) = (shape.tokens(), self.precision, &self.offsets);
        let (ws, params) = (&mut self.ws, &self.state.params);
        let th = t * h;
        let input = &ws.inputs[slot];
        be.gemm(
            ws.xs[0].at_mut(0, th),
            Operand::new(input.hs.at(0, t * din), t, din),
            Operand::new(params.at(at.fc, h * din), h, din).t(),
            1.0,
            0.0,
            p,
        )?;
        for (b, w) in at.blocks.iter().enumerate() {
            let (done, rest) = ws.xs.split_at_mut(b + 1);
            let (x, next) = (&done[b], &mut rest[0]);
            be.rmsnorm_forward(
                x.at(0, th),
                params.at(w.norm, h),
                ws.normed.at_mut(b * th, th),
                ws.inv_rms.at_mut(b * t, t),
                RMS_EPS,
            )?;
            be.gemm(
                ws.gate_up.at_mut(b * t * 2 * i, t * 2 * i),
                Operand::new(ws.normed.at(b * th, th), t, h),
                Operand::new(params.at(w.gate_up, 2 * i * h), 2 * i, h).t(),
                1.0,
                0.0,
                p,
            )?;
            be.swiglu_forward(
                ws.gate_up.at(b * t * 2 * i, t * 2 * i),
                ws.act.at_mut(b * t * i, t * i),
                i,
            )?;
            // x_{b+1} = x_b + act · downᵀ: copy the residual, then accumulate the product into it.
            be.copy(next.at_mut(0, th), x.at(0, th))?;
            be.gemm(
                next.at_mut(0, th),
                Operand::new(ws.act.at(b * t * i, t * i), t, i),
                Operand::new(params.at(w.down, h * i), h, i).t(),
                1.0,
                1.0,
                p,
            )?;
        }
        let blocks = at.blocks.len();
        be.rmsnorm_forward(
            ws.xs[blocks].at(0, th),
            params.at(at.norm, h),
            ws.z.at_mut(0, th),
            ws.inv_rms.at_mut(blocks * t, t),
            RMS_EPS,
        )
    }

    /// Heads, fused loss and the heads' backward, one head at a time (one head's activations live at once).
    fn loss_and_heads(&mut self, be: &mut B, shape: StepShape, slot: usize) -> BackendResult {
        let MlpSpec {
            hidden: h,
            heads,
            vocab: v,
            ..
        } = self.spec;
        let (t, p, at) = (shape.tokens(), self.precision, &self.offsets);
        let th = t * h;
        let (ws, state) = (&mut self.ws, &mut self.state);
        let input = &ws.inputs[slot];
        be.build_labels(
            input.input_ids.at(0, t),
            input.loss_mask.at(0, t),
            input.seq_lens.at(0, shape.sequences),
            ws.labels.at_mut(0, heads * t),
            shape.padded_len,
            v,
        )?;
        be.head_loss_scales(
            ws.labels.at(0, heads * t),
            self.loss.head_decay,
            ws.counts.all_mut(),
            ws.scales.all_mut(),
        )?;
        be.fill(ws.dz.at_mut(0, th), 0.0)?;
        let chunk = self.chunk_rows.min(t);
        let lm = Operand::new(state.params.at(at.lm_head, v * h), v, h);
        for (j, &w) in at.heads.iter().enumerate() {
            let w_j = Operand::new(state.params.at(w, h * h), h, h);
            let z = Operand::new(ws.z.at(0, th), t, h);
            be.gemm(ws.head_a.at_mut(0, th), z, w_j.t(), 1.0, 0.0, p)?;
            be.head_residual_forward(ws.z.at(0, th), ws.head_a.at(0, th), ws.head_h.at_mut(0, th))?;
            for start in (0..t).step_by(chunk.max(1)) {
                let rows = chunk.min(t - start);
                let h_rows = Operand::new(ws.head_h.at(start * h, rows * h), rows, h);
                be.gemm(ws.logits.at_mut(0, rows * v), h_rows, lm.t(), 1.0, 0.0, p)?;
                be.vocab_loss(
                    ws.logits.at_mut(0, rows * v),
                    ws.labels.at(j * t + start, rows),
                    ws.scales.at(j, 1),
                    ws.row_loss.at_mut(j * t + start, rows),
                    v,
                )?;
                let dlogits = Operand::new(ws.logits.at(0, rows * v), rows, v);
                be.gemm(
                    ws.head_dh.at_mut(start * h, rows * h),
                    dlogits,
                    lm,
                    1.0,
                    0.0,
                    p,
                )?;
                let beta = if j == 0 && start == 0 { 0.0 } else { 1.0 };
                be.gemm(
                    state.grads.at_mut(at.lm_head, v * h),
                    dlogits.t(),
                    h_rows,
                    1.0,
                    beta,
                    p,
                )?;
            }
            be.head_residual_backward(
                ws.head_a.at(0, th),
                ws.head_dh.at(0, th),
                ws.head_da.at_mut(0, th),
                ws.dz.at_mut(0, th),
            )?;
            let da = Operand::new(ws.head_da.at(0, th), t, h);
            be.gemm(ws.dz.at_mut(0, th), da, w_j, 1.0, 1.0, p)?;
            be.gemm(state.grads.at_mut(w, h * h), da.t(), z, 1.0, 0.0, p)?;
        }
        be.sum(
            ws.row_loss.at(0, heads * t),
            ws.loss_partials.all_mut(),
            ws.step_scalars.at_mut(2, 1),
        )
    }

    fn backward(&mut self, be: &mut B, shape: StepShape, slot: usize) -> BackendResult {
        let MlpSpec {
            din,
            hidden: h,
            intermediate: i,
            ..
        } = self.spec;
        let (t, p, at) = (shape.tokens(), self.precision, &self.offsets);
        let th = t * h;
        let (ws, state) = (&mut self.ws, &mut self.state);
        let blocks = at.blocks.len();
        let x_last = ws.xs[blocks].at(0, th);
        let inv_rms_last = ws.inv_rms.at(blocks * t, t);
        be.rmsnorm_backward_input(
            x_last,
            state.params.at(at.norm, h),
            inv_rms_last,
            ws.dz.at(0, th),
            ws.dx.at_mut(0, th),
            false,
        )?;
        be.rmsnorm_weight_grad(
            x_last,
            inv_rms_last,
            ws.dz.at(0, th),
            state.grads.at_mut(at.norm, h),
            ws.norm_partials.all_mut(),
        )?;
        for (b, w) in at.blocks.iter().enumerate().rev() {
            let dx = Operand::new(ws.dx.at(0, th), t, h);
            be.gemm(
                state.grads.at_mut(w.down, h * i),
                dx.t(),
                Operand::new(ws.act.at(b * t * i, t * i), t, i),
                1.0,
                0.0,
                p,
            )?;
            be.gemm(
                ws.dact.at_mut(0, t * i),
                dx,
                Operand::new(state.params.at(w.down, h * i), h, i),
                1.0,
                0.0,
                p,
            )?;
            be.swiglu_backward(
                ws.gate_up.at(b * t * 2 * i, t * 2 * i),
                ws.dact.at(0, t * i),
                ws.dgate_up.at_mut(0, t * 2 * i),
                i,
            )?;
            let dgu = Operand::new(ws.dgate_up.at(0, t * 2 * i), t, 2 * i);
            be.gemm(
                state.grads.at_mut(w.gate_up, 2 * i * h),
                dgu.t(),
                Operand::new(ws.normed.at(b * th, th), t, h),
                1.0,
                0.0,
                p,
            )?;
            be.gemm(
                ws.dnormed.at_mut(0, th),
                dgu,
                Operand::new(state.params.at(w.gate_up, 2 * i * h), 2 * i, h),
                1.0,
                0.0,
                p,
            )?;
            be.rmsnorm_weight_grad(
                ws.xs[b].at(0, th),
                ws.inv_rms.at(b * t, t),
                ws.dnormed.at(0, th),
                state.grads.at_mut(w.norm, h),
                ws.norm_partials.all_mut(),
            )?;
            be.rmsnorm_backward_input(
                ws.xs[b].at(0, th),
                state.params.at(w.norm, h),
                ws.inv_rms.at(b * t, t),
                ws.dnormed.at(0, th),
                ws.dx.at_mut(0, th),
                true,
            )?;
        }
        be.gemm(
            state.grads.at_mut(at.fc, h * din),
            Operand::new(ws.dx.at(0, th), t, h).t(),
            Operand::new(ws.inputs[slot].hs.at(0, t * din), t, din),
            1.0,
            0.0,
            p,
        )
    }

    /// Gradient norm and clip scale into `step_scalars[0..2]`, AdamW's step state advanced on the device, and
    /// one fused AdamW pass; a non-finite norm skips the update and leaves the step count alone.
    pub fn update(&mut self, be: &mut B) -> BackendResult {
        let AdamWSpec {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            clip_grad_norm,
        } = self.optimizer;
        let (ws, state) = (&mut self.ws, &mut self.state);
        be.grad_norm(
            state.grads.all(),
            ws.grad_norm_partials.all_mut(),
            clip_grad_norm.unwrap_or(0.0),
            ws.step_scalars.at_mut(0, 2),
        )?;
        be.adamw_advance(
            ws.step_scalars.at(0, 1),
            AdamWHyper {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            },
            ws.adamw_state.all_mut(),
            ws.adamw_step.all_mut(),
        )?;
        be.adamw_update(
            state.params.all_mut(),
            state.grads.all(),
            state.exp_avg.all_mut(),
            state.exp_avg_sq.all_mut(),
            ws.step_scalars.at(0, 2),
            ws.adamw_step.all(),
        )
    }

    /// AdamW's device state for `steps` applied steps: `[steps, β1^steps, β2^steps]`, as PyTorch's corrections
    /// (computed in f64).
    pub fn adamw_state_for(&self, steps: u64) -> [f64; 3] {
        let t = steps as f64;
        [
            t,
            f64::from(self.optimizer.beta1).powf(t),
            f64::from(self.optimizer.beta2).powf(t),
        ]
    }
}
