//! Steady-state allocation of the CPU step, counted by a global allocator in this dedicated test binary.
//!
//! Nothing this crate owns is allocated after a bucket's first batch (workspaces, partials, labels, logits
//! chunk, label counts). What is left is upstream: each `gemm::gemm` call allocates its scratch and frees it
//! before returning (in `gemm_basic_generic`, gemm-common's `gemm.rs`): a `Vec<bool>` of packed-panel flags
//! (alignment 1) and, when it packs an operand, a buffer at cache-line alignment (16 bytes or more). The test
//! tells them from ours by alignment, since our buffers hold `f32`/`u32`/`usize` (alignment 4 or 8): a steady
//! step makes no allocation of those alignments, at most two of the others per GEMM call, the same number every
//! step, the optimizer step none at all, and every byte is freed again. (A `String` or `Vec<u8>` of ours would
//! pass for the crate's flags; none is built on the step path.)
//!
//! Only the thread that runs the step is counted. The step runs outside any drafter pool (`HostThreads`), so
//! all of its work, the GEMMs' scratch included, runs on the calling thread.
mod cpu_step_support;

use cpu_step_support::*;
use draftpipe_compiler::plan::{AdamWSpec, MlpSpec};
use draftpipe_runtime::drafter::cpu::CpuDrafter;
use draftpipe_runtime::params::FlatState;
use rand::SeedableRng;
use rand::rngs::Xoshiro256PlusPlus;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicIsize, AtomicUsize, Ordering::Relaxed};

struct Counting;

/// Whether an allocation has an alignment only the `gemm` crate's scratch asks for on this path: 1 (its flags)
/// or 16 and more (its packing buffers).
fn upstream(layout: Layout) -> bool {
    layout.align() == 1 || layout.align() >= 16
}

static UPSTREAM_ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);
static OTHER_ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);
static LIVE_BYTES: AtomicIsize = AtomicIsize::new(0);

thread_local! {
    /// Set on the thread that runs the steps; a `const` initialiser with no destructor, so reading it from the
    /// allocator never allocates.
    static COUNTED: Cell<bool> = const { Cell::new(false) };
}

// SAFETY: forwards every call to `System` unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if counted() {
            if upstream(layout) {
                UPSTREAM_ALLOCATIONS.fetch_add(1, Relaxed);
            } else {
                OTHER_ALLOCATIONS.fetch_add(1, Relaxed);
            }
            LIVE_BYTES.fetch_add(layout.size() as isize, Relaxed);
        }
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if counted() {
            LIVE_BYTES.fetch_sub(layout.size() as isize, Relaxed);
        }
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
}

fn counted() -> bool {
    COUNTED.try_with(Cell::get).unwrap_or(false)
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
fn steady_steps_allocate_nothing_but_the_gemm_crates_scratch() {
    COUNTED.with(|counted| counted.set(true));
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

    let counts = || {
        (
            UPSTREAM_ALLOCATIONS.load(Relaxed),
            OTHER_ALLOCATIONS.load(Relaxed),
        )
    };
    let gemm_calls = gemm_calls(&SPEC, padded_len * sequences, chunk);
    let mut per_step = None;
    for batch in batches.iter().cycle().take(12) {
        let ((upstream, other), live) = (counts(), LIVE_BYTES.load(Relaxed));
        let out = drafter.forward_backward(&mut state, batch).unwrap();
        assert!(out.loss.is_finite());
        let (upstream_after, other_after) = counts();
        assert_eq!(other_after - other, 0, "forward_backward allocated");
        let scratch = upstream_after - upstream;
        assert!(
            scratch <= 2 * gemm_calls,
            "{scratch} scratch allocations for {gemm_calls} GEMM calls"
        );
        assert_eq!(
            *per_step.get_or_insert(scratch),
            scratch,
            "steady steps of one batch shape allocate alike"
        );
        assert_eq!(
            LIVE_BYTES.load(Relaxed),
            live,
            "forward_backward must free all it allocates"
        );

        let before = counts();
        let report = drafter.optimizer_step(&mut state);
        assert!(!report.skipped);
        assert_eq!(counts(), before, "optimizer_step allocated");
    }
    assert_eq!(drafter.valid_labels().len(), SPEC.heads);
}
