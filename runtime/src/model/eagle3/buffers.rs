//! Every buffer of [`WorkspaceLayout::eagle3`], allocated by name, and the frozen target tables the step reads:
//! the embedding, the whole `lm_head` (the once-per-batch argmax), its rows `d2t` selects (the teacher on the
//! draft vocabulary), `t2d` and the draft tokens' target ids.

use draftpipe_compiler::plan::{Eagle3Spec, WorkspaceLayout};

use crate::backend::{Backend, Buf, InputSlot};
use crate::model::step::{AllocateError, input_slot, take_buffer as take};

/// The target's frozen tables on the device (f32 whatever the checkpoint's dtype; not part of the trained
/// state).
#[allow(missing_docs)] // each field is the table of the same name
pub struct Eagle3Frozen<B: Backend> {
    /// `[vocab, hidden]`.
    pub embed: Buf<B, f32>,
    /// The target's whole `lm_head`, `[vocab, hidden]`.
    pub lm_head: Buf<B, f32>,
    /// `lm_head` rows `d + d2t[d]` for each draft token `d`, `[draft_vocab, hidden]`, gathered once.
    pub teacher_head: Buf<B, f32>,
    /// `[vocab]`: 1 where the target token is in the draft vocabulary.
    pub t2d: Buf<B, u8>,
    /// `[draft_vocab]`: the target token of each draft token (`d + d2t[d]`), the gather's indices.
    pub draft_ids: Buf<B, u32>,
}

#[allow(missing_docs)] // each field is the layout buffer of the same name
pub struct Eagle3Workspace<B: Backend> {
    pub frozen: Eagle3Frozen<B>,
    pub(crate) ids: Buf<B, u32>,
    pub(crate) teacher_hs: Buf<B, f32>,
    pub(crate) row_valid: Buf<B, f32>,
    pub(crate) step_ids: Buf<B, u32>,
    pub(crate) step_teacher_hs: Buf<B, f32>,
    pub(crate) step_weight: Buf<B, f32>,
    pub(crate) positions: Buf<B, u32>,
    pub(crate) xs: Buf<B, f32>,
    pub(crate) emb: Buf<B, f32>,
    pub(crate) emb_inv_rms: Buf<B, f32>,
    pub(crate) h_inv_rms: Buf<B, f32>,
    pub(crate) cat: Buf<B, f32>,
    pub(crate) q: Buf<B, f32>,
    pub(crate) k: Buf<B, f32>,
    pub(crate) v: Buf<B, f32>,
    pub(crate) attn: Buf<B, f32>,
    pub(crate) lse: Buf<B, f32>,
    pub(crate) mid: Buf<B, f32>,
    pub(crate) normed2: Buf<B, f32>,
    pub(crate) inv_rms2: Buf<B, f32>,
    pub(crate) gate_up: Buf<B, f32>,
    pub(crate) act: Buf<B, f32>,
    pub(crate) final_inv_rms: Buf<B, f32>,
    pub(crate) z: Buf<B, f32>,
    pub(crate) logits: Buf<B, f32>,
    pub(crate) teacher_logits: Buf<B, f32>,
    pub(crate) row_loss: Buf<B, f32>,
    pub(crate) correct: Buf<B, f32>,
    pub(crate) loss_partials: Buf<B, f32>,
    pub(crate) dz: Buf<B, f32>,
    pub(crate) d_emb_normed: Buf<B, f32>,
    pub(crate) d_h_normed: Buf<B, f32>,
    pub(crate) dnormed2: Buf<B, f32>,
    pub(crate) dk: Buf<B, f32>,
    pub(crate) dv: Buf<B, f32>,
    pub(crate) dh: Buf<B, f32>,
    pub(crate) dmid: Buf<B, f32>,
    pub(crate) dcat: Buf<B, f32>,
    pub(crate) dact: Buf<B, f32>,
    pub(crate) dgate_up: Buf<B, f32>,
    pub(crate) dattn: Buf<B, f32>,
    pub(crate) dq: Buf<B, f32>,
    pub(crate) attn_delta: Buf<B, f32>,
    pub(crate) norm_partials: Buf<B, f32>,
    pub(crate) grad_norm_partials: Buf<B, f32>,
    pub step_scalars: Buf<B, f32>,
    pub(crate) adamw_step: Buf<B, f32>,
    pub adamw_state: Buf<B, f64>,
    pub inputs: Vec<InputSlot<B>>,
}

impl<B: Backend> Eagle3Workspace<B> {
    /// Allocates every buffer of `layout` and the frozen tables of `spec`.
    ///
    /// # Errors
    /// When the layout lacks a buffer or the backend cannot allocate.
    pub fn allocate(
        be: &mut B,
        layout: &WorkspaceLayout,
        spec: &Eagle3Spec,
    ) -> Result<Self, AllocateError> {
        let inputs = (0..layout.input_slots)
            .map(|slot| input_slot(be, layout, slot))
            .collect::<Result<_, _>>()?;
        let (v, vd, h) = (spec.vocab, spec.draft_vocab, spec.hidden);
        Ok(Self {
            frozen: Eagle3Frozen {
                embed: be.alloc(v * h)?,
                lm_head: be.alloc(v * h)?,
                teacher_head: be.alloc(vd * h)?,
                t2d: be.alloc(v)?,
                draft_ids: be.alloc(vd)?,
            },
            ids: take(be, layout, "ids")?,
            teacher_hs: take(be, layout, "teacher_hs")?,
            row_valid: take(be, layout, "row_valid")?,
            step_ids: take(be, layout, "step_ids")?,
            step_teacher_hs: take(be, layout, "step_teacher_hs")?,
            step_weight: take(be, layout, "step_weight")?,
            positions: take(be, layout, "positions")?,
            xs: take(be, layout, "xs")?,
            emb: take(be, layout, "emb")?,
            emb_inv_rms: take(be, layout, "emb_inv_rms")?,
            h_inv_rms: take(be, layout, "h_inv_rms")?,
            cat: take(be, layout, "cat")?,
            q: take(be, layout, "q")?,
            k: take(be, layout, "k")?,
            v: take(be, layout, "v")?,
            attn: take(be, layout, "attn")?,
            lse: take(be, layout, "lse")?,
            mid: take(be, layout, "mid")?,
            normed2: take(be, layout, "normed2")?,
            inv_rms2: take(be, layout, "inv_rms2")?,
            gate_up: take(be, layout, "gate_up")?,
            act: take(be, layout, "act")?,
            final_inv_rms: take(be, layout, "final_inv_rms")?,
            z: take(be, layout, "z")?,
            logits: take(be, layout, "logits")?,
            teacher_logits: take(be, layout, "teacher_logits")?,
            row_loss: take(be, layout, "row_loss")?,
            correct: take(be, layout, "correct")?,
            loss_partials: take(be, layout, "loss_partials")?,
            dz: take(be, layout, "dz")?,
            d_emb_normed: take(be, layout, "d_emb_normed")?,
            d_h_normed: take(be, layout, "d_h_normed")?,
            dnormed2: take(be, layout, "dnormed2")?,
            dk: take(be, layout, "dk")?,
            dv: take(be, layout, "dv")?,
            dh: take(be, layout, "dh")?,
            dmid: take(be, layout, "dmid")?,
            dcat: take(be, layout, "dcat")?,
            dact: take(be, layout, "dact")?,
            dgate_up: take(be, layout, "dgate_up")?,
            dattn: take(be, layout, "dattn")?,
            dq: take(be, layout, "dq")?,
            attn_delta: take(be, layout, "attn_delta")?,
            norm_partials: take(be, layout, "norm_partials")?,
            grad_norm_partials: take(be, layout, "grad_norm_partials")?,
            step_scalars: take(be, layout, "step_scalars")?,
            adamw_step: take(be, layout, "adamw_step")?,
            adamw_state: take(be, layout, "adamw_state")?,
            inputs,
        })
    }
}
