//! Where the `dflash` step's trained tensors live in the flat buffers: read by name from the plan's tensor
//! table (z-lab's names) and checked against the shapes the step assumes, so a layout the step cannot train is
//! an error when the drafter is built, never a wrong product.

use draftpipe_compiler::plan::{DflashSpec, ModelPlan, TensorView};

use crate::model::step::LayoutError;

/// Element offsets of one decoder layer's tensors.
#[derive(Debug, Clone, Copy)]
pub(super) struct LayerOffsets {
    pub(super) input_layernorm: usize,
    pub(super) q_proj: usize,
    pub(super) k_proj: usize,
    pub(super) v_proj: usize,
    pub(super) q_norm: usize,
    pub(super) k_norm: usize,
    pub(super) o_proj: usize,
    pub(super) post_attention_layernorm: usize,
    /// `gate_proj` directly followed by `up_proj`: one `[2I, H]` matrix, as the SwiGLU kernel reads `[g | u]`.
    pub(super) gate_up: usize,
    pub(super) down_proj: usize,
}

/// Where each trained tensor lives, checked against the step's shapes.
#[derive(Debug, Clone)]
pub struct DflashOffsets {
    pub(super) spec: DflashSpec,
    pub(super) fc: usize,
    pub(super) hidden_norm: usize,
    pub(super) layers: Vec<LayerOffsets>,
    pub(super) norm: usize,
}

impl DflashOffsets {
    /// Reads the offsets from the model's tensor table.
    ///
    /// # Errors
    /// [`LayoutError`] when the plan is not a `dflash`, a tensor is missing or mis-shaped, `up_proj` does not
    /// follow `gate_proj`, a dimension is zero or the parameter count disagrees with the table.
    pub fn new(model: &ModelPlan) -> Result<Self, LayoutError> {
        let spec = model
            .spec
            .as_dflash()
            .ok_or(LayoutError::Unsupported(model.spec.kind()))?
            .clone();
        let layout: &[TensorView] = &model.layout;
        let find = |name: String, shape: &[usize]| -> Result<usize, LayoutError> {
            match layout.iter().find(|v| v.name == name) {
                Some(v) if v.shape == shape => Ok(v.offset),
                _ => Err(LayoutError::Tensor(name)),
            }
        };
        let DflashSpec {
            hidden: h,
            taps,
            vocab,
            layers,
            heads,
            kv_heads,
            head_dim: hd,
            intermediate: i,
            block,
            anchors,
            ..
        } = spec;
        if [
            h, taps, vocab, layers, heads, kv_heads, hd, i, block, anchors,
        ]
        .contains(&0)
            || heads % kv_heads != 0
            || hd % 2 != 0
        {
            return Err(LayoutError::EmptyDimension);
        }
        let expected: usize = layout.iter().map(TensorView::len).sum();
        if model.parameters != expected || layout.iter().any(|v| v.range().end > expected) {
            return Err(LayoutError::Parameters {
                expected,
                got: model.parameters,
            });
        }
        let (q, kv) = (heads * hd, kv_heads * hd);
        let layers = (0..layers)
            .map(|l| {
                let name = |t: &str| format!("layers.{l}.{t}.weight");
                let gate_up = find(name("mlp.gate_proj"), &[i, h])?;
                if find(name("mlp.up_proj"), &[i, h])? != gate_up + i * h {
                    return Err(LayoutError::Tensor(format!(
                        "{} (must follow gate_proj)",
                        name("mlp.up_proj")
                    )));
                }
                Ok(LayerOffsets {
                    input_layernorm: find(name("input_layernorm"), &[h])?,
                    q_proj: find(name("self_attn.q_proj"), &[q, h])?,
                    k_proj: find(name("self_attn.k_proj"), &[kv, h])?,
                    v_proj: find(name("self_attn.v_proj"), &[kv, h])?,
                    q_norm: find(name("self_attn.q_norm"), &[hd])?,
                    k_norm: find(name("self_attn.k_norm"), &[hd])?,
                    o_proj: find(name("self_attn.o_proj"), &[h, q])?,
                    post_attention_layernorm: find(name("post_attention_layernorm"), &[h])?,
                    gate_up,
                    down_proj: find(name("mlp.down_proj"), &[h, i])?,
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            fc: find("fc.weight".into(), &[h, taps * h])?,
            hidden_norm: find("hidden_norm.weight".into(), &[h])?,
            layers,
            norm: find("norm.weight".into(), &[h])?,
            spec,
        })
    }

    /// The dimensions the offsets were read for.
    pub fn spec(&self) -> &DflashSpec {
        &self.spec
    }
}
