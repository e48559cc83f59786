//! GPU benchmarks of the CUDA backend, timed with CUDA events, printing one table last (issue 5 targets):
//!
//! - AdamW bandwidth against a device-to-device copy measured in the same run (target ≥ 85 %);
//! - the fused vocabulary loss against a version that materialises all logits (time and logits memory);
//! - the whole step of the `mlp-5x3.pipe` drafter (din 12288, hidden 1024, 2 blocks, intermediate 2816,
//!   4 heads, vocab 151936, 16384 tokens per step) in eager and graph mode with f32 GEMMs, and in graph mode
//!   with TF32 and bf16 GEMMs (`precision`): tokens/s, device busy % with the next batch always staged (target
//!   ≥ 97 % in graph mode), host µs per step (target ≤ 20). Each section's rows are printed as soon as they are measured.
//!
//! Medians over repetitions. Without a GPU it prints one line and exits 0. Run: `cargo bench -p
//! draftpipe-runtime --bench cuda_step`, or the prebuilt binary from `scripts/gpu-check.sh`.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr as _, result as driver};
use draftpipe_compiler::plan::{
    AdamWSpec, BucketPlan, LaunchMode, LossSpec, LrSchedule, MlpSpec, ModelPlan, Precision,
};
use draftpipe_gpu_kernels::adamw::AdamWStep;
use draftpipe_runtime::batch::HsBatch;
use draftpipe_runtime::cuda::{
    CudaDrafter, DevicePtr, Gemm, KernelModule, Launcher, Op, discover_devices, open_device,
};
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

fn dflash_step(launch: LaunchMode, precision: Precision, rows: &mut Vec<Row>) {
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
        std::slice::from_ref(&bucket),
        launch,
        None,
    )
    .expect("drafter");
    drafter
        .upload_state(&FlatState::init(&model, 1))
        .expect("upload");
    let mut batch = HsBatch::zeroed(bucket.padded_len, bucket.sequences, spec.din);
    for (i, v) in batch.hs.iter_mut().enumerate() {
        *v = ((i * 2654435761) % 1000) as f32 / 1000.0 - 0.5;
    }
    for (i, id) in batch.input_ids.iter_mut().enumerate() {
        *id = (i * 7919 % spec.vocab) as u32;
    }
    batch.seq_lens.fill(bucket.padded_len as u32);
    batch.loss_mask.fill(1);
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
        "dflash-5x3 mlp step, {launch:?}, {}, 16384 tokens",
        precision.name()
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
    measure(&mut |rows| adamw_vs_copy(&ctx, &launcher, rows));
    measure(&mut |rows| fused_vs_materialised(&ctx, &launcher, rows));
    measure(&mut |rows| dflash_step(LaunchMode::Eager, Precision::F32, rows));
    measure(&mut |rows| dflash_step(LaunchMode::Graph, Precision::F32, rows));
    measure(&mut |rows| dflash_step(LaunchMode::Graph, Precision::Tf32, rows));
    measure(&mut |rows| dflash_step(LaunchMode::Graph, Precision::Bf16, rows));
}
