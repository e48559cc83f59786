//! EAGLE-3's kernels as backend operations: [`Eagle3Launch`], implemented once per backend over the launchers the
//! kernel table generates (`gpu-kernels/src/eagle3.rs` holds the bodies), so the step in [`super`] is written once.
//!
//! ```text
//!  model::eagle3 step ──▶ Backend (eagle3_backend_methods!) ──▶ Eagle3Launch ──┬─▶ CpuBackend:  kernels::launch::NAME (host loops over the bodies)
//!                                                                              └─▶ CudaBackend: Launcher::NAME (the PTX entry points, compute stream)
//! ```
//!
//! The attention backward is the one composite: `attention_delta` (shared with DFlash), the query gradient, then
//! the key/value gradients added into the stacked ones.

use draftpipe_gpu_kernels::convert::{FORMAT_BF16, FORMAT_F16};

use crate::backend::cpu::kernels::launch as host;
use crate::backend::cpu::{CpuBackend, slice, slice_mut};
use crate::backend::cuda::{CudaBackend, ptr, ptr_mut};
use crate::backend::{Backend, BackendResult, Dst, HsSrc, Src};

/// The shape of one TTT step's attention: `rows` query rows in sequences of `padded_len`, step `step` (it reads
/// the keys of steps `0..=step`), grouped-query heads, softmax scale.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct UnrollAttention {
    /// Query rows (tokens of the batch).
    pub rows: usize,
    /// Rows per sequence.
    pub padded_len: usize,
    /// The TTT step.
    pub step: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Head width.
    pub head_dim: usize,
    /// Score scale (`1 / sqrt(head_dim)`).
    pub scale: f32,
}

impl UnrollAttention {
    /// Elements of the stacked keys (or values) the step reads.
    fn keys(&self) -> usize {
        (self.step + 1) * self.rows * self.kv_heads * self.head_dim
    }

    #[track_caller]
    fn check(&self, q: usize, k_all: usize, v_all: usize, out: usize, lse: usize) {
        assert!(
            self.padded_len > 0
                && self.rows.is_multiple_of(self.padded_len)
                && self.heads.is_multiple_of(self.kv_heads.max(1))
                && self.head_dim <= draftpipe_gpu_kernels::plane::MAX_ROW
                && q == self.rows * self.heads * self.head_dim
                && out == q
                && lse == self.rows * self.heads
                && k_all >= self.keys()
                && v_all >= self.keys(),
            "eagle3 attention: sizes {self:?}"
        );
    }
}

/// The saved tensors the attention backward reads: step `k`'s queries, the stacked keys and values, and the
/// forward's output and log-sum-exp.
pub struct UnrollSaved<'a, B: Backend> {
    /// Queries `[rows, heads, head_dim]` (after RoPE).
    pub q: Src<'a, B, f32>,
    /// Keys of every step, `[steps, rows, kv_heads, head_dim]`.
    pub k_all: Src<'a, B, f32>,
    /// Values of every step.
    pub v_all: Src<'a, B, f32>,
    /// The forward's output.
    pub out: Src<'a, B, f32>,
    /// The forward's log-sum-exp.
    pub lse: Src<'a, B, f32>,
}

/// EAGLE-3's operations beyond the shared ones, one implementation per backend; [`Backend`] exposes them through
/// [`eagle3_backend_methods!`] (declared in the trait, delegated in each backend's impl), so the step and every
/// caller of a generic `B: Backend` reach them without another bound.
pub trait Eagle3Launch: Backend {
    /// The unroll's attention forward of one TTT step (`gpu-kernels` `eagle3_attention_forward`).
    fn eagle3_attention_forward(
        &mut self,
        q: Src<'_, Self, f32>,
        k_all: Src<'_, Self, f32>,
        v_all: Src<'_, Self, f32>,
        out: Dst<'_, Self, f32>,
        lse: Dst<'_, Self, f32>,
        shape: UnrollAttention,
    ) -> BackendResult;

    /// Its backward: `dq` overwritten, the keys' and values' gradients of steps `0..=step` added into
    /// `dk_all`, `dv_all`; `delta` is scratch `[rows, heads]`.
    fn eagle3_attention_backward(
        &mut self,
        saved: UnrollSaved<'_, Self>,
        dout: Src<'_, Self, f32>,
        delta: Dst<'_, Self, f32>,
        grads: (Dst<'_, Self, f32>, Dst<'_, Self, f32>, Dst<'_, Self, f32>),
        shape: UnrollAttention,
    ) -> BackendResult;

    /// The soft-label loss of a chunk of rows (`draft` logits in, their gradient out; see the kernel).
    #[allow(clippy::too_many_arguments)]
    fn soft_label_loss(
        &mut self,
        draft: Dst<'_, Self, f32>,
        teacher: Src<'_, Self, f32>,
        weights: Src<'_, Self, f32>,
        row_loss: Dst<'_, Self, f32>,
        correct: Dst<'_, Self, f32>,
        scale: f32,
        vocab: usize,
    ) -> BackendResult;

    /// Per row of a full-vocabulary logits chunk: 1 when its loss mask is set and its argmax is in `t2d`.
    fn argmax_in_draft(
        &mut self,
        logits: Src<'_, Self, f32>,
        t2d: Src<'_, Self, u8>,
        loss_mask: Src<'_, Self, u8>,
        valid: Dst<'_, Self, f32>,
    ) -> BackendResult;

    /// Rows of `src` (`[rows, width]`, any hidden-state precision) shifted up by `shift` inside each sequence,
    /// zeros past its end, into f32 `dst`.
    fn shift_rows(
        &mut self,
        src: HsSrc<'_, Self>,
        dst: Dst<'_, Self, f32>,
        width: usize,
        padded_len: usize,
        shift: usize,
    ) -> BackendResult;

    /// Token ids shifted up by `shift` inside each sequence, 0 past its end.
    fn shift_ids(
        &mut self,
        src: Src<'_, Self, u32>,
        dst: Dst<'_, Self, u32>,
        padded_len: usize,
        shift: usize,
    ) -> BackendResult;

    /// `positions[r] = r % padded_len + offset`.
    fn step_positions(
        &mut self,
        positions: Dst<'_, Self, u32>,
        padded_len: usize,
        offset: usize,
    ) -> BackendResult;

    /// `out[r] = [a[r] | b[r]]` (widths `wa`, `wb`).
    fn concat_columns(
        &mut self,
        a: Src<'_, Self, f32>,
        b: Src<'_, Self, f32>,
        out: Dst<'_, Self, f32>,
        wa: usize,
        wb: usize,
    ) -> BackendResult;

    /// `a[r] = x[r, ..wa]`, `b[r] = x[r, wa..]`.
    fn split_columns(
        &mut self,
        x: Src<'_, Self, f32>,
        a: Dst<'_, Self, f32>,
        b: Dst<'_, Self, f32>,
        wa: usize,
        wb: usize,
    ) -> BackendResult;

    /// `counts[k]`: rows of the loss mask shifted by `k` that are set, for `k < counts.len()`.
    fn step_mask_counts(
        &mut self,
        loss_mask: Src<'_, Self, u8>,
        counts: Dst<'_, Self, f32>,
        padded_len: usize,
    ) -> BackendResult;
}

/// The [`Eagle3Launch`] operations as [`Backend`] methods: `eagle3_backend_methods!(declare)` inside the trait
/// declares them, `eagle3_backend_methods!(delegate)` inside a backend's impl forwards each to its
/// [`Eagle3Launch`] implementation (one line per backend instead of one method per kernel per backend).
macro_rules! eagle3_backend_methods {
    (declare) => {
        /// See [`Eagle3Launch`](crate::model::eagle3::kernels::Eagle3Launch).
        fn eagle3_attention_forward(
            &mut self,
            q: $crate::backend::Src<'_, Self, f32>,
            k_all: $crate::backend::Src<'_, Self, f32>,
            v_all: $crate::backend::Src<'_, Self, f32>,
            out: $crate::backend::Dst<'_, Self, f32>,
            lse: $crate::backend::Dst<'_, Self, f32>,
            shape: $crate::model::eagle3::kernels::UnrollAttention,
        ) -> $crate::backend::BackendResult;

        /// See [`Eagle3Launch`](crate::model::eagle3::kernels::Eagle3Launch).
        fn eagle3_attention_backward(
            &mut self,
            saved: $crate::model::eagle3::kernels::UnrollSaved<'_, Self>,
            dout: $crate::backend::Src<'_, Self, f32>,
            delta: $crate::backend::Dst<'_, Self, f32>,
            grads: (
                $crate::backend::Dst<'_, Self, f32>,
                $crate::backend::Dst<'_, Self, f32>,
                $crate::backend::Dst<'_, Self, f32>,
            ),
            shape: $crate::model::eagle3::kernels::UnrollAttention,
        ) -> $crate::backend::BackendResult;

        /// See [`Eagle3Launch`](crate::model::eagle3::kernels::Eagle3Launch).
        #[allow(clippy::too_many_arguments)]
        fn soft_label_loss(
            &mut self,
            draft: $crate::backend::Dst<'_, Self, f32>,
            teacher: $crate::backend::Src<'_, Self, f32>,
            weights: $crate::backend::Src<'_, Self, f32>,
            row_loss: $crate::backend::Dst<'_, Self, f32>,
            correct: $crate::backend::Dst<'_, Self, f32>,
            scale: f32,
            vocab: usize,
        ) -> $crate::backend::BackendResult;

        /// See [`Eagle3Launch`](crate::model::eagle3::kernels::Eagle3Launch).
        fn argmax_in_draft(
            &mut self,
            logits: $crate::backend::Src<'_, Self, f32>,
            t2d: $crate::backend::Src<'_, Self, u8>,
            loss_mask: $crate::backend::Src<'_, Self, u8>,
            valid: $crate::backend::Dst<'_, Self, f32>,
        ) -> $crate::backend::BackendResult;

        /// See [`Eagle3Launch`](crate::model::eagle3::kernels::Eagle3Launch).
        fn shift_rows(
            &mut self,
            src: $crate::backend::HsSrc<'_, Self>,
            dst: $crate::backend::Dst<'_, Self, f32>,
            width: usize,
            padded_len: usize,
            shift: usize,
        ) -> $crate::backend::BackendResult;

        /// See [`Eagle3Launch`](crate::model::eagle3::kernels::Eagle3Launch).
        fn shift_ids(
            &mut self,
            src: $crate::backend::Src<'_, Self, u32>,
            dst: $crate::backend::Dst<'_, Self, u32>,
            padded_len: usize,
            shift: usize,
        ) -> $crate::backend::BackendResult;

        /// See [`Eagle3Launch`](crate::model::eagle3::kernels::Eagle3Launch).
        fn step_positions(
            &mut self,
            positions: $crate::backend::Dst<'_, Self, u32>,
            padded_len: usize,
            offset: usize,
        ) -> $crate::backend::BackendResult;

        /// See [`Eagle3Launch`](crate::model::eagle3::kernels::Eagle3Launch).
        fn concat_columns(
            &mut self,
            a: $crate::backend::Src<'_, Self, f32>,
            b: $crate::backend::Src<'_, Self, f32>,
            out: $crate::backend::Dst<'_, Self, f32>,
            wa: usize,
            wb: usize,
        ) -> $crate::backend::BackendResult;

        /// See [`Eagle3Launch`](crate::model::eagle3::kernels::Eagle3Launch).
        fn split_columns(
            &mut self,
            x: $crate::backend::Src<'_, Self, f32>,
            a: $crate::backend::Dst<'_, Self, f32>,
            b: $crate::backend::Dst<'_, Self, f32>,
            wa: usize,
            wb: usize,
        ) -> $crate::backend::BackendResult;

        /// See [`Eagle3Launch`](crate::model::eagle3::kernels::Eagle3Launch).
        fn step_mask_counts(
            &mut self,
            loss_mask: $crate::backend::Src<'_, Self, u8>,
            counts: $crate::backend::Dst<'_, Self, f32>,
            padded_len: usize,
        ) -> $crate::backend::BackendResult;
    };
    (delegate) => {
        fn eagle3_attention_forward(
            &mut self,
            q: $crate::backend::Src<'_, Self, f32>,
            k_all: $crate::backend::Src<'_, Self, f32>,
            v_all: $crate::backend::Src<'_, Self, f32>,
            out: $crate::backend::Dst<'_, Self, f32>,
            lse: $crate::backend::Dst<'_, Self, f32>,
            shape: $crate::model::eagle3::kernels::UnrollAttention,
        ) -> $crate::backend::BackendResult {
            $crate::model::eagle3::kernels::Eagle3Launch::eagle3_attention_forward(
                self, q, k_all, v_all, out, lse, shape,
            )
        }

        fn eagle3_attention_backward(
            &mut self,
            saved: $crate::model::eagle3::kernels::UnrollSaved<'_, Self>,
            dout: $crate::backend::Src<'_, Self, f32>,
            delta: $crate::backend::Dst<'_, Self, f32>,
            grads: (
                $crate::backend::Dst<'_, Self, f32>,
                $crate::backend::Dst<'_, Self, f32>,
                $crate::backend::Dst<'_, Self, f32>,
            ),
            shape: $crate::model::eagle3::kernels::UnrollAttention,
        ) -> $crate::backend::BackendResult {
            $crate::model::eagle3::kernels::Eagle3Launch::eagle3_attention_backward(
                self, saved, dout, delta, grads, shape,
            )
        }

        #[allow(clippy::too_many_arguments)]
        fn soft_label_loss(
            &mut self,
            draft: $crate::backend::Dst<'_, Self, f32>,
            teacher: $crate::backend::Src<'_, Self, f32>,
            weights: $crate::backend::Src<'_, Self, f32>,
            row_loss: $crate::backend::Dst<'_, Self, f32>,
            correct: $crate::backend::Dst<'_, Self, f32>,
            scale: f32,
            vocab: usize,
        ) -> $crate::backend::BackendResult {
            $crate::model::eagle3::kernels::Eagle3Launch::soft_label_loss(
                self, draft, teacher, weights, row_loss, correct, scale, vocab,
            )
        }

        fn argmax_in_draft(
            &mut self,
            logits: $crate::backend::Src<'_, Self, f32>,
            t2d: $crate::backend::Src<'_, Self, u8>,
            loss_mask: $crate::backend::Src<'_, Self, u8>,
            valid: $crate::backend::Dst<'_, Self, f32>,
        ) -> $crate::backend::BackendResult {
            $crate::model::eagle3::kernels::Eagle3Launch::argmax_in_draft(
                self, logits, t2d, loss_mask, valid,
            )
        }

        fn shift_rows(
            &mut self,
            src: $crate::backend::HsSrc<'_, Self>,
            dst: $crate::backend::Dst<'_, Self, f32>,
            width: usize,
            padded_len: usize,
            shift: usize,
        ) -> $crate::backend::BackendResult {
            $crate::model::eagle3::kernels::Eagle3Launch::shift_rows(
                self, src, dst, width, padded_len, shift,
            )
        }

        fn shift_ids(
            &mut self,
            src: $crate::backend::Src<'_, Self, u32>,
            dst: $crate::backend::Dst<'_, Self, u32>,
            padded_len: usize,
            shift: usize,
        ) -> $crate::backend::BackendResult {
            $crate::model::eagle3::kernels::Eagle3Launch::shift_ids(
                self, src, dst, padded_len, shift,
            )
        }

        fn step_positions(
            &mut self,
            positions: $crate::backend::Dst<'_, Self, u32>,
            padded_len: usize,
            offset: usize,
        ) -> $crate::backend::BackendResult {
            $crate::model::eagle3::kernels::Eagle3Launch::step_positions(
                self, positions, padded_len, offset,
            )
        }

        fn concat_columns(
            &mut self,
            a: $crate::backend::Src<'_, Self, f32>,
            b: $crate::backend::Src<'_, Self, f32>,
            out: $crate::backend::Dst<'_, Self, f32>,
            wa: usize,
            wb: usize,
        ) -> $crate::backend::BackendResult {
            $crate::model::eagle3::kernels::Eagle3Launch::concat_columns(self, a, b, out, wa, wb)
        }

        fn split_columns(
            &mut self,
            x: $crate::backend::Src<'_, Self, f32>,
            a: $crate::backend::Dst<'_, Self, f32>,
            b: $crate::backend::Dst<'_, Self, f32>,
            wa: usize,
            wb: usize,
        ) -> $crate::backend::BackendResult {
            $crate::model::eagle3::kernels::Eagle3Launch::split_columns(self, x, a, b, wa, wb)
        }

        fn step_mask_counts(
            &mut self,
            loss_mask: $crate::backend::Src<'_, Self, u8>,
            counts: $crate::backend::Dst<'_, Self, f32>,
            padded_len: usize,
        ) -> $crate::backend::BackendResult {
            $crate::model::eagle3::kernels::Eagle3Launch::step_mask_counts(
                self, loss_mask, counts, padded_len,
            )
        }
    };
}
pub(crate) use eagle3_backend_methods;

#[track_caller]
fn check_concat(a: usize, b: usize, out: usize, wa: usize, wb: usize) -> usize {
    let width = wa + wb;
    assert!(
        width > 0 && out.is_multiple_of(width),
        "eagle3 columns: sizes"
    );
    let rows = out / width;
    assert!(a == rows * wa && b == rows * wb, "eagle3 columns: sizes");
    rows
}

impl Eagle3Launch for CpuBackend {
    fn eagle3_attention_forward(
        &mut self,
        q: Src<'_, Self, f32>,
        k_all: Src<'_, Self, f32>,
        v_all: Src<'_, Self, f32>,
        out: Dst<'_, Self, f32>,
        lse: Dst<'_, Self, f32>,
        s: UnrollAttention,
    ) -> BackendResult {
        s.check(q.len(), k_all.len(), v_all.len(), out.len(), lse.len());
        host::eagle3_attention_forward(
            slice(q),
            slice(k_all),
            slice(v_all),
            slice_mut(out),
            slice_mut(lse),
            s.rows,
            s.padded_len,
            s.step,
            s.heads,
            s.kv_heads,
            s.head_dim,
            s.scale,
        );
        Ok(())
    }

    fn eagle3_attention_backward(
        &mut self,
        saved: UnrollSaved<'_, Self>,
        dout: Src<'_, Self, f32>,
        delta: Dst<'_, Self, f32>,
        (dq, dk_all, dv_all): (Dst<'_, Self, f32>, Dst<'_, Self, f32>, Dst<'_, Self, f32>),
        s: UnrollAttention,
    ) -> BackendResult {
        let UnrollSaved {
            q,
            k_all,
            v_all,
            out,
            lse,
        } = saved;
        s.check(q.len(), k_all.len(), v_all.len(), out.len(), lse.len());
        assert!(
            dout.len() == q.len()
                && dq.len() == q.len()
                && delta.len() == lse.len()
                && dk_all.len() >= s.keys()
                && dv_all.len() >= s.keys(),
            "eagle3 attention backward: sizes"
        );
        let delta = slice_mut(delta);
        host::attention_delta(
            slice(out),
            slice(dout),
            &mut *delta,
            s.head_dim,
            s.rows * s.heads,
        );
        let args = (
            s.rows,
            s.padded_len,
            s.step,
            s.heads,
            s.kv_heads,
            s.head_dim,
            s.scale,
        );
        host::eagle3_attention_backward_q(
            slice(q),
            slice(k_all),
            slice(v_all),
            slice(dout),
            slice(lse),
            &*delta,
            slice_mut(dq),
            args.0,
            args.1,
            args.2,
            args.3,
            args.4,
            args.5,
            args.6,
        );
        host::eagle3_attention_backward_kv(
            slice(q),
            slice(dout),
            slice(lse),
            &*delta,
            slice(k_all),
            slice(v_all),
            slice_mut(dk_all),
            slice_mut(dv_all),
            args.0,
            args.1,
            args.2,
            args.3,
            args.4,
            args.5,
            args.6,
        );
        Ok(())
    }

    fn soft_label_loss(
        &mut self,
        draft: Dst<'_, Self, f32>,
        teacher: Src<'_, Self, f32>,
        weights: Src<'_, Self, f32>,
        row_loss: Dst<'_, Self, f32>,
        correct: Dst<'_, Self, f32>,
        scale: f32,
        vocab: usize,
    ) -> BackendResult {
        let rows = weights.len();
        assert!(
            vocab > 0
                && draft.len() == rows * vocab
                && teacher.len() == rows * vocab
                && row_loss.len() == rows
                && correct.len() == rows,
            "soft_label_loss: sizes"
        );
        host::soft_label_loss_row(
            slice(teacher),
            slice(weights),
            slice_mut(draft),
            slice_mut(row_loss),
            slice_mut(correct),
            scale,
            vocab,
            rows,
        );
        Ok(())
    }

    fn argmax_in_draft(
        &mut self,
        logits: Src<'_, Self, f32>,
        t2d: Src<'_, Self, u8>,
        loss_mask: Src<'_, Self, u8>,
        valid: Dst<'_, Self, f32>,
    ) -> BackendResult {
        let (rows, vocab) = (valid.len(), t2d.len());
        assert!(
            vocab > 0 && logits.len() == rows * vocab && loss_mask.len() == rows,
            "argmax_in_draft: sizes"
        );
        host::argmax_in_draft_row(
            slice(logits),
            slice(t2d),
            slice(loss_mask),
            slice_mut(valid),
            vocab,
            rows,
        );
        Ok(())
    }

    fn shift_rows(
        &mut self,
        src: HsSrc<'_, Self>,
        dst: Dst<'_, Self, f32>,
        width: usize,
        padded_len: usize,
        shift: usize,
    ) -> BackendResult {
        let n = dst.len();
        assert!(
            src.len() == n && width > 0 && padded_len > 0 && n.is_multiple_of(width * padded_len),
            "shift_rows: sizes"
        );
        let dst = slice_mut(dst);
        match src {
            HsSrc::F32(src) => host::shift_rows(slice(src), dst, width, padded_len, shift, n),
            HsSrc::Bf16(src) => host::shift_rows_half(
                bytemuck_u16(slice(src)),
                dst,
                width,
                padded_len,
                shift,
                FORMAT_BF16,
                n,
            ),
            HsSrc::F16(src) => host::shift_rows_half(
                bytemuck_u16(slice(src)),
                dst,
                width,
                padded_len,
                shift,
                FORMAT_F16,
                n,
            ),
        }
        Ok(())
    }

    fn shift_ids(
        &mut self,
        src: Src<'_, Self, u32>,
        dst: Dst<'_, Self, u32>,
        padded_len: usize,
        shift: usize,
    ) -> BackendResult {
        let rows = dst.len();
        assert!(
            src.len() == rows && padded_len > 0 && rows.is_multiple_of(padded_len),
            "shift_ids: sizes"
        );
        host::shift_ids(slice(src), slice_mut(dst), padded_len, shift, rows);
        Ok(())
    }

    fn step_positions(
        &mut self,
        positions: Dst<'_, Self, u32>,
        padded_len: usize,
        offset: usize,
    ) -> BackendResult {
        let rows = positions.len();
        assert!(padded_len > 0, "step_positions: padded_len");
        host::step_positions(slice_mut(positions), padded_len, offset, rows);
        Ok(())
    }

    fn concat_columns(
        &mut self,
        a: Src<'_, Self, f32>,
        b: Src<'_, Self, f32>,
        out: Dst<'_, Self, f32>,
        wa: usize,
        wb: usize,
    ) -> BackendResult {
        check_concat(a.len(), b.len(), out.len(), wa, wb);
        let n = out.len();
        host::concat_columns(slice(a), slice(b), slice_mut(out), wa, wb, n);
        Ok(())
    }

    fn split_columns(
        &mut self,
        x: Src<'_, Self, f32>,
        a: Dst<'_, Self, f32>,
        b: Dst<'_, Self, f32>,
        wa: usize,
        wb: usize,
    ) -> BackendResult {
        check_concat(a.len(), b.len(), x.len(), wa, wb);
        let n = x.len();
        host::split_columns(slice(x), slice_mut(a), slice_mut(b), wa, wb, n);
        Ok(())
    }

    fn step_mask_counts(
        &mut self,
        loss_mask: Src<'_, Self, u8>,
        counts: Dst<'_, Self, f32>,
        padded_len: usize,
    ) -> BackendResult {
        let (rows, steps) = (loss_mask.len(), counts.len());
        assert!(
            padded_len > 0 && rows.is_multiple_of(padded_len),
            "step_mask_counts: sizes"
        );
        host::step_mask_counts(slice(loss_mask), slice_mut(counts), rows, padded_len, steps);
        Ok(())
    }
}

/// The bits of 16-bit floats, as the kernels read them.
fn bytemuck_u16<T: Copy>(values: &[T]) -> &[u16] {
    assert_eq!(size_of::<T>(), 2, "16-bit values");
    // SAFETY: `T` is a 2-byte plain float type (`bf16` or `f16`, `repr(transparent)` over `u16`); the slice's
    // length and alignment carry over.
    unsafe { std::slice::from_raw_parts(values.as_ptr().cast::<u16>(), values.len()) }
}

impl Eagle3Launch for CudaBackend {
    fn eagle3_attention_forward(
        &mut self,
        q: Src<'_, Self, f32>,
        k_all: Src<'_, Self, f32>,
        v_all: Src<'_, Self, f32>,
        out: Dst<'_, Self, f32>,
        lse: Dst<'_, Self, f32>,
        s: UnrollAttention,
    ) -> BackendResult {
        s.check(q.len(), k_all.len(), v_all.len(), out.len(), lse.len());
        self.launcher().eagle3_attention_forward(
            ptr(q),
            ptr(k_all),
            ptr(v_all),
            ptr_mut(out),
            ptr_mut(lse),
            s.rows,
            s.padded_len,
            s.step,
            s.heads,
            s.kv_heads,
            s.head_dim,
            s.scale,
        )?;
        Ok(())
    }

    fn eagle3_attention_backward(
        &mut self,
        saved: UnrollSaved<'_, Self>,
        dout: Src<'_, Self, f32>,
        delta: Dst<'_, Self, f32>,
        (dq, dk_all, dv_all): (Dst<'_, Self, f32>, Dst<'_, Self, f32>, Dst<'_, Self, f32>),
        s: UnrollAttention,
    ) -> BackendResult {
        let UnrollSaved {
            q,
            k_all,
            v_all,
            out,
            lse,
        } = saved;
        s.check(q.len(), k_all.len(), v_all.len(), out.len(), lse.len());
        assert!(
            dout.len() == q.len()
                && dq.len() == q.len()
                && delta.len() == lse.len()
                && dk_all.len() >= s.keys()
                && dv_all.len() >= s.keys(),
            "eagle3 attention backward: sizes"
        );
        let kernels = self.launcher();
        let delta = ptr_mut(delta);
        kernels.attention_delta(ptr(out), ptr(dout), delta, s.head_dim, s.rows * s.heads)?;
        // SAFETY (both casts): the same allocation, read by the next kernels on the same stream after the
        // delta kernel wrote it.
        let delta_read = unsafe { delta.cast::<f32>() };
        kernels.eagle3_attention_backward_q(
            ptr(q),
            ptr(k_all),
            ptr(v_all),
            ptr(dout),
            ptr(lse),
            delta_read,
            ptr_mut(dq),
            s.rows,
            s.padded_len,
            s.step,
            s.heads,
            s.kv_heads,
            s.head_dim,
            s.scale,
        )?;
        kernels.eagle3_attention_backward_kv(
            ptr(q),
            ptr(dout),
            ptr(lse),
            unsafe { delta.cast::<f32>() },
            ptr(k_all),
            ptr(v_all),
            ptr_mut(dk_all),
            ptr_mut(dv_all),
            s.rows,
            s.padded_len,
            s.step,
            s.heads,
            s.kv_heads,
            s.head_dim,
            s.scale,
        )?;
        Ok(())
    }

    fn soft_label_loss(
        &mut self,
        draft: Dst<'_, Self, f32>,
        teacher: Src<'_, Self, f32>,
        weights: Src<'_, Self, f32>,
        row_loss: Dst<'_, Self, f32>,
        correct: Dst<'_, Self, f32>,
        scale: f32,
        vocab: usize,
    ) -> BackendResult {
        let rows = weights.len();
        assert!(
            vocab > 0
                && draft.len() == rows * vocab
                && teacher.len() == rows * vocab
                && row_loss.len() == rows
                && correct.len() == rows,
            "soft_label_loss: sizes"
        );
        self.launcher().soft_label_loss_row(
            ptr(teacher),
            ptr(weights),
            ptr_mut(draft),
            ptr_mut(row_loss),
            ptr_mut(correct),
            scale,
            vocab,
            rows,
        )?;
        Ok(())
    }

    fn argmax_in_draft(
        &mut self,
        logits: Src<'_, Self, f32>,
        t2d: Src<'_, Self, u8>,
        loss_mask: Src<'_, Self, u8>,
        valid: Dst<'_, Self, f32>,
    ) -> BackendResult {
        let (rows, vocab) = (valid.len(), t2d.len());
        assert!(
            vocab > 0 && logits.len() == rows * vocab && loss_mask.len() == rows,
            "argmax_in_draft: sizes"
        );
        self.launcher().argmax_in_draft_row(
            ptr(logits),
            ptr(t2d),
            ptr(loss_mask),
            ptr_mut(valid),
            vocab,
            rows,
        )?;
        Ok(())
    }

    fn shift_rows(
        &mut self,
        src: HsSrc<'_, Self>,
        dst: Dst<'_, Self, f32>,
        width: usize,
        padded_len: usize,
        shift: usize,
    ) -> BackendResult {
        let n = dst.len();
        assert!(
            src.len() == n && width > 0 && padded_len > 0 && n.is_multiple_of(width * padded_len),
            "shift_rows: sizes"
        );
        let kernels = self.launcher();
        let dst = ptr_mut(dst);
        // SAFETY (casts): bf16 and f16 are 16-bit values the kernel reads as their bits.
        match src {
            HsSrc::F32(src) => kernels.shift_rows(ptr(src), dst, width, padded_len, shift, n)?,
            HsSrc::Bf16(src) => kernels.shift_rows_half(
                unsafe { ptr(src).cast::<u16>() },
                dst,
                width,
                padded_len,
                shift,
                FORMAT_BF16,
                n,
            )?,
            HsSrc::F16(src) => kernels.shift_rows_half(
                unsafe { ptr(src).cast::<u16>() },
                dst,
                width,
                padded_len,
                shift,
                FORMAT_F16,
                n,
            )?,
        }
        Ok(())
    }

    fn shift_ids(
        &mut self,
        src: Src<'_, Self, u32>,
        dst: Dst<'_, Self, u32>,
        padded_len: usize,
        shift: usize,
    ) -> BackendResult {
        let rows = dst.len();
        assert!(
            src.len() == rows && padded_len > 0 && rows.is_multiple_of(padded_len),
            "shift_ids: sizes"
        );
        self.launcher()
            .shift_ids(ptr(src), ptr_mut(dst), padded_len, shift, rows)?;
        Ok(())
    }

    fn step_positions(
        &mut self,
        positions: Dst<'_, Self, u32>,
        padded_len: usize,
        offset: usize,
    ) -> BackendResult {
        let rows = positions.len();
        assert!(padded_len > 0, "step_positions: padded_len");
        self.launcher()
            .step_positions(ptr_mut(positions), padded_len, offset, rows)?;
        Ok(())
    }

    fn concat_columns(
        &mut self,
        a: Src<'_, Self, f32>,
        b: Src<'_, Self, f32>,
        out: Dst<'_, Self, f32>,
        wa: usize,
        wb: usize,
    ) -> BackendResult {
        check_concat(a.len(), b.len(), out.len(), wa, wb);
        let n = out.len();
        self.launcher()
            .concat_columns(ptr(a), ptr(b), ptr_mut(out), wa, wb, n)?;
        Ok(())
    }

    fn split_columns(
        &mut self,
        x: Src<'_, Self, f32>,
        a: Dst<'_, Self, f32>,
        b: Dst<'_, Self, f32>,
        wa: usize,
        wb: usize,
    ) -> BackendResult {
        check_concat(a.len(), b.len(), x.len(), wa, wb);
        let n = x.len();
        self.launcher()
            .split_columns(ptr(x), ptr_mut(a), ptr_mut(b), wa, wb, n)?;
        Ok(())
    }

    fn step_mask_counts(
        &mut self,
        loss_mask: Src<'_, Self, u8>,
        counts: Dst<'_, Self, f32>,
        padded_len: usize,
    ) -> BackendResult {
        let (rows, steps) = (loss_mask.len(), counts.len());
        assert!(
            padded_len > 0 && rows.is_multiple_of(padded_len),
            "step_mask_counts: sizes"
        );
        self.launcher().step_mask_counts(
            ptr(loss_mask),
            ptr_mut(counts),
            rows,
            padded_len,
            steps,
        )?;
        Ok(())
    }
}
