//! Where the `eagle3` step's trained tensors live in the flat buffers: read by name from the plan's tensor
//! table (SGLang's `LlamaForCausalLMEagle3` names) and checked against the shapes the step assumes, so a layout
//! the step cannot train is an error when the drafter is built, never a wrong product.

use draftpipe_compiler::plan::{Eagle3Spec, ModelPlan, TensorView};

use crate::model::step::LayoutError;

/// Offsets of the trained tensors, and the dimensions they were checked against.
#[derive(Debug, Clone)]
pub struct Eagle3Offsets {
    pub(super) spec: Eagle3Spec,
    pub(super) fc: usize,
    pub(super) input_layernorm: usize,
    pub(super) hidden_norm: usize,
    pub(super) q_proj: usize,
    pub(super) k_proj: usize,
    pub(super) v_proj: usize,
    pub(super) o_proj: usize,
    pub(super) post_attention_layernorm: usize,
    /// `gate_proj` then `up_proj`, back to back: one `[2I, H]` product.
    pub(super) gate_up: usize,
    pub(super) down_proj: usize,
    pub(super) norm: usize,
    pub(super) lm_head: usize,
}

impl Eagle3Offsets {
    /// The offsets of `model`'s layout.
    ///
    /// # Errors
    /// [`LayoutError`] when the model is not `eagle3`, a dimension is zero (or the heads do not group), or a
    /// tensor is missing or mis-shaped.
    pub fn new(model: &ModelPlan) -> Result<Self, LayoutError> {
        let spec = model
            .spec
            .as_eagle3()
            .ok_or(LayoutError::Unsupported(model.spec.kind()))?
            .clone();
        let Eagle3Spec {
            hidden: h,
            taps,
            vocab,
            draft_vocab,
            heads,
            kv_heads,
            head_dim: hd,
            intermediate: i,
            ttt,
            ..
        } = spec;
        if [h, taps, vocab, draft_vocab, heads, kv_heads, hd, i, ttt].contains(&0)
            || !heads.is_multiple_of(kv_heads)
            || !hd.is_multiple_of(2)
            || draft_vocab > vocab
        {
            return Err(LayoutError::EmptyDimension);
        }
        let layout: &[TensorView] = &model.layout;
        let expected: usize = layout.iter().map(TensorView::len).sum();
        if model.parameters != expected || layout.iter().any(|v| v.range().end > expected) {
            return Err(LayoutError::Parameters {
                expected,
                got: model.parameters,
            });
        }
        let find = |name: &str, shape: &[usize]| -> Result<usize, LayoutError> {
            match layout.iter().find(|v| v.name == name) {
                Some(v) if v.shape == shape => Ok(v.offset),
                _ => Err(LayoutError::Tensor(name.to_owned())),
            }
        };
        let (qd, kd) = (heads * hd, kv_heads * hd);
        let gate_up = find("midlayer.mlp.gate_proj.weight", &[i, h])?;
        if find("midlayer.mlp.up_proj.weight", &[i, h])? != gate_up + i * h {
            return Err(LayoutError::Tensor(
                "midlayer.mlp.up_proj.weight (must follow gate_proj)".to_owned(),
            ));
        }
        Ok(Self {
            fc: find("fc.weight", &[h, taps * h])?,
            input_layernorm: find("midlayer.input_layernorm.weight", &[h])?,
            hidden_norm: find("midlayer.hidden_norm.weight", &[h])?,
            q_proj: find("midlayer.self_attn.q_proj.weight", &[qd, 2 * h])?,
            k_proj: find("midlayer.self_attn.k_proj.weight", &[kd, 2 * h])?,
            v_proj: find("midlayer.self_attn.v_proj.weight", &[kd, 2 * h])?,
            o_proj: find("midlayer.self_attn.o_proj.weight", &[h, qd])?,
            post_attention_layernorm: find("midlayer.post_attention_layernorm.weight", &[h])?,
            gate_up,
            down_proj: find("midlayer.mlp.down_proj.weight", &[h, i])?,
            norm: find("norm.weight", &[h])?,
            lm_head: find("lm_head.weight", &[draft_vocab, h])?,
            spec,
        })
    }

    /// The model's dimensions.
    pub fn spec(&self) -> &Eagle3Spec {
        &self.spec
    }
}
