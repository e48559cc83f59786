//! The `dflash` drafter's workspace: every buffer one worker allocates besides the flat state buffers.

use crate::family::dflash::DflashSpec;
use crate::family::dflash::flash::flash_attention;
use crate::plan::derived::BucketPlan;
use crate::plan::stages::{LossSpec, Precision};
use crate::workspace::{
    ADAMW_STATE_DOUBLES, ADAMW_STEP_FLOATS, BackendKind, CUBLAS_WORKSPACE_BYTES, Dtype,
    NORM_ROWS_PER_CHUNK, REDUCE_CHUNK, STEP_SCALARS, WorkspaceBuffer, WorkspaceLayout,
    hs_operand_elements,
};

impl WorkspaceLayout {
    /// The `dflash` drafter's workspace for `buckets` on `backend` at `precision`; `None` when a size
    /// overflows. Besides `T`, `S` and `C` (over the head's rows, `N·A·(B − 1) + 1` at most,
    /// [`DflashSpec::head_rows`]): `Q = S·A·B` block rows (`A` the block slots of a sequence,
    /// [`DflashSpec::block_slots`]: `anchors`, fewer when the bucket has fewer anchor positions; `B` slots per
    /// block), the largest over the buckets,
    /// `D = L·H` the tapped width, `NL` layers, `qd = heads·head_dim`, `kd = kv_heads·head_dim`. Every buffer is
    /// linear in `T` or in `Q` (attention keeps only `lse` per query and head, never `Q × keys`), so at fixed
    /// anchors the workspace grows linearly with the context length (exactly so in steps of whole reduction
    /// chunks: the norms' partial sums take one row per [`NORM_ROWS_PER_CHUNK`] rows).
    ///
    /// # Examples
    /// ```
    /// use draftpipe_compiler::plan::{BucketPlan, DflashSpec, LossSpec, Precision};
    /// use draftpipe_compiler::workspace::{BackendKind, WorkspaceLayout};
    ///
    /// let spec = DflashSpec {
    ///     hidden: 8, taps: 2, tap_layers: vec![1, 2], vocab: 16, layers: 1, heads: 2, kv_heads: 1,
    ///     head_dim: 4, intermediate: 12, block: 3, anchors: 2, mask_token: 15, rope_theta: 1e4,
    ///     rms_norm_eps: 1e-6,
    /// };
    /// let loss = LossSpec { head_decay: 1.0, position_decay: Some(7.0), step_decay: None, chunk_tokens: 4 };
    /// let bytes = |len: usize| {
    ///     let bucket = BucketPlan { padded_len: len, sequences: 2, tokens: 2 * len, step_flops: 0, step_bytes: 0 };
    ///     WorkspaceLayout::dflash(&spec, &[bucket], &loss, BackendKind::Cpu, Precision::F32).unwrap().bytes().unwrap()
    /// };
    /// assert_eq!(bytes(192) - bytes(128), bytes(128) - bytes(64)); // linear in the context length
    /// ```
    pub fn dflash(
        spec: &DflashSpec,
        buckets: &[BucketPlan],
        loss: &LossSpec,
        backend: BackendKind,
        precision: Precision,
    ) -> Option<Self> {
        let DflashSpec {
            hidden: h,
            taps,
            vocab: v,
            layers: nl,
            heads,
            kv_heads,
            head_dim: hd,
            intermediate: i,
            block,
            ..
        } = *spec;
        let m = |a: usize, b: usize| a.checked_mul(b);
        let t = buckets.iter().map(|b| b.tokens).max().unwrap_or(0);
        let s = buckets.iter().map(|b| b.sequences).max().unwrap_or(0);
        let blocks = buckets.iter().try_fold(0, |most: usize, b| {
            Some(most.max(m(b.sequences, spec.block_slots(b.padded_len))?))
        })?;
        let q = m(blocks, block)?;
        // The head's rows: the labelled block rows gathered, at most `N·A·(B − 1)`, and one unlabelled row
        // (`DflashSpec::head_rows`).
        let head = buckets.iter().try_fold(1, |most: usize, b| {
            Some(most.max(spec.head_rows(b.padded_len, b.sequences)?))
        })?;
        let c = loss.chunk_tokens.clamp(1, head);
        let d = m(taps, h)?;
        let (qd, kd) = (m(heads, hd)?, m(kv_heads, hd)?);
        let p = spec.parameter_count();
        let (qh, th) = (m(q, h)?, m(t, h)?);
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
        // Context: fc output, after hidden_norm (every layer's K/V input), its norm statistics.
        add("ctx_pre", F32, Some(th))?;
        add("ctx", F32, Some(th))?;
        add("ctx_inv_rms", F32, Some(t))?;
        // The block rows' residual stream before each layer and after the last.
        for l in 0..=nl {
            add(&format!("xs.{l}"), F32, Some(qh))?;
        }
        // Per layer, stacked: what the backward pass reads again.
        let per_layer = |x: Option<usize>| m(nl, x?);
        add("normed", F32, per_layer(Some(qh)))?;
        add("inv_rms", F32, per_layer(Some(q)))?;
        add("q_raw", F32, per_layer(m(q, qd)))?;
        add("q_inv_rms", F32, per_layer(m(q, heads)))?;
        add("q", F32, per_layer(m(q, qd)))?;
        add("k_blk_raw", F32, per_layer(m(q, kd)))?;
        add("k_blk_inv_rms", F32, per_layer(m(q, kv_heads)))?;
        add("k_blk", F32, per_layer(m(q, kd)))?;
        add("v_blk", F32, per_layer(m(q, kd)))?;
        add("k_ctx_raw", F32, per_layer(m(t, kd)))?;
        add("k_ctx_inv_rms", F32, per_layer(m(t, kv_heads)))?;
        add("k_ctx", F32, per_layer(m(t, kd)))?;
        add("v_ctx", F32, per_layer(m(t, kd)))?;
        add("attn", F32, per_layer(m(q, qd)))?;
        add("lse", F32, per_layer(m(q, heads)))?;
        add("mid", F32, per_layer(Some(qh)))?;
        add("normed2", F32, per_layer(Some(qh)))?;
        add("inv_rms2", F32, per_layer(Some(q)))?;
        add("gate_up", F32, per_layer(m(q, m(2, i)?)))?;
        add("act", F32, per_layer(m(q, i)))?;
        add("z", F32, Some(qh))?;
        add("final_inv_rms", F32, Some(q))?;
        // The fused loss over the head's rows only: their final-norm rows gathered and their gradient before
        // it is scattered back into `dz`; one logits chunk, never `[rows, V]`; per-row loss and correctness
        // (scattered back to the block rows for the per-slot sums, a product with a ones vector). On CUDA at
        // bf16 the head's products read 16-bit operands only: the rows are gathered straight into bf16 (no f32
        // copy), `lm_head` has a frozen bf16 copy (rounded once at upload), and the fused loss writes the logits
        // gradient's copy beside the f32 logits (the product writes f32 for the softmax).
        let head16 = (backend, precision) == (BackendKind::Cuda, Precision::Bf16);
        if head16 {
            add("head_z_bf16", Dtype::Bf16, m(head, h))?;
            add("lm_head_bf16", Dtype::Bf16, m(v, h))?;
            add("logits_bf16", Dtype::Bf16, m(c, v))?;
        } else {
            add("head_z", F32, m(head, h))?;
        }
        add("head_dz", F32, m(head, h))?;
        add("logits", F32, m(c, v))?;
        add("row_loss", F32, Some(head))?;
        add("head_correct", F32, Some(head))?;
        add("correct", F32, Some(q))?;
        add("loss_partials", F32, Some(head.div_ceil(REDUCE_CHUNK)))?;
        add("ones", F32, Some(blocks.max(1)))?;
        // Backward scratch (one layer at a time).
        for name in ["dz", "dx", "dnormed"] {
            add(name, F32, Some(qh))?;
        }
        add("dact", F32, m(q, i))?;
        add("dgate_up", F32, m(q, m(2, i)?))?;
        for name in ["dattn", "dq", "dq_raw"] {
            add(name, F32, m(q, qd))?;
        }
        add("attn_delta", F32, m(q, heads))?;
        for name in ["dk_blk", "dv_blk", "dk_blk_raw"] {
            add(name, F32, m(q, kd))?;
        }
        for name in ["dk_ctx", "dv_ctx", "dk_ctx_raw"] {
            add(name, F32, m(t, kd))?;
        }
        add("dctx", F32, Some(th))?;
        add("dctx_pre", F32, Some(th))?;
        add("k_norm_grad", F32, Some(hd))?;
        let norm_partials = [
            (t, h),
            (q, h),
            (m(q, heads)?, hd),
            (m(q, kv_heads)?, hd),
            (m(t, kv_heads)?, hd),
        ]
        .into_iter()
        .try_fold(0, |most: usize, (rows, cols)| {
            Some(most.max(m(rows.div_ceil(NORM_ROWS_PER_CHUNK), cols)?))
        })?;
        add("norm_partials", F32, Some(norm_partials))?;
        // Optimizer, and the read-back: [grad_norm, clip, loss, correct rows of each slot, accepted prefixes].
        add("grad_norm_partials", F32, Some(p.div_ceil(REDUCE_CHUNK)))?;
        add("step_scalars", F32, STEP_SCALARS.checked_add(block + 1))?;
        add("adamw_step", F32, Some(ADAMW_STEP_FLOATS))?;
        add("adamw_state", F64, Some(ADAMW_STATE_DOUBLES))?;
        let input_slots = match backend {
            BackendKind::Cpu => 1,
            BackendKind::Cuda => 2,
        };
        for slot in 0..input_slots {
            add(&format!("input{slot}.hs"), F32, m(t, d))?;
            add(&format!("input{slot}.input_ids"), U32, Some(t))?;
            add(&format!("input{slot}.seq_lens"), U32, Some(s))?;
            add(&format!("input{slot}.loss_mask"), U8, Some(t))?;
            // The host-built block plan of the slot's batch.
            add(&format!("input{slot}.block_ids"), U32, Some(q))?;
            add(&format!("input{slot}.positions"), U32, t.checked_add(q))?;
            add(&format!("input{slot}.query_ranges"), U32, m(4, q))?;
            add(&format!("input{slot}.context_key_ranges"), U32, m(2, t))?;
            add(&format!("input{slot}.block_key_ranges"), U32, m(2, q))?;
            // The head's rows: which block row each is, its label and weight; for each block row its head row
            // (the unlabelled one for a row without a label).
            add(&format!("input{slot}.head_rows"), U32, Some(head))?;
            add(&format!("input{slot}.head_index"), U32, Some(q))?;
            add(&format!("input{slot}.labels"), I32, Some(head))?;
            add(&format!("input{slot}.weights"), F32, Some(head))?;
            add(&format!("input{slot}.inv_weight_sum"), F32, Some(1))?;
        }
        if (backend, precision) == (BackendKind::Cuda, Precision::Bf16) {
            // The 16-bit operands CUDA's products read (`docs/gpu.md`), each written by the kernel that writes
            // its f32 value, in the same pass: the trained parameters rounded to bf16 (`2·P` bytes, by AdamW),
            // the context after hidden_norm (every layer's context K/V input, forward and backward).
            add("params_bf16", Dtype::Bf16, Some(p))?;
            add("ctx_bf16", Dtype::Bf16, Some(th))?;
            // The block rows' saved activations, per layer, stacked like their f32 values: the forward's products
            // read them and the backward's weight gradients read them again. Kept rather than rounded again in
            // the backward: a rounding pass reads 4 and writes 2 bytes per element to save the product 2, so it
            // costs more bytes than the f32 operand it replaces, while the copies cost only memory (at
            // dflash-5x3.pipe 2·NL·Q·(2H + qd + I) = 7.5 GiB of the H200's 141 GB).
            add("normed_bf16", Dtype::Bf16, per_layer(Some(qh)))?;
            add("attn_bf16", Dtype::Bf16, per_layer(m(q, qd)))?;
            add("normed2_bf16", Dtype::Bf16, per_layer(Some(qh)))?;
            add("act_bf16", Dtype::Bf16, per_layer(m(q, i)))?;
            // The backward's gradients as product operands, one layer at a time: the residual stream's gradient
            // (written by the norms' backward, read by the down and o_proj products), and one scratch the
            // other gradients take in turn, each read by the two products right after the kernel that writes it
            // (dgate_up; dq_raw; dk_blk_raw, dv_blk; dk_ctx_raw, dv_ctx; dctx_pre for fc's weight gradient).
            add("dx_bf16", Dtype::Bf16, Some(qh))?;
            let grad = [m(q, m(2, i)?), m(q, qd), m(q, kd), m(t, kd), Some(th)]
                .into_iter()
                .try_fold(0, |most: usize, x| Some(most.max(x?)))?;
            add("grad_bf16", Dtype::Bf16, Some(grad))?;
        }
        // The flash path's bf16 copies of every layer's attention operands, written by their producers in the
        // forward (RoPE for q and k, a rounding pass for v) and read again by the backward, which therefore
        // rounds nothing; and one layer's copy of the output gradient the key-major pass reads.
        if flash_attention(backend, precision, (heads, kv_heads, hd), block) {
            for (name, rows, width) in [
                ("flash_q", q, qd),
                ("flash_k_ctx", t, kd),
                ("flash_v_ctx", t, kd),
                ("flash_k_blk", q, kd),
                ("flash_v_blk", q, kd),
            ] {
                add(name, Dtype::Bf16, per_layer(m(rows, width)))?;
            }
            add("flash_dout", Dtype::Bf16, m(q, qd))?;
        }
        match backend {
            BackendKind::Cuda => add("cublas_workspace", U8, Some(CUBLAS_WORKSPACE_BYTES))?,
            BackendKind::Cpu if precision != Precision::F32 => {
                let operand = [
                    m(t, d),
                    m(h, d),
                    Some(th),
                    Some(qh),
                    m(q, m(2, i)?),
                    m(m(2, i)?, h),
                    m(q, qd),
                    m(qd, h),
                    m(t, kd),
                    m(v, h),
                    m(c, v),
                    Some(blocks.max(1)),
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
            hs_operand_elements: hs_operand_elements(backend, precision, m(h, d)?, th),
            buffers,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::family::dflash::DFLASH_RMS_NORM_EPS;

    #[test]
    fn only_cuda_at_bf16_keeps_the_16_bit_operand_copies() {
        let spec = DflashSpec {
            hidden: 64,
            taps: 3,
            tap_layers: vec![1, 2, 3],
            vocab: 512,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 32,
            intermediate: 96,
            block: 4,
            anchors: 8,
            mask_token: 511,
            rope_theta: 10000.0,
            rms_norm_eps: DFLASH_RMS_NORM_EPS,
        };
        let loss = LossSpec {
            head_decay: 1.0,
            position_decay: Some(7.0),
            step_decay: None,
            chunk_tokens: 16,
        };
        let bucket = BucketPlan {
            padded_len: 64,
            sequences: 2,
            tokens: 128,
            step_flops: 0,
            step_bytes: 0,
        };
        let make = |backend, precision| {
            WorkspaceLayout::dflash(
                &spec,
                std::slice::from_ref(&bucket),
                &loss,
                backend,
                precision,
            )
            .unwrap()
        };
        let names = [
            "params_bf16",
            "ctx_bf16",
            "normed_bf16",
            "attn_bf16",
            "normed2_bf16",
            "act_bf16",
            "dx_bf16",
            "grad_bf16",
            "head_z_bf16",
            "lm_head_bf16",
            "logits_bf16",
        ];
        for (backend, precision) in [
            (BackendKind::Cpu, Precision::F32),
            (BackendKind::Cpu, Precision::Bf16),
            (BackendKind::Cuda, Precision::F32),
            (BackendKind::Cuda, Precision::Tf32),
        ] {
            let layout = make(backend, precision);
            assert!(names.iter().all(|n| layout.elements(n).is_none()));
        }
        let (f32_layout, bf16) = (
            make(BackendKind::Cuda, Precision::F32),
            make(BackendKind::Cuda, Precision::Bf16),
        );
        // Q = 2 sequences · 8 anchors · 4 slots; qd = 4 · 32 = 128 is wider than H = 64; 2 layers.
        let (q, t, h, i, qd, nl) = (64, 128, 64, 96, 128, 2);
        assert_eq!(bf16.elements("params_bf16"), Some(spec.parameter_count()));
        assert_eq!(bf16.elements("ctx_bf16"), Some(t * h));
        assert_eq!(bf16.elements("normed_bf16"), Some(nl * q * h));
        assert_eq!(bf16.elements("attn_bf16"), Some(nl * q * qd));
        assert_eq!(bf16.elements("normed2_bf16"), Some(nl * q * h));
        assert_eq!(bf16.elements("act_bf16"), Some(nl * q * i));
        assert_eq!(bf16.elements("dx_bf16"), Some(q * h));
        // The gradient scratch: the widest of dgate_up (Q·2I = 12288), dq_raw, the key gradients and
        // dctx_pre (T·H = 8192).
        assert_eq!(bf16.elements("grad_bf16"), Some(q * 2 * i));
        // The head: 2 · 8 · 3 labelled rows and one, gathered into bf16 instead of f32; lm_head's copy [V, H];
        // the logits gradient's copy of one chunk of 16 rows.
        let (head, v, c) = (2 * 8 * 3 + 1, 512, 16);
        assert_eq!(bf16.elements("head_z"), None);
        assert_eq!(bf16.elements("head_z_bf16"), Some(head * h));
        assert_eq!(bf16.elements("lm_head_bf16"), Some(v * h));
        assert_eq!(bf16.elements("logits_bf16"), Some(c * v));
        let saved = nl * q * (2 * h + qd + i);
        let copies =
            2 * (spec.parameter_count() + t * h + saved + q * h + q * 2 * i + v * h + c * v) as u64;
        let head_rows_saved = 2 * (head * h) as u64;
        assert_eq!(
            bf16.bytes().unwrap() - f32_layout.bytes().unwrap(),
            copies - head_rows_saved
        );
    }
}
