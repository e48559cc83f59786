//! Every drafter kernel on the GPU against the same kernel through its host launcher (the CPU backend's code),
//! and the row-major GEMM wrappers (f32, and 16-bit inputs with f32 output) against an f64 product, on fresh
//! random inputs with poisoned outputs; the bf16 copies the kernels write beside their f32 outputs against the
//! device's own f32 values rounded to nearest even. Both
//! launchers are generated from the kernel table, so each comparison calls the two with the same arguments.
//!
//! Tolerances: the device's `exp`/`ln`/`rsqrt` are the PTX approximate instructions (relative error ≈ 2^-22)
//! where the host uses ≤ 2-ulp polynomials, so elementwise results are compared at 2e-5 relative. Row
//! reductions run in the same order on both (a warp's lanes and butterfly, emulated on the host); the sums still
//! differ by the approximations inside them, hence 1e-4. Skips with one line without a GPU.

mod common;

use common::{assert_close, download, gpu_or_skip, poisoned, rng, uniform, upload};
use draftpipe_gpu_kernels::adamw;
use draftpipe_gpu_kernels::convert::{FORMAT_BF16, FORMAT_F16};
use draftpipe_runtime::backend::cpu::kernels::launch;
use draftpipe_runtime::backend::cuda::{Gemm, HalfType, KernelModule, Launcher, Op};
use rand::RngExt;

fn launcher(test: &str) -> Option<Launcher> {
    let ctx = gpu_or_skip(test)?;
    let module = KernelModule::load(&ctx).expect("load the embedded PTX");
    Some(Launcher::new(&module, ctx.new_stream().expect("stream")).expect("resolve kernels"))
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-check.sh runs it with --include-ignored"]
fn rmsnorm_forward_and_backward_match_host() {
    let Some(k) = launcher("rmsnorm_forward_and_backward_match_host") else {
        return;
    };
    let s = k.stream().clone();
    let (mut r, seed) = rng();
    // 300 columns: nine full lane rounds and a partial one.
    let (rows, cols, eps) = (37, 300, 1e-6);
    let x = uniform(&mut r, rows * cols, -2.0, 2.0);
    let w = uniform(&mut r, cols, 0.5, 1.5);
    let dy = uniform(&mut r, rows * cols, -1.0, 1.0);
    let dx0 = uniform(&mut r, rows * cols, -1.0, 1.0);
    let chunk = 8;
    let chunks = rows.div_ceil(chunk);

    let (mut y, mut inv, mut dx, mut partials, mut dw) = (
        vec![0.0; rows * cols],
        vec![0.0; rows],
        dx0.clone(),
        vec![0.0; chunks * cols],
        vec![0.0; cols],
    );
    launch::rmsnorm_forward(&x, &w, &mut y, &mut inv, cols, eps, rows);
    launch::rmsnorm_backward_input(&x, &w, &inv, &dy, &mut dx, cols, 1, rows);
    launch::rmsnorm_weight_grad_partials(&x, &inv, &dy, &mut partials, rows, cols, chunk);
    launch::column_sums(&partials, &mut dw, chunks, cols, 0);

    let ((_x, x_), (_w, w_), (_dy, dy_)) = (upload(&s, &x), upload(&s, &w), upload(&s, &dy));
    let ((gy, gy_), (ginv, ginv_), (gdx, gdx_)) = (
        poisoned(&s, rows * cols),
        poisoned(&s, rows),
        upload(&s, &dx0),
    );
    let ((_p, gp_), (gdw, gdw_)) = (poisoned(&s, chunks * cols), poisoned(&s, cols));
    k.rmsnorm_forward(x_, w_, gy_, ginv_, cols, eps, rows)
        .unwrap();
    k.rmsnorm_backward_input(x_, w_, ginv_, dy_, gdx_, cols, 1, rows)
        .unwrap();
    k.rmsnorm_weight_grad_partials(x_, ginv_, dy_, gp_, rows, cols, chunk)
        .unwrap();
    k.column_sums(gp_, gdw_, chunks, cols, 0).unwrap();
    assert_close("rmsnorm y", &download(&s, &gy), &y, 2e-5, 1e-6, seed);
    assert_close(
        "rmsnorm inv_rms",
        &download(&s, &ginv),
        &inv,
        2e-5,
        0.0,
        seed,
    );
    assert_close("rmsnorm dx", &download(&s, &gdx), &dx, 1e-4, 1e-5, seed);
    assert_close("rmsnorm dw", &download(&s, &gdw), &dw, 1e-4, 1e-5, seed);
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-check.sh runs it with --include-ignored"]
fn swiglu_and_head_residual_match_host() {
    let Some(k) = launcher("swiglu_and_head_residual_match_host") else {
        return;
    };
    let s = k.stream().clone();
    let (mut r, seed) = rng();
    let (rows, inter) = (29, 173);
    let n = rows * inter;
    let gate_up = uniform(&mut r, 2 * n, -6.0, 6.0);
    let dact = uniform(&mut r, n, -1.0, 1.0);
    let (z, a, dh, dz0) = (
        uniform(&mut r, n, -2.0, 2.0),
        uniform(&mut r, n, -6.0, 6.0),
        uniform(&mut r, n, -1.0, 1.0),
        uniform(&mut r, n, -1.0, 1.0),
    );
    let (mut act, mut dgu, mut h, mut da, mut dz) = (
        vec![0.0; n],
        vec![0.0; 2 * n],
        vec![0.0; n],
        vec![0.0; n],
        dz0.clone(),
    );
    launch::swiglu_forward(&gate_up, &mut act, inter, n);
    launch::swiglu_backward(&gate_up, &dact, &mut dgu, inter, n);
    launch::head_residual_forward(&z, &a, &mut h, n);
    launch::head_residual_backward(&a, &dh, &mut da, &mut dz, n);

    let ((_gu, gu_), (_da, dact_), (_z, z_), (_a, a_), (_dh, dh_)) = (
        upload(&s, &gate_up),
        upload(&s, &dact),
        upload(&s, &z),
        upload(&s, &a),
        upload(&s, &dh),
    );
    let ((gact, gact_), (gdgu, gdgu_), (gh, gh_), (gda, gda_), (gdz, gdz_)) = (
        poisoned(&s, n),
        poisoned(&s, 2 * n),
        poisoned(&s, n),
        poisoned(&s, n),
        upload(&s, &dz0),
    );
    k.swiglu_forward(gu_, gact_, inter, n).unwrap();
    k.swiglu_backward(gu_, dact_, gdgu_, inter, n).unwrap();
    k.head_residual_forward(z_, a_, gh_, n).unwrap();
    k.head_residual_backward(a_, dh_, gda_, gdz_, n).unwrap();
    assert_close("swiglu act", &download(&s, &gact), &act, 2e-5, 1e-6, seed);
    assert_close(
        "swiglu dgate_up",
        &download(&s, &gdgu),
        &dgu,
        2e-5,
        1e-6,
        seed,
    );
    assert_close("head h", &download(&s, &gh), &h, 2e-5, 1e-6, seed);
    assert_close("head da", &download(&s, &gda), &da, 2e-5, 1e-6, seed);
    assert_close("head dz", &download(&s, &gdz), &dz, 2e-5, 1e-6, seed);
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-check.sh runs it with --include-ignored"]
fn labels_scales_and_fused_loss_match_host() {
    let Some(k) = launcher("labels_scales_and_fused_loss_match_host") else {
        return;
    };
    let s = k.stream().clone();
    let (mut r, seed) = rng();
    let (padded_len, sequences, heads, vocab, decay) = (40, 3, 3, 5003, 0.8f32);
    let tokens = padded_len * sequences;
    let ids: Vec<u32> = (0..tokens)
        .map(|_| r.random_range(0..vocab as u32 + 3))
        .collect();
    let mask: Vec<u8> = (0..tokens)
        .map(|_| u8::from(r.random_range(0..10) > 0))
        .collect();
    let lens: Vec<u32> = (0..sequences)
        .map(|_| r.random_range(1..=padded_len as u32))
        .collect();
    let logits = uniform(&mut r, tokens * vocab, -8.0, 8.0);
    let (mut labels, mut counts, mut scales) = (
        vec![0i32; heads * tokens],
        vec![0u32; heads],
        vec![0.0f32; heads],
    );
    let (mut grad, mut row_loss) = (logits.clone(), vec![0.0f32; tokens]);
    let head = 1;
    launch::build_labels(
        &ids,
        &mask,
        &lens,
        &mut labels,
        padded_len,
        tokens,
        vocab,
        heads,
    );
    launch::head_loss_scales(&labels, &mut counts, &mut scales, tokens, heads, decay);
    launch::vocab_loss_row(
        &labels[head * tokens..],
        &scales[head..],
        &mut grad,
        &mut row_loss,
        vocab,
        tokens,
    );

    let ((_i, ids_), (_m, mask_), (_l, lens_)) =
        (upload(&s, &ids), upload(&s, &mask), upload(&s, &lens));
    let (glabels, glabels_) = upload(&s, &vec![i32::MIN; heads * tokens]);
    let (gcounts, gcounts_) = upload(&s, &vec![u32::MAX; heads]);
    let ((gscales, gscales_), (glogits, glogits_), (gloss, gloss_)) = (
        poisoned(&s, heads),
        upload(&s, &logits),
        poisoned(&s, tokens),
    );
    k.build_labels(
        ids_, mask_, lens_, glabels_, padded_len, tokens, vocab, heads,
    )
    .unwrap();
    k.head_loss_scales(glabels_, gcounts_, gscales_, tokens, heads, decay)
        .unwrap();
    k.vocab_loss_row(
        glabels_.offset(head * tokens).unwrap(),
        gscales_.offset(head).unwrap(),
        glogits_,
        gloss_,
        vocab,
        tokens,
    )
    .unwrap();
    assert_eq!(download(&s, &glabels), labels, "labels (seed {seed})");
    assert_eq!(download(&s, &gcounts), counts, "counts (seed {seed})");
    assert_close("scales", &download(&s, &gscales), &scales, 1e-6, 0.0, seed);
    assert_close(
        "row loss",
        &download(&s, &gloss),
        &row_loss,
        1e-4,
        1e-7,
        seed,
    );
    assert_close(
        "logits grad",
        &download(&s, &glogits),
        &grad,
        1e-4,
        1e-9,
        seed,
    );
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-check.sh runs it with --include-ignored"]
fn grad_norm_and_adamw_match_host() {
    let Some(k) = launcher("grad_norm_and_adamw_match_host") else {
        return;
    };
    let s = k.stream().clone();
    let (mut r, seed) = rng();
    let (n, chunk, max_norm) = (100_003, 1024, 1.0f32);
    let params = uniform(&mut r, n, -1.0, 1.0);
    let grads = uniform(&mut r, n, -0.1, 0.1);
    let m0 = uniform(&mut r, n, -0.01, 0.01);
    // Some second moments subnormal: the device `sqrt` must not turn them into infinities.
    let mut v0 = uniform(&mut r, n, 0.0, 1e-4);
    v0.iter_mut().step_by(97).for_each(|v| *v = 1e-40);
    let step = 3;
    let (lr, b1, b2) = (1e-3f32, 0.9f32, 0.95f32);
    let hyper = adamw::AdamWStep {
        lr,
        beta1: b1,
        beta2: b2,
        eps: 1e-8,
        weight_decay: 0.01,
        step_size: lr / (1.0 - b1.powi(step)),
        bias_correction2_sqrt: (1.0 - b2.powi(step)).sqrt(),
    };
    let chunks = n.div_ceil(chunk);
    let (mut partials, mut norm, mut clip) = (vec![0.0; chunks], [0.0f32], [0.0f32]);
    let (mut p, mut m, mut v) = (params.clone(), m0.clone(), v0.clone());
    launch::sum_squares_partials(&grads, &mut partials, n, chunk);
    launch::finish_grad_norm(&partials, &mut norm, &mut clip, chunks, max_norm);
    launch::adamw_update(&grads, &norm, &clip, &[hyper], &mut p, &mut m, &mut v, n);

    let ((gp, gp_), (_g, g_), (gm, gm_), (gv, gv_)) = (
        upload(&s, &params),
        upload(&s, &grads),
        upload(&s, &m0),
        upload(&s, &v0),
    );
    let hyper_floats = [
        hyper.lr,
        hyper.beta1,
        hyper.beta2,
        hyper.eps,
        hyper.weight_decay,
        hyper.step_size,
        hyper.bias_correction2_sqrt,
    ];
    let ((_pa, pa_), (gnorm, gnorm_), (gclip, gclip_), (_h, h_)) = (
        poisoned(&s, chunks),
        poisoned(&s, 1),
        poisoned(&s, 1),
        upload(&s, &hyper_floats),
    );
    // SAFETY: `AdamWStep` is seven f32s, `repr(C)`.
    let h_ = unsafe { h_.cast::<adamw::AdamWStep>() };
    k.sum_squares_partials(g_, pa_, n, chunk).unwrap();
    k.finish_grad_norm(pa_, gnorm_, gclip_, chunks, max_norm)
        .unwrap();
    k.adamw_update(g_, gnorm_, gclip_, h_, gp_, gm_, gv_, n)
        .unwrap();
    assert_close("grad norm", &download(&s, &gnorm), &norm, 1e-5, 0.0, seed);
    assert_close("clip scale", &download(&s, &gclip), &clip, 1e-5, 0.0, seed);
    let got = download(&s, &gp);
    assert!(
        got.iter().all(|p| p.is_finite()),
        "non-finite parameter (seed {seed})"
    );
    assert_close("params", &got, &p, 1e-5, 1e-7, seed);
    assert_close("exp_avg", &download(&s, &gm), &m, 1e-5, 1e-9, seed);
    assert_close("exp_avg_sq", &download(&s, &gv), &v, 1e-5, 1e-12, seed);
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-check.sh runs it with --include-ignored"]
fn sum_partials_and_finish_sum_match_host() {
    let Some(k) = launcher("sum_partials_and_finish_sum_match_host") else {
        return;
    };
    let s = k.stream().clone();
    let (mut r, seed) = rng();
    let (n, chunk) = (50_001, 1024);
    let values = uniform(&mut r, n, -1.0, 1.0);
    let chunks = n.div_ceil(chunk);
    let (mut partials, mut total) = (vec![0.0; chunks], [0.0f32]);
    launch::sum_partials(&values, &mut partials, n, chunk);
    launch::finish_sum(&partials, &mut total, chunks);
    let ((_v, v_), (_p, p_), (gt, gt_)) =
        (upload(&s, &values), poisoned(&s, chunks), poisoned(&s, 1));
    k.sum_partials(v_, p_, n, chunk).unwrap();
    k.finish_sum(p_, gt_, chunks).unwrap();
    assert_close("sum", &download(&s, &gt), &total, 1e-5, 1e-5, seed);
}

/// The plane kernels (a warp per row) at rows shorter than a warp and lengths that are not a multiple of 32:
/// lanes past the row's end take no element but still join every shuffle, so a shuffle LLVM moved into the
/// lane-dependent loop (the hazard of an inline-asm shuffle) would read lanes that never arrive.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-check.sh runs it with --include-ignored"]
fn plane_kernels_handle_short_and_ragged_rows() {
    let Some(k) = launcher("plane_kernels_handle_short_and_ragged_rows") else {
        return;
    };
    let s = k.stream().clone();
    let (mut r, seed) = rng();
    for cols in [1usize, 5, 31, 32, 33, 45, 100] {
        let (rows, chunk, eps) = (7usize, 3usize, 1e-6);
        let chunks = rows.div_ceil(chunk);
        let x = uniform(&mut r, rows * cols, -2.0, 2.0);
        let w = uniform(&mut r, cols, 0.5, 1.5);
        let dy = uniform(&mut r, rows * cols, -1.0, 1.0);
        let (mut y, mut inv, mut dx) = (
            vec![0.0; rows * cols],
            vec![0.0; rows],
            vec![0.0; rows * cols],
        );
        let (mut partials, mut dw) = (vec![0.0; chunks * cols], vec![0.0; cols]);
        launch::rmsnorm_forward(&x, &w, &mut y, &mut inv, cols, eps, rows);
        launch::rmsnorm_backward_input(&x, &w, &inv, &dy, &mut dx, cols, 0, rows);
        launch::rmsnorm_weight_grad_partials(&x, &inv, &dy, &mut partials, rows, cols, chunk);
        launch::column_sums(&partials, &mut dw, chunks, cols, 0);

        let ((_x, x_), (_w, w_), (_dy, dy_)) = (upload(&s, &x), upload(&s, &w), upload(&s, &dy));
        let ((gy, gy_), (_ginv, ginv_), (gdx, gdx_)) = (
            poisoned(&s, rows * cols),
            poisoned(&s, rows),
            poisoned(&s, rows * cols),
        );
        let ((_p, gp_), (gdw, gdw_)) = (poisoned(&s, chunks * cols), poisoned(&s, cols));
        k.rmsnorm_forward(x_, w_, gy_, ginv_, cols, eps, rows)
            .unwrap();
        k.rmsnorm_backward_input(x_, w_, ginv_, dy_, gdx_, cols, 0, rows)
            .unwrap();
        k.rmsnorm_weight_grad_partials(x_, ginv_, dy_, gp_, rows, cols, chunk)
            .unwrap();
        k.column_sums(gp_, gdw_, chunks, cols, 0).unwrap();
        let what = |name: &str| format!("{name} at {cols} columns");
        assert_close(&what("rmsnorm y"), &download(&s, &gy), &y, 2e-5, 1e-6, seed);
        assert_close(
            &what("rmsnorm dx"),
            &download(&s, &gdx),
            &dx,
            1e-4,
            1e-5,
            seed,
        );
        assert_close(
            &what("rmsnorm dw"),
            &download(&s, &gdw),
            &dw,
            1e-4,
            1e-5,
            seed,
        );
    }
    for vocab in [2usize, 17, 31, 33, 77] {
        let rows = 5;
        let logits = uniform(&mut r, rows * vocab, -8.0, 8.0);
        let labels: Vec<i32> = (0..rows).map(|row| ((row * 7) % vocab) as i32).collect();
        let (mut grad, mut row_loss) = (logits.clone(), vec![0.0f32; rows]);
        launch::vocab_loss_row(&labels, &[0.5], &mut grad, &mut row_loss, vocab, rows);
        let ((_l, labels_), (_s, scale_)) = (upload(&s, &labels), upload(&s, &[0.5f32]));
        let ((glogits, glogits_), (gloss, gloss_)) = (upload(&s, &logits), poisoned(&s, rows));
        k.vocab_loss_row(labels_, scale_, glogits_, gloss_, vocab, rows)
            .unwrap();
        let what = |name: &str| format!("{name} at vocabulary {vocab}");
        assert_close(
            &what("row loss"),
            &download(&s, &gloss),
            &row_loss,
            1e-4,
            1e-7,
            seed,
        );
        assert_close(
            &what("logits grad"),
            &download(&s, &glogits),
            &grad,
            1e-4,
            1e-9,
            seed,
        );
    }
    // Chunks of 45 values and fewer than 32 partials: ragged lanes in both passes.
    for (n, chunk) in [(1000usize, 45usize), (70, 7), (31, 1024)] {
        let values = uniform(&mut r, n, -1.0, 1.0);
        let chunks = n.div_ceil(chunk);
        let (mut partials, mut total, mut norm, mut clip) =
            (vec![0.0; chunks], [0.0f32], [0.0f32], [0.0f32]);
        launch::sum_partials(&values, &mut partials, n, chunk);
        launch::finish_sum(&partials, &mut total, chunks);
        launch::sum_squares_partials(&values, &mut partials, n, chunk);
        launch::finish_grad_norm(&partials, &mut norm, &mut clip, chunks, 1.0);
        let ((_v, v_), (_p, p_)) = (upload(&s, &values), poisoned(&s, chunks));
        let ((gt, gt_), (gn, gn_), (gc, gc_)) = (poisoned(&s, 1), poisoned(&s, 1), poisoned(&s, 1));
        k.sum_partials(v_, p_, n, chunk).unwrap();
        k.finish_sum(p_, gt_, chunks).unwrap();
        k.sum_squares_partials(v_, p_, n, chunk).unwrap();
        k.finish_grad_norm(p_, gn_, gc_, chunks, 1.0).unwrap();
        let what = |name: &str| format!("{name} of {n} values in chunks of {chunk}");
        assert_close(&what("sum"), &download(&s, &gt), &total, 1e-5, 1e-5, seed);
        assert_close(
            &what("grad norm"),
            &download(&s, &gn),
            &norm,
            1e-5,
            0.0,
            seed,
        );
        assert_close(
            &what("clip scale"),
            &download(&s, &gc),
            &clip,
            1e-5,
            0.0,
            seed,
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-check.sh runs it with --include-ignored"]
fn a_short_buffer_is_an_error_not_a_launch() {
    let Some(k) = launcher("a_short_buffer_is_an_error_not_a_launch") else {
        return;
    };
    let s = k.stream().clone();
    let ((_x, x_), (_y, y_)) = (poisoned(&s, 10), poisoned(&s, 1));
    let error = k.sum_partials(x_, y_, 10, 4).unwrap_err().to_string();
    assert!(
        error.contains("`partials` holds 1 elements, the launch needs 3"),
        "{error}"
    );
}

/// `alpha · op_a(a) · op_b(b) + beta · c0` in f64, row-major; `a` stored `[m, k]` (`[k, m]` transposed), `b`
/// `[k, n]` (`[n, k]` transposed).
#[allow(clippy::too_many_arguments)]
fn row_major_reference(
    (op_a, a): (Op, &[f32]),
    (op_b, b): (Op, &[f32]),
    c0: &[f32],
    (m, n, k): (usize, usize, usize),
    alpha: f32,
    beta: f32,
) -> Vec<f32> {
    let at = |i: usize, p: usize| {
        f64::from(if op_a == Op::N {
            a[i * k + p]
        } else {
            a[p * m + i]
        })
    };
    let bt = |p: usize, j: usize| {
        f64::from(if op_b == Op::N {
            b[p * n + j]
        } else {
            b[j * k + p]
        })
    };
    (0..m * n)
        .map(|e| {
            let (i, j) = (e / n, e % n);
            let dot: f64 = (0..k).map(|p| at(i, p) * bt(p, j)).sum();
            (f64::from(alpha) * dot + f64::from(beta) * f64::from(c0[e])) as f32
        })
        .collect()
}

const TRANSPOSES: [(Op, Op); 4] = [
    (Op::N, Op::N),
    (Op::N, Op::T),
    (Op::T, Op::N),
    (Op::T, Op::T),
];

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-check.sh runs it with --include-ignored"]
fn row_major_gemm_matches_f64_for_every_transpose() {
    let Some(k) = launcher("row_major_gemm_matches_f64_for_every_transpose") else {
        return;
    };
    let s = k.stream().clone();
    let gemm = Gemm::new(s.clone()).expect("cuBLAS");
    let (mut r, seed) = rng();
    let (m, n, kk) = (37, 53, 71);
    for (op_a, op_b) in TRANSPOSES {
        let a = uniform(&mut r, m * kk, -1.0, 1.0);
        let b = uniform(&mut r, kk * n, -1.0, 1.0);
        let c0 = uniform(&mut r, m * n, -1.0, 1.0);
        let (alpha, beta) = (0.75f32, 0.5f32);
        let want = row_major_reference((op_a, &a), (op_b, &b), &c0, (m, n, kk), alpha, beta);
        let ((_a, a_), (_b, b_), (gc, gc_)) = (upload(&s, &a), upload(&s, &b), upload(&s, &c0));
        // SAFETY: the buffers hold the stated shapes.
        unsafe {
            gemm.row_major(
                (op_a, a_.addr()),
                (op_b, b_.addr()),
                gc_.addr(),
                (m, n, kk),
                alpha,
                beta,
            )
        }
        .unwrap();
        assert_close(
            &format!("gemm {op_a:?}{op_b:?}"),
            &download(&s, &gc),
            &want,
            1e-5,
            1e-5,
            seed,
        );
    }
}

/// The product of 16-bit inputs (`Gemm::row_major_16`: bf16 or f16, f32 accumulation and output, what a
/// product with 16-bit hidden states runs) against f64 for every transpose. The inputs are exactly
/// representable in the 16-bit type, so only the f32 accumulation differs from the reference.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-check.sh runs it with --include-ignored"]
fn row_major_16_matches_f64_for_every_transpose() {
    let Some(k) = launcher("row_major_16_matches_f64_for_every_transpose") else {
        return;
    };
    let s = k.stream().clone();
    let gemm = Gemm::new(s.clone()).expect("cuBLAS");
    let (mut r, seed) = rng();
    let (m, n, kk) = (37, 53, 71);
    for input in [HalfType::Bf16, HalfType::F16] {
        // Values and their 16-bit bits (the f32 values are the 16-bit ones, exactly).
        let held = |values: Vec<f32>| -> (Vec<f32>, Vec<u16>) {
            values
                .into_iter()
                .map(|x| match input {
                    HalfType::Bf16 => {
                        let h = half::bf16::from_f32(x);
                        (h.to_f32(), h.to_bits())
                    }
                    HalfType::F16 => {
                        let h = half::f16::from_f32(x);
                        (h.to_f32(), h.to_bits())
                    }
                })
                .unzip()
        };
        for (op_a, op_b) in TRANSPOSES {
            let (a, a16) = held(uniform(&mut r, m * kk, -1.0, 1.0));
            let (b, b16) = held(uniform(&mut r, kk * n, -1.0, 1.0));
            let c0 = uniform(&mut r, m * n, -1.0, 1.0);
            let (alpha, beta) = (0.75f32, 0.5f32);
            let want = row_major_reference((op_a, &a), (op_b, &b), &c0, (m, n, kk), alpha, beta);
            let ((_a, a_), (_b, b_), (gc, gc_)) =
                (upload(&s, &a16), upload(&s, &b16), upload(&s, &c0));
            // SAFETY: the buffers hold the stated shapes, `a` and `b` in 16-bit elements of `input`.
            unsafe {
                gemm.row_major_16(
                    (op_a, a_.addr()),
                    (op_b, b_.addr()),
                    gc_.addr(),
                    (m, n, kk),
                    (alpha, beta),
                    input,
                )
            }
            .unwrap();
            assert_close(
                &format!("{input:?} gemm {op_a:?}{op_b:?}"),
                &download(&s, &gc),
                &want,
                1e-5,
                1e-5,
                seed,
            );
        }
    }
}

/// `round_to_half` on the device gives the host launcher's bits (which `kernels_convert.rs` checks against the
/// `half` crate): random bit patterns (every exponent, NaNs and infinities among them) and the edge cases, both
/// formats, the output poisoned.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-check.sh runs it with --include-ignored"]
fn round_to_half_matches_host_bit_for_bit() {
    let Some(k) = launcher("round_to_half_matches_host_bit_for_bit") else {
        return;
    };
    let s = k.stream().clone();
    let (mut r, seed) = rng();
    let mut x: Vec<f32> = (0..100_003)
        .map(|_| f32::from_bits(r.random::<u32>()))
        .collect();
    x.extend([
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::from_bits(0x7F80_0001),
        f32::MAX,
        65520.0,
        2.980_232_2e-8,
        1.0 + 1.0 / 256.0,
    ]);
    let n = x.len();
    let (_x, x_) = upload(&s, &x);
    for format in [FORMAT_BF16, FORMAT_F16] {
        let mut want = vec![0u16; n];
        launch::round_to_half(&x, &mut want, n, format);
        let (out, out_) = upload(&s, &vec![0xDEADu16; n]);
        k.round_to_half(x_, out_, n, format).unwrap();
        let got = download(&s, &out);
        if let Some(i) = got.iter().zip(&want).position(|(g, w)| g != w) {
            panic!(
                "format {format}: element {i} (f32 bits {:#010x}) gave {:#06x} on the GPU, {:#06x} on the host \
                 (seed {seed})",
                x[i].to_bits(),
                got[i],
                want[i]
            );
        }
    }
}

/// The bit pattern of `x` rounded to bf16, nearest even (the `half` crate's, not the kernels' own code).
fn bf16_bits(x: &[f32]) -> Vec<u16> {
    x.iter()
        .map(|v| half::bf16::from_f32(*v).to_bits())
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-check.sh runs it with --include-ignored"]
fn bf16_copies_are_the_device_values_rounded_to_nearest_even() {
    // What CUDA's products read at bf16 precision: AdamW's copy of the parameters, RMSNorm's and SwiGLU's of
    // their outputs. Each must be the device's own f32 result rounded to nearest even, bit for bit (the value
    // the CPU's emulation rounds to), and the f32 results must match the host launchers as the kernels without
    // a copy do. Copies start poisoned.
    let Some(k) = launcher("bf16_copies_are_the_device_values_rounded_to_nearest_even") else {
        return;
    };
    let s = k.stream().clone();
    let (mut r, seed) = rng();
    let poison = |n: usize| upload(&s, &vec![0x7FC1u16; n]);

    let n = 50_001;
    let (params, grads) = (uniform(&mut r, n, -1.0, 1.0), uniform(&mut r, n, -0.1, 0.1));
    let hyper = adamw::AdamWStep {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.01,
        step_size: 1e-2,
        bias_correction2_sqrt: 0.05f32.sqrt(),
    };
    let (mut p, mut m, mut v) = (params.clone(), vec![0.0; n], vec![0.0; n]);
    launch::adamw_update(&grads, &[1.0], &[1.0], &[hyper], &mut p, &mut m, &mut v, n);
    let ((gp, gp_), (_g, g_), (_m, gm_), (_v, gv_), (gc, gc_)) = (
        upload(&s, &params),
        upload(&s, &grads),
        upload(&s, &vec![0.0f32; n]),
        upload(&s, &vec![0.0f32; n]),
        poison(n),
    );
    let hyper_floats = [
        hyper.lr,
        hyper.beta1,
        hyper.beta2,
        hyper.eps,
        hyper.weight_decay,
        hyper.step_size,
        hyper.bias_correction2_sqrt,
    ];
    let ((_n, norm_), (_c, clip_), (_h, h_)) = (
        upload(&s, &[1.0f32]),
        upload(&s, &[1.0f32]),
        upload(&s, &hyper_floats),
    );
    // SAFETY: `AdamWStep` is seven f32s, `repr(C)`.
    let h_ = unsafe { h_.cast::<adamw::AdamWStep>() };
    k.adamw_update_bf16(g_, norm_, clip_, h_, gp_, gc_, gm_, gv_, n)
        .unwrap();
    let got = download(&s, &gp);
    assert_close("params", &got, &p, 1e-5, 1e-7, seed);
    assert_eq!(
        download(&s, &gc),
        bf16_bits(&got),
        "AdamW's copy (seed {seed})"
    );

    // 19 columns (a partial plane) and 300 (ragged lane rounds).
    for (rows, cols) in [(13, 19), (37, 300)] {
        let x = uniform(&mut r, rows * cols, -2.0, 2.0);
        let w = uniform(&mut r, cols, 0.5, 1.5);
        let (mut y, mut inv) = (vec![0.0; rows * cols], vec![0.0; rows]);
        launch::rmsnorm_forward(&x, &w, &mut y, &mut inv, cols, 1e-6, rows);
        let ((_x, x_), (_w, w_)) = (upload(&s, &x), upload(&s, &w));
        let ((gy, gy_), (gy16, gy16_), (_i, ginv_)) = (
            poisoned(&s, rows * cols),
            poison(rows * cols),
            poisoned(&s, rows),
        );
        k.rmsnorm_forward_bf16(x_, w_, gy_, gy16_, ginv_, cols, 1e-6, rows)
            .unwrap();
        let got = download(&s, &gy);
        assert_close("rmsnorm y", &got, &y, 2e-5, 1e-6, seed);
        assert_eq!(
            download(&s, &gy16),
            bf16_bits(&got),
            "rmsnorm's copy (seed {seed})"
        );
    }

    let (rows, inter) = (11, 37);
    let n = rows * inter;
    let gate_up = uniform(&mut r, 2 * n, -3.0, 3.0);
    let mut act = vec![0.0; n];
    launch::swiglu_forward(&gate_up, &mut act, inter, n);
    let (_gu, gu_) = upload(&s, &gate_up);
    let ((ga, ga_), (ga16, ga16_)) = (poisoned(&s, n), poison(n));
    k.swiglu_forward_bf16(gu_, ga_, ga16_, inter, n).unwrap();
    let got = download(&s, &ga);
    assert_close("swiglu act", &got, &act, 2e-5, 1e-6, seed);
    assert_eq!(
        download(&s, &ga16),
        bf16_bits(&got),
        "swiglu's copy (seed {seed})"
    );
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-check.sh runs it with --include-ignored"]
fn backward_bf16_copies_are_the_device_gradients_rounded_to_nearest_even() {
    // What CUDA's backward products read at bf16 precision: the RMSNorm backward's input gradient (written and
    // accumulated) and the SwiGLU backward's [dgate | dup], each the device's own f32 result rounded to nearest
    // even bit for bit, the f32 results as close to the host launchers as the kernels without a copy. Copies
    // start poisoned.
    let Some(k) = launcher("backward_bf16_copies_are_the_device_gradients_rounded_to_nearest_even")
    else {
        return;
    };
    let s = k.stream().clone();
    let (mut r, seed) = rng();
    let poison = |n: usize| upload(&s, &vec![0x7FC1u16; n]);
    for (rows, cols, accumulate) in [(13, 19, 0u32), (37, 300, 1)] {
        let n = rows * cols;
        let x = uniform(&mut r, n, -2.0, 2.0);
        let w = uniform(&mut r, cols, 0.5, 1.5);
        let inv = uniform(&mut r, rows, 0.5, 2.0);
        let dy = uniform(&mut r, n, -1e-3, 1e-3);
        let dx0 = uniform(&mut r, n, -1e-3, 1e-3);
        let mut dx = dx0.clone();
        launch::rmsnorm_backward_input(&x, &w, &inv, &dy, &mut dx, cols, accumulate, rows);
        let ((_x, x_), (_w, w_), (_i, inv_), (_dy, dy_)) = (
            upload(&s, &x),
            upload(&s, &w),
            upload(&s, &inv),
            upload(&s, &dy),
        );
        let (gdx, gdx_) = if accumulate == 1 {
            upload(&s, &dx0)
        } else {
            poisoned(&s, n)
        };
        let (gdx16, gdx16_) = poison(n);
        k.rmsnorm_backward_input_bf16(x_, w_, inv_, dy_, gdx_, gdx16_, cols, accumulate, rows)
            .unwrap();
        let got = download(&s, &gdx);
        assert_close("rmsnorm dx", &got, &dx, 1e-4, 1e-9, seed);
        assert_eq!(
            download(&s, &gdx16),
            bf16_bits(&got),
            "rmsnorm backward's copy, accumulate {accumulate} (seed {seed})"
        );
    }

    let (rows, inter) = (11, 37);
    let n = rows * inter;
    let gate_up = uniform(&mut r, 2 * n, -3.0, 3.0);
    let dact = uniform(&mut r, n, -1e-3, 1e-3);
    let mut dgu = vec![0.0; 2 * n];
    launch::swiglu_backward(&gate_up, &dact, &mut dgu, inter, n);
    let ((_gu, gu_), (_d, dact_)) = (upload(&s, &gate_up), upload(&s, &dact));
    let ((gdgu, gdgu_), (gdgu16, gdgu16_)) = (poisoned(&s, 2 * n), poison(2 * n));
    k.swiglu_backward_bf16(gu_, dact_, gdgu_, gdgu16_, inter, n)
        .unwrap();
    let got = download(&s, &gdgu);
    assert_close("swiglu dgate_up", &got, &dgu, 2e-5, 1e-9, seed);
    assert_eq!(
        download(&s, &gdgu16),
        bf16_bits(&got),
        "swiglu backward's copy (seed {seed})"
    );
}
