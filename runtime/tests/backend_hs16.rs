//! Hidden states held in 16 bits, on every backend present (`test_device!`): a drafter built for bf16 (f16)
//! batches at `bf16` precision keeps them so in its input slots (the CPU widens tiles of rows for its products;
//! CUDA multiplies them as 16-bit GEMM inputs against a `round_to_half` copy of the other operand, f32
//! accumulation) and matches the CPU's f32 step on the same values: every gradient after one step, the
//! parameter updates after twenty, and every loss.
//!
//! Tolerances (relative L2 norm of the difference; the bf16 row of `backend_step.rs`, whose products round both
//! operands to bf16 as these do): gradients 3e-2 per tensor, twenty-step updates 5e-2, losses 3e-2. f16 hidden
//! states are held to the same bounds: on CUDA they are held in bf16 slots (an f16 copy of the upstream gradient
//! would underflow; `the_fc_weight_gradient_of_f16_hidden_states_keeps_gradients_near_1e_7`), and the CPU's
//! tiles round both operands to bf16, the same points.

mod backends;
mod cpu_step_support;

use backends::{TestDevice, relative_l2, train};
use cpu_step_support::*;
use draftpipe_compiler::plan::{HsDtype, MlpSpec, Precision};
use draftpipe_runtime::batch::HsBatch;
use draftpipe_runtime::params::FlatState;
use rand::SeedableRng;
use rand::rngs::Xoshiro256PlusPlus;

const SPEC: MlpSpec = MlpSpec {
    din: 24,
    hidden: 16,
    blocks: 1,
    intermediate: 20,
    heads: 2,
    vocab: 29,
};

const GRADIENT_TOLERANCE: f64 = 3e-2;
const UPDATE_TOLERANCE: f64 = 5e-2;

/// `batch` with its hidden states held in `dtype` (each value rounded to nearest even).
fn held_in(batch: &HsBatch, dtype: HsDtype) -> HsBatch {
    let mut held = HsBatch::zeroed_in(dtype, batch.padded_len, batch.sequences, batch.din);
    held.hs
        .store_f32(0, &batch.hs.to_f32_vec(0..batch.hs.len()));
    held.input_ids.clone_from(&batch.input_ids);
    held.seq_lens.clone_from(&batch.seq_lens);
    held.loss_mask.clone_from(&batch.loss_mask);
    held
}

fn hs16_steps_match_the_cpu_f32_step<D: TestDevice>(device: &D) {
    let model = model(SPEC);
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(rand::random());
    let (padded_len, sequences) = (16, 4);
    let buckets = [bucket(padded_len, sequences)];
    let random: Vec<HsBatch> = (0..20)
        .map(|_| random_batch(&mut rng, padded_len, sequences, SPEC.din, SPEC.vocab))
        .collect();
    let init = FlatState::init(&model, 3);
    let settings = |precision| (loss(0.8, 24), adamw(3e-3), precision);
    for dtype in [HsDtype::Bf16, HsDtype::F16] {
        let narrow: Vec<HsBatch> = random.iter().map(|b| held_in(b, dtype)).collect();
        // The reference reads the same values as f32 and multiplies in f32.
        let wide: Vec<HsBatch> = narrow.iter().map(|b| held_in(b, HsDtype::F32)).collect();
        let reference = |count: usize| {
            train(
                &mut backends::Cpu.drafter(&model, settings(Precision::F32), &buckets),
                &init,
                &wide[..count],
            )
        };
        let (_, cpu_first) = reference(1);
        let (cpu_losses, cpu_last) = reference(20);

        let fresh = || device.drafter_for(&model, settings(Precision::Bf16), &buckets, dtype);
        let mut drafter = fresh();
        // CUDA's products read f16 batches as bf16 (the slots hold them so); everything else as they arrive.
        let held = if D::NAME == "cuda" && dtype == HsDtype::F16 {
            HsDtype::Bf16
        } else {
            dtype
        };
        assert_eq!(
            drafter.model().input_hs_dtype(),
            held,
            "{}: the input slots hold the batch's precision",
            D::NAME
        );
        let (_, first) = train(&mut drafter, &init, &narrow[..1]);
        for view in first.layout() {
            let error = relative_l2(&first.grads[view.range()], &cpu_first.grads[view.range()]);
            assert!(
                error <= GRADIENT_TOLERANCE,
                "{dtype:?}: gradient of {} differs by {error:.2e} (relative L2)",
                view.name
            );
        }
        let (losses, last) = train(&mut fresh(), &init, &narrow);
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
            "{} {dtype:?} hidden states: 20-step update differs by {error:.2e}",
            D::NAME
        );
        assert!(
            error <= UPDATE_TOLERANCE,
            "{dtype:?}: 20-step parameter updates differ by {error:.2e} (relative L2)"
        );
        for (i, (&got, &want)) in losses.iter().zip(&cpu_losses).enumerate() {
            assert!(
                f64::from((got - want).abs()) <= GRADIENT_TOLERANCE * f64::from(want.abs()),
                "{dtype:?} step {i}: loss {got} vs cpu f32 {want}"
            );
        }
    }
}
test_device!(hs16_steps_match_the_cpu_f32_step);

/// At f32 and TF32 the products must not round the f32 operand to 16 bits: a CUDA drafter keeps f32 input
/// slots for bf16 batches (the host widens while staging); the CPU holds the batch's precision at every
/// precision (its tiles widen exactly). Either way the step's loss is the CPU f32 step's on the same values,
/// within `backend_step.rs`'s loss tolerance of the precision (f32: 1e-3, TF32: 5e-3).
fn full_precision_products_keep_what_they_read<D: TestDevice>(device: &D) {
    let model = model(SPEC);
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(rand::random());
    let buckets = [bucket(16, 4)];
    let narrow = held_in(
        &random_batch(&mut rng, 16, 4, SPEC.din, SPEC.vocab),
        HsDtype::Bf16,
    );
    let wide = held_in(&narrow, HsDtype::F32);
    let init = FlatState::init(&model, 5);
    let settings = |precision| (loss(0.8, 24), adamw(3e-3), precision);
    let (reference, _) = train(
        &mut backends::Cpu.drafter(&model, settings(Precision::F32), &buckets),
        &init,
        std::slice::from_ref(&wide),
    );
    for (precision, tolerance) in [(Precision::F32, 1e-3), (Precision::Tf32, 5e-3)] {
        let mut drafter = device.drafter_for(&model, settings(precision), &buckets, HsDtype::Bf16);
        let slots = if D::NAME == "cpu" {
            HsDtype::Bf16
        } else {
            HsDtype::F32
        };
        assert_eq!(drafter.model().input_hs_dtype(), slots, "{precision:?}");
        let (losses, _) = train(&mut drafter, &init, std::slice::from_ref(&narrow));
        assert!(
            f64::from((losses[0] - reference[0]).abs())
                <= tolerance * f64::from(reference[0].abs()),
            "{precision:?}: loss {} vs cpu f32 {}",
            losses[0],
            reference[0]
        );
    }
}
test_device!(full_precision_products_keep_what_they_read);

/// Issue 19, "16-bit gradients": the `fc` weight gradient `dW = dYᵀ · hs` of f16 hidden states, with upstream
/// gradients at the magnitudes of real vocabularies (log-uniform in 1e-8..1e-6, around 1e-7: all below f16's
/// normal range from 6.1e-5, many below its smallest subnormal step of 6e-8), is right to bf16 precision (relative L2 ≤ 1e-2
/// against f64 on the same values) on both backends: the CPU's product, and CUDA's product emulated on the host
/// from its layout (the slot dtype the batch is staged into, the dtype `round_to_half` writes the upstream
/// gradient into, exact products summed as its f32 accumulation). With f16 slots and an f16 operand copy, as
/// the layout had before the fix, the same emulation is off by 5.6e-2 (checked here to exceed the bound), so the
/// test failed then; the CPU and bf16 CUDA measure 2.2e-3.
#[test]
fn the_fc_weight_gradient_of_f16_hidden_states_keeps_gradients_near_1e_7() {
    use draftpipe_compiler::plan::{BackendKind, WorkspaceLayout};
    use draftpipe_compiler::workspace::{Dtype, WorkspaceBuffer};
    use draftpipe_gpu_kernels::convert::{f16_bits_to_f32, f32_to_bf16_bits, f32_to_f16_bits};
    use draftpipe_runtime::backend::cpu::CpuBackend;
    use draftpipe_runtime::backend::{Backend, HsBuf, HsOperand, Operand};
    use half::{bf16, f16};
    use rand::RngExt;

    let (tokens, hidden, din) = (96, 8, 40);
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(19);
    let hs: Vec<f16> = (0..tokens * din)
        .map(|_| f16::from_f32(rng.random_range(-2.0..2.0)))
        .collect();
    let dy: Vec<f32> = (0..tokens * hidden)
        .map(|_| {
            let magnitude = 10f64.powf(rng.random_range(-8.0..-6.0)) as f32;
            if rng.random_bool(0.5) {
                magnitude
            } else {
                -magnitude
            }
        })
        .collect();
    let reference: Vec<f64> = (0..hidden * din)
        .map(|at| {
            let (i, j) = (at / din, at % din);
            (0..tokens)
                .map(|t| f64::from(dy[t * hidden + i]) * f64::from(hs[t * din + j].to_f32()))
                .sum()
        })
        .collect();
    let error = |got: &[f64]| {
        let diff: f64 = got
            .iter()
            .zip(&reference)
            .map(|(a, b)| (a - b).powi(2))
            .sum();
        let norm: f64 = reference.iter().map(|b| b.powi(2)).sum();
        (diff / norm).sqrt()
    };
    let layout = |backend| {
        WorkspaceLayout {
            tokens,
            sequences: 1,
            chunk_rows: tokens,
            input_slots: 1,
            hs_operand_elements: (hidden * din).max(tokens * hidden),
            // The hidden states, and the CPU's buffers for rounding the f32 operand to bf16.
            buffers: [
                ("input0.hs", tokens * din),
                ("gemm_round_a", tokens * hidden),
                ("gemm_round_b", tokens * hidden),
            ]
            .map(|(name, elements)| WorkspaceBuffer {
                name: name.to_owned(),
                dtype: Dtype::F32,
                elements,
            })
            .to_vec(),
        }
        .with_hs_dtype(backend, HsDtype::F16)
        .expect("layout")
    };

    // The CPU backend's product.
    let cpu_layout = layout(BackendKind::Cpu);
    let mut be = CpuBackend::new(&cpu_layout);
    let mut hs_buf = be.alloc::<f16>(tokens * din).unwrap();
    be.upload(hs_buf.all_mut(), &hs).unwrap();
    let hs_buf = HsBuf::F16(hs_buf);
    let mut dy_buf = be.alloc::<f32>(tokens * hidden).unwrap();
    be.upload(dy_buf.all_mut(), &dy).unwrap();
    let mut dw = be.alloc::<f32>(hidden * din).unwrap();
    be.gemm_hs(
        dw.all_mut(),
        Operand::new(dy_buf.all(), tokens, hidden).t().into(),
        HsOperand::new(hs_buf.at(0, tokens * din), tokens, din),
        1.0,
        0.0,
        Precision::Bf16,
    )
    .unwrap();
    let cpu: Vec<f64> = dw.as_slice().iter().map(|&x| f64::from(x)).collect();
    let cpu_error = error(&cpu);

    // CUDA's product, at the points where it rounds.
    let cuda_layout = layout(BackendKind::Cuda);
    let dtype = |name: &str| {
        cuda_layout
            .buffers
            .iter()
            .find(|b| b.name == name)
            .map(|b| b.dtype)
    };
    // Exact products summed in f64 and rounded once, as the f32 accumulation of so short a sum is.
    let emulated = |slot: Option<Dtype>, copy: Option<Dtype>| -> f64 {
        let staged: Vec<f32> = match slot {
            Some(Dtype::F16) => hs.iter().map(|x| x.to_f32()).collect(),
            Some(Dtype::Bf16) => hs
                .iter()
                .map(|x| bf16::from_f32(x.to_f32()).to_f32())
                .collect(),
            other => panic!("CUDA slot of f16 hidden states in {other:?}"),
        };
        let operand: Vec<f32> = match copy {
            Some(Dtype::F16) => dy
                .iter()
                .map(|&x| f16_bits_to_f32(f32_to_f16_bits(x)))
                .collect(),
            Some(Dtype::Bf16) => dy
                .iter()
                .map(|&x| f32::from_bits(u32::from(f32_to_bf16_bits(x)) << 16))
                .collect(),
            other => panic!("CUDA operand copy in {other:?}"),
        };
        let product: Vec<f64> = (0..hidden * din)
            .map(|at| {
                let (i, j) = (at / din, at % din);
                let sum: f64 = (0..tokens)
                    .map(|t| f64::from(operand[t * hidden + i]) * f64::from(staged[t * din + j]))
                    .sum();
                f64::from(sum as f32)
            })
            .collect();
        error(&product)
    };
    let cuda_error = emulated(dtype("input0.hs"), dtype("gemm_hs_operand"));
    // The hazard is real at these magnitudes: f16 slots with an f16 copy (the layout before the fix) lose it.
    let f16_error = emulated(Some(Dtype::F16), Some(Dtype::F16));
    println!(
        "fc weight gradient, relative L2 against f64: cpu {cpu_error:.2e}, cuda {cuda_error:.2e} \
         (with an f16 copy: {f16_error:.2e})"
    );
    assert!(
        f16_error > 1e-2,
        "an f16 copy of the gradient: {f16_error:.2e}"
    );
    assert!(cpu_error <= 1e-2, "cpu: {cpu_error:.2e}");
    assert!(cuda_error <= 1e-2, "cuda (emulated): {cuda_error:.2e}");
}
