//! Where the `mlp` step's tensors live: the parameter offsets read (and checked) from the model's layout, the
//! four flat state buffers, and the workspace allocated by name from the compiler's [`WorkspaceLayout`].

use draftpipe_compiler::plan::{MlpSpec, ModelPlan, TensorView, WorkspaceLayout};

use crate::backend::{Backend, Buf, InputSlot};
use crate::model::step::{AllocateError, LayoutError, input_slot, take_buffer as take};

/// Element offsets of one SwiGLU block's tensors in the flat buffers.
#[derive(Debug, Clone, Copy)]
pub(super) struct BlockOffsets {
    pub(super) norm: usize,
    /// `gate.weight` directly followed by `up.weight`: one `[2I, H]` matrix.
    pub(super) gate_up: usize,
    pub(super) down: usize,
}

/// Where each tensor lives in the flat buffers, checked against the shapes the step assumes.
#[derive(Debug, Clone)]
pub struct MlpOffsets {
    /// The dimensions the offsets were read for.
    pub(super) spec: MlpSpec,
    pub(super) fc: usize,
    pub(super) blocks: Vec<BlockOffsets>,
    pub(super) norm: usize,
    pub(super) heads: Vec<usize>,
    pub(super) lm_head: usize,
}

impl MlpOffsets {
    /// The dimensions the offsets were read for.
    pub fn spec(&self) -> &MlpSpec {
        &self.spec
    }

    /// Reads the offsets from the model's layout.
    ///
    /// # Errors
    /// [`LayoutError`] when a tensor is missing or mis-shaped, `gate` and `up` are not adjacent (the fused
    /// `[gate | up]` product relies on it), or a dimension is zero.
    pub fn new(model: &ModelPlan) -> Result<Self, LayoutError> {
        let spec = model
            .spec
            .as_mlp()
            .ok_or(LayoutError::Unsupported(model.spec.kind()))?;
        let layout: &[TensorView] = &model.layout;
        let find = |name: String, shape: &[usize]| -> Result<usize, LayoutError> {
            match layout.iter().find(|v| v.name == name) {
                Some(v) if v.shape == shape => Ok(v.offset),
                _ => Err(LayoutError::Tensor(name)),
            }
        };
        let MlpSpec {
            din,
            hidden: h,
            blocks,
            intermediate: i,
            heads,
            vocab,
        } = *spec;
        if [din, h, i, heads, vocab].contains(&0) {
            return Err(LayoutError::EmptyDimension);
        }
        let expected: usize = layout.iter().map(TensorView::len).sum();
        if model.parameters != expected || layout.iter().any(|v| v.range().end > expected) {
            return Err(LayoutError::Parameters {
                expected,
                got: model.parameters,
            });
        }
        let blocks = (0..blocks)
            .map(|b| {
                let gate_up = find(format!("blocks.{b}.gate.weight"), &[i, h])?;
                if find(format!("blocks.{b}.up.weight"), &[i, h])? != gate_up + i * h {
                    return Err(LayoutError::Tensor(format!(
                        "blocks.{b}.up.weight (must follow gate.weight)"
                    )));
                }
                Ok(BlockOffsets {
                    norm: find(format!("blocks.{b}.norm.weight"), &[h])?,
                    gate_up,
                    down: find(format!("blocks.{b}.down.weight"), &[h, i])?,
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            spec: *spec,
            fc: find("fc.weight".into(), &[h, din])?,
            blocks,
            norm: find("norm.weight".into(), &[h])?,
            heads: (0..heads)
                .map(|j| find(format!("heads.{j}.weight"), &[h, h]))
                .collect::<Result<_, _>>()?,
            lm_head: find("lm_head.weight".into(), &[vocab, h])?,
        })
    }
}

/// Every buffer of [`WorkspaceLayout::mlp`], allocated by name.
pub struct MlpWorkspace<B: Backend> {
    /// Residual stream before each block and after the last, `L + 1` buffers of `[T, H]`.
    pub xs: Vec<Buf<B, f32>>,
    pub(crate) normed: Buf<B, f32>,
    pub(crate) inv_rms: Buf<B, f32>,
    pub(crate) gate_up: Buf<B, f32>,
    pub(crate) act: Buf<B, f32>,
    pub(crate) z: Buf<B, f32>,
    pub(crate) head_a: Buf<B, f32>,
    pub(crate) head_h: Buf<B, f32>,
    pub(crate) head_dh: Buf<B, f32>,
    pub(crate) head_da: Buf<B, f32>,
    pub(crate) logits: Buf<B, f32>,
    pub(crate) labels: Buf<B, i32>,
    /// Valid labels per head of the last step.
    pub counts: Buf<B, u32>,
    pub(crate) scales: Buf<B, f32>,
    pub(crate) row_loss: Buf<B, f32>,
    pub(crate) loss_partials: Buf<B, f32>,
    pub(crate) dz: Buf<B, f32>,
    pub(crate) dx: Buf<B, f32>,
    pub(crate) dnormed: Buf<B, f32>,
    pub(crate) dact: Buf<B, f32>,
    pub(crate) dgate_up: Buf<B, f32>,
    pub(crate) norm_partials: Buf<B, f32>,
    pub(crate) grad_norm_partials: Buf<B, f32>,
    /// `[grad_norm, clip_scale, loss]` of the last step.
    pub step_scalars: Buf<B, f32>,
    pub(crate) adamw_step: Buf<B, f32>,
    /// `[steps applied, β1^steps, β2^steps]`.
    pub adamw_state: Buf<B, f64>,
    /// The input slots.
    pub inputs: Vec<InputSlot<B>>,
}

impl<B: Backend> MlpWorkspace<B> {
    /// Allocates every buffer `layout` lists for this backend's step (the layout's backend-specific entries,
    /// cuBLAS's workspace or the CPU's rounding buffers, are the backend's own).
    pub fn allocate(backend: &mut B, layout: &WorkspaceLayout) -> Result<Self, AllocateError> {
        let mut xs = Vec::new();
        while layout.elements(&format!("xs.{}", xs.len())).is_some() {
            xs.push(take(backend, layout, &format!("xs.{}", xs.len()))?);
        }
        let inputs = (0..layout.input_slots)
            .map(|slot| input_slot(backend, layout, slot))
            .collect::<Result<_, AllocateError>>()?;
        Ok(Self {
            xs,
            normed: take(backend, layout, "normed")?,
            inv_rms: take(backend, layout, "inv_rms")?,
            gate_up: take(backend, layout, "gate_up")?,
            act: take(backend, layout, "act")?,
            z: take(backend, layout, "z")?,
            head_a: take(backend, layout, "head_a")?,
            head_h: take(backend, layout, "head_h")?,
            head_dh: take(backend, layout, "head_dh")?,
            head_da: take(backend, layout, "head_da")?,
            logits: take(backend, layout, "logits")?,
            labels: take(backend, layout, "labels")?,
            counts: take(backend, layout, "counts")?,
            scales: take(backend, layout, "scales")?,
            row_loss: take(backend, layout, "row_loss")?,
            loss_partials: take(backend, layout, "loss_partials")?,
            dz: take(backend, layout, "dz")?,
            dx: take(backend, layout, "dx")?,
            dnormed: take(backend, layout, "dnormed")?,
            dact: take(backend, layout, "dact")?,
            dgate_up: take(backend, layout, "dgate_up")?,
            norm_partials: take(backend, layout, "norm_partials")?,
            grad_norm_partials: take(backend, layout, "grad_norm_partials")?,
            step_scalars: take(backend, layout, "step_scalars")?,
            adamw_step: take(backend, layout, "adamw_step")?,
            adamw_state: take(backend, layout, "adamw_state")?,
            inputs,
        })
    }
}
