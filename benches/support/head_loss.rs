//! One head's fused vocabulary loss on host slices, for the kernels benchmark that compares the chunked loss
//! with materialised `[T, V]` logits (the training step's own loss loop is `model::mlp`'s, over the backend).
//! The products are one `gemm::gemm` call each on the calling thread: what the CPU backend's GEMM runs outside a
//! drafter's thread pool.

use draftpipe_runtime::backend::cpu::kernels;

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

/// `c = a · b + beta · c`, row-major, `a` `[m, k]` read with strides `(rsa, csa)`, `b` `[k, n]` with `(rsb, csb)`.
#[allow(clippy::too_many_arguments)]
fn gemm(
    c: &mut [f32],
    (a, rsa, csa): (&[f32], isize, isize),
    (b, rsb, csb): (&[f32], isize, isize),
    (m, k, n): (usize, usize, usize),
    beta: f32,
) {
    assert!(
        c.len() == m * n && a.len() >= m * k && b.len() >= k * n,
        "gemm: shapes"
    );
    // SAFETY: the strides below are those of row-major `[m, k]`/`[k, m]`, `[k, n]`/`[n, k]` buffers whose
    // lengths are checked above, and `c` is a unique borrow, so it overlaps neither input. The crate's `alpha`
    // scales `c` and its `beta` the product (BLAS's names swapped); `c` is read only when `beta` is not 0.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n as isize,
            beta != 0.0,
            a.as_ptr(),
            csa,
            rsa,
            b.as_ptr(),
            csb,
            rsb,
            beta,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// One head's fused vocabulary loss, `logits.len() / V` tokens at a time: per chunk, one GEMM for the logits,
/// [`kernels::vocab_loss`] in place, one GEMM for `dh` (overwritten) and one accumulating `d_lm_head` (overwritten
/// first when `accumulate_lm` is false). Only `logits` is vocabulary-sized: a `[C, V]` chunk, never `[T, V]`
/// (passing a `[T, V]` buffer gives the materialised variant the benches compare against).
///
/// # Panics
/// When a buffer does not match the shapes in `input`.
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
        chunk > 0
            && h_all.len() == t * h
            && dh.len() == t * h
            && row_loss.len() == t
            && lm_head.len() == v * h
            && d_lm_head.len() == v * h,
        "head_loss: shapes"
    );
    let (hs, vs) = (h as isize, v as isize);
    let mut start = 0;
    while start < t {
        let rows = chunk.min(t - start);
        let logits = &mut logits[..rows * v];
        let h_chunk = &h_all[start * h..][..rows * h];
        // logits = h · lmᵀ: lm [V, H] read transposed.
        gemm(
            logits,
            (h_chunk, hs, 1),
            (lm_head, 1, hs),
            (rows, h, v),
            0.0,
        );
        kernels::vocab_loss(
            logits,
            &labels[start..][..rows],
            scale,
            &mut row_loss[start..][..rows],
            v,
        );
        // dh = dlogits · lm.
        let dh_chunk = &mut dh[start * h..][..rows * h];
        gemm(
            dh_chunk,
            (logits, vs, 1),
            (lm_head, hs, 1),
            (rows, v, h),
            0.0,
        );
        // d_lm (+)= dlogitsᵀ · h.
        let beta = if accumulate_lm || start > 0 { 1.0 } else { 0.0 };
        gemm(
            d_lm_head,
            (logits, 1, vs),
            (h_chunk, hs, 1),
            (v, rows, h),
            beta,
        );
        start += rows;
    }
}
