//! Every kernel (through its host launcher) against an f64 reference written from its formula, on fresh random
//! inputs of random sizes (fresh seeds every run, see `seeds`), with outputs filled with NaN before each run so a missed element fails.
//!
//! Stated bounds (normwise: `max |out − ref| / max |ref|`): RMSNorm forward 2e-6, input gradient 2e-6 of its
//! larger term (the two terms can cancel), weight gradient 1e-5, SwiGLU and head residual 2e-6 (forward and backward), fused loss row losses and gradients
//! 2e-6, sums and norms 1e-6.

use draftpipe_runtime::backend::cpu::kernels;
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

/// Six fresh seeds per run (from the clock), or six from `KERNEL_TEST_SEED` to reproduce a failure; every
/// assertion message names its seed.
fn seeds() -> std::ops::Range<u64> {
    let base = std::env::var("KERNEL_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default();
            now.as_nanos() as u64 % 1_000_000_007
        });
    base..base + 6
}

fn normal(rng: &mut Xoshiro256PlusPlus, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| scale * (rng.random_range(-1.0f32..1.0) + rng.random_range(-1.0f32..1.0)))
        .collect()
}

fn poisoned(n: usize) -> Vec<f32> {
    vec![f32::NAN; n]
}

/// `max |out − ref| / max |ref|`, NaN-aware (a NaN output gives infinity).
fn normwise(out: &[f32], reference: &[f64]) -> f64 {
    let scale = reference
        .iter()
        .fold(0.0f64, |m, r| m.max(r.abs()))
        .max(f64::MIN_POSITIVE);
    worst_abs(out, reference) / scale
}

/// Asserts that `out` is within `bound` of `reference` normwise; the message names `what` and the error.
fn assert_normwise(out: &[f32], reference: &[f64], bound: f64, what: &str) {
    let error = normwise(out, reference);
    assert!(
        error < bound,
        "{what}: normwise error {error} (bound {bound})"
    );
}

/// `max |out − ref|`, NaN-aware (a NaN output gives infinity).
fn worst_abs(out: &[f32], reference: &[f64]) -> f64 {
    assert_eq!(out.len(), reference.len());
    out.iter()
        .zip(reference)
        .map(|(&o, r)| {
            if o.is_finite() {
                (o as f64 - r).abs()
            } else {
                f64::INFINITY
            }
        })
        .fold(0.0, f64::max)
}

/// One row of logits' softmax in f64, the row maximum subtracted: its log-sum-exp and its probabilities.
fn softmax_f64(logits: &[f32]) -> (f64, Vec<f64>) {
    let row: Vec<f64> = logits.iter().map(|&v| v as f64).collect();
    let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = row.iter().map(|l| (l - max).exp()).sum();
    let probabilities = row.iter().map(|l| (l - max).exp() / sum).collect();
    (max + sum.ln(), probabilities)
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

fn silu_grad(x: f64) -> f64 {
    let s = 1.0 / (1.0 + (-x).exp());
    s * (1.0 + x * (1.0 - s))
}

#[test]
fn rmsnorm_forward_backward_and_weight_grad_match_f64() {
    for seed in seeds() {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
        let rows = rng.random_range(1..200);
        let cols = rng.random_range(1..300);
        let x = normal(&mut rng, rows * cols, 2.0);
        let w = normal(&mut rng, cols, 1.0);
        let dy = normal(&mut rng, rows * cols, 1.0);
        let (mut y, mut inv) = (poisoned(rows * cols), poisoned(rows));
        kernels::rmsnorm_forward(&x, &w, &mut y, &mut inv, 1e-6);
        let mut dx = poisoned(rows * cols);
        kernels::rmsnorm_backward_input(&x, &w, &inv, &dy, &mut dx, false);
        let mut dx_acc: Vec<f32> = vec![0.5; rows * cols];
        kernels::rmsnorm_backward_input(&x, &w, &inv, &dy, &mut dx_acc, true);
        let mut dw = poisoned(cols);
        let mut partials = poisoned(rows.div_ceil(7) * cols);
        kernels::rmsnorm_weight_grad(&x, &inv, &dy, &mut dw, &mut partials, 7);

        let (mut y_ref, mut dx_ref, mut dw_ref) = (
            vec![0.0; rows * cols],
            vec![0.0; rows * cols],
            vec![0.0; cols],
        );
        // The input gradient is a difference of two terms that can cancel (few columns, one dominant
        // element), so its error is measured against the larger of the terms, not the difference.
        let mut dx_term_scale = 0.0f64;
        for r in 0..rows {
            let xr: Vec<f64> = x[r * cols..][..cols].iter().map(|&v| v as f64).collect();
            let ms = xr.iter().map(|v| v * v).sum::<f64>() / cols as f64;
            let ir = 1.0 / (ms + 1e-6).sqrt();
            let dot: f64 = (0..cols)
                .map(|c| w[c] as f64 * dy[r * cols + c] as f64 * xr[c])
                .sum();
            for c in 0..cols {
                let g = dy[r * cols + c] as f64;
                y_ref[r * cols + c] = xr[c] * ir * w[c] as f64;
                let (direct, through_rms) =
                    (ir * w[c] as f64 * g, xr[c] * ir.powi(3) * dot / cols as f64);
                dx_ref[r * cols + c] = direct - through_rms;
                dx_term_scale = dx_term_scale.max(direct.abs()).max(through_rms.abs());
                dw_ref[c] += g * xr[c] * ir;
            }
        }
        let acc_ref: Vec<f64> = dx_ref.iter().map(|v| v + 0.5).collect();
        assert_normwise(&y, &y_ref, 2e-6, &format!("seed {seed}: forward"));
        let dx_err = worst_abs(&dx, &dx_ref) / dx_term_scale;
        assert!(dx_err < 2e-6, "seed {seed}: input grad {dx_err}");
        let acc_err = worst_abs(&dx_acc, &acc_ref) / (dx_term_scale + 0.5);
        assert!(
            acc_err < 2e-6,
            "seed {seed}: accumulated input grad {acc_err}"
        );
        assert_normwise(&dw, &dw_ref, 1e-5, &format!("seed {seed}: weight grad"));
    }
}

#[test]
fn swiglu_forward_and_backward_match_f64() {
    for seed in seeds() {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed.wrapping_mul(10));
        // Sizes that do not divide the host chunk, so chunks cross rows.
        let rows = rng.random_range(1..40);
        let inter = rng.random_range(1..700);
        let gate_up = normal(&mut rng, 2 * rows * inter, 3.0);
        let dact = normal(&mut rng, rows * inter, 1.0);
        let mut act = poisoned(rows * inter);
        kernels::swiglu_forward(&gate_up, &mut act, inter);
        let mut dgu = poisoned(2 * rows * inter);
        kernels::swiglu_backward(&gate_up, &dact, &mut dgu, inter);

        let (mut act_ref, mut dgu_ref) = (vec![0.0; rows * inter], vec![0.0; 2 * rows * inter]);
        for t in 0..rows {
            for i in 0..inter {
                let g = gate_up[2 * t * inter + i] as f64;
                let u = gate_up[2 * t * inter + inter + i] as f64;
                let d = dact[t * inter + i] as f64;
                act_ref[t * inter + i] = silu(g) * u;
                dgu_ref[2 * t * inter + i] = d * u * silu_grad(g);
                dgu_ref[2 * t * inter + inter + i] = d * silu(g);
            }
        }
        assert_normwise(&act, &act_ref, 2e-6, &format!("seed {seed}: forward"));
        assert_normwise(&dgu, &dgu_ref, 2e-6, &format!("seed {seed}: backward"));
    }
}

#[test]
fn head_residual_forward_and_backward_match_f64() {
    for seed in seeds() {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed.wrapping_mul(20));
        let n = rng.random_range(1..20_000);
        let z = normal(&mut rng, n, 1.0);
        let a = normal(&mut rng, n, 4.0);
        let dh_in = normal(&mut rng, n, 1.0);
        let dz_in = normal(&mut rng, n, 1.0);
        let mut h = poisoned(n);
        kernels::head_residual_forward(&z, &a, &mut h);
        let (mut da, mut dz) = (poisoned(n), dz_in.clone());
        kernels::head_residual_backward(&a, &dh_in, &mut da, &mut dz);
        let h_ref: Vec<f64> = (0..n).map(|e| z[e] as f64 + silu(a[e] as f64)).collect();
        let da_ref: Vec<f64> = (0..n)
            .map(|e| dh_in[e] as f64 * silu_grad(a[e] as f64))
            .collect();
        let dz_ref: Vec<f64> = (0..n).map(|e| dz_in[e] as f64 + dh_in[e] as f64).collect();
        assert_normwise(&h, &h_ref, 2e-6, &format!("seed {seed}: forward"));
        assert_normwise(&da, &da_ref, 2e-6, &format!("seed {seed}: activation grad"));
        assert_normwise(&dz, &dz_ref, 2e-6, &format!("seed {seed}: residual grad"));
    }
}

#[test]
fn fused_vocab_loss_matches_f64_softmax_cross_entropy() {
    for seed in seeds() {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed.wrapping_mul(30));
        let rows = rng.random_range(1..50);
        let vocab = rng.random_range(2..5000);
        // Large logits: the kernel must subtract the row maximum.
        let logits_in = normal(&mut rng, rows * vocab, 30.0);
        let labels: Vec<i32> = (0..rows)
            .map(|_| {
                if rng.random_range(0..5) == 0 {
                    -1
                } else {
                    rng.random_range(0..vocab as i32)
                }
            })
            .collect();
        let scale = rng.random_range(0.01f32..2.0);
        let mut logits = logits_in.clone();
        let mut row_loss = poisoned(rows);
        kernels::vocab_loss(&mut logits, &labels, scale, &mut row_loss, vocab);

        let (mut loss_ref, mut grad_ref) = (vec![0.0; rows], vec![0.0; rows * vocab]);
        for r in 0..rows {
            if labels[r] < 0 {
                continue;
            }
            let (log_sum_exp, probabilities) = softmax_f64(&logits_in[r * vocab..][..vocab]);
            let label = labels[r] as usize;
            loss_ref[r] = scale as f64 * (log_sum_exp - logits_in[r * vocab + label] as f64);
            for (v, p) in probabilities.into_iter().enumerate() {
                grad_ref[r * vocab + v] = scale as f64 * (p - f64::from(u8::from(v == label)));
            }
        }
        assert_normwise(&row_loss, &loss_ref, 2e-6, &format!("seed {seed}: loss"));
        assert_normwise(&logits, &grad_ref, 2e-6, &format!("seed {seed}: grad"));
    }
}

/// Logits of scale 1, as a trained model's are: most probabilities are near `1 / vocab`, so a relative error in
/// a small probability is invisible to a normwise bound (whose scale is the label's `p − 1`). Every gradient
/// element is checked against its own reference, at a vocabulary that leaves the last lane round partial.
#[test]
fn fused_vocab_loss_is_right_for_every_small_probability() {
    for seed in seeds() {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed.wrapping_mul(31));
        let rows = rng.random_range(1..12);
        let vocab = 32 * rng.random_range(1..300) + rng.random_range(1..32);
        let logits_in = normal(&mut rng, rows * vocab, 1.0);
        let labels: Vec<i32> = (0..rows)
            .map(|_| rng.random_range(0..vocab as i32))
            .collect();
        let mut logits = logits_in.clone();
        let mut row_loss = poisoned(rows);
        kernels::vocab_loss(&mut logits, &labels, 1.0, &mut row_loss, vocab);
        for r in 0..rows {
            let (log_sum_exp, probabilities) = softmax_f64(&logits_in[r * vocab..][..vocab]);
            let label = labels[r] as usize;
            let loss = log_sum_exp - logits_in[r * vocab + label] as f64;
            assert!(
                (row_loss[r] as f64 - loss).abs() <= 2e-6 * loss.abs().max(1.0),
                "seed {seed} (vocab {vocab}) row {r}: loss {} vs {loss}",
                row_loss[r]
            );
            for (v, p) in probabilities.into_iter().enumerate() {
                let want = p - f64::from(u8::from(v == label));
                let got = logits[r * vocab + v] as f64;
                assert!(
                    (got - want).abs() <= 1e-5 * want.abs(),
                    "seed {seed} (vocab {vocab}) row {r} logit {v}: {got:e} vs {want:e}"
                );
            }
        }
    }
}

#[test]
fn labels_and_head_scales_follow_the_definition() {
    for seed in seeds() {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed.wrapping_mul(40));
        let (padded_len, sequences, heads, vocab) =
            (rng.random_range(1..30), rng.random_range(1..5), 4, 50);
        let tokens = padded_len * sequences;
        let seq_lens: Vec<u32> = (0..sequences)
            .map(|_| rng.random_range(0..=padded_len as u32))
            .collect();
        // Some ids past the vocabulary: the kernel must ignore them rather than read out of range later.
        let ids: Vec<u32> = (0..tokens)
            .map(|_| rng.random_range(0..vocab as u32 + 5))
            .collect();
        let mask: Vec<u8> = (0..tokens)
            .map(|_| u8::from(rng.random_range(0..4) != 0))
            .collect();
        let mut labels = vec![i32::MIN; heads * tokens];
        kernels::build_labels(&ids, &mask, &seq_lens, &mut labels, padded_len, vocab);
        let (mut counts, mut scales) = (vec![u32::MAX; heads], poisoned(heads));
        kernels::head_loss_scales(&labels, 0.7, &mut counts, &mut scales);

        let total: f64 = (0..heads).map(|j| 0.7f64.powi(j as i32)).sum();
        for j in 0..heads {
            let mut count = 0;
            for t in 0..tokens {
                let (s, p) = (t / padded_len, t % padded_len);
                let q = p + j + 1;
                let position = s * padded_len + q;
                let valid = q < seq_lens[s] as usize
                    && mask[position] != 0
                    && (ids[position] as usize) < vocab;
                let expected = if valid { ids[position] as i32 } else { -1 };
                assert_eq!(
                    labels[j * tokens + t],
                    expected,
                    "seed {seed} head {j} token {t}"
                );
                count += usize::from(expected >= 0);
            }
            assert_eq!(counts[j] as usize, count);
            let scale_ref = if count == 0 {
                0.0
            } else {
                0.7f64.powi(j as i32) / (total * count as f64)
            };
            assert!(
                (scales[j] as f64 - scale_ref).abs() <= 1e-6 * scale_ref,
                "seed {seed} head {j}"
            );
        }
    }
}

#[test]
fn sums_and_grad_norm_match_f64_and_clip_like_pytorch() {
    for seed in seeds() {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed.wrapping_mul(50));
        let n = rng.random_range(1..300_000);
        let values = normal(&mut rng, n, 1.0);
        let chunk = rng.random_range(1..5000);
        let mut partials = poisoned(n.div_ceil(chunk));
        let total = kernels::sum(&values, chunk, &mut partials);
        let total_ref: f64 = values.iter().map(|&v| v as f64).sum();
        let abs_sum: f64 = values.iter().map(|&v| (v as f64).abs()).sum();
        assert!(
            (total as f64 - total_ref).abs() < 1e-6 * abs_sum,
            "seed {seed}: {total} vs {total_ref}"
        );

        let norm_ref = values
            .iter()
            .map(|&v| v as f64 * v as f64)
            .sum::<f64>()
            .sqrt();
        let (norm, no_clip) = kernels::grad_norm(&values, chunk, &mut partials, 0.0);
        assert!(
            ((norm as f64 - norm_ref) / norm_ref).abs() < 1e-6,
            "seed {seed}: {norm} vs {norm_ref}"
        );
        assert_eq!(no_clip, 1.0);
        let max_norm = (norm_ref / 3.0) as f32;
        let (_, clip) = kernels::grad_norm(&values, chunk, &mut partials, max_norm);
        let clip_ref = max_norm as f64 / (norm_ref + 1e-6);
        assert!(
            ((clip as f64 - clip_ref) / clip_ref).abs() < 1e-6,
            "seed {seed}: clip {clip} vs {clip_ref}"
        );
        let (_, above) = kernels::grad_norm(&values, chunk, &mut partials, (norm_ref * 2.0) as f32);
        assert_eq!(above, 1.0, "a norm under the limit is not scaled");
    }
    let mut with_nan = vec![1.0f32; 100];
    with_nan[17] = f32::NAN;
    let mut partials = poisoned(10);
    let (norm, clip) = kernels::grad_norm(&with_nan, 10, &mut partials, 1.0);
    assert!(norm.is_nan() && clip == 1.0);
    with_nan[17] = f32::INFINITY;
    assert_eq!(
        kernels::grad_norm(&with_nan, 10, &mut partials, 1.0).0,
        f32::INFINITY
    );
}
