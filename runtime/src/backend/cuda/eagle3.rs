//! [`Eagle3Launch`] on CUDA: size checks, then the table's launchers on the compute stream (the PTX entry
//! points).

use draftpipe_gpu_kernels::convert::{FORMAT_BF16, FORMAT_F16};

use super::{CudaBackend, ptr, ptr_mut};
use crate::backend::eagle3::{Eagle3Launch, UnrollAttention, UnrollSaved, check_concat};
use crate::backend::{BackendResult, Dst, HsSrc, Src};

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
