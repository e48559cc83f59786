//! The whole CPU training step (forward, fused loss, backward, AdamW) at the quickstart dimensions: din 384,
//! hidden 256, 2 blocks, intermediate 704, 4 heads, vocab 4096, 2048 tokens (4 sequences × 512).
//!
//! Groups:
//! - `step_flops`: the step and the bare sequence of its GEMMs (same shapes and transposes, nothing else), both
//!   with `Throughput::Elements` = the step's GEMM FLOPs, so the two `elem/s` figures are FLOP/s and their ratio
//!   is the step's effective FLOP rate as a fraction of the bare GEMM rate, measured in the same run.
//! - `step_tokens`: the step with `Throughput::Elements` = tokens, i.e. tokens/s.
//! - `step_hs_dtype`: staging and step of the same batch held in f32 and in bf16 (`hs_dtype`), then the median
//!   ratio of bf16 to f32 step time over interleaved pairs.
//!
//! Everything runs on a drafter's threads ([`HostThreads`]), as `draftpipe run` runs the step: the bare GEMMs
//! split over them as the step's do.
//!
//! Run: `cargo bench --bench step -- --warm-up-time 1 --measurement-time 5` (`MATMUL_NUM_THREADS` sets the
//! drafter's threads; default: every core).

use std::time::Instant;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use draftpipe_compiler::plan::{
    AdamWSpec, BackendKind, BucketPlan, HsDtype, LossSpec, LrSchedule, MlpSpec, ModelPlan,
    Precision, WorkspaceLayout,
};
use draftpipe_runtime::backend::cpu::CpuBackend;
use draftpipe_runtime::backend::cpu::{HostThreads, matmul};
use draftpipe_runtime::batch::{HsBatch, HsData};
use draftpipe_runtime::drafter::Drafter;
use draftpipe_runtime::drafter::cpu::CpuDrafter;
use draftpipe_runtime::params::FlatState;

const SPEC: MlpSpec = MlpSpec {
    din: 384,
    hidden: 256,
    blocks: 2,
    intermediate: 704,
    heads: 4,
    vocab: 4096,
};
const PADDED_LEN: usize = 512;
const SEQUENCES: usize = 4;
const TOKENS: usize = PADDED_LEN * SEQUENCES;
const CHUNK: usize = 512;

/// One GEMM of the step: `[m, k] · [k, n]`, with whether each operand is stored transposed.
#[derive(Clone, Copy)]
struct Shape {
    m: usize,
    k: usize,
    n: usize,
    a_t: bool,
    b_t: bool,
}

const fn g(m: usize, k: usize, n: usize, a_t: bool, b_t: bool) -> Shape {
    Shape { m, k, n, a_t, b_t }
}

/// The step's GEMMs (shapes and transposes) as `runtime/src/model/mlp/mod.rs` issues them; the order differs (the
/// model runs each head's loss and backward together), the FLOPs and shapes do not.
fn step_gemms() -> Vec<Shape> {
    let MlpSpec {
        din,
        hidden: h,
        blocks,
        intermediate: i,
        heads,
        vocab: v,
    } = SPEC;
    let t = TOKENS;
    let mut list = vec![g(t, din, h, false, true)];
    for _ in 0..blocks {
        list.extend([g(t, h, 2 * i, false, true), g(t, i, h, false, true)]);
    }
    list.extend((0..heads).map(|_| g(t, h, h, false, true)));
    for _ in 0..heads {
        for start in (0..t).step_by(CHUNK) {
            let c = CHUNK.min(t - start);
            list.extend([
                g(c, h, v, false, true),
                g(c, v, h, false, false),
                g(v, c, h, true, false),
            ]);
        }
    }
    for _ in 0..heads {
        list.extend([g(h, t, h, true, false), g(t, h, h, false, false)]);
    }
    for _ in 0..blocks {
        list.extend([
            g(h, t, i, true, false),
            g(t, h, i, false, false),
            g(2 * i, t, h, true, false),
            g(t, 2 * i, h, false, false),
        ]);
    }
    list.push(g(h, t, din, true, false));
    list
}

fn run_gemms(list: &[Shape], a: &[f32], b: &[f32], c: &mut [f32]) {
    for s in list {
        matmul(
            &mut c[..s.m * s.n],
            (&a[..s.m * s.k], s.a_t),
            (&b[..s.k * s.n], s.b_t),
            (s.m, s.k, s.n),
        );
    }
}

fn batch() -> HsBatch {
    let mut batch = HsBatch::zeroed(PADDED_LEN, SEQUENCES, SPEC.din);
    let mut s = 0x2545_F491_4F6C_DD1Du64;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let hs = batch.hs.as_f32_mut().expect("an f32 batch");
    for (k, v) in hs.iter_mut().enumerate() {
        *v = ((next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
            * if k % 3 == 0 { 2.0 } else { 1.0 };
    }
    for (t, id) in batch.input_ids.iter_mut().enumerate() {
        *id = (next() % SPEC.vocab as u64) as u32;
        batch.loss_mask[t] = 1;
    }
    batch.seq_lens.fill(PADDED_LEN as u32);
    batch
}

/// The quickstart's model, its one bucket, and the optimizer and loss both benchmarks train with.
fn settings() -> (ModelPlan, BucketPlan, AdamWSpec, LossSpec) {
    let bucket = BucketPlan {
        padded_len: PADDED_LEN,
        sequences: SEQUENCES,
        tokens: TOKENS,
        step_flops: 0,
        step_bytes: 0,
    };
    let optimizer = AdamWSpec {
        lr: 1e-4,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        clip_grad_norm: Some(1.0),
        schedule: LrSchedule::CONSTANT,
    };
    let loss = LossSpec {
        head_decay: 0.8,
        position_decay: None,
        step_decay: None,
        chunk_tokens: CHUNK,
    };
    (ModelPlan::new(SPEC), bucket, optimizer, loss)
}

fn bench_step(c: &mut Criterion) {
    let (model, bucket, optimizer, loss) = settings();
    let mut drafter = CpuDrafter::new(&model, loss, optimizer, &[bucket]);
    let mut state = FlatState::init(&model, 0);
    let batch = batch();
    let threads = drafter_threads();
    let mut step = || {
        threads.run(|| {
            drafter
                .forward_backward(&mut state, &batch)
                .expect("bench batch fits its bucket");
            drafter.optimizer_step(&mut state);
        })
    };

    let gemms = step_gemms();
    let flops: u64 = gemms.iter().map(|s| 2 * (s.m * s.k * s.n) as u64).sum();
    let largest = |f: fn(&Shape) -> usize| gemms.iter().map(f).max().unwrap_or(0);
    let a = vec![0.5f32; largest(|s| s.m * s.k)];
    let b = vec![0.25f32; largest(|s| s.k * s.n)];
    let mut out = vec![0.0f32; largest(|s| s.m * s.n)];
    println!(
        "step: {} GEMMs, {:.2} GFLOP per step",
        gemms.len(),
        flops as f64 / 1e9
    );

    let mut group = c.benchmark_group("step_flops");
    group.sample_size(10);
    group.throughput(Throughput::Elements(flops));
    group.bench_function("step", |bench| bench.iter(&mut step));
    group.bench_function("bare_gemm", |bench| {
        bench.iter(|| threads.run(|| run_gemms(&gemms, &a, &b, &mut out)))
    });
    group.finish();

    let mut group = c.benchmark_group("step_tokens");
    group.sample_size(10);
    group.throughput(Throughput::Elements(TOKENS as u64));
    group.bench_function("step", |bench| bench.iter(&mut step));
    group.finish();

    // The two groups above run minutes apart, and this machine's GEMM rate drifts by more than the target's
    // margin over minutes; pairs timed back to back give a ratio that drift cannot bias.
    let mut ratios: Vec<f64> = (0..INTERLEAVED_PAIRS)
        .map(|_| {
            let started = Instant::now();
            step();
            let step_time = started.elapsed();
            let started = Instant::now();
            threads.run(|| run_gemms(&gemms, &a, &b, &mut out));
            started.elapsed().as_secs_f64() / step_time.as_secs_f64()
        })
        .collect();
    ratios.sort_by(f64::total_cmp);
    println!(
        "step rate / bare GEMM rate, {INTERLEAVED_PAIRS} interleaved pairs: median {:.1}% (min {:.1}%, max {:.1}%)",
        100.0 * ratios[ratios.len() / 2],
        100.0 * ratios[0],
        100.0 * ratios[ratios.len() - 1],
    );
}

/// Back-to-back (step, bare GEMMs) pairs behind the printed ratio.
const INTERLEAVED_PAIRS: usize = 9;

/// The drafter step (staging included) on the same bf16-representable batch held in f32 and in bf16: the bf16
/// batch stays bf16 in the input slot and the first layer's products widen it a tile at a time.
fn bench_hs_dtype(c: &mut Criterion) {
    let (model, bucket, optimizer, loss) = settings();
    let wide = batch();
    let values = wide.hs.as_f32().expect("an f32 batch");
    let drafter_for = |hs: HsDtype| {
        let layout = WorkspaceLayout::mlp(
            &SPEC,
            std::slice::from_ref(&bucket),
            &loss,
            BackendKind::Cpu,
            Precision::F32,
        )
        .and_then(|layout| layout.with_hs_dtype(BackendKind::Cpu, hs))
        .expect("layout");
        let mut drafter = Drafter::with_hs_dtype(
            CpuBackend::new(&layout),
            &model,
            (loss, optimizer, Precision::F32),
            std::slice::from_ref(&bucket),
            hs,
        )
        .expect("drafter");
        drafter
            .upload_state(&FlatState::init(&model, 0))
            .expect("state");
        let mut batch = HsBatch {
            hs: HsData::zeroed(hs, wide.din, values.len()),
            ..wide.clone()
        };
        // Both runs see the same values: each rounded to bf16 once.
        let rounded: Vec<f32> = values
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_f32())
            .collect();
        batch.hs.store_f32(0, &rounded);
        (drafter, batch)
    };
    let (mut f32_drafter, f32_batch) = drafter_for(HsDtype::F32);
    let (mut bf16_drafter, bf16_batch) = drafter_for(HsDtype::Bf16);
    let threads = drafter_threads();
    let step = |drafter: &mut Drafter<CpuBackend>, batch: &HsBatch| {
        threads.run(|| {
            drafter.stage(batch).expect("bench batch fits its bucket");
            drafter.step().expect("step");
        })
    };

    let mut group = c.benchmark_group("step_hs_dtype");
    group.sample_size(10);
    group.throughput(Throughput::Elements(TOKENS as u64));
    group.bench_function("f32", |bench| {
        bench.iter(|| step(&mut f32_drafter, &f32_batch))
    });
    group.bench_function("bf16", |bench| {
        bench.iter(|| step(&mut bf16_drafter, &bf16_batch))
    });
    group.finish();

    let mut ratios: Vec<f64> = (0..INTERLEAVED_PAIRS)
        .map(|_| {
            let started = Instant::now();
            step(&mut f32_drafter, &f32_batch);
            let f32_time = started.elapsed();
            let started = Instant::now();
            step(&mut bf16_drafter, &bf16_batch);
            started.elapsed().as_secs_f64() / f32_time.as_secs_f64()
        })
        .collect();
    ratios.sort_by(f64::total_cmp);
    println!(
        "bf16 step time / f32 step time, {INTERLEAVED_PAIRS} interleaved pairs: median {:.3} (min {:.3}, max {:.3})",
        ratios[ratios.len() / 2],
        ratios[0],
        ratios[ratios.len() - 1],
    );
}

/// A drafter's threads, as `draftpipe run` gives each CPU drafter: every timed step and GEMM runs inside them
/// (criterion itself cannot move to another thread, so each iteration enters the pool: about 10 µs, the same
/// for the step and the bare GEMMs).
fn drafter_threads() -> HostThreads {
    let threads = HostThreads::new("bench", HostThreads::drafter_threads()).expect("threads");
    println!("on {} drafter thread(s)", threads.threads());
    threads
}

criterion_group!(benches, bench_step, bench_hs_dtype);
criterion_main!(benches);
