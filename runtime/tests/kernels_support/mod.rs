//! Helpers of the DFlash kernel tests that run through the `Backend` trait on every backend present: fresh
//! seeds, buffers in and out of a bare backend, NaN-poisoned outputs, and the normwise error.
#![allow(dead_code)] // each test crate uses a different subset

use draftpipe_compiler::plan::WorkspaceLayout;
use draftpipe_runtime::backend::{Backend, Buf, Element, Src};
use rand::RngExt;
use rand::rngs::Xoshiro256PlusPlus;

use crate::backends::TestDevice;

/// A fresh seed per run (from the clock), or `KERNEL_TEST_SEED` to reproduce a failure; assertion messages
/// name it.
pub fn seed() -> u64 {
    std::env::var("KERNEL_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default();
            now.as_nanos() as u64 % 1_000_000_007
        })
}

/// A bare backend of `device` with no workspace of its own (kernel-level tests allocate their buffers).
pub fn bare<D: TestDevice>(device: &D) -> D::B {
    device.backend(&WorkspaceLayout {
        tokens: 0,
        sequences: 0,
        chunk_rows: 0,
        input_slots: 0,
        hs_operand_elements: 0,
        buffers: Vec::new(),
    })
}

/// A buffer holding `data`.
pub fn up<B: Backend, T: Element>(be: &mut B, data: &[T]) -> Buf<B, T> {
    let mut buf = be.alloc::<T>(data.len()).expect("alloc");
    be.upload(buf.all_mut(), data).expect("upload");
    buf
}

/// A buffer of `n` NaNs (an output the kernel must overwrite entirely).
pub fn poisoned<B: Backend>(be: &mut B, n: usize) -> Buf<B, f32> {
    let mut buf = be.alloc::<f32>(n).expect("alloc");
    be.fill(buf.all_mut(), f32::NAN).expect("fill");
    buf
}

/// The elements of a view, after the work queued so far.
pub fn down<B: Backend, T: Element>(be: &mut B, src: Src<'_, B, T>) -> Vec<T> {
    let mut out = vec![T::default(); src.len()];
    be.download(src, &mut out).expect("download");
    out
}

/// `max |out − ref| / max |ref|`; a non-finite output gives infinity.
pub fn normwise(out: &[f32], reference: &[f64]) -> f64 {
    assert_eq!(out.len(), reference.len(), "lengths");
    let scale = reference
        .iter()
        .fold(0.0f64, |m, r| m.max(r.abs()))
        .max(f64::MIN_POSITIVE);
    out.iter()
        .zip(reference)
        .map(|(&o, r)| {
            if o.is_finite() {
                (o as f64 - r).abs()
            } else {
                f64::INFINITY
            }
        })
        .fold(0.0, f64::max)
        / scale
}

/// `n` values uniform in `[-scale, scale)`.
pub fn uniform(rng: &mut Xoshiro256PlusPlus, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}
