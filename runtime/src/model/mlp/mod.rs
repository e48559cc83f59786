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

use draftpipe_compiler::plan::{
    AdamWSpec, BackendKind, LossSpec, MlpSpec, ModelPlan, WorkspaceLayout,
};

use crate::backend::{Backend, BackendResult, HsOperand, Operand, Precision};
use crate::model::family::{Family, FamilyModel, FamilyPlan};
use crate::model::layers::{self, MlpDims, NormSaved, SwigluSaved, SwigluWeights};
use crate::model::serving::FamilySpec;
use crate::model::step::{AllocateError, LayoutError, StepShape};
use crate::model::update::Optimizer;

mod buffers;

pub use crate::model::update::FlatBuffers;
pub use buffers::{MlpOffsets, MlpWorkspace};

/// RMSNorm epsilon of the model (inside the square root: `x / sqrt(mean(x²) + eps)`).
pub const RMS_EPS: f32 = 1e-6;

/// The `mlp` drafter on one backend: its settings, state buffers and workspace.
pub struct Mlp<B: Backend> {
    spec: MlpSpec,
    offsets: MlpOffsets,
    loss: LossSpec,
    /// AdamW's settings and schedule.
    pub(crate) optimizer: Optimizer,
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
        let state = FlatBuffers::zeroed(backend, model.parameters)?;
        Ok(Self {
            spec: offsets.spec,
            offsets,
            loss,
            optimizer: Optimizer::new(optimizer),
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
        let dims = MlpDims {
            rows: t,
            hidden: h,
            intermediate: i,
        };
        let input = &ws.inputs[slot];
        be.gemm_hs(
            ws.xs[0].at_mut(0, th),
            HsOperand::new(input.hs.at(0, t * din), t, din),
            Operand::new(params.at(at.fc, h * din), h, din).t().into(),
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
            // x_{b+1} = x_b + swiglu(normed · [gate; up]ᵀ) · downᵀ
            layers::swiglu_mlp_forward(
                be,
                dims,
                (
                    Operand::new(ws.normed.at(b * th, th), t, h).into(),
                    x.at(0, th),
                ),
                (
                    SwigluWeights {
                        gate_up: params.at(w.gate_up, 2 * i * h),
                        down: params.at(w.down, h * i),
                    },
                    Operand::new(params.at(w.gate_up, 2 * i * h), 2 * i, h).into(),
                ),
                (
                    (&mut ws.gate_up, b * t * 2 * i),
                    (&mut ws.act, b * t * i),
                    None,
                ),
                next.at_mut(0, th),
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
        let dims = MlpDims {
            rows: t,
            hidden: h,
            intermediate: i,
        };
        layers::rmsnorm_backward(
            be,
            NormSaved {
                x: ws.xs[blocks].at(0, th),
                weight: state.params.at(at.norm, h),
                inv_rms: ws.inv_rms.at(blocks * t, t),
                dy: ws.dz.at(0, th),
            },
            (state.grads.at_mut(at.norm, h), ws.norm_partials.all_mut()),
            (ws.dx.at_mut(0, th), None),
            false,
        )?;
        for (b, w) in at.blocks.iter().enumerate().rev() {
            layers::swiglu_mlp_backward(
                be,
                dims,
                ws.dx.at(0, th),
                SwigluSaved {
                    normed: ws.normed.at(b * th, th),
                    gate_up: ws.gate_up.at(b * t * 2 * i, t * 2 * i),
                    act: ws.act.at(b * t * i, t * i),
                },
                SwigluWeights {
                    gate_up: state.params.at(w.gate_up, 2 * i * h),
                    down: state.params.at(w.down, h * i),
                },
                (&mut state.grads, w.gate_up, w.down),
                (&mut ws.dact, &mut ws.dgate_up),
                None,
                ws.dnormed.at_mut(0, th),
                p,
            )?;
            // dx ← dx (the residual's gradient) + the block norm's input gradient.
            layers::rmsnorm_backward(
                be,
                NormSaved {
                    x: ws.xs[b].at(0, th),
                    weight: state.params.at(w.norm, h),
                    inv_rms: ws.inv_rms.at(b * t, t),
                    dy: ws.dnormed.at(0, th),
                },
                (state.grads.at_mut(w.norm, h), ws.norm_partials.all_mut()),
                (ws.dx.at_mut(0, th), None),
                true,
            )?;
        }
        be.gemm_hs(
            state.grads.at_mut(at.fc, h * din),
            Operand::new(ws.dx.at(0, th), t, h).t().into(),
            HsOperand::new(ws.inputs[slot].hs.at(0, t * din), t, din),
            1.0,
            0.0,
            p,
        )
    }
}

impl<B: Backend> Family<B> for Mlp<B> {
    fn name(&self) -> &'static str {
        "mlp"
    }

    /// The hidden layers' and the head's activations.
    fn forward(&mut self, be: &mut B, shape: StepShape, slot: usize) -> BackendResult {
        Mlp::forward(self, be, shape, slot)
    }

    /// The fused vocabulary loss and the head's gradients.
    fn loss(&mut self, be: &mut B, shape: StepShape, slot: usize) -> BackendResult {
        self.loss_and_heads(be, shape, slot)
    }

    fn backward(&mut self, be: &mut B, shape: StepShape, slot: usize) -> BackendResult {
        Mlp::backward(self, be, shape, slot)
    }

    crate::model::family::family_state_parts!();

    fn input_width_and_vocab(&self) -> (usize, usize) {
        (self.spec.din, self.spec.vocab)
    }
}

/// The `mlp` family as the registry builds it.
impl<B: Backend> FamilyModel<B> for Mlp<B> {
    type Offsets = MlpOffsets;

    fn offsets(model: &ModelPlan) -> Result<MlpOffsets, LayoutError> {
        MlpOffsets::new(model)
    }

    fn workspace(
        offsets: &MlpOffsets,
        plan: &FamilyPlan<'_>,
        kind: BackendKind,
    ) -> Option<WorkspaceLayout> {
        WorkspaceLayout::mlp(
            offsets.spec(),
            plan.buckets,
            &plan.loss,
            kind,
            plan.precision,
        )
    }

    fn allocate(
        backend: &mut B,
        plan: &FamilyPlan<'_>,
        offsets: MlpOffsets,
        layout: &WorkspaceLayout,
    ) -> Result<Self, AllocateError> {
        Mlp::new(
            backend,
            (plan.model, offsets),
            plan.loss,
            plan.optimizer,
            plan.precision,
            layout,
        )
    }
}

/// `mlp` reads no target tensors and exports no serving config (the defaults).
impl FamilySpec for MlpSpec {
    fn name(&self) -> &'static str {
        "mlp"
    }
}
