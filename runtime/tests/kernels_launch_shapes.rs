//! The GPU launch shapes on the host: element-range kernels called with `chunk_len = 1` for every index (one
//! element per thread, as the CUDA wrappers launch them) and the norm weight gradient with other row chunkings
//! must give the same results as the host launchers' long chunks — bitwise for elementwise kernels, whose
//! per-element arithmetic does not depend on the chunking.

use draftpipe_gpu_kernels::{activation, adamw, norm};
use draftpipe_runtime::cpu::kernels;
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

fn values(rng: &mut Xoshiro256PlusPlus, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-4.0f32..4.0)).collect()
}

#[test]
fn one_element_per_index_matches_the_host_chunks_bitwise() {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(77);
    let (rows, inter) = (13, 333);
    let n = rows * inter;
    let gate_up = values(&mut rng, 2 * n);
    let dact = values(&mut rng, n);

    let mut act_host = vec![f32::NAN; n];
    kernels::swiglu_forward(&gate_up, &mut act_host, inter);
    let mut dgu_host = vec![f32::NAN; 2 * n];
    kernels::swiglu_backward(&gate_up, &dact, &mut dgu_host, inter);
    let (mut act_gpu, mut dgu_gpu) = (vec![f32::NAN; n], vec![f32::NAN; 2 * n]);
    for index in 0..n {
        // SAFETY: buffers sized for `rows × inter`; `index < n`.
        unsafe {
            activation::swiglu_forward(gate_up.as_ptr(), act_gpu.as_mut_ptr(), inter, n, 1, index);
            activation::swiglu_backward(
                gate_up.as_ptr(),
                dact.as_ptr(),
                dgu_gpu.as_mut_ptr(),
                inter,
                n,
                1,
                index,
            );
        }
    }
    assert_eq!(act_host, act_gpu);
    assert_eq!(dgu_host, dgu_gpu);

    let (z, a, dh) = (
        values(&mut rng, n),
        values(&mut rng, n),
        values(&mut rng, n),
    );
    let (mut h_host, mut h_gpu) = (vec![f32::NAN; n], vec![f32::NAN; n]);
    kernels::head_residual_forward(&z, &a, &mut h_host);
    let (mut da_host, mut dz_host) = (vec![f32::NAN; n], z.clone());
    kernels::head_residual_backward(&a, &dh, &mut da_host, &mut dz_host);
    let (mut da_gpu, mut dz_gpu) = (vec![f32::NAN; n], z.clone());
    for index in 0..n {
        // SAFETY: all buffers hold `n` elements; `index < n`.
        unsafe {
            activation::head_residual_forward(
                z.as_ptr(),
                a.as_ptr(),
                h_gpu.as_mut_ptr(),
                n,
                1,
                index,
            );
            activation::head_residual_backward(
                a.as_ptr(),
                dh.as_ptr(),
                da_gpu.as_mut_ptr(),
                dz_gpu.as_mut_ptr(),
                n,
                1,
                index,
            );
        }
    }
    assert_eq!(h_host, h_gpu);
    assert_eq!(da_host, da_gpu);
    assert_eq!(dz_host, dz_gpu);

    let grads = values(&mut rng, n);
    let hyper = kernels::adamw_step_scalars(1e-2, 0.9, 0.99, 1e-8, 0.1, 3);
    let params = values(&mut rng, n);
    let moments: Vec<f32> = values(&mut rng, n).iter().map(|v| v * 0.01).collect();
    let second: Vec<f32> = moments.iter().map(|v| v * v).collect();
    let (mut p_host, mut m_host, mut v_host) = (params.clone(), moments.clone(), second.clone());
    kernels::adamw_update(
        &mut p_host,
        &grads,
        &mut m_host,
        &mut v_host,
        2.0,
        0.5,
        hyper,
    );
    let (mut p_gpu, mut m_gpu, mut v_gpu) = (params, moments, second);
    let (norm_value, clip) = (2.0f32, 0.5f32);
    for index in 0..n {
        // SAFETY: all buffers hold `n` elements and are distinct; the scalars are locals.
        unsafe {
            adamw::adamw_update(
                p_gpu.as_mut_ptr(),
                grads.as_ptr(),
                m_gpu.as_mut_ptr(),
                v_gpu.as_mut_ptr(),
                &norm_value,
                &clip,
                hyper,
                n,
                1,
                index,
            );
        }
    }
    assert_eq!(p_host, p_gpu);
    assert_eq!(m_host, m_gpu);
    assert_eq!(v_host, v_gpu);
}

#[test]
fn norm_weight_grad_is_deterministic_and_chunking_only_regroups_the_sum() {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(78);
    let (rows, cols) = (301, 37);
    let (x, dy) = (values(&mut rng, rows * cols), values(&mut rng, rows * cols));
    let inv: Vec<f32> = (0..rows).map(|_| rng.random_range(0.1f32..2.0)).collect();
    let mut first = vec![f32::NAN; cols];
    let mut partials = vec![f32::NAN; rows * cols];
    kernels::rmsnorm_weight_grad(&x, &inv, &dy, &mut first, &mut partials, 64);
    let mut again = vec![f32::NAN; cols];
    kernels::rmsnorm_weight_grad(&x, &inv, &dy, &mut again, &mut partials, 64);
    assert_eq!(first, again, "same inputs, same chunking: bitwise equal");
    for rows_per_chunk in [1, 7, 300, 301, 1000] {
        let chunks = rows.div_ceil(rows_per_chunk);
        let mut dw = vec![f32::NAN; cols];
        for index in 0..chunks * cols {
            // SAFETY: `partials` holds `rows · cols ≥ chunks · cols` elements; inputs hold `rows · cols`.
            unsafe {
                norm::rmsnorm_weight_grad_partials(
                    x.as_ptr(),
                    inv.as_ptr(),
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
            // SAFETY: `partials` holds `chunks · cols` written elements; `dw` holds `cols`.
            unsafe {
                norm::column_sums(partials.as_ptr(), dw.as_mut_ptr(), chunks, cols, false, col)
            };
        }
        for c in 0..cols {
            let scale: f32 = (0..rows)
                .map(|r| (x[r * cols + c] * dy[r * cols + c] * inv[r]).abs())
                .sum();
            assert!(
                (dw[c] - first[c]).abs() <= 1e-5 * scale,
                "rows_per_chunk {rows_per_chunk} col {c}"
            );
        }
    }
}
