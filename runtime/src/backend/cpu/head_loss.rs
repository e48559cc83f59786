//! One head's fused vocabulary loss on host slices, for the kernels benchmark that compares the chunked loss
//! with materialised `[T, V]` logits (the training step's own loss loop is `model::mlp`'s, over the backend).

use super::gemm::{Mat, gemm};
use super::kernels;

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
