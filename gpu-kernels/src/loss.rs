//! The fused vocabulary loss: labels from token ids, per-head normalisation kept on the device, and per token
//! row of a logits chunk the cross-entropy, its log-sum-exp and the logits gradient written in place.
//!
//! ```text
//!  build_labels ──▶ head_loss_scales (counts, decay^j / (Σ decay · count_j)) ──┐
//!  for each head j, for each chunk of tokens:                                  ▼
//!     logits = h_j[chunk] · lm_headᵀ (GEMM) ──▶ vocab_loss_row (in place) ──▶ two GEMMs (dh_j, dlm_head)
//! ```
//!
//! The scale multiplies the gradient and the per-row loss inside the kernel, so the normalisation by the
//! number of valid labels never needs the host to read a count mid-step.

use core::ptr;

use crate::plane::Plane;

/// Label value of an ignored position.
pub const IGNORE_LABEL: i32 = -1;

/// Labels of head `j` at token `t`: `input_ids[t + j + 1]` when that position is inside the same sequence
/// (`p + j + 1 < seq_len` for `t = s · padded_len + p`), its `loss_mask` is non-zero and the id is `< vocab`;
/// otherwise [`IGNORE_LABEL`].
///
/// Launch: `index = j · tokens + t`, `heads · tokens` indices (`tokens = sequences · padded_len`).
///
/// # Safety
/// `input_ids`, `loss_mask` hold `tokens` elements, `seq_lens` `tokens / padded_len`, `labels`
/// `heads · tokens`; `padded_len > 0`; `index` is inside the launch.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn build_labels(
    input_ids: *const u32,
    loss_mask: *const u8,
    seq_lens: *const u32,
    labels: *mut i32,
    padded_len: usize,
    tokens: usize,
    vocab: usize,
    index: usize,
) {
    // A zero divisor means an empty launch; returning keeps the device path free of the division panic.
    if tokens == 0 || padded_len == 0 {
        return;
    }
    let head = index / tokens;
    let t = index % tokens;
    let sequence = t / padded_len;
    let target = t % padded_len + head + 1;
    // SAFETY: `sequence` indexes `seq_lens`; the target position is read only when inside its sequence, which
    // lies inside the padded row; `index` is inside `labels`.
    unsafe {
        let len = *seq_lens.add(sequence) as usize;
        let len = if len < padded_len { len } else { padded_len };
        let mut label = IGNORE_LABEL;
        if target < len {
            let position = sequence * padded_len + target;
            let id = *input_ids.add(position) as usize;
            if *loss_mask.add(position) != 0 && id < vocab {
                label = id as i32;
            }
        }
        *labels.add(index) = label;
    }
}

/// Counts the valid labels of head `j` and its loss scale `decay^j / (Σ_k decay^k · count_j)` (0 when the head
/// has no valid label, so it adds nothing): the factor that turns per-row cross-entropies into
/// `Σ_j decay^j · mean_j / Σ_j decay^j`.
///
/// Launch: one index per head (`heads` indices; each loops over `tokens` labels).
///
/// # Safety
/// `labels` holds `heads · tokens` elements, `counts` and `scales` `heads`; `head < heads`.
#[inline(always)]
pub unsafe fn head_loss_scales(
    labels: *const i32,
    tokens: usize,
    heads: usize,
    head_decay: f32,
    counts: *mut u32,
    scales: *mut f32,
    head: usize,
) {
    let mut weight_sum = 0.0f32;
    let mut weight = 1.0f32;
    let mut head_weight = 0.0f32;
    for k in 0..heads {
        if k == head {
            head_weight = weight;
        }
        weight_sum += weight;
        weight *= head_decay;
    }
    let mut count = 0u32;
    // SAFETY: the head's labels are `labels[head · tokens ..][..tokens]`; `head` is inside `counts`, `scales`.
    unsafe {
        let row = labels.add(head * tokens);
        for t in 0..tokens {
            count += (*row.add(t) >= 0) as u32;
        }
        *counts.add(head) = count;
        *scales.add(head) = if count == 0 {
            0.0
        } else {
            head_weight / (weight_sum * count as f32)
        };
    }
}

/// Cross-entropy of one token row of a logits chunk, fused with its gradient:
/// `row_loss[row] = scale · (logsumexp(logits) − logits[label])` and, in place,
/// `logits ← scale · (softmax(logits) − onehot(label))`; an ignored row (`label < 0`) gets loss 0 and a zero
/// gradient. `scale` points at the head's entry of [`head_loss_scales`]'s output (read on the device).
///
/// Two passes over the row: an online max and sum of exponentials (each lane keeps its running maximum `m`
/// and `s = Σ e^(x − m)`, rescaled when the maximum grows, one `exp` per element), combined across lanes; then
/// the gradient, written over the logits. On the GPU the lanes of a warp read adjacent logits (coalesced).
///
/// Launch: one plane per token row of the chunk; `logits`, `labels`, `row_loss` point at the chunk's first row.
///
/// # Safety
/// `logits` holds `(row + 1) · vocab` elements, `labels` and `row_loss` `row + 1`, `scale` one; labels are
/// `< vocab` (as [`build_labels`] guarantees); `vocab > 0`.
#[inline(always)]
pub unsafe fn vocab_loss_row(
    logits: *mut f32,
    labels: *const i32,
    scale: *const f32,
    row_loss: *mut f32,
    vocab: usize,
    plane: impl Plane,
    row: usize,
) {
    // SAFETY: every access is inside row `row` of `logits` or at `row` of `labels`/`row_loss`. The target logit
    // is read by every lane before the reduction, whose shuffles every lane passes before any lane writes.
    unsafe {
        let logits = logits.add(row * vocab);
        let label = *labels.add(row);
        if label < 0 {
            plane.for_each(vocab, |v| *logits.add(v) = 0.0);
            if plane.is_leader() {
                *row_loss.add(row) = 0.0;
            }
            return;
        }
        let label = label as usize;
        let target = *logits.add(label);
        let scale = *scale;
        let stats = plane.softmax_gradient_in_place(logits, ptr::null_mut(), vocab, label, scale);
        if plane.is_leader() {
            *row_loss.add(row) = scale * (stats.max + crate::math::ln(stats.sum) - target);
        }
    }
}

/// The weighted cross-entropy of one row of a logits chunk (DFlash's decayed loss), fused with its gradient:
/// with `s = weights[row] · norm[0]` (`norm` is `1 / Σ weights` over the batch, computed when the batch is
/// staged), `row_loss[row] = s · (logsumexp(logits) − logits[label])`, in place
/// `logits ← s · (softmax(logits) − onehot(label))` and, where `logits16` is not null, that gradient rounded to
/// bf16 into `logits16` (the 16-bit operand of the `lm_head` input-gradient product on CUDA at `bf16`), and
/// `correct[row] = 1` when the row's first largest logit is the label (`torch.argmax`'s tie rule, NaN skipped),
/// else 0. A row without a label (`label < 0`) gets a zero gradient (and copy), loss 0 and `correct` 0.
///
/// Two passes over the row ([`Plane::softmax_gradient_in_place`]): one for the statistics (the online maximum
/// with its first index, and the sum of exponentials), one for the gradient.
///
/// Launch: one plane per row of the chunk; the pointers point at the chunk's first row.
///
/// # Safety
/// `logits` holds `(row + 1) · vocab` elements, `logits16` is null or holds as many, `labels`, `weights`,
/// `row_loss`, `correct` `row + 1`, `norm` one; labels are `< vocab`; `vocab > 0`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn weighted_vocab_loss_row(
    logits: *mut f32,
    logits16: *mut u16,
    labels: *const i32,
    weights: *const f32,
    norm: *const f32,
    row_loss: *mut f32,
    correct: *mut f32,
    vocab: usize,
    plane: impl Plane,
    row: usize,
) {
    // SAFETY: every access is inside row `row` of `logits` (and `logits16`) or at `row` of the per-row
    // buffers. Every lane reads the target logit before the statistics pass, whose shuffles wait for all
    // lanes, and no lane writes before it.
    unsafe {
        let logits = logits.add(row * vocab);
        let logits16 = if logits16.is_null() {
            logits16
        } else {
            logits16.add(row * vocab)
        };
        let label = *labels.add(row);
        if label < 0 || label as usize >= vocab {
            plane.for_each(vocab, |v| {
                *logits.add(v) = 0.0;
                if !logits16.is_null() {
                    *logits16.add(v) = 0;
                }
            });
            if plane.is_leader() {
                *row_loss.add(row) = 0.0;
                *correct.add(row) = 0.0;
            }
            return;
        }
        let label = label as usize;
        let target = *logits.add(label);
        let scale = *weights.add(row) * *norm;
        let stats = plane.softmax_gradient_in_place(logits, logits16, vocab, label, scale);
        if plane.is_leader() {
            *row_loss.add(row) = scale * (stats.max + crate::math::ln(stats.sum) - target);
            *correct.add(row) = if stats.argmax == label { 1.0 } else { 0.0 };
        }
    }
}
