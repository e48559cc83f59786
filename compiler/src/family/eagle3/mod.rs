//! The `eagle3` drafter family's compiler side: its dimensions ([`Eagle3Spec`]), its trained tensors in SGLang's
//! `LlamaForCausalLMEagle3` names ([`Eagle3Spec::layout`]), the frozen tables it reads, its step's FLOPs and
//! bytes, and its workspace ([`WorkspaceLayout::eagle3`]), the buffer list the runtime's `model::eagle3` step
//! allocates and the memory figure `compile` reports.
//!
//! ```text
//!  check (model = eagle3(...)) ──▶ Eagle3Spec ──┬─▶ layout (flat parameters, export names)
//!                                               ├─▶ cost (step FLOPs, bytes, frozen tables)
//!                                               └─▶ WorkspaceLayout::eagle3 ──▶ runtime allocators
//! ```
//!
//! The model is SpecForge's offline EAGLE-3 (`specforge/modeling/draft/llama3_eagle.py`): `fc` (3H → H) over the
//! three tapped layers; one Llama decoder layer `midlayer` on `cat(input_layernorm(embed(ids)), hidden_norm(h))`
//! (2H wide into q/k/v, residual h), its post-attention norm and SwiGLU MLP; `norm` and the draft's own
//! `lm_head` over the draft vocabulary; unrolled `ttt` times (test-time training), step `k + 1` fed step `k`'s
//! midlayer output. The target's embedding and `lm_head` are frozen and not trained.

use serde::{Deserialize, Serialize};

mod check;
mod facts;

pub use check::EAGLE3_RMS_NORM_EPS;
pub(crate) use check::Eagle3Args;

use crate::plan::derived::{BucketPlan, TensorView, pack};
use crate::plan::stages::{LossSpec, Precision};
use crate::workspace::{
    ADAMW_STATE_DOUBLES, ADAMW_STEP_FLOATS, BackendKind, CUBLAS_WORKSPACE_BYTES, Dtype,
    NORM_ROWS_PER_CHUNK, REDUCE_CHUNK, STEP_SCALARS, WorkspaceBuffer, WorkspaceLayout,
    hs_operand_elements,
};

/// Tapped target layers EAGLE-3's `fc` reads (low, middle, high).
pub const EAGLE3_TAPS: usize = 3;

/// SpecForge's default TTT length (`--ttt-length 7`).
pub const EAGLE3_DEFAULT_TTT: usize = 7;

/// Dimensions of the `eagle3` drafter (SGLang's / SpecForge's `LlamaForCausalLMEagle3`). The drafter's width is
/// the target's hidden size `H` (`target_hidden_size == hidden_size`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Eagle3Spec {
    /// The target's hidden size `H`, also the drafter's width.
    pub hidden: usize,
    /// Tapped target layers ([`EAGLE3_TAPS`]); `fc` reads `taps·H` per token.
    pub taps: usize,
    /// The target section's `tap_layers` as written: indices into the hidden-states tuple, whose entry 0 is the
    /// embeddings (the export's `eagle_aux_hidden_state_layer_ids` are these minus one).
    pub tap_layers: Vec<usize>,
    /// The target's vocabulary (the frozen embedding's rows, `t2d`'s length).
    pub vocab: usize,
    /// The draft vocabulary (`lm_head`'s rows, `d2t`'s length), at most `vocab`.
    pub draft_vocab: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (grouped-query attention: `heads % kv_heads == 0`).
    pub kv_heads: usize,
    /// Width of one head (even: RoPE rotates pairs).
    pub head_dim: usize,
    /// SwiGLU intermediate size.
    pub intermediate: usize,
    /// Test-time-training unroll length (steps of the midlayer per batch), at least 1.
    pub ttt: usize,
    /// RoPE base.
    pub rope_theta: f32,
    /// RMSNorm epsilon of every norm.
    pub rms_norm_eps: f32,
}

impl Eagle3Spec {
    /// `heads · head_dim`, the query width.
    pub fn q_width(&self) -> usize {
        self.heads * self.head_dim
    }

    /// `kv_heads · head_dim`, the key (and value) width.
    pub fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// The closed-form count of trained parameters (frozen embedding, target `lm_head`, `t2d`, `d2t` excluded).
    ///
    /// # Examples
    /// ```
    /// use draftpipe_compiler::plan::Eagle3Spec;
    ///
    /// let spec = Eagle3Spec {
    ///     hidden: 64, taps: 3, tap_layers: vec![2, 4, 6], vocab: 512, draft_vocab: 128, heads: 4,
    ///     kv_heads: 2, head_dim: 16, intermediate: 128, ttt: 3, rope_theta: 1e4, rms_norm_eps: 1e-6,
    /// };
    /// assert_eq!(spec.parameter_count(), spec.layout().iter().map(|v| v.len()).sum::<usize>());
    /// ```
    pub fn parameter_count(&self) -> usize {
        let h = self.hidden;
        let (q, kv) = (self.q_width(), self.kv_width());
        h * self.taps * h
            + 2 * h
            + (q + 2 * kv) * 2 * h
            + h * q
            + h
            + 3 * self.intermediate * h
            + h
            + self.draft_vocab * h
    }

    /// [`Eagle3Spec::parameter_count`] in `u128`, safe before the dimensions are known to fit.
    pub fn parameter_count_wide(&self) -> u128 {
        let w = |x: usize| x as u128;
        let h = w(self.hidden);
        let (q, kv) = (
            w(self.heads) * w(self.head_dim),
            w(self.kv_heads) * w(self.head_dim),
        );
        h * w(self.taps) * h
            + 2 * h
            + (q + 2 * kv) * 2 * h
            + h * q
            + h
            + 3 * w(self.intermediate) * h
            + h
            + w(self.draft_vocab) * h
    }

    /// The flat layout in SGLang's `LlamaForCausalLMEagle3` names (SpecForge's state dict less `embed_tokens`,
    /// `t2d` and `d2t`, which are frozen), PyTorch `[out, in]` weight shapes.
    pub fn layout(&self) -> Vec<TensorView> {
        let (h, i) = (self.hidden, self.intermediate);
        let (q, kv) = (self.q_width(), self.kv_width());
        pack(vec![
            ("fc.weight".into(), vec![h, self.taps * h]),
            ("midlayer.input_layernorm.weight".into(), vec![h]),
            ("midlayer.hidden_norm.weight".into(), vec![h]),
            ("midlayer.self_attn.q_proj.weight".into(), vec![q, 2 * h]),
            ("midlayer.self_attn.k_proj.weight".into(), vec![kv, 2 * h]),
            ("midlayer.self_attn.v_proj.weight".into(), vec![kv, 2 * h]),
            ("midlayer.self_attn.o_proj.weight".into(), vec![h, q]),
            ("midlayer.post_attention_layernorm.weight".into(), vec![h]),
            ("midlayer.mlp.gate_proj.weight".into(), vec![i, h]),
            ("midlayer.mlp.up_proj.weight".into(), vec![i, h]),
            ("midlayer.mlp.down_proj.weight".into(), vec![h, i]),
            ("norm.weight".into(), vec![h]),
            ("lm_head.weight".into(), vec![self.draft_vocab, h]),
        ])
    }

    /// Bytes of the frozen tables one worker holds, f32 whatever the checkpoint's dtype: the target's embedding
    /// `[V, H]`, its whole `lm_head` `[V, H]` (the once-per-batch argmax over the full vocabulary), the rows of
    /// it `d2t` selects `[Vd, H]` (the teacher on the draft vocabulary), `t2d` (`V` bytes) and `d2t` (`Vd` i32).
    pub fn frozen_bytes(&self) -> Option<u64> {
        let (v, vd, h) = (
            self.vocab as u128,
            self.draft_vocab as u128,
            self.hidden as u128,
        );
        u64::try_from(4 * (2 * v + vd) * h + v + 4 * vd).ok()
    }

    /// FLOPs of one training step of `sequences` sequences of padded length `padded_len`. With `T` rows, `K`
    /// TTT steps, `qd`/`kd` query/key widths, `I` intermediate, `V`/`Vd` full/draft vocabulary. Forward:
    /// `fc` `2·T·3H·H` once; the full-vocabulary argmax of the teacher `2·T·H·V` once; per step q/k/v
    /// `2·T·2H·(qd + 2·kd)`, `o_proj` `2·T·qd·H`, SwiGLU `2·T·3·I·H`, the draft head and the teacher on the
    /// draft vocabulary `2·2·T·H·Vd`, attention `4·hd·heads·pairs_k` with `pairs_k = N·S(S+1)/2 + T·k`
    /// (causal over step 0's keys, one diagonal key per cached step). Backward: twice the forward of every
    /// trained product but `fc`'s (its input is data: weight gradient only), attention `2.5×` its forward; the
    /// teacher none. The fused loss `8·T·Vd` per step (both softmaxes and the gradient), AdamW `12·P`.
    pub fn step_flops(&self, padded_len: usize, sequences: usize) -> Option<u64> {
        let w = |x: usize| x as u128;
        let (n, s) = (w(sequences), w(padded_len));
        let t = n * s;
        let (h, i, k) = (w(self.hidden), w(self.intermediate), w(self.ttt));
        let (qd, kd) = (w(self.q_width()), w(self.kv_width()));
        let (hd, heads) = (w(self.head_dim), w(self.heads));
        let (v, vd) = (w(self.vocab), w(self.draft_vocab));
        let fc = 2 * t * w(self.taps) * h * h;
        let argmax = 2 * t * h * v;
        let trained_per_step = 2 * t * 2 * h * (qd + 2 * kd) + 2 * t * qd * h + 2 * t * 3 * i * h;
        let head = 2 * t * h * vd;
        // Σ_k pairs_k = K·N·S(S+1)/2 + T·K(K−1)/2.
        let pairs = k * n * s * (s + 1) / 2 + t * k * k.saturating_sub(1) / 2;
        let attention = 4 * hd * heads * pairs;
        let forward = fc + argmax + k * (trained_per_step + 2 * head) + attention;
        let backward = fc + 2 * k * (trained_per_step + head) + attention * 5 / 2;
        let loss = 8 * k * t * vd;
        let adamw = 12 * w(self.parameter_count());
        u64::try_from(forward + backward + loss + adamw).ok()
    }

    /// Bytes one step moves through memory, a lower bound: parameters read forward and backward, gradients
    /// written, AdamW reading `p, g, m, v` and writing `p, m, v` (`10·P` floats); the frozen draft-vocabulary
    /// teacher rows and the draft head read once per logits chunk per TTT step forward, the head again backward
    /// (`3·K·⌈T/C⌉·Vd·H`), the full `lm_head` once per chunk (`⌈T/C⌉·V·H`); every workspace buffer written once
    /// and read once. All f32.
    pub fn step_bytes(&self, bucket: &BucketPlan, loss: &LossSpec) -> Option<u64> {
        let w = |x: usize| x as u128;
        let layout = WorkspaceLayout::eagle3(
            self,
            std::slice::from_ref(bucket),
            loss,
            BackendKind::Cpu,
            Precision::F32,
        )?;
        let chunks = w(bucket.tokens.div_ceil(layout.chunk_rows.max(1)));
        let (h, v, vd, k) = (
            w(self.hidden),
            w(self.vocab),
            w(self.draft_vocab),
            w(self.ttt),
        );
        let tables = 4 * (3 * k * chunks * vd * h + chunks * v * h);
        let bytes = 4 * 10 * w(self.parameter_count()) + tables + 2 * u128::from(layout.bytes()?);
        u64::try_from(bytes).ok()
    }
}

impl WorkspaceLayout {
    /// The `eagle3` drafter's workspace for `buckets` on `backend` at `precision`; `None` when a size overflows.
    /// Notation: `T` rows and `N` sequences of the largest bucket, `K` TTT steps, `qd`/`kd` query/key widths,
    /// `nh` query heads, `I` intermediate, `V`/`Vd` full/draft vocabulary, `C = clamp(chunk_tokens, 1, T)` rows
    /// of a logits chunk. What the backward pass reads of each TTT step is stacked `[K, …]` (the unroll is not
    /// detached, so every step's activations live until the backward); every buffer is linear in `T`, and the
    /// logits never exceed one chunk: `[C, V]` for the full-vocabulary argmax (then the draft head's `[C, Vd]`),
    /// and the teacher's `[C, Vd]`.
    ///
    /// # Examples
    /// ```
    /// use draftpipe_compiler::plan::{BucketPlan, Eagle3Spec, LossSpec, Precision};
    /// use draftpipe_compiler::workspace::{BackendKind, WorkspaceLayout};
    ///
    /// let spec = Eagle3Spec {
    ///     hidden: 8, taps: 3, tap_layers: vec![1, 2, 3], vocab: 32, draft_vocab: 12, heads: 2, kv_heads: 1,
    ///     head_dim: 4, intermediate: 12, ttt: 3, rope_theta: 1e4, rms_norm_eps: 1e-6,
    /// };
    /// let loss = LossSpec { head_decay: 1.0, position_decay: None, step_decay: Some(0.8), chunk_tokens: 4 };
    /// let bytes = |len: usize| {
    ///     let bucket = BucketPlan { padded_len: len, sequences: 2, tokens: 2 * len, step_flops: 0, step_bytes: 0 };
    ///     WorkspaceLayout::eagle3(&spec, &[bucket], &loss, BackendKind::Cpu, Precision::F32).unwrap().bytes().unwrap()
    /// };
    /// assert_eq!(bytes(1536) - bytes(1024), bytes(1024) - bytes(512)); // linear in the context length
    /// ```
    pub fn eagle3(
        spec: &Eagle3Spec,
        buckets: &[BucketPlan],
        loss: &LossSpec,
        backend: BackendKind,
        precision: Precision,
    ) -> Option<Self> {
        let m = |a: usize, b: usize| a.checked_mul(b);
        let (h, i, k) = (spec.hidden, spec.intermediate, spec.ttt.max(1));
        let (v, vd) = (spec.vocab, spec.draft_vocab);
        let (qd, kd) = (
            m(spec.heads, spec.head_dim)?,
            m(spec.kv_heads, spec.head_dim)?,
        );
        let t = buckets.iter().map(|b| b.tokens).max().unwrap_or(0);
        let s = buckets.iter().map(|b| b.sequences).max().unwrap_or(0);
        let c = loss.chunk_tokens.clamp(1, t.max(1));
        let d = m(spec.taps, h)?;
        let p = spec.parameter_count();
        let th = m(t, h)?;
        let kt = m(k, t)?;
        let kth = m(kt, h)?;
        let mut buffers = Vec::new();
        let mut add = |name: &str, dtype: Dtype, elements: Option<usize>| -> Option<()> {
            buffers.push(WorkspaceBuffer {
                name: name.to_owned(),
                dtype,
                elements: elements?,
            });
            Some(())
        };
        use Dtype::{F32, F64, U8, U32};
        // Once per batch: the ids and the teacher's hidden states shifted left by one, the rows the teacher
        // supervises (loss mask and "the full-vocabulary argmax is in the draft vocabulary").
        add("ids", U32, Some(t))?;
        add("teacher_hs", F32, Some(th))?;
        add("row_valid", F32, Some(t))?;
        // One TTT step's view of them (shifted by the step), and its RoPE positions.
        add("step_ids", U32, Some(t))?;
        add("step_teacher_hs", F32, Some(th))?;
        add("step_weight", F32, Some(t))?;
        add("positions", U32, Some(t))?;
        // Stacked over the unroll: `xs` holds `h_0 = fc(hs)` and each step's midlayer output `h_{k+1}`.
        add("xs", F32, m(k + 1, th))?;
        add("emb", F32, Some(kth))?;
        add("emb_inv_rms", F32, Some(kt))?;
        add("h_inv_rms", F32, Some(kt))?;
        add("cat", F32, m(kth, 2))?;
        add("q", F32, m(kt, qd))?;
        add("k", F32, m(kt, kd))?;
        add("v", F32, m(kt, kd))?;
        add("attn", F32, m(kt, qd))?;
        add("lse", F32, m(kt, spec.heads))?;
        add("mid", F32, Some(kth))?;
        add("normed2", F32, Some(kth))?;
        add("inv_rms2", F32, Some(kt))?;
        add("gate_up", F32, m(kt, m(2, i)?))?;
        add("act", F32, m(kt, i))?;
        add("final_inv_rms", F32, Some(kt))?;
        add("z", F32, Some(th))?;
        // The fused loss: one chunk of logits (the full vocabulary for the argmax, then the draft head's), the
        // teacher's chunk on the draft vocabulary, per-row loss and agreement of every step, the gradient reaching
        // each step's `z`.
        add("logits", F32, Some(m(c, v.max(vd))?))?;
        add("teacher_logits", F32, m(c, vd))?;
        add("row_loss", F32, Some(kt))?;
        add("correct", F32, Some(kt))?;
        add("loss_partials", F32, Some(kt.div_ceil(REDUCE_CHUNK)))?;
        add("dz", F32, Some(kth))?;
        // Backward: the norms' upstream gradients stacked (one weight-gradient pass over all steps), the
        // attention keys' and values' gradients stacked (step k's queries reach every earlier step's keys).
        add("d_emb_normed", F32, Some(kth))?;
        add("d_h_normed", F32, Some(kth))?;
        add("dnormed2", F32, Some(kth))?;
        add("dk", F32, m(kt, kd))?;
        add("dv", F32, m(kt, kd))?;
        add("dh", F32, Some(th))?;
        add("dmid", F32, Some(th))?;
        add("dcat", F32, m(th, 2))?;
        add("dact", F32, m(t, i))?;
        add("dgate_up", F32, m(t, m(2, i)?))?;
        add("dattn", F32, m(t, qd))?;
        add("dq", F32, m(t, qd))?;
        add("attn_delta", F32, m(t, spec.heads))?;
        add("norm_partials", F32, m(kt.div_ceil(NORM_ROWS_PER_CHUNK), h))?;
        // Optimizer, and the read-back: [grad_norm, clip, loss, then per step: loss, correct rows, supervised
        // rows; then the accepted prefixes over the unroll].
        add("grad_norm_partials", F32, Some(p.div_ceil(REDUCE_CHUNK)))?;
        add(
            "step_scalars",
            F32,
            STEP_SCALARS.checked_add(m(3, k)?.checked_add(1)?),
        )?;
        add("adamw_step", F32, Some(ADAMW_STEP_FLOATS))?;
        add("adamw_state", F64, Some(ADAMW_STATE_DOUBLES))?;
        let input_slots = match backend {
            BackendKind::Cpu => 1,
            BackendKind::Cuda => 2,
        };
        for slot in 0..input_slots {
            add(&format!("input{slot}.hs"), F32, m(t, d))?;
            add(&format!("input{slot}.last_hs"), F32, Some(th))?;
            add(&format!("input{slot}.input_ids"), U32, Some(t))?;
            add(&format!("input{slot}.seq_lens"), U32, Some(s))?;
            add(&format!("input{slot}.loss_mask"), U8, Some(t))?;
        }
        match backend {
            BackendKind::Cuda => add("cublas_workspace", U8, Some(CUBLAS_WORKSPACE_BYTES))?,
            BackendKind::Cpu if precision != Precision::F32 => {
                let operand = [
                    m(t, d),
                    m(h, d),
                    m(th, 2),
                    m(qd, m(2, h)?),
                    m(t, qd),
                    m(t, m(2, i)?),
                    m(m(2, i)?, h),
                    m(v, h),
                    m(c, v),
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
    use crate::plan::stages::HsDtype;

    fn spec() -> Eagle3Spec {
        Eagle3Spec {
            hidden: 16,
            taps: EAGLE3_TAPS,
            tap_layers: vec![2, 4, 6],
            vocab: 64,
            draft_vocab: 24,
            heads: 4,
            kv_heads: 2,
            head_dim: 4,
            intermediate: 40,
            ttt: 3,
            rope_theta: 1e4,
            rms_norm_eps: 1e-6,
        }
    }

    fn loss() -> LossSpec {
        LossSpec {
            head_decay: 1.0,
            position_decay: None,
            step_decay: Some(0.8),
            chunk_tokens: 8,
        }
    }

    #[test]
    fn layout_has_sglangs_names_and_shapes_back_to_back() {
        let spec = spec();
        let layout = spec.layout();
        let named: Vec<(&str, &[usize])> = layout
            .iter()
            .map(|v| (v.name.as_str(), v.shape.as_slice()))
            .collect();
        assert_eq!(
            named,
            [
                ("fc.weight", &[16, 48][..]),
                ("midlayer.input_layernorm.weight", &[16]),
                ("midlayer.hidden_norm.weight", &[16]),
                ("midlayer.self_attn.q_proj.weight", &[16, 32]),
                ("midlayer.self_attn.k_proj.weight", &[8, 32]),
                ("midlayer.self_attn.v_proj.weight", &[8, 32]),
                ("midlayer.self_attn.o_proj.weight", &[16, 16]),
                ("midlayer.post_attention_layernorm.weight", &[16]),
                ("midlayer.mlp.gate_proj.weight", &[40, 16]),
                ("midlayer.mlp.up_proj.weight", &[40, 16]),
                ("midlayer.mlp.down_proj.weight", &[16, 40]),
                ("norm.weight", &[16]),
                ("lm_head.weight", &[24, 16]),
            ]
        );
        let mut offset = 0;
        for view in &layout {
            assert_eq!(view.offset, offset, "{}", view.name);
            offset += view.len();
        }
        assert_eq!(offset, spec.parameter_count());
        assert_eq!(spec.parameter_count_wide(), offset as u128);
    }

    #[test]
    fn last_hidden_states_take_the_batchs_dtype_and_the_tile_the_taps_width() {
        let bucket = BucketPlan {
            padded_len: 8,
            sequences: 2,
            tokens: 16,
            step_flops: 0,
            step_bytes: 0,
        };
        let layout = WorkspaceLayout::eagle3(
            &spec(),
            &[bucket],
            &loss(),
            BackendKind::Cpu,
            Precision::F32,
        )
        .unwrap()
        .with_hs_dtype(BackendKind::Cpu, HsDtype::Bf16)
        .unwrap();
        let dtype = |name: &str| {
            layout
                .buffers
                .iter()
                .find(|b| b.name == name)
                .unwrap()
                .dtype
        };
        assert_eq!(dtype("input0.hs"), Dtype::Bf16);
        assert_eq!(dtype("input0.last_hs"), Dtype::Bf16);
        assert_eq!(layout.elements("hs_tile"), Some(16 * 48));
        assert_eq!(layout.elements("logits"), Some(8 * 64));
    }

    #[test]
    fn a_loss_without_step_decay_serialises_as_before() {
        let before = r#"{"head_decay":0.8,"chunk_tokens":4}"#;
        let parsed: LossSpec = serde_json::from_str(before).unwrap();
        assert_eq!(parsed.step_decay, None);
        assert_eq!(serde_json::to_string(&parsed).unwrap(), before);
        let with = serde_json::to_string(&loss()).unwrap();
        assert!(with.contains(r#""step_decay":0.8"#), "{with}");
    }

    #[test]
    fn the_step_counts_every_ttt_step() {
        let (one, three) = (
            Eagle3Spec { ttt: 1, ..spec() },
            Eagle3Spec { ttt: 3, ..spec() },
        );
        let (f1, f3) = (
            one.step_flops(8, 2).unwrap(),
            three.step_flops(8, 2).unwrap(),
        );
        assert!(f3 > 2 * f1, "{f3} against {f1}");
    }
}
