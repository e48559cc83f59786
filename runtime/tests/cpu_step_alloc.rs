//! Steady-state allocation of the CPU step, counted by a global allocator in this dedicated test binary.
//!
//! `matrixmultiply::sgemm` allocates its packing buffer on every call (see `make_packing_buffer` in its
//! `gemm.rs`), and `StepOutput::valid_labels` is a returned `Vec` by API. The test pins exactly those: a steady
//! step allocates once per GEMM call plus once for `valid_labels`, no more, the optimizer step not at all, and
//! every byte is freed again (nothing grows from step to step). Everything this crate owns (workspaces,
//! partials, labels, logits chunk) is allocated on a bucket's first batch only.

mod cpu_step_support;

use cpu_step_support::*;
use draftpipe_compiler::plan::{AdamWSpec, MlpSpec};
use draftpipe_runtime::cpu::CpuDrafter;
use draftpipe_runtime::params::FlatState;
use rand::SeedableRng;
use rand::rngs::Xoshiro256PlusPlus;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, AtomicUsize, Ordering::Relaxed};

struct Counting;

static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);
static LIVE_BYTES: AtomicIsize = AtomicIsize::new(0);

// SAFETY: forwards every call to `System` unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Relaxed);
        LIVE_BYTES.fetch_add(layout.size() as isize, Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE_BYTES.fetch_sub(layout.size() as isize, Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const SPEC: MlpSpec = MlpSpec {
    din: 48,
    hidden: 32,
    blocks: 2,
    intermediate: 88,
    heads: 3,
    vocab: 500,
};

fn gemm_calls(spec: &MlpSpec, tokens: usize, chunk: usize) -> usize {
    let forward = 1 + 2 * spec.blocks + spec.heads;
    let loss = 3 * spec.heads * tokens.div_ceil(chunk);
    let backward = 2 * spec.heads + 4 * spec.blocks + 1;
    forward + loss + backward
}

#[test]
fn steady_steps_allocate_only_gemm_packing_and_the_returned_counts() {
    let model = model(SPEC);
    let (padded_len, sequences, chunk) = (32, 4, 48);
    let optimizer = AdamWSpec {
        clip_grad_norm: Some(1.0),
        ..adamw(1e-3)
    };
    let mut drafter = CpuDrafter::new(
        &model,
        loss(0.8, chunk),
        optimizer,
        &[bucket(16, 8), bucket(padded_len, sequences)],
    );
    let mut state = FlatState::init(&model, 0);
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(1);
    let batches: Vec<_> = (0..4)
        .map(|_| random_batch(&mut rng, padded_len, sequences, SPEC.din, SPEC.vocab))
        .collect();
    // First step: the bucket's workspace is allocated here.
    drafter.forward_backward(&mut state, &batches[0]).unwrap();
    drafter.optimizer_step(&mut state);

    let expected = gemm_calls(&SPEC, padded_len * sequences, chunk) + 1;
    for batch in batches.iter().cycle().take(12) {
        let (count, live) = (ALLOCATIONS.load(Relaxed), LIVE_BYTES.load(Relaxed));
        let out = drafter.forward_backward(&mut state, batch).unwrap();
        drop(out);
        let step_allocations = ALLOCATIONS.load(Relaxed) - count;
        assert_eq!(step_allocations, expected, "forward_backward allocations");
        assert_eq!(
            LIVE_BYTES.load(Relaxed),
            live,
            "forward_backward must free all it allocates"
        );

        let count = ALLOCATIONS.load(Relaxed);
        let report = drafter.optimizer_step(&mut state);
        assert!(!report.skipped);
        assert_eq!(
            ALLOCATIONS.load(Relaxed) - count,
            0,
            "optimizer_step allocations"
        );
    }
}
