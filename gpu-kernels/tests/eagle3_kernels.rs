//! EAGLE-3's kernel bodies (`gpu-kernels/src/eagle3.rs`) on the host plane, against f64 references written from
//! the rules (the unroll's attention: step 0's keys `t' ≤ t` of the sequence, then one key per cached step at
//! `t`; the soft-label cross entropy; the teacher's flag; the shifts), every output poisoned with NaN first so an
//! element the kernel skips fails. Each reference also has a deliberate mistake that the comparison must
//! reject (the causal bound off by one, the diagonal keys dropped, an unnormalised teacher, a shift by one row
//! too few), so a check that would pass anything fails here.
//!
//! Tolerances: 1e-5 relative (f32 sums of a few dozen terms against f64), attention gradients 1e-4 (central
//! differences of the f64 forward with step 1e-6).

use draftpipe_gpu_kernels::attention::attention_delta;
use draftpipe_gpu_kernels::eagle3::{
    argmax_in_draft_row, concat_columns, eagle3_attention_backward_kv, eagle3_attention_backward_q,
    eagle3_attention_forward, shift_ids, shift_rows, soft_label_loss_row, split_columns,
    step_mask_counts,
};
use draftpipe_gpu_kernels::plane::HostPlane;

/// A small deterministic generator (no dependency): values uniform in ±1.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
    }

    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next() as f32).collect()
    }
}

/// `max |a − b| / max(1, max |b|)`.
fn rel_err(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(1.0f64, |m, x| m.max(x.abs()));
    a.iter()
        .zip(b)
        .map(|(&x, &y)| {
            let d = (f64::from(x) - y).abs();
            if d.is_nan() { f64::INFINITY } else { d }
        })
        .fold(0.0, f64::max)
        / scale
}

#[derive(Clone, Copy)]
struct Shape {
    rows: usize,
    padded_len: usize,
    step: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

/// Which keys query row `t` of step `step` sees: `(step, row)` pairs in softmax order.
#[derive(Clone, Copy, PartialEq)]
enum Rule {
    /// The kernels' rule.
    Right,
    /// A mistake: the causal bound includes the next row.
    CausalOffByOne,
    /// A mistake: no cached step's key.
    NoDiagonal,
}

fn keys_seen(s: Shape, t: usize, rule: Rule) -> Vec<(usize, usize)> {
    let start = t / s.padded_len * s.padded_len;
    let end = match rule {
        Rule::CausalOffByOne => (t + 2).min(start + s.padded_len),
        _ => t + 1,
    };
    let mut keys: Vec<(usize, usize)> = (start..end).map(|u| (0, u)).collect();
    if rule != Rule::NoDiagonal {
        keys.extend((1..=s.step).map(|j| (j, t)));
    }
    keys
}

/// f64 attention forward: `out [rows, heads, hd]`.
fn attention_ref(s: Shape, q: &[f64], k: &[f64], v: &[f64], rule: Rule) -> Vec<f64> {
    let (hd, group) = (s.head_dim, s.heads / s.kv_heads);
    let scale = 1.0 / (hd as f64).sqrt();
    let mut out = vec![0.0; s.rows * s.heads * hd];
    for t in 0..s.rows {
        for h in 0..s.heads {
            let g = h / group;
            let qr = &q[(t * s.heads + h) * hd..][..hd];
            let seen = keys_seen(s, t, rule);
            let at = |(j, u): (usize, usize)| ((j * s.rows + u) * s.kv_heads + g) * hd;
            let scores: Vec<f64> = seen
                .iter()
                .map(|&key| scale * (0..hd).map(|d| qr[d] * k[at(key) + d]).sum::<f64>())
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = scores.iter().map(|x| (x - max).exp()).sum();
            for (&key, x) in seen.iter().zip(&scores) {
                let p = (x - max).exp() / sum;
                for d in 0..hd {
                    out[(t * s.heads + h) * hd + d] += p * v[at(key) + d];
                }
            }
        }
    }
    out
}

fn widen(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| f64::from(v)).collect()
}

fn run_forward(s: Shape, q: &[f32], k: &[f32], v: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let mut out = vec![f32::NAN; s.rows * s.heads * s.head_dim];
    let mut lse = vec![f32::NAN; s.rows * s.heads];
    let scale = 1.0 / (s.head_dim as f32).sqrt();
    for index in 0..s.rows * s.heads {
        // SAFETY: the buffers hold the layouts of `s`.
        unsafe {
            eagle3_attention_forward(
                q.as_ptr(),
                k.as_ptr(),
                v.as_ptr(),
                out.as_mut_ptr(),
                lse.as_mut_ptr(),
                s.rows,
                s.padded_len,
                s.step,
                s.heads,
                s.kv_heads,
                s.head_dim,
                scale,
                HostPlane,
                index,
            );
        }
    }
    (out, lse)
}

const SHAPE: Shape = Shape {
    rows: 10,
    padded_len: 5,
    step: 2,
    heads: 4,
    kv_heads: 2,
    head_dim: 6,
};

fn inputs(s: Shape, seed: u64) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut rng = Lcg(seed);
    let keys = (s.step + 1) * s.rows * s.kv_heads * s.head_dim;
    (
        rng.vec(s.rows * s.heads * s.head_dim),
        rng.vec(keys),
        rng.vec(keys),
    )
}

#[test]
fn attention_forward_matches_the_rule_and_a_wrong_rule_does_not() {
    let s = SHAPE;
    let (q, k, v) = inputs(s, 1);
    let (out, lse) = run_forward(s, &q, &k, &v);
    assert!(lse.iter().all(|x| x.is_finite()), "every lse written");
    let (q64, k64, v64) = (widen(&q), widen(&k), widen(&v));
    let want = attention_ref(s, &q64, &k64, &v64, Rule::Right);
    let err = rel_err(&out, &want);
    assert!(err < 1e-5, "forward: {err:.2e}");
    for mistake in [Rule::CausalOffByOne, Rule::NoDiagonal] {
        let wrong = attention_ref(s, &q64, &k64, &v64, mistake);
        assert!(rel_err(&out, &wrong) > 1e-3, "a wrong mask must not match");
    }
}

#[test]
fn attention_backward_matches_central_differences_of_the_forward() {
    let s = SHAPE;
    let (q, k, v) = inputs(s, 2);
    let dout = Lcg(3).vec(q.len());
    let (out, lse) = run_forward(s, &q, &k, &v);
    let scale = 1.0 / (s.head_dim as f32).sqrt();
    let mut delta = vec![f32::NAN; s.rows * s.heads];
    let mut dq = vec![f32::NAN; q.len()];
    // The stacked gradients are added into: start from a known offset, so a kernel that overwrote would fail.
    let mut dk = vec![0.5f32; k.len()];
    let mut dv = vec![0.5f32; v.len()];
    // SAFETY: the buffers hold the layouts of `s`.
    unsafe {
        for index in 0..s.rows * s.heads {
            attention_delta(
                out.as_ptr(),
                dout.as_ptr(),
                delta.as_mut_ptr(),
                s.head_dim,
                HostPlane,
                index,
            );
        }
        for index in 0..s.rows * s.heads {
            eagle3_attention_backward_q(
                q.as_ptr(),
                k.as_ptr(),
                v.as_ptr(),
                dout.as_ptr(),
                lse.as_ptr(),
                delta.as_ptr(),
                dq.as_mut_ptr(),
                s.rows,
                s.padded_len,
                s.step,
                s.heads,
                s.kv_heads,
                s.head_dim,
                scale,
                HostPlane,
                index,
            );
        }
        for index in 0..s.rows * s.kv_heads {
            eagle3_attention_backward_kv(
                q.as_ptr(),
                dout.as_ptr(),
                lse.as_ptr(),
                delta.as_ptr(),
                k.as_ptr(),
                v.as_ptr(),
                dk.as_mut_ptr(),
                dv.as_mut_ptr(),
                s.rows,
                s.padded_len,
                s.step,
                s.heads,
                s.kv_heads,
                s.head_dim,
                scale,
                HostPlane,
                index,
            );
        }
    }
    let (q64, k64, v64, g64) = (widen(&q), widen(&k), widen(&v), widen(&dout));
    let objective = |q: &[f64], k: &[f64], v: &[f64]| -> f64 {
        attention_ref(s, q, k, v, Rule::Right)
            .iter()
            .zip(&g64)
            .map(|(a, b)| a * b)
            .sum()
    };
    let fd = |x: &[f64], which: usize| -> Vec<f64> {
        let step = 1e-6;
        (0..x.len())
            .map(|i| {
                let mut plus = x.to_vec();
                let mut minus = x.to_vec();
                plus[i] += step;
                minus[i] -= step;
                let eval = |p: &[f64]| match which {
                    0 => objective(p, &k64, &v64),
                    1 => objective(&q64, p, &v64),
                    _ => objective(&q64, &k64, p),
                };
                (eval(&plus) - eval(&minus)) / (2.0 * step)
            })
            .collect()
    };
    let (fq, fk, fv) = (fd(&q64, 0), fd(&k64, 1), fd(&v64, 2));
    let shifted = |x: &[f64]| x.iter().map(|v| v + 0.5).collect::<Vec<_>>();
    for (name, got, want) in [
        ("dq", &dq, fq),
        ("dk", &dk, shifted(&fk)),
        ("dv", &dv, shifted(&fv)),
    ] {
        let err = rel_err(got, &want);
        assert!(err < 1e-4, "{name}: {err:.2e}");
    }
    // Keys of steps past `step` are never read: their gradients keep the offset (all of them here are read).
    assert!(fk.iter().any(|x| x.abs() > 1e-3), "the keys matter");
}

/// f64 soft-label loss of one row: `(−Σ p log q, q − p)`.
fn soft_label_ref(draft: &[f64], teacher: &[f64], normalise_teacher: bool) -> (f64, Vec<f64>) {
    let softmax = |x: &[f64]| {
        let max = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = x.iter().map(|v| (v - max).exp()).collect();
        let sum: f64 = e.iter().sum();
        e.into_iter().map(|v| v / sum).collect::<Vec<_>>()
    };
    let q = softmax(draft);
    let p: Vec<f64> = if normalise_teacher {
        softmax(teacher)
    } else {
        teacher.iter().map(|v| v.exp()).collect()
    };
    let loss = -p.iter().zip(&q).map(|(a, b)| a * b.ln()).sum::<f64>();
    (loss, q.iter().zip(&p).map(|(a, b)| a - b).collect())
}

#[test]
fn soft_label_loss_matches_the_reference_per_row() {
    let (rows, vocab, scale) = (5, 37, 0.25f32);
    let mut rng = Lcg(4);
    let draft = rng
        .vec(rows * vocab)
        .iter()
        .map(|x| 3.0 * x)
        .collect::<Vec<f32>>();
    let mut teacher: Vec<f32> = rng.vec(rows * vocab).iter().map(|x| 3.0 * x).collect();
    // Row 1's teacher agrees with the draft's argmax; row 3 is not supervised.
    let best = (0..vocab)
        .max_by(|&a, &b| draft[vocab + a].total_cmp(&draft[vocab + b]))
        .unwrap();
    teacher[vocab + best] = 10.0;
    let weights = [1.0f32, 2.0, 0.5, 0.0, 1.0];
    let mut logits = draft.clone();
    let mut row_loss = vec![f32::NAN; rows];
    let mut correct = vec![f32::NAN; rows];
    for row in 0..rows {
        // SAFETY: the buffers hold `rows` rows of `vocab`.
        unsafe {
            soft_label_loss_row(
                logits.as_mut_ptr(),
                teacher.as_ptr(),
                weights.as_ptr(),
                row_loss.as_mut_ptr(),
                correct.as_mut_ptr(),
                scale,
                vocab,
                HostPlane,
                row,
            );
        }
    }
    for row in 0..rows {
        let r = row * vocab..(row + 1) * vocab;
        let w = f64::from(weights[row] * scale);
        let (loss, grad) =
            soft_label_ref(&widen(&draft[r.clone()]), &widen(&teacher[r.clone()]), true);
        let want: Vec<f64> = grad.iter().map(|g| w * g).collect();
        assert!(
            rel_err(&logits[r.clone()], &want) < 1e-5,
            "row {row}: gradient"
        );
        assert!(
            (f64::from(row_loss[row]) - w * loss).abs() < 1e-5 * (w * loss).abs().max(1.0),
            "row {row}: loss"
        );
        if row == 3 {
            assert_eq!(
                (row_loss[row], correct[row]),
                (0.0, 0.0),
                "an unsupervised row is zero"
            );
        }
        let (wrong, _) = soft_label_ref(&widen(&draft[r.clone()]), &widen(&teacher[r]), false);
        if w > 0.0 {
            assert!(
                (f64::from(row_loss[row]) - w * wrong).abs() > 1e-3,
                "an unnormalised teacher differs"
            );
        }
    }
    assert_eq!(correct[1], 1.0, "the argmax agreement");
}

#[test]
fn the_teacher_flag_needs_the_mask_and_a_draft_argmax() {
    let (rows, vocab) = (4, 9);
    let mut logits = vec![0.0f32; rows * vocab];
    for (row, best) in [(0, 2), (1, 3), (2, 2), (3, 8)] {
        logits[row * vocab + best] = 1.0;
    }
    let mut t2d = vec![0u8; vocab];
    t2d[2] = 1;
    t2d[8] = 1;
    let mask = [1u8, 1, 0, 1];
    let mut valid = vec![f32::NAN; rows];
    for row in 0..rows {
        // SAFETY: the buffers hold `rows` rows of `vocab`.
        unsafe {
            argmax_in_draft_row(
                logits.as_ptr(),
                t2d.as_ptr(),
                mask.as_ptr(),
                valid.as_mut_ptr(),
                vocab,
                HostPlane,
                row,
            );
        }
    }
    assert_eq!(valid, [1.0, 0.0, 0.0, 1.0]);
}

#[test]
fn shifts_stay_inside_each_sequence() {
    let (padded_len, sequences, width) = (4, 2, 3);
    let n = padded_len * sequences * width;
    let src: Vec<f32> = (0..n).map(|i| i as f32 + 1.0).collect();
    for shift in 0..=padded_len {
        let mut dst = vec![f32::NAN; n];
        // SAFETY: `n` elements each; one chunk covers them.
        unsafe {
            shift_rows(
                src.as_ptr(),
                dst.as_mut_ptr(),
                width,
                padded_len,
                shift,
                n,
                n,
                0,
            )
        };
        let want: Vec<f32> = (0..n)
            .map(|e| {
                let r = e / width;
                if r % padded_len + shift < padded_len {
                    src[e + shift * width]
                } else {
                    0.0
                }
            })
            .collect();
        assert_eq!(dst, want, "shift {shift}");
        if shift > 0 {
            // The mistake: shifting by one row fewer.
            let wrong: Vec<f32> = (0..n)
                .map(|e| {
                    let r = e / width;
                    let s = shift - 1;
                    if r % padded_len + s < padded_len {
                        src[e + s * width]
                    } else {
                        0.0
                    }
                })
                .collect();
            assert_ne!(dst, wrong);
        }
    }
    let ids: Vec<u32> = (10..18).collect();
    let mut shifted = vec![u32::MAX; ids.len()];
    for row in 0..ids.len() {
        // SAFETY: `ids.len()` rows.
        unsafe { shift_ids(ids.as_ptr(), shifted.as_mut_ptr(), padded_len, 1, row) };
    }
    assert_eq!(shifted, [11, 12, 13, 0, 15, 16, 17, 0]);
    let mask = [0u8, 1, 1, 1, 1, 0, 1, 1];
    let mut counts = vec![f32::NAN; 3];
    // SAFETY: `mask` has 8 rows, `counts` 3 steps.
    unsafe {
        step_mask_counts(
            mask.as_ptr(),
            counts.as_mut_ptr(),
            8,
            padded_len,
            3,
            HostPlane,
        )
    };
    // Step k counts mask[t + k] over the rows whose t + k stays in the sequence.
    assert_eq!(counts, [6.0, 5.0, 4.0]);
}

#[test]
fn columns_concatenate_and_split_back() {
    let (rows, wa, wb) = (3, 2, 4);
    let a: Vec<f32> = (0..rows * wa).map(|i| i as f32).collect();
    let b: Vec<f32> = (0..rows * wb).map(|i| 100.0 + i as f32).collect();
    let n = rows * (wa + wb);
    let mut out = vec![f32::NAN; n];
    // SAFETY: the sizes above; one chunk.
    unsafe { concat_columns(a.as_ptr(), b.as_ptr(), out.as_mut_ptr(), wa, wb, n, n, 0) };
    assert_eq!(&out[..wa + wb], &[0.0, 1.0, 100.0, 101.0, 102.0, 103.0]);
    let (mut a2, mut b2) = (vec![f32::NAN; a.len()], vec![f32::NAN; b.len()]);
    // SAFETY: as above.
    unsafe {
        split_columns(
            out.as_ptr(),
            a2.as_mut_ptr(),
            b2.as_mut_ptr(),
            wa,
            wb,
            n,
            5,
            0,
        )
    };
    // SAFETY: the remaining chunks.
    for chunk in 1..n.div_ceil(5) {
        unsafe {
            split_columns(
                out.as_ptr(),
                a2.as_mut_ptr(),
                b2.as_mut_ptr(),
                wa,
                wb,
                n,
                5,
                chunk,
            )
        };
    }
    assert_eq!((a2, b2), (a, b));
}
