//! Safe host launchers for the `draftpipe-gpu-kernels` bodies: each checks buffer lengths against the launch
//! shape, then calls the kernel for every index of its launch (the host's "grid").
//!
//! Element-range kernels run in chunks of [`HOST_CHUNK`] elements so their inner loops vectorise.
//!
//! Each launcher is compiled twice from its one body (the `launcher!` macro): for the baseline x86-64 target and for
//! AVX2 + FMA, picked at run time by what the CPU has. The kernels' `exp`/`rsqrt` polynomials are what bound the
//! loss and activation kernels, and twice the lanes nearly halve them. Both copies give bit-identical results:
//! the kernels fix their summation order in code, and Rust never fuses `a * b + c` into an FMA on its own, so the
//! wider target changes only how many lanes run at once (a test compares the two bit for bit).
//!
//! # Panics
//! Every launcher panics when a buffer is shorter than its shape needs: the step sizes all buffers from one
//! bucket shape, so a mismatch is a bug, and the check is what makes the `unsafe` kernel calls sound.

use draftpipe_gpu_kernels::{activation, adamw, loss, norm, reduce};

pub use draftpipe_gpu_kernels::adamw::AdamWStep;
pub use draftpipe_gpu_kernels::loss::IGNORE_LABEL;

/// Elements per call of an element-range kernel on the host.
pub const HOST_CHUNK: usize = 4096;

/// Defines a launcher over one body compiled twice: as written for the baseline target, and inside a
/// `#[target_feature(enable = "avx2,fma")]` copy, where the `#[inline(always)]` kernel bodies vectorise with
/// 8 lanes. The copy runs when `simd_available` says the CPU has both features.
macro_rules! launcher {
    (
        $(#[$attr:meta])*
        pub fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block
    ) => {
        $(#[$attr])*
        pub fn $name($($arg: $ty),*) $(-> $ret)? {
            #[allow(clippy::too_many_arguments)]
            #[inline(always)]
            fn baseline($($arg: $ty),*) $(-> $ret)? $body

            #[cfg(target_arch = "x86_64")]
            {
                #[allow(clippy::too_many_arguments)]
                #[target_feature(enable = "avx2,fma")]
                fn avx2_fma($($arg: $ty),*) $(-> $ret)? {
                    baseline($($arg),*)
                }

                if simd_available() {
                    // SAFETY: `simd_available` checked that this CPU has AVX2 and FMA.
                    return unsafe { avx2_fma($($arg),*) };
                }
            }
            baseline($($arg),*)
        }
    };
}

/// Whether the launchers take their AVX2 + FMA copies: the CPU has both (std detects them once and caches the
/// answer), and, in this crate's unit tests, the calling thread has not asked for the baseline.
#[cfg(target_arch = "x86_64")]
fn simd_available() -> bool {
    #[cfg(test)]
    if tests::BASELINE_ONLY.with(std::cell::Cell::get) {
        return false;
    }
    std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
}

launcher! {
/// RMSNorm forward over `rows = x.len() / weight.len()` rows; `y = x / rms ⊙ weight`, `inv_rms[r] = 1/rms`.
pub fn rmsnorm_forward(x: &[f32], weight: &[f32], y: &mut [f32], inv_rms: &mut [f32], eps: f32) {
    let cols = weight.len();
    let rows = inv_rms.len();
    assert!(
        x.len() == rows * cols && y.len() == rows * cols,
        "rmsnorm_forward: buffer sizes"
    );
    for row in 0..rows {
        // SAFETY: the lengths checked above cover every row.
        unsafe {
            norm::rmsnorm_forward(
                x.as_ptr(),
                weight.as_ptr(),
                y.as_mut_ptr(),
                inv_rms.as_mut_ptr(),
                cols,
                eps,
                row,
            )
        };
    }
}
}

launcher! {
/// RMSNorm input gradient; `dx = ∂L/∂x` (or `dx += ∂L/∂x` with `accumulate`).
pub fn rmsnorm_backward_input(
    x: &[f32],
    weight: &[f32],
    inv_rms: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    accumulate: bool,
) {
    let cols = weight.len();
    let rows = inv_rms.len();
    let n = rows * cols;
    assert!(
        x.len() == n && dy.len() == n && dx.len() == n,
        "rmsnorm_backward_input: buffer sizes"
    );
    for row in 0..rows {
        // SAFETY: the lengths checked above cover every row; `dx` is a unique borrow.
        unsafe {
            norm::rmsnorm_backward_input(
                x.as_ptr(),
                weight.as_ptr(),
                inv_rms.as_ptr(),
                dy.as_ptr(),
                dx.as_mut_ptr(),
                cols,
                accumulate,
                row,
            )
        };
    }
}
}

launcher! {
/// RMSNorm weight gradient `dw[c] = Σ_r dy[r,c]·x[r,c]·inv_rms[r]` by the two-pass reduction, using
/// `partials` (at least `ceil(rows / rows_per_chunk) · cols` elements) as scratch.
pub fn rmsnorm_weight_grad(
    x: &[f32],
    inv_rms: &[f32],
    dy: &[f32],
    dw: &mut [f32],
    partials: &mut [f32],
    rows_per_chunk: usize,
) {
    let cols = dw.len();
    let rows = inv_rms.len();
    assert!(rows_per_chunk > 0, "rmsnorm_weight_grad: empty chunk");
    let chunks = rows.div_ceil(rows_per_chunk);
    assert!(
        x.len() == rows * cols && dy.len() == rows * cols,
        "rmsnorm_weight_grad: buffer sizes"
    );
    assert!(
        partials.len() >= chunks * cols,
        "rmsnorm_weight_grad: partials too short"
    );
    for index in 0..chunks * cols {
        // SAFETY: the lengths checked above cover every chunk and column.
        unsafe {
            norm::rmsnorm_weight_grad_partials(
                x.as_ptr(),
                inv_rms.as_ptr(),
                dy.as_ptr(),
                partials.as_mut_ptr(),
                rows,
                cols,
                rows_per_chunk,
                index,
            )
        };
    }
    for col in 0..cols {
        // SAFETY: `partials` holds `chunks · cols` elements, `dw` `cols`.
        unsafe { norm::column_sums(partials.as_ptr(), dw.as_mut_ptr(), chunks, cols, false, col) };
    }
}
}

launcher! {
/// SwiGLU forward: `act = silu(gate) ⊙ up` from `[gate | up]` rows of width `2 · inter`.
pub fn swiglu_forward(gate_up: &[f32], act: &mut [f32], inter: usize) {
    let n = act.len();
    assert_eq!(gate_up.len(), 2 * n, "swiglu_forward: buffer sizes");
    for chunk in 0..n.div_ceil(HOST_CHUNK) {
        // SAFETY: sizes checked above; the kernel clips the last chunk to `n`.
        unsafe {
            activation::swiglu_forward(
                gate_up.as_ptr(),
                act.as_mut_ptr(),
                inter,
                n,
                HOST_CHUNK,
                chunk,
            )
        };
    }
}
}

launcher! {
/// SwiGLU backward into the `[dgate | dup]` rows of `dgate_up`.
pub fn swiglu_backward(gate_up: &[f32], dact: &[f32], dgate_up: &mut [f32], inter: usize) {
    let n = dact.len();
    assert!(
        gate_up.len() == 2 * n && dgate_up.len() == 2 * n,
        "swiglu_backward: buffer sizes"
    );
    for chunk in 0..n.div_ceil(HOST_CHUNK) {
        // SAFETY: sizes checked above; `dgate_up` is a unique borrow.
        unsafe {
            activation::swiglu_backward(
                gate_up.as_ptr(),
                dact.as_ptr(),
                dgate_up.as_mut_ptr(),
                inter,
                n,
                HOST_CHUNK,
                chunk,
            )
        };
    }
}
}

launcher! {
/// Head residual forward `h = z + silu(a)`.
pub fn head_residual_forward(z: &[f32], a: &[f32], h: &mut [f32]) {
    let n = h.len();
    assert!(
        z.len() == n && a.len() == n,
        "head_residual_forward: buffer sizes"
    );
    for chunk in 0..n.div_ceil(HOST_CHUNK) {
        // SAFETY: sizes checked above; `h` is a unique borrow.
        unsafe {
            activation::head_residual_forward(
                z.as_ptr(),
                a.as_ptr(),
                h.as_mut_ptr(),
                n,
                HOST_CHUNK,
                chunk,
            )
        };
    }
}
}

launcher! {
/// Head residual backward: `da = dh · silu'(a)` (the gradient with respect to `a`) and `dz += dh`.
///
/// `da` is a separate buffer although the kernel allows `da = dh`: distinct buffers pass the compiler's runtime
/// overlap check, so the loop runs vectorised (in place it measured 4× slower).
pub fn head_residual_backward(a: &[f32], dh: &[f32], da: &mut [f32], dz: &mut [f32]) {
    let n = a.len();
    assert!(
        dh.len() == n && da.len() == n && dz.len() == n,
        "head_residual_backward: buffer sizes"
    );
    for chunk in 0..n.div_ceil(HOST_CHUNK) {
        // SAFETY: sizes checked above; `da` and `dz` are unique borrows, so they overlap nothing.
        unsafe {
            activation::head_residual_backward(
                a.as_ptr(),
                dh.as_ptr(),
                da.as_mut_ptr(),
                dz.as_mut_ptr(),
                n,
                HOST_CHUNK,
                chunk,
            )
        };
    }
}
}

launcher! {
/// Labels of every head, `labels[j · tokens + t]` (see [`loss::build_labels`]).
pub fn build_labels(
    input_ids: &[u32],
    loss_mask: &[u8],
    seq_lens: &[u32],
    labels: &mut [i32],
    padded_len: usize,
    vocab: usize,
) {
    let tokens = input_ids.len();
    assert!(
        padded_len > 0 && tokens == seq_lens.len() * padded_len,
        "build_labels: shape"
    );
    assert!(
        loss_mask.len() == tokens && labels.len().is_multiple_of(tokens.max(1)),
        "build_labels: buffer sizes"
    );
    for index in 0..labels.len() {
        // SAFETY: sizes checked above; `index < heads · tokens`.
        unsafe {
            loss::build_labels(
                input_ids.as_ptr(),
                loss_mask.as_ptr(),
                seq_lens.as_ptr(),
                labels.as_mut_ptr(),
                padded_len,
                tokens,
                vocab,
                index,
            )
        };
    }
}
}

launcher! {
/// Valid-label counts and loss scales of every head.
pub fn head_loss_scales(labels: &[i32], head_decay: f32, counts: &mut [u32], scales: &mut [f32]) {
    let heads = counts.len();
    assert!(
        scales.len() == heads && heads > 0 && labels.len().is_multiple_of(heads),
        "head_loss_scales: buffer sizes"
    );
    let tokens = labels.len() / heads;
    for head in 0..heads {
        // SAFETY: sizes checked above.
        unsafe {
            loss::head_loss_scales(
                labels.as_ptr(),
                tokens,
                heads,
                head_decay,
                counts.as_mut_ptr(),
                scales.as_mut_ptr(),
                head,
            )
        };
    }
}
}

launcher! {
/// Fused cross-entropy over the rows of a logits chunk `[rows, vocab]`: per-row scaled loss into `row_loss`,
/// the scaled logits gradient in place. Labels must be `< vocab` or negative (ignored).
pub fn vocab_loss(
    logits: &mut [f32],
    labels: &[i32],
    scale: f32,
    row_loss: &mut [f32],
    vocab: usize,
) {
    let rows = labels.len();
    assert!(
        vocab > 0 && logits.len() == rows * vocab && row_loss.len() == rows,
        "vocab_loss: buffer sizes"
    );
    assert!(
        labels.iter().all(|&l| l < vocab as i32),
        "vocab_loss: label out of range"
    );
    for row in 0..rows {
        // SAFETY: sizes and label range checked above.
        unsafe {
            loss::vocab_loss_row(
                logits.as_mut_ptr(),
                labels.as_ptr(),
                &scale,
                row_loss.as_mut_ptr(),
                vocab,
                row,
            )
        };
    }
}
}

launcher! {
/// Deterministic sum of `values` through `partials` (at least `ceil(n / chunk_len)` elements).
pub fn sum(values: &[f32], chunk_len: usize, partials: &mut [f32]) -> f32 {
    let chunks = values.len().div_ceil(chunk_len);
    assert!(
        chunk_len > 0 && partials.len() >= chunks,
        "sum: partials too short"
    );
    for chunk in 0..chunks {
        // SAFETY: sizes checked above.
        unsafe {
            reduce::sum_partials(
                values.as_ptr(),
                values.len(),
                chunk_len,
                partials.as_mut_ptr(),
                chunk,
            )
        };
    }
    let mut total = 0.0;
    // SAFETY: `partials` holds `chunks` elements.
    unsafe { reduce::finish_sum(partials.as_ptr(), chunks, &mut total) };
    total
}
}

launcher! {
/// Global L2 norm of `values` and the clip scale for `max_norm` (`≤ 0`: no clipping), by the deterministic
/// two-pass reduction through `partials` (at least `ceil(n / chunk_len)` elements).
pub fn grad_norm(
    values: &[f32],
    chunk_len: usize,
    partials: &mut [f32],
    max_norm: f32,
) -> (f32, f32) {
    let chunks = values.len().div_ceil(chunk_len);
    assert!(
        chunk_len > 0 && partials.len() >= chunks,
        "grad_norm: partials too short"
    );
    for chunk in 0..chunks {
        // SAFETY: sizes checked above.
        unsafe {
            reduce::sum_squares_partials(
                values.as_ptr(),
                values.len(),
                chunk_len,
                partials.as_mut_ptr(),
                chunk,
            )
        };
    }
    let (mut norm, mut scale) = (0.0, 0.0);
    // SAFETY: `partials` holds `chunks` elements; the outputs are locals.
    unsafe { reduce::finish_grad_norm(partials.as_ptr(), chunks, max_norm, &mut norm, &mut scale) };
    (norm, scale)
}
}

launcher! {
/// One fused AdamW pass over all parameters; a no-op when `grad_norm` is not finite.
#[allow(clippy::too_many_arguments)]
pub fn adamw_update(
    params: &mut [f32],
    grads: &[f32],
    exp_avg: &mut [f32],
    exp_avg_sq: &mut [f32],
    grad_norm: f32,
    clip_scale: f32,
    hyper: AdamWStep,
) {
    let n = params.len();
    assert!(
        grads.len() == n && exp_avg.len() == n && exp_avg_sq.len() == n,
        "adamw_update: buffer sizes"
    );
    for chunk in 0..n.div_ceil(HOST_CHUNK) {
        // SAFETY: sizes checked above; the three mutable buffers are distinct unique borrows.
        unsafe {
            adamw::adamw_update(
                params.as_mut_ptr(),
                grads.as_ptr(),
                exp_avg.as_mut_ptr(),
                exp_avg_sq.as_mut_ptr(),
                &grad_norm,
                &clip_scale,
                hyper,
                n,
                HOST_CHUNK,
                chunk,
            )
        };
    }
}
}

/// Advances AdamW's device state `[steps, β1^steps, β2^steps]` and writes the step's scalars (seven floats in
/// [`AdamWStep`] order) when `grad_norm` is finite; a skipped step changes nothing.
pub fn adamw_advance(grad_norm: f32, hyper: [f32; 5], state: &mut [f64], step: &mut [f32]) {
    assert!(
        state.len() == 3 && step.len() == size_of::<AdamWStep>() / size_of::<f32>(),
        "adamw_advance: buffer sizes"
    );
    let [lr, beta1, beta2, eps, weight_decay] = hyper;
    let mut scalars = adamw_step_from_floats(step);
    // SAFETY: `state` holds three elements (checked above); `scalars` is a local.
    unsafe {
        adamw::adamw_advance(
            &grad_norm,
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            state.as_mut_ptr(),
            &mut scalars,
        )
    };
    step.copy_from_slice(&[
        scalars.lr,
        scalars.beta1,
        scalars.beta2,
        scalars.eps,
        scalars.weight_decay,
        scalars.step_size,
        scalars.bias_correction2_sqrt,
    ]);
}

/// The [`AdamWStep`] stored as seven floats in field order (its `repr(C)` layout).
///
/// # Panics
/// When `floats` does not hold seven elements.
pub fn adamw_step_from_floats(floats: &[f32]) -> AdamWStep {
    let &[
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        step_size,
        bias_correction2_sqrt,
    ] = floats
    else {
        panic!("an AdamWStep is seven floats, got {}", floats.len());
    };
    AdamWStep {
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        step_size,
        bias_correction2_sqrt,
    }
}

/// The AdamW scalars of step `step` (1-based, after incrementing), bias corrections computed in f64 as PyTorch
/// does in Python floats.
pub fn adamw_step_scalars(
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    weight_decay: f32,
    step: u64,
) -> AdamWStep {
    let t = step as f64;
    let bc1 = 1.0 - (beta1 as f64).powf(t);
    let bc2 = 1.0 - (beta2 as f64).powf(t);
    AdamWStep {
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        step_size: (lr as f64 / bc1) as f32,
        bias_correction2_sqrt: bc2.sqrt() as f32,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::cell::Cell;

    thread_local! {
        /// Set by a test to make the launchers take their baseline copies on its thread.
        pub(crate) static BASELINE_ONLY: Cell<bool> = const { Cell::new(false) };
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_and_baseline_copies_give_bit_identical_training_steps() {
        use crate::batch::HsBatch;
        use crate::cpu::CpuDrafter;
        use crate::params::FlatState;
        use draftpipe_compiler::plan::{AdamWSpec, BucketPlan, LossSpec, MlpSpec, ModelPlan};
        use rand::rngs::Xoshiro256PlusPlus;
        use rand::{RngExt, SeedableRng};

        if !(std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")) {
            eprintln!("skipped: this CPU has no AVX2 + FMA, so only the baseline copies run");
            return;
        }
        // Odd sizes, so every kernel runs its vector body and its remainder.
        let spec = MlpSpec {
            din: 37,
            hidden: 44,
            blocks: 2,
            intermediate: 75,
            heads: 3,
            vocab: 301,
        };
        let model = ModelPlan::new(spec);
        let (padded_len, sequences) = (29, 5);
        let bucket = BucketPlan {
            padded_len,
            sequences,
            tokens: padded_len * sequences,
            step_flops: 0,
            step_bytes: 0,
        };
        let loss = LossSpec {
            head_decay: 0.8,
            chunk_tokens: 50,
        };
        let optimizer = AdamWSpec {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            clip_grad_norm: Some(0.5),
        };
        let seed = rand::rng().random::<u64>();
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
        let mut batch = HsBatch::zeroed(padded_len, sequences, spec.din);
        for s in 0..sequences {
            let len = rng.random_range(1..=padded_len);
            batch.seq_lens[s] = len as u32;
            for t in s * padded_len..s * padded_len + len {
                batch.input_ids[t] = rng.random_range(0..spec.vocab as u32);
                batch.loss_mask[t] = u8::from(rng.random_range(0..8) != 0);
            }
        }
        batch
            .hs
            .iter_mut()
            .for_each(|v| *v = rng.random_range(-2.0f32..2.0));

        let train = |baseline: bool| {
            BASELINE_ONLY.with(|only| only.set(baseline));
            let mut drafter =
                CpuDrafter::new(&model, loss, optimizer, std::slice::from_ref(&bucket));
            let mut state = FlatState::init(&model, seed);
            let mut trace = Vec::new();
            for _ in 0..3 {
                let out = drafter.forward_backward(&mut state, &batch).unwrap();
                let report = drafter.optimizer_step(&mut state);
                trace.push((out.loss.to_bits(), report.grad_norm.to_bits()));
                trace.extend(state.grads.iter().map(|g| (g.to_bits(), 0)));
            }
            BASELINE_ONLY.with(|only| only.set(false));
            let bits = |values: &[f32]| values.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            (trace, bits(&state.params), bits(&state.exp_avg_sq))
        };
        let (wide, baseline) = (train(false), train(true));
        assert!(
            wide == baseline,
            "AVX2 and baseline steps differ (seed {seed})"
        );
    }
}
