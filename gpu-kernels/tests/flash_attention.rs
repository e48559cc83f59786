//! The flash-attention bodies (`gpu-kernels/src/flash/`) run on the host through the warp model
//! (`flash::warp::ModelWarp`: mma, ldmatrix, shuffles lane by lane from the PTX ISA layouts, the block barrier a
//! host barrier with one thread per warp), against an f64 reference on ragged DFlash plans.
//!
//! Tolerances (normwise, `‖got − ref‖ / ‖ref‖` per output): Q, K, V are bf16 in both, so the kernel's error
//! comes from the values it rounds to bf16 on the way into an `mma` (P in the forward; dO, P and dS in the
//! backward), each with a relative error ≤ u = 2^-9 ≈ 2e-3, and from f32 sums. Rounding errors of random sign
//! average over a row, so the normwise error is about u: the bounds are 5u = 1e-2 for the forward output and
//! 10u = 2e-2 for the gradients (dS = P ∘ (dP − D) loses digits to the cancellation in dP − D). `lse` is
//! computed from f32 probabilities: 1e-4 absolute. A layout mistake gives errors of order 1 (the mutation tests).

use std::sync::Barrier;

use draftpipe_gpu_kernels::convert::f32_to_bf16_bits;
use draftpipe_gpu_kernels::flash::backward::{KeyMajorInputs, flash_backward_kv, flash_backward_q};
use draftpipe_gpu_kernels::flash::forward::{FlashInputs, flash_forward};
use draftpipe_gpu_kernels::flash::warp::{BlockBarrier, LayoutMutation, ModelWarp};
use draftpipe_gpu_kernels::flash::{
    BLOCK, KV_TILE, KV_WARPS, check_head_dim, key_major_smem_bytes, query_major_smem_bytes,
};

const FORWARD_TOLERANCE: f64 = 1e-2;
const GRADIENT_TOLERANCE: f64 = 2e-2;
const LSE_TOLERANCE: f64 = 1e-4;

struct HostBarrier(Barrier);

impl BlockBarrier for HostBarrier {
    fn wait(&self) {
        self.0.wait();
    }
}

/// Runs `body(warp, smem, block_index)` for every block of a launch: its warps as threads sharing a barrier
/// and `smem_bytes` of zeroed, 16-byte aligned shared memory.
fn launch(
    blocks: usize,
    warps: usize,
    smem_bytes: usize,
    mutation: LayoutMutation,
    body: impl Fn(ModelWarp<'_>, *mut u8, usize) + Sync,
) {
    for index in 0..blocks {
        let mut smem = vec![0u128; smem_bytes.div_ceil(16)];
        let smem_addr = smem.as_mut_ptr() as usize;
        let barrier = HostBarrier(Barrier::new(warps));
        std::thread::scope(|scope| {
            for w in 0..warps {
                let (barrier, body) = (&barrier, &body);
                scope.spawn(move || {
                    body(
                        ModelWarp::new(w, barrier, mutation),
                        smem_addr as *mut u8,
                        index,
                    )
                });
            }
        });
    }
}

/// A small deterministic generator (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// A DFlash batch: sequences of `seq_len` context rows (the first `len` valid), `slots` blocks per sequence,
/// the present ones at `anchors` (sorted), the rest absent; mask ranges as the runtime's block plan writes them.
struct Plan {
    queries: usize,
    context: usize,
    query_ranges: Vec<u32>,
    ctx_key_ranges: Vec<u32>,
    blk_key_ranges: Vec<u32>,
}

fn plan(seq_len: usize, slots: usize, anchors: &[&[usize]]) -> Plan {
    let (n, b) = (anchors.len(), BLOCK);
    let (queries, context) = (n * slots * b, n * seq_len);
    let mut query_ranges = Vec::new();
    let mut blk_key_ranges = Vec::new();
    let mut ctx_key_ranges = vec![0u32; 2 * context];
    for (s, chosen) in anchors.iter().enumerate() {
        assert!(chosen.len() <= slots && chosen.windows(2).all(|w| w[0] < w[1]));
        let (base, first_row) = (s * seq_len, s * slots * b);
        let present_end = first_row + chosen.len() * b;
        for slot in 0..slots {
            let block_start = first_row + slot * b;
            for _ in 0..b {
                match chosen.get(slot) {
                    Some(&a) => {
                        query_ranges.extend(
                            [base, base + a, block_start, block_start + b].map(|x| x as u32),
                        );
                        blk_key_ranges.extend([block_start as u32, (block_start + b) as u32]);
                    }
                    None => {
                        query_ranges
                            .extend([base, base, block_start, block_start].map(|x| x as u32));
                        blk_key_ranges.extend([block_start as u32; 2]);
                    }
                }
            }
        }
        let mut first_block = 0;
        for p in 0..seq_len {
            while first_block < chosen.len() && chosen[first_block] <= p {
                first_block += 1;
            }
            let start = (first_row + first_block * b).min(present_end);
            ctx_key_ranges[2 * (base + p)] = start as u32;
            ctx_key_ranges[2 * (base + p) + 1] = present_end as u32;
        }
    }
    Plan {
        queries,
        context,
        query_ranges,
        ctx_key_ranges,
        blk_key_ranges,
    }
}

/// Random bf16 values (and their f32 values) scaled by `scale`.
fn bf16_values(rng: &mut Rng, n: usize, scale: f32) -> (Vec<u16>, Vec<f32>) {
    let bits: Vec<u16> = (0..n)
        .map(|_| f32_to_bf16_bits(rng.unit() * scale))
        .collect();
    let values = bits
        .iter()
        .map(|&b| f32::from_bits((b as u32) << 16))
        .collect();
    (bits, values)
}

struct Case {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    plan: Plan,
    q: (Vec<u16>, Vec<f32>),
    k_ctx: (Vec<u16>, Vec<f32>),
    v_ctx: (Vec<u16>, Vec<f32>),
    k_blk: (Vec<u16>, Vec<f32>),
    v_blk: (Vec<u16>, Vec<f32>),
    dout: Vec<f32>,
}

fn case(seed: u64, heads: usize, kv_heads: usize, head_dim: usize, plan: Plan) -> Case {
    let mut rng = Rng(seed | 1);
    let (qn, tn) = (plan.queries, plan.context);
    // Scores of a few units: softmax rows neither flat nor one-hot.
    let q = bf16_values(&mut rng, qn * heads * head_dim, 2.0);
    let k_ctx = bf16_values(&mut rng, tn * kv_heads * head_dim, 2.0);
    let v_ctx = bf16_values(&mut rng, tn * kv_heads * head_dim, 1.0);
    let k_blk = bf16_values(&mut rng, qn * kv_heads * head_dim, 2.0);
    let v_blk = bf16_values(&mut rng, qn * kv_heads * head_dim, 1.0);
    let dout = (0..qn * heads * head_dim).map(|_| rng.unit()).collect();
    Case {
        heads,
        kv_heads,
        head_dim,
        plan,
        q,
        k_ctx,
        v_ctx,
        k_blk,
        v_blk,
        dout,
    }
}

/// The f64 reference: out, lse, dq, dk_ctx, dv_ctx, dk_blk, dv_blk.
struct Reference {
    out: Vec<f64>,
    lse: Vec<f64>,
    dq: Vec<f64>,
    dk: [Vec<f64>; 2],
    dv: [Vec<f64>; 2],
}

fn reference(c: &Case) -> Reference {
    let (h, kvh, d) = (c.heads, c.kv_heads, c.head_dim);
    let (qn, tn) = (c.plan.queries, c.plan.context);
    let scale = 1.0 / (d as f64).sqrt();
    let mut r = Reference {
        out: vec![0.0; qn * h * d],
        lse: vec![f64::NEG_INFINITY; qn * h],
        dq: vec![0.0; qn * h * d],
        dk: [vec![0.0; tn * kvh * d], vec![0.0; qn * kvh * d]],
        dv: [vec![0.0; tn * kvh * d], vec![0.0; qn * kvh * d]],
    };
    let sets = [(&c.k_ctx.1, &c.v_ctx.1), (&c.k_blk.1, &c.v_blk.1)];
    for row in 0..qn {
        let g = &c.plan.query_ranges[4 * row..4 * row + 4];
        for head in 0..h {
            let kv = head / (h / kvh);
            let qv = &c.q.1[(row * h + head) * d..][..d];
            let go = &c.dout[(row * h + head) * d..][..d];
            // (set, key, score)
            let mut keys = Vec::new();
            for (set, (start, end)) in [(0, (g[0], g[1])), (1, (g[2], g[3]))] {
                for j in start as usize..end as usize {
                    let kr = &sets[set].0[(j * kvh + kv) * d..][..d];
                    let s: f64 = qv
                        .iter()
                        .zip(kr)
                        .map(|(&a, &b)| a as f64 * b as f64)
                        .sum::<f64>()
                        * scale;
                    keys.push((set, j, s));
                }
            }
            if keys.is_empty() {
                continue;
            }
            let m = keys.iter().map(|k| k.2).fold(f64::NEG_INFINITY, f64::max);
            let l: f64 = keys.iter().map(|k| (k.2 - m).exp()).sum();
            let lse = m + l.ln();
            r.lse[row * h + head] = lse;
            let o = &mut r.out[(row * h + head) * d..][..d];
            for &(set, j, s) in &keys {
                let p = (s - lse).exp();
                let vr = &sets[set].1[(j * kvh + kv) * d..][..d];
                for (x, &v) in o.iter_mut().zip(vr) {
                    *x += p * v as f64;
                }
            }
            let o = o.to_vec();
            let delta: f64 = o.iter().zip(go).map(|(&a, &b)| a * b as f64).sum();
            for &(set, j, s) in &keys {
                let p = (s - lse).exp();
                let (kr, vr) = (
                    &sets[set].0[(j * kvh + kv) * d..][..d],
                    &sets[set].1[(j * kvh + kv) * d..][..d],
                );
                let dp: f64 = go.iter().zip(vr).map(|(&a, &b)| a as f64 * b as f64).sum();
                let ds = p * (dp - delta);
                for i in 0..d {
                    r.dq[(row * h + head) * d + i] += scale * ds * kr[i] as f64;
                    r.dk[set][(j * kvh + kv) * d + i] += scale * ds * qv[i] as f64;
                    r.dv[set][(j * kvh + kv) * d + i] += p * go[i] as f64;
                }
            }
        }
    }
    r
}

/// What the kernels wrote.
struct Outputs {
    out: Vec<f32>,
    lse: Vec<f32>,
    dq: Vec<f32>,
    dk: [Vec<f32>; 2],
    dv: [Vec<f32>; 2],
}

/// Dispatches the bodies' head-dimension constants.
macro_rules! with_head_dim {
    ($d:expr, |$D:ident, $D8:ident, $D16:ident| $body:expr) => {
        match $d {
            64 => {
                const $D: usize = 64;
                const $D8: usize = 8;
                const $D16: usize = 4;
                $body
            }
            128 => {
                const $D: usize = 128;
                const $D8: usize = 16;
                const $D16: usize = 8;
                $body
            }
            other => panic!("no flash kernel for head_dim {other}"),
        }
    };
}

fn run(c: &Case, mutation: LayoutMutation) -> Outputs {
    let (h, kvh, d) = (c.heads, c.kv_heads, c.head_dim);
    let (qn, tn) = (c.plan.queries, c.plan.context);
    check_head_dim(qn, h, kvh, d).expect("a shape the flash kernels take");
    let scale = 1.0 / (d as f32).sqrt();
    // Poisoned: every element the kernels should write is overwritten.
    let mut o = Outputs {
        out: vec![f32::NAN; qn * h * d],
        lse: vec![f32::NAN; qn * h],
        dq: vec![f32::NAN; qn * h * d],
        dk: [vec![f32::NAN; tn * kvh * d], vec![f32::NAN; qn * kvh * d]],
        dv: [vec![f32::NAN; tn * kvh * d], vec![f32::NAN; qn * kvh * d]],
    };
    let mut delta = vec![f32::NAN; qn * h];
    let mut dout_bf16 = vec![u16::MAX; qn * h * d];
    let inputs = FlashInputs {
        q: c.q.0.as_ptr(),
        k_ctx: c.k_ctx.0.as_ptr(),
        v_ctx: c.v_ctx.0.as_ptr(),
        k_blk: c.k_blk.0.as_ptr(),
        v_blk: c.v_blk.0.as_ptr(),
        query_ranges: c.plan.query_ranges.as_ptr(),
        queries: qn,
        context: tn,
        heads: h,
        kv_heads: kvh,
        scale,
    };
    let blocks = qn / BLOCK * kvh;
    let group = h / kvh;
    // Raw pointers cross the warp threads as addresses: each element is written by exactly one lane.
    let (out, lse, dq, dl) = (
        o.out.as_mut_ptr() as usize,
        o.lse.as_mut_ptr() as usize,
        o.dq.as_mut_ptr() as usize,
        delta.as_mut_ptr() as usize,
    );
    let dout_bf16 = dout_bf16.as_mut_ptr() as usize;
    let inputs_addr = &inputs as *const FlashInputs as usize;
    with_head_dim!(d, |D, D8, D16| {
        launch(
            blocks,
            group,
            query_major_smem_bytes(D),
            mutation,
            |w, smem, i| unsafe {
                let inputs = *(inputs_addr as *const FlashInputs);
                flash_forward::<32, D, D8, D16, _>(
                    inputs,
                    (out as *mut f32, std::ptr::null_mut()),
                    lse as *mut f32,
                    smem,
                    w,
                    i,
                )
            },
        );
        let dout = c.dout.as_ptr() as usize;
        launch(
            blocks,
            group,
            query_major_smem_bytes(D),
            mutation,
            |w, smem, i| unsafe {
                let inputs = *(inputs_addr as *const FlashInputs);
                flash_backward_q::<32, D, D8, D16, _>(
                    inputs,
                    out as *const f32,
                    dout as *const f32,
                    lse as *const f32,
                    dl as *mut f32,
                    dq as *mut f32,
                    dout_bf16 as *mut u16,
                    smem,
                    w,
                    i,
                )
            },
        );
        let key_sets = [
            (
                tn,
                c.k_ctx.0.as_ptr(),
                c.v_ctx.0.as_ptr(),
                c.plan.ctx_key_ranges.as_ptr(),
            ),
            (
                qn,
                c.k_blk.0.as_ptr(),
                c.v_blk.0.as_ptr(),
                c.plan.blk_key_ranges.as_ptr(),
            ),
        ];
        for (set, (keys, k, v, key_ranges)) in key_sets.into_iter().enumerate() {
            let kv_inputs = KeyMajorInputs {
                q: c.q.0.as_ptr(),
                dout: dout_bf16 as *const u16,
                lse: lse as *const f32,
                delta: dl as *const f32,
                k,
                v,
                key_ranges,
                keys,
                queries: qn,
                heads: h,
                kv_heads: kvh,
                scale,
            };
            let kv_addr = &kv_inputs as *const KeyMajorInputs as usize;
            let (dk, dv) = (
                o.dk[set].as_mut_ptr() as usize,
                o.dv[set].as_mut_ptr() as usize,
            );
            let blocks = keys.div_ceil(KV_TILE) * kvh;
            launch(
                blocks,
                KV_WARPS,
                key_major_smem_bytes(D),
                mutation,
                |w, smem, i| unsafe {
                    let inputs = *(kv_addr as *const KeyMajorInputs);
                    flash_backward_kv::<32, D, D8, D16, _>(
                        inputs,
                        dk as *mut f32,
                        dv as *mut f32,
                        smem,
                        w,
                        i,
                    )
                },
            );
        }
    });
    o
}

/// `‖got − want‖ / ‖want‖`, or infinity when `got` has a non-finite element.
fn normwise(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    if got.iter().any(|x| !x.is_finite()) {
        return f64::INFINITY;
    }
    let err: f64 = got
        .iter()
        .zip(want)
        .map(|(&g, &w)| (g as f64 - w).powi(2))
        .sum();
    let norm: f64 = want.iter().map(|w| w * w).sum();
    (err / norm.max(f64::MIN_POSITIVE)).sqrt()
}

/// The worst error of each output: (out, lse, dq, dk, dv), with the lse of key-less rows checked exactly.
fn errors(c: &Case, mutation: LayoutMutation) -> [f64; 5] {
    let (r, o) = (reference(c), run(c, mutation));
    let mut lse_err = 0.0f64;
    for (&g, &w) in o.lse.iter().zip(&r.lse) {
        lse_err = lse_err.max(if w == f64::NEG_INFINITY {
            if g == f32::NEG_INFINITY {
                0.0
            } else {
                f64::INFINITY
            }
        } else {
            (g as f64 - w).abs()
        });
    }
    let out_err = normwise(&o.out, &r.out);
    let dk = normwise(&o.dk[0], &r.dk[0]).max(normwise(&o.dk[1], &r.dk[1]));
    let dv = normwise(&o.dv[0], &r.dv[0]).max(normwise(&o.dv[1], &r.dv[1]));
    [out_err, lse_err, normwise(&o.dq, &r.dq), dk, dv]
}

fn assert_close(name: &str, c: &Case) {
    let [out, lse, dq, dk, dv] = errors(c, LayoutMutation::None);
    eprintln!("{name}: out {out:.2e} lse {lse:.2e} dq {dq:.2e} dk {dk:.2e} dv {dv:.2e}");
    assert!(out <= FORWARD_TOLERANCE, "{name}: out error {out:e}");
    assert!(lse <= LSE_TOLERANCE, "{name}: lse error {lse:e}");
    for (what, e) in [("dq", dq), ("dk", dk), ("dv", dv)] {
        assert!(e <= GRADIENT_TOLERANCE, "{name}: {what} error {e:e}");
    }
}

/// Two sequences of 40 context rows: anchors at 0 (block keys only), at the last valid position 39 (a
/// partial tile of 39 context keys), in between, and absent blocks; GQA 4 (a block of 4 warps), head_dim 64.
#[test]
fn ragged_plan_gqa4_head_dim_64() {
    let c = case(1, 4, 1, 64, plan(40, 3, &[&[0, 17, 39], &[5]]));
    assert_close("gqa4 d64", &c);
}

/// A context of 100 rows: an anchor at 99 sees one full 64-key tile and a partial one of 35; GQA 1, two kv
/// heads, head_dim 128.
#[test]
fn full_and_partial_context_tiles_gqa1_head_dim_128() {
    let c = case(2, 2, 2, 128, plan(100, 2, &[&[64, 99], &[1]]));
    assert_close("gqa1 d128", &c);
}

/// GQA 8 (a block of 8 warps), head_dim 128, an anchor past the first tile and a sequence with no anchor.
#[test]
fn gqa8_head_dim_128_and_a_sequence_without_blocks() {
    let c = case(3, 8, 1, 128, plan(70, 2, &[&[3, 66], &[]]));
    assert_close("gqa8 d128", &c);
}

/// Rows of absent blocks (past a sequence's end) get zeros and lse = −∞, and their block keys zero gradients.
#[test]
fn absent_blocks_write_zeros() {
    let c = case(4, 4, 2, 64, plan(20, 2, &[&[7], &[]]));
    let o = run(&c, LayoutMutation::None);
    let (h, d) = (c.heads, c.head_dim);
    for row in BLOCK..c.plan.queries {
        for head in 0..h {
            assert_eq!(o.lse[row * h + head], f32::NEG_INFINITY, "row {row}");
            assert!(
                o.out[(row * h + head) * d..][..d].iter().all(|&x| x == 0.0),
                "row {row}"
            );
            assert!(
                o.dq[(row * h + head) * d..][..d].iter().all(|&x| x == 0.0),
                "row {row}"
            );
        }
    }
    assert!(o.dk[1][BLOCK * c.kv_heads * d..].iter().all(|&x| x == 0.0));
    assert!(o.dv[1][BLOCK * c.kv_heads * d..].iter().all(|&x| x == 0.0));
    assert_close("absent blocks", &c);
}

/// With a fragment layout permuted in the model, the same checks fail: the tests see layout mistakes.
#[test]
fn a_permuted_fragment_layout_fails_the_checks() {
    let c = case(5, 4, 1, 64, plan(40, 2, &[&[20, 39]]));
    for mutation in [
        LayoutMutation::MmaARowsSwapped,
        LayoutMutation::LdmatrixIgnoresTrans,
    ] {
        let [out, _, dq, dk, dv] = errors(&c, mutation);
        eprintln!("{mutation:?}: out {out:.2e} dq {dq:.2e} dk {dk:.2e} dv {dv:.2e}");
        assert!(
            out > 10.0 * FORWARD_TOLERANCE,
            "{mutation:?} went unnoticed in the forward: {out:e}"
        );
        assert!(
            dk.max(dv).max(dq) > 10.0 * GRADIENT_TOLERANCE,
            "{mutation:?} unnoticed in the backward"
        );
    }
}

#[test]
fn other_head_dims_are_refused_with_a_message() {
    let err = check_head_dim(16, 4, 1, 96).unwrap_err();
    assert!(
        err.to_string().contains("head_dim 64 and 128, not 96"),
        "{err}"
    );
    assert!(check_head_dim(16, 6, 4, 64).is_err());
    assert!(check_head_dim(20, 4, 1, 64).is_err());
}
