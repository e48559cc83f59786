//! Hidden states held in 16 bits, on every backend present (`test_device!`): a drafter built for bf16 (f16)
//! batches at `bf16` precision keeps them so in its input slots (the CPU widens tiles of rows for its products;
//! CUDA multiplies them as 16-bit GEMM inputs against a `round_to_half` copy of the other operand, f32
//! accumulation) and matches the CPU's f32 step on the same values: every gradient after one step, the
//! parameter updates after twenty, and every loss.
//!
//! Tolerances (relative L2 norm of the difference; the bf16 row of `backend_step.rs`, whose products round both
//! operands to bf16 as these do): gradients 3e-2 per tensor, twenty-step updates 5e-2, losses 3e-2. f16 hidden
//! states are held to the same bounds: their products round the other operand to f16, finer than bf16 for the
//! magnitudes here (the CPU emulation rounds both to bf16).

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
        assert_eq!(
            drafter.model().input_hs_dtype(),
            dtype,
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
