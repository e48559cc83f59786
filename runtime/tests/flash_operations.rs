//! The flash-attention operations of the `Backend` trait (`backend/flash.rs`) with exactly the buffers, strides
//! and ranges the `dflash` model passes them: a block plan built by the model's own code
//! (`BlockPlan::build`) for a ragged batch, the bf16 operand copies written by their producers as the model
//! writes them (`rope_bf16` for q and both key sets at the plan's positions, `round_to_bf16` for both value
//! sets), NaN-poisoned outputs and copies, against an f64 reference attention over the operands the kernels
//! read (the copies). On the CPU the flash table's bodies run through the warp model (`cpu/flash.rs`); on CUDA
//! (ignored here, run by `scripts/gpu-check.sh`) on the device.
//!
//! - the copies: every element bit-equal to `half`'s rounding (nearest even) of the producer's f32 output, the
//!   rotated f32 bit-equal to `rope`'s, the forward's output copy bit-equal to the rounding of its f32 output;
//!
//! - the batch: a long sequence (anchors drawn from every position), one whose only valid anchors are 0 and
//!   its last valid position (with an absent third block), one too short for any anchor (all blocks absent),
//!   a mid-length one; context lengths not multiples of the 64-key tile; GQA 1, 4 and 8; head_dim 64 and 128;
//! - tolerances as `gpu-kernels/tests/flash_attention.rs` states them for bf16 operands (relative L2): 1e-2 for
//!   the output, 2e-2 for the gradients, 1e-4 absolute for `lse`; a wiring mistake (a swapped range buffer, a
//!   stride) gives errors of order 1;
//! - the selection rule: the compiler's `flash_attention` against the kernels' own `check_head_dim` over a
//!   sweep of shapes, and the layout holds the `flash_*` scratch exactly where the rule says;
//! - on a GPU: the device's flash attention against the CPU's f32 attention lanes on the same batch.

mod backends;
mod kernels_support;

use backends::TestDevice;
use draftpipe_compiler::family::dflash::flash::{
    FLASH_BLOCK, FLASH_HEAD_DIMS, FLASH_MAX_GROUP, flash_attention,
};
use draftpipe_compiler::plan::{BucketPlan, DflashSpec, LossSpec, Precision};
use draftpipe_compiler::workspace::{BackendKind, WorkspaceLayout};
use draftpipe_gpu_kernels::flash::{BLOCK, HEAD_DIMS, check_head_dim};
use draftpipe_runtime::backend::{
    AttentionGrads, AttentionInputs, AttentionSaved, AttentionShape, Backend, Buf, Dst,
};
use draftpipe_runtime::model::dflash::{BlockGeometry, BlockPlan, PlanInput};
use kernels_support::{bare, down, poisoned, seed, uniform, up};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

const FORWARD_TOLERANCE: f64 = 1e-2;
const GRADIENT_TOLERANCE: f64 = 2e-2;
const LSE_TOLERANCE: f64 = 1e-4;

/// The ragged batch's block plan, built by the model's code: 4 sequences padded to 130, 3 block slots each.
fn ragged_plan() -> BlockPlan {
    let (padded_len, slots) = (130, 3);
    let seq_lens = [130u32, 20, 1, 67];
    let mut loss_mask = vec![0u8; seq_lens.len() * padded_len];
    for (s, &len) in seq_lens.iter().enumerate() {
        let row = &mut loss_mask[s * padded_len..][..len as usize];
        if s == 1 {
            // Valid anchors exactly 0 and 18 (the last valid position of a sequence of 20).
            for p in [0, 1, 18, 19] {
                row[p] = 1;
            }
        } else {
            row.fill(1);
        }
    }
    let input_ids: Vec<u32> = (0..loss_mask.len() as u32).map(|i| i % 97).collect();
    let geometry = BlockGeometry {
        block: BLOCK,
        anchors: slots,
        mask_token: 99,
        position_decay: 7.0,
    };
    let mut plan = BlockPlan::default();
    plan.build(
        &geometry,
        PlanInput {
            padded_len,
            input_ids: &input_ids,
            loss_mask: &loss_mask,
            seq_lens: &seq_lens,
        },
        seed(),
        3,
    );
    assert_eq!(plan.present, [3, 2, 0, 3], "the batch's shape");
    assert_eq!(
        &plan.anchors[3..5],
        [0, 18],
        "anchors at 0 and at the last valid position"
    );
    plan
}

/// Qwen3's RoPE base.
const THETA: f32 = 1e6;

/// One attention call's inputs: for the flash path the producers' inputs (q and keys before RoPE, values
/// before rounding), for the f32 path and the reference the attention operands themselves.
#[derive(Clone)]
struct Case {
    shape: AttentionShape,
    queries: usize,
    context: usize,
    q: Vec<f32>,
    k: [Vec<f32>; 2],
    v: [Vec<f32>; 2],
    /// RoPE positions of the context rows and of the block rows.
    positions: [Vec<u32>; 2],
    dout: Vec<f32>,
    query_ranges: Vec<u32>,
    key_ranges: [Vec<u32>; 2],
}

fn case(plan: &BlockPlan, heads: usize, kv_heads: usize, head_dim: usize, seed: u64) -> Case {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let (queries, context) = (plan.query_rows(), plan.context_positions.len());
    let kv = kv_heads * head_dim;
    // Scores of a few units: softmax rows neither flat nor one-hot.
    Case {
        shape: AttentionShape::new(heads, kv_heads, head_dim),
        queries,
        context,
        q: uniform(&mut rng, queries * heads * head_dim, 2.0),
        k: [
            uniform(&mut rng, context * kv, 2.0),
            uniform(&mut rng, queries * kv, 2.0),
        ],
        v: [
            uniform(&mut rng, context * kv, 1.0),
            uniform(&mut rng, queries * kv, 1.0),
        ],
        positions: [plan.context_positions.clone(), plan.block_positions.clone()],
        dout: (0..queries * heads * head_dim)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect(),
        query_ranges: plan.query_ranges.clone(),
        key_ranges: [
            plan.context_key_ranges.clone(),
            plan.block_key_ranges.clone(),
        ],
    }
}

/// out, lse, dq, dk (context, block), dv (context, block).
struct Outputs<T> {
    out: Vec<T>,
    lse: Vec<T>,
    dq: Vec<T>,
    dk: [Vec<T>; 2],
    dv: [Vec<T>; 2],
}

/// The f64 attention under the ranges, forward and backward of `L = Σ dout ∘ out`.
fn reference(c: &Case) -> Outputs<f64> {
    let AttentionShape {
        heads: h,
        kv_heads: kvh,
        head_dim: d,
        ..
    } = c.shape;
    let scale = 1.0 / (d as f64).sqrt();
    let mut r = Outputs {
        out: vec![0.0; c.queries * h * d],
        lse: vec![f64::NEG_INFINITY; c.queries * h],
        dq: vec![0.0; c.queries * h * d],
        dk: [
            vec![0.0; c.context * kvh * d],
            vec![0.0; c.queries * kvh * d],
        ],
        dv: [
            vec![0.0; c.context * kvh * d],
            vec![0.0; c.queries * kvh * d],
        ],
    };
    for row in 0..c.queries {
        let g = &c.query_ranges[4 * row..4 * row + 4];
        for head in 0..h {
            let kv = head / (h / kvh);
            let at = (row * h + head) * d;
            let (qv, go) = (&c.q[at..at + d], &c.dout[at..at + d]);
            let key = |_set: usize, j: usize| (j * kvh + kv) * d;
            let mut keys = Vec::new();
            for (set, (start, end)) in [(0, (g[0], g[1])), (1, (g[2], g[3]))] {
                for j in start as usize..end as usize {
                    let kr = &c.k[set][key(set, j)..][..d];
                    let s: f64 = qv.iter().zip(kr).map(|(&a, &b)| a as f64 * b as f64).sum();
                    keys.push((set, j, s * scale));
                }
            }
            if keys.is_empty() {
                continue;
            }
            let m = keys.iter().map(|k| k.2).fold(f64::NEG_INFINITY, f64::max);
            let lse = m + keys.iter().map(|k| (k.2 - m).exp()).sum::<f64>().ln();
            r.lse[row * h + head] = lse;
            for &(set, j, s) in &keys {
                let p = (s - lse).exp();
                for i in 0..d {
                    r.out[at + i] += p * c.v[set][key(set, j) + i] as f64;
                }
            }
            let delta: f64 = (0..d).map(|i| r.out[at + i] * go[i] as f64).sum();
            for &(set, j, s) in &keys {
                let p = (s - lse).exp();
                let dp: f64 = (0..d)
                    .map(|i| go[i] as f64 * c.v[set][key(set, j) + i] as f64)
                    .sum();
                let ds = p * (dp - delta);
                for i in 0..d {
                    r.dq[at + i] += scale * ds * c.k[set][key(set, j) + i] as f64;
                    r.dk[set][key(set, j) + i] += scale * ds * qv[i] as f64;
                    r.dv[set][key(set, j) + i] += p * go[i] as f64;
                }
            }
        }
    }
    r
}

/// The case's buffers on `be`: inputs uploaded, outputs NaN-poisoned.
struct Buffers<B: Backend> {
    inp: InputBuffers<B>,
    out: OutputBuffers<B>,
}

/// The case's inputs on a backend.
struct InputBuffers<B: Backend> {
    q: Buf<B, f32>,
    k: [Buf<B, f32>; 2],
    v: [Buf<B, f32>; 2],
    dout: Buf<B, f32>,
    query_ranges: Buf<B, u32>,
    key_ranges: [Buf<B, u32>; 2],
}

/// What the operations write, and the backward's `delta` scratch.
struct OutputBuffers<B: Backend> {
    out: Buf<B, f32>,
    lse: Buf<B, f32>,
    delta: Buf<B, f32>,
    dq: Buf<B, f32>,
    dk: [Buf<B, f32>; 2],
    dv: [Buf<B, f32>; 2],
}

impl<B: Backend> InputBuffers<B> {
    fn inputs(&self) -> AttentionInputs<'_, B> {
        AttentionInputs {
            q: self.q.all(),
            k_ctx: self.k[0].all(),
            v_ctx: self.v[0].all(),
            k_blk: self.k[1].all(),
            v_blk: self.v[1].all(),
            query_ranges: self.query_ranges.all(),
        }
    }
}

impl<B: Backend> OutputBuffers<B> {
    /// What both backward operations (f32 and flash) take besides their inputs: the saved views (`inp`'s
    /// output gradient and key ranges), `delta` and the gradients.
    fn backward_views<'a>(
        &'a mut self,
        inp: &'a InputBuffers<B>,
    ) -> (
        AttentionSaved<'a, B>,
        Dst<'a, B, f32>,
        AttentionGrads<'a, B>,
    ) {
        let [dk_ctx, dk_blk] = &mut self.dk;
        let [dv_ctx, dv_blk] = &mut self.dv;
        (
            AttentionSaved {
                out: self.out.all(),
                dout: inp.dout.all(),
                lse: self.lse.all(),
                key_ranges_ctx: inp.key_ranges[0].all(),
                key_ranges_blk: inp.key_ranges[1].all(),
            },
            self.delta.all_mut(),
            AttentionGrads {
                dq: self.dq.all_mut(),
                dk_ctx: dk_ctx.all_mut(),
                dv_ctx: dv_ctx.all_mut(),
                dk_blk: dk_blk.all_mut(),
                dv_blk: dv_blk.all_mut(),
            },
        )
    }

    fn read(&self, be: &mut B) -> Outputs<f32> {
        Outputs {
            out: down(be, self.out.all()),
            lse: down(be, self.lse.all()),
            dq: down(be, self.dq.all()),
            dk: [down(be, self.dk[0].all()), down(be, self.dk[1].all())],
            dv: [down(be, self.dv[0].all()), down(be, self.dv[1].all())],
        }
    }
}

impl<B: Backend> Buffers<B> {
    fn new(be: &mut B, c: &Case) -> Self {
        let rows = c.queries * c.shape.heads;
        Self {
            inp: InputBuffers {
                q: up(be, &c.q),
                k: [up(be, &c.k[0]), up(be, &c.k[1])],
                v: [up(be, &c.v[0]), up(be, &c.v[1])],
                dout: up(be, &c.dout),
                query_ranges: up(be, &c.query_ranges),
                key_ranges: [up(be, &c.key_ranges[0]), up(be, &c.key_ranges[1])],
            },
            out: OutputBuffers {
                out: poisoned(be, c.q.len()),
                lse: poisoned(be, rows),
                delta: poisoned(be, rows),
                dq: poisoned(be, c.q.len()),
                dk: [poisoned(be, c.k[0].len()), poisoned(be, c.k[1].len())],
                dv: [poisoned(be, c.v[0].len()), poisoned(be, c.v[1].len())],
            },
        }
    }
}

/// `n` bf16 NaNs on `be` (a copy nothing wrote stays NaN).
fn nan_bf16<B: Backend>(be: &mut B, n: usize) -> Buf<B, half::bf16> {
    up(be, &vec![half::bf16::NAN; n])
}

/// Asserts `copy` is `x` rounded to bf16 by `half` (nearest even), bit for bit.
fn assert_rounded(what: &str, x: &[f32], copy: &[half::bf16]) {
    assert_eq!(x.len(), copy.len(), "{what}: lengths");
    for (i, (&x, &c)) in x.iter().zip(copy).enumerate() {
        assert_eq!(
            c.to_bits(),
            half::bf16::from_f32(x).to_bits(),
            "{what}[{i}]: the copy of {x:e} is {c}"
        );
    }
}

/// The flash path's bf16 operands `[q, k_ctx, v_ctx, k_blk, v_blk]` on a backend, with the query ranges.
struct Copies<B: Backend> {
    copies: [Buf<B, half::bf16>; 5],
    query_ranges: Buf<B, u32>,
}

impl<B: Backend> Copies<B> {
    fn inputs(&self) -> AttentionInputs<'_, B, half::bf16> {
        let [q, k_ctx, v_ctx, k_blk, v_blk] = &self.copies;
        AttentionInputs {
            q: q.all(),
            k_ctx: k_ctx.all(),
            v_ctx: v_ctx.all(),
            k_blk: k_blk.all(),
            v_blk: v_blk.all(),
            query_ranges: self.query_ranges.all(),
        }
    }
}

/// The copies as the model's forward writes them from the case's producer inputs: `rope_bf16` over q and
/// both key sets at their positions, `round_to_bf16` over both value sets, into NaN-poisoned buffers. Each
/// copy is checked against `half`'s rounding of its producer's f32 output, and the rotated f32 against
/// `rope`'s; returns the copies and the case of the attention operands they hold (for the f64 reference and
/// the f32 path).
fn produce<B: Backend>(be: &mut B, c: &Case) -> (Copies<B>, Case) {
    let AttentionShape {
        heads,
        kv_heads,
        head_dim,
        ..
    } = c.shape;
    let mut operands = c.clone();
    let copy_of = |be: &mut B, name: &str, x: &[f32], positions: Option<(&[u32], usize)>| {
        let mut f32s = up(be, x);
        let mut copy = nan_bf16(be, x.len());
        let produced = match positions {
            Some((positions, heads)) => {
                let positions = up(be, positions);
                be.rope_bf16(
                    (f32s.all_mut(), copy.all_mut()),
                    positions.all(),
                    THETA,
                    heads,
                    head_dim,
                )
                .expect("rope_bf16");
                let mut alone = up(be, x);
                be.rope(
                    alone.all_mut(),
                    positions.all(),
                    THETA,
                    heads,
                    head_dim,
                    false,
                )
                .expect("rope");
                let (produced, alone) = (down(be, f32s.all()), down(be, alone.all()));
                // The first element that differs, not the whole buffers, in the message.
                let differs = produced
                    .iter()
                    .zip(&alone)
                    .position(|(a, b)| a.to_bits() != b.to_bits());
                assert_eq!(differs, None, "{name}: rope_bf16 rotates as rope does");
                produced
            }
            None => {
                be.round_to_bf16(f32s.all(), copy.all_mut())
                    .expect("round_to_bf16");
                x.to_vec()
            }
        };
        let values = down(be, copy.all());
        assert_rounded(name, &produced, &values);
        (
            copy,
            values.iter().map(|v| v.to_f32()).collect::<Vec<f32>>(),
        )
    };
    let (q, q_values) = copy_of(be, "q", &c.q, Some((&c.positions[1], heads)));
    let (k_ctx, k_ctx_values) = copy_of(be, "k_ctx", &c.k[0], Some((&c.positions[0], kv_heads)));
    let (k_blk, k_blk_values) = copy_of(be, "k_blk", &c.k[1], Some((&c.positions[1], kv_heads)));
    let (v_ctx, v_ctx_values) = copy_of(be, "v_ctx", &c.v[0], None);
    let (v_blk, v_blk_values) = copy_of(be, "v_blk", &c.v[1], None);
    operands.q = q_values;
    operands.k = [k_ctx_values, k_blk_values];
    operands.v = [v_ctx_values, v_blk_values];
    let copies = Copies {
        copies: [q, k_ctx, v_ctx, k_blk, v_blk],
        query_ranges: up(be, &c.query_ranges),
    };
    (copies, operands)
}

/// Forward and backward through the flash operations over the producers' copies, as the model calls them;
/// the outputs and the case of the operands the kernels read.
fn run_flash<B: Backend>(be: &mut B, c: &Case) -> (Outputs<f32>, Case) {
    let (copies, operands) = produce(be, c);
    let mut b = Buffers::new(be, &operands);
    let (mut out16, mut dout16) = (nan_bf16(be, c.q.len()), nan_bf16(be, c.q.len()));
    be.flash_attention_forward(
        copies.inputs(),
        c.shape,
        (b.out.out.all_mut(), out16.all_mut()),
        b.out.lse.all_mut(),
    )
    .expect("flash forward");
    let (out, out16_values) = (down(be, b.out.out.all()), down(be, out16.all()));
    assert_rounded("out16", &out, &out16_values);
    let (saved, delta, grads) = b.out.backward_views(&b.inp);
    be.flash_attention_backward(
        copies.inputs(),
        c.shape,
        saved,
        (delta, dout16.all_mut()),
        grads,
    )
    .expect("flash backward");
    (b.out.read(be), operands)
}

/// Forward and backward through the f32 attention operations (the CPU's lanes on the CPU).
fn run_f32<B: Backend>(be: &mut B, c: &Case) -> Outputs<f32> {
    let mut b = Buffers::new(be, c);
    be.attention_forward(
        b.inp.inputs(),
        c.shape,
        b.out.out.all_mut(),
        b.out.lse.all_mut(),
    )
    .expect("forward");
    let (saved, delta, grads) = b.out.backward_views(&b.inp);
    be.attention_backward(b.inp.inputs(), c.shape, saved, delta, grads)
        .expect("backward");
    b.out.read(be)
}

/// `‖got − want‖₂ / ‖want‖₂`; infinite when `got` has a non-finite value.
fn relative_l2(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    if got.iter().any(|x| !x.is_finite()) {
        return f64::INFINITY;
    }
    let diff: f64 = got
        .iter()
        .zip(want)
        .map(|(&g, &w)| (g as f64 - w).powi(2))
        .sum();
    let norm: f64 = want.iter().map(|w| w * w).sum();
    (diff / norm.max(f64::MIN_POSITIVE)).sqrt()
}

/// The largest `|got − want|` of the log-sum-exps, both −∞ for a query without keys counting as equal.
fn lse_error(got: &[f32], want: &[f64]) -> f64 {
    got.iter()
        .zip(want)
        .map(
            |(&g, &w)| match (g == f32::NEG_INFINITY, w == f64::NEG_INFINITY) {
                (true, true) => 0.0,
                _ if g.is_finite() => (g as f64 - w).abs(),
                _ => f64::INFINITY,
            },
        )
        .fold(0.0, f64::max)
}

/// Every output of `got` against `want`, with the stated tolerances; `what` names the run.
fn assert_close<T: Copy + Into<f64>>(what: &str, got: &Outputs<f32>, want: &Outputs<T>) {
    let wide = |v: &[T]| v.iter().map(|&x| x.into()).collect::<Vec<f64>>();
    let checks = [
        (
            "out",
            relative_l2(&got.out, &wide(&want.out)),
            FORWARD_TOLERANCE,
        ),
        ("lse", lse_error(&got.lse, &wide(&want.lse)), LSE_TOLERANCE),
        (
            "dq",
            relative_l2(&got.dq, &wide(&want.dq)),
            GRADIENT_TOLERANCE,
        ),
        (
            "dk_ctx",
            relative_l2(&got.dk[0], &wide(&want.dk[0])),
            GRADIENT_TOLERANCE,
        ),
        (
            "dk_blk",
            relative_l2(&got.dk[1], &wide(&want.dk[1])),
            GRADIENT_TOLERANCE,
        ),
        (
            "dv_ctx",
            relative_l2(&got.dv[0], &wide(&want.dv[0])),
            GRADIENT_TOLERANCE,
        ),
        (
            "dv_blk",
            relative_l2(&got.dv[1], &wide(&want.dv[1])),
            GRADIENT_TOLERANCE,
        ),
    ];
    for (name, error, tolerance) in checks {
        eprintln!("{what}: {name} error {error:.2e} (bound {tolerance:.0e})");
        assert!(
            error <= tolerance,
            "{what}: {name} error {error:.3e} above {tolerance:.0e}"
        );
    }
}

/// (heads, kv_heads, head_dim): GQA 4, 1 and 8 over head_dim 64 and 128.
const SHAPES: [(usize, usize, usize); 3] = [(4, 1, 64), (2, 2, 128), (8, 1, 64)];

fn flash_operations_match_f64_on_a_dflash_plan<D: TestDevice>(device: &D) {
    let plan = ragged_plan();
    let mut be = bare(device);
    let base = seed();
    for (i, &(heads, kv_heads, head_dim)) in SHAPES.iter().enumerate() {
        let c = case(&plan, heads, kv_heads, head_dim, base + i as u64);
        let (got, operands) = run_flash(&mut be, &c);
        assert_close(
            &format!("{} flash {heads}/{kv_heads} heads of {head_dim}", D::NAME),
            &got,
            &reference(&operands),
        );
    }
}
test_device!(flash_operations_match_f64_on_a_dflash_plan);

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-check.sh runs it with --include-ignored"]
fn cuda_flash_attention_matches_the_cpu_lanes() {
    let Some(cuda) = backends::cuda_or_skip("cuda_flash_attention_matches_the_cpu_lanes") else {
        return;
    };
    let plan = ragged_plan();
    let (mut gpu, mut cpu) = (bare(&cuda), bare(&backends::Cpu));
    for (i, &(heads, kv_heads, head_dim)) in SHAPES.iter().enumerate() {
        let c = case(&plan, heads, kv_heads, head_dim, seed() + i as u64);
        let (device, operands) = run_flash(&mut gpu, &c);
        let lanes = run_f32(&mut cpu, &operands);
        assert_close(
            &format!("cuda flash vs cpu lanes, {heads}/{kv_heads} heads of {head_dim}"),
            &device,
            &lanes,
        );
    }
}

#[test]
fn a_head_dim_the_kernels_refuse_is_an_error_not_a_launch() {
    let plan = ragged_plan();
    let mut be = bare(&backends::Cpu);
    let c = case(&plan, 2, 1, 96, seed());
    let (copies, operands) = produce(&mut be, &c);
    let mut b = Buffers::new(&mut be, &operands);
    let mut out16 = nan_bf16(&mut be, c.q.len());
    let error = be
        .flash_attention_forward(
            copies.inputs(),
            c.shape,
            (b.out.out.all_mut(), out16.all_mut()),
            b.out.lse.all_mut(),
        )
        .expect_err("head_dim 96 has no flash kernel");
    assert!(
        error.to_string().contains("head_dim 64 and 128, not 96"),
        "{error}"
    );
    assert!(
        down(&mut be, b.out.out.all()).iter().all(|x| x.is_nan()),
        "nothing was launched"
    );
}

fn spec(heads: usize, kv_heads: usize, head_dim: usize, block: usize) -> DflashSpec {
    DflashSpec {
        hidden: 64,
        taps: 2,
        tap_layers: vec![1, 2],
        vocab: 32,
        layers: 1,
        heads,
        kv_heads,
        head_dim,
        intermediate: 96,
        block,
        anchors: 2,
        mask_token: 31,
        rope_theta: 1e4,
        rms_norm_eps: 1e-6,
    }
}

#[test]
fn flash_rule_agrees_with_the_kernels() {
    assert_eq!(FLASH_HEAD_DIMS, HEAD_DIMS);
    assert_eq!(FLASH_BLOCK, BLOCK);
    let loss = LossSpec {
        head_decay: 1.0,
        position_decay: Some(7.0),
        step_decay: None,
        chunk_tokens: 16,
    };
    let bucket = BucketPlan {
        padded_len: 48,
        sequences: 2,
        tokens: 96,
        step_flops: 0,
        step_bytes: 0,
    };
    let mut flash_shapes = 0;
    for backend in [BackendKind::Cpu, BackendKind::Cuda] {
        for precision in [Precision::F32, Precision::Tf32, Precision::Bf16] {
            for head_dim in [32, 64, 96, 128, 256] {
                for (heads, kv_heads) in [(4, 4), (8, 2), (32, 8), (8, 1), (16, 1), (9, 3)] {
                    for block in [8, 16] {
                        let rule =
                            flash_attention(backend, precision, (heads, kv_heads, head_dim), block);
                        let kernels = check_head_dim(block, heads, kv_heads, head_dim).is_ok()
                            && heads / kv_heads <= FLASH_MAX_GROUP;
                        let expected = backend == BackendKind::Cuda
                            && precision == Precision::Bf16
                            && block == BLOCK
                            && kernels;
                        assert_eq!(
                            rule, expected,
                            "{backend:?} {precision:?} {heads}/{kv_heads} heads of {head_dim}, block {block}"
                        );
                        flash_shapes += usize::from(rule);
                        let layout = WorkspaceLayout::dflash(
                            &spec(heads, kv_heads, head_dim, block),
                            std::slice::from_ref(&bucket),
                            &loss,
                            backend,
                            precision,
                        )
                        .expect("layout");
                        for name in [
                            "flash_q",
                            "flash_k_ctx",
                            "flash_v_ctx",
                            "flash_k_blk",
                            "flash_v_blk",
                            "flash_dout",
                        ] {
                            assert_eq!(
                                layout.elements(name).is_some(),
                                rule,
                                "{name} in the layout of {backend:?} {precision:?} {heads}/{kv_heads} \
                                 heads of {head_dim}, block {block}"
                            );
                        }
                    }
                }
            }
        }
    }
    // CUDA at bf16, blocks of 16, head_dim 64 or 128, groups 1, 4, 4, 8 and 3 (16/1 has 16 heads per kv
    // head: refused).
    assert_eq!(
        flash_shapes,
        2 * 5,
        "the shapes the sweep puts on the flash kernels"
    );
}
