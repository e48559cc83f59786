//! EAGLE-3's kernels: the TTT unroll's attention (causal over step 0's keys, diagonal over each cached step's
//! key), the soft-label loss fused with the draft head's logits, the teacher's full-vocabulary argmax flag, and
//! the row shifts, column concatenation and positions the unroll's bookkeeping needs.
//!
//! ```text
//!  once per batch  shift_rows(_half) (ids, teacher hidden states ← row + 1)   argmax_in_draft_row (valid rows)
//!  step k          shift_rows (ids, teacher, weights ← row + k)   positions (t + k)   concat_columns (q/k/v input)
//!                  eagle3_attention_forward                       soft_label_loss_row (per logits chunk)
//!  backward        attention_delta (shared), eagle3_attention_backward_q, eagle3_attention_backward_kv,
//!                  split_columns
//! ```
//!
//! **Attention layout** (row-major, f32): step `k`'s queries `q [T, heads, head_dim]`; the keys and values of
//! every step stacked `k_all, v_all [steps, T, kv_heads, head_dim]` (step `j` at rows `j·T ..`). Query row `t`
//! of step `k` (sequence `s = t / padded_len`) sees step 0's keys `t'` of its sequence with `t' ≤ t` (causal)
//! and, for each cached step `j = 1..=k`, only step `j`'s key at row `t` (diagonal); one softmax over the
//! concatenation (`scale · q·k`, f32), `lse` saved. Head `h` reads kv head `h / (heads / kv_heads)` (GQA). This is
//! SpecForge's `LlamaAttention` with `cache_hidden`: step 0's full causal mask, then one extra score per cached
//! step (`attn_weights = cat(step-0 scores, q·k_j summed over the head dimension)`).
//!
//! The backward recomputes probabilities from `lse` with the forward's operations in its order, and writes
//! every gradient element from one plane (no atomics): `dq` by query, `dk`/`dv` by key row (each row owns its
//! step-0 key and its cached keys), added into the stacked gradients so every TTT step's backward contributes to
//! the keys it read. A plane holds a row in registers, so `head_dim ≤ MAX_ROW`; the launchers reject more.
//!
//! This is the plain (untiled) form: a plane per (row, head), keys read one at a time. It is the reference the
//! CPU runs and the GPU's first body; tiling it like the DFlash attention is left for when it is measured.

use crate::plane::{MAX_ROW, Plane};

/// Whether the head counts are ones the kernels handle (a body returns early otherwise).
#[inline(always)]
fn valid_heads(heads: usize, kv_heads: usize, head_dim: usize) -> bool {
    heads > 0 && kv_heads > 0 && heads.is_multiple_of(kv_heads) && head_dim <= MAX_ROW
}

/// The keys row `row` of step `step` sees, in softmax order: `(step-0 key rows start..=row, then cached steps
/// 1..=step at row)`, as the start of its sequence.
#[inline(always)]
fn sequence_start(row: usize, padded_len: usize) -> usize {
    (row / padded_len) * padded_len
}

/// Attention forward of query row `row`, head `head` (`index = row · heads + head`) of TTT step `step`: `out` and
/// `lse` (module docs).
///
/// Launch: one plane per (row, head): `rows · heads` planes.
///
/// # Safety
/// `q`, `out` hold `rows · heads · head_dim`, `lse` `rows · heads`; `k_all`, `v_all` hold at least
/// `(step + 1) · rows · kv_heads · head_dim`; `padded_len > 0`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn eagle3_attention_forward<P: Plane>(
    q: *const f32,
    k_all: *const f32,
    v_all: *const f32,
    out: *mut f32,
    lse: *mut f32,
    rows: usize,
    padded_len: usize,
    step: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    scale: f32,
    plane: P,
    index: usize,
) {
    if !valid_heads(heads, kv_heads, head_dim) || padded_len == 0 {
        return;
    }
    let (row, head) = (index / heads, index % heads);
    let group = head / (heads / kv_heads);
    let key_row = |j: usize, r: usize| ((j * rows + r) * kv_heads + group) * head_dim;
    // SAFETY: every row read is below `rows` of its step, steps at most `step`; the output row is `index`'s.
    unsafe {
        let q_row = plane.row_load(head_dim, |d| *q.add(index * head_dim + d));
        let (mut max, mut sum, mut acc) = (f32::NEG_INFINITY, 0.0f32, plane.row_zero());
        let (mut k, mut v) = (plane.row_zero(), plane.row_zero());
        let mut fold = |offset: usize, k: &mut P::Row, v: &mut P::Row| {
            plane.row_load_into(k, head_dim, |d| *k_all.add(offset + d));
            plane.row_load_into(v, head_dim, |d| *v_all.add(offset + d));
            let s = scale * plane.row_dot(&q_row, k, head_dim);
            if s > max {
                let alpha = crate::math::exp(max - s);
                sum = sum * alpha + 1.0;
                plane.row_scale_add(&mut acc, alpha, 1.0, v, head_dim);
                max = s;
            } else {
                let p = crate::math::exp(s - max);
                sum += p;
                plane.row_scale_add(&mut acc, 1.0, p, v, head_dim);
            }
        };
        for key in sequence_start(row, padded_len)..=row {
            fold(key_row(0, key), &mut k, &mut v);
        }
        for cached in 1..=step {
            fold(key_row(cached, row), &mut k, &mut v);
        }
        let inv = 1.0 / sum;
        plane.row_store(&acc, head_dim, |d, x| {
            *out.add(index * head_dim + d) = x * inv
        });
        if plane.is_leader() {
            *lse.add(index) = max + crate::math::ln(sum);
        }
    }
}

/// Query gradient of row `row`, head `head` (`index = row · heads + head`) of TTT step `step`:
/// `dq = scale · Σ_keys p (dout·v − delta) k` with `p = exp(scale · q·k − lse)` over the keys the forward read.
///
/// Launch: one plane per (row, head).
///
/// # Safety
/// As [`eagle3_attention_forward`], with `dout`, `dq` of `q`'s length and `delta` of `lse`'s.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn eagle3_attention_backward_q<P: Plane>(
    q: *const f32,
    k_all: *const f32,
    v_all: *const f32,
    dout: *const f32,
    lse: *const f32,
    delta: *const f32,
    dq: *mut f32,
    rows: usize,
    padded_len: usize,
    step: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    scale: f32,
    plane: P,
    index: usize,
) {
    if !valid_heads(heads, kv_heads, head_dim) || padded_len == 0 {
        return;
    }
    let (row, head) = (index / heads, index % heads);
    let group = head / (heads / kv_heads);
    let key_row = |j: usize, r: usize| ((j * rows + r) * kv_heads + group) * head_dim;
    // SAFETY: as the forward.
    unsafe {
        let q_row = plane.row_load(head_dim, |d| *q.add(index * head_dim + d));
        let g_row = plane.row_load(head_dim, |d| *dout.add(index * head_dim + d));
        let (l, dl) = (*lse.add(index), *delta.add(index));
        let mut acc = plane.row_zero();
        let (mut k, mut v) = (plane.row_zero(), plane.row_zero());
        let mut fold = |offset: usize, k: &mut P::Row, v: &mut P::Row| {
            plane.row_load_into(k, head_dim, |d| *k_all.add(offset + d));
            plane.row_load_into(v, head_dim, |d| *v_all.add(offset + d));
            let p = crate::math::exp(scale * plane.row_dot(&q_row, k, head_dim) - l);
            let ds = p * (plane.row_dot(&g_row, v, head_dim) - dl);
            plane.row_scale_add(&mut acc, 1.0, scale * ds, k, head_dim);
        };
        for key in sequence_start(row, padded_len)..=row {
            fold(key_row(0, key), &mut k, &mut v);
        }
        for cached in 1..=step {
            fold(key_row(cached, row), &mut k, &mut v);
        }
        plane.row_store(&acc, head_dim, |d, x| *dq.add(index * head_dim + d) = x);
    }
}

/// Key and value gradients of row `row`, kv head `group` (`index = row · kv_heads + group`) from TTT step
/// `step`'s queries, added into the stacked `dk_all`, `dv_all`: step 0's key at `row` collects from the queries
/// `t ≥ row` of its sequence, each cached step `j = 1..=step`'s key at `row` from query `row` alone; over the
/// query heads of the group. `dv += p · dout`, `dk += scale · p (dout·v − delta) q`.
///
/// Launch: one plane per (row, kv head): `rows · kv_heads` planes.
///
/// # Safety
/// As [`eagle3_attention_backward_q`], with `dk_all`, `dv_all` of `k_all`'s length.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn eagle3_attention_backward_kv<P: Plane>(
    q: *const f32,
    dout: *const f32,
    lse: *const f32,
    delta: *const f32,
    k_all: *const f32,
    v_all: *const f32,
    dk_all: *mut f32,
    dv_all: *mut f32,
    rows: usize,
    padded_len: usize,
    step: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    scale: f32,
    plane: P,
    index: usize,
) {
    if !valid_heads(heads, kv_heads, head_dim) || padded_len == 0 {
        return;
    }
    let (row, group) = (index / kv_heads, index % kv_heads);
    let per_group = heads / kv_heads;
    let key_row = |j: usize| ((j * rows + row) * kv_heads + group) * head_dim;
    let sequence_end = sequence_start(row, padded_len) + padded_len;
    let sequence_end = if sequence_end < rows {
        sequence_end
    } else {
        rows
    };
    // SAFETY: query rows are below `rows`, heads below `heads`; key rows are `row`'s of steps `0..=step`.
    unsafe {
        let (mut qr, mut gr) = (plane.row_zero(), plane.row_zero());
        // One key: its gradients from the queries `queries` (a range of rows) over the group's heads.
        let mut key_grads = |j: usize, queries: core::ops::Range<usize>| {
            let offset = key_row(j);
            let k = plane.row_load(head_dim, |d| *k_all.add(offset + d));
            let v = plane.row_load(head_dim, |d| *v_all.add(offset + d));
            let (mut dk, mut dv) = (plane.row_zero(), plane.row_zero());
            for t in queries {
                for h in group * per_group..(group + 1) * per_group {
                    let qi = t * heads + h;
                    plane.row_load_into(&mut qr, head_dim, |d| *q.add(qi * head_dim + d));
                    plane.row_load_into(&mut gr, head_dim, |d| *dout.add(qi * head_dim + d));
                    let p =
                        crate::math::exp(scale * plane.row_dot(&qr, &k, head_dim) - *lse.add(qi));
                    let ds = p * (plane.row_dot(&gr, &v, head_dim) - *delta.add(qi));
                    plane.row_scale_add(&mut dv, 1.0, p, &gr, head_dim);
                    plane.row_scale_add(&mut dk, 1.0, scale * ds, &qr, head_dim);
                }
            }
            plane.row_store(&dk, head_dim, |d, x| *dk_all.add(offset + d) += x);
            plane.row_store(&dv, head_dim, |d, x| *dv_all.add(offset + d) += x);
        };
        key_grads(0, row..sequence_end);
        for cached in 1..=step {
            key_grads(cached, row..row + 1);
        }
    }
}

/// The soft-label cross entropy of one row of a logits chunk, fused with its gradient: with `p = softmax(teacher)`
/// and `q = softmax(draft)` over the draft vocabulary and `w = weights[row] · scale`,
/// `row_loss[row] = w · (−Σ p log q)`, in place `draft ← w · (q − p)`, and `correct[row] = 1` when the row is
/// weighted and the draft's first largest logit is the teacher's (`torch.argmax`'s tie rule), else 0. A row of
/// weight 0 gets a zero gradient, loss 0 and `correct` 0.
///
/// Launch: one plane per row of the chunk; the pointers point at the chunk's first row.
///
/// # Safety
/// `draft` and `teacher` hold `(row + 1) · vocab` elements, `weights`, `row_loss`, `correct` `row + 1`; `vocab > 0`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn soft_label_loss_row(
    draft: *mut f32,
    teacher: *const f32,
    weights: *const f32,
    row_loss: *mut f32,
    correct: *mut f32,
    scale: f32,
    vocab: usize,
    plane: impl Plane,
    row: usize,
) {
    // SAFETY: every access is inside row `row`; every lane finishes the reductions (whose shuffles wait for all
    // lanes) before any lane writes the row.
    unsafe {
        let x = draft.add(row * vocab);
        let y = teacher.add(row * vocab);
        let w = *weights.add(row) * scale;
        if w == 0.0 {
            plane.for_each(vocab, |v| *x.add(v) = 0.0);
            if plane.is_leader() {
                *row_loss.add(row) = 0.0;
                *correct.add(row) = 0.0;
            }
            return;
        }
        let best_draft = plane.argmax(vocab, |v| *x.add(v));
        let best_teacher = plane.argmax(vocab, |v| *y.add(v));
        let max_of = |p: *const f32| {
            plane.reduce(
                vocab,
                f32::NEG_INFINITY,
                |m, v| {
                    let e = *p.add(v);
                    if e > m { e } else { m }
                },
                |m| m,
                |a, b| if a > b { a } else { b },
            )
        };
        let (mx, my) = (max_of(x), max_of(y));
        let sx = plane.sum(vocab, |v| crate::math::exp(*x.add(v) - mx));
        let sy = plane.sum(vocab, |v| crate::math::exp(*y.add(v) - my));
        let inv_sy = 1.0 / sy;
        // −Σ p log q = mx + ln sx − Σ p x (Σ p = 1).
        let px = plane.sum(vocab, |v| {
            crate::math::exp(*y.add(v) - my) * inv_sy * *x.add(v)
        });
        let loss = mx + crate::math::ln(sx) - px;
        let inv_sx = 1.0 / sx;
        plane.for_each(vocab, |v| {
            let q = crate::math::exp(*x.add(v) - mx) * inv_sx;
            let p = crate::math::exp(*y.add(v) - my) * inv_sy;
            *x.add(v) = w * (q - p);
        });
        if plane.is_leader() {
            *row_loss.add(row) = w * loss;
            *correct.add(row) = if best_draft == best_teacher { 1.0 } else { 0.0 };
        }
    }
}

/// Whether the teacher supervises a row: `valid[row] = 1` when `loss_mask[row]` is set and the first largest of
/// its full-vocabulary logits is in the draft vocabulary (`t2d`), else 0 (SpecForge's `position_mask`).
///
/// Launch: one plane per row of a logits chunk; `logits`, `loss_mask`, `valid` point at the chunk's first row.
///
/// # Safety
/// `logits` holds `(row + 1) · vocab` elements, `t2d` `vocab`, `loss_mask`, `valid` `row + 1`; `vocab > 0`.
#[inline(always)]
pub unsafe fn argmax_in_draft_row(
    logits: *const f32,
    t2d: *const u8,
    loss_mask: *const u8,
    valid: *mut f32,
    vocab: usize,
    plane: impl Plane,
    row: usize,
) {
    // SAFETY: the caller's contract; the argmax is below `vocab`.
    unsafe {
        let x = logits.add(row * vocab);
        let best = plane.argmax(vocab, |v| *x.add(v));
        if plane.is_leader() {
            let keep = *loss_mask.add(row) != 0 && *t2d.add(best) != 0;
            *valid.add(row) = if keep { 1.0 } else { 0.0 };
        }
    }
}

/// The element range `chunk · chunk_len .. min(n, (chunk + 1) · chunk_len)`.
#[inline(always)]
fn range(n: usize, chunk_len: usize, chunk: usize) -> (usize, usize) {
    let start = chunk * chunk_len;
    let end = if start + chunk_len < n {
        start + chunk_len
    } else {
        n
    };
    (start, end)
}

/// `dst[r, c] = src[r + shift, c]` when row `r + shift` is in `r`'s sequence (`r % padded_len + shift <
/// padded_len`), else 0, over `[rows, width]` (`n = rows · width`): SpecForge's `padding(x, left=False)`, one
/// row per TTT step, and the teacher's shift by one.
///
/// Launch: element range.
///
/// # Safety
/// `src`, `dst` hold `n` elements, do not overlap; `width`, `padded_len > 0`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn shift_rows(
    src: *const f32,
    dst: *mut f32,
    width: usize,
    padded_len: usize,
    shift: usize,
    n: usize,
    chunk_len: usize,
    chunk: usize,
) {
    if width == 0 || padded_len == 0 {
        return;
    }
    let (start, end) = range(n, chunk_len, chunk);
    for e in start..end {
        let r = e / width;
        // SAFETY: `e < n`; the source element is read only when its row is inside the sequence, so `< n`.
        unsafe {
            *dst.add(e) = if r % padded_len + shift < padded_len {
                *src.add(e + shift * width)
            } else {
                0.0
            };
        }
    }
}

/// [`shift_rows`] of 16-bit hidden states into f32 (`format`: [`crate::convert::FORMAT_BF16`], else IEEE half),
/// widened exactly.
///
/// Launch: element range.
///
/// # Safety
/// As [`shift_rows`].
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn shift_rows_half(
    src: *const u16,
    dst: *mut f32,
    width: usize,
    padded_len: usize,
    shift: usize,
    format: u32,
    n: usize,
    chunk_len: usize,
    chunk: usize,
) {
    if width == 0 || padded_len == 0 {
        return;
    }
    let (start, end) = range(n, chunk_len, chunk);
    for e in start..end {
        let r = e / width;
        // SAFETY: as `shift_rows`.
        unsafe {
            *dst.add(e) = if r % padded_len + shift < padded_len {
                let bits = *src.add(e + shift * width);
                if format == crate::convert::FORMAT_BF16 {
                    f32::from_bits((bits as u32) << 16)
                } else {
                    crate::convert::f16_bits_to_f32(bits)
                }
            } else {
                0.0
            };
        }
    }
}

/// [`shift_rows`] of token ids (`width` 1; 0 past the sequence).
///
/// Launch: a thread per row.
///
/// # Safety
/// `src`, `dst` hold `rows` elements; `padded_len > 0`; `row < rows`.
#[inline(always)]
pub unsafe fn shift_ids(
    src: *const u32,
    dst: *mut u32,
    padded_len: usize,
    shift: usize,
    row: usize,
) {
    if padded_len == 0 {
        return;
    }
    // SAFETY: as `shift_rows`.
    unsafe {
        *dst.add(row) = if row % padded_len + shift < padded_len {
            *src.add(row + shift)
        } else {
            0
        };
    }
}

/// `positions[r] = r % padded_len + offset`: RoPE positions of TTT step `offset`.
///
/// Launch: a thread per row.
///
/// # Safety
/// `positions` holds `row + 1` elements; `padded_len > 0`.
#[inline(always)]
pub unsafe fn step_positions(positions: *mut u32, padded_len: usize, offset: usize, row: usize) {
    if padded_len == 0 {
        return;
    }
    // SAFETY: the caller's contract.
    unsafe { *positions.add(row) = (row % padded_len + offset) as u32 };
}

/// `out[r] = [a[r] | b[r]]` over `rows` rows of widths `wa`, `wb` (`n = rows · (wa + wb)`).
///
/// Launch: element range over `out`.
///
/// # Safety
/// `a` holds `rows · wa`, `b` `rows · wb`, `out` `n` elements.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn concat_columns(
    a: *const f32,
    b: *const f32,
    out: *mut f32,
    wa: usize,
    wb: usize,
    n: usize,
    chunk_len: usize,
    chunk: usize,
) {
    let width = wa + wb;
    if width == 0 {
        return;
    }
    let (start, end) = range(n, chunk_len, chunk);
    for e in start..end {
        let (r, c) = (e / width, e % width);
        // SAFETY: row `r < rows`; the column is inside its half.
        unsafe {
            *out.add(e) = if c < wa {
                *a.add(r * wa + c)
            } else {
                *b.add(r * wb + c - wa)
            };
        }
    }
}

/// The inverse of [`concat_columns`]: `a[r] = x[r, ..wa]`, `b[r] = x[r, wa..]` (`n = rows · (wa + wb)`).
///
/// Launch: element range over `x`.
///
/// # Safety
/// As [`concat_columns`], `x` read and `a`, `b` written.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn split_columns(
    x: *const f32,
    a: *mut f32,
    b: *mut f32,
    wa: usize,
    wb: usize,
    n: usize,
    chunk_len: usize,
    chunk: usize,
) {
    let width = wa + wb;
    if width == 0 {
        return;
    }
    let (start, end) = range(n, chunk_len, chunk);
    for e in start..end {
        let (r, c) = (e / width, e % width);
        // SAFETY: as `concat_columns`.
        unsafe {
            if c < wa {
                *a.add(r * wa + c) = *x.add(e);
            } else {
                *b.add(r * wb + c - wa) = *x.add(e);
            }
        }
    }
}

/// `counts[k] = Σ_t loss_mask[t + k]` over the rows `t` whose row `t + k` is in their sequence, for `k <
/// steps`: the rows each TTT step's accuracy is over (SpecForge's shifted `loss_mask`).
///
/// Launch: one plane.
///
/// # Safety
/// `loss_mask` holds `rows` elements, `counts` `steps`; `padded_len > 0`.
#[inline(always)]
pub unsafe fn step_mask_counts(
    loss_mask: *const u8,
    counts: *mut f32,
    rows: usize,
    padded_len: usize,
    steps: usize,
    plane: impl Plane,
) {
    if padded_len == 0 {
        return;
    }
    for k in 0..steps {
        // SAFETY: `t + k` is read only inside its sequence, so below `rows`.
        let count = plane.sum(rows, |t| unsafe {
            if t % padded_len + k < padded_len && *loss_mask.add(t + k) != 0 {
                1.0
            } else {
                0.0
            }
        });
        if plane.is_leader() {
            // SAFETY: `k < steps`.
            unsafe { *counts.add(k) = count };
        }
    }
}
