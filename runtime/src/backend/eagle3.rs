//! EAGLE-3's kernels as backend operations: [`Backend`](crate::backend::Backend) methods provided once, for
//! every backend, by [`eagle3_operations!`] (expanded inside the trait), over the table's kernels
//! (`gpu-kernels/src/eagle3.rs` holds the bodies), so the step in `model::eagle3` is written once. They sit with
//! the backends, as DFlash's attention does, so no backend imports a model family.
//!
//! ```text
//!  model::eagle3 step ──▶ Backend (eagle3_operations!: sizes checked) ──▶ Backend::launch(Kernel::NAME) ──┬─▶ CpuBackend:  launch::NAME (host loops over the bodies)
//!                                                                                                         └─▶ CudaBackend: Launcher::NAME (the PTX entry points, compute stream)
//! ```
//!
//! The attention backward is the one composite: `attention_delta` (shared with DFlash), the query gradient, then
//! the key/value gradients added into the stacked ones.

use crate::backend::{Backend, Src};

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
    pub(super) fn keys(&self) -> usize {
        (self.step + 1) * self.rows * self.kv_heads * self.head_dim
    }

    #[track_caller]
    pub(super) fn check(&self, q: usize, k_all: usize, v_all: usize, out: usize, lse: usize) {
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

/// EAGLE-3's operations as provided [`Backend`] methods: `eagle3_operations!()` inside the trait expands them
/// (the trait stays free of one family's operations, and no backend writes them).
macro_rules! eagle3_operations {
    () => {
        /// The unroll's attention forward of one TTT step (`gpu-kernels` `eagle3_attention_forward`).
        fn eagle3_attention_forward(
            &mut self,
            q: $crate::backend::Src<'_, Self, f32>,
            k_all: $crate::backend::Src<'_, Self, f32>,
            v_all: $crate::backend::Src<'_, Self, f32>,
            out: $crate::backend::Dst<'_, Self, f32>,
            lse: $crate::backend::Dst<'_, Self, f32>,
            s: $crate::backend::eagle3::UnrollAttention,
        ) -> $crate::backend::BackendResult {
            s.check(q.len(), k_all.len(), v_all.len(), out.len(), lse.len());
            self.launch($crate::backend::Kernel::eagle3_attention_forward {
                q: Self::read(q),
                k_all: Self::read(k_all),
                v_all: Self::read(v_all),
                out: Self::write(out),
                lse: Self::write(lse),
                rows: s.rows,
                padded_len: s.padded_len,
                step: s.step,
                heads: s.heads,
                kv_heads: s.kv_heads,
                head_dim: s.head_dim,
                scale: s.scale,
            })
        }

        /// Its backward: `dq` overwritten, the keys' and values' gradients of steps `0..=step` added into
        /// `dk_all`, `dv_all`; `delta` is scratch `[rows, heads]`.
        fn eagle3_attention_backward(
            &mut self,
            saved: $crate::backend::eagle3::UnrollSaved<'_, Self>,
            dout: $crate::backend::Src<'_, Self, f32>,
            mut delta: $crate::backend::Dst<'_, Self, f32>,
            (dq, dk_all, dv_all): (
                $crate::backend::Dst<'_, Self, f32>,
                $crate::backend::Dst<'_, Self, f32>,
                $crate::backend::Dst<'_, Self, f32>,
            ),
            s: $crate::backend::eagle3::UnrollAttention,
        ) -> $crate::backend::BackendResult {
            let $crate::backend::eagle3::UnrollSaved {
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
            self.launch($crate::backend::Kernel::attention_delta {
                out: Self::read(out),
                dout: Self::read(dout),
                delta: Self::write(delta.reborrow()),
                head_dim: s.head_dim,
                rows: s.rows * s.heads,
            })?;
            let delta = delta.into_read();
            self.launch($crate::backend::Kernel::eagle3_attention_backward_q {
                q: Self::read(q),
                k_all: Self::read(k_all),
                v_all: Self::read(v_all),
                dout: Self::read(dout),
                lse: Self::read(lse),
                delta: Self::read(delta),
                dq: Self::write(dq),
                rows: s.rows,
                padded_len: s.padded_len,
                step: s.step,
                heads: s.heads,
                kv_heads: s.kv_heads,
                head_dim: s.head_dim,
                scale: s.scale,
            })?;
            self.launch($crate::backend::Kernel::eagle3_attention_backward_kv {
                q: Self::read(q),
                dout: Self::read(dout),
                lse: Self::read(lse),
                delta: Self::read(delta),
                k_all: Self::read(k_all),
                v_all: Self::read(v_all),
                dk_all: Self::write(dk_all),
                dv_all: Self::write(dv_all),
                rows: s.rows,
                padded_len: s.padded_len,
                step: s.step,
                heads: s.heads,
                kv_heads: s.kv_heads,
                head_dim: s.head_dim,
                scale: s.scale,
            })
        }

        /// The soft-label loss of a chunk of rows (`draft` logits in, their gradient out; see the kernel).
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
            let rows = weights.len();
            assert!(
                vocab > 0
                    && draft.len() == rows * vocab
                    && teacher.len() == rows * vocab
                    && row_loss.len() == rows
                    && correct.len() == rows,
                "soft_label_loss: sizes"
            );
            self.launch($crate::backend::Kernel::soft_label_loss_row {
                teacher: Self::read(teacher),
                weights: Self::read(weights),
                draft: Self::write(draft),
                row_loss: Self::write(row_loss),
                correct: Self::write(correct),
                scale,
                vocab,
                rows,
            })
        }

        /// Per row of a full-vocabulary logits chunk: 1 when its loss mask is set and its argmax is in `t2d`.
        fn argmax_in_draft(
            &mut self,
            logits: $crate::backend::Src<'_, Self, f32>,
            t2d: $crate::backend::Src<'_, Self, u8>,
            loss_mask: $crate::backend::Src<'_, Self, u8>,
            valid: $crate::backend::Dst<'_, Self, f32>,
        ) -> $crate::backend::BackendResult {
            let (rows, vocab) = (valid.len(), t2d.len());
            assert!(
                vocab > 0 && logits.len() == rows * vocab && loss_mask.len() == rows,
                "argmax_in_draft: sizes"
            );
            self.launch($crate::backend::Kernel::argmax_in_draft_row {
                logits: Self::read(logits),
                t2d: Self::read(t2d),
                loss_mask: Self::read(loss_mask),
                valid: Self::write(valid),
                vocab,
                rows,
            })
        }

        /// Rows of `src` (`[rows, width]`, any hidden-state precision) shifted up by `shift` inside each
        /// sequence, zeros past its end, into f32 `dst`.
        fn shift_rows(
            &mut self,
            src: $crate::backend::HsSrc<'_, Self>,
            dst: $crate::backend::Dst<'_, Self, f32>,
            width: usize,
            padded_len: usize,
            shift: usize,
        ) -> $crate::backend::BackendResult {
            use draftpipe_gpu_kernels::convert::{FORMAT_BF16, FORMAT_F16};
            use $crate::backend::HsSrc;
            let n = dst.len();
            assert!(
                src.len() == n
                    && width > 0
                    && padded_len > 0
                    && n.is_multiple_of(width * padded_len),
                "shift_rows: sizes"
            );
            let (src, format) = match src {
                HsSrc::F32(src) => {
                    return self.launch($crate::backend::Kernel::shift_rows {
                        src: Self::read(src),
                        dst: Self::write(dst),
                        width,
                        padded_len,
                        shift,
                        n,
                    });
                }
                HsSrc::Bf16(src) => (Self::reinterpret_read(Self::read(src)), FORMAT_BF16),
                HsSrc::F16(src) => (Self::reinterpret_read(Self::read(src)), FORMAT_F16),
            };
            self.launch($crate::backend::Kernel::shift_rows_half {
                src,
                dst: Self::write(dst),
                width,
                padded_len,
                shift,
                format,
                n,
            })
        }

        /// Token ids shifted up by `shift` inside each sequence, 0 past its end.
        fn shift_ids(
            &mut self,
            src: $crate::backend::Src<'_, Self, u32>,
            dst: $crate::backend::Dst<'_, Self, u32>,
            padded_len: usize,
            shift: usize,
        ) -> $crate::backend::BackendResult {
            let rows = dst.len();
            assert!(
                src.len() == rows && padded_len > 0 && rows.is_multiple_of(padded_len),
                "shift_ids: sizes"
            );
            self.launch($crate::backend::Kernel::shift_ids {
                src: Self::read(src),
                dst: Self::write(dst),
                padded_len,
                shift,
                rows,
            })
        }

        /// `positions[r] = r % padded_len + offset`.
        fn step_positions(
            &mut self,
            positions: $crate::backend::Dst<'_, Self, u32>,
            padded_len: usize,
            offset: usize,
        ) -> $crate::backend::BackendResult {
            let rows = positions.len();
            assert!(padded_len > 0, "step_positions: padded_len");
            self.launch($crate::backend::Kernel::step_positions {
                positions: Self::write(positions),
                padded_len,
                offset,
                rows,
            })
        }

        /// `out[r] = [a[r] | b[r]]` (widths `wa`, `wb`).
        fn concat_columns(
            &mut self,
            a: $crate::backend::Src<'_, Self, f32>,
            b: $crate::backend::Src<'_, Self, f32>,
            out: $crate::backend::Dst<'_, Self, f32>,
            wa: usize,
            wb: usize,
        ) -> $crate::backend::BackendResult {
            $crate::backend::eagle3::check_concat(a.len(), b.len(), out.len(), wa, wb);
            let n = out.len();
            self.launch($crate::backend::Kernel::concat_columns {
                a: Self::read(a),
                b: Self::read(b),
                out: Self::write(out),
                wa,
                wb,
                n,
            })
        }

        /// `a[r] = x[r, ..wa]`, `b[r] = x[r, wa..]`.
        fn split_columns(
            &mut self,
            x: $crate::backend::Src<'_, Self, f32>,
            a: $crate::backend::Dst<'_, Self, f32>,
            b: $crate::backend::Dst<'_, Self, f32>,
            wa: usize,
            wb: usize,
        ) -> $crate::backend::BackendResult {
            $crate::backend::eagle3::check_concat(a.len(), b.len(), x.len(), wa, wb);
            let n = x.len();
            self.launch($crate::backend::Kernel::split_columns {
                x: Self::read(x),
                a: Self::write(a),
                b: Self::write(b),
                wa,
                wb,
                n,
            })
        }

        /// `counts[k]`: rows of the loss mask shifted by `k` that are set, for `k < counts.len()`.
        fn step_mask_counts(
            &mut self,
            loss_mask: $crate::backend::Src<'_, Self, u8>,
            counts: $crate::backend::Dst<'_, Self, f32>,
            padded_len: usize,
        ) -> $crate::backend::BackendResult {
            let (rows, steps) = (loss_mask.len(), counts.len());
            assert!(
                padded_len > 0 && rows.is_multiple_of(padded_len),
                "step_mask_counts: sizes"
            );
            self.launch($crate::backend::Kernel::step_mask_counts {
                loss_mask: Self::read(loss_mask),
                counts: Self::write(counts),
                rows,
                padded_len,
                steps,
            })
        }
    };
}
pub(crate) use eagle3_operations;

#[track_caller]
pub(super) fn check_concat(a: usize, b: usize, out: usize, wa: usize, wb: usize) -> usize {
    let width = wa + wb;
    assert!(
        width > 0 && out.is_multiple_of(width),
        "eagle3 columns: sizes"
    );
    let rows = out / width;
    assert!(a == rows * wa && b == rows * wb, "eagle3 columns: sizes");
    rows
}
