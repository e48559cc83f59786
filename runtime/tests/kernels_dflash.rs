//! The small DFlash kernels through the `Backend` trait, on every backend present (`test_device!`), against
//! f64 references on fresh random inputs (`KERNEL_TEST_SEED` reproduces), outputs NaN-poisoned first:
//!
//! - `adamw_advance` with a schedule: the learning rate of every applied step equals Hugging Face's
//!   `get_{linear,cosine}_schedule_with_warmup` factor (relative 1e-6), a skipped step advances neither the
//!   schedule nor the bias corrections, and the corrections stay PyTorch's.
//! - `embedding_gather`: bit-exact rows.
//! - `rope`: against the closed form (a cos/sin rotation of each pair `(j, j + hd/2)` by
//!   `position · θ^(−2j/hd)`, computed in f64); the error bound grows with the position as the f32 angle's
//!   rounding does: `|err| ≤ (2e-6 + 5e-7 · position) · (|a| + |b|)` per pair; within 2e-6 below position 16;
//!   `inverse` undoes the rotation (1e-6) and is its adjoint (`⟨R x, y⟩ = ⟨x, R⁻¹ y⟩`, relative 1e-6).
//! - `weighted_vocab_loss`: row losses and the gradient normwise within 2e-6 of f64, `correct` exact
//!   (including ties, where `torch.argmax` takes the first index), ignored rows zero, −∞ logits adding nothing,
//!   at vocabularies below, at and past a plane's 32 lanes.

mod backends;
mod kernels_support;

use backends::TestDevice;
use draftpipe_runtime::backend::{
    AdamWHyper, Backend, SCHEDULE_CONSTANT, SCHEDULE_COSINE, SCHEDULE_LINEAR,
};
use kernels_support::{bare, down, normwise, poisoned, seed, uniform, up};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

/// Hugging Face's schedule factor for the step after `s` applied steps.
fn hf_factor(kind: u32, s: f64, warmup: f64, total: f64) -> f64 {
    if kind == SCHEDULE_CONSTANT {
        return 1.0;
    }
    if s < warmup {
        return s / warmup.max(1.0);
    }
    let span = (total - warmup).max(1.0);
    if kind == SCHEDULE_LINEAR {
        ((total - s) / span).max(0.0)
    } else {
        (0.5 * (1.0 + (std::f64::consts::PI * (s - warmup) / span).cos())).max(0.0)
    }
}

fn adamw_schedule_follows_hugging_face<D: TestDevice>(device: &D) {
    let mut be = bare(device);
    for (kind, warmup, total) in [
        (SCHEDULE_CONSTANT, 0.0, 10.0),
        (SCHEDULE_LINEAR, 3.0, 10.0),
        (SCHEDULE_COSINE, 3.0, 10.0),
        (SCHEDULE_COSINE, 0.0, 7.0),
        (SCHEDULE_LINEAR, 1.0, 1.0),
    ] {
        let hyper = AdamWHyper {
            lr: 3e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            schedule_kind: kind,
            warmup,
            total,
        };
        let mut state = up(&mut be, &[0.0f64, 1.0, 1.0]);
        let mut step = poisoned(&mut be, 7);
        let mut norm = up(&mut be, &[1.0f32]);
        let mut applied = 0u32;
        for call in 0..12 {
            // Call 5 is skipped (non-finite norm): nothing may advance.
            let skipped = call == 5;
            be.upload(norm.all_mut(), &[if skipped { f32::NAN } else { 1.0 }])
                .unwrap();
            be.adamw_advance(norm.all(), hyper, state.all_mut(), step.all_mut())
                .unwrap();
            let scalars = down(&mut be, step.all());
            let counts = down(&mut be, state.all());
            if skipped {
                assert_eq!(
                    counts[0], applied as f64,
                    "a skipped step advanced the count"
                );
                continue;
            }
            let factor = hf_factor(kind, applied as f64, warmup as f64, total as f64);
            applied += 1;
            let lr = 3e-3 * factor;
            let what = format!("kind {kind} warmup {warmup} total {total}, step {applied}");
            assert!(
                (scalars[0] as f64 - lr).abs() <= 1e-6 * 3e-3,
                "{what}: lr {} vs {lr}",
                scalars[0]
            );
            let bc1 = 1.0 - 0.9f64.powi(applied as i32);
            let bc2 = 1.0 - 0.95f64.powi(applied as i32);
            assert!(
                (scalars[5] as f64 - lr / bc1).abs() <= 1e-6 * 3e-3 / bc1,
                "{what}: step size"
            );
            assert!(
                (scalars[6] as f64 - bc2.sqrt()).abs() <= 1e-6,
                "{what}: bias correction"
            );
            assert_eq!(counts[0], applied as f64, "{what}: count");
        }
    }
}
test_device!(adamw_schedule_follows_hugging_face);

fn embedding_gather_copies_rows<D: TestDevice>(device: &D) {
    let mut be = bare(device);
    let seed = seed();
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    for _ in 0..4 {
        let (vocab, hidden, rows) = (
            rng.random_range(1..300),
            rng.random_range(1..200),
            rng.random_range(1..100),
        );
        let table = uniform(&mut rng, vocab * hidden, 2.0);
        let ids: Vec<u32> = (0..rows)
            .map(|_| rng.random_range(0..vocab as u32))
            .collect();
        let (table_buf, ids_buf) = (up(&mut be, &table), up(&mut be, &ids));
        let mut out = poisoned(&mut be, rows * hidden);
        be.embedding_gather(table_buf.all(), ids_buf.all(), out.all_mut())
            .unwrap();
        let got = down(&mut be, out.all());
        for (r, &id) in ids.iter().enumerate() {
            assert_eq!(
                got[r * hidden..][..hidden],
                table[id as usize * hidden..][..hidden],
                "seed {seed}: row {r} (id {id})"
            );
        }
    }
}
test_device!(embedding_gather_copies_rows);

fn rope_matches_its_closed_form<D: TestDevice>(device: &D) {
    let mut be = bare(device);
    let seed = seed();
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    for theta in [10_000.0f32, 1_000_000.0] {
        let (rows, heads) = (rng.random_range(1..40), rng.random_range(1..5));
        let head_dim = 2 * rng.random_range(1..65);
        let positions: Vec<u32> = (0..rows)
            .map(|r| {
                if r % 3 == 0 {
                    rng.random_range(0..16)
                } else {
                    rng.random_range(0..4096)
                }
            })
            .collect();
        let x = uniform(&mut rng, rows * heads * head_dim, 1.0);
        let y = uniform(&mut rng, rows * heads * head_dim, 1.0);
        let pos_buf = up(&mut be, &positions);
        let mut rotated = up(&mut be, &x);
        be.rope(
            rotated.all_mut(),
            pos_buf.all(),
            theta,
            heads,
            head_dim,
            false,
        )
        .unwrap();
        let got = down(&mut be, rotated.all());
        let half = head_dim / 2;
        let mut worst_small = 0.0f64;
        for (r, &position) in positions.iter().enumerate() {
            let position = position as f64;
            for h in 0..heads {
                let base = (r * heads + h) * head_dim;
                for j in 0..half {
                    let angle = position * (theta as f64).powf(-2.0 * j as f64 / head_dim as f64);
                    let (a, b) = (x[base + j] as f64, x[base + j + half] as f64);
                    let (sin, cos) = angle.sin_cos();
                    let want = [a * cos - b * sin, b * cos + a * sin];
                    let err = (got[base + j] as f64 - want[0])
                        .abs()
                        .max((got[base + j + half] as f64 - want[1]).abs());
                    let bound = (2e-6 + 5e-7 * position) * (a.abs() + b.abs());
                    assert!(
                        err <= bound,
                        "seed {seed}: theta {theta}, row {r} (position {position}), head {h}, pair {j}: error \
                         {err:e} > {bound:e}"
                    );
                    if position < 16.0 {
                        worst_small = worst_small.max(err / (a.abs() + b.abs()).max(1e-30));
                    }
                }
            }
        }
        assert!(
            worst_small <= 2e-6,
            "seed {seed}: small positions {worst_small:e}"
        );

        // The inverse undoes the rotation and is its adjoint.
        be.rope(
            rotated.all_mut(),
            pos_buf.all(),
            theta,
            heads,
            head_dim,
            true,
        )
        .unwrap();
        let back = down(&mut be, rotated.all());
        let undo = x
            .iter()
            .zip(&back)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(
            undo <= 1e-6,
            "seed {seed}: inverse ∘ forward off by {undo:e}"
        );
        let mut y_back = up(&mut be, &y);
        be.rope(
            y_back.all_mut(),
            pos_buf.all(),
            theta,
            heads,
            head_dim,
            true,
        )
        .unwrap();
        let y_back = down(&mut be, y_back.all());
        let dot = |a: &[f32], b: &[f32]| {
            a.iter()
                .zip(b)
                .map(|(&p, &q)| p as f64 * q as f64)
                .sum::<f64>()
        };
        let (lhs, rhs) = (dot(&got, &y), dot(&x, &y_back));
        let norms = (dot(&x, &x) * dot(&y, &y)).sqrt();
        assert!(
            (lhs - rhs).abs() <= 1e-6 * norms,
            "seed {seed}: <Rx, y> = {lhs} but <x, R⁻¹y> = {rhs}"
        );
    }
}
test_device!(rope_matches_its_closed_form);

fn weighted_vocab_loss_matches_f64<D: TestDevice>(device: &D) {
    let mut be = bare(device);
    let seed = seed();
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    // Below one plane's 32 lanes, exactly 32, and partial last lane rounds (the warp's lane split).
    for vocab in [7usize, 31, 32, 333, 1001] {
        let rows = rng.random_range(5..40);
        let mut logits = uniform(&mut rng, rows * vocab, 4.0);
        let mut labels: Vec<i32> = (0..rows)
            .map(|_| {
                if rng.random_range(0..5) == 0 {
                    -1
                } else {
                    rng.random_range(0..vocab as i32)
                }
            })
            .collect();
        // Row 0: a tie for the maximum, the label on the second copy (argmax is the first: wrong).
        // Row 1: the label is the clear maximum (right). Row 2: the label on the first of a tie (right).
        let (first, second) = (0usize, vocab - 1);
        for row in [0usize, 2] {
            logits[row * vocab + first] = 9.0;
            logits[row * vocab + second] = 9.0;
        }
        labels[0] = second as i32;
        labels[2] = first as i32;
        labels[1] = rng.random_range(0..vocab as i32);
        logits[vocab + labels[1] as usize] = 12.0;
        // Row 3: −∞ logits (a masked vocabulary entry) at the start of lanes and elsewhere, none the label's
        // or the maximum: they add nothing to the sum and get a zero gradient.
        labels[3] = (vocab - 1) as i32;
        for v in (0..vocab - 1).step_by(3) {
            logits[3 * vocab + v] = f32::NEG_INFINITY;
        }
        logits[3 * vocab + vocab - 1] = 5.0;
        let weights: Vec<f32> = (0..rows).map(|_| rng.random_range(0.05f32..1.0)).collect();
        let total: f64 = (0..rows)
            .filter(|&r| labels[r] >= 0)
            .map(|r| weights[r] as f64)
            .sum();
        let norm = (1.0 / total) as f32;

        let mut logits_buf = up(&mut be, &logits);
        let (labels_buf, weights_buf, norm_buf) = (
            up(&mut be, &labels),
            up(&mut be, &weights),
            up(&mut be, &[norm]),
        );
        let (mut loss_buf, mut correct_buf) = (poisoned(&mut be, rows), poisoned(&mut be, rows));
        be.weighted_vocab_loss(
            (logits_buf.all_mut(), None),
            labels_buf.all(),
            weights_buf.all(),
            norm_buf.all(),
            loss_buf.all_mut(),
            correct_buf.all_mut(),
            vocab,
        )
        .unwrap();
        let (grad, row_loss, correct) = (
            down(&mut be, logits_buf.all()),
            down(&mut be, loss_buf.all()),
            down(&mut be, correct_buf.all()),
        );

        let (mut grad_ref, mut loss_ref) = (vec![0.0f64; rows * vocab], vec![0.0f64; rows]);
        for r in 0..rows {
            let row = &logits[r * vocab..][..vocab];
            let Ok(label) = usize::try_from(labels[r]) else {
                assert_eq!(
                    correct[r], 0.0,
                    "seed {seed}: ignored row {r} counted correct"
                );
                continue;
            };
            let s = weights[r] as f64 * norm as f64;
            let max = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
            let sum: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
            loss_ref[r] = s * (max + sum.ln() - row[label] as f64);
            for v in 0..vocab {
                let p = (row[v] as f64 - max).exp() / sum;
                grad_ref[r * vocab + v] = s * (p - f64::from(u8::from(v == label)));
            }
            let argmax = (0..vocab).fold(0, |best, v| if row[v] > row[best] { v } else { best });
            assert_eq!(
                correct[r],
                f32::from(u8::from(argmax == label)),
                "seed {seed}: row {r} correct"
            );
        }
        assert_eq!(
            (correct[0], correct[1], correct[2]),
            (0.0, 1.0, 1.0),
            "seed {seed}: ties"
        );
        let (loss_err, grad_err) = (normwise(&row_loss, &loss_ref), normwise(&grad, &grad_ref));
        assert!(loss_err <= 2e-6, "seed {seed}: row loss error {loss_err:e}");
        assert!(grad_err <= 2e-6, "seed {seed}: gradient error {grad_err:e}");
    }
}
test_device!(weighted_vocab_loss_matches_f64);
