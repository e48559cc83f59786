//! Every buffer of [`WorkspaceLayout::dflash`], allocated by name: the frozen target tensors, the activations
//! the backward pass reads again, the backward scratch, the optimizer's scalars, and per input slot the batch
//! and its host-built block plan.

use draftpipe_compiler::plan::WorkspaceLayout;

use crate::backend::head::HeadOperands;
use crate::backend::{AttentionInputs, Backend, Buf, Dst, InputSlot, Src};
use crate::model::step::{AllocateError, input_slot, take_buffer as take};

/// One input slot's block plan on the device (see [`super::blocks::BlockPlan`]).
pub struct PlanSlot<B: Backend> {
    /// Token id of each block row `[Q]`.
    pub block_ids: Buf<B, u32>,
    /// RoPE positions: the context rows `[T]`, then the block rows `[Q]`.
    pub positions: Buf<B, u32>,
    /// `[Q, 4]` key ranges of each query row.
    pub query_ranges: Buf<B, u32>,
    /// `[T, 2]` query ranges of each context key.
    pub context_key_ranges: Buf<B, u32>,
    /// `[Q, 2]` query ranges of each block key.
    pub block_key_ranges: Buf<B, u32>,
    /// The block row of each head row (the labelled rows, then padding; see `backend::head`).
    pub head_rows: Buf<B, u32>,
    /// The head row of each block row.
    pub head_index: Buf<B, u32>,
    /// Label of each head row (−1: none).
    pub labels: Buf<B, i32>,
    /// Loss weight of each head row.
    pub weights: Buf<B, f32>,
    /// `1 / Σ weights`.
    pub inv_weight_sum: Buf<B, f32>,
}

/// The flash path's bf16 copies (the layout's `flash_*`): every layer's attention operands, stacked as the f32
/// ones are, written by their producers in the forward and read again by the backward, and one layer's output
/// gradient copy; present exactly where the compiler's rule puts the worker on the flash kernels
/// (`draftpipe_compiler::family::dflash::flash`, `backend/flash.rs`).
pub(crate) struct FlashCopies<B: Backend> {
    /// Queries `[layers, Q, heads, D]`, written by RoPE.
    pub(crate) q: Buf<B, half::bf16>,
    /// Context keys `[layers, T, kv_heads, D]`, written by RoPE.
    pub(crate) k_ctx: Buf<B, half::bf16>,
    /// Context values `[layers, T, kv_heads, D]`, rounded after their product.
    pub(crate) v_ctx: Buf<B, half::bf16>,
    /// Block keys `[layers, Q, kv_heads, D]`, written by RoPE.
    pub(crate) k_blk: Buf<B, half::bf16>,
    /// Block values `[layers, Q, kv_heads, D]`, rounded after their product.
    pub(crate) v_blk: Buf<B, half::bf16>,
    /// The output gradient's copy `[Q, heads, D]`, scratch of one layer's backward.
    dout: Buf<B, half::bf16>,
}

impl<B: Backend> FlashCopies<B> {
    /// The copies `layout` lists, or `None` when it lists none (the f32 attention path).
    fn take(be: &mut B, layout: &WorkspaceLayout) -> Result<Option<Self>, AllocateError> {
        if layout.elements("flash_q").is_none() {
            return Ok(None);
        }
        Ok(Some(Self {
            q: take(be, layout, "flash_q")?,
            k_ctx: take(be, layout, "flash_k_ctx")?,
            v_ctx: take(be, layout, "flash_v_ctx")?,
            k_blk: take(be, layout, "flash_k_blk")?,
            v_blk: take(be, layout, "flash_v_blk")?,
            dout: take(be, layout, "flash_dout")?,
        }))
    }

    /// Layer `layer`'s copies as the flash kernels' inputs (`q_len = Q·heads·D`, `ctx_len = T·kv_heads·D`,
    /// `blk_len = Q·kv_heads·D` elements each) with `query_ranges`, and the output gradient's scratch.
    pub(crate) fn layer<'a>(
        &'a mut self,
        layer: usize,
        (q_len, ctx_len, blk_len): (usize, usize, usize),
        query_ranges: Src<'a, B, u32>,
    ) -> (AttentionInputs<'a, B, half::bf16>, Dst<'a, B, half::bf16>) {
        (
            AttentionInputs {
                q: self.q.at(layer * q_len, q_len),
                k_ctx: self.k_ctx.at(layer * ctx_len, ctx_len),
                v_ctx: self.v_ctx.at(layer * ctx_len, ctx_len),
                k_blk: self.k_blk.at(layer * blk_len, blk_len),
                v_blk: self.v_blk.at(layer * blk_len, blk_len),
                query_ranges,
            },
            self.dout.at_mut(0, q_len),
        )
    }
}

/// The forward's bf16 copies CUDA's products read at `bf16` precision beside the f32 values (the layout's
/// `*_bf16` of activations; `params_bf16` is the flat state's), each written by the kernel that writes its f32
/// value; the backward reads the per-layer ones again.
pub(crate) struct OperandCopies<B: Backend> {
    /// `ctx`, written by hidden_norm.
    pub(crate) ctx: Buf<B, half::bf16>,
    /// `normed` per layer, written by the input norm (the q/k/v products, forward and weight gradients).
    pub(crate) normed: Buf<B, half::bf16>,
    /// `attn` per layer, in a pass after attention (o_proj, forward and weight gradient).
    pub(crate) attn: Buf<B, half::bf16>,
    /// `normed2` per layer, written by the post-attention norm (gate_up, forward and weight gradient).
    pub(crate) normed2: Buf<B, half::bf16>,
    /// `act` per layer, written by the SwiGLU (down, forward and weight gradient).
    pub(crate) act: Buf<B, half::bf16>,
}

/// The backward's gradients rounded to bf16 beside their f32 values, where the layout keeps them (CUDA at
/// `bf16`), one layer at a time: the products that read a gradient read this copy.
pub(crate) struct GradientCopies<B: Backend> {
    /// `dx`, written by the norms' backward (the down and o_proj gradient products).
    pub(crate) dx: Buf<B, half::bf16>,
    /// The other gradients in turn, each read by the two products after the kernel that writes it.
    pub(crate) grad: Buf<B, half::bf16>,
}

impl<B: Backend> GradientCopies<B> {
    /// The copies `layout` lists, or `None` when it lists none.
    fn take(be: &mut B, layout: &WorkspaceLayout) -> Result<Option<Self>, AllocateError> {
        if layout.elements("dx_bf16").is_none() {
            return Ok(None);
        }
        Ok(Some(Self {
            dx: take(be, layout, "dx_bf16")?,
            grad: take(be, layout, "grad_bf16")?,
        }))
    }
}

impl<B: Backend> OperandCopies<B> {
    /// The copies `layout` lists, or `None` when it lists none (f32 operands: the CPU, f32 and TF32).
    fn take(be: &mut B, layout: &WorkspaceLayout) -> Result<Option<Self>, AllocateError> {
        if layout.elements("ctx_bf16").is_none() {
            return Ok(None);
        }
        Ok(Some(Self {
            ctx: take(be, layout, "ctx_bf16")?,
            normed: take(be, layout, "normed_bf16")?,
            attn: take(be, layout, "attn_bf16")?,
            normed2: take(be, layout, "normed2_bf16")?,
            act: take(be, layout, "act_bf16")?,
        }))
    }
}

/// The head's product operands (`backend::head`): the gathered rows in f32, or on CUDA at `bf16` the 16-bit
/// copies the layout keeps instead (`head_z_bf16`, `lm_head_bf16`, `logits_bf16`).
pub(crate) enum HeadBuffers<B: Backend> {
    F32 {
        z: Buf<B, f32>,
    },
    Bf16 {
        z: Buf<B, half::bf16>,
        /// The frozen `lm_head` rounded to bf16, written when the target's tensors are uploaded.
        lm_head: Buf<B, half::bf16>,
        logits: Buf<B, half::bf16>,
    },
}

impl<B: Backend> HeadBuffers<B> {
    fn take(be: &mut B, layout: &WorkspaceLayout) -> Result<Self, AllocateError> {
        if layout.elements("head_z_bf16").is_none() {
            return Ok(Self::F32 {
                z: take(be, layout, "head_z")?,
            });
        }
        Ok(Self::Bf16 {
            z: take(be, layout, "head_z_bf16")?,
            lm_head: take(be, layout, "lm_head_bf16")?,
            logits: take(be, layout, "logits_bf16")?,
        })
    }

    /// The operands of a head over `m` rows of `h` in chunks of `chunk_len` logits.
    pub(crate) fn operands(&mut self, m: usize, h: usize, chunk_len: usize) -> HeadOperands<'_, B> {
        match self {
            Self::F32 { z } => HeadOperands::F32 {
                z: z.at_mut(0, m * h),
            },
            Self::Bf16 { z, lm_head, logits } => HeadOperands::Bf16 {
                lm_head: lm_head.all(),
                z: z.at_mut(0, m * h),
                logits: logits.at_mut(0, chunk_len),
            },
        }
    }

    /// `lm_head`'s bf16 copy to write after an upload of `lm_head`, when the head keeps one.
    pub(crate) fn lm_head_copy(&mut self) -> Option<Dst<'_, B, half::bf16>> {
        match self {
            Self::F32 { .. } => None,
            Self::Bf16 { lm_head, .. } => Some(lm_head.all_mut()),
        }
    }
}

/// The `dflash` workspace (names as in [`WorkspaceLayout::dflash`]; per-layer buffers are stacked) and the
/// target's frozen tensors, which `compile` reports apart (`frozen_weights`).
#[allow(missing_docs)] // each field is the layout buffer of the same name
pub struct DflashWorkspace<B: Backend> {
    /// The target's frozen embedding `[V, H]`.
    pub embed: Buf<B, f32>,
    /// The target's frozen `lm_head` `[V, H]` (a tied one is a second copy of the embedding).
    pub lm_head: Buf<B, f32>,
    pub(crate) ctx_pre: Buf<B, f32>,
    pub(crate) ctx: Buf<B, f32>,
    pub(crate) ctx_inv_rms: Buf<B, f32>,
    pub(crate) xs: Vec<Buf<B, f32>>,
    pub(crate) normed: Buf<B, f32>,
    pub(crate) inv_rms: Buf<B, f32>,
    pub(crate) q_raw: Buf<B, f32>,
    pub(crate) q_inv_rms: Buf<B, f32>,
    pub(crate) q: Buf<B, f32>,
    pub(crate) k_blk_raw: Buf<B, f32>,
    pub(crate) k_blk_inv_rms: Buf<B, f32>,
    pub(crate) k_blk: Buf<B, f32>,
    pub(crate) v_blk: Buf<B, f32>,
    pub(crate) k_ctx_raw: Buf<B, f32>,
    pub(crate) k_ctx_inv_rms: Buf<B, f32>,
    pub(crate) k_ctx: Buf<B, f32>,
    pub(crate) v_ctx: Buf<B, f32>,
    pub(crate) attn: Buf<B, f32>,
    pub(crate) lse: Buf<B, f32>,
    pub(crate) mid: Buf<B, f32>,
    pub(crate) normed2: Buf<B, f32>,
    pub(crate) inv_rms2: Buf<B, f32>,
    pub(crate) gate_up: Buf<B, f32>,
    pub(crate) act: Buf<B, f32>,
    pub(crate) z: Buf<B, f32>,
    pub(crate) final_inv_rms: Buf<B, f32>,
    pub(crate) head: HeadBuffers<B>,
    pub(crate) head_dz: Buf<B, f32>,
    pub(crate) logits: Buf<B, f32>,
    pub(crate) row_loss: Buf<B, f32>,
    pub(crate) head_correct: Buf<B, f32>,
    pub(crate) correct: Buf<B, f32>,
    pub(crate) loss_partials: Buf<B, f32>,
    pub(crate) ones: Buf<B, f32>,
    pub(crate) dz: Buf<B, f32>,
    pub(crate) dx: Buf<B, f32>,
    pub(crate) dnormed: Buf<B, f32>,
    pub(crate) dact: Buf<B, f32>,
    pub(crate) dgate_up: Buf<B, f32>,
    pub(crate) dattn: Buf<B, f32>,
    pub(crate) dq: Buf<B, f32>,
    pub(crate) dq_raw: Buf<B, f32>,
    pub(crate) attn_delta: Buf<B, f32>,
    pub(crate) dk_blk: Buf<B, f32>,
    pub(crate) dv_blk: Buf<B, f32>,
    pub(crate) dk_blk_raw: Buf<B, f32>,
    pub(crate) dk_ctx: Buf<B, f32>,
    pub(crate) dv_ctx: Buf<B, f32>,
    pub(crate) dk_ctx_raw: Buf<B, f32>,
    pub(crate) dctx: Buf<B, f32>,
    pub(crate) dctx_pre: Buf<B, f32>,
    pub(crate) k_norm_grad: Buf<B, f32>,
    pub(crate) norm_partials: Buf<B, f32>,
    pub(crate) grad_norm_partials: Buf<B, f32>,
    /// `[grad_norm, clip_scale, loss, correct rows of slot 0, 1, …]` of the last step.
    pub step_scalars: Buf<B, f32>,
    pub(crate) adamw_step: Buf<B, f32>,
    /// `[steps applied, β1^steps, β2^steps]`.
    pub adamw_state: Buf<B, f64>,
    /// The forward's bf16 operands, where the layout keeps them (CUDA at `bf16` precision).
    pub(crate) copies: Option<OperandCopies<B>>,
    /// The backward's bf16 gradient operands, likewise.
    pub(crate) grad_copies: Option<GradientCopies<B>>,
    /// The flash path's bf16 copies, when this worker takes it.
    pub(crate) flash: Option<FlashCopies<B>>,
    /// The input slots' batches.
    pub inputs: Vec<InputSlot<B>>,
    /// The input slots' block plans.
    pub plans: Vec<PlanSlot<B>>,
}

impl<B: Backend> DflashWorkspace<B> {
    /// Allocates every buffer `layout` lists for this backend's step (the backend-specific entries, cuBLAS's
    /// workspace or the CPU's rounding buffers, are the backend's own), and the two frozen `[V, H]` tensors of
    /// `frozen` elements each.
    ///
    /// # Errors
    /// When the layout lacks a buffer or the backend cannot allocate.
    pub fn allocate(
        be: &mut B,
        layout: &WorkspaceLayout,
        frozen: usize,
    ) -> Result<Self, AllocateError> {
        let mut xs = Vec::new();
        while layout.elements(&format!("xs.{}", xs.len())).is_some() {
            xs.push(take(be, layout, &format!("xs.{}", xs.len()))?);
        }
        let mut inputs = Vec::new();
        let mut plans = Vec::new();
        for slot in 0..layout.input_slots {
            let name = |n: &str| format!("input{slot}.{n}");
            inputs.push(input_slot(be, layout, slot)?);
            plans.push(PlanSlot {
                block_ids: take(be, layout, &name("block_ids"))?,
                positions: take(be, layout, &name("positions"))?,
                query_ranges: take(be, layout, &name("query_ranges"))?,
                context_key_ranges: take(be, layout, &name("context_key_ranges"))?,
                block_key_ranges: take(be, layout, &name("block_key_ranges"))?,
                head_rows: take(be, layout, &name("head_rows"))?,
                head_index: take(be, layout, &name("head_index"))?,
                labels: take(be, layout, &name("labels"))?,
                weights: take(be, layout, &name("weights"))?,
                inv_weight_sum: take(be, layout, &name("inv_weight_sum"))?,
            });
        }
        Ok(Self {
            embed: be.alloc(frozen)?,
            lm_head: be.alloc(frozen)?,
            ctx_pre: take(be, layout, "ctx_pre")?,
            ctx: take(be, layout, "ctx")?,
            ctx_inv_rms: take(be, layout, "ctx_inv_rms")?,
            xs,
            normed: take(be, layout, "normed")?,
            inv_rms: take(be, layout, "inv_rms")?,
            q_raw: take(be, layout, "q_raw")?,
            q_inv_rms: take(be, layout, "q_inv_rms")?,
            q: take(be, layout, "q")?,
            k_blk_raw: take(be, layout, "k_blk_raw")?,
            k_blk_inv_rms: take(be, layout, "k_blk_inv_rms")?,
            k_blk: take(be, layout, "k_blk")?,
            v_blk: take(be, layout, "v_blk")?,
            k_ctx_raw: take(be, layout, "k_ctx_raw")?,
            k_ctx_inv_rms: take(be, layout, "k_ctx_inv_rms")?,
            k_ctx: take(be, layout, "k_ctx")?,
            v_ctx: take(be, layout, "v_ctx")?,
            attn: take(be, layout, "attn")?,
            lse: take(be, layout, "lse")?,
            mid: take(be, layout, "mid")?,
            normed2: take(be, layout, "normed2")?,
            inv_rms2: take(be, layout, "inv_rms2")?,
            gate_up: take(be, layout, "gate_up")?,
            act: take(be, layout, "act")?,
            z: take(be, layout, "z")?,
            final_inv_rms: take(be, layout, "final_inv_rms")?,
            head: HeadBuffers::take(be, layout)?,
            head_dz: take(be, layout, "head_dz")?,
            logits: take(be, layout, "logits")?,
            row_loss: take(be, layout, "row_loss")?,
            head_correct: take(be, layout, "head_correct")?,
            correct: take(be, layout, "correct")?,
            loss_partials: take(be, layout, "loss_partials")?,
            ones: take(be, layout, "ones")?,
            dz: take(be, layout, "dz")?,
            dx: take(be, layout, "dx")?,
            dnormed: take(be, layout, "dnormed")?,
            dact: take(be, layout, "dact")?,
            dgate_up: take(be, layout, "dgate_up")?,
            dattn: take(be, layout, "dattn")?,
            dq: take(be, layout, "dq")?,
            dq_raw: take(be, layout, "dq_raw")?,
            attn_delta: take(be, layout, "attn_delta")?,
            dk_blk: take(be, layout, "dk_blk")?,
            dv_blk: take(be, layout, "dv_blk")?,
            dk_blk_raw: take(be, layout, "dk_blk_raw")?,
            dk_ctx: take(be, layout, "dk_ctx")?,
            dv_ctx: take(be, layout, "dv_ctx")?,
            dk_ctx_raw: take(be, layout, "dk_ctx_raw")?,
            dctx: take(be, layout, "dctx")?,
            dctx_pre: take(be, layout, "dctx_pre")?,
            k_norm_grad: take(be, layout, "k_norm_grad")?,
            norm_partials: take(be, layout, "norm_partials")?,
            grad_norm_partials: take(be, layout, "grad_norm_partials")?,
            step_scalars: take(be, layout, "step_scalars")?,
            adamw_step: take(be, layout, "adamw_step")?,
            adamw_state: take(be, layout, "adamw_state")?,
            copies: OperandCopies::take(be, layout)?,
            grad_copies: GradientCopies::take(be, layout)?,
            flash: FlashCopies::take(be, layout)?,
            inputs,
            plans,
        })
    }
}
