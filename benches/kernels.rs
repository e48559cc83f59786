//! Kernel benchmarks on the CPU backend, quickstart dimensions (T = 2048 tokens, H = 256, I = 704, V = 4096,
//! 2.49 M parameters, the `mlp` drafter with din 384, 2 blocks, 4 heads).
//!
//! Each group holds one kernel and a plain `memcpy` that moves the same bytes (half read, half written), both with
//! `Throughput::Bytes` of the kernel's minimum traffic, so the two GB/s figures of one run sit side by side.
//! `fused_loss` compares the chunked loss of one head with the variant that materialises all `T × V` logits
//! (same code, one chunk of T rows), and prints the peak heap of each.
//!
//! `attention` times the DFlash attention forward and backward on the host (4 sequences of 256 context rows,
//! 32 anchors each spread over the sequence, blocks of 4, 4 query heads over 2 kv heads of 16: the shapes of
//! the example pipeline with longer sequences), with `Throughput::Elements` = the floating-point
//! operations of the unmasked (query, head, key) pairs only (forward `4·hd` per pair, backward `14·hd`: both
//! passes recompute the scores), and prints how many pairs a dense `[queries × keys]` computation would touch.
//!
//! `gemm_realistic` times the CPU backend's products (`matmul`, one thread) at `benches/dflash-realistic.pipe`'s
//! shapes (480 labelled rows of a 512-token sequence, width 512, intermediate 1536, vocabulary 8192), with
//! `Throughput::Elements` = their floating-point operations (`2·m·k·n`), so the rate reads as FLOP/s.
//!
//! Run: `cargo bench --bench kernels -- --warm-up-time 1 --measurement-time 3`.

use criterion::{
    BenchmarkGroup, Criterion, Throughput, criterion_group, criterion_main, measurement::WallTime,
};
use draftpipe_compiler::plan::MlpSpec;
use draftpipe_runtime::backend::cpu::{gemm_flops, kernels, matmul};
use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

#[path = "support/head_loss.rs"]
mod head_loss;
use head_loss::{HeadLoss, head_loss};

struct PeakTracking;
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards every call to `System` unchanged; only tracks sizes.
unsafe impl GlobalAlloc for PeakTracking {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let live = LIVE.fetch_add(layout.size(), Relaxed) + layout.size();
        PEAK.fetch_max(live, Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: PeakTracking = PeakTracking;

const T: usize = 2048;
const H: usize = 256;
const I: usize = 704;
const V: usize = 4096;
const CHUNK: usize = 256;

/// Deterministic values in (-1, 1) from a xorshift sequence.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// Benchmarks `kernel` and a memcpy of the same `bytes` in one group.
fn with_memcpy(c: &mut Criterion, name: &str, bytes: usize, mut kernel: impl FnMut()) {
    let mut group: BenchmarkGroup<'_, WallTime> = c.benchmark_group(name);
    group.throughput(Throughput::Bytes(bytes as u64));
    group.bench_function("kernel", |b| b.iter(&mut kernel));
    let src = vec![1u8; bytes / 2];
    let mut dst = vec![0u8; bytes / 2];
    group.bench_function("memcpy", |b| {
        b.iter(|| dst.copy_from_slice(black_box(&src)))
    });
    group.finish();
}

fn bench_kernels(c: &mut Criterion) {
    let spec = MlpSpec {
        din: 384,
        hidden: H,
        blocks: 2,
        intermediate: I,
        heads: 4,
        vocab: V,
    };
    let params_len = spec.parameter_count();
    let f = 4;
    let x = values(T * H, 1);
    let w = values(H, 2);
    let dy = values(T * H, 3);
    let (mut y, mut inv) = (vec![0.0; T * H], vec![0.0; T]);
    kernels::rmsnorm_forward(&x, &w, &mut y, &mut inv, 1e-6);
    with_memcpy(c, "rmsnorm_forward", 2 * T * H * f, || {
        kernels::rmsnorm_forward(&x, &w, &mut y, &mut inv, 1e-6)
    });
    let mut dx = vec![0.0; T * H];
    with_memcpy(c, "rmsnorm_backward_input", 3 * T * H * f, || {
        kernels::rmsnorm_backward_input(&x, &w, &inv, &dy, &mut dx, false)
    });
    let (mut dw, mut partials) = (vec![0.0; H], vec![0.0; T.div_ceil(64) * H]);
    with_memcpy(c, "rmsnorm_weight_grad", 2 * T * H * f, || {
        kernels::rmsnorm_weight_grad(&x, &inv, &dy, &mut dw, &mut partials, 64)
    });

    let gate_up = values(2 * T * I, 4);
    let dact = values(T * I, 5);
    let (mut act, mut dgu) = (vec![0.0; T * I], vec![0.0; 2 * T * I]);
    with_memcpy(c, "swiglu_forward", 3 * T * I * f, || {
        kernels::swiglu_forward(&gate_up, &mut act, I)
    });
    with_memcpy(c, "swiglu_backward", 5 * T * I * f, || {
        kernels::swiglu_backward(&gate_up, &dact, &mut dgu, I)
    });

    let a = values(T * H, 6);
    let mut h = vec![0.0; T * H];
    with_memcpy(c, "head_residual_forward", 3 * T * H * f, || {
        kernels::head_residual_forward(&x, &a, &mut h)
    });
    let (dh, mut da, mut dz) = (values(T * H, 7), vec![0.0; T * H], vec![0.0; T * H]);
    with_memcpy(c, "head_residual_backward", 5 * T * H * f, || {
        kernels::head_residual_backward(&a, &dh, &mut da, &mut dz)
    });

    let logits_in: Vec<f32> = values(CHUNK * V, 8).iter().map(|v| 8.0 * v).collect();
    let labels: Vec<i32> = (0..CHUNK as i32).map(|r| (r * 37) % V as i32).collect();
    let mut logits = logits_in.clone();
    let mut row_loss = vec![0.0; CHUNK];
    // Rewriting the chunk each iteration keeps the input fixed; the copy is part of the measured bytes.
    with_memcpy(c, "vocab_loss_chunk", 4 * CHUNK * V * f, || {
        logits.copy_from_slice(&logits_in);
        kernels::vocab_loss(&mut logits, &labels, 0.5, &mut row_loss, V)
    });

    let grads = values(params_len, 9);
    let mut norm_partials = vec![0.0; params_len.div_ceil(1 << 14)];
    with_memcpy(c, "grad_norm", params_len * f, || {
        black_box(kernels::grad_norm(&grads, 1 << 14, &mut norm_partials, 1.0));
    });
    let mut params = values(params_len, 10);
    let (mut m, mut v) = (vec![0.0; params_len], vec![0.0; params_len]);
    let hyper = kernels::adamw_step_scalars(1e-4, 0.9, 0.999, 1e-8, 0.01, 10);
    with_memcpy(c, "adamw", 7 * params_len * f, || {
        kernels::adamw_update(&mut params, &grads, &mut m, &mut v, 1.0, 1.0, hyper)
    });
}

fn bench_fused_loss(c: &mut Criterion) {
    let h = values(T * H, 11);
    let lm_head: Vec<f32> = values(V * H, 12).iter().map(|v| v / 16.0).collect();
    let labels: Vec<i32> = (0..T as i32)
        .map(|r| {
            if r % 10 == 0 {
                -1
            } else {
                (r * 131) % V as i32
            }
        })
        .collect();
    let input = HeadLoss {
        h: &h,
        lm_head: &lm_head,
        labels: &labels,
        scale: 1.0 / T as f32,
        hidden: H,
        vocab: V,
    };
    let (mut row_loss, mut dh, mut d_lm) = (vec![0.0; T], vec![0.0; T * H], vec![0.0; V * H]);
    let mut group = c.benchmark_group("fused_loss");
    group.sample_size(10);
    group.throughput(Throughput::Elements(T as u64));
    for (name, rows) in [("chunked_256", CHUNK), ("materialised", T)] {
        let before = LIVE.load(Relaxed);
        PEAK.store(before, Relaxed);
        let mut logits = vec![0.0f32; rows * V];
        head_loss(input, &mut logits, &mut row_loss, &mut dh, &mut d_lm, false);
        println!(
            "fused_loss/{name}: peak heap growth {:.1} MB",
            (PEAK.load(Relaxed) - before) as f64 / 1e6
        );
        group.bench_function(name, |b| {
            b.iter(|| head_loss(input, &mut logits, &mut row_loss, &mut dh, &mut d_lm, false))
        });
    }
    group.finish();
}

/// The ranges of a DFlash block plan: `sequences` of `len` context rows, `anchors` per sequence evenly spread,
/// `block` query rows each. Returns `(query_ranges, key_ranges_ctx, key_ranges_blk, unmasked pairs)`.
fn dflash_ranges(
    sequences: usize,
    len: usize,
    anchors: usize,
    block: usize,
) -> (Vec<u32>, Vec<u32>, Vec<u32>, usize) {
    let (mut query, mut key_ctx, mut key_blk, mut pairs) = (vec![], vec![], vec![], 0);
    let mut row = 0u32;
    for s in 0..sequences {
        let start = (s * len) as u32;
        let first_row = row;
        let anchor_at = |j: usize| (j * (len - 1) / anchors) as u32;
        for j in 0..anchors {
            for _ in 0..block {
                query.extend([start, start + anchor_at(j), row, row + block as u32]);
                key_blk.extend([row, row + block as u32]);
                pairs += anchor_at(j) as usize + block;
            }
            row += block as u32;
        }
        for position in 0..len as u32 {
            let first = (0..anchors).find(|&j| anchor_at(j) > position);
            key_ctx.extend(match first {
                Some(j) => [first_row + (j * block) as u32, row],
                None => [0, 0],
            });
        }
    }
    (query, key_ctx, key_blk, pairs)
}

fn bench_attention(c: &mut Criterion) {
    use draftpipe_runtime::backend::AttentionShape;
    use draftpipe_runtime::backend::cpu::attention::{
        AttentionGradSlices, AttentionSlices, HostKernels, attention_backward, attention_forward,
    };
    let (sequences, len, anchors, block) = (4, 256, 32, 4);
    let shape = AttentionShape::new(4, 2, 16);
    let (query_ranges, key_ctx, key_blk, pairs_per_head) =
        dflash_ranges(sequences, len, anchors, block);
    let (queries, context) = (sequences * anchors * block, sequences * len);
    let (q_len, ctx_len, blk_len) = (
        queries * shape.heads * shape.head_dim,
        context * shape.kv_heads * shape.head_dim,
        queries * shape.kv_heads * shape.head_dim,
    );
    let inputs = [
        values(q_len, 21),
        values(ctx_len, 22),
        values(ctx_len, 23),
        values(blk_len, 24),
        values(blk_len, 25),
    ];
    let slices = AttentionSlices {
        q: &inputs[0],
        k_ctx: &inputs[1],
        v_ctx: &inputs[2],
        k_blk: &inputs[3],
        v_blk: &inputs[4],
        query_ranges: &query_ranges,
    };
    let pairs = pairs_per_head * shape.heads;
    let dense = queries * shape.heads * (context + queries);
    println!(
        "attention: {queries} queries × {} heads, {pairs} unmasked (query, head, key) pairs of {dense} dense \
         ({:.1} %)",
        shape.heads,
        100.0 * pairs as f64 / dense as f64
    );
    let (mut out, mut lse) = (vec![0.0; q_len], vec![0.0; queries * shape.heads]);
    let dout = values(q_len, 26);
    let mut delta = vec![0.0; queries * shape.heads];
    let mut grads: [Vec<f32>; 5] =
        [q_len, ctx_len, ctx_len, blk_len, blk_len].map(|n| vec![0.0; n]);
    let mut group = c.benchmark_group("attention");
    group.sample_size(10);
    // Both host implementations on one thread, side by side: the kernel table's bodies (the GPU's code) and
    // the vectorised tiles the CPU step runs.
    for (name, kernels) in [
        ("planes", HostKernels::Planes),
        ("lanes", HostKernels::Lanes),
    ] {
        attention_forward(kernels, slices, shape, &mut out, &mut lse);
        group.throughput(Throughput::Elements((pairs * 4 * shape.head_dim) as u64));
        group.bench_function(format!("forward/{name}"), |b| {
            b.iter(|| attention_forward(kernels, slices, shape, &mut out, &mut lse))
        });
        group.throughput(Throughput::Elements((pairs * 14 * shape.head_dim) as u64));
        group.bench_function(format!("backward/{name}"), |b| {
            b.iter(|| {
                let [dq, dk_ctx, dv_ctx, dk_blk, dv_blk] = &mut grads;
                attention_backward(
                    kernels,
                    slices,
                    shape,
                    &out,
                    &dout,
                    &lse,
                    &key_ctx,
                    &key_blk,
                    &mut delta,
                    AttentionGradSlices {
                        dq,
                        dk_ctx,
                        dv_ctx,
                        dk_blk,
                        dv_blk,
                    },
                )
            })
        });
    }
    group.finish();
}

/// One product of the realistic step: its name, `(m, k, n)`, and whether `a` and `b` are read transposed.
type RealisticGemm = (&'static str, (usize, usize, usize), bool, bool);

/// The realistic DFlash step's products: the head's logits `h · lm_headᵀ` and their input gradient
/// `dlogits · lm_head`, the MLP's `x · gateᵀ`, the down projection's input gradient `dy · down` (`down` is
/// `[512, 1536]`), and a weight gradient `dyᵀ · x` (`a` read transposed).
const REALISTIC_GEMMS: [RealisticGemm; 5] = [
    ("logits", (480, 512, 8192), false, true),
    ("logits_input_grad", (480, 8192, 512), false, false),
    ("mlp_gate", (512, 512, 1536), false, true),
    ("down_input_grad", (512, 512, 1536), false, false),
    ("weight_grad", (1536, 512, 512), true, false),
];

fn bench_gemm_realistic(c: &mut Criterion) {
    let mut group = c.benchmark_group("gemm_realistic");
    for (name, (m, k, n), a_transposed, b_transposed) in REALISTIC_GEMMS {
        let (a, b) = (values(m * k, 11), values(k * n, 12));
        let mut out = vec![0.0f32; m * n];
        group.throughput(Throughput::Elements(gemm_flops(m, k, n)));
        group.bench_function(name, |bench| {
            bench.iter(|| matmul(&mut out, (&a, a_transposed), (&b, b_transposed), (m, k, n)))
        });
    }
    group.finish();
}

criterion_group!(
    benches,
    bench_kernels,
    bench_fused_loss,
    bench_attention,
    bench_gemm_realistic
);
criterion_main!(benches);
