//! The `mlp` drafter's workspace: every buffer one worker allocates besides the flat state buffers.
//!
//! Notation: `T` the largest bucket's tokens, `S` its sequences, `H` hidden, `I` intermediate, `L` blocks, `J`
//! heads, `V` vocabulary, `C = clamp(chunk_tokens, 1, T)` rows of the fused loss's logits chunk, `P` parameters.

use crate::family::mlp::MlpSpec;
use crate::plan::derived::BucketPlan;
use crate::plan::stages::{LossSpec, Precision};
use crate::workspace::{
    ADAMW_STATE_DOUBLES, ADAMW_STEP_FLOATS, BackendKind, CUBLAS_WORKSPACE_BYTES, Dtype,
    NORM_ROWS_PER_CHUNK, REDUCE_CHUNK, STEP_SCALARS, WorkspaceBuffer, WorkspaceLayout,
    hs_operand_elements,
};

impl WorkspaceLayout {
    /// The `mlp` drafter's workspace for `buckets` on `backend` at `precision`; `None` when a size overflows.
    ///
    /// # Examples
    /// ```
    /// use draftpipe_compiler::plan::{BucketPlan, LossSpec, MlpSpec, Precision};
    /// use draftpipe_compiler::workspace::{BackendKind, WorkspaceLayout};
    ///
    /// let spec = MlpSpec { din: 8, hidden: 4, blocks: 1, intermediate: 6, heads: 2, vocab: 10 };
    /// let bucket = BucketPlan { padded_len: 4, sequences: 2, tokens: 8, step_flops: 0, step_bytes: 0 };
    /// let loss = LossSpec { head_decay: 0.8, position_decay: None, step_decay: None, chunk_tokens: 3 };
    /// let cpu = WorkspaceLayout::mlp(&spec, &[bucket.clone()], &loss, BackendKind::Cpu, Precision::F32).unwrap();
    /// let cuda = WorkspaceLayout::mlp(&spec, &[bucket], &loss, BackendKind::Cuda, Precision::F32).unwrap();
    /// assert_eq!(cpu.elements("logits"), Some(3 * 10));
    /// assert!(cuda.bytes().unwrap() > cpu.bytes().unwrap()); // a second input slot and cuBLAS's workspace
    /// ```
    pub fn mlp(
        spec: &MlpSpec,
        buckets: &[BucketPlan],
        loss: &LossSpec,
        backend: BackendKind,
        precision: Precision,
    ) -> Option<Self> {
        let MlpSpec {
            din,
            hidden: h,
            blocks: l,
            intermediate: i,
            heads: j,
            vocab: v,
        } = *spec;
        let t = buckets.iter().map(|b| b.tokens).max().unwrap_or(0);
        let s = buckets.iter().map(|b| b.sequences).max().unwrap_or(0);
        let c = loss.chunk_tokens.clamp(1, t.max(1));
        let m = |a: usize, b: usize| a.checked_mul(b);
        let p = [
            m(h, din)?,
            m(l, h.checked_add(m(3, m(i, h)?)?)?)?,
            h,
            m(j, m(h, h)?)?,
            m(v, h)?,
        ]
        .into_iter()
        .try_fold(0usize, |sum, x| sum.checked_add(x))?;
        let th = m(t, h)?;
        let mut buffers = Vec::new();
        let mut add = |name: &str, dtype: Dtype, elements: Option<usize>| -> Option<()> {
            buffers.push(WorkspaceBuffer {
                name: name.to_owned(),
                dtype,
                elements: elements?,
            });
            Some(())
        };
        use Dtype::{F32, F64, I32, U8, U32};
        // Forward activations kept for the backward pass.
        // The residual stream before each block and after the last, one buffer each (a block reads one and
        // writes the next).
        for b in 0..=l {
            add(&format!("xs.{b}"), F32, Some(th))?;
        }
        add("normed", F32, m(l, th))?;
        add("inv_rms", F32, m(l + 1, t))?;
        add("gate_up", F32, m(m(l, t)?, m(2, i)?))?;
        add("act", F32, m(m(l, t)?, i))?;
        add("z", F32, Some(th))?;
        // One head at a time: its pre-activation, output and their gradients.
        for name in ["head_a", "head_h", "head_dh", "head_da"] {
            add(name, F32, Some(th))?;
        }
        // The fused loss: one logits chunk, never `[T, V]`.
        add("logits", F32, m(c, v))?;
        add("labels", I32, m(j, t))?;
        add("counts", U32, Some(j))?;
        add("scales", F32, Some(j))?;
        add("row_loss", F32, m(j, t))?;
        add("loss_partials", F32, Some(m(j, t)?.div_ceil(REDUCE_CHUNK)))?;
        // Backward scratch.
        for name in ["dz", "dx", "dnormed"] {
            add(name, F32, Some(th))?;
        }
        add("dact", F32, m(t, i))?;
        add("dgate_up", F32, m(t, m(2, i)?))?;
        add("norm_partials", F32, m(t.div_ceil(NORM_ROWS_PER_CHUNK), h))?;
        // Optimizer: gradient-norm partials, the step's read-back scalars, AdamW's per-step and running state.
        add("grad_norm_partials", F32, Some(p.div_ceil(REDUCE_CHUNK)))?;
        add("step_scalars", F32, Some(STEP_SCALARS))?;
        add("adamw_step", F32, Some(ADAMW_STEP_FLOATS))?;
        add("adamw_state", F64, Some(ADAMW_STATE_DOUBLES))?;
        let input_slots = match backend {
            BackendKind::Cpu => 1,
            BackendKind::Cuda => 2,
        };
        for slot in 0..input_slots {
            add(&format!("input{slot}.hs"), F32, m(t, din))?;
            add(&format!("input{slot}.input_ids"), U32, Some(t))?;
            add(&format!("input{slot}.seq_lens"), U32, Some(s))?;
            add(&format!("input{slot}.loss_mask"), U8, Some(t))?;
        }
        match backend {
            // cuBLAS rounds f32 operands itself (compute types `32F_FAST_16BF` / `32F_FAST_TF32`).
            BackendKind::Cuda => add("cublas_workspace", U8, Some(CUBLAS_WORKSPACE_BYTES))?,
            // The CPU emulates reduced precisions by rounding both GEMM operands into these first.
            BackendKind::Cpu if precision != Precision::F32 => {
                let operand = [
                    m(t, din),
                    m(h, din),
                    m(t, m(2, i)?),
                    m(m(2, i)?, h),
                    m(v, h),
                    m(c, v),
                    Some(th),
                ]
                .into_iter()
                .try_fold(0, |most, x| x.map(|x| most.max(x)))?;
                add("gemm_round_a", F32, Some(operand))?;
                add("gemm_round_b", F32, Some(operand))?;
            }
            BackendKind::Cpu => {}
        }
        Some(Self {
            tokens: t,
            sequences: s,
            chunk_rows: c,
            input_slots,
            hs_operand_elements: hs_operand_elements(backend, precision, m(h, din)?, th),
            buffers,
        })
    }
}
