//! The bf16 copies CUDA's products read at `bf16` precision, written by the kernels that produce their f32
//! values (AdamW for the trained matrices, RMSNorm and SwiGLU for activations, their backward kernels for the
//! gradients the backward's products read, the head's row gather and the fused loss's logits gradient for the
//! `lm_head` products), through the host launchers that
//! run the same bodies as the PTX: each copy is, bit for bit, the f32 value rounded to nearest even, which is the
//! value the CPU's bf16 emulation rounds the same f32 to inside its products, so the CPU's bf16 tests cover what
//! the GPU reads. The reference rounding is the `half` crate's (`bf16::from_f32`), not ours. The copies start
//! poisoned (a NaN pattern) so an element the kernel skips cannot pass, and the f32 outputs must be exactly those
//! of the kernel without a copy (writing the copy changes nothing else).

use draftpipe_gpu_kernels::adamw::AdamWStep;
use draftpipe_runtime::backend::cpu::kernels::launch;
use half::bf16;
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

/// A NaN bit pattern no rounding of a finite value gives.
const POISON: u16 = 0x7FC1;

fn uniform(rng: &mut Xoshiro256PlusPlus, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(lo..hi)).collect()
}

/// The first index where `copy` is not `values` rounded to nearest even, with both bit patterns.
fn first_mismatch(values: &[f32], copy: &[u16]) -> Option<String> {
    assert_eq!(values.len(), copy.len());
    values
        .iter()
        .zip(copy)
        .enumerate()
        .find(|(_, (v, c))| bf16::from_f32(**v).to_bits() != **c)
        .map(|(i, (v, c))| {
            format!(
                "element {i}: f32 {v:e} ({:#010x}) has copy {c:#06x}, nearest even is {:#06x}",
                v.to_bits(),
                bf16::from_f32(*v).to_bits()
            )
        })
}

/// How many of `values` round differently to nearest even than by truncation: the test's inputs must hold
/// many, or a copy that truncates would pass.
fn rounding_matters(values: &[f32]) -> usize {
    values
        .iter()
        .filter(|v| bf16::from_f32(**v).to_bits() != (v.to_bits() >> 16) as u16)
        .count()
}

fn hyper(lr: f32) -> AdamWStep {
    AdamWStep {
        lr,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        step_size: lr / (1.0 - 0.9),
        bias_correction2_sqrt: (1.0f32 - 0.999).sqrt(),
    }
}

#[test]
fn adamw_writes_the_nearest_even_bf16_of_every_updated_parameter() {
    let seed = rand::random();
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    // Not a multiple of the host chunk, so the last chunk is partial.
    let n = 10_007;
    let params = uniform(&mut rng, n, -0.5, 0.5);
    let grads = uniform(&mut rng, n, -1.0, 1.0);
    let m0 = uniform(&mut rng, n, -0.1, 0.1);
    let v0 = uniform(&mut rng, n, 0.0, 0.01);
    let step = hyper(3e-3);

    let (mut p_ref, mut m_ref, mut v_ref) = (params.clone(), m0.clone(), v0.clone());
    launch::adamw_update(
        &grads,
        &[1.5],
        &[0.75],
        &[step],
        &mut p_ref,
        &mut m_ref,
        &mut v_ref,
        n,
    );
    let (mut p, mut m, mut v, mut copy) = (params.clone(), m0, v0, vec![POISON; n]);
    launch::adamw_update_bf16(
        &grads,
        &[1.5],
        &[0.75],
        &[step],
        &mut p,
        &mut copy,
        &mut m,
        &mut v,
        n,
    );
    assert!(p != params, "seed {seed}: the step changed no parameter");
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&p), bits(&p_ref), "seed {seed}: masters differ");
    assert_eq!(bits(&m), bits(&m_ref), "seed {seed}: first moments differ");
    assert_eq!(bits(&v), bits(&v_ref), "seed {seed}: second moments differ");
    assert!(
        rounding_matters(&p) > n / 4,
        "seed {seed}: too few parameters tell rounding from truncation"
    );
    if let Some(error) = first_mismatch(&p, &copy) {
        panic!("seed {seed}: {error}");
    }

    // A skipped step (non-finite norm) leaves master and copy as they were: still the master's rounding.
    let (before, copy_before) = (p.clone(), copy.clone());
    let (mut m2, mut v2) = (m.clone(), v.clone());
    launch::adamw_update_bf16(
        &grads,
        &[f32::NAN],
        &[1.0],
        &[step],
        &mut p,
        &mut copy,
        &mut m2,
        &mut v2,
        n,
    );
    assert_eq!(bits(&p), bits(&before));
    assert_eq!(copy, copy_before);
}

#[test]
fn rmsnorm_and_swiglu_write_the_nearest_even_bf16_of_their_outputs() {
    let seed = rand::random();
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    // Rows of 19 and 300 columns: shorter than a plane's 32 lanes, and nine full lane rounds plus a partial one.
    for (rows, cols) in [(13, 19), (7, 300)] {
        let x = uniform(&mut rng, rows * cols, -2.0, 2.0);
        let w = uniform(&mut rng, cols, 0.5, 1.5);
        let (mut y_ref, mut inv_ref) = (vec![f32::NAN; rows * cols], vec![f32::NAN; rows]);
        launch::rmsnorm_forward(&x, &w, &mut y_ref, &mut inv_ref, cols, 1e-6, rows);
        let (mut y, mut y16, mut inv) = (
            vec![f32::NAN; rows * cols],
            vec![POISON; rows * cols],
            vec![f32::NAN; rows],
        );
        launch::rmsnorm_forward_bf16(&x, &w, &mut y, &mut y16, &mut inv, cols, 1e-6, rows);
        assert_eq!(y, y_ref, "seed {seed}: rmsnorm's f32 output changed");
        assert_eq!(inv, inv_ref, "seed {seed}: rmsnorm's inv_rms changed");
        assert!(rounding_matters(&y) > y.len() / 4, "seed {seed}");
        if let Some(error) = first_mismatch(&y, &y16) {
            panic!("seed {seed}: rmsnorm {rows}×{cols}: {error}");
        }
    }
    // 11 rows of 37: rows straddle the host chunks.
    let (rows, inter) = (11, 37);
    let n = rows * inter;
    let gate_up = uniform(&mut rng, 2 * n, -3.0, 3.0);
    let mut act_ref = vec![f32::NAN; n];
    launch::swiglu_forward(&gate_up, &mut act_ref, inter, n);
    let (mut act, mut act16) = (vec![f32::NAN; n], vec![POISON; n]);
    launch::swiglu_forward_bf16(&gate_up, &mut act, &mut act16, inter, n);
    assert_eq!(act, act_ref, "seed {seed}: swiglu's f32 output changed");
    assert!(rounding_matters(&act) > n / 4, "seed {seed}");
    if let Some(error) = first_mismatch(&act, &act16) {
        panic!("seed {seed}: swiglu: {error}");
    }
}

#[test]
fn rmsnorm_backward_writes_the_nearest_even_bf16_of_its_input_gradient() {
    let seed = rand::random();
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    // Written (the q/k norms, hidden_norm, the final norm) and added to a residual's gradient (the layers'
    // norms, where the copy is of the sum); rows shorter than a plane and with a ragged last lane round.
    for (rows, cols, accumulate) in [(13, 19, 0), (7, 300, 0), (13, 19, 1), (7, 300, 1)] {
        let n = rows * cols;
        let x = uniform(&mut rng, n, -2.0, 2.0);
        let w = uniform(&mut rng, cols, 0.5, 1.5);
        let inv = uniform(&mut rng, rows, 0.5, 2.0);
        // Gradients of the magnitudes the step's have (a loss averaged over thousands of rows).
        let dy = uniform(&mut rng, n, -1e-3, 1e-3);
        let dx0 = if accumulate == 1 {
            uniform(&mut rng, n, -1e-3, 1e-3)
        } else {
            vec![f32::NAN; n]
        };
        let mut dx_ref = dx0.clone();
        launch::rmsnorm_backward_input(&x, &w, &inv, &dy, &mut dx_ref, cols, accumulate, rows);
        let (mut dx, mut dx16) = (dx0, vec![POISON; n]);
        launch::rmsnorm_backward_input_bf16(
            &x, &w, &inv, &dy, &mut dx, &mut dx16, cols, accumulate, rows,
        );
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&dx),
            bits(&dx_ref),
            "seed {seed}: the norm's f32 input gradient changed ({rows}×{cols}, accumulate {accumulate})"
        );
        assert!(dx.iter().all(|v| v.is_finite()), "seed {seed}");
        assert!(rounding_matters(&dx) > n / 4, "seed {seed}");
        if let Some(error) = first_mismatch(&dx, &dx16) {
            panic!("seed {seed}: rmsnorm backward {rows}×{cols}, accumulate {accumulate}: {error}");
        }
    }
}

#[test]
fn swiglu_backward_writes_the_nearest_even_bf16_of_both_input_gradients() {
    let seed = rand::random();
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    // 11 rows of 37: rows straddle the host chunks; both halves of each `[dgate | dup]` row get a copy.
    let (rows, inter) = (11, 37);
    let n = rows * inter;
    let gate_up = uniform(&mut rng, 2 * n, -3.0, 3.0);
    let dact = uniform(&mut rng, n, -1e-3, 1e-3);
    let mut dgu_ref = vec![f32::NAN; 2 * n];
    launch::swiglu_backward(&gate_up, &dact, &mut dgu_ref, inter, n);
    let (mut dgu, mut dgu16) = (vec![f32::NAN; 2 * n], vec![POISON; 2 * n]);
    launch::swiglu_backward_bf16(&gate_up, &dact, &mut dgu, &mut dgu16, inter, n);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&dgu),
        bits(&dgu_ref),
        "seed {seed}: swiglu's f32 gradients changed"
    );
    assert!(dgu.iter().all(|v| v.is_finite()), "seed {seed}");
    assert!(rounding_matters(&dgu) > n / 2, "seed {seed}");
    if let Some(error) = first_mismatch(&dgu, &dgu16) {
        panic!("seed {seed}: swiglu backward: {error}");
    }
}

#[test]
fn round_to_half_gives_the_copy_of_weights_at_load() {
    // The copy written when parameters are uploaded (initial weights, a resumed checkpoint) and of the attention
    // output: the same rounding as AdamW's, so the first step reads what every later one would.
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(7);
    let x = uniform(&mut rng, 4099, -1.0, 1.0);
    let mut out = vec![POISON; x.len()];
    launch::round_to_half(
        &x,
        &mut out,
        x.len(),
        draftpipe_gpu_kernels::convert::FORMAT_BF16,
    );
    assert_eq!(first_mismatch(&x, &out), None);
}

#[test]
fn the_head_gathers_its_rows_and_the_loss_writes_its_gradient_in_nearest_even_bf16() {
    let seed = rand::random();
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    // The head rows: whole rows of the final-norm output gathered by index (a row twice, the last row).
    let (rows, hidden, ids) = (9usize, 37usize, [4u32, 0, 8, 4, 2]);
    let z = uniform(&mut rng, rows * hidden, -3.0, 3.0);
    let n = ids.len() * hidden;
    let mut wide = vec![f32::NAN; n];
    launch::embedding_gather(&z, &ids, &mut wide, rows, hidden, n);
    let mut copy = vec![POISON; n];
    launch::embedding_gather_bf16(&z, &ids, &mut copy, rows, hidden, n);
    assert!(rounding_matters(&wide) > n / 4, "seed {seed}");
    if let Some(error) = first_mismatch(&wide, &copy) {
        panic!("seed {seed}: head row gather: {error}");
    }

    // The fused loss: the f32 gradient, losses and hits exactly those of the kernel without a copy, the copy
    // the gradient's rounding (an unlabelled row's zeros included); vocabularies below and past 32 lanes.
    for vocab in [19usize, 333] {
        let loss_rows = 4;
        let logits = uniform(&mut rng, loss_rows * vocab, -6.0, 6.0);
        let labels = [3i32, -1, (vocab - 1) as i32, 0];
        let weights = [0.5f32, 1.0, 0.25, 2.0];
        let norm = [1.0f32 / 2.75];
        let (mut g_ref, mut loss_ref, mut hit_ref) = (
            logits.clone(),
            vec![f32::NAN; loss_rows],
            vec![f32::NAN; loss_rows],
        );
        launch::weighted_vocab_loss_row(
            &labels,
            &weights,
            &norm,
            &mut g_ref,
            &mut loss_ref,
            &mut hit_ref,
            vocab,
            loss_rows,
        );
        let (mut g, mut g16, mut row_loss, mut hit) = (
            logits.clone(),
            vec![POISON; loss_rows * vocab],
            vec![f32::NAN; loss_rows],
            vec![f32::NAN; loss_rows],
        );
        launch::weighted_vocab_loss_row_bf16(
            &labels,
            &weights,
            &norm,
            &mut g,
            &mut g16,
            &mut row_loss,
            &mut hit,
            vocab,
            loss_rows,
        );
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&g),
            bits(&g_ref),
            "seed {seed}: the f32 gradient changed"
        );
        assert_eq!(
            bits(&row_loss),
            bits(&loss_ref),
            "seed {seed}: the losses changed"
        );
        assert_eq!(hit, hit_ref, "seed {seed}: the hits changed");
        assert!(rounding_matters(&g) > g.len() / 4, "seed {seed}");
        if let Some(error) = first_mismatch(&g, &g16) {
            panic!("seed {seed}: fused loss, vocab {vocab}: {error}");
        }
    }
}
