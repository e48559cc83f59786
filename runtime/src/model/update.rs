//! The update every model shares: the flat state buffers, and gradient norm → clip scale → AdamW's step state
//! advanced on the device → one fused AdamW pass. One function, so `mlp` and `dflash` cannot drift apart.
//!
//! ```text
//!  grads ──grad_norm──▶ step_scalars[0..2] = [‖g‖, clip] ──adamw_advance──▶ adamw_step ──adamw_update──▶ params,
//!                                                                                                       moments,
//!                                                                                          params_bf16 (if kept)
//! ```

use draftpipe_compiler::plan::{AdamWSpec, WorkspaceLayout};

use draftpipe_compiler::plan::ScheduleKind;

use crate::backend::{
    AdamWHyper, Backend, BackendResult, Buf, SCHEDULE_CONSTANT, SCHEDULE_COSINE, SCHEDULE_LINEAR,
};

/// Parameters, gradients and AdamW moments, each one flat buffer in the model's layout order.
pub struct FlatBuffers<B: Backend> {
    /// Parameters.
    pub params: Buf<B, f32>,
    /// Gradients of the last step (overwritten each step).
    pub grads: Buf<B, f32>,
    /// AdamW first moments.
    pub exp_avg: Buf<B, f32>,
    /// AdamW second moments.
    pub exp_avg_sq: Buf<B, f32>,
    /// The parameters rounded to bf16, where the workspace layout keeps such a copy (`params_bf16`: CUDA at
    /// `bf16` precision, for the families whose products read it): written by AdamW in its pass and by
    /// [`FlatBuffers::refresh_bf16`] whenever the parameters are replaced, so it always equals the rounding of
    /// the f32 master. Derived state: never checkpointed.
    pub params_bf16: Option<Buf<B, half::bf16>>,
}

impl<B: Backend> FlatBuffers<B> {
    /// Four zeroed buffers of `parameters` elements.
    ///
    /// # Errors
    /// When the backend cannot allocate.
    pub fn zeroed(backend: &mut B, parameters: usize) -> BackendResult<Self> {
        Ok(Self {
            params: backend.alloc(parameters)?,
            grads: backend.alloc(parameters)?,
            exp_avg: backend.alloc(parameters)?,
            exp_avg_sq: backend.alloc(parameters)?,
            params_bf16: None,
        })
    }

    /// Adds the bf16 copy of the parameters when `layout` lists `params_bf16` (zeroed, as the parameters are).
    ///
    /// # Errors
    /// When the backend cannot allocate.
    pub fn with_layout_copy(
        mut self,
        backend: &mut B,
        layout: &WorkspaceLayout,
    ) -> BackendResult<Self> {
        if let Some(len) = layout.elements("params_bf16") {
            assert_eq!(len, self.params.len(), "params_bf16: one per parameter");
            self.params_bf16 = Some(backend.alloc(len)?);
        }
        Ok(self)
    }

    /// Rewrites the bf16 copy from the parameters (after they were uploaded: initial weights, a resumed
    /// checkpoint), so the first forward reads the new weights; nothing without a copy.
    ///
    /// # Errors
    /// When the backend fails.
    pub fn refresh_bf16(&mut self, backend: &mut B) -> BackendResult {
        match &mut self.params_bf16 {
            Some(copy) => backend.round_to_bf16(self.params.all(), copy.all_mut()),
            None => Ok(()),
        }
    }
}

/// The workspace buffers the update reads and writes.
pub struct UpdateBuffers<'a, B: Backend> {
    /// First pass of the gradient norm.
    pub grad_norm_partials: &'a mut Buf<B, f32>,
    /// The step's read-back scalars; the update writes `[0] = ‖g‖`, `[1] = clip scale`.
    pub step_scalars: &'a mut Buf<B, f32>,
    /// AdamW's per-step scalars.
    pub adamw_step: &'a mut Buf<B, f32>,
    /// `[steps applied, β1^steps, β2^steps]`.
    pub adamw_state: &'a mut Buf<B, f64>,
}

/// AdamW's settings and the step count its learning-rate schedule runs over: what the update needs besides the
/// buffers, held once by every model.
#[derive(Debug, Clone, Copy)]
pub struct Optimizer {
    spec: AdamWSpec,
    schedule_total: u64,
}

impl Optimizer {
    /// `spec`, its schedule over 0 steps until [`Self::set_schedule_total`].
    pub fn new(spec: AdamWSpec) -> Self {
        Self {
            spec,
            schedule_total: 0,
        }
    }

    /// Sets the step count the learning-rate schedule runs over (the drafter's `steps`; before the first step,
    /// since a captured update keeps it).
    pub fn set_schedule_total(&mut self, total_steps: u64) {
        self.schedule_total = total_steps;
    }

    /// AdamW's device state for `steps` applied steps ([`adamw_state_for`]).
    pub fn adamw_state_for(&self, steps: u64) -> [f64; 3] {
        adamw_state_for(&self.spec, steps)
    }

    /// The shared [`update`] with these settings.
    ///
    /// # Errors
    /// When the backend fails.
    pub fn update<B: Backend>(
        &self,
        be: &mut B,
        state: &mut FlatBuffers<B>,
        ws: UpdateBuffers<'_, B>,
    ) -> BackendResult {
        update(be, (&self.spec, self.schedule_total), state, ws)
    }
}

/// What a model lends the update: its optimizer, its state and its workspace's update buffers.
pub type UpdateParts<'a, B> = (&'a Optimizer, &'a mut FlatBuffers<B>, UpdateBuffers<'a, B>);

/// Gradient norm and clip scale into `step_scalars[0..2]`, AdamW's step state advanced on the device (the
/// learning rate of the plan's schedule over `total_steps`, computed there from the applied-step count so a
/// captured graph replays it), and one fused AdamW pass; a non-finite norm skips the update and leaves the
/// step count alone.
pub fn update<B: Backend>(
    be: &mut B,
    (optimizer, total_steps): (&AdamWSpec, u64),
    state: &mut FlatBuffers<B>,
    ws: UpdateBuffers<'_, B>,
) -> BackendResult {
    let AdamWSpec {
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        clip_grad_norm,
        schedule,
    } = *optimizer;
    be.grad_norm(
        state.grads.all(),
        ws.grad_norm_partials.all_mut(),
        clip_grad_norm.unwrap_or(0.0),
        ws.step_scalars.at_mut(0, 2),
    )?;
    be.adamw_advance(
        ws.step_scalars.at(0, 1),
        AdamWHyper {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            schedule_kind: match schedule.kind {
                ScheduleKind::Constant => SCHEDULE_CONSTANT,
                ScheduleKind::Linear => SCHEDULE_LINEAR,
                ScheduleKind::Cosine => SCHEDULE_COSINE,
            },
            warmup: schedule.warmup_steps as f32,
            total: total_steps as f32,
        },
        ws.adamw_state.all_mut(),
        ws.adamw_step.all_mut(),
    )?;
    be.adamw_update(
        (
            state.params.all_mut(),
            state.params_bf16.as_mut().map(Buf::all_mut),
        ),
        state.grads.all(),
        state.exp_avg.all_mut(),
        state.exp_avg_sq.all_mut(),
        ws.step_scalars.at(0, 2),
        ws.adamw_step.all(),
    )
}

/// AdamW's device state for `steps` applied steps: `[steps, β1^steps, β2^steps]`, as PyTorch's corrections
/// (computed in f64).
pub fn adamw_state_for(optimizer: &AdamWSpec, steps: u64) -> [f64; 3] {
    let t = steps as f64;
    [
        t,
        f64::from(optimizer.beta1).powf(t),
        f64::from(optimizer.beta2).powf(t),
    ]
}
