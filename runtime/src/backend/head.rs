//! The frozen `lm_head` over the labelled rows only: a backend operation provided once, for every backend, by
//! [`head_operations!`] (expanded inside the [`Backend`](crate::backend::Backend) trait), over the table's
//! kernels and the backend's GEMM, so the CPU and CUDA run the same body. Rows without a label (slot 0 of
//! every block, slots past a sequence's end, blocks of absent anchors, positions the loss mask drops) weigh 0
//! in the loss, and the head's two products are the largest of a DFlash step: they skip those rows.
//!
//! ```text
//!  z [Q, H] ──gather(head_rows)──▶ head_z [M, H]
//!  per chunk of C head rows: logits = head_z·lm_headᵀ ──weighted_vocab_loss (gradient in place)──▶
//!      head_dz = logits·lm_head, row_loss, head_correct
//!  head_dz [M, H] ──gather(head_index)──▶ dz [Q, H]      head_correct [M] ──gather(head_index)──▶ correct [Q]
//! ```
//!
//! Where the layout keeps the head's 16-bit operands (CUDA at `bf16`, [`HeadOperands::Bf16`]) both products
//! read only bf16 from memory: `lm_head`'s frozen copy (rounded once when the target's tensors are uploaded),
//! the head rows gathered straight into bf16 (no f32 copy of them), and the logits gradient's copy the fused
//! loss writes in its gradient pass; the logits themselves stay f32 (the product writes f32, which the
//! softmax reads). Elsewhere every operand is f32 and the backend rounds inside its product as its precision
//! says (the CPU's bf16 emulation rounds the same values at the same points).
//!
//! `M` head rows: the labelled rows, then unlabelled padding (label −1), the last head row always unlabelled;
//! the fused loss writes a zero gradient, loss and `correct` for an unlabelled row, so a block row without a
//! label reads zeros back through `head_index` (which points it at the last head row). Both gathers are the
//! `embedding_gather` kernel: a gather of whole rows by index. `M` is the batch's labelled rows plus one on a
//! synchronous backend, the bucket's bound `N·A·(B − 1) + 1` where a step is captured once per bucket
//! (`DflashSpec::head_rows`); the block plan builds the arrays (`model::dflash::blocks`).

use crate::backend::{Dst, Src};

/// The head's rows, built with the block plan and staged with the batch.
pub struct HeadPlan<'a, B: crate::backend::Backend> {
    /// The block row each head row gathers `[M]`.
    pub rows: Src<'a, B, u32>,
    /// The head row of each block row `[Q]` (the last, unlabelled one for a row without a label).
    pub index: Src<'a, B, u32>,
    /// Label of each head row `[M]` (−1: none).
    pub labels: Src<'a, B, i32>,
    /// Loss weight of each head row `[M]`.
    pub weights: Src<'a, B, f32>,
    /// `1 / Σ weights` `[1]`.
    pub norm: Src<'a, B, f32>,
}

/// The head's product operands: f32, or the 16-bit copies CUDA's products read at `bf16` (module docs).
pub enum HeadOperands<'a, B: crate::backend::Backend> {
    /// f32 operands: the gathered final-norm output of the head rows `[M, H]`.
    F32 {
        /// The gathered rows `[M, H]`.
        z: Dst<'a, B, f32>,
    },
    /// bf16 operands.
    Bf16 {
        /// `lm_head` rounded to bf16 `[V, H]` (frozen: rounded once at upload).
        lm_head: Src<'a, B, half::bf16>,
        /// The gathered rows in bf16 `[M, H]`.
        z: Dst<'a, B, half::bf16>,
        /// The logits gradient of one chunk in bf16 `[C, V]`.
        logits: Dst<'a, B, half::bf16>,
    },
}

/// The head's scratch: the gathered rows (in the operands), their gradient, one logits chunk and the per-row
/// hits.
pub struct HeadScratch<'a, B: crate::backend::Backend> {
    /// The products' operands.
    pub operands: HeadOperands<'a, B>,
    /// Their gradient `[M, H]`.
    pub dz: Dst<'a, B, f32>,
    /// One chunk of logits `[C, V]` (`C` its length over `V`).
    pub logits: Dst<'a, B, f32>,
    /// Whether each head row's argmax is its label `[M]`.
    pub correct: Dst<'a, B, f32>,
}

/// What the head writes: the loss of each head row, and per block row the gradient of the final-norm output
/// and the argmax hit (both zero without a label).
pub struct HeadOutputs<'a, B: crate::backend::Backend> {
    /// Weighted loss of each head row `[M]` (their sum is the step's loss).
    pub row_loss: Dst<'a, B, f32>,
    /// Gradient of the final-norm output `[Q, H]`.
    pub dz: Dst<'a, B, f32>,
    /// Argmax hit of each block row `[Q]`.
    pub correct: Dst<'a, B, f32>,
}

/// The head's operation as a provided [`Backend`](crate::backend::Backend) method. Expanded only inside the
/// trait in `backend/mod.rs`.
macro_rules! head_operations {
    () => {
        /// The frozen `lm_head` and the weighted fused loss over the head rows of `plan` (module
        /// `backend::head`): `z [Q, H]` the final-norm output, `lm_head [V, H]`; chunk by chunk of the scratch's
        /// logits, never `[M, V]`.
        fn labelled_head_loss(
            &mut self,
            (z, lm_head): (Src<'_, Self, f32>, Src<'_, Self, f32>),
            plan: crate::backend::head::HeadPlan<'_, Self>,
            scratch: crate::backend::head::HeadScratch<'_, Self>,
            out: crate::backend::head::HeadOutputs<'_, Self>,
            precision: Precision,
        ) -> BackendResult {
            let (q, m) = (plan.index.len(), plan.rows.len());
            assert!(
                q > 0 && m > 0 && z.len().is_multiple_of(q),
                "labelled_head_loss: rows"
            );
            let h = z.len() / q;
            assert!(
                h > 0 && lm_head.len().is_multiple_of(h),
                "labelled_head_loss: lm_head"
            );
            let v = lm_head.len() / h;
            let chunk = scratch.logits.len() / v.max(1);
            let operand_rows = match &scratch.operands {
                crate::backend::head::HeadOperands::F32 { z } => z.len(),
                crate::backend::head::HeadOperands::Bf16 {
                    lm_head: lm16,
                    z,
                    logits,
                } => {
                    assert!(
                        lm16.len() == lm_head.len() && logits.len() == scratch.logits.len(),
                        "labelled_head_loss: 16-bit copies"
                    );
                    z.len()
                }
            };
            assert!(
                chunk > 0
                    && plan.labels.len() == m
                    && plan.weights.len() == m
                    && operand_rows == m * h
                    && scratch.dz.len() == m * h
                    && scratch.correct.len() == m
                    && out.row_loss.len() == m
                    && out.dz.len() == q * h
                    && out.correct.len() == q,
                "labelled_head_loss: sizes"
            );
            let crate::backend::head::HeadScratch {
                operands,
                dz: mut head_dz,
                mut logits,
                correct: mut head_correct,
            } = scratch;
            let mut row_loss = out.row_loss;
            // The gathered rows and `lm_head` as product operands, and the logits gradient's copy if kept.
            let (head_z, lm, mut logits16) = match operands {
                crate::backend::head::HeadOperands::F32 { z: mut head_z } => {
                    self.embedding_gather(z, plan.rows, head_z.reborrow())?;
                    (
                        HsSrc::F32(head_z.into_read()),
                        HsOperand::from(Operand::new(lm_head, v, h)),
                        None,
                    )
                }
                crate::backend::head::HeadOperands::Bf16 {
                    lm_head: lm16,
                    z: mut head_z,
                    logits: logits16,
                } => {
                    self.embedding_gather_bf16(z, plan.rows, head_z.reborrow())?;
                    (
                        HsSrc::Bf16(head_z.into_read()),
                        HsOperand::new(HsSrc::Bf16(lm16), v, h),
                        Some(logits16),
                    )
                }
            };
            for start in (0..m).step_by(chunk) {
                let rows = chunk.min(m - start);
                let mut chunk_logits = logits.at_mut(0, rows * v);
                self.gemm_hs(
                    chunk_logits.reborrow(),
                    HsOperand::new(head_z.at(start * h, rows * h), rows, h),
                    lm.t(),
                    1.0,
                    0.0,
                    precision,
                )?;
                let mut chunk_copy = logits16.as_mut().map(|c| c.at_mut(0, rows * v));
                self.weighted_vocab_loss(
                    (
                        chunk_logits.reborrow(),
                        chunk_copy.as_mut().map(|c| c.reborrow()),
                    ),
                    plan.labels.at(start, rows),
                    plan.weights.at(start, rows),
                    plan.norm,
                    row_loss.at_mut(start, rows),
                    head_correct.at_mut(start, rows),
                    v,
                )?;
                let dlogits = match chunk_copy {
                    Some(copy) => HsSrc::Bf16(copy.into_read()),
                    None => HsSrc::F32(chunk_logits.into_read()),
                };
                self.gemm_hs(
                    head_dz.at_mut(start * h, rows * h),
                    HsOperand::new(dlogits, rows, v),
                    lm,
                    1.0,
                    0.0,
                    precision,
                )?;
            }
            self.embedding_gather(head_dz.into_read(), plan.index, out.dz)?;
            self.embedding_gather(head_correct.into_read(), plan.index, out.correct)
        }
    };
}
pub(super) use head_operations;
