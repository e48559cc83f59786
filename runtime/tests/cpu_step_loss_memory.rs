//! The fused loss's memory bound, measured: a whole step at T = 8192 tokens and V = 32000 with a peak-tracking
//! global allocator. Materialising the logits would need `T × V × 4` = 1.05 GB for one head; the fused loss keeps
//! one `[C, V]` chunk (C = 256: 32.8 MB).
//!
//! Stated bound: the peak heap growth of building the drafter and running a step stays within the GEMM library's
//! own scratch of what the compiler's workspace layout says the drafter allocates (flat state included), whose
//! only vocabulary-sized part is the `C × V` chunk; the workspace itself stays under 10% of `T × V × 4`. The
//! scratch is measured here, one bare product of each of the step's shapes at a time, because `gemm` sizes its
//! packing buffers from the machine's cache sizes (1.1 MB on a 32 MiB-L3 EPYC, about 17 MB on a larger-cache
//! one): a fixed allowance fits one machine only. The measured figures are printed with `--nocapture`.

mod cpu_step_support;

use cpu_step_support::*;
use draftpipe_compiler::plan::MlpSpec;
use draftpipe_runtime::drafter::cpu::CpuDrafter;
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

    let gemm_scratch = gemm_scratch_bytes(&[
        (TOKENS, spec.din, spec.hidden),
        (TOKENS, spec.hidden, 2 * spec.intermediate),
        (TOKENS, spec.intermediate, spec.hidden),
        (256, spec.hidden, VOCAB),
        (256, VOCAB, spec.hidden),
        (VOCAB, 256, spec.hidden),
    ]);

    let baseline = LIVE.load(Relaxed);
    PEAK.store(baseline, Relaxed);
    let mut drafter = CpuDrafter::new(
        &model,
        loss(0.8, 256),
        adamw(1e-3),
        &[bucket(padded_len, sequences)],
    );
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
    // What the compiler's layout says the drafter allocates (its flat state and workspace, the `[C, V]` logits
    // chunk being the only vocabulary-sized buffer), which the drafter allocates exactly.
    let layout = draftpipe_compiler::plan::WorkspaceLayout::mlp(
        &spec,
        &[bucket(padded_len, sequences)],
        &loss(0.8, 256),
        draftpipe_compiler::plan::BackendKind::Cpu,
        draftpipe_compiler::plan::Precision::F32,
    )
    .unwrap();
    let allocated = layout.bytes().unwrap() as usize + 16 * model.parameters;
    assert_eq!(drafter.allocated_bytes() as usize, allocated);
    println!("gemm scratch {:.1} MB", gemm_scratch as f64 / 1e6);
    // 64 KiB for the drafter's own bookkeeping (bucket tables, names), which is not in the layout.
    let bound = allocated + gemm_scratch + 64 * 1024;
    assert!(
        peak_growth <= bound,
        "peak growth {peak_growth} bytes over the bound {bound}"
    );
    // The step's own memory, the workspace (state aside), stays under a tenth of the materialised logits.
    let workspace = layout.bytes().unwrap() as usize;
    println!(
        "workspace {:.1} MB ({:.2}% of the materialised logits)",
        workspace as f64 / 1e6,
        100.0 * workspace as f64 / materialised as f64
    );
    assert!(workspace + gemm_scratch < materialised / 10);
}

/// The most heap one bare product of any of these `(m, k, n)` shapes, each operand read either way, takes beyond
/// its operands (its packing buffers; the first call also allocates this thread's persistent packing slab).
fn gemm_scratch_bytes(shapes: &[(usize, usize, usize)]) -> usize {
    let mut most = 0;
    for &(m, k, n) in shapes {
        let (a, b, mut c) = (
            vec![0.5f32; m * k],
            vec![0.25f32; k * n],
            vec![0.0f32; m * n],
        );
        for a_transposed in [false, true] {
            for b_transposed in [false, true] {
                let before = LIVE.load(Relaxed);
                PEAK.store(before, Relaxed);
                draftpipe_runtime::backend::cpu::matmul(
                    &mut c,
                    (&a, a_transposed),
                    (&b, b_transposed),
                    (m, k, n),
                );
                most = most.max(PEAK.load(Relaxed) - before);
            }
        }
    }
    most
}
