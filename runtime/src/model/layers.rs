//! Layers the families share, written once over the [`Backend`]: the SwiGLU MLP block forward and backward,
//! an RMSNorm's backward (weight and input gradients), and a linear projection's backward. Each family's step
//! (`model::mlp`, `model::dflash`, …) calls these with its own buffers; the signatures are plain (views,
//! buffers with element offsets, dimensions), so a new family's layer is a sequence of these calls.
//!
//! ```text
//!  swiglu_mlp_forward   gate_up = n·[Wg; Wu]ᵀ → act = silu(g)·u → out = residual + act·Wdᵀ
//!  swiglu_mlp_backward  dWd = dyᵀ·act, dact = dy·Wd → dgate_up → d[Wg; Wu] = dgate_upᵀ·n, dn = dgate_up·[Wg; Wu]
//!  rmsnorm_backward     dw = Σ dy·x·inv_rms, dx (+)= ∂y/∂x · dy
//!  linear_backward      dW (β_W)+= dyᵀ·x, dx (β_x)+= dy·W
//! ```
//!
//! Buffers a layer both writes and then reads (the MLP's saved `gate_up` and `act`, its scratch gradients)
//! are passed as `(buffer, element offset)`, since a write view cannot be read back.
//!
//! On CUDA at `bf16` precision every product reads bf16 copies of both operands (`docs/gpu.md`): the weights'
//! (AdamW's `params_bf16`), the saved activations' (written by their forward kernels) and the gradients'
//! (written by the backward kernel that produces each gradient, in the same pass). Each layer here takes those
//! copies as `Option`s, `None` where the workspace keeps none (the CPU, which rounds inside its products to
//! the same values, and f32/TF32), and then multiplies the f32 values.

use crate::backend::{Backend, BackendResult, Buf, Dst, HsOperand, Operand, Precision, Src};

/// Rows and widths of one SwiGLU MLP block: `rows` tokens of width `hidden`, `intermediate` wide inside.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlpDims {
    /// Rows (tokens) the block runs on.
    pub rows: usize,
    /// Model width `H`.
    pub hidden: usize,
    /// Intermediate width `I`.
    pub intermediate: usize,
}

/// A SwiGLU block's weights: the fused `[gate; up]` projection `[2I, H]` and `down` `[H, I]`.
#[derive(Clone, Copy)]
pub struct SwigluWeights<'a, B: Backend> {
    /// `[gate; up]`, `[2I, H]` (gate rows first).
    pub gate_up: Src<'a, B, f32>,
    /// `down`, `[H, I]`.
    pub down: Src<'a, B, f32>,
}

/// A buffer and the element offset a layer's rows start at.
pub type At<'a, B> = (&'a mut Buf<B, f32>, usize);

/// A bf16 buffer and the element offset a layer's rows start at.
pub type At16<'a, B> = (&'a mut Buf<B, half::bf16>, usize);

/// Where the SwiGLU output's bf16 copy goes and the `down` weight's bf16 copy (CUDA at `bf16`).
pub type DownCopies<'a, B> = (At16<'a, B>, Src<'a, B, half::bf16>);

/// The SwiGLU MLP block forward: `gate_up = normed · [Wg; Wu]ᵀ` (`[rows, 2I]`, saved), `act = silu(g) ⊙ u`
/// (`[rows, I]`, saved) and `out = residual + act · Wdᵀ` (`[rows, H]`). `normed` (`[rows, H]`) and `gate_up_w`
/// (`[2I, H]`, the `gate_up` weight as an operand) may be bf16 copies ([`HsOperand::with_copy`]), read as
/// such by the first product; with `copies = Some((act16, down16))` the SwiGLU also writes `act` rounded to
/// bf16 into `act16` (from its offset) and the down product reads that and `down16` (`down`'s bf16 copy).
///
/// # Errors
/// Backend failures.
pub fn swiglu_mlp_forward<B: Backend>(
    be: &mut B,
    dims: MlpDims,
    (normed, residual): (HsOperand<'_, B>, Src<'_, B, f32>),
    (weights, gate_up_w): (SwigluWeights<'_, B>, HsOperand<'_, B>),
    ((gate_up, gate_up_at), (act, act_at), copies): (
        At<'_, B>,
        At<'_, B>,
        Option<DownCopies<'_, B>>,
    ),
    mut out: Dst<'_, B, f32>,
    precision: Precision,
) -> BackendResult {
    let MlpDims {
        rows,
        hidden: h,
        intermediate: i,
    } = dims;
    assert_eq!(
        normed.shape(),
        (rows, h),
        "swiglu_mlp_forward: normed input"
    );
    assert_eq!(
        gate_up_w.shape(),
        (2 * i, h),
        "swiglu_mlp_forward: gate_up weight"
    );
    be.gemm_hs(
        gate_up.at_mut(gate_up_at, rows * 2 * i),
        normed,
        gate_up_w.t(),
        1.0,
        0.0,
        precision,
    )?;
    let (act_operand, down_operand) = match copies {
        Some(((act16, act16_at), down16)) => {
            be.swiglu_forward_bf16(
                gate_up.at(gate_up_at, rows * 2 * i),
                (
                    act.at_mut(act_at, rows * i),
                    act16.at_mut(act16_at, rows * i),
                ),
                i,
            )?;
            (
                HsOperand::with_copy(
                    act.at(act_at, rows * i),
                    Some(act16.at(act16_at, rows * i)),
                    rows,
                    i,
                ),
                HsOperand::with_copy(weights.down, Some(down16), h, i),
            )
        }
        None => {
            be.swiglu_forward(
                gate_up.at(gate_up_at, rows * 2 * i),
                act.at_mut(act_at, rows * i),
                i,
            )?;
            (
                Operand::new(act.at(act_at, rows * i), rows, i).into(),
                Operand::new(weights.down, h, i).into(),
            )
        }
    };
    // out = residual + act · downᵀ: copy the residual, then accumulate the product into it.
    be.copy(out.reborrow(), residual)?;
    be.gemm_hs(out, act_operand, down_operand.t(), 1.0, 1.0, precision)
}

/// What the SwiGLU backward reads that its forward saved: the block's normed input `[rows, H]`, `gate_up`
/// `[rows, 2I]` and `act` `[rows, I]`.
#[derive(Clone, Copy)]
pub struct SwigluSaved<'a, B: Backend> {
    /// The normed input the block read.
    pub normed: Src<'a, B, f32>,
    /// The saved `[gate | up]` pre-activations.
    pub gate_up: Src<'a, B, f32>,
    /// The saved activations.
    pub act: Src<'a, B, f32>,
}

/// The bf16 copies a SwiGLU block's backward reads where the workspace keeps them (CUDA at `bf16`): the
/// output gradient's (`[rows, H]`), the saved normed input's and activations' (as [`SwigluSaved`]) and the
/// weights' (as [`SwigluWeights`]).
#[derive(Clone, Copy)]
pub struct SwigluCopies<'a, B: Backend> {
    /// `dout` rounded to bf16.
    pub dout: Src<'a, B, half::bf16>,
    /// The normed input's copy.
    pub normed: Src<'a, B, half::bf16>,
    /// The activations' copy.
    pub act: Src<'a, B, half::bf16>,
    /// `[gate; up]`'s copy.
    pub gate_up: Src<'a, B, half::bf16>,
    /// `down`'s copy.
    pub down: Src<'a, B, half::bf16>,
}

/// The SwiGLU MLP block backward from `dout` (`[rows, H]`, the gradient of the block's output): overwrites
/// the `down` gradient at `grads[down_at..]` and the `[gate; up]` gradient at `grads[gate_up_at..]`, and writes
/// the gradient of the normed input into `dnormed` (the residual's gradient is `dout` itself, the caller's).
/// `dact` (`[rows, I]`) and `dgate_up` (`[rows, 2I]`) are scratch, used from offset 0. With `copies =
/// Some((reads, dgate_up16))` every product reads bf16 operands: `reads`, and `dgate_up`'s copy, which the
/// SwiGLU backward writes into `dgate_up16` (from offset 0) in its pass.
///
/// # Errors
/// Backend failures.
#[allow(clippy::too_many_arguments)]
pub fn swiglu_mlp_backward<B: Backend>(
    be: &mut B,
    dims: MlpDims,
    dout: Src<'_, B, f32>,
    saved: SwigluSaved<'_, B>,
    weights: SwigluWeights<'_, B>,
    (grads, gate_up_at, down_at): (&mut Buf<B, f32>, usize, usize),
    (dact, dgate_up): (&mut Buf<B, f32>, &mut Buf<B, f32>),
    copies: Option<(SwigluCopies<'_, B>, &mut Buf<B, half::bf16>)>,
    dnormed: Dst<'_, B, f32>,
    precision: Precision,
) -> BackendResult {
    let MlpDims {
        rows,
        hidden: h,
        intermediate: i,
    } = dims;
    let (reads, mut dgate_up16) = match copies {
        Some((reads, scratch)) => (Some(reads), Some(scratch)),
        None => (None, None),
    };
    let dy = HsOperand::with_copy(dout, reads.as_ref().map(|c| c.dout), rows, h);
    be.gemm_hs(
        grads.at_mut(down_at, h * i),
        dy.t(),
        HsOperand::with_copy(saved.act, reads.as_ref().map(|c| c.act), rows, i),
        1.0,
        0.0,
        precision,
    )?;
    be.gemm_hs(
        dact.at_mut(0, rows * i),
        dy,
        HsOperand::with_copy(weights.down, reads.as_ref().map(|c| c.down), h, i),
        1.0,
        0.0,
        precision,
    )?;
    let n = rows * 2 * i;
    match dgate_up16.as_deref_mut() {
        Some(copy) => be.swiglu_backward_bf16(
            saved.gate_up,
            dact.at(0, rows * i),
            (dgate_up.at_mut(0, n), copy.at_mut(0, n)),
            i,
        )?,
        None => be.swiglu_backward(
            saved.gate_up,
            dact.at(0, rows * i),
            dgate_up.at_mut(0, n),
            i,
        )?,
    }
    let dgu = HsOperand::with_copy(
        dgate_up.at(0, n),
        dgate_up16.as_deref().map(|c| c.at(0, n)),
        rows,
        2 * i,
    );
    be.gemm_hs(
        grads.at_mut(gate_up_at, 2 * i * h),
        dgu.t(),
        HsOperand::with_copy(saved.normed, reads.as_ref().map(|c| c.normed), rows, h),
        1.0,
        0.0,
        precision,
    )?;
    be.gemm_hs(
        dnormed,
        dgu,
        HsOperand::with_copy(weights.gate_up, reads.as_ref().map(|c| c.gate_up), 2 * i, h),
        1.0,
        0.0,
        precision,
    )
}

/// What an RMSNorm's backward reads: its input `x` (`[rows, width]`), weight (`[width]`), the saved
/// `inv_rms` (`[rows]`) and the gradient of its output `dy`.
#[derive(Clone, Copy)]
pub struct NormSaved<'a, B: Backend> {
    /// The norm's input.
    pub x: Src<'a, B, f32>,
    /// Its weight.
    pub weight: Src<'a, B, f32>,
    /// `1 / rms` per row, saved by the forward.
    pub inv_rms: Src<'a, B, f32>,
    /// The gradient of its output.
    pub dy: Src<'a, B, f32>,
}

/// An RMSNorm's backward: the weight's gradient (overwritten, through `partials`) and the input's gradient
/// (written, or added to `dx` when `accumulate`: a residual's gradient already there), and with `dx16` the final
/// `dx` rounded to bf16 there in the same pass (the products after it read that copy).
///
/// # Errors
/// Backend failures.
pub fn rmsnorm_backward<B: Backend>(
    be: &mut B,
    saved: NormSaved<'_, B>,
    (dweight, partials): (Dst<'_, B, f32>, Dst<'_, B, f32>),
    (dx, dx16): (Dst<'_, B, f32>, Option<Dst<'_, B, half::bf16>>),
    accumulate: bool,
) -> BackendResult {
    let NormSaved {
        x,
        weight,
        inv_rms,
        dy,
    } = saved;
    be.rmsnorm_weight_grad(x, inv_rms, dy, dweight, partials)?;
    match dx16 {
        Some(dx16) => {
            be.rmsnorm_backward_input_bf16(x, weight, inv_rms, dy, (dx, dx16), accumulate)
        }
        None => be.rmsnorm_backward_input(x, weight, inv_rms, dy, dx, accumulate),
    }
}

/// A linear projection's backward, `y = x · Wᵀ` with `x` `[rows, in]` and `W` `[out, in]`: `dW = β_W·dW +
/// dyᵀ·x` and `dx = β_x·dx + dy·W` (β 0 overwrites, 1 accumulates). The operands may be bf16 copies
/// ([`HsOperand::with_copy`]); `dy` meets both `x` and `W`, so all three are copies or none.
///
/// # Errors
/// Backend failures.
pub fn linear_backward<B: Backend>(
    be: &mut B,
    (dy, x, weight): (HsOperand<'_, B>, HsOperand<'_, B>, HsOperand<'_, B>),
    (dweight, dweight_beta): (Dst<'_, B, f32>, f32),
    (dx, dx_beta): (Dst<'_, B, f32>, f32),
    precision: Precision,
) -> BackendResult {
    be.gemm_hs(dweight, dy.t(), x, 1.0, dweight_beta, precision)?;
    be.gemm_hs(dx, dy, weight, 1.0, dx_beta, precision)
}
