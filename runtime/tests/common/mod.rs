//! Shared helpers of the GPU tests: the skip rule, device buffers by raw address, and comparisons.
#![allow(dead_code)] // each test crate uses a different subset

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, DevicePtr as _, DeviceRepr, ValidAsZeroBits,
};
use draftpipe_runtime::backend::cuda::{CudaError, DevicePtr, discover_devices, open_device};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

/// Device 0 with cudarc's per-slice event tracking off (the backend's setting), or `None` after printing one
/// line saying why the test is skipped. Only a missing driver (or no device) is a skip, and under
/// `DRAFTPIPE_REQUIRE_GPU=1` (set by `scripts/gpu-check.sh`) not even that; a driver that is there but fails is a
/// failure.
pub fn gpu_or_skip(test: &str) -> Option<Arc<CudaContext>> {
    let reason = match discover_devices() {
        Ok(devices) if !devices.is_empty() => {
            let ctx = open_device(0).expect("open device 0");
            // SAFETY: the tests order their work on one stream and read results after synchronising it.
            unsafe { ctx.disable_event_tracking() };
            return Some(ctx);
        }
        Ok(_) => "the CUDA driver reports no device".to_owned(),
        Err(CudaError::NoDriver) => "no CUDA driver".to_owned(),
        Err(other) => panic!("{test}: CUDA discovery failed with a driver present: {other}"),
    };
    assert!(
        !std::env::var("DRAFTPIPE_REQUIRE_GPU").is_ok_and(|v| v == "1"),
        "{test}: DRAFTPIPE_REQUIRE_GPU=1 but {reason}"
    );
    eprintln!("{test} skipped: {reason}");
    None
}

/// A fresh generator per run (seed printed on failure through the value in the assertion message).
pub fn rng() -> (Xoshiro256PlusPlus, u64) {
    let seed = rand::random::<u64>();
    (Xoshiro256PlusPlus::seed_from_u64(seed), seed)
}

/// `n` values uniform in `[lo, hi)`.
pub fn uniform(rng: &mut Xoshiro256PlusPlus, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(lo..hi)).collect()
}

/// A device copy of `host` and its typed address.
pub fn upload<T: DeviceRepr>(stream: &Arc<CudaStream>, host: &[T]) -> (CudaSlice<T>, DevicePtr<T>) {
    let slice = stream.clone_htod(host).expect("upload");
    let (ptr, _) = slice.device_ptr(stream);
    // SAFETY: the allocation just made holds `host.len()` elements and lives as long as `slice`.
    let typed = unsafe { DevicePtr::from_raw(ptr, host.len()) };
    (slice, typed)
}

/// A device buffer of `n` NaNs (outputs are poisoned before every run).
pub fn poisoned(stream: &Arc<CudaStream>, n: usize) -> (CudaSlice<f32>, DevicePtr<f32>) {
    upload(stream, &vec![f32::NAN; n])
}

/// Synchronises `stream` and copies `slice` back.
pub fn download<T: DeviceRepr + ValidAsZeroBits + Clone + Default>(
    stream: &Arc<CudaStream>,
    slice: &CudaSlice<T>,
) -> Vec<T> {
    stream.synchronize().expect("synchronise");
    stream.clone_dtoh(slice).expect("download")
}

/// Asserts `|got − want| ≤ atol + rtol·|want|` element-wise, naming the first offender.
pub fn assert_close(what: &str, got: &[f32], want: &[f32], rtol: f32, atol: f32, seed: u64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= atol + rtol * w.abs(),
            "{what}[{i}]: gpu {g} vs cpu {w} (rtol {rtol}, atol {atol}, seed {seed})"
        );
    }
}
