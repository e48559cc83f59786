//! The `dflash` drafter's training step (SpecForge's DFlash), written once over [`Backend`]: context
//! projection, Qwen3 decoder layers over the sampled blocks with the DFlash mask, the target's frozen
//! `lm_head` in a chunked weighted loss, the full backward, and the update every model shares.
//!
//! ```text
//!  stage     host: block plan (anchors, ids, positions, mask ranges, labels, weights) ──stage_upload──▶ plan slot
//!  context   c = hidden_norm(hs·fcᵀ)                                        [T, H], once per sequence
//!  blocks    x₀ = embed[block ids]                                          [Q, H], frozen embedding
//!  layer     n = rmsnorm(x); q = rope(q_norm(n·Wqᵀ)); k/v of the block rows from n, of the context rows
//!            from c (not re-normalised: SpecForge's `k_proj(target_hidden)`); a = attention(q, [k_c; k_b],
//!            [v_c; v_b]) under the ranges; m = x + a·Woᵀ; x' = m + swiglu(rmsnorm(m)·[Wg; Wu]ᵀ)·Wdᵀ
//!  loss      z = norm(x_L); the labelled rows of z gathered (`backend::head`); per chunk of C of them:
//!            logits = z·lm_headᵀ → weighted fused CE (gradient in place, w·(1/Σw)) → their dz, scattered back
//!            (0 for the other rows); loss = Σ rows; per-slot correct = correctᵀ·1
//!  backward  the reverse of every line above; RoPE's backward is the inverse rotation; k_norm collects its
//!            gradient from block and context rows; the frozen embedding and lm_head get none
//!  update    crate::model::update (shared with mlp)
//! ```
//!
//! Nothing here reads back or allocates on the step path: every size is the bucket's, the loss, the per-slot
//! correct counts and AdamW's state stay in device buffers, so the CUDA backend can capture each part as a graph.
//! The block plan is copied when the batch is staged, through [`Backend::stage_upload`]: on CUDA into the input
//! slot's pinned plan arena and from there on the copy stream with the hidden states, so staging a DFlash batch
//! neither waits for the step in flight nor allocates.

pub mod blocks;
mod buffers;
#[cfg(test)]
mod head_tests;
mod offsets;

use draftpipe_compiler::plan::{
    AdamWSpec, BackendKind, DflashSpec, LossSpec, ModelPlan, WorkspaceLayout,
};

use crate::backend::head::{HeadOutputs, HeadPlan, HeadScratch};
use crate::backend::{
    AttentionGrads, AttentionInputs, AttentionSaved, AttentionShape, Backend, BackendResult, Buf,
    Dst, HsBuf, HsOperand, Operand, Precision, Src,
};
use crate::batch::HsBatch;
use crate::model::family::{Family, FamilyModel, FamilyPlan, FrozenTables};
use crate::model::layers::{
    MlpDims, NormSaved, SwigluCopies, SwigluSaved, SwigluWeights, linear_backward,
    rmsnorm_backward, swiglu_mlp_backward, swiglu_mlp_forward,
};
use crate::model::step::{AllocateError, LayoutError, StepShape};
use crate::model::update::{FlatBuffers, Optimizer};

pub mod serving;

pub use blocks::{BlockGeometry, BlockPlan, PlanInput};
pub use buffers::{DflashWorkspace, PlanSlot};
pub use offsets::DflashOffsets;

/// The `dflash` drafter on one backend: its settings, state buffers, workspace and host block plan.
pub struct Dflash<B: Backend> {
    offsets: DflashOffsets,
    geometry: BlockGeometry,
    /// AdamW's settings and schedule.
    pub(crate) optimizer: Optimizer,
    precision: Precision,
    chunk_rows: usize,
    /// The flat state (trained tensors only).
    pub state: FlatBuffers<B>,
    /// The workspace.
    pub ws: DflashWorkspace<B>,
    plan: BlockPlan,
    /// Whether the head runs over the bucket's most labelled rows rather than the batch's (a backend that
    /// captures a step once per bucket needs the bucket's shapes: the asynchronous one).
    bucket_head: bool,
    /// Head rows of the batch staged in each input slot (`backend::head`).
    staged_head_rows: Vec<usize>,
}

impl<B: Backend> Dflash<B> {
    /// The model of `plan` on `backend`, state zeroed, workspace allocated from `layout`; the frozen embedding
    /// and `lm_head` are zero until [`Dflash::upload_frozen`].
    ///
    /// # Errors
    /// When the layout lacks a buffer or the backend cannot allocate.
    pub fn new(
        backend: &mut B,
        (model, offsets): (&ModelPlan, DflashOffsets),
        loss: LossSpec,
        optimizer: AdamWSpec,
        precision: Precision,
        layout: &WorkspaceLayout,
    ) -> Result<Self, AllocateError> {
        let spec = offsets.spec();
        // `anchors` is the bucket's (see `stage_plan`).
        let geometry = BlockGeometry {
            block: spec.block,
            anchors: spec.anchors,
            mask_token: spec.mask_token,
            position_decay: loss.position_decay.unwrap_or(0.0),
        };
        Ok(Self {
            geometry,
            optimizer: Optimizer::new(optimizer),
            precision,
            chunk_rows: layout.chunk_rows,
            state: FlatBuffers::zeroed(backend, model.parameters)?
                .with_layout_copy(backend, layout)?,
            ws: DflashWorkspace::allocate(backend, layout, spec.vocab * spec.hidden)?,
            offsets,
            plan: BlockPlan::default(),
            bucket_head: backend.asynchronous(),
            staged_head_rows: vec![1; layout.input_slots],
        })
    }

    /// The model's dimensions.
    pub fn spec(&self) -> &DflashSpec {
        self.offsets.spec()
    }

    /// Rows of the step: `(T, Q, blocks)`.
    fn rows(&self, shape: StepShape) -> (usize, usize, usize) {
        let blocks = shape.sequences * self.spec().block_slots(shape.padded_len);
        (shape.tokens(), blocks * self.geometry.block, blocks)
    }

    fn forward(&mut self, be: &mut B, shape: StepShape, slot: usize) -> BackendResult {
        let spec = self.offsets.spec();
        let (h, d, i) = (spec.hidden, spec.taps * spec.hidden, spec.intermediate);
        let (heads, kvh, hd) = (spec.heads, spec.kv_heads, spec.head_dim);
        let (qd, kd) = (heads * hd, kvh * hd);
        let (eps, theta) = (spec.rms_norm_eps, spec.rope_theta);
        let (t, q, blocks) = self.rows(shape);
        let (p, at) = (self.precision, &self.offsets);
        let (ws, params) = (&mut self.ws, &self.state.params);
        // The trained matrices as product operands: their bf16 copy where the layout keeps one (CUDA at bf16).
        let params16 = self.state.params_bf16.as_ref();
        let weight = |offset: usize, rows: usize, cols: usize| {
            let n = rows * cols;
            HsOperand::with_copy(
                params.at(offset, n),
                params16.map(|c| c.at(offset, n)),
                rows,
                cols,
            )
        };
        let (input, plan) = (&ws.inputs[slot], &ws.plans[slot]);
        let (th, qh) = (t * h, q * h);
        let mlp_dims = MlpDims {
            rows: q,
            hidden: h,
            intermediate: i,
        };
        // Context, once per sequence: c = hidden_norm(hs · fcᵀ). Hidden states held in bf16 meet `fc`'s bf16
        // copy where there is one (no rounding pass before the product); f32 ones meet the f32 weight.
        let fc = match input.hs {
            HsBuf::Bf16(_) => weight(at.fc, h, d),
            _ => Operand::new(params.at(at.fc, h * d), h, d).into(),
        };
        be.gemm_hs(
            ws.ctx_pre.at_mut(0, th),
            HsOperand::new(input.hs.at(0, t * d), t, d),
            fc.t(),
            1.0,
            0.0,
            p,
        )?;
        rmsnorm_with_copy(
            be,
            (ws.ctx_pre.at(0, th), params.at(at.hidden_norm, h)),
            (
                ws.ctx.at_mut(0, th),
                ws.copies.as_mut().map(|c| c.ctx.at_mut(0, th)),
            ),
            ws.ctx_inv_rms.at_mut(0, t),
            eps,
        )?;
        be.embedding_gather(
            ws.embed.all(),
            plan.block_ids.at(0, q),
            ws.xs[0].at_mut(0, qh),
        )?;
        be.fill(ws.ones.at_mut(0, blocks), 1.0)?;
        let ctx_positions = plan.positions.at(0, t);
        let blk_positions = plan.positions.at(t, q);
        for (l, w) in at.layers.iter().enumerate() {
            let (done, rest) = ws.xs.split_at_mut(l + 1);
            let (x, next) = (&done[l], &mut rest[0]);
            // The block rows' operands and their bf16 copies are per layer: the backward's weight gradients read
            // them again.
            rmsnorm_with_copy(
                be,
                (x.at(0, qh), params.at(w.input_layernorm, h)),
                (
                    ws.normed.at_mut(l * qh, qh),
                    ws.copies.as_mut().map(|c| c.normed.at_mut(l * qh, qh)),
                ),
                ws.inv_rms.at_mut(l * q, q),
                eps,
            )?;
            let normed = HsOperand::with_copy(
                ws.normed.at(l * qh, qh),
                ws.copies.as_ref().map(|c| c.normed.at(l * qh, qh)),
                q,
                h,
            );
            // Queries of the block rows: projection, per-head q_norm, RoPE at anchor + slot.
            be.gemm_hs(
                ws.q_raw.at_mut(l * q * qd, q * qd),
                normed,
                weight(w.q_proj, qd, h).t(),
                1.0,
                0.0,
                p,
            )?;
            be.rmsnorm_forward(
                ws.q_raw.at(l * q * qd, q * qd),
                params.at(w.q_norm, hd),
                ws.q.at_mut(l * q * qd, q * qd),
                ws.q_inv_rms.at_mut(l * q * heads, q * heads),
                eps,
            )?;
            // On the flash path RoPE also writes the bf16 copies of q and k the attention kernels read, and the
            // v products' outputs are rounded once; the copies stay per layer for the backward.
            let flash = ws.flash.as_mut();
            let (q16, [blk16, ctx16]) = match flash {
                Some(f) => (
                    Some(&mut f.q),
                    [
                        Some((&mut f.k_blk, &mut f.v_blk)),
                        Some((&mut f.k_ctx, &mut f.v_ctx)),
                    ],
                ),
                None => (None, [None, None]),
            };
            rope_with_copy(
                be,
                ws.q.at_mut(l * q * qd, q * qd),
                q16.map(|c| c.at_mut(l * q * qd, q * qd)),
                (blk_positions, theta),
                (heads, hd),
            )?;
            // Keys and values of the block rows (from n) and of the context rows (from c).
            for (rows, source, raw, inv, (keys, values), positions, copies) in [
                (
                    q,
                    normed,
                    &mut ws.k_blk_raw,
                    &mut ws.k_blk_inv_rms,
                    (&mut ws.k_blk, &mut ws.v_blk),
                    blk_positions,
                    blk16,
                ),
                (
                    t,
                    HsOperand::with_copy(
                        ws.ctx.at(0, th),
                        ws.copies.as_ref().map(|c| c.ctx.at(0, th)),
                        t,
                        h,
                    ),
                    &mut ws.k_ctx_raw,
                    &mut ws.k_ctx_inv_rms,
                    (&mut ws.k_ctx, &mut ws.v_ctx),
                    ctx_positions,
                    ctx16,
                ),
            ] {
                let n = rows * kd;
                be.gemm_hs(
                    raw.at_mut(l * n, n),
                    source,
                    weight(w.k_proj, kd, h).t(),
                    1.0,
                    0.0,
                    p,
                )?;
                be.rmsnorm_forward(
                    raw.at(l * n, n),
                    params.at(w.k_norm, hd),
                    keys.at_mut(l * n, n),
                    inv.at_mut(l * rows * kvh, rows * kvh),
                    eps,
                )?;
                let (k16, v16) = copies.unzip();
                rope_with_copy(
                    be,
                    keys.at_mut(l * n, n),
                    k16.map(|c| c.at_mut(l * n, n)),
                    (positions, theta),
                    (kvh, hd),
                )?;
                be.gemm_hs(
                    values.at_mut(l * n, n),
                    source,
                    weight(w.v_proj, kd, h).t(),
                    1.0,
                    0.0,
                    p,
                )?;
                // A pass of its own rather than a second, bf16-output product: cuBLAS writes one output, and
                // re-running the product would re-read both operands (6 bytes per element here against
                // 2·H + 2 bytes per element there).
                if let Some(v16) = v16 {
                    be.round_to_bf16(values.at(l * n, n), v16.at_mut(l * n, n))?;
                }
            }
            let inputs = AttentionInputs {
                q: ws.q.at(l * q * qd, q * qd),
                k_ctx: ws.k_ctx.at(l * t * kd, t * kd),
                v_ctx: ws.v_ctx.at(l * t * kd, t * kd),
                k_blk: ws.k_blk.at(l * q * kd, q * kd),
                v_blk: ws.v_blk.at(l * q * kd, q * kd),
                query_ranges: plan.query_ranges.at(0, 4 * q),
            };
            let shape = AttentionShape::new(heads, kvh, hd);
            let out = ws.attn.at_mut(l * q * qd, q * qd);
            let lse = ws.lse.at_mut(l * q * heads, q * heads);
            // The flash kernels where the layout put this worker on them (backend/flash.rs), which also write
            // the output's bf16 copy, the o_proj operand; the f32 kernels' output is rounded in a pass of its
            // own where the layout keeps that operand (the flash path is a subset of CUDA at bf16, which keeps
            // it, so the flash copies never go unused).
            let (qq, at_q) = (q * qd, l * q * qd);
            match (ws.flash.as_mut(), ws.copies.as_mut()) {
                (Some(flash), Some(saved16)) => {
                    let (copies, _) = flash.layer(l, (qq, t * kd, q * kd), inputs.query_ranges);
                    let out16 = saved16.attn.at_mut(at_q, qq);
                    be.flash_attention_forward(copies, shape, (out, out16), lse)?
                }
                (_, saved16) => {
                    be.attention_forward(inputs, shape, out, lse)?;
                    if let Some(saved16) = saved16 {
                        be.round_to_bf16(ws.attn.at(at_q, qq), saved16.attn.at_mut(at_q, qq))?;
                    }
                }
            }
            // m = x + attn · Woᵀ
            be.copy(ws.mid.at_mut(l * qh, qh), x.at(0, qh))?;
            be.gemm_hs(
                ws.mid.at_mut(l * qh, qh),
                HsOperand::with_copy(
                    ws.attn.at(at_q, qq),
                    ws.copies.as_ref().map(|c| c.attn.at(at_q, qq)),
                    q,
                    qd,
                ),
                weight(w.o_proj, h, qd).t(),
                1.0,
                1.0,
                p,
            )?;
            // x' = m + swiglu(rmsnorm(m) · [Wg; Wu]ᵀ) · Wdᵀ
            rmsnorm_with_copy(
                be,
                (
                    ws.mid.at(l * qh, qh),
                    params.at(w.post_attention_layernorm, h),
                ),
                (
                    ws.normed2.at_mut(l * qh, qh),
                    ws.copies.as_mut().map(|c| c.normed2.at_mut(l * qh, qh)),
                ),
                ws.inv_rms2.at_mut(l * q, q),
                eps,
            )?;
            // The MLP reads normed2's copy and writes act's: two fields of the same copies.
            let (normed2_16, act16) = match ws.copies.as_mut() {
                Some(c) => (
                    Some(c.normed2.at(l * qh, qh)),
                    Some((&mut c.act, l * q * i)),
                ),
                None => (None, None),
            };
            swiglu_mlp_forward(
                be,
                mlp_dims,
                (
                    HsOperand::with_copy(ws.normed2.at(l * qh, qh), normed2_16, q, h),
                    ws.mid.at(l * qh, qh),
                ),
                (
                    SwigluWeights {
                        gate_up: params.at(w.gate_up, 2 * i * h),
                        down: params.at(w.down_proj, h * i),
                    },
                    weight(w.gate_up, 2 * i, h),
                ),
                (
                    (&mut ws.gate_up, l * q * 2 * i),
                    (&mut ws.act, l * q * i),
                    act16.zip(params16.map(|c| c.at(w.down_proj, h * i))),
                ),
                next.at_mut(0, qh),
                p,
            )?;
        }
        let layers = at.layers.len();
        be.rmsnorm_forward(
            ws.xs[layers].at(0, qh),
            params.at(at.norm, h),
            ws.z.at_mut(0, qh),
            ws.final_inv_rms.at_mut(0, q),
            eps,
        )
    }

    /// The frozen lm_head and the weighted fused loss over the labelled rows only, chunk by chunk (never
    /// `[rows, V]`), writing `dz` (zero for the rows without a label); the loss total and the per-slot correct
    /// counts into the step scalars.
    fn loss(&mut self, be: &mut B, shape: StepShape, slot: usize) -> BackendResult {
        let spec = self.offsets.spec();
        let (h, v, b) = (spec.hidden, spec.vocab, spec.block);
        let (_, q, blocks) = self.rows(shape);
        let m = self.staged_head_rows[slot];
        let ws = &mut self.ws;
        let plan = &ws.plans[slot];
        let chunk = self.chunk_rows.clamp(1, m);
        be.labelled_head_loss(
            (ws.z.at(0, q * h), ws.lm_head.all()),
            HeadPlan {
                rows: plan.head_rows.at(0, m),
                index: plan.head_index.at(0, q),
                labels: plan.labels.at(0, m),
                weights: plan.weights.at(0, m),
                norm: plan.inv_weight_sum.all(),
            },
            HeadScratch {
                operands: ws.head.operands(m, h, chunk * v),
                dz: ws.head_dz.at_mut(0, m * h),
                logits: ws.logits.at_mut(0, chunk * v),
                correct: ws.head_correct.at_mut(0, m),
            },
            HeadOutputs {
                row_loss: ws.row_loss.at_mut(0, m),
                dz: ws.dz.at_mut(0, q * h),
                correct: ws.correct.at_mut(0, q),
            },
            self.precision,
        )?;
        be.sum(
            ws.row_loss.at(0, m),
            ws.loss_partials.all_mut(),
            ws.step_scalars.at_mut(2, 1),
        )?;
        // Correct rows per slot: correct viewed [blocks, B], summed over blocks by a product with ones (f32,
        // exact for counts below 2²⁴).
        be.gemm(
            ws.step_scalars.at_mut(3, b),
            Operand::new(ws.correct.at(0, q), blocks, b).t(),
            Operand::new(ws.ones.at(0, blocks), blocks, 1),
            1.0,
            0.0,
            Precision::F32,
        )?;
        // The exact acceptance length's numerator: each block's drafted slots 1..B right in a row (slot 0 is the
        // anchor, given), on the device beside the counts above.
        be.accepted_prefix_sum(
            ws.correct.at(1, q - 1),
            ws.step_scalars.at_mut(3 + b, 1),
            (blocks, b - 1),
            (b, 1),
        )
    }

    /// The reverse of the forward. On CUDA at `bf16` every product reads bf16 copies of both operands: the
    /// weights' (`params_bf16`), the saved activations' (per layer, written by the forward) and each gradient's,
    /// written in the same pass by the kernel that produces the gradient (the norms' and the SwiGLU's backward);
    /// the attention kernels write their f32 gradients only, so dv's copies are a rounding pass of their own
    /// ([`projection_backward`]).
    fn backward(&mut self, be: &mut B, shape: StepShape, slot: usize) -> BackendResult {
        let spec = self.offsets.spec();
        let (h, d, i) = (spec.hidden, spec.taps * spec.hidden, spec.intermediate);
        let (heads, kvh, hd) = (spec.heads, spec.kv_heads, spec.head_dim);
        let (qd, kd) = (heads * hd, kvh * hd);
        let theta = spec.rope_theta;
        let (t, q, _) = self.rows(shape);
        let (p, at) = (self.precision, &self.offsets);
        let (ws, state) = (&mut self.ws, &mut self.state);
        let (params, grads) = (&state.params, &mut state.grads);
        let params16 = state.params_bf16.as_ref();
        let weight = |offset: usize, rows: usize, cols: usize| {
            let n = rows * cols;
            HsOperand::with_copy(
                params.at(offset, n),
                params16.map(|c| c.at(offset, n)),
                rows,
                cols,
            )
        };
        let (input, plan) = (&ws.inputs[slot], &ws.plans[slot]);
        // The forward's copies are only read here; the gradients' are written in `ws.grad_copies`.
        let saved16 = ws.copies.as_ref();
        let (th, qh, qq, qk, tk) = (t * h, q * h, q * qd, q * kd, t * kd);
        let ctx_positions = plan.positions.at(0, t);
        let blk_positions = plan.positions.at(t, q);
        let layers = at.layers.len();
        let mlp_dims = MlpDims {
            rows: q,
            hidden: h,
            intermediate: i,
        };
        rmsnorm_backward(
            be,
            NormSaved {
                x: ws.xs[layers].at(0, qh),
                weight: params.at(at.norm, h),
                inv_rms: ws.final_inv_rms.at(0, q),
                dy: ws.dz.at(0, qh),
            },
            (grads.at_mut(at.norm, h), ws.norm_partials.all_mut()),
            (
                ws.dx.at_mut(0, qh),
                ws.grad_copies.as_mut().map(|c| c.dx.at_mut(0, qh)),
            ),
            false,
        )?;
        for (l, w) in at.layers.iter().enumerate().rev() {
            // MLP: x' = m + swiglu(post_attention_layernorm(m)) · Wdᵀ.
            swiglu_mlp_backward(
                be,
                mlp_dims,
                ws.dx.at(0, qh),
                SwigluSaved {
                    normed: ws.normed2.at(l * qh, qh),
                    gate_up: ws.gate_up.at(l * q * 2 * i, q * 2 * i),
                    act: ws.act.at(l * q * i, q * i),
                },
                SwigluWeights {
                    gate_up: params.at(w.gate_up, 2 * i * h),
                    down: params.at(w.down_proj, h * i),
                },
                (&mut *grads, w.gate_up, w.down_proj),
                (&mut ws.dact, &mut ws.dgate_up),
                ws.grad_copies
                    .as_mut()
                    .zip(saved16.zip(params16))
                    .map(|(g, (s, p16))| {
                        let copies = SwigluCopies {
                            dout: g.dx.at(0, qh),
                            normed: s.normed2.at(l * qh, qh),
                            act: s.act.at(l * q * i, q * i),
                            gate_up: p16.at(w.gate_up, 2 * i * h),
                            down: p16.at(w.down_proj, h * i),
                        };
                        (copies, &mut g.grad)
                    }),
                ws.dnormed.at_mut(0, qh),
                p,
            )?;
            // dx ← dm = dx' + the post-attention norm's input gradient.
            rmsnorm_backward(
                be,
                NormSaved {
                    x: ws.mid.at(l * qh, qh),
                    weight: params.at(w.post_attention_layernorm, h),
                    inv_rms: ws.inv_rms2.at(l * q, q),
                    dy: ws.dnormed.at(0, qh),
                },
                (
                    grads.at_mut(w.post_attention_layernorm, h),
                    ws.norm_partials.all_mut(),
                ),
                (
                    ws.dx.at_mut(0, qh),
                    ws.grad_copies.as_mut().map(|c| c.dx.at_mut(0, qh)),
                ),
                true,
            )?;
            // Attention output projection: m = x + attn · Woᵀ.
            projection_backward(
                be,
                (ws.dx.at(0, qh), h, false),
                ws.grad_copies.as_mut().map(|c| &mut c.dx),
                (
                    HsOperand::with_copy(
                        ws.attn.at(l * qq, qq),
                        saved16.map(|c| c.attn.at(l * qq, qq)),
                        q,
                        qd,
                    ),
                    weight(w.o_proj, h, qd),
                ),
                (
                    (grads.at_mut(w.o_proj, h * qd), 0.0),
                    (ws.dattn.at_mut(0, qq), 0.0),
                ),
                p,
            )?;
            let inputs = AttentionInputs {
                q: ws.q.at(l * qq, qq),
                k_ctx: ws.k_ctx.at(l * tk, tk),
                v_ctx: ws.v_ctx.at(l * tk, tk),
                k_blk: ws.k_blk.at(l * qk, qk),
                v_blk: ws.v_blk.at(l * qk, qk),
                query_ranges: plan.query_ranges.at(0, 4 * q),
            };
            let saved = AttentionSaved {
                out: ws.attn.at(l * qq, qq),
                dout: ws.dattn.at(0, qq),
                lse: ws.lse.at(l * q * heads, q * heads),
                key_ranges_ctx: plan.context_key_ranges.at(0, 2 * t),
                key_ranges_blk: plan.block_key_ranges.at(0, 2 * q),
            };
            let attn_grads = AttentionGrads {
                dq: ws.dq.at_mut(0, qq),
                dk_ctx: ws.dk_ctx.at_mut(0, tk),
                dv_ctx: ws.dv_ctx.at_mut(0, tk),
                dk_blk: ws.dk_blk.at_mut(0, qk),
                dv_blk: ws.dv_blk.at_mut(0, qk),
            };
            let (shape, delta) = (
                AttentionShape::new(heads, kvh, hd),
                ws.attn_delta.at_mut(0, q * heads),
            );
            // The flash path reads the copies its forward's producers wrote: no rounding here.
            match ws.flash.as_mut() {
                Some(flash) => {
                    let (copies, dout16) = flash.layer(l, (qq, tk, qk), inputs.query_ranges);
                    be.flash_attention_backward(copies, shape, saved, (delta, dout16), attn_grads)?
                }
                None => be.attention_backward(inputs, shape, saved, delta, attn_grads)?,
            }
            let normed = HsOperand::with_copy(
                ws.normed.at(l * qh, qh),
                saved16.map(|c| c.normed.at(l * qh, qh)),
                q,
                h,
            );
            // Queries: inverse RoPE, q_norm, projection; dn starts here.
            be.rope(ws.dq.at_mut(0, qq), blk_positions, theta, heads, hd, true)?;
            rmsnorm_backward(
                be,
                NormSaved {
                    x: ws.q_raw.at(l * qq, qq),
                    weight: params.at(w.q_norm, hd),
                    inv_rms: ws.q_inv_rms.at(l * q * heads, q * heads),
                    dy: ws.dq.at(0, qq),
                },
                (grads.at_mut(w.q_norm, hd), ws.norm_partials.all_mut()),
                (
                    ws.dq_raw.at_mut(0, qq),
                    ws.grad_copies.as_mut().map(|c| c.grad.at_mut(0, qq)),
                ),
                false,
            )?;
            projection_backward(
                be,
                (ws.dq_raw.at(0, qq), qd, false),
                ws.grad_copies.as_mut().map(|c| &mut c.grad),
                (normed, weight(w.q_proj, qd, h)),
                (
                    (grads.at_mut(w.q_proj, qd * h), 0.0),
                    (ws.dnormed.at_mut(0, qh), 0.0),
                ),
                p,
            )?;
            // Block keys (k_norm's gradient from these rows into scratch) and values.
            be.rope(ws.dk_blk.at_mut(0, qk), blk_positions, theta, kvh, hd, true)?;
            rmsnorm_backward(
                be,
                NormSaved {
                    x: ws.k_blk_raw.at(l * qk, qk),
                    weight: params.at(w.k_norm, hd),
                    inv_rms: ws.k_blk_inv_rms.at(l * q * kvh, q * kvh),
                    dy: ws.dk_blk.at(0, qk),
                },
                (ws.k_norm_grad.all_mut(), ws.norm_partials.all_mut()),
                (
                    ws.dk_blk_raw.at_mut(0, qk),
                    ws.grad_copies.as_mut().map(|c| c.grad.at_mut(0, qk)),
                ),
                false,
            )?;
            for (dy, round, dweight) in [
                (ws.dk_blk_raw.at(0, qk), false, w.k_proj),
                (ws.dv_blk.at(0, qk), true, w.v_proj),
            ] {
                projection_backward(
                    be,
                    (dy, kd, round),
                    ws.grad_copies.as_mut().map(|c| &mut c.grad),
                    (normed, weight(dweight, kd, h)),
                    (
                        (grads.at_mut(dweight, kd * h), 0.0),
                        (ws.dnormed.at_mut(0, qh), 1.0),
                    ),
                    p,
                )?;
            }
            // Context keys and values: into k/v_proj's gradients and dc (accumulated over layers).
            be.rope(ws.dk_ctx.at_mut(0, tk), ctx_positions, theta, kvh, hd, true)?;
            rmsnorm_backward(
                be,
                NormSaved {
                    x: ws.k_ctx_raw.at(l * tk, tk),
                    weight: params.at(w.k_norm, hd),
                    inv_rms: ws.k_ctx_inv_rms.at(l * t * kvh, t * kvh),
                    dy: ws.dk_ctx.at(0, tk),
                },
                (grads.at_mut(w.k_norm, hd), ws.norm_partials.all_mut()),
                (
                    ws.dk_ctx_raw.at_mut(0, tk),
                    ws.grad_copies.as_mut().map(|c| c.grad.at_mut(0, tk)),
                ),
                false,
            )?;
            // k_norm += the block rows' part (a [1, hd] += [1, 1] · [1, hd] product: no add kernel needed).
            be.gemm(
                grads.at_mut(w.k_norm, hd),
                Operand::new(ws.ones.at(0, 1), 1, 1),
                Operand::new(ws.k_norm_grad.all(), 1, hd),
                1.0,
                1.0,
                Precision::F32,
            )?;
            let ctx =
                HsOperand::with_copy(ws.ctx.at(0, th), saved16.map(|c| c.ctx.at(0, th)), t, h);
            let first = if l + 1 == layers { 0.0 } else { 1.0 };
            for (dy, round, dweight, dctx_beta) in [
                (ws.dk_ctx_raw.at(0, tk), false, w.k_proj, first),
                (ws.dv_ctx.at(0, tk), true, w.v_proj, 1.0),
            ] {
                projection_backward(
                    be,
                    (dy, kd, round),
                    ws.grad_copies.as_mut().map(|c| &mut c.grad),
                    (ctx, weight(dweight, kd, h)),
                    (
                        (grads.at_mut(dweight, kd * h), 1.0),
                        (ws.dctx.at_mut(0, th), dctx_beta),
                    ),
                    p,
                )?;
            }
            // Input norm: dx ← dm + its input gradient (its copy read by the next layer down's products; below
            // layer 0 nothing reads it).
            rmsnorm_backward(
                be,
                NormSaved {
                    x: ws.xs[l].at(0, qh),
                    weight: params.at(w.input_layernorm, h),
                    inv_rms: ws.inv_rms.at(l * q, q),
                    dy: ws.dnormed.at(0, qh),
                },
                (
                    grads.at_mut(w.input_layernorm, h),
                    ws.norm_partials.all_mut(),
                ),
                (
                    ws.dx.at_mut(0, qh),
                    ws.grad_copies
                        .as_mut()
                        .filter(|_| l > 0)
                        .map(|c| c.dx.at_mut(0, qh)),
                ),
                true,
            )?;
        }
        // Context: hidden_norm, then fc (the block embedding is frozen: dx stops here). fc's weight gradient
        // pairs dctx_pre with the hidden states as they are held: its bf16 copy meets bf16 ones, f32 meets f32.
        let dctx_pre16 = match input.hs {
            HsBuf::Bf16(_) => ws.grad_copies.as_mut().map(|c| &mut c.grad),
            _ => None,
        };
        let (dctx_pre, dctx_pre16) = match dctx_pre16 {
            Some(copy) => {
                rmsnorm_backward(
                    be,
                    NormSaved {
                        x: ws.ctx_pre.at(0, th),
                        weight: params.at(at.hidden_norm, h),
                        inv_rms: ws.ctx_inv_rms.at(0, t),
                        dy: ws.dctx.at(0, th),
                    },
                    (grads.at_mut(at.hidden_norm, h), ws.norm_partials.all_mut()),
                    (ws.dctx_pre.at_mut(0, th), Some(copy.at_mut(0, th))),
                    false,
                )?;
                (ws.dctx_pre.at(0, th), Some(copy.at(0, th)))
            }
            None => {
                rmsnorm_backward(
                    be,
                    NormSaved {
                        x: ws.ctx_pre.at(0, th),
                        weight: params.at(at.hidden_norm, h),
                        inv_rms: ws.ctx_inv_rms.at(0, t),
                        dy: ws.dctx.at(0, th),
                    },
                    (grads.at_mut(at.hidden_norm, h), ws.norm_partials.all_mut()),
                    (ws.dctx_pre.at_mut(0, th), None),
                    false,
                )?;
                (ws.dctx_pre.at(0, th), None)
            }
        };
        be.gemm_hs(
            grads.at_mut(at.fc, h * d),
            HsOperand::with_copy(dctx_pre, dctx_pre16, t, h).t(),
            HsOperand::new(input.hs.at(0, t * d), t, d),
            1.0,
            0.0,
            p,
        )
    }
}

impl<B: Backend> Family<B> for Dflash<B> {
    fn name(&self) -> &'static str {
        "dflash"
    }

    fn forward(&mut self, be: &mut B, shape: StepShape, slot: usize) -> BackendResult {
        Dflash::forward(self, be, shape, slot)
    }

    /// The weighted loss and its gradient (the batch's plan staged by [`Dflash::stage_plan`]): the loss into
    /// `step_scalars[2]`, the correct rows of each slot into `step_scalars[3..3 + block]`, the accepted prefixes
    /// summed into `step_scalars[3 + block]`. Evaluation runs the same.
    fn loss(&mut self, be: &mut B, shape: StepShape, slot: usize) -> BackendResult {
        Dflash::loss(self, be, shape, slot)
    }

    fn backward(&mut self, be: &mut B, shape: StepShape, slot: usize) -> BackendResult {
        Dflash::backward(self, be, shape, slot)
    }

    crate::model::family::family_state_parts!();

    fn input_width_and_vocab(&self) -> (usize, usize) {
        (self.spec().taps * self.spec().hidden, self.spec().vocab)
    }

    fn frozen_mut(&mut self) -> Option<FrozenTables<'_, B>> {
        Some((&mut self.ws.embed, &mut self.ws.lm_head))
    }

    /// Rounds the uploaded `lm_head` into its bf16 copy where the head reads one (CUDA at `bf16`): once per
    /// upload, never on the step path (the tensor is frozen).
    fn frozen_uploaded(&mut self, be: &mut B) -> BackendResult {
        match self.ws.head.lm_head_copy() {
            Some(copy) => be.round_to_bf16(self.ws.lm_head.all(), copy),
            None => Ok(()),
        }
    }

    /// Builds the block plan of `batch` (anchors drawn with `(seed, step)`) and copies it into input slot
    /// `slot`'s plan buffers. Returns the labelled rows per slot.
    ///
    /// # Errors
    /// Backend failures.
    fn stage(
        &mut self,
        be: &mut B,
        slot: usize,
        batch: &HsBatch,
        (seed, step): (u64, u64),
    ) -> BackendResult<Option<Vec<u32>>> {
        let input = PlanInput {
            padded_len: batch.padded_len,
            input_ids: &batch.input_ids,
            loss_mask: &batch.loss_mask,
            seq_lens: &batch.seq_lens,
        };
        let geometry = BlockGeometry {
            anchors: self.spec().block_slots(batch.padded_len),
            ..self.geometry
        };
        self.plan.build(&geometry, input, seed, step);
        let head_rows = if self.bucket_head {
            self.spec()
                .head_rows(batch.padded_len, batch.sequences)
                .expect("the layout holds the bucket's head rows")
        } else {
            self.plan.labelled_rows() + 1
        };
        self.plan.pad_head(head_rows);
        self.staged_head_rows[slot] = head_rows;
        let plan = &self.plan;
        let dev = &mut self.ws.plans[slot];
        let (t, q) = (plan.context_positions.len(), plan.query_rows());
        be.stage_upload(slot, dev.block_ids.at_mut(0, q), &plan.block_ids)?;
        be.stage_upload(slot, dev.positions.at_mut(0, t), &plan.context_positions)?;
        be.stage_upload(slot, dev.positions.at_mut(t, q), &plan.block_positions)?;
        be.stage_upload(slot, dev.query_ranges.at_mut(0, 4 * q), &plan.query_ranges)?;
        be.stage_upload(
            slot,
            dev.context_key_ranges.at_mut(0, 2 * t),
            &plan.context_key_ranges,
        )?;
        be.stage_upload(
            slot,
            dev.block_key_ranges.at_mut(0, 2 * q),
            &plan.block_key_ranges,
        )?;
        be.stage_upload(slot, dev.head_rows.at_mut(0, head_rows), &plan.head_rows)?;
        be.stage_upload(slot, dev.head_index.at_mut(0, q), &plan.head_index)?;
        be.stage_upload(slot, dev.labels.at_mut(0, head_rows), &plan.head_labels)?;
        be.stage_upload(slot, dev.weights.at_mut(0, head_rows), &plan.head_weights)?;
        be.stage_upload(slot, dev.inv_weight_sum.all_mut(), &[plan.inv_weight_sum])?;
        Ok(Some(self.plan.slot_labels.clone()))
    }
}

/// The `dflash` family as the registry builds it.
impl<B: Backend> FamilyModel<B> for Dflash<B> {
    type Offsets = DflashOffsets;

    fn offsets(model: &ModelPlan) -> Result<DflashOffsets, LayoutError> {
        DflashOffsets::new(model)
    }

    fn workspace(
        offsets: &DflashOffsets,
        plan: &FamilyPlan<'_>,
        kind: BackendKind,
    ) -> Option<WorkspaceLayout> {
        WorkspaceLayout::dflash(
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
        offsets: DflashOffsets,
        layout: &WorkspaceLayout,
    ) -> Result<Self, AllocateError> {
        Dflash::new(
            backend,
            (plan.model, offsets),
            plan.loss,
            plan.optimizer,
            plan.precision,
            layout,
        )
    }
}

/// RoPE forward over `x` at `positions` with `theta`, writing `x`'s bf16 copy in the same pass where the flash
/// path keeps one (`copy`).
fn rope_with_copy<B: Backend>(
    be: &mut B,
    x: Dst<'_, B, f32>,
    copy: Option<Dst<'_, B, half::bf16>>,
    (positions, theta): (Src<'_, B, u32>, f32),
    (heads, head_dim): (usize, usize),
) -> BackendResult {
    match copy {
        Some(copy) => be.rope_bf16((x, copy), positions, theta, heads, head_dim),
        None => be.rope(x, positions, theta, heads, head_dim, false),
    }
}

/// An RMSNorm forward over `x`'s rows into `y`, and into `copy` rounded to bf16 in the same pass when the
/// layout keeps that copy (CUDA at `bf16`: the operand of the products that read the norm's output).
fn rmsnorm_with_copy<B: Backend>(
    be: &mut B,
    (x, weight): (Src<'_, B, f32>, Src<'_, B, f32>),
    (y, copy): (Dst<'_, B, f32>, Option<Dst<'_, B, half::bf16>>),
    inv_rms: Dst<'_, B, f32>,
    eps: f32,
) -> BackendResult {
    match copy {
        Some(copy) => be.rmsnorm_forward_bf16(x, weight, (y, copy), inv_rms, eps),
        None => be.rmsnorm_forward(x, weight, y, inv_rms, eps),
    }
}

/// An output of a product and the β it is scaled by before the product is added (0 overwrites).
type Scaled<'a, B> = (Dst<'a, B, f32>, f32);

/// A projection's backward from the gradient `dy` (`[rows, width]`, f32) through [`linear_backward`] with `x`
/// and the weight (`(dweight, β), (dx, β)` as there). Where the layout keeps gradient copies (`scratch`: CUDA at
/// `bf16`), the products read `dy`'s copy from the start of `scratch`: there already, written by the kernel that
/// produced `dy` in its pass, or with `round` written here first (the attention's f32 dv outputs: a pass of 6
/// bytes per element that lets both products read 2-byte operands on both sides rather than 4-byte ones, and
/// cuBLAS multiply bf16 natively; a bf16 product cannot take an f32 `dy` beside the weights' bf16 copy).
fn projection_backward<B: Backend>(
    be: &mut B,
    (dy, width, round): (Src<'_, B, f32>, usize, bool),
    scratch: Option<&mut Buf<B, half::bf16>>,
    (x, weight): (HsOperand<'_, B>, HsOperand<'_, B>),
    (dweight, dx): (Scaled<'_, B>, Scaled<'_, B>),
    precision: Precision,
) -> BackendResult {
    let n = dy.len();
    let copy = match scratch {
        Some(scratch) => {
            if round {
                be.round_to_bf16(dy, scratch.at_mut(0, n))?;
            }
            Some(scratch.at(0, n))
        }
        None => None,
    };
    let dy = HsOperand::with_copy(dy, copy, n / width.max(1), width);
    linear_backward(be, (dy, x, weight), dweight, dx, precision)
}
