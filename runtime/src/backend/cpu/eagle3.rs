//! [`Eagle3Launch`] on the host: size checks, then the table's host launchers (`backend/cpu/kernels.rs`) over
//! the kernel bodies.

use draftpipe_gpu_kernels::convert::{FORMAT_BF16, FORMAT_F16};

use super::{CpuBackend, slice, slice_mut};
use crate::backend::cpu::kernels::launch as host;
use crate::backend::eagle3::{Eagle3Launch, UnrollAttention, UnrollSaved, check_concat};
use crate::backend::{BackendResult, Dst, HsSrc, Src};

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
