//! The `eagle3` drafter's training step (SpecForge's offline EAGLE-3), written once over [`Backend`]: the shifts
//! and the teacher once per batch, `fc`, the test-time-training unroll of the one Llama decoder layer, the
//! soft-label loss fused with the draft head chunk by chunk, the backward through the whole unroll, and the
//! update every model shares.
//!
//! ```text
//!  batch     ids = input_ids ← 1; teacher_hs = last_hidden_states ← 1 (row shifts inside each sequence, zeros
//!            past its end); valid[t] = loss_mask[t] · [argmax(teacher_hs[t]·lm_headᵀ) ∈ draft vocabulary],
//!            chunked over the full vocabulary                                                     once
//!  fc        h₀ = hs·fcᵀ                                                                          [T, H]
//!  step k    e = embed[ids ← k]; c = [input_layernorm(e) | hidden_norm(h_k)]; q, k, v = c·W{q,k,v}ᵀ,
//!            RoPE at t + k; a = attention(q; step 0's keys causal, steps 1..=k's keys diagonal);
//!            m = h_k + a·Woᵀ; h_{k+1} = m + swiglu(post_attention_layernorm(m)·[Wg; Wu]ᵀ)·Wdᵀ   (not detached)
//!  loss      per step, per chunk of C rows: draft = norm(h_{k+1})·lm_headᵀ, teacher = (teacher_hs ← k)·Tᵀ
//!            (T: the target lm_head's rows d2t selects) → soft-label CE, weight (valid ← k)·0.8^k / T_rows,
//!            gradient in place → dz_k, dlm_head
//!  backward  the reverse, step K−1 first; a step's keys collect the gradients of every later step's queries
//!            before their projection's backward; the norms' weight gradients in one pass over all steps
//!  update    crate::model::update (shared)
//! ```
//!
//! The loss is SpecForge's: per step `Σ_rows −Σ p log q` over all `T = N·S` rows (padding included) divided by
//! `T`, i.e. the mean over sequences of the per-sequence sum divided by `S`; the total `Σ_k decay^k · loss_k`,
//! not renormalised. `step_scalars` after a step: `[‖g‖, clip, loss, loss_k (weighted) …, correct_k …,
//! supervised_k …, accepted]` for `k < K`; accuracy_k = correct_k / supervised_k over the shifted loss mask, and
//! `accepted` the sum over start rows of the TTT steps right in a row from step 0 (the exact acceptance length's
//! numerator, `draftpipe_gpu_kernels::acceptance`).
//!
//! Nothing here reads back or allocates on the step path: every size is the bucket's, so the CUDA backend can
//! capture each part as a graph.

mod backward;
mod buffers;
pub mod export;
mod family;
mod offsets;
pub mod vocab;

use draftpipe_compiler::plan::{AdamWSpec, Eagle3Spec, LossSpec, ModelPlan, WorkspaceLayout};
use draftpipe_compiler::workspace::STEP_SCALARS;

use crate::backend::{Backend, BackendError, BackendResult, HsOperand, HsSrc, Operand, Precision};
use crate::model::layers::{self, MlpDims, SwigluWeights};
use crate::model::step::{AllocateError, StepShape};
use crate::model::update::{FlatBuffers, Optimizer};

pub use crate::backend::eagle3::{UnrollAttention, UnrollSaved};
pub use buffers::{Eagle3Frozen, Eagle3Workspace};
pub use family::ttt_metrics;
pub use offsets::Eagle3Offsets;

/// SpecForge's TTT step weight when the plan gives none (`0.8^k`).
pub const DEFAULT_STEP_DECAY: f32 = 0.8;

/// The `eagle3` drafter on one backend: its settings, state buffers and workspace.
pub struct Eagle3<B: Backend> {
    offsets: Eagle3Offsets,
    step_decay: f32,
    /// AdamW's settings and schedule.
    pub(crate) optimizer: Optimizer,
    precision: Precision,
    chunk_rows: usize,
    /// The flat state (trained tensors only).
    pub state: FlatBuffers<B>,
    /// Whether a draft vocabulary was uploaded.
    vocab_uploaded: bool,
    /// Whether `teacher_head` holds the rows of the current `lm_head` and draft vocabulary.
    teacher_gathered: bool,
    /// The workspace and the frozen tables.
    pub ws: Eagle3Workspace<B>,
}

/// Why the frozen tables do not fit the model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrozenError {
    /// A table has another length than the model's dimensions give it.
    #[error("frozen `{name}` has {got} elements, the model needs {expected}")]
    Length {
        /// The table.
        name: &'static str,
        /// Elements the model needs.
        expected: usize,
        /// Elements given.
        got: usize,
    },
    /// `d2t` maps a draft token outside the target vocabulary.
    #[error(
        "d2t[{draft}] = {offset} maps draft token {draft} to {target}, outside the vocabulary of {vocab}"
    )]
    D2tOutOfRange {
        /// The draft token.
        draft: usize,
        /// Its offset.
        offset: i64,
        /// The target token it names.
        target: i64,
        /// The vocabulary.
        vocab: usize,
    },
}

impl<B: Backend> Eagle3<B> {
    /// The model of `plan` on `backend`, state zeroed, workspace allocated from `layout`; the frozen tables are
    /// zero until the drafter uploads them ([`Family::frozen_mut`](crate::model::Family::frozen_mut)) and the
    /// draft vocabulary ([`Eagle3::upload_vocab_map`]).
    ///
    /// # Errors
    /// When the layout lacks a buffer or the backend cannot allocate.
    pub fn new(
        backend: &mut B,
        (model, offsets): (&ModelPlan, Eagle3Offsets),
        loss: LossSpec,
        optimizer: AdamWSpec,
        precision: Precision,
        layout: &WorkspaceLayout,
    ) -> Result<Self, AllocateError> {
        Ok(Self {
            step_decay: loss.step_decay.unwrap_or(DEFAULT_STEP_DECAY),
            optimizer: Optimizer::new(optimizer),
            precision,
            chunk_rows: layout.chunk_rows,
            state: FlatBuffers::zeroed(backend, model.parameters)?,
            vocab_uploaded: false,
            teacher_gathered: false,
            ws: Eagle3Workspace::allocate(backend, layout, offsets.spec())?,
            offsets,
        })
    }

    /// The model's dimensions.
    pub fn spec(&self) -> &Eagle3Spec {
        self.offsets.spec()
    }

    /// Copies the draft vocabulary to the device: `d2t` (draft token `d` is target token `d + d2t[d]`,
    /// SpecForge's offsets) and `t2d` (`[vocab]`, whether the target token is in the draft vocabulary), as
    /// SpecForge's `vocab_mapping` (and `draftpipe vocab`) write them.
    /// The teacher's rows of the target's `lm_head` are gathered from it when the next batch is staged (after
    /// the frozen tables, whichever is uploaded last).
    ///
    /// # Errors
    /// [`FrozenError`] (nothing is uploaded then) inside `Ok`; backend failures outside.
    pub fn upload_vocab_map(
        &mut self,
        be: &mut B,
        d2t: &[i64],
        t2d: &[bool],
    ) -> BackendResult<Result<(), FrozenError>> {
        let (v, vd) = (self.spec().vocab, self.spec().draft_vocab);
        for (name, expected, got) in [("d2t", vd, d2t.len()), ("t2d", v, t2d.len())] {
            if expected != got {
                return Ok(Err(FrozenError::Length {
                    name,
                    expected,
                    got,
                }));
            }
        }
        let mut ids = Vec::with_capacity(vd);
        for (draft, &offset) in d2t.iter().enumerate() {
            let target = draft as i64 + offset;
            if target < 0 || target >= v as i64 || !t2d[target as usize] {
                return Ok(Err(FrozenError::D2tOutOfRange {
                    draft,
                    offset,
                    target,
                    vocab: v,
                }));
            }
            ids.push(target as u32);
        }
        let t2d: Vec<u8> = t2d.iter().map(|&member| u8::from(member)).collect();
        be.upload(self.ws.frozen.t2d.all_mut(), &t2d)?;
        be.upload(self.ws.frozen.draft_ids.all_mut(), &ids)?;
        self.vocab_uploaded = true;
        self.teacher_gathered = false;
        Ok(Ok(()))
    }

    /// Gathers the teacher's rows of the target's `lm_head` by the draft vocabulary, when either changed since
    /// the last gather. Fails when no draft vocabulary was uploaded (the teacher would be all zeros).
    pub(super) fn gather_teacher(&mut self, be: &mut B) -> BackendResult {
        if !self.vocab_uploaded {
            return Err(BackendError::Unsupported(
                "an eagle3 drafter needs its draft vocabulary (vocab map) before the first batch"
                    .to_owned(),
            ));
        }
        if !self.teacher_gathered {
            let frozen = &mut self.ws.frozen;
            be.embedding_gather(
                frozen.lm_head.all(),
                frozen.draft_ids.all(),
                frozen.teacher_head.all_mut(),
            )?;
            self.teacher_gathered = true;
        }
        Ok(())
    }

    /// The batch's shifts and teacher rows, `fc`, and the unroll up to each step's midlayer output.
    pub(super) fn forward(&mut self, be: &mut B, shape: StepShape, slot: usize) -> BackendResult {
        let spec = self.offsets.spec();
        let (h, d, i, vocab) = (
            spec.hidden,
            spec.taps * spec.hidden,
            spec.intermediate,
            spec.vocab,
        );
        let (heads, kvh, hd) = (spec.heads, spec.kv_heads, spec.head_dim);
        let (qd, kd) = (heads * hd, kvh * hd);
        let (eps, theta, steps) = (spec.rms_norm_eps, spec.rope_theta, spec.ttt);
        let (t, len) = (shape.tokens(), shape.padded_len);
        let th = t * h;
        let (p, at) = (self.precision, &self.offsets);
        let (ws, params) = (&mut self.ws, &self.state.params);
        let input = &ws.inputs[slot];
        let last = input
            .last_hidden_states
            .as_ref()
            .expect("an eagle3 input slot holds last_hidden_states");
        // Once per batch: the shifts by one, and the rows the teacher supervises.
        be.shift_ids(input.input_ids.at(0, t), ws.ids.at_mut(0, t), len, 1)?;
        be.shift_rows(last.at(0, th), ws.teacher_hs.at_mut(0, th), h, len, 1)?;
        let chunk = self.chunk_rows.clamp(1, t.max(1));
        let lm_full = Operand::new(ws.frozen.lm_head.all(), vocab, h);
        for start in (0..t).step_by(chunk) {
            let rows = chunk.min(t - start);
            be.gemm(
                ws.logits.at_mut(0, rows * vocab),
                Operand::new(ws.teacher_hs.at(start * h, rows * h), rows, h),
                lm_full.t(),
                1.0,
                0.0,
                Precision::F32,
            )?;
            be.argmax_in_draft(
                ws.logits.at(0, rows * vocab),
                ws.frozen.t2d.all(),
                input.loss_mask.at(start, rows),
                ws.row_valid.at_mut(start, rows),
            )?;
        }
        // h₀ = fc(hs), the first of the stacked `xs`.
        be.gemm_hs(
            ws.xs.at_mut(0, th),
            HsOperand::new(input.hs.at(0, t * d), t, d),
            Operand::new(params.at(at.fc, h * d), h, d).t().into(),
            1.0,
            0.0,
            p,
        )?;
        let scale = 1.0 / (hd as f32).sqrt();
        for k in 0..steps {
            let (kth, kt) = (k * th, k * t);
            be.step_positions(ws.positions.at_mut(0, t), len, k)?;
            be.shift_ids(ws.ids.at(0, t), ws.step_ids.at_mut(0, t), len, k)?;
            be.embedding_gather(
                ws.frozen.embed.all(),
                ws.step_ids.at(0, t),
                ws.emb.at_mut(kth, th),
            )?;
            // c = [input_layernorm(e) | hidden_norm(h_k)]; `dh` and `dmid` are free until the backward.
            be.rmsnorm_forward(
                ws.emb.at(kth, th),
                params.at(at.input_layernorm, h),
                ws.dh.at_mut(0, th),
                ws.emb_inv_rms.at_mut(kt, t),
                eps,
            )?;
            be.rmsnorm_forward(
                ws.xs.at(kth, th),
                params.at(at.hidden_norm, h),
                ws.dmid.at_mut(0, th),
                ws.h_inv_rms.at_mut(kt, t),
                eps,
            )?;
            be.concat_columns(
                ws.dh.at(0, th),
                ws.dmid.at(0, th),
                ws.cat.at_mut(2 * kth, 2 * th),
                h,
                h,
            )?;
            let cat = Operand::new(ws.cat.at(2 * kth, 2 * th), t, 2 * h);
            for (out, offset, width) in [
                (&mut ws.q, at.q_proj, qd),
                (&mut ws.k, at.k_proj, kd),
                (&mut ws.v, at.v_proj, kd),
            ] {
                be.gemm(
                    out.at_mut(k * t * width, t * width),
                    cat,
                    Operand::new(params.at(offset, width * 2 * h), width, 2 * h).t(),
                    1.0,
                    0.0,
                    p,
                )?;
            }
            let positions = ws.positions.at(0, t);
            be.rope(
                ws.q.at_mut(k * t * qd, t * qd),
                positions,
                theta,
                heads,
                hd,
                false,
            )?;
            be.rope(
                ws.k.at_mut(k * t * kd, t * kd),
                positions,
                theta,
                kvh,
                hd,
                false,
            )?;
            be.eagle3_attention_forward(
                ws.q.at(k * t * qd, t * qd),
                ws.k.at(0, (k + 1) * t * kd),
                ws.v.at(0, (k + 1) * t * kd),
                ws.attn.at_mut(k * t * qd, t * qd),
                ws.lse.at_mut(k * t * heads, t * heads),
                UnrollAttention {
                    rows: t,
                    padded_len: len,
                    step: k,
                    heads,
                    kv_heads: kvh,
                    head_dim: hd,
                    scale,
                },
            )?;
            // m = h_k + a·Woᵀ
            be.copy(ws.mid.at_mut(kth, th), ws.xs.at(kth, th))?;
            be.gemm(
                ws.mid.at_mut(kth, th),
                Operand::new(ws.attn.at(k * t * qd, t * qd), t, qd),
                Operand::new(params.at(at.o_proj, h * qd), h, qd).t(),
                1.0,
                1.0,
                p,
            )?;
            // h_{k+1} = m + swiglu(post_attention_layernorm(m)·[Wg; Wu]ᵀ)·Wdᵀ
            be.rmsnorm_forward(
                ws.mid.at(kth, th),
                params.at(at.post_attention_layernorm, h),
                ws.normed2.at_mut(kth, th),
                ws.inv_rms2.at_mut(kt, t),
                eps,
            )?;
            layers::swiglu_mlp_forward(
                be,
                MlpDims {
                    rows: t,
                    hidden: h,
                    intermediate: i,
                },
                (
                    Operand::new(ws.normed2.at(kth, th), t, h).into(),
                    ws.mid.at(kth, th),
                ),
                (
                    SwigluWeights {
                        gate_up: params.at(at.gate_up, 2 * i * h),
                        down: params.at(at.down_proj, h * i),
                    },
                    Operand::new(params.at(at.gate_up, 2 * i * h), 2 * i, h).into(),
                ),
                ((&mut ws.gate_up, kt * 2 * i), (&mut ws.act, kt * i), None),
                ws.xs.at_mut(kth + th, th),
                p,
            )?;
        }
        Ok(())
    }

    /// Per step: the final norm, then chunk by chunk the draft head and the teacher on the draft vocabulary and
    /// the fused soft-label loss (never `[T, Vd]`), writing `dz_k` and, with `train`, the `lm_head` gradient;
    /// the loss total, per-step losses, correct and supervised rows into the step scalars.
    pub(super) fn loss(
        &mut self,
        be: &mut B,
        shape: StepShape,
        slot: usize,
        train: bool,
    ) -> BackendResult {
        let spec = self.offsets.spec();
        let (h, vd, eps, steps) = (spec.hidden, spec.draft_vocab, spec.rms_norm_eps, spec.ttt);
        let (t, len) = (shape.tokens(), shape.padded_len);
        let th = t * h;
        let (p, at) = (self.precision, &self.offsets);
        let (ws, state) = (&mut self.ws, &mut self.state);
        let (params, grads) = (&state.params, &mut state.grads);
        let chunk = self.chunk_rows.clamp(1, t.max(1));
        let head = Operand::new(params.at(at.lm_head, vd * h), vd, h);
        let teacher_head = Operand::new(ws.frozen.teacher_head.all(), vd, h);
        let mut decay = 1.0f32;
        for k in 0..steps {
            let (kth, kt) = (k * th, k * t);
            be.rmsnorm_forward(
                ws.xs.at(kth + th, th),
                params.at(at.norm, h),
                ws.z.at_mut(0, th),
                ws.final_inv_rms.at_mut(kt, t),
                eps,
            )?;
            be.shift_rows(
                HsSrc::F32(ws.teacher_hs.at(0, th)),
                ws.step_teacher_hs.at_mut(0, th),
                h,
                len,
                k,
            )?;
            be.shift_rows(
                HsSrc::F32(ws.row_valid.at(0, t)),
                ws.step_weight.at_mut(0, t),
                1,
                len,
                k,
            )?;
            for start in (0..t).step_by(chunk) {
                let rows = chunk.min(t - start);
                let n = rows * vd;
                let z = Operand::new(ws.z.at(start * h, rows * h), rows, h);
                be.gemm(ws.logits.at_mut(0, n), z, head.t(), 1.0, 0.0, p)?;
                be.gemm(
                    ws.teacher_logits.at_mut(0, n),
                    Operand::new(ws.step_teacher_hs.at(start * h, rows * h), rows, h),
                    teacher_head.t(),
                    1.0,
                    0.0,
                    Precision::F32,
                )?;
                be.soft_label_loss(
                    ws.logits.at_mut(0, n),
                    ws.teacher_logits.at(0, n),
                    ws.step_weight.at(start, rows),
                    ws.row_loss.at_mut(kt + start, rows),
                    ws.correct.at_mut(kt + start, rows),
                    decay / t as f32,
                    vd,
                )?;
                let dlogits = Operand::new(ws.logits.at(0, n), rows, vd);
                be.gemm(
                    ws.dz.at_mut(kth + start * h, rows * h),
                    dlogits,
                    head,
                    1.0,
                    0.0,
                    p,
                )?;
                if train {
                    let first = k == 0 && start == 0;
                    be.gemm(
                        grads.at_mut(at.lm_head, vd * h),
                        dlogits.t(),
                        z,
                        1.0,
                        if first { 0.0 } else { 1.0 },
                        p,
                    )?;
                }
            }
            be.sum(
                ws.row_loss.at(kt, t),
                ws.loss_partials.all_mut(),
                ws.step_scalars.at_mut(STEP_SCALARS + k, 1),
            )?;
            be.sum(
                ws.correct.at(kt, t),
                ws.loss_partials.all_mut(),
                ws.step_scalars.at_mut(STEP_SCALARS + steps + k, 1),
            )?;
            decay *= self.step_decay;
        }
        be.step_mask_counts(
            ws.inputs[slot].loss_mask.at(0, t),
            ws.step_scalars.at_mut(STEP_SCALARS + 2 * steps, steps),
            len,
        )?;
        // Start row r's unroll: step k's row r drafts token r + k + 1 from the steps before it, so its chain is
        // `correct[k · t + r]` for k = 0, 1, …; a row past its sequence's end has weight 0, so `correct` 0.
        be.accepted_prefix_sum(
            ws.correct.at(0, steps * t),
            ws.step_scalars.at_mut(STEP_SCALARS + 3 * steps, 1),
            (t, steps),
            (1, t),
        )?;
        be.sum(
            ws.row_loss.at(0, steps * t),
            ws.loss_partials.all_mut(),
            ws.step_scalars.at_mut(2, 1),
        )
    }
}
