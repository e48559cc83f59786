//! The drafter's workspace layout, described once: every device buffer one worker allocates besides the four
//! flat state buffers, with its element type and count.
//!
//! ```text
//!  MlpSpec + buckets + loss + backend + precision ──▶ WorkspaceLayout ──┬─▶ cost model (DeviceMemory.workspaces)
//!                                                                       ├─▶ CPU allocator  (runtime::model)
//!                                                                       └─▶ CUDA allocator (runtime::model)
//! ```
//!
//! The runtime allocates each buffer by its name from this list and nothing else, and a test checks that the
//! bytes it allocates equal [`WorkspaceLayout::bytes`] for both shipped pipelines on both backends, so the
//! memory `compile` reports is the memory `run` takes.
//!
//! Notation: `T` the largest bucket's tokens, `S` its sequences, `H` hidden, `I` intermediate, `L` blocks, `J`
//! heads, `V` vocabulary, `C = clamp(chunk_tokens, 1, T)` rows of the fused loss's logits chunk, `P` parameters.
//! Buckets run one at a time on a worker, so one workspace sized for the largest bucket serves them all.

use serde::{Deserialize, Serialize};

use crate::plan::{
    BucketPlan, Device, DflashSpec, HsDtype, LossSpec, MlpSpec, ModelSpec, Precision,
};

/// Elements per partial sum of the loss total and of the gradient norm (first pass of both reductions).
pub const REDUCE_CHUNK: usize = 1024;
/// Rows per partial sum of an RMSNorm weight gradient (first pass).
pub const NORM_ROWS_PER_CHUNK: usize = 64;
/// Bytes of the workspace given to cuBLAS so it never allocates (stream capture forbids it); NVIDIA recommends
/// 32 MiB on Hopper.
pub const CUBLAS_WORKSPACE_BYTES: usize = 32 << 20;
/// `f32`s of AdamW's per-step scalars (`AdamWStep` in `gpu-kernels`, `repr(C)`).
pub const ADAMW_STEP_FLOATS: usize = 7;
/// `f64`s of AdamW's device state: steps applied, `β1^step`, `β2^step`.
pub const ADAMW_STATE_DOUBLES: usize = 3;
/// `f32`s of a step's results read back by the host: gradient norm, clip scale, loss.
pub const STEP_SCALARS: usize = 3;

/// Where a worker's workspace lives; the CUDA layout adds a second input slot (the next batch lands while the
/// current step runs) and cuBLAS's workspace; the CPU layout adds the rounding buffers of emulated precisions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum BackendKind {
    /// The host.
    Cpu,
    /// A CUDA device.
    Cuda,
}

impl BackendKind {
    /// The backend a worker on `device` runs on.
    pub fn of(device: Device) -> Self {
        match device {
            Device::Cpu => BackendKind::Cpu,
            Device::Gpu(_) => BackendKind::Cuda,
        }
    }
}

/// Rows of hidden states the CPU converts to f32 at a time for a matrix product (one `matrixmultiply` depth
/// panel, so a tile costs the product no extra pass).
pub const HS_TILE_ROWS: usize = 256;

/// [`WorkspaceLayout::hs_operand_elements`]: on CUDA at `bf16` precision, the larger of the `fc` weight
/// (`fc_weight` elements) and its upstream gradient (`upstream` elements); 0 elsewhere.
pub(crate) fn hs_operand_elements(
    backend: BackendKind,
    precision: Precision,
    fc_weight: usize,
    upstream: usize,
) -> usize {
    match (backend, precision) {
        (BackendKind::Cuda, Precision::Bf16) => fc_weight.max(upstream),
        _ => 0,
    }
}

/// Element type of a workspace buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Dtype {
    /// `f32`.
    F32,
    /// `f64`.
    F64,
    /// `i32`.
    I32,
    /// `u32`.
    U32,
    /// `u8`.
    U8,
    /// bfloat16 (hidden states held as they arrive).
    Bf16,
    /// IEEE half (hidden states held as they arrive).
    F16,
}

impl Dtype {
    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            Dtype::F64 => 8,
            Dtype::F32 | Dtype::I32 | Dtype::U32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
            Dtype::U8 => 1,
        }
    }
}

/// One named buffer of the workspace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkspaceBuffer {
    /// The name the runtime allocates it by.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Elements.
    pub elements: usize,
}

impl WorkspaceBuffer {
    /// Bytes of the buffer (`None` on overflow).
    pub fn bytes(&self) -> Option<u64> {
        let bytes = (self.elements as u128).checked_mul(self.dtype.bytes() as u128)?;
        u64::try_from(bytes).ok()
    }
}

/// Every buffer of one worker's workspace, in allocation order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkspaceLayout {
    /// Tokens of the largest bucket (the workspace's row count).
    pub tokens: usize,
    /// Sequences of the largest bucket.
    pub sequences: usize,
    /// Rows of the fused loss's logits chunk.
    pub chunk_rows: usize,
    /// Input slots (batches on the device at once).
    pub input_slots: usize,
    /// Elements of the 16-bit copy a CUDA product needs of its f32 operand when the other holds 16-bit hidden
    /// states (the larger of the `fc` weight and its upstream gradient, `[T, H]`), which
    /// [`WorkspaceLayout::with_hs_dtype`] adds as `gemm_hs_operand`; 0 where the products never read 16-bit
    /// hidden states directly (the CPU converts tiles of them instead; CUDA at f32 or TF32, whose products must
    /// not round the f32 operand to 16 bits).
    pub hs_operand_elements: usize,
    /// The buffers.
    pub buffers: Vec<WorkspaceBuffer>,
}

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

    /// The `dflash` drafter's workspace for `buckets` on `backend` at `precision`; `None` when a size
    /// overflows. Besides `T`, `S` and `C` (over block rows): `Q = S·A·B` block rows (`A` the block slots of a
    /// sequence, [`DflashSpec::block_slots`]: `anchors`, fewer when the bucket has fewer anchor positions; `B`
    /// slots per block), the largest over the buckets,
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
        let c = loss.chunk_tokens.clamp(1, q.max(1));
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
        // The fused loss: one logits chunk, never `[Q, V]`; per-row loss and correctness; ones for the
        // per-slot sums (a product with a ones vector).
        add("logits", F32, m(c, v))?;
        add("row_loss", F32, Some(q))?;
        add("correct", F32, Some(q))?;
        add("loss_partials", F32, Some(q.div_ceil(REDUCE_CHUNK)))?;
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
        // Optimizer, and the read-back: [grad_norm, clip, loss, correct rows of each slot].
        add("grad_norm_partials", F32, Some(p.div_ceil(REDUCE_CHUNK)))?;
        add("step_scalars", F32, STEP_SCALARS.checked_add(block))?;
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
            add(&format!("input{slot}.labels"), I32, Some(q))?;
            add(&format!("input{slot}.weights"), F32, Some(q))?;
            add(&format!("input{slot}.inv_weight_sum"), F32, Some(1))?;
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

    /// The workspace of `spec`'s model family (see [`WorkspaceLayout::mlp`], [`WorkspaceLayout::dflash`]).
    pub fn of_model(
        spec: &ModelSpec,
        buckets: &[BucketPlan],
        loss: &LossSpec,
        backend: BackendKind,
        precision: Precision,
    ) -> Option<Self> {
        match spec {
            ModelSpec::Mlp(spec) => Self::mlp(spec, buckets, loss, backend, precision),
            ModelSpec::Dflash(spec) => Self::dflash(spec, buckets, loss, backend, precision),
            ModelSpec::Eagle3(spec) => Self::eagle3(spec, buckets, loss, backend, precision),
        }
    }

    /// The layout for hidden states held in `hs` ([`HsDtype`]). On the CPU the input slots hold them in that
    /// dtype and the first layer's products convert [`HS_TILE_ROWS`] rows at a time into `hs_tile`, so no f32
    /// copy of the batch exists. On CUDA at `bf16` precision the slots hold them in that dtype too (the
    /// host→device copy moves 16-bit values) and the products read them as 16-bit GEMM inputs against a 16-bit
    /// copy of the other operand, `gemm_hs_operand` ([`WorkspaceLayout::hs_operand_elements`]); at f32 or TF32
    /// the CUDA slots stay f32 and the host widens while filling the pinned staging buffer, since cuBLAS has no
    /// product of 16-bit by f32 operands. `None` on overflow.
    pub fn with_hs_dtype(mut self, backend: BackendKind, hs: HsDtype) -> Option<Self> {
        let dtype = match hs {
            HsDtype::F32 => return Some(self),
            HsDtype::Bf16 => Dtype::Bf16,
            HsDtype::F16 => Dtype::F16,
        };
        if backend == BackendKind::Cuda && self.hs_operand_elements == 0 {
            return Some(self);
        }
        let mut din = 0;
        for buffer in &mut self.buffers {
            // `input{slot}.last_hs` (EAGLE-3's teacher input) arrives in the batch's dtype too.
            if buffer.name.starts_with("input") && buffer.name.ends_with(".last_hs") {
                buffer.dtype = dtype;
            } else if buffer.name.starts_with("input") && buffer.name.ends_with(".hs") {
                buffer.dtype = dtype;
                din = buffer.elements / self.tokens.max(1);
            }
        }
        let (name, dtype, elements) = match backend {
            BackendKind::Cpu => (
                "hs_tile",
                Dtype::F32,
                HS_TILE_ROWS.min(self.tokens).checked_mul(din)?,
            ),
            BackendKind::Cuda => ("gemm_hs_operand", dtype, self.hs_operand_elements),
        };
        self.buffers.push(WorkspaceBuffer {
            name: name.to_owned(),
            dtype,
            elements,
        });
        Some(self)
    }

    /// Elements of the buffer called `name`.
    pub fn elements(&self, name: &str) -> Option<usize> {
        self.buffers
            .iter()
            .find(|b| b.name == name)
            .map(|b| b.elements)
    }

    /// Bytes of every buffer together (`None` on overflow).
    pub fn bytes(&self) -> Option<u64> {
        self.buffers
            .iter()
            .try_fold(0u64, |sum, b| sum.checked_add(b.bytes()?))
    }
}
