//! One forward/loss/backward pass of the `mlp` drafter on the host: GEMMs through [`gemm`], everything else
//! through the shared kernels ([`kernels`]).
//!
//! ```text
//!  hs ─fc─▶ x ─[rmsnorm → gate|up → swiglu → down (+x)]×B─▶ rmsnorm ─▶ z ─[z + silu(z·Wⱼᵀ)]×J─▶ h_j
//!  h_j ─chunks of C tokens─▶ logits (C×V) ─vocab_loss_row─▶ dlogits ─▶ dh_j, dlm_head
//! ```

use super::gemm::{Mat, gemm};
use super::kernels;
use super::workspace::{LOSS_SUM_CHUNK, NORM_GRAD_ROWS_PER_CHUNK, Workspace};
use crate::batch::HsBatch;
use draftpipe_compiler::plan::MlpSpec;

/// RMSNorm epsilon of the model.
pub const RMS_EPS: f32 = 1e-6;

/// Offsets of every tensor in the flat buffers (the layout of [`MlpSpec::layout`]).
pub(crate) struct Offsets {
    fc: usize,
    blocks: Vec<BlockOffsets>,
    norm: usize,
    heads: Vec<usize>,
    lm_head: usize,
}

struct BlockOffsets {
    norm: usize,
    /// `gate.weight` immediately followed by `up.weight`: one `[2I, H]` matrix.
    gate_up: usize,
    down: usize,
}

impl Offsets {
    /// Offsets of the canonical layout. `None` when `gate` and `up` are not adjacent (the fused `[gate | up]`
    /// GEMM relies on it).
    pub(crate) fn new(spec: &MlpSpec) -> Option<Self> {
        let layout = spec.layout();
        let at = |name: &str| layout.iter().find(|v| v.name == name).map(|v| v.offset);
        let gate_len = spec.intermediate * spec.hidden;
        let mut blocks = Vec::with_capacity(spec.blocks);
        for b in 0..spec.blocks {
            let gate = at(&format!("blocks.{b}.gate.weight"))?;
            if at(&format!("blocks.{b}.up.weight"))? != gate + gate_len {
                return None;
            }
            blocks.push(BlockOffsets {
                norm: at(&format!("blocks.{b}.norm.weight"))?,
                gate_up: gate,
                down: at(&format!("blocks.{b}.down.weight"))?,
            });
        }
        Some(Self {
            fc: at("fc.weight")?,
            blocks,
            norm: at("norm.weight")?,
            heads: (0..spec.heads)
                .map(|j| at(&format!("heads.{j}.weight")))
                .collect::<Option<_>>()?,
            lm_head: at("lm_head.weight")?,
        })
    }
}

/// Forward pass up to the heads' outputs `h_j`, saving what the backward needs.
pub(crate) fn forward(
    spec: &MlpSpec,
    at: &Offsets,
    params: &[f32],
    batch: &HsBatch,
    ws: &mut Workspace,
) {
    let MlpSpec {
        din,
        hidden: h,
        intermediate: i,
        ..
    } = *spec;
    let t = ws.tokens;
    let first_x = match ws.blocks.first_mut() {
        Some(block) => &mut block.x,
        None => &mut ws.x_final,
    };
    gemm(
        first_x,
        Mat::new(&batch.hs, t, din),
        Mat::new(&params[at.fc..][..h * din], h, din).t(),
        1.0,
        0.0,
    );
    for b in 0..ws.blocks.len() {
        let (done, rest) = ws.blocks.split_at_mut(b + 1);
        let block = &mut done[b];
        let w = &at.blocks[b];
        let next_x = match rest.first_mut() {
            Some(next) => &mut next.x,
            None => &mut ws.x_final,
        };
        kernels::rmsnorm_forward(
            &block.x,
            &params[w.norm..][..h],
            &mut block.normed,
            &mut block.inv_rms,
            RMS_EPS,
        );
        let w_gate_up = Mat::new(&params[w.gate_up..][..2 * i * h], 2 * i, h);
        gemm(
            &mut block.gate_up,
            Mat::new(&block.normed, t, h),
            w_gate_up.t(),
            1.0,
            0.0,
        );
        kernels::swiglu_forward(&block.gate_up, &mut block.act, i);
        next_x.copy_from_slice(&block.x);
        gemm(
            next_x,
            Mat::new(&block.act, t, i),
            Mat::new(&params[w.down..][..h * i], h, i).t(),
            1.0,
            1.0,
        );
    }
    kernels::rmsnorm_forward(
        &ws.x_final,
        &params[at.norm..][..h],
        &mut ws.z,
        &mut ws.inv_rms_final,
        RMS_EPS,
    );
    for (head, &offset) in ws.heads.iter_mut().zip(&at.heads) {
        gemm(
            &mut head.a,
            Mat::new(&ws.z, t, h),
            Mat::new(&params[offset..][..h * h], h, h).t(),
            1.0,
            0.0,
        );
        kernels::head_residual_forward(&ws.z, &head.a, &mut head.h);
    }
}

/// The fused vocabulary loss of every head, chunk by chunk: fills each head's `dh` and the `lm_head` gradient
/// (overwritten) and returns the loss.
pub(crate) fn loss(
    spec: &MlpSpec,
    at: &Offsets,
    head_decay: f32,
    params: &[f32],
    grads: &mut [f32],
    batch: &HsBatch,
    ws: &mut Workspace,
) -> f32 {
    let MlpSpec {
        hidden: h,
        vocab: v,
        ..
    } = *spec;
    let t = ws.tokens;
    kernels::build_labels(
        &batch.input_ids,
        &batch.loss_mask,
        &batch.seq_lens,
        &mut ws.labels,
        batch.padded_len,
        v,
    );
    kernels::head_loss_scales(&ws.labels, head_decay, &mut ws.counts, &mut ws.scales);
    let lm_head = &params[at.lm_head..][..v * h];
    let d_lm = &mut grads[at.lm_head..][..v * h];
    let chunk_rows = ws.chunk_tokens(v);
    for (j, head) in ws.heads.iter_mut().enumerate() {
        head_loss(
            HeadLoss {
                h: &head.h,
                lm_head,
                labels: &ws.labels[j * t..][..t],
                scale: ws.scales[j],
                hidden: h,
                vocab: v,
            },
            &mut ws.logits[..chunk_rows * v],
            &mut ws.row_loss[j * t..][..t],
            &mut head.dh,
            d_lm,
            j > 0,
        );
    }
    kernels::sum(&ws.row_loss, LOSS_SUM_CHUNK, &mut ws.loss_partials)
}

/// The inputs of one head's fused vocabulary loss.
#[derive(Clone, Copy)]
pub struct HeadLoss<'a> {
    /// The head's output `h`, `[T, H]`.
    pub h: &'a [f32],
    /// `lm_head.weight`, `[V, H]`.
    pub lm_head: &'a [f32],
    /// The head's labels, `[T]`, negative where ignored.
    pub labels: &'a [i32],
    /// The head's loss scale (`decay^j / (Σ decay · count_j)`).
    pub scale: f32,
    /// Hidden size `H`.
    pub hidden: usize,
    /// Vocabulary size `V`.
    pub vocab: usize,
}

/// One head's fused vocabulary loss, `logits.len() / V` tokens at a time: per chunk, one GEMM for the logits,
/// [`kernels::vocab_loss`] in place, one GEMM for `dh` (overwritten) and one accumulating `d_lm_head` (overwritten
/// first when `accumulate_lm` is false). Only `logits` is vocabulary-sized: a `[C, V]` chunk, never `[T, V]`
/// (passing a `[T, V]` buffer gives the materialised variant the benches compare against).
///
/// # Panics
/// When a buffer does not match the shapes in `input` (the step sizes them from one bucket).
pub fn head_loss(
    input: HeadLoss<'_>,
    logits: &mut [f32],
    row_loss: &mut [f32],
    dh: &mut [f32],
    d_lm_head: &mut [f32],
    accumulate_lm: bool,
) {
    let HeadLoss {
        h: h_all,
        lm_head,
        labels,
        scale,
        hidden: h,
        vocab: v,
    } = input;
    let t = labels.len();
    let chunk = logits.len() / v.max(1);
    assert!(
        chunk > 0 && h_all.len() == t * h && dh.len() == t * h && row_loss.len() == t,
        "head_loss: shapes"
    );
    let lm = Mat::new(lm_head, v, h);
    let mut start = 0;
    while start < t {
        let rows = chunk.min(t - start);
        let logits = &mut logits[..rows * v];
        let h_chunk = Mat::new(&h_all[start * h..][..rows * h], rows, h);
        gemm(logits, h_chunk, lm.t(), 1.0, 0.0);
        kernels::vocab_loss(
            logits,
            &labels[start..][..rows],
            scale,
            &mut row_loss[start..][..rows],
            v,
        );
        let dlogits = Mat::new(logits, rows, v);
        gemm(&mut dh[start * h..][..rows * h], dlogits, lm, 1.0, 0.0);
        let beta = if accumulate_lm || start > 0 { 1.0 } else { 0.0 };
        gemm(d_lm_head, dlogits.t(), h_chunk, 1.0, beta);
        start += rows;
    }
}

/// Backward from the heads' `dh` to every parameter gradient except `lm_head` (written by [`loss`]).
pub(crate) fn backward(
    spec: &MlpSpec,
    at: &Offsets,
    params: &[f32],
    grads: &mut [f32],
    batch: &HsBatch,
    ws: &mut Workspace,
) {
    let MlpSpec {
        din,
        hidden: h,
        intermediate: i,
        ..
    } = *spec;
    let t = ws.tokens;
    let z = Mat::new(&ws.z, t, h);
    ws.dz.fill(0.0);
    for (head, &offset) in ws.heads.iter().zip(&at.heads) {
        kernels::head_residual_backward(&head.a, &head.dh, &mut ws.da, &mut ws.dz);
        let da = Mat::new(&ws.da, t, h);
        gemm(&mut grads[offset..][..h * h], da.t(), z, 1.0, 0.0);
        gemm(
            &mut ws.dz,
            da,
            Mat::new(&params[offset..][..h * h], h, h),
            1.0,
            1.0,
        );
    }
    let x_last = &ws.x_final;
    kernels::rmsnorm_backward_input(
        x_last,
        &params[at.norm..][..h],
        &ws.inv_rms_final,
        &ws.dz,
        &mut ws.dx,
        false,
    );
    kernels::rmsnorm_weight_grad(
        x_last,
        &ws.inv_rms_final,
        &ws.dz,
        &mut grads[at.norm..][..h],
        &mut ws.norm_partials,
        NORM_GRAD_ROWS_PER_CHUNK,
    );
    for (block, w) in ws.blocks.iter().zip(&at.blocks).rev() {
        let dx = Mat::new(&ws.dx, t, h);
        let act = Mat::new(&block.act, t, i);
        let down = Mat::new(&params[w.down..][..h * i], h, i);
        gemm(&mut grads[w.down..][..h * i], dx.t(), act, 1.0, 0.0);
        gemm(&mut ws.dact, dx, down, 1.0, 0.0);
        kernels::swiglu_backward(&block.gate_up, &ws.dact, &mut ws.dgate_up, i);
        let dgu = Mat::new(&ws.dgate_up, t, 2 * i);
        gemm(
            &mut grads[w.gate_up..][..2 * i * h],
            dgu.t(),
            Mat::new(&block.normed, t, h),
            1.0,
            0.0,
        );
        gemm(
            &mut ws.dnormed,
            dgu,
            Mat::new(&params[w.gate_up..][..2 * i * h], 2 * i, h),
            1.0,
            0.0,
        );
        kernels::rmsnorm_weight_grad(
            &block.x,
            &block.inv_rms,
            &ws.dnormed,
            &mut grads[w.norm..][..h],
            &mut ws.norm_partials,
            NORM_GRAD_ROWS_PER_CHUNK,
        );
        kernels::rmsnorm_backward_input(
            &block.x,
            &params[w.norm..][..h],
            &block.inv_rms,
            &ws.dnormed,
            &mut ws.dx,
            true,
        );
    }
    gemm(
        &mut grads[at.fc..][..h * din],
        Mat::new(&ws.dx, t, h).t(),
        Mat::new(&batch.hs, t, din),
        1.0,
        0.0,
    );
}
