//! GPU benchmarks of the CUDA backend, timed with CUDA events, printing one table last (issue 5 targets):
//!
//! - AdamW bandwidth against a device-to-device copy measured in the same run (target ≥ 85 %);
//! - the fused vocabulary loss against a version that materialises all logits (time and logits memory);
//! - the whole step of the `mlp-5x3.pipe` drafter (din 12288, hidden 1024, 2 blocks, intermediate 2816,
//!   4 heads, vocab 151936, 16384 tokens per step) in eager and graph mode with f32 GEMMs, in graph mode with
//!   TF32 and bf16 GEMMs (`precision`), and at bf16 with bf16 hidden states (16-bit input slots, half the
//!   host→device bytes, the first products as 16-bit GEMMs): tokens/s, device busy % with the next batch
//!   always staged (target ≥ 97 % in graph mode), host µs per step (target ≤ 20). Each section's rows are
//!   printed as soon as they are measured;
//! - the DFlash attention kernels at Qwen3-8B's shape (32 query and 8 kv heads of 128; one sequence of 8192
//!   context rows with 512 anchors evenly spread, blocks of 16: 8192 queries): time against the FLOPs of the
//!   unmasked (query, head, key) pairs only (forward `4·hd` per pair; backward `14·hd`, both of its passes
//!   recomputing the scores), and the fraction of the dense `[queries × keys]` pairs they are; the flash kernels
//!   (bf16, tensor cores: what `precision = bf16` runs) on the same case first;
//! - the whole DFlash step of `pipelines/dflash-5x3.pipe` (its largest bucket, 8192 tokens) in eager and graph
//!   mode at bf16 and TF32, and in graph mode at bf16 with bf16 hidden states (as the pipeline holds them):
//!   tokens/s, MFU against the compiler's FLOP count of the step (H200 dense peaks: 989 TFLOP/s bf16, 494
//!   TF32), device busy %.
//!
//! The sections run most valuable first (the DFlash step as `dflash-5x3.pipe` trains it, then its attention, the
//! other DFlash variants, the mlp step, the single kernels), so a GPU window cut short keeps the rows that
//! matter. Medians over repetitions. Without a GPU it prints one line and exits 0. Run: `cargo bench -p
//! draftpipe-runtime --bench cuda_step`, or the prebuilt binary from `scripts/gpu-check.sh`.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr as _, result as driver};
use draftpipe_compiler::plan::{
    AdamWSpec, BucketPlan, LaunchMode, LossSpec, LrSchedule, MlpSpec, ModelPlan, Precision,
};
use draftpipe_gpu_kernels::adamw::AdamWStep;
use draftpipe_runtime::backend::cuda::{
    DevicePtr, FlashLauncher, Gemm, KernelModule, Launcher, Op, discover_devices, open_device,
};
use draftpipe_runtime::batch::{HsBatch, HsDtype};
use draftpipe_runtime::drafter::cuda::CudaDrafter;
use draftpipe_runtime::params::FlatState;

const REPS: usize = 15;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn alloc(stream: &Arc<CudaStream>, n: usize, value: f32) -> (CudaSlice<f32>, DevicePtr<f32>) {
    typed(
        stream,
        stream.clone_htod(&vec![value; n]).expect("allocate"),
    )
}

/// `slice` and its typed address.
fn typed<T>(stream: &Arc<CudaStream>, slice: CudaSlice<T>) -> (CudaSlice<T>, DevicePtr<T>) {
    let (ptr, _) = slice.device_ptr(stream);
    // SAFETY: the address of `slice`'s own allocation of `slice.len()` elements.
    let typed = unsafe { DevicePtr::from_raw(ptr, slice.len()) };
    (slice, typed)
}

/// Zeroed device memory (contents irrelevant, or overwritten before use), without a host-side copy.
fn zeros(stream: &Arc<CudaStream>, n: usize) -> (CudaSlice<f32>, DevicePtr<f32>) {
    typed(stream, stream.alloc_zeros::<f32>(n).expect("allocate"))
}

/// Median milliseconds of `work` between two events on `stream`.
fn time_ms(ctx: &Arc<CudaContext>, stream: &Arc<CudaStream>, mut work: impl FnMut()) -> f64 {
    let start = ctx
        .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .expect("event");
    let stop = ctx
        .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .expect("event");
    work();
    let samples = (0..REPS)
        .map(|_| {
            start.record(stream).expect("record");
            work();
            stop.record(stream).expect("record");
            f64::from(start.elapsed_ms(&stop).expect("elapsed"))
        })
        .collect();
    median(samples)
}

struct Row(String, String, String);

fn adamw_vs_copy(ctx: &Arc<CudaContext>, k: &Launcher, rows: &mut Vec<Row>) {
    let s = k.stream().clone();
    let n = 64 << 20;
    let (_p, p) = alloc(&s, n, 0.5);
    let (_g, g) = alloc(&s, n, 1e-3);
    let (_m, m) = zeros(&s, n);
    let (_v, v) = zeros(&s, n);
    let (_norm, norm) = alloc(&s, 1, 1.0);
    let (_clip, clip) = alloc(&s, 1, 1.0);
    let hyper_host = [1e-4f32, 0.9, 0.95, 1e-8, 0.01, 1e-3, 0.3];
    let (_hyper, hyper) = typed(&s, s.clone_htod(&hyper_host).expect("hyper"));
    // SAFETY: the seven f32s of a `repr(C)` `AdamWStep`.
    let hyper = unsafe { hyper.cast::<AdamWStep>() };
    let adamw_ms = time_ms(ctx, &s, || {
        k.adamw_update(g, norm, clip, hyper, p, m, v, n)
            .expect("adamw")
    });
    let (_dst, dst) = zeros(&s, 7 * n);
    let (_src, src) = zeros(&s, 7 * n);
    let copy_bytes = 7 * n * 4 / 2;
    // SAFETY: both buffers hold `7n` f32s; half of that is copied so reads + writes equal AdamW's 28 B/element.
    let copy_ms = time_ms(ctx, &s, || {
        unsafe { driver::memcpy_dtod_async(dst.addr(), src.addr(), copy_bytes, s.cu_stream()) }
            .expect("copy")
    });
    let adamw_gbs = (n * 28) as f64 / adamw_ms / 1e6;
    let copy_gbs = (2 * copy_bytes) as f64 / copy_ms / 1e6;
    rows.push(Row(
        "AdamW, 64 Mi params (28 B/param)".into(),
        format!("{adamw_gbs:.0} GB/s ({adamw_ms:.3} ms)"),
        "".into(),
    ));
    rows.push(Row(
        "D2D copy, same bytes".into(),
        format!("{copy_gbs:.0} GB/s ({copy_ms:.3} ms)"),
        "".into(),
    ));
    rows.push(Row(
        "AdamW / copy".into(),
        format!("{:.1} %", 100.0 * adamw_gbs / copy_gbs),
        "≥ 85 %".into(),
    ));
}

fn fused_vs_materialised(ctx: &Arc<CudaContext>, k: &Launcher, rows: &mut Vec<Row>) {
    let s = k.stream().clone();
    let gemm = Gemm::new(s.clone()).expect("cuBLAS");
    let (t, h, v, chunk) = (16384usize, 1024usize, 151936usize, 4096usize);
    let (_h, hs) = alloc(&s, t * h, 0.01);
    let (_w, lm) = alloc(&s, v * h, 0.01);
    let (_dh, dh) = zeros(&s, t * h);
    let (_dw, dlm) = zeros(&s, v * h);
    let labels_host: Vec<i32> = (0..t).map(|i| (i * 7919 % v) as i32).collect();
    let (_labels, labels) = typed(&s, s.clone_htod(&labels_host).expect("labels"));
    let (_scale, scale) = alloc(&s, 1, 1.0 / t as f32);
    let (_loss, row_loss) = alloc(&s, t, 0.0);
    let (hs, lm, dh, dlm) = (hs.addr(), lm.addr(), dh.addr(), dlm.addr());
    let run = |rows_per_chunk: usize, logits: DevicePtr<f32>| {
        for start in (0..t).step_by(rows_per_chunk) {
            let r = rows_per_chunk.min(t - start);
            let hrow = hs + (start * h * 4) as u64;
            let at = |e: usize| labels.offset(e).expect("inside the labels");
            k.vocab_loss_row(
                at(start),
                scale,
                logits,
                row_loss.offset(start).expect("inside the row losses"),
                v,
                r,
            )
            .expect("loss");
            let logits = logits.addr();
            // SAFETY: every buffer above holds the shapes used here.
            unsafe {
                gemm.row_major((Op::N, hrow), (Op::T, lm), logits, (r, v, h), 1.0, 0.0)
                    .expect("logits");
                gemm.row_major(
                    (Op::N, logits),
                    (Op::N, lm),
                    dh + (start * h * 4) as u64,
                    (r, h, v),
                    1.0,
                    0.0,
                )
                .expect("dh");
                let beta = if start == 0 { 0.0 } else { 1.0 };
                gemm.row_major((Op::T, logits), (Op::N, hrow), dlm, (v, h, r), 1.0, beta)
                    .expect("dlm");
            }
        }
    };
    let fused_ms = {
        let (_l, logits) = zeros(&s, chunk * v);
        time_ms(ctx, &s, || run(chunk, logits))
    };
    let full_ms = {
        let (_l, logits) = zeros(&s, t * v);
        time_ms(ctx, &s, || run(t, logits))
    };
    let gib = |elems: usize| (elems * 4) as f64 / (1u64 << 30) as f64;
    rows.push(Row(
        format!("fused loss, T {t}, V {v}, chunk {chunk}"),
        format!("{fused_ms:.1} ms, logits {:.2} GiB", gib(chunk * v)),
        "".into(),
    ));
    rows.push(Row(
        "materialised logits, same".into(),
        format!("{full_ms:.1} ms, logits {:.2} GiB", gib(t * v)),
        "".into(),
    ));
}

/// A full batch of `bucket` with hidden states of width `din` held in `hs` (deterministic values in
/// [−0.5, 0.5), rounded to `hs`), token ids below `vocab`, every token labelled.
fn filled_batch(bucket: &BucketPlan, din: usize, vocab: usize, hs: HsDtype) -> HsBatch {
    let mut batch = HsBatch::zeroed_in(hs, bucket.padded_len, bucket.sequences, din);
    let n = batch.hs.len();
    // In chunks, so an f32 copy of a whole bf16 batch never exists.
    let chunk = 1 << 20;
    for start in (0..n).step_by(chunk) {
        let values: Vec<f32> = (start..(start + chunk).min(n))
            .map(|i| ((i * 2654435761) % 1000) as f32 / 1000.0 - 0.5)
            .collect();
        batch.hs.store_f32(start, &values);
    }
    for (i, id) in batch.input_ids.iter_mut().enumerate() {
        *id = (i * 7919 % vocab) as u32;
    }
    batch.seq_lens.fill(bucket.padded_len as u32);
    batch.loss_mask.fill(1);
    batch
}

fn mlp_step(launch: LaunchMode, precision: Precision, hs: HsDtype, rows: &mut Vec<Row>) {
    let spec = MlpSpec {
        din: 3 * 4096,
        hidden: 1024,
        blocks: 2,
        intermediate: 2816,
        heads: 4,
        vocab: 151936,
    };
    let model = ModelPlan::new(spec);
    let loss = LossSpec {
        head_decay: 0.8,
        position_decay: None,
        step_decay: None,
        chunk_tokens: 4096,
    };
    let adamw = AdamWSpec {
        lr: 3e-4,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.01,
        clip_grad_norm: Some(1.0),
        schedule: LrSchedule::CONSTANT,
    };
    let bucket = BucketPlan {
        padded_len: 4096,
        sequences: 4,
        tokens: 16384,
        step_flops: 0,
        step_bytes: 0,
    };
    let mut drafter = CudaDrafter::on_device(
        0,
        &model,
        (loss, adamw, precision),
        (std::slice::from_ref(&bucket), hs),
        launch,
        None,
    )
    .expect("drafter");
    drafter
        .upload_state(&FlatState::init(&model, 1))
        .expect("upload");
    let batch = filled_batch(&bucket, spec.din, spec.vocab, hs);
    let (warmup, measured) = (2, 6);
    for _ in 0..warmup {
        drafter.stage(&batch).expect("stage");
        drafter.step().expect("step");
    }
    drafter.finish().expect("finish");
    let mut outcomes = Vec::new();
    drafter.stage(&batch).expect("stage");
    let began = Instant::now();
    for i in 0..measured {
        outcomes.extend(drafter.step().expect("step"));
        if i + 1 < measured {
            drafter.stage(&batch).expect("stage");
        }
    }
    outcomes.extend(drafter.finish().expect("finish"));
    let wall_s = began.elapsed().as_secs_f64();
    let device_s: f64 = outcomes
        .iter()
        .map(|o| f64::from(o.device_ms.unwrap_or(0.0)) / 1e3)
        .sum();
    let host_us = median(outcomes.iter().map(|o| f64::from(o.host_us)).collect());
    // "busy": the steps' event spans over the wall time, i.e. the gaps between steps (gaps inside an eager step
    // fall inside its span and are not seen here).
    let name = format!(
        "mlp-5x3 step, {launch:?}, {}, 16384 tokens, {} hidden states",
        precision.name(),
        hs.name()
    );
    let tokens_s = (bucket.tokens * measured) as f64 / wall_s;
    let busy = 100.0 * device_s / wall_s;
    let target = if launch == LaunchMode::Graph {
        "≥ 97 %, ≤ 20 µs"
    } else {
        ""
    };
    rows.push(Row(
        name,
        format!("{tokens_s:.0} tok/s, busy {busy:.1} %, host {host_us:.1} µs/step"),
        target.into(),
    ));
}

/// The ranges of a DFlash block plan over one sequence of `len` context rows with `anchors` evenly spread and
/// `block` query rows each: `(query_ranges [Q, 4], key_ranges_ctx [len, 2], key_ranges_blk [Q, 2], unmasked
/// (query, key) pairs)`.
fn dflash_ranges(
    len: usize,
    anchors: usize,
    block: usize,
) -> (Vec<u32>, Vec<u32>, Vec<u32>, usize) {
    let (mut query, mut key_ctx, mut key_blk, mut pairs) = (vec![], vec![], vec![], 0);
    let anchor_at = |j: usize| (j * (len - 1) / anchors) as u32;
    for j in 0..anchors {
        let row = (j * block) as u32;
        for _ in 0..block {
            query.extend([0, anchor_at(j), row, row + block as u32]);
            key_blk.extend([row, row + block as u32]);
            pairs += anchor_at(j) as usize + block;
        }
    }
    for position in 0..len as u32 {
        let first = (0..anchors).find(|&j| anchor_at(j) > position);
        key_ctx.extend(match first {
            Some(j) => [(j * block) as u32, (anchors * block) as u32],
            None => [0, 0],
        });
    }
    (query, key_ctx, key_blk, pairs)
}

fn attention_vs_flops(ctx: &Arc<CudaContext>, k: &Launcher, rows: &mut Vec<Row>) {
    let s = k.stream().clone();
    let (heads, kv_heads, hd, len, anchors, block) =
        (32usize, 8usize, 128usize, 8192usize, 512usize, 16usize);
    let scale = 1.0 / (hd as f32).sqrt();
    let (query_host, key_ctx_host, key_blk_host, pairs) = dflash_ranges(len, anchors, block);
    let queries = anchors * block;
    let (q_len, ctx_len, blk_len) = (
        queries * heads * hd,
        len * kv_heads * hd,
        queries * kv_heads * hd,
    );
    let (_q, q) = alloc(&s, q_len, 0.02);
    let (_kc, k_ctx) = alloc(&s, ctx_len, 0.03);
    let (_vc, v_ctx) = alloc(&s, ctx_len, 0.5);
    let (_kb, k_blk) = alloc(&s, blk_len, 0.03);
    let (_vb, v_blk) = alloc(&s, blk_len, 0.5);
    let (_qr, ranges) = typed(&s, s.clone_htod(&query_host).expect("ranges"));
    let (_kcr, key_ctx) = typed(&s, s.clone_htod(&key_ctx_host).expect("ranges"));
    let (_kbr, key_blk) = typed(&s, s.clone_htod(&key_blk_host).expect("ranges"));
    let (_o, out) = zeros(&s, q_len);
    let (_l, lse) = zeros(&s, queries * heads);
    let (_do, dout) = alloc(&s, q_len, 0.01);
    let (_d, delta) = zeros(&s, queries * heads);
    let (_dq, dq) = zeros(&s, q_len);
    let (_dkc, dk_ctx) = zeros(&s, ctx_len);
    let (_dvc, dv_ctx) = zeros(&s, ctx_len);
    let (_dkb, dk_blk) = zeros(&s, blk_len);
    let (_dvb, dv_blk) = zeros(&s, blk_len);
    let forward_ms = time_ms(ctx, &s, || {
        k.attention_forward(
            q, k_ctx, v_ctx, k_blk, v_blk, ranges, out, lse, queries, len, heads, kv_heads, hd,
            scale,
        )
        .expect("attention forward")
    });
    let backward_ms = time_ms(ctx, &s, || {
        k.attention_delta(out, dout, delta, hd, queries * heads)
            .expect("delta");
        k.attention_backward_q(
            q, k_ctx, v_ctx, k_blk, v_blk, ranges, dout, lse, delta, dq, queries, len, heads,
            kv_heads, hd, scale,
        )
        .expect("attention dq");
        k.attention_backward_kv(
            q, dout, lse, delta, k_ctx, v_ctx, key_ctx, dk_ctx, dv_ctx, len, queries, heads,
            kv_heads, hd, scale,
        )
        .expect("attention dk/dv (context)");
        k.attention_backward_kv(
            q, dout, lse, delta, k_blk, v_blk, key_blk, dk_blk, dv_blk, queries, queries, heads,
            kv_heads, hd, scale,
        )
        .expect("attention dk/dv (block)");
    });
    let head_pairs = pairs * heads;
    let dense = queries * heads * (len + queries);
    let tflops = |per_pair: usize, ms: f64| (head_pairs * per_pair * hd) as f64 / ms / 1e9;
    rows.push(Row(
        format!(
            "attention fwd, {queries} q × {heads}/{kv_heads} heads of {hd}, {len} ctx ({:.1} % of dense pairs)",
            100.0 * head_pairs as f64 / dense as f64
        ),
        format!(
            "{forward_ms:.2} ms, {:.1} TFLOP/s on unmasked pairs ({:.0} GFLOP)",
            tflops(4, forward_ms),
            (head_pairs * 4 * hd) as f64 / 1e9
        ),
        "".into(),
    ));
    rows.push(Row(
        "attention bwd (delta, dq, dk/dv of both key sets), same".into(),
        format!(
            "{backward_ms:.2} ms, {:.1} TFLOP/s on unmasked pairs ({:.0} GFLOP)",
            tflops(14, backward_ms),
            (head_pairs * 14 * hd) as f64 / 1e9
        ),
        "".into(),
    ));
}

/// The flash kernels (bf16 Q/K/V, tensor cores) on `attention_vs_flops`'s case: forward, then the backward
/// (query-major `delta`/dq pass and the key-major dk/dv passes of both key sets), against the FLOPs of the
/// unmasked pairs: `4·hd` forward; backward `14·hd` as run (7 products per pair: the key-major pass recomputes
/// `QKᵀ` and `dO Vᵀ`) and `10·hd` as FlashAttention-2 counts it (5 products), the targets 300 and 200.
fn flash_vs_flops(ctx: &Arc<CudaContext>, k: &FlashLauncher, rows: &mut Vec<Row>) {
    let s = k.stream().clone();
    let (heads, kv_heads, hd, len, anchors, block) =
        (32usize, 8usize, 128usize, 8192usize, 512usize, 16usize);
    let scale = 1.0 / (hd as f32).sqrt();
    let (query_host, key_ctx_host, key_blk_host, pairs) = dflash_ranges(len, anchors, block);
    let queries = anchors * block;
    let (q_len, ctx_len, blk_len) = (
        queries * heads * hd,
        len * kv_heads * hd,
        queries * kv_heads * hd,
    );
    let bf16 = |n: usize, value: f32| {
        let bits = vec![half::bf16::from_f32(value).to_bits(); n];
        typed(&s, s.clone_htod(&bits).expect("allocate"))
    };
    let (_q, q) = bf16(q_len, 0.02);
    let (_kc, k_ctx) = bf16(ctx_len, 0.03);
    let (_vc, v_ctx) = bf16(ctx_len, 0.5);
    let (_kb, k_blk) = bf16(blk_len, 0.03);
    let (_vb, v_blk) = bf16(blk_len, 0.5);
    let (_d16, dout16) = bf16(q_len, 0.0);
    let (_o16, out16) = bf16(q_len, 0.0);
    let (_qr, ranges) = typed(&s, s.clone_htod(&query_host).expect("ranges"));
    let (_kcr, key_ctx) = typed(&s, s.clone_htod(&key_ctx_host).expect("ranges"));
    let (_kbr, key_blk) = typed(&s, s.clone_htod(&key_blk_host).expect("ranges"));
    let (_o, out) = zeros(&s, q_len);
    let (_l, lse) = zeros(&s, queries * heads);
    let (_do, dout) = alloc(&s, q_len, 0.01);
    let (_d, delta) = zeros(&s, queries * heads);
    let (_dq, dq) = zeros(&s, q_len);
    let (_dkc, dk_ctx) = zeros(&s, ctx_len);
    let (_dvc, dv_ctx) = zeros(&s, ctx_len);
    let (_dkb, dk_blk) = zeros(&s, blk_len);
    let (_dvb, dv_blk) = zeros(&s, blk_len);
    let forward_ms = time_ms(ctx, &s, || {
        k.flash_forward_d128(
            q, k_ctx, v_ctx, k_blk, v_blk, ranges, out, out16, lse, queries, len, heads, kv_heads,
            scale,
        )
        .expect("flash forward")
    });
    let backward_ms = time_ms(ctx, &s, || {
        k.flash_backward_q_d128(
            q, k_ctx, v_ctx, k_blk, v_blk, ranges, out, dout, lse, delta, dq, dout16, queries, len,
            heads, kv_heads, scale,
        )
        .expect("flash dq");
        k.flash_backward_kv_d128(
            q, dout16, lse, delta, k_ctx, v_ctx, key_ctx, dk_ctx, dv_ctx, len, queries, heads,
            kv_heads, scale,
        )
        .expect("flash dk/dv (context)");
        k.flash_backward_kv_d128(
            q, dout16, lse, delta, k_blk, v_blk, key_blk, dk_blk, dv_blk, queries, queries, heads,
            kv_heads, scale,
        )
        .expect("flash dk/dv (block)");
    });
    let head_pairs = pairs * heads;
    let tflops = |per_pair: usize, ms: f64| (head_pairs * per_pair * hd) as f64 / ms / 1e9;
    rows.push(Row(
        format!("flash attention fwd (bf16, tensor cores), {queries} q × {heads}/{kv_heads} heads of {hd}, {len} ctx"),
        format!("{forward_ms:.2} ms, {:.1} TFLOP/s on unmasked pairs", tflops(4, forward_ms)),
        "≥ 300 TFLOP/s".into(),
    ));
    rows.push(Row(
        "flash attention bwd (dq pass, dk/dv of both key sets), same".into(),
        format!(
            "{backward_ms:.2} ms, {:.1} TFLOP/s as run (14·hd per pair), {:.1} as FA-2 counts (10·hd)",
            tflops(14, backward_ms),
            tflops(10, backward_ms)
        ),
        "≥ 200 TFLOP/s (FA-2 count)".into(),
    ));
}

/// The DFlash drafter of `pipelines/dflash-5x3.pipe` (Qwen3-8B's shapes) on its largest bucket.
fn dflash_model_step(launch: LaunchMode, precision: Precision, hs: HsDtype, rows: &mut Vec<Row>) {
    // Embedded at build time: the GPU machine runs this binary without the repository.
    let source = include_str!("../../pipelines/dflash-5x3.pipe");
    let plan = draftpipe_compiler::compile_source("pipelines/dflash-5x3.pipe", source)
        .expect("dflash-5x3.pipe compiles");
    let spec = plan.model.spec.as_dflash().expect("a dflash model").clone();
    let bucket = plan
        .buckets
        .iter()
        .max_by_key(|b| b.tokens)
        .expect("a bucket")
        .clone();
    let (loss, adamw) = (plan.drafter.loss, plan.drafter.optimizer);
    let mut drafter = CudaDrafter::on_device(
        0,
        &plan.model,
        (loss, adamw, precision),
        (std::slice::from_ref(&bucket), hs),
        launch,
        None,
    )
    .expect("drafter");
    let table: Vec<f32> = (0..spec.vocab * spec.hidden)
        .map(|i| ((i * 2654435761) % 2000) as f32 / 1e5 - 0.01)
        .collect();
    drafter
        .upload_frozen(&table, &table)
        .expect("frozen tensors");
    drafter
        .upload_state(&FlatState::init(&plan.model, 1))
        .expect("upload");
    let batch = filled_batch(&bucket, spec.hidden * spec.taps, spec.vocab, hs);
    let (warmup, measured) = (1, 4);
    for _ in 0..warmup {
        drafter.stage(&batch).expect("stage");
        drafter.step().expect("step");
    }
    drafter.finish().expect("finish");
    let mut outcomes = Vec::new();
    drafter.stage(&batch).expect("stage");
    let began = Instant::now();
    for i in 0..measured {
        outcomes.extend(drafter.step().expect("step"));
        if i + 1 < measured {
            drafter.stage(&batch).expect("stage");
        }
    }
    outcomes.extend(drafter.finish().expect("finish"));
    let wall_s = began.elapsed().as_secs_f64();
    let device_s: f64 = outcomes
        .iter()
        .map(|o| f64::from(o.device_ms.unwrap_or(0.0)) / 1e3)
        .sum();
    let step_s = wall_s / measured as f64;
    let peak = match precision {
        Precision::Bf16 => 989e12,
        Precision::Tf32 => 494e12,
        Precision::F32 => 67e12,
    };
    rows.push(Row(
        format!(
            "dflash-5x3 DFlash step, {launch:?}, {}, {} tokens, {} hidden states",
            precision.name(),
            bucket.tokens,
            hs.name()
        ),
        format!(
            "{:.0} tok/s, MFU {:.1} % ({:.1} TFLOP/step), busy {:.1} %",
            bucket.tokens as f64 / step_s,
            100.0 * bucket.step_flops as f64 / step_s / peak,
            bucket.step_flops as f64 / 1e12,
            100.0 * device_s / wall_s
        ),
        "".into(),
    ));
}

fn main() {
    let devices = match discover_devices() {
        Ok(d) if !d.is_empty() => d,
        Ok(_) => return println!("cuda_step skipped: the CUDA driver reports no device"),
        Err(e) => return println!("cuda_step skipped: {e}"),
    };
    let ctx = open_device(0).expect("device 0");
    // SAFETY: the benchmarks order their work on one stream through raw addresses.
    unsafe { ctx.disable_event_tracking() };
    let module = KernelModule::load(&ctx).expect("load the embedded PTX");
    let launcher = Launcher::new(&module, ctx.new_stream().expect("stream")).expect("kernels");
    let flash = FlashLauncher::new(&module, launcher.stream().clone()).expect("flash kernels");
    let d = &devices[0];
    println!(
        "\n{} (sm_{}{}), medians of {REPS} runs (steps: 6 after 2 warm-up)",
        d.name, d.compute_capability.0, d.compute_capability.1
    );
    println!("| measure | result | target |\n| --- | --- | --- |");
    // Each section's rows are printed as soon as it is measured, so a time-out keeps the rows before it.
    let mut rows = Vec::new();
    let mut printed = 0;
    let mut measure = |section: &mut dyn FnMut(&mut Vec<Row>)| {
        section(&mut rows);
        for Row(what, result, target) in &rows[printed..] {
            println!("| {what} | {result} | {target} |");
        }
        printed = rows.len();
    };
    // The most valuable rows first, so a GPU window cut short still answers the main question: the DFlash step
    // of dflash-5x3.pipe as it would train (bf16, in a graph, bf16 hidden states), then its attention, then the
    // other DFlash variants, then the mlp step and the single-kernel comparisons.
    measure(&mut |rows| {
        dflash_model_step(LaunchMode::Graph, Precision::Bf16, HsDtype::Bf16, rows);
    });
    // The flash kernels (what bf16 runs) before the f32 attention kernels (what f32 and tf32 run).
    measure(&mut |rows| flash_vs_flops(&ctx, &flash, rows));
    measure(&mut |rows| attention_vs_flops(&ctx, &launcher, rows));
    for (launch, precision, hs) in [
        (LaunchMode::Graph, Precision::Bf16, HsDtype::F32),
        (LaunchMode::Eager, Precision::Bf16, HsDtype::F32),
        (LaunchMode::Graph, Precision::Tf32, HsDtype::F32),
        (LaunchMode::Eager, Precision::Tf32, HsDtype::F32),
    ] {
        measure(&mut |rows| dflash_model_step(launch, precision, hs, rows));
    }
    // f32 hidden states, then bf16 ones (16-bit slots and copies, 16-bit first GEMMs) at bf16 precision.
    for (launch, precision, hs) in [
        (LaunchMode::Graph, Precision::Bf16, HsDtype::Bf16),
        (LaunchMode::Graph, Precision::Bf16, HsDtype::F32),
        (LaunchMode::Eager, Precision::F32, HsDtype::F32),
        (LaunchMode::Graph, Precision::F32, HsDtype::F32),
        (LaunchMode::Graph, Precision::Tf32, HsDtype::F32),
    ] {
        measure(&mut |rows| mlp_step(launch, precision, hs, rows));
    }
    measure(&mut |rows| adamw_vs_copy(&ctx, &launcher, rows));
    measure(&mut |rows| fused_vs_materialised(&ctx, &launcher, rows));
}
