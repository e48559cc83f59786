//! The drafter's training state as four flat buffers (parameters, gradients, AdamW moments) with named views.
//!
//! ```text
//!  Plan.model.layout ──▶ FlatState::init ──▶ step (grads) ──▶ all-reduce (grads) ──▶ AdamW (params, moments)
//!                                                  └── checkpoints read the named views
//! ```
//!
//! One contiguous buffer per role is what lets AdamW be one pass, the all-reduce one call and a checkpoint a
//! list of named slices.

use draftpipe_compiler::plan::{ModelPlan, TensorView};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

/// Parameters, gradients and AdamW moments of one drafter replica, each one flat buffer in the model's
/// layout order, plus the optimizer step count.
#[derive(Debug, Clone, PartialEq)]
pub struct FlatState {
    /// All parameters.
    pub params: Vec<f32>,
    /// Gradients of the last `forward_backward` (overwritten each step).
    pub grads: Vec<f32>,
    /// AdamW first moments.
    pub exp_avg: Vec<f32>,
    /// AdamW second moments.
    pub exp_avg_sq: Vec<f32>,
    /// AdamW steps taken (skipped steps do not count).
    pub step: u64,
    layout: Vec<TensorView>,
}

impl FlatState {
    /// A fresh state with PyTorch's default initialisation: every `Linear` weight uniform in
    /// `±1/sqrt(in_features)` (kaiming-uniform with `a = √5`), every norm weight 1; gradients and moments 0.
    /// The same seed gives the same parameters.
    ///
    /// # Examples
    /// ```
    /// use draftpipe_compiler::plan::{MlpSpec, ModelPlan};
    /// use draftpipe_runtime::params::FlatState;
    ///
    /// let spec = MlpSpec { din: 8, hidden: 4, blocks: 1, intermediate: 6, heads: 2, vocab: 10 };
    /// let model = ModelPlan::new(spec);
    /// let state = FlatState::init(&model, 7);
    /// assert_eq!(state.params.len(), model.parameters);
    /// assert!(state.view("norm.weight").unwrap().iter().all(|&w| w == 1.0));
    /// ```
    pub fn init(model: &ModelPlan, seed: u64) -> Self {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
        let mut params = vec![0.0f32; model.parameters];
        for view in &model.layout {
            let tensor = &mut params[view.range()];
            if view.shape.len() == 1 {
                tensor.fill(1.0);
            } else {
                let bound = 1.0 / (view.shape[1] as f32).sqrt();
                for p in tensor {
                    *p = rng.random_range(-bound..bound);
                }
            }
        }
        let n = model.parameters;
        Self {
            params,
            grads: vec![0.0; n],
            exp_avg: vec![0.0; n],
            exp_avg_sq: vec![0.0; n],
            step: 0,
            layout: model.layout.clone(),
        }
    }

    /// A state of zeros in `model`'s layout (the target of a download).
    pub fn zeros(model: &ModelPlan) -> Self {
        let n = model.parameters;
        Self {
            params: vec![0.0; n],
            grads: vec![0.0; n],
            exp_avg: vec![0.0; n],
            exp_avg_sq: vec![0.0; n],
            step: 0,
            layout: model.layout.clone(),
        }
    }

    /// The named tensors, in buffer order.
    pub fn layout(&self) -> &[TensorView] {
        &self.layout
    }

    /// The parameters of the tensor called `name` (PyTorch naming, e.g. `blocks.0.up.weight`).
    pub fn view(&self, name: &str) -> Option<&[f32]> {
        self.find(name).map(|v| &self.params[v.range()])
    }

    /// Mutable parameters of the tensor called `name` (checkpoint loading, tests).
    pub fn view_mut(&mut self, name: &str) -> Option<&mut [f32]> {
        let range = self.find(name)?.range();
        Some(&mut self.params[range])
    }

    /// The gradient of the tensor called `name`.
    pub fn grad_view(&self, name: &str) -> Option<&[f32]> {
        self.find(name).map(|v| &self.grads[v.range()])
    }

    fn find(&self, name: &str) -> Option<&TensorView> {
        self.layout.iter().find(|v| v.name == name)
    }
}
