//! The fused loss's memory bound, measured: a whole step at T = 8192 tokens and V = 32000 with a peak-tracking
//! global allocator. Materialising the logits would need `T × V × 4` = 1.05 GB for one head; the fused loss keeps
//! one `[C, V]` chunk (C = 256: 32.8 MB).
//!
//! Stated bound: the step's peak heap growth, workspace allocation included, stays within 4 MB (GEMM packing
//! buffers) of the workspace formula of `cpu/workspace.rs`, whose vocabulary-sized part is the `C × V` chunk;
//! here that is 79 MB in all, 7.6% of `T × V × 4`. The measured figure is printed with `--nocapture`.

mod cpu_step_support;

use cpu_step_support::*;
use draftpipe_compiler::plan::MlpSpec;
use draftpipe_runtime::cpu::CpuDrafter;
use draftpipe_runtime::params::FlatState;
use rand::SeedableRng;
use rand::rngs::Xoshiro256PlusPlus;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

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

#[test]
fn fused_loss_peak_memory_at_8192_tokens_and_32000_vocab_stays_far_below_materialised_logits() {
    const TOKENS: usize = 8192;
    const VOCAB: usize = 32_000;
    let spec = MlpSpec {
        din: 64,
        hidden: 64,
        blocks: 1,
        intermediate: 128,
        heads: 1,
        vocab: VOCAB,
    };
    let model = model(spec);
    let (padded_len, sequences) = (1024, TOKENS / 1024);
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(3);
    let batch = random_batch(&mut rng, padded_len, sequences, spec.din, VOCAB);
    let mut state = FlatState::init(&model, 0);
    let mut drafter = CpuDrafter::new(
        &model,
        loss(0.8, 256),
        adamw(1e-3),
        &[bucket(padded_len, sequences)],
    );

    let baseline = LIVE.load(Relaxed);
    PEAK.store(baseline, Relaxed);
    let out = drafter
        .forward_backward(&mut state, &batch)
        .expect("valid batch");
    let peak_growth = PEAK.load(Relaxed) - baseline;
    assert!(out.loss.is_finite() && out.loss > 0.0);

    let materialised = TOKENS * VOCAB * 4;
    println!(
        "peak heap growth {:.1} MB vs materialised logits {:.1} MB ({:.2}%)",
        peak_growth as f64 / 1e6,
        materialised as f64 / 1e6,
        100.0 * peak_growth as f64 / materialised as f64
    );
    let MlpSpec {
        hidden: h,
        intermediate: i,
        blocks: b,
        heads: j,
        ..
    } = spec;
    let (t, c) = (TOKENS, 256);
    let workspace_floats = t * h * (2 * b + 6 + 3 * j)
        + 3 * t * i * (b + 1)
        + t * (b + 1)
        + 2 * t * j
        + c * VOCAB
        + t * h / 64;
    let bound = workspace_floats * 4 + 4_000_000;
    assert!(
        peak_growth <= bound,
        "peak growth {peak_growth} bytes over the bound {bound}"
    );
    assert!(bound < materialised / 10);
}
