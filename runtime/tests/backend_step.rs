//! The `mlp` step on every backend present, through `test_device!`: gradients against central finite differences
//! of an independent f64 reference, RMSNorm's epsilon pinned inside the square root, the loss falling on a
//! learnable task, allocations equal to the compiled workspace layout, a skipped step leaving AdamW's step count
//! alone, and every backend and precision against the CPU's f32 step: gradients after one step and parameters
//! after twenty, not only losses.
//!
//! Tolerances, per precision (relative L2 norm of the difference, per tensor for gradients, over all parameters
//! for the twenty-step updates; measured on the CPU with emulated rounding, stated with a margin):
//!
//! | precision | gradient vs f64 FD (of the largest) | gradients vs CPU f32 | 20-step updates vs CPU f32 |
//! | --- | --- | --- | --- |
//! | f32 (CPU)  | 1e-4 | 0 (bit-identical) | 0 (bit-identical) |
//! | f32 (CUDA) | 1e-3 (the device's `ex2.approx`) | 1e-3 | 1e-2 |
//! | tf32       | 5e-3 (CPU: 7.6e-4) | 5e-3 | 1e-2 (CPU: 3.1e-4) |
//! | bf16       | 3e-2 (CPU: 1.1e-2) | 3e-2 | 5e-2 (CPU: 9.4e-3) |

mod backends;
mod cpu_step_support;

use backends::{TestDevice, relative_l2, train};
use cpu_step_support::*;
use draftpipe_compiler::plan::{
    AdamWSpec, BackendKind, Device, HsDtype, LrSchedule, MlpSpec, Precision, WorkspaceLayout,
};
use draftpipe_runtime::backend::Backend;
use draftpipe_runtime::batch::HsBatch;
use draftpipe_runtime::params::FlatState;
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

const PRECISIONS: [Precision; 3] = [Precision::F32, Precision::Tf32, Precision::Bf16];

/// The stated tolerances (module docs): (gradient vs f64 FD, gradients vs CPU f32, 20-step updates vs CPU f32).
fn tolerances<D: TestDevice>(precision: Precision) -> (f64, f64, f64) {
    match (D::NAME, precision) {
        ("cpu", Precision::F32) => (1e-4, 0.0, 0.0),
        (_, Precision::F32) => (1e-3, 1e-3, 1e-2),
        (_, Precision::Tf32) => (5e-3, 5e-3, 1e-2),
        (_, Precision::Bf16) => (3e-2, 3e-2, 5e-2),
    }
}

const FD_SPEC: MlpSpec = MlpSpec {
    din: 6,
    hidden: 4,
    blocks: 2,
    intermediate: 5,
    heads: 3,
    vocab: 7,
};

fn gradients_match_finite_differences<D: TestDevice>(device: &D) {
    let model = model(FD_SPEC);
    let decay = 0.8;
    for precision in PRECISIONS {
        let (tolerance, _, _) = tolerances::<D>(precision);
        for seed in 0..3u64 {
            let mut rng = Xoshiro256PlusPlus::seed_from_u64(100 + seed);
            let batch = random_batch(&mut rng, 6, 3, FD_SPEC.din, FD_SPEC.vocab);
            let mut init = FlatState::init(&model, seed);
            // Norm weights away from 1 so their gradients are exercised off the identity.
            for (k, p) in init.params.iter_mut().enumerate() {
                *p *= 1.0 + 0.3 * ((k % 7) as f32 / 7.0);
            }
            init.grads.fill(f32::NAN);
            // Chunks of 4 tokens over 18 tokens: the last chunk is partial.
            let mut drafter = device.drafter(
                &model,
                (loss(decay, 4), adamw(1e-3), precision),
                &[bucket(6, 3)],
            );
            let (losses, state) = train(&mut drafter, &init, std::slice::from_ref(&batch));
            let grads = &state.grads;
            // A NaN would pass a `max` of errors unnoticed: every gradient must be finite first.
            if let Some(k) = grads.iter().position(|g| !g.is_finite()) {
                panic!("{precision:?} seed {seed}: gradient {k} is {}", grads[k]);
            }
            let params64: Vec<f64> = init.params.iter().map(|&p| f64::from(p)).collect();
            let reference = reference_loss(&FD_SPEC, &params64, &batch, f64::from(decay));
            let loss_error = ((f64::from(losses[0]) - reference) / reference).abs();
            assert!(
                loss_error < tolerance,
                "{precision:?} seed {seed}: loss {} vs f64 {reference}",
                losses[0]
            );
            let (mut worst, mut scale) = (0.0f64, 0.0f64);
            let step = 1e-5;
            for k in 0..params64.len() {
                let mut shifted = params64.clone();
                shifted[k] += step;
                let up = reference_loss(&FD_SPEC, &shifted, &batch, f64::from(decay));
                shifted[k] -= 2.0 * step;
                let down = reference_loss(&FD_SPEC, &shifted, &batch, f64::from(decay));
                let fd = (up - down) / (2.0 * step);
                worst = worst.max((f64::from(grads[k]) - fd).abs());
                scale = scale.max(fd.abs());
            }
            println!(
                "{} {precision:?} seed {seed}: worst gradient error / largest gradient {:.2e}",
                D::NAME,
                worst / scale
            );
            assert!(
                worst / scale < tolerance,
                "{precision:?} seed {seed}: worst gradient error {worst} at scale {scale}"
            );
        }
    }
}
test_device!(gradients_match_finite_differences);

/// RMSNorm forward and input gradient against f64 where the epsilon decides the result: rows of magnitude
/// 1e-4 with the model's 1e-6 (`mean(x²) ≈ 3e-9`, so `sqrt(ms + eps)` and `sqrt(ms) + eps` differ 17×), and
/// unit rows with epsilon 0.5. Moving the epsilon outside the square root fails both.
fn small_rows_and_a_large_epsilon_pin_rmsnorm_epsilon<D: TestDevice>(device: &D) {
    let (rows, cols) = (5, 16);
    let layout = WorkspaceLayout::mlp(
        &FD_SPEC,
        &[bucket(6, 3)],
        &loss(0.8, 4),
        match D::NAME {
            "cpu" => BackendKind::Cpu,
            _ => BackendKind::Cuda,
        },
        Precision::F32,
    )
    .expect("layout");
    let mut be = device.backend(&layout);
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(rand::random());
    for (magnitude, eps) in [(1e-4f32, 1e-6f32), (1.0, 0.5)] {
        let x: Vec<f32> = (0..rows * cols)
            .map(|_| magnitude * rng.random_range(-1.0f32..1.0))
            .collect();
        let w: Vec<f32> = (0..cols).map(|_| rng.random_range(0.5f32..1.5)).collect();
        let dy: Vec<f32> = (0..rows * cols)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let mut bx = be.alloc::<f32>(x.len()).unwrap();
        let mut bw = be.alloc::<f32>(cols).unwrap();
        let mut bdy = be.alloc::<f32>(dy.len()).unwrap();
        let mut by = be.alloc::<f32>(x.len()).unwrap();
        let mut binv = be.alloc::<f32>(rows).unwrap();
        let mut bdx = be.alloc::<f32>(x.len()).unwrap();
        be.upload(bx.all_mut(), &x).unwrap();
        be.upload(bw.all_mut(), &w).unwrap();
        be.upload(bdy.all_mut(), &dy).unwrap();
        be.fill(by.all_mut(), f32::NAN).unwrap();
        be.fill(bdx.all_mut(), f32::NAN).unwrap();
        be.rmsnorm_forward(bx.all(), bw.all(), by.all_mut(), binv.all_mut(), eps)
            .unwrap();
        be.rmsnorm_backward_input(
            bx.all(),
            bw.all(),
            binv.all(),
            bdy.all(),
            bdx.all_mut(),
            false,
        )
        .unwrap();
        let (mut y, mut dx) = (vec![0.0f32; x.len()], vec![0.0f32; x.len()]);
        be.download(by.all(), &mut y).unwrap();
        be.download(bdx.all(), &mut dx).unwrap();
        for r in 0..rows {
            let xr: Vec<f64> = x[r * cols..][..cols]
                .iter()
                .map(|&v| f64::from(v))
                .collect();
            let ms = xr.iter().map(|v| v * v).sum::<f64>() / cols as f64;
            let inv = 1.0 / (ms + f64::from(eps)).sqrt();
            let dot: f64 = (0..cols)
                .map(|c| f64::from(dy[r * cols + c]) * f64::from(w[c]) * xr[c])
                .sum();
            for c in 0..cols {
                let want_y = xr[c] * inv * f64::from(w[c]);
                let want_dx = inv * f64::from(w[c]) * f64::from(dy[r * cols + c])
                    - inv.powi(3) * xr[c] * dot / cols as f64;
                let (got_y, got_dx) = (f64::from(y[r * cols + c]), f64::from(dx[r * cols + c]));
                assert!(
                    (got_y - want_y).abs() <= 1e-5 * want_y.abs() + 1e-7 * magnitude as f64,
                    "eps {eps} row {r} col {c}: y {got_y} vs f64 {want_y}"
                );
                assert!(
                    (got_dx - want_dx).abs() <= 1e-4 * want_dx.abs().max(inv * 1e-3),
                    "eps {eps} row {r} col {c}: dx {got_dx} vs f64 {want_dx}"
                );
            }
        }
    }
}
test_device!(small_rows_and_a_large_epsilon_pin_rmsnorm_epsilon);

const TASK_SPEC: MlpSpec = MlpSpec {
    din: 32,
    hidden: 32,
    blocks: 1,
    intermediate: 64,
    heads: 2,
    vocab: 16,
};

/// Each token's hidden state is a fixed random embedding of the tokens the heads must predict plus noise, so a
/// drafter that trains correctly drives the loss far below `ln V`.
fn learnable_batches(seed: u64, count: usize) -> Vec<HsBatch> {
    let (padded_len, sequences, din) = (16, 8, TASK_SPEC.din);
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let embeddings: Vec<Vec<f32>> = (0..TASK_SPEC.heads)
        .map(|_| {
            (0..TASK_SPEC.vocab * din)
                .map(|_| rng.random_range(-1.0f32..1.0))
                .collect()
        })
        .collect();
    (0..count)
        .map(|_| {
            let mut batch = HsBatch::zeroed(padded_len, sequences, din);
            for s in 0..sequences {
                let len = rng.random_range(padded_len / 2..=padded_len);
                batch.seq_lens[s] = len as u32;
                let base = s * padded_len;
                for p in 0..len {
                    batch.input_ids[base + p] = rng.random_range(0..TASK_SPEC.vocab as u32);
                    batch.loss_mask[base + p] = 1;
                }
                for p in 0..len {
                    for (j, embedding) in embeddings.iter().enumerate() {
                        if p + j + 1 < len {
                            let id = batch.input_ids[base + p + j + 1] as usize;
                            let hs = batch.hs.as_f32_mut().expect("an f32 batch");
                            hs[(base + p) * din..][..din]
                                .iter_mut()
                                .zip(&embedding[id * din..][..din])
                                .for_each(|(h, e)| *h += e);
                        }
                    }
                    let hs = batch.hs.as_f32_mut().expect("an f32 batch");
                    hs[(base + p) * din..][..din]
                        .iter_mut()
                        .for_each(|h| *h += 0.1 * rng.random_range(-1.0f32..1.0));
                }
            }
            batch
        })
        .collect()
}

fn task_adamw(lr: f32) -> AdamWSpec {
    AdamWSpec {
        lr,
        beta1: 0.9,
        beta2: 0.99,
        eps: 1e-8,
        weight_decay: 0.0,
        clip_grad_norm: Some(1.0),
        schedule: LrSchedule::CONSTANT,
    }
}

/// Stated margin: over 150 steps (fresh batches every step), the mean loss of the last 10 steps is below 2% of
/// the first step's loss (f32) or 4% (bf16), at every precision.
fn loss_falls_on_a_learnable_task<D: TestDevice>(device: &D) {
    let model = model(TASK_SPEC);
    let batches = learnable_batches(7, 150);
    for precision in PRECISIONS {
        let mut drafter = device.drafter(
            &model,
            (loss(0.8, 64), task_adamw(1e-2), precision),
            &[bucket(16, 8)],
        );
        let (losses, _) = train(&mut drafter, &FlatState::init(&model, 3), &batches);
        let tail = losses[losses.len() - 10..].iter().sum::<f32>() / 10.0;
        let margin = if precision == Precision::Bf16 {
            0.04
        } else {
            0.02
        };
        println!(
            "{} {precision:?}: loss {} → {tail} over {} steps",
            D::NAME,
            losses[0],
            losses.len()
        );
        assert!(
            tail < margin * losses[0],
            "{precision:?}: loss {} → {tail}",
            losses[0]
        );
    }
}
test_device!(loss_falls_on_a_learnable_task);

fn shipped(file: &str) -> draftpipe_compiler::plan::Plan {
    draftpipe_compiler::compile_file(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../pipelines")
            .join(file),
    )
    .expect("shipped pipelines compile")
}

/// A small `dflash` plan (the issue's example dimensions, two buckets) compiled from source.
fn small_dflash() -> draftpipe_compiler::plan::Plan {
    let source = r#"
pipeline "dflash-small"
target t on cpu {
    hidden       = 64
    tap_layers   = [1, 2, 3]
    vocab        = 512
    batch_tokens = 64
    source       = synthetic(seed = 1, lengths = 8..32)
}
queue hs from t to d {
    capacity  = 4
    min_ready = 1
    buckets   = [16, 32]
    pull      = fifo
}
drafter d on cpu {
    model     = dflash(layers = 2, heads = 4, kv_heads = 2, head_dim = 16, intermediate = 128, block = 4, anchors = 8, mask_token = 511, rope_theta = 10000)
    loss      = cross_entropy(position_decay = 7.0, chunk_tokens = 32)
    optimizer = adamw(lr = 1e-3, betas = (0.9, 0.999), eps = 1e-8, weight_decay = 0.0)
    steps     = 3
}
"#;
    draftpipe_compiler::compile_source("dflash-small.pipe", source).expect("compiles")
}

/// What `compile` reports for one worker on `device` (state, frozen target tensors and workspace; the pool is
/// the queue's).
fn compiled_bytes_per_worker(plan: &draftpipe_compiler::plan::Plan, device: Device) -> u64 {
    let workers = plan
        .drafter
        .placement
        .workers
        .iter()
        .filter(|&&d| d == device)
        .count() as u64;
    let memory = plan
        .memory
        .iter()
        .find(|m| m.device == device)
        .expect("memory of the drafter's device");
    (memory.parameters
        + memory.gradients
        + memory.optimizer_state
        + memory.frozen_weights
        + memory.workspaces)
        / workers
}

/// `plan` with bf16 hidden states at `bf16` precision: the CPU's input slots hold them beside its `hs_tile`,
/// CUDA's beside the 16-bit operand copy `gemm_hs_operand`.
fn with_bf16_hidden_states(
    mut plan: draftpipe_compiler::plan::Plan,
) -> draftpipe_compiler::plan::Plan {
    plan.target.hs_dtype = Some(HsDtype::Bf16);
    plan.drafter.precision = Precision::Bf16;
    plan.name.push_str(" (bf16 hidden states)");
    plan
}

/// A drafter allocates exactly what `compile` reports: the quickstart and a small dflash plan on this backend,
/// each also with bf16 hidden states, and the mlp-5x3 pipeline on CUDA (its CPU layout is computed by the same
/// code but not allocated here: ~8 GB).
fn allocation_equals_the_compiled_layout<D: TestDevice>(device: &D) {
    let mut cases = vec![shipped("quickstart.pipe"), small_dflash()];
    cases.extend(cases.clone().into_iter().map(with_bf16_hidden_states));
    if D::NAME == "cuda" {
        cases.push(shipped("mlp-5x3.pipe"));
    }
    for mut plan in cases {
        let kind_device = if D::NAME == "cpu" {
            Device::Cpu
        } else {
            Device::Gpu(0)
        };
        // The plan as if placed on this backend, so `compile`'s memory figure is this backend's layout.
        let workers = plan.drafter.placement.workers.len();
        plan.drafter.placement.workers = vec![kind_device; workers];
        plan.memory = draftpipe_compiler::cost::device_memory(
            &plan.drafter.placement,
            &plan.model.spec,
            &plan.buckets,
            &plan.drafter.loss,
            (plan.drafter.precision, plan.target.hs_dtype_or_widest()),
        )
        .expect("memory plan");
        let stage = &plan.drafter;
        let drafter = device.drafter_for(
            &plan.model,
            (stage.loss, stage.optimizer, stage.precision),
            &plan.buckets,
            plan.target.hs_dtype_or_widest(),
        );
        let layout = plan.workspace_layout(kind_device).expect("layout");
        let allocated = drafter.allocated_bytes();
        println!(
            "{} {}: allocated {allocated} B, layout {} B + state {} B",
            D::NAME,
            plan.name,
            layout.bytes().unwrap(),
            16 * plan.model.parameters
        );
        assert_eq!(
            allocated,
            compiled_bytes_per_worker(&plan, kind_device),
            "{}: allocated vs compiled",
            plan.name
        );
    }
}
test_device!(allocation_equals_the_compiled_layout);

/// A step whose gradients are not finite is skipped on the device: the parameters, the moments and AdamW's
/// step count stay, so the next good step is step 1 with step 1's bias corrections (the host used to assume
/// every launched step was applied).
fn a_skipped_step_leaves_adamw_step_count_alone<D: TestDevice>(device: &D) {
    let model = model(TASK_SPEC);
    let batches = learnable_batches(11, 1);
    let mut poisoned = batches[0].clone();
    poisoned.hs.store_f32(0, &[f32::NAN]);
    let settings = (loss(0.8, 64), task_adamw(1e-2), Precision::F32);
    let init = FlatState::init(&model, 5);
    let mut skipping = device.drafter(&model, settings, &[bucket(16, 8)]);
    let (_, skipped) = train(&mut skipping, &init, std::slice::from_ref(&poisoned));
    assert_eq!(skipped.step, 0, "a skipped step is not counted");
    assert_eq!(
        skipped.params, init.params,
        "a skipped step changes nothing"
    );
    let (_, after) = train(&mut skipping, &skipped, &batches);
    let mut fresh = device.drafter(&model, settings, &[bucket(16, 8)]);
    let (_, direct) = train(&mut fresh, &init, &batches);
    assert_eq!(after.step, 1);
    assert_eq!(
        after.params, direct.params,
        "the step after a skip uses step 1's bias corrections"
    );
}
test_device!(a_skipped_step_leaves_adamw_step_count_alone);

/// Every precision on this backend against the CPU's f32 step from the same weights and batches: the gradients
/// of step 1 per tensor, the parameter updates after 20 steps, and the losses of all 20 (within the tolerances
/// of the module docs; bit-identical for f32 on the CPU).
fn matches_the_cpu_after_one_and_twenty_steps<D: TestDevice>(device: &D) {
    let model = model(TASK_SPEC);
    let batches = learnable_batches(rand::random(), 20);
    let init = FlatState::init(&model, 9);
    let settings = |precision| (loss(0.8, 48), task_adamw(3e-3), precision);
    let reference = |count: usize| {
        train(
            &mut backends::Cpu.drafter(&model, settings(Precision::F32), &[bucket(16, 8)]),
            &init,
            &batches[..count],
        )
    };
    let (_, cpu_first) = reference(1);
    let (cpu_losses, cpu_last) = reference(20);
    for precision in PRECISIONS {
        let (_, grad_tol, param_tol) = tolerances::<D>(precision);
        let mut drafter = device.drafter(&model, settings(precision), &[bucket(16, 8)]);
        let (_, first) = train(&mut drafter, &init, &batches[..1]);
        for view in first.layout() {
            let error = relative_l2(&first.grads[view.range()], &cpu_first.grads[view.range()]);
            assert!(
                error <= grad_tol,
                "{precision:?}: gradient of {} differs by {error:.2e} (relative L2)",
                view.name
            );
        }
        let mut drafter = device.drafter(&model, settings(precision), &[bucket(16, 8)]);
        let (losses, last) = train(&mut drafter, &init, &batches);
        let delta = |state: &FlatState| -> Vec<f32> {
            state
                .params
                .iter()
                .zip(&init.params)
                .map(|(p, q)| p - q)
                .collect()
        };
        let error = relative_l2(&delta(&last), &delta(&cpu_last));
        println!(
            "{} {precision:?}: 20-step update differs by {error:.2e}",
            D::NAME
        );
        assert!(
            error <= param_tol,
            "{precision:?}: 20-step parameter updates differ by {error:.2e} (relative L2)"
        );
        assert_eq!(
            last.step, cpu_last.step,
            "{precision:?}: AdamW steps applied"
        );
        for (i, (&got, &want)) in losses.iter().zip(&cpu_losses).enumerate() {
            assert!(
                f64::from((got - want).abs()) <= grad_tol * f64::from(want.abs()),
                "{precision:?} step {i}: loss {got} vs cpu f32 {want}"
            );
        }
    }
}
test_device!(matches_the_cpu_after_one_and_twenty_steps);

#[test]
fn tf32_on_a_cpu_drafter_is_refused_at_compile_time() {
    let source = r#"
pipeline "t"
target t on cpu { hidden = 8  tap_layers = [0]  vocab = 16  batch_tokens = 32  source = synthetic(seed = 1, lengths = 2..8) }
queue q from t to d { capacity = 2  buckets = [8] }
drafter d on cpu { model = mlp(hidden = 8, blocks = 1, intermediate = 8, heads = 1)  precision = tf32 }
"#;
    let errors = draftpipe_compiler::compile_source("t.pipe", source).unwrap_err();
    let text = errors.to_string();
    assert!(text.contains("t.pipe:5:"), "{text}");
    assert!(text.contains("needs GPU tensor cores"), "{text}");
    let ok = source.replace("tf32", "bf16");
    let plan =
        draftpipe_compiler::compile_source("t.pipe", &ok).expect("bf16 is emulated on the cpu");
    assert_eq!(plan.drafter.precision, Precision::Bf16);
    let default = source.replace("  precision = tf32", "");
    let plan = draftpipe_compiler::compile_source("t.pipe", &default).unwrap();
    assert_eq!(plan.drafter.precision, Precision::F32, "the cpu default");
}
