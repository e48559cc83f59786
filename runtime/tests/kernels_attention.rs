//! The attention kernels through the `Backend` trait, on every backend present (`test_device!`), against an
//! f64 reference attention that builds the dense `[queries × keys]` mask (which the kernels never do):
//!
//! - the mask on a hand-worked case: two sequences, the ranges and the keys each query sees written out by
//!   hand, each output against a softmax over exactly those keys; then the context keys no query sees get
//!   values of 1e6, which must change nothing;
//! - the forward on fresh random shapes (GQA, head dims up to 128, ranges of a DFlash block plan and arbitrary
//!   ones, queries without any key): output and log-sum-exp normwise within 2e-6 of f64, `lse = −∞` and a zero
//!   output for a query without keys;
//! - the backward against central finite differences of the f64 forward (of `L = Σ dout ∘ out`) for every
//!   element of `q`, both key sets and both value sets: normwise within 5e-6 (measured 2-4e-7: f32 sums
//!   against an f64 difference quotient); bitwise reproducible; outputs NaN-poisoned first.
//!
//! `KERNEL_TEST_SEED` reproduces a run.

mod backends;
mod kernels_support;

use backends::TestDevice;
use draftpipe_runtime::backend::{
    AttentionGrads, AttentionInputs, AttentionSaved, AttentionShape, Backend,
};
use kernels_support::{bare, down, normwise, poisoned, seed, uniform, up};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

/// A DFlash block plan: per sequence its context rows and its sorted anchors, `block` query rows per anchor.
struct Plan {
    queries: usize,
    context: usize,
    query_ranges: Vec<u32>,
    key_ranges_ctx: Vec<u32>,
    key_ranges_blk: Vec<u32>,
}

/// The plan SpecForge's mask gives: a query of the block at anchor `a` of a sequence sees that sequence's
/// context rows at positions `< a` and every row of its own block; a context key at position `p` is seen by
/// the blocks of its sequence whose anchor is `> p` (a suffix, as anchors are sorted), a block key by its block.
fn dflash_plan(seq_lens: &[usize], anchors: &[Vec<usize>], block: usize) -> Plan {
    let context: usize = seq_lens.iter().sum();
    let queries = anchors.iter().map(Vec::len).sum::<usize>() * block;
    let (mut query_ranges, mut key_ranges_ctx, mut key_ranges_blk) = (vec![], vec![], vec![]);
    let (mut seq_start, mut row) = (0u32, 0u32);
    for (&len, seq_anchors) in seq_lens.iter().zip(anchors) {
        let first_row = row;
        for &anchor in seq_anchors {
            for _ in 0..block {
                query_ranges.extend([
                    seq_start,
                    seq_start + anchor as u32,
                    row,
                    row + block as u32,
                ]);
                key_ranges_blk.extend([row, row + block as u32]);
            }
            row += block as u32;
        }
        for position in 0..len {
            let first = seq_anchors.partition_point(|&a| a <= position) as u32;
            let start = first_row + first * block as u32;
            key_ranges_ctx.extend(if start < row { [start, row] } else { [0, 0] });
        }
        seq_start += len as u32;
    }
    Plan {
        queries,
        context,
        query_ranges,
        key_ranges_ctx,
        key_ranges_blk,
    }
}

/// One attention problem: sizes, the five inputs in f32, the ranges.
struct Case {
    shape: AttentionShape,
    queries: usize,
    context: usize,
    inputs: [Vec<f32>; 5],
    query_ranges: Vec<u32>,
}

impl Case {
    fn random(rng: &mut Xoshiro256PlusPlus, shape: AttentionShape, plan: &Plan) -> Self {
        let (q_len, ctx_len, blk_len) = (
            plan.queries * shape.heads * shape.head_dim,
            plan.context * shape.kv_heads * shape.head_dim,
            plan.queries * shape.kv_heads * shape.head_dim,
        );
        Self {
            shape,
            queries: plan.queries,
            context: plan.context,
            inputs: [
                uniform(rng, q_len, 1.5),
                uniform(rng, ctx_len, 1.5),
                uniform(rng, ctx_len, 1.0),
                uniform(rng, blk_len, 1.5),
                uniform(rng, blk_len, 1.0),
            ],
            query_ranges: plan.query_ranges.clone(),
        }
    }

    /// Whether query `r` sees key `key` of the concatenated `[context | block]` keys: the dense mask.
    fn sees(&self, r: usize, key: usize) -> bool {
        let ranges = &self.query_ranges[4 * r..][..4];
        if key < self.context {
            (ranges[0] as usize..ranges[1] as usize).contains(&key)
        } else {
            (ranges[2] as usize..ranges[3] as usize).contains(&(key - self.context))
        }
    }

    /// The f64 reference: scores of every (query, key) pair, masked to −∞, softmax, weighted values.
    fn reference(&self, inputs: &[Vec<f64>; 5]) -> (Vec<f64>, Vec<f64>) {
        let AttentionShape {
            heads,
            kv_heads,
            head_dim: hd,
            scale,
        } = self.shape;
        let [q, k_ctx, v_ctx, k_blk, v_blk] = inputs;
        let keys = self.context + self.queries;
        let row = |key: usize, g: usize| (key * kv_heads + g) * hd..(key * kv_heads + g + 1) * hd;
        let (mut out, mut lse) = (
            vec![0.0; q.len()],
            vec![f64::NEG_INFINITY; self.queries * heads],
        );
        for r in 0..self.queries {
            for h in 0..heads {
                let g = h / (heads / kv_heads);
                let qr = &q[(r * heads + h) * hd..][..hd];
                let key_row = |key: usize| {
                    if key < self.context {
                        (&k_ctx[row(key, g)], &v_ctx[row(key, g)])
                    } else {
                        let key = key - self.context;
                        (&k_blk[row(key, g)], &v_blk[row(key, g)])
                    }
                };
                let scores: Vec<f64> = (0..keys)
                    .map(|key| {
                        if self.sees(r, key) {
                            let (k, _) = key_row(key);
                            scale as f64 * qr.iter().zip(k).map(|(a, b)| a * b).sum::<f64>()
                        } else {
                            f64::NEG_INFINITY
                        }
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                if max == f64::NEG_INFINITY {
                    continue;
                }
                let sum: f64 = scores.iter().map(|s| (s - max).exp()).sum();
                lse[r * heads + h] = max + sum.ln();
                let o = &mut out[(r * heads + h) * hd..][..hd];
                for (key, s) in scores.iter().enumerate() {
                    let p = (s - max).exp() / sum;
                    if p > 0.0 {
                        let (_, v) = key_row(key);
                        o.iter_mut().zip(v).for_each(|(o, v)| *o += p * v);
                    }
                }
            }
        }
        (out, lse)
    }

    fn inputs_f64(&self) -> [Vec<f64>; 5] {
        self.inputs
            .clone()
            .map(|v| v.iter().map(|&x| x as f64).collect())
    }
}

/// The forward on `be`: `(out, lse)`, outputs poisoned first.
fn forward<B: Backend>(be: &mut B, case: &Case) -> (Vec<f32>, Vec<f32>) {
    let [q, k_ctx, v_ctx, k_blk, v_blk] = case.inputs.each_ref().map(|v| up(be, v));
    let ranges = up(be, &case.query_ranges);
    let mut out = poisoned(be, q.len());
    let mut lse = poisoned(be, case.queries * case.shape.heads);
    be.attention_forward(
        AttentionInputs {
            q: q.all(),
            k_ctx: k_ctx.all(),
            v_ctx: v_ctx.all(),
            k_blk: k_blk.all(),
            v_blk: v_blk.all(),
            query_ranges: ranges.all(),
        },
        case.shape,
        out.all_mut(),
        lse.all_mut(),
    )
    .unwrap();
    (down(be, out.all()), down(be, lse.all()))
}

/// The backward on `be`: `[dq, dk_ctx, dv_ctx, dk_blk, dv_blk]`, outputs poisoned first.
fn backward<B: Backend>(be: &mut B, case: &Case, plan: &Plan, dout: &[f32]) -> [Vec<f32>; 5] {
    let (out, lse) = forward(be, case);
    let [q, k_ctx, v_ctx, k_blk, v_blk] = case.inputs.each_ref().map(|v| up(be, v));
    let ranges = up(be, &case.query_ranges);
    let (out, lse, dout) = (up(be, &out), up(be, &lse), up(be, dout));
    let (key_ctx, key_blk) = (up(be, &plan.key_ranges_ctx), up(be, &plan.key_ranges_blk));
    let mut delta = poisoned(be, lse.len());
    let mut grads = case.inputs.each_ref().map(|v| poisoned(be, v.len()));
    let [dq, dk_ctx, dv_ctx, dk_blk, dv_blk] = &mut grads;
    be.attention_backward(
        AttentionInputs {
            q: q.all(),
            k_ctx: k_ctx.all(),
            v_ctx: v_ctx.all(),
            k_blk: k_blk.all(),
            v_blk: v_blk.all(),
            query_ranges: ranges.all(),
        },
        case.shape,
        AttentionSaved {
            out: out.all(),
            dout: dout.all(),
            lse: lse.all(),
            key_ranges_ctx: key_ctx.all(),
            key_ranges_blk: key_blk.all(),
        },
        delta.all_mut(),
        AttentionGrads {
            dq: dq.all_mut(),
            dk_ctx: dk_ctx.all_mut(),
            dv_ctx: dv_ctx.all_mut(),
            dk_blk: dk_blk.all_mut(),
            dv_blk: dv_blk.all_mut(),
        },
    )
    .unwrap();
    grads.map(|g| down(be, g.all()))
}

fn check_forward(case: &Case, got: &(Vec<f32>, Vec<f32>), what: &str) {
    let (out_ref, lse_ref) = case.reference(&case.inputs_f64());
    let (out, lse) = got;
    let err = normwise(out, &out_ref);
    assert!(err <= 2e-6, "{what}: output error {err:e}");
    for (i, (&l, &want)) in lse.iter().zip(&lse_ref).enumerate() {
        if want == f64::NEG_INFINITY {
            assert_eq!(
                l,
                f32::NEG_INFINITY,
                "{what}: lse[{i}] of a query without keys"
            );
            let hd = case.shape.head_dim;
            assert!(
                out[i * hd..][..hd].iter().all(|&o| o == 0.0),
                "{what}: output of a query without keys"
            );
        } else {
            assert!(
                (l as f64 - want).abs() <= 2e-6 * want.abs().max(1.0),
                "{what}: lse[{i}] = {l} vs {want}"
            );
        }
    }
}

fn attention_mask_matches_a_hand_worked_case<D: TestDevice>(device: &D) {
    // Two sequences of 5 and 4 context rows (rows 0..5 and 5..9), blocks of 2 query rows; sequence 0 has
    // anchors 1 and 3, sequence 1 anchor 2. Query rows: 0, 1 (anchor 1), 2, 3 (anchor 3), 4, 5 (seq 1, anchor 2).
    let plan = dflash_plan(&[5, 4], &[vec![1, 3], vec![2]], 2);
    #[rustfmt::skip]
    let expected_ranges: [u32; 24] = [
        0, 1, 0, 2,   0, 1, 0, 2,   // context position 0 of sequence 0; its own block 0..2
        0, 3, 2, 4,   0, 3, 2, 4,   // context positions 0, 1, 2; block 2..4
        5, 7, 4, 6,   5, 7, 4, 6,   // sequence 1's positions 0, 1 (rows 5, 6); block 4..6
    ];
    assert_eq!(plan.query_ranges, expected_ranges);
    // Context key → the query rows that see it: positions 0 (both blocks), 1-2 (the anchor-3 block), 3-4
    // (none); sequence 1: positions 0-1 (its block), 2-3 (none).
    assert_eq!(
        plan.key_ranges_ctx,
        [0, 4, 2, 4, 2, 4, 0, 0, 0, 0, 4, 6, 4, 6, 0, 0, 0, 0]
    );
    assert_eq!(plan.key_ranges_blk, [0, 2, 0, 2, 2, 4, 2, 4, 4, 6, 4, 6]);
    // The visible keys of each query, by hand: (context rows, block rows).
    let visible: [(&[usize], &[usize]); 6] = [
        (&[0], &[0, 1]),
        (&[0], &[0, 1]),
        (&[0, 1, 2], &[2, 3]),
        (&[0, 1, 2], &[2, 3]),
        (&[5, 6], &[4, 5]),
        (&[5, 6], &[4, 5]),
    ];
    let shape = AttentionShape::new(2, 1, 4);
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed());
    let mut case = Case::random(&mut rng, shape, &plan);
    let hd = shape.head_dim;
    let mut be = bare(device);
    let (out, lse) = forward(&mut be, &case);
    for (r, (ctx, blk)) in visible.iter().enumerate() {
        for h in 0..shape.heads {
            let q = &case.inputs[0][(r * shape.heads + h) * hd..][..hd];
            let keys: Vec<(&[f32], &[f32])> = ctx
                .iter()
                .map(|&c| {
                    (
                        &case.inputs[1][c * hd..][..hd],
                        &case.inputs[2][c * hd..][..hd],
                    )
                })
                .chain(blk.iter().map(|&b| {
                    (
                        &case.inputs[3][b * hd..][..hd],
                        &case.inputs[4][b * hd..][..hd],
                    )
                }))
                .collect();
            let scores: Vec<f64> = keys
                .iter()
                .map(|(k, _)| {
                    0.5 * q
                        .iter()
                        .zip(*k)
                        .map(|(&a, &b)| a as f64 * b as f64)
                        .sum::<f64>()
                })
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = scores.iter().map(|s| (s - max).exp()).sum();
            let at = (r * shape.heads + h) * hd;
            for d in 0..hd {
                let want: f64 = keys
                    .iter()
                    .zip(&scores)
                    .map(|((_, v), s)| (s - max).exp() / sum * v[d] as f64)
                    .sum();
                assert!(
                    (out[at + d] as f64 - want).abs() < 2e-6,
                    "query {r} head {h} dim {d}"
                );
            }
            let lse_want = max + sum.ln();
            assert!(
                (lse[r * shape.heads + h] as f64 - lse_want).abs() < 2e-6,
                "lse of query {r}"
            );
        }
    }
    // The context keys no query sees carry huge values: the outputs must not move.
    for c in [3usize, 4, 7, 8] {
        case.inputs[2][c * hd..][..hd].fill(1e6);
    }
    let (leaky, _) = forward(&mut be, &case);
    assert_eq!(leaky, out, "a masked context key changed an output");
}
test_device!(attention_mask_matches_a_hand_worked_case);

/// A random DFlash plan: 1-3 sequences, up to 4 anchors each (anchor 0 too: a block without context), blocks
/// of 1-5 rows.
fn random_plan(rng: &mut Xoshiro256PlusPlus, max_len: usize) -> Plan {
    let sequences = rng.random_range(1..4);
    let block = rng.random_range(1..6);
    let seq_lens: Vec<usize> = (0..sequences)
        .map(|_| rng.random_range(2..max_len))
        .collect();
    let anchors: Vec<Vec<usize>> = seq_lens
        .iter()
        .map(|&len| {
            let mut anchors: Vec<usize> = (0..len - 1).collect();
            for i in (1..anchors.len()).rev() {
                anchors.swap(i, rng.random_range(0..=i));
            }
            anchors.truncate(rng.random_range(1..5));
            anchors.sort_unstable();
            anchors
        })
        .collect();
    dflash_plan(&seq_lens, &anchors, block)
}

fn random_shape(rng: &mut Xoshiro256PlusPlus, max_dim: usize) -> AttentionShape {
    let kv_heads = rng.random_range(1..4);
    let heads = kv_heads * rng.random_range(1..4);
    AttentionShape::new(heads, kv_heads, rng.random_range(1..=max_dim))
}

fn attention_forward_matches_f64<D: TestDevice>(device: &D) {
    let mut be = bare(device);
    forward_trials(|case| forward(&mut be, case));
}
test_device!(attention_forward_matches_f64);

/// Random forward cases (see the module docs) through `forward`, each against f64.
fn forward_trials(mut forward: impl FnMut(&Case) -> (Vec<f32>, Vec<f32>)) {
    let seed = seed();
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    for trial in 0..6 {
        let plan = random_plan(&mut rng, 40);
        let shape = random_shape(&mut rng, 128);
        let mut case = Case::random(&mut rng, shape, &plan);
        if trial % 2 == 1 {
            // Arbitrary ranges, empty ones included (and some queries with no key at all).
            for r in 0..case.queries {
                let mut pick = |limit: usize| {
                    let (a, b) = (rng.random_range(0..=limit), rng.random_range(0..=limit));
                    if rng.random_range(0..4) == 0 {
                        (a, a)
                    } else {
                        (a.min(b), a.max(b))
                    }
                };
                let ((c0, c1), (b0, b1)) = (pick(case.context), pick(case.queries));
                case.query_ranges[4 * r..][..4]
                    .copy_from_slice(&[c0 as u32, c1 as u32, b0 as u32, b1 as u32]);
            }
            case.query_ranges[..4].copy_from_slice(&[0, 0, 0, 0]);
        }
        let got = forward(&case);
        check_forward(
            &case,
            &got,
            &format!("seed {seed}, trial {trial}, {shape:?}"),
        );
    }
}

fn attention_backward_matches_finite_differences<D: TestDevice>(device: &D) {
    let mut be = bare(device);
    backward_trials(|case, plan, dout| backward(&mut be, case, plan, dout));
}
test_device!(attention_backward_matches_finite_differences);

/// Random backward cases through `backward`, each against central finite differences of the f64 forward.
fn backward_trials(mut backward: impl FnMut(&Case, &Plan, &[f32]) -> [Vec<f32>; 5]) {
    let seed = seed();
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    for (trial, max_dim) in [(0, 8), (1, 40)] {
        // A plan where some context key is seen, so the context gradients are not trivially zero.
        let plan = loop {
            let plan = random_plan(&mut rng, 12);
            if plan.key_ranges_ctx.chunks(2).any(|r| r[0] < r[1]) {
                break plan;
            }
        };
        let shape = random_shape(&mut rng, max_dim);
        let case = Case::random(&mut rng, shape, &plan);
        let dout = uniform(&mut rng, case.inputs[0].len(), 1.0);
        let grads = backward(&case, &plan, &dout);
        let again = backward(&case, &plan, &dout);
        assert_eq!(
            grads, again,
            "seed {seed}: the backward is not reproducible"
        );

        let loss = |inputs: &[Vec<f64>; 5]| -> f64 {
            let (out, _) = case.reference(inputs);
            out.iter().zip(&dout).map(|(o, &g)| o * g as f64).sum()
        };
        let mut inputs = case.inputs_f64();
        let h = 1e-6;
        for (which, (name, grad)) in ["dq", "dk_ctx", "dv_ctx", "dk_blk", "dv_blk"]
            .iter()
            .zip(&grads)
            .enumerate()
        {
            let mut fd = vec![0.0f64; grad.len()];
            for (i, slot) in fd.iter_mut().enumerate() {
                let x = inputs[which][i];
                inputs[which][i] = x + h;
                let up = loss(&inputs);
                inputs[which][i] = x - h;
                let low = loss(&inputs);
                inputs[which][i] = x;
                *slot = (up - low) / (2.0 * h);
            }
            let err = normwise(grad, &fd);
            assert!(
                err <= 5e-6,
                "seed {seed}, trial {trial}, {shape:?}: {name} off finite differences by {err:e}"
            );
        }
    }
}

/// The CPU backend runs its own vectorised attention (`HostKernels::Lanes`); the kernel table's bodies, which the
/// GPU runs, pass the same checks on the host through their generated launchers.
mod kernel_table_bodies {
    use super::*;
    use draftpipe_runtime::backend::cpu::attention::{
        AttentionGradSlices, AttentionSlices, HostKernels, attention_backward, attention_forward,
    };

    fn slices(case: &Case) -> AttentionSlices<'_> {
        let [q, k_ctx, v_ctx, k_blk, v_blk] = &case.inputs;
        AttentionSlices {
            q,
            k_ctx,
            v_ctx,
            k_blk,
            v_blk,
            query_ranges: &case.query_ranges,
        }
    }

    fn forward(case: &Case) -> (Vec<f32>, Vec<f32>) {
        let mut out = vec![f32::NAN; case.inputs[0].len()];
        let mut lse = vec![f32::NAN; case.queries * case.shape.heads];
        attention_forward(
            HostKernels::Planes,
            slices(case),
            case.shape,
            &mut out,
            &mut lse,
        );
        (out, lse)
    }

    fn backward(case: &Case, plan: &Plan, dout: &[f32]) -> [Vec<f32>; 5] {
        let (out, lse) = forward(case);
        let mut delta = vec![f32::NAN; lse.len()];
        let mut grads = case.inputs.each_ref().map(|v| vec![f32::NAN; v.len()]);
        let [dq, dk_ctx, dv_ctx, dk_blk, dv_blk] = &mut grads;
        attention_backward(
            HostKernels::Planes,
            slices(case),
            case.shape,
            &out,
            dout,
            &lse,
            &plan.key_ranges_ctx,
            &plan.key_ranges_blk,
            &mut delta,
            AttentionGradSlices {
                dq,
                dk_ctx,
                dv_ctx,
                dk_blk,
                dv_blk,
            },
        );
        grads
    }

    #[test]
    fn forward_matches_f64() {
        forward_trials(forward);
    }

    #[test]
    fn backward_matches_finite_differences() {
        backward_trials(backward);
    }
}
