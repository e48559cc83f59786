//! GPU benchmark of the fused vocabulary loss kernel (`vocab_loss_row`, one warp per row): time per row
//! against the bandwidth bound of its traffic, for vocabularies of 32 000 and 151 936.
//!
//! The kernel reads each logit twice and writes it once (online max and sum, then the gradient), 12 bytes per
//! logit; the bound is that traffic at the device-to-device copy bandwidth measured in the same run. Each row of
//! the table is printed as soon as it is measured (a time-out keeps the rows before it). Medians of 15 runs
//! timed with CUDA events. Without a GPU it prints one line and exits 0 (`DRAFTPIPE_REQUIRE_GPU=1`: exits 1).
//! Run: `cargo bench -p draftpipe-runtime --bench cuda_vocab_loss`, or the prebuilt binary from
//! `scripts/gpu-check.sh`.

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr as _, result as driver};
use draftpipe_runtime::backend::cuda::{
    DevicePtr, KernelModule, Launcher, discover_devices, open_device,
};

const REPS: usize = 15;
const ROWS: usize = 4096;

fn typed<T>(stream: &Arc<CudaStream>, slice: CudaSlice<T>) -> (CudaSlice<T>, DevicePtr<T>) {
    let (ptr, _) = slice.device_ptr(stream);
    // SAFETY: the address of `slice`'s own allocation of `slice.len()` elements.
    let typed = unsafe { DevicePtr::from_raw(ptr, slice.len()) };
    (slice, typed)
}

fn median_ms(ctx: &Arc<CudaContext>, stream: &Arc<CudaStream>, mut work: impl FnMut()) -> f64 {
    let event = || {
        ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .expect("event")
    };
    let (start, stop) = (event(), event());
    work();
    let mut samples: Vec<f64> = (0..REPS)
        .map(|_| {
            start.record(stream).expect("record");
            work();
            stop.record(stream).expect("record");
            f64::from(start.elapsed_ms(&stop).expect("elapsed"))
        })
        .collect();
    samples.sort_by(f64::total_cmp);
    samples[REPS / 2]
}

fn main() {
    let require = std::env::var("DRAFTPIPE_REQUIRE_GPU").is_ok_and(|v| v == "1");
    match discover_devices() {
        Ok(devices) if !devices.is_empty() => {}
        other => {
            let reason = other.map_or_else(|e| e.to_string(), |_| "no CUDA device".into());
            println!("cuda_vocab_loss skipped: {reason}");
            std::process::exit(i32::from(require));
        }
    }
    let ctx = open_device(0).expect("open device 0");
    // SAFETY: every launch below is ordered on one stream and timed by events on it.
    unsafe { ctx.disable_event_tracking() };
    let module = KernelModule::load(&ctx).expect("load the embedded PTX");
    let k = Launcher::new(&module, ctx.new_stream().expect("stream")).expect("kernels");
    let s = k.stream().clone();

    let copy_bytes = 1usize << 30;
    let (_src, src) = typed(&s, s.alloc_zeros::<u8>(copy_bytes).expect("allocate"));
    let (_dst, dst) = typed(&s, s.alloc_zeros::<u8>(copy_bytes).expect("allocate"));
    let copy_ms = median_ms(&ctx, &s, || {
        // SAFETY: both buffers hold `copy_bytes` bytes.
        unsafe { driver::memcpy_dtod_async(dst.addr(), src.addr(), copy_bytes, s.cu_stream()) }
            .expect("copy")
    });
    let copy_gbs = (2 * copy_bytes) as f64 / copy_ms / 1e6;
    println!("| D2D copy, 1 GiB | {copy_gbs:.0} GB/s (reads + writes) | |");
    println!(
        "| vocab_loss_row, {ROWS} rows | µs per row | bound at copy bandwidth (12 B per logit) |"
    );

    for vocab in [32_000usize, 151_936] {
        let logits_host: Vec<f32> = (0..ROWS * vocab)
            .map(|i| ((i * 2_654_435_761) % 1000) as f32 * 0.01 - 5.0)
            .collect();
        let labels_host: Vec<i32> = (0..ROWS).map(|r| ((r * 7919) % vocab) as i32).collect();
        let (_l, logits) = typed(&s, s.clone_htod(&logits_host).expect("logits"));
        let (_b, labels) = typed(&s, s.clone_htod(&labels_host).expect("labels"));
        let (_c, scale) = typed(&s, s.clone_htod(&[1.0f32 / ROWS as f32]).expect("scale"));
        let (_r, row_loss) = typed(&s, s.alloc_zeros::<f32>(ROWS).expect("row loss"));
        // Rerunning in place turns the logits into gradients after the first run; the traffic is the same.
        let ms = median_ms(&ctx, &s, || {
            k.vocab_loss_row(labels, scale, logits, row_loss, vocab, ROWS)
                .expect("launch")
        });
        let per_row_us = ms * 1e3 / ROWS as f64;
        let bound_us = (12 * vocab) as f64 / (copy_gbs * 1e9) * 1e6;
        println!(
            "| V {vocab} | {per_row_us:.3} µs ({:.1} ms per launch) | {bound_us:.3} µs ({:.0} % of bound) |",
            ms,
            100.0 * bound_us / per_row_us
        );
    }
}
