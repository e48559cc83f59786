//! AdamW fused into one pass over the flat parameter buffer, with PyTorch semantics (`torch.optim.AdamW`,
//! `foreach=False`): decoupled weight decay `p ← p · (1 − lr·wd)`, moments `m ← β1·m + (1−β1)·g`,
//! `v ← β2·v + (1−β2)·g²`, then `p ← p − (lr / bc1) · m / (sqrt(v) / sqrt(bc2) + eps)`, where `g` is the
//! gradient times the clip scale.

/// Per-step scalars of AdamW; the bias corrections depend on the step count, so the host computes them.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    /// Learning rate.
    pub lr: f32,
    /// First-moment decay β1.
    pub beta1: f32,
    /// Second-moment decay β2.
    pub beta2: f32,
    /// Denominator epsilon.
    pub eps: f32,
    /// Decoupled weight decay.
    pub weight_decay: f32,
    /// `lr / (1 − β1^step)`.
    pub step_size: f32,
    /// `sqrt(1 − β2^step)`.
    pub bias_correction2_sqrt: f32,
}

/// One AdamW update of the elements `chunk · chunk_len ..` up to `min(n, (chunk + 1) · chunk_len)`, with the
/// gradient scaled by `clip_scale[0]`. Does nothing when `grad_norm[0]` is not finite (a skipped step; the host
/// then does not advance the step count).
///
/// When `params_bf16` is not null it receives, in the same pass, each updated parameter rounded to bfloat16
/// (nearest even, [`crate::convert::f32_to_bf16_bits`]): the copy the 16-bit products read at `bf16` precision,
/// bit for bit the value the CPU's emulation rounds the f32 master to inside its products. A skipped step leaves
/// it alone too, so it always equals the master's rounding.
///
/// Launch: element range: the GPU uses `chunk_len = 1` (`n` indices), the CPU long chunks.
///
/// # Safety
/// `params`, `grads`, `exp_avg`, `exp_avg_sq` (and `params_bf16` unless null) hold `n` elements and do not
/// overlap; `grad_norm` and `clip_scale` hold one element each.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn adamw_update(
    params: *mut f32,
    params_bf16: *mut u16,
    grads: *const f32,
    exp_avg: *mut f32,
    exp_avg_sq: *mut f32,
    grad_norm: *const f32,
    clip_scale: *const f32,
    hyper: AdamWStep,
    n: usize,
    chunk_len: usize,
    chunk: usize,
) {
    // SAFETY: the scalars are single elements; `start..end` is inside the four non-overlapping buffers.
    unsafe {
        if !(*grad_norm).is_finite() {
            return;
        }
        let clip = *clip_scale;
        let start = chunk * chunk_len;
        let end = if start + chunk_len < n {
            start + chunk_len
        } else {
            n
        };
        let decay = 1.0 - hyper.lr * hyper.weight_decay;
        let one_minus_b1 = 1.0 - hyper.beta1;
        let one_minus_b2 = 1.0 - hyper.beta2;
        for i in start..end {
            let g = *grads.add(i) * clip;
            let m = hyper.beta1 * *exp_avg.add(i) + one_minus_b1 * g;
            let v = hyper.beta2 * *exp_avg_sq.add(i) + one_minus_b2 * g * g;
            *exp_avg.add(i) = m;
            *exp_avg_sq.add(i) = v;
            let denom = crate::math::sqrt(v) / hyper.bias_correction2_sqrt + hyper.eps;
            let p = *params.add(i) * decay - hyper.step_size * m / denom;
            *params.add(i) = p;
            if !params_bf16.is_null() {
                *params_bf16.add(i) = crate::convert::f32_to_bf16_bits(p);
            }
        }
    }
}

/// AdamW's constant hyper-parameters (the learning rate before the schedule).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConstants {
    /// Peak learning rate.
    pub lr: f32,
    /// First-moment decay β1.
    pub beta1: f32,
    /// Second-moment decay β2.
    pub beta2: f32,
    /// Denominator epsilon.
    pub eps: f32,
    /// Decoupled weight decay.
    pub weight_decay: f32,
}

/// Schedule kind: the learning rate as given.
pub const SCHEDULE_CONSTANT: u32 = 0;
/// Schedule kind: linear warmup, then linear decay to 0 at `total`.
pub const SCHEDULE_LINEAR: u32 = 1;
/// Schedule kind: linear warmup, then half a cosine to 0 at `total`.
pub const SCHEDULE_COSINE: u32 = 2;

/// A learning-rate schedule as Hugging Face's `get_{linear,cosine}_schedule_with_warmup` (or constant).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Schedule {
    /// [`SCHEDULE_CONSTANT`], [`SCHEDULE_LINEAR`] or [`SCHEDULE_COSINE`] (any other value: constant).
    pub kind: u32,
    /// Warmup steps `w`.
    pub warmup: f32,
    /// Total steps `T`.
    pub total: f32,
}

impl Schedule {
    /// The learning-rate factor for the step applied after `applied` steps (0 for the first):
    /// `s < w: s / max(1, w)`; linear: `max(0, (T − s) / max(1, T − w))`; cosine:
    /// `max(0, ½ (1 + cos(π (s − w) / max(1, T − w))))`; constant: 1.
    #[inline(always)]
    pub fn factor(self, applied: f64) -> f64 {
        let (w, total) = (self.warmup as f64, self.total as f64);
        let at_least_one = |x: f64| if x > 1.0 { x } else { 1.0 };
        let non_negative = |x: f64| if x > 0.0 { x } else { 0.0 };
        if self.kind != SCHEDULE_LINEAR && self.kind != SCHEDULE_COSINE {
            return 1.0;
        }
        if applied < w {
            return applied / at_least_one(w);
        }
        let span = at_least_one(total - w);
        if self.kind == SCHEDULE_LINEAR {
            non_negative((total - applied) / span)
        } else {
            let progress = ((applied - w) / span) as f32;
            let (_, cos) = crate::math::sin_cos(core::f32::consts::PI * progress);
            non_negative(0.5 * (1.0 + cos as f64))
        }
    }
}

/// Advances AdamW's running state for one applied step and writes that step's scalars, on the device, so the
/// host never computes bias corrections or the scheduled learning rate (a CUDA graph replays the same launch
/// every step) and a skipped step (non-finite `grad_norm[0]`) advances nothing:
/// `state = [steps, β1^steps, β2^steps]` (f64, as PyTorch computes the corrections in Python floats). The
/// step's learning rate is `lr · schedule.factor(steps before this one)`, which also scales the decoupled weight
/// decay, as a PyTorch scheduler changes the group's `lr`.
///
/// Launch: one index.
///
/// # Safety
/// `grad_norm` holds one element, `state` three, `step` one [`AdamWStep`].
#[inline(always)]
pub unsafe fn adamw_advance(
    grad_norm: *const f32,
    constants: AdamWConstants,
    schedule: Schedule,
    state: *mut f64,
    step: *mut AdamWStep,
) {
    // SAFETY: the caller's contract: one, three and one element.
    unsafe {
        if !(*grad_norm).is_finite() {
            return;
        }
        let lr = constants.lr as f64 * schedule.factor(*state);
        *state += 1.0;
        *state.add(1) *= constants.beta1 as f64;
        *state.add(2) *= constants.beta2 as f64;
        let bias1 = 1.0 - *state.add(1);
        let bias2 = 1.0 - *state.add(2);
        *step = AdamWStep {
            lr: lr as f32,
            beta1: constants.beta1,
            beta2: constants.beta2,
            eps: constants.eps,
            weight_decay: constants.weight_decay,
            step_size: (lr / bias1) as f32,
            bias_correction2_sqrt: crate::math::sqrt(bias2 as f32),
        };
    }
}
