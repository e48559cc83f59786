//! Every drafter kernel on the GPU against the same body run on the host (the CPU backend's code), and the
//! row-major GEMM wrapper against an f64 product, on fresh random inputs with poisoned outputs.
//!
//! Tolerances: the device's `exp`/`ln`/`rsqrt` are the PTX approximate instructions (relative error ≈ 2^-22)
//! where the host uses ≤ 2-ulp polynomials, and sums run in another order, so elementwise results are compared
//! at 2e-5 relative; reductions over thousands of terms at 1e-4. Skips with one line without a GPU.

mod common;

use common::{assert_close, download, gpu_or_skip, poisoned, rng, uniform, upload};
use draftpipe_gpu_kernels::{activation, adamw, loss, norm, reduce};
use draftpipe_runtime::cuda::{Gemm, KernelModule, Launcher, Op};
use rand::RngExt;

fn launcher(test: &str) -> Option<Launcher> {
    let ctx = gpu_or_skip(test)?;
    let module = KernelModule::load(&ctx).expect("load the embedded PTX");
    Some(Launcher::new(&module, ctx.new_stream().expect("stream")).expect("resolve kernels"))
}

#[test]
fn rmsnorm_forward_and_backward_match_host() {
    let Some(k) = launcher("rmsnorm_forward_and_backward_match_host") else {
        return;
    };
    let s = k.stream().clone();
    let (mut r, seed) = rng();
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
    // SAFETY: every buffer has the sizes the bodies' contracts state.
    unsafe {
        for row in 0..rows {
            norm::rmsnorm_forward(
                x.as_ptr(),
                w.as_ptr(),
                y.as_mut_ptr(),
                inv.as_mut_ptr(),
                cols,
                eps,
                row,
            );
            norm::rmsnorm_backward_input(
                x.as_ptr(),
                w.as_ptr(),
                inv.as_ptr(),
                dy.as_ptr(),
                dx.as_mut_ptr(),
                cols,
                true,
                row,
            );
        }
        for index in 0..chunks * cols {
            norm::rmsnorm_weight_grad_partials(
                x.as_ptr(),
                inv.as_ptr(),
                dy.as_ptr(),
                partials.as_mut_ptr(),
                rows,
                cols,
                chunk,
                index,
            );
        }
        for col in 0..cols {
            norm::column_sums(partials.as_ptr(), dw.as_mut_ptr(), chunks, cols, false, col);
        }
    }

    let ((_x, dx_), (_w, dw_), (_dy, ddy)) = (upload(&s, &x), upload(&s, &w), upload(&s, &dy));
    let ((gy, gy_), (ginv, ginv_), (gdx, gdx_)) = (
        poisoned(&s, rows * cols),
        poisoned(&s, rows),
        upload(&s, &dx0),
    );
    let ((_p, gp_), (gdw, gdw_)) = (poisoned(&s, chunks * cols), poisoned(&s, cols));
    k.rmsnorm_forward((dx_, dw_, gy_, ginv_), rows, cols, eps)
        .unwrap();
    k.rmsnorm_backward_input((dx_, dw_, ginv_, ddy, gdx_), rows, cols, true)
        .unwrap();
    k.rmsnorm_weight_grad_partials((dx_, ginv_, ddy, gp_), rows, cols, chunk)
        .unwrap();
    k.column_sums(gp_, gdw_, chunks, cols, false).unwrap();
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
    // SAFETY: sizes as the bodies' contracts state; one element per call (the GPU's chunking).
    unsafe {
        for e in 0..n {
            activation::swiglu_forward(gate_up.as_ptr(), act.as_mut_ptr(), inter, n, 1, e);
            activation::swiglu_backward(
                gate_up.as_ptr(),
                dact.as_ptr(),
                dgu.as_mut_ptr(),
                inter,
                n,
                1,
                e,
            );
            activation::head_residual_forward(z.as_ptr(), a.as_ptr(), h.as_mut_ptr(), n, 1, e);
            activation::head_residual_backward(
                a.as_ptr(),
                dh.as_ptr(),
                da.as_mut_ptr(),
                dz.as_mut_ptr(),
                n,
                1,
                e,
            );
        }
    }
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
    k.swiglu_forward(gu_, gact_, rows, inter).unwrap();
    k.swiglu_backward((gu_, dact_, gdgu_), rows, inter).unwrap();
    k.head_residual_forward(z_, a_, gh_, n).unwrap();
    k.head_residual_backward((a_, dh_, gda_, gdz_), n).unwrap();
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
    // SAFETY: sizes as the bodies' contracts state.
    unsafe {
        for index in 0..heads * tokens {
            loss::build_labels(
                ids.as_ptr(),
                mask.as_ptr(),
                lens.as_ptr(),
                labels.as_mut_ptr(),
                padded_len,
                tokens,
                vocab,
                index,
            );
        }
        for j in 0..heads {
            loss::head_loss_scales(
                labels.as_ptr(),
                tokens,
                heads,
                decay,
                counts.as_mut_ptr(),
                scales.as_mut_ptr(),
                j,
            );
        }
        for row in 0..tokens {
            let l = labels.as_ptr().add(head * tokens);
            loss::vocab_loss_row(
                grad.as_mut_ptr(),
                l,
                scales.as_ptr().add(head),
                row_loss.as_mut_ptr(),
                vocab,
                row,
            );
        }
    }
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
        (ids_, mask_, lens_, glabels_),
        padded_len,
        tokens,
        heads,
        vocab,
    )
    .unwrap();
    k.head_loss_scales((glabels_, gcounts_, gscales_), tokens, heads, decay)
        .unwrap();
    let labels_of_head = glabels_ + (head * tokens * 4) as u64;
    k.vocab_loss_row(
        (
            glogits_,
            labels_of_head,
            gscales_ + (head * 4) as u64,
            gloss_,
        ),
        tokens,
        vocab,
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
    let v0 = uniform(&mut r, n, 0.0, 1e-4);
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
    let hyper_floats = [
        hyper.lr,
        hyper.beta1,
        hyper.beta2,
        hyper.eps,
        hyper.weight_decay,
        hyper.step_size,
        hyper.bias_correction2_sqrt,
    ];
    let chunks = n.div_ceil(chunk);
    let (mut partials, mut norm, mut clip) = (vec![0.0; chunks], [0.0f32], [0.0f32]);
    let (mut p, mut m, mut v) = (params.clone(), m0.clone(), v0.clone());
    // SAFETY: sizes as the bodies' contracts state.
    unsafe {
        for c in 0..chunks {
            reduce::sum_squares_partials(grads.as_ptr(), n, chunk, partials.as_mut_ptr(), c);
        }
        reduce::finish_grad_norm(
            partials.as_ptr(),
            chunks,
            max_norm,
            norm.as_mut_ptr(),
            clip.as_mut_ptr(),
        );
        for e in 0..n {
            adamw::adamw_update(
                p.as_mut_ptr(),
                grads.as_ptr(),
                m.as_mut_ptr(),
                v.as_mut_ptr(),
                norm.as_ptr(),
                clip.as_ptr(),
                hyper,
                n,
                1,
                e,
            );
        }
    }
    let ((gp, gp_), (_g, g_), (gm, gm_), (gv, gv_)) = (
        upload(&s, &params),
        upload(&s, &grads),
        upload(&s, &m0),
        upload(&s, &v0),
    );
    let ((_pa, pa_), (gnorm, gnorm_), (gclip, gclip_), (_h, h_)) = (
        poisoned(&s, chunks),
        poisoned(&s, 1),
        poisoned(&s, 1),
        upload(&s, &hyper_floats),
    );
    k.sum_squares_partials(g_, pa_, n, chunk).unwrap();
    k.finish_grad_norm((pa_, gnorm_, gclip_), chunks, max_norm)
        .unwrap();
    k.adamw_update((gp_, g_, gm_, gv_), (gnorm_, gclip_, h_), n)
        .unwrap();
    assert_close("grad norm", &download(&s, &gnorm), &norm, 1e-5, 0.0, seed);
    assert_close("clip scale", &download(&s, &gclip), &clip, 1e-5, 0.0, seed);
    assert_close("params", &download(&s, &gp), &p, 1e-5, 1e-7, seed);
    assert_close("exp_avg", &download(&s, &gm), &m, 1e-5, 1e-9, seed);
    assert_close("exp_avg_sq", &download(&s, &gv), &v, 1e-5, 1e-12, seed);
}

#[test]
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
    // SAFETY: sizes as the bodies' contracts state.
    unsafe {
        for c in 0..chunks {
            reduce::sum_partials(values.as_ptr(), n, chunk, partials.as_mut_ptr(), c);
        }
        reduce::finish_sum(partials.as_ptr(), chunks, total.as_mut_ptr());
    }
    let ((_v, v_), (_p, p_), (gt, gt_)) =
        (upload(&s, &values), poisoned(&s, chunks), poisoned(&s, 1));
    k.sum_partials(v_, p_, n, chunk).unwrap();
    k.finish_sum(p_, chunks, gt_).unwrap();
    assert_close("sum", &download(&s, &gt), &total, 1e-5, 1e-5, seed);
}

#[test]
fn row_major_gemm_matches_f64_for_every_transpose() {
    let Some(k) = launcher("row_major_gemm_matches_f64_for_every_transpose") else {
        return;
    };
    let s = k.stream().clone();
    let gemm = Gemm::new(s.clone()).expect("cuBLAS");
    let (mut r, seed) = rng();
    let (m, n, kk) = (37, 53, 71);
    for (op_a, op_b) in [
        (Op::N, Op::N),
        (Op::N, Op::T),
        (Op::T, Op::N),
        (Op::T, Op::T),
    ] {
        let a = uniform(&mut r, m * kk, -1.0, 1.0);
        let b = uniform(&mut r, kk * n, -1.0, 1.0);
        let c0 = uniform(&mut r, m * n, -1.0, 1.0);
        // a is stored [m,k] (N) or [k,m] (T); b [k,n] (N) or [n,k] (T).
        let at = |i: usize, p: usize| {
            f64::from(if op_a == Op::N {
                a[i * kk + p]
            } else {
                a[p * m + i]
            })
        };
        let bt = |p: usize, j: usize| {
            f64::from(if op_b == Op::N {
                b[p * n + j]
            } else {
                b[j * kk + p]
            })
        };
        let (alpha, beta) = (0.75f32, 0.5f32);
        let want: Vec<f32> = (0..m * n)
            .map(|e| {
                let (i, j) = (e / n, e % n);
                let dot: f64 = (0..kk).map(|p| at(i, p) * bt(p, j)).sum();
                (f64::from(alpha) * dot + f64::from(beta) * f64::from(c0[e])) as f32
            })
            .collect();
        let ((_a, a_), (_b, b_), (gc, gc_)) = (upload(&s, &a), upload(&s, &b), upload(&s, &c0));
        // SAFETY: the buffers hold the stated shapes.
        unsafe { gemm.row_major((op_a, a_), (op_b, b_), gc_, (m, n, kk), alpha, beta) }.unwrap();
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
