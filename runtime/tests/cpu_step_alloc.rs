//! Steady-state allocation of the CPU step, counted by a global allocator in this dedicated test binary.
//!
//! Nothing this crate owns is allocated after a bucket's first batch (workspaces, partials, labels, logits
//! chunk, label counts). The one allocation left is upstream: `matrixmultiply::sgemm` allocates its packing
//! buffer on every call (see `make_packing_buffer` in its `gemm.rs`) and frees it before returning. The test
//! tells the two apart by alignment, since matrixmultiply asks for its SIMD kernel's alignment (16 bytes or more
//! on x86_64) where our `f32`/`u32` buffers ask for 4: a steady step makes exactly one aligned allocation per
//! GEMM call and no other, the optimizer step none at all, and every byte is freed again.
//!
//! Only the thread that runs the step is counted. The step runs outside any drafter pool (`HostThreads`), so
//! all of its work, the packing buffers included, runs on the calling thread.
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

/// Alignment below which an allocation cannot be a matrixmultiply packing buffer on x86_64.
const PACKING_ALIGN: usize = 16;

static PACKING_ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);
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
            if layout.align() >= PACKING_ALIGN {
                PACKING_ALLOCATIONS.fetch_add(1, Relaxed);
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
fn steady_steps_allocate_nothing_but_matrixmultiply_packing_buffers() {
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
            PACKING_ALLOCATIONS.load(Relaxed),
            OTHER_ALLOCATIONS.load(Relaxed),
        )
    };
    let gemm_calls = gemm_calls(&SPEC, padded_len * sequences, chunk);
    for batch in batches.iter().cycle().take(12) {
        let ((packing, other), live) = (counts(), LIVE_BYTES.load(Relaxed));
        let out = drafter.forward_backward(&mut state, batch).unwrap();
        assert!(out.loss.is_finite());
        let (packing_after, other_after) = counts();
        assert_eq!(other_after - other, 0, "forward_backward allocated");
        assert_eq!(
            packing_after - packing,
            gemm_calls,
            "one packing buffer per GEMM call"
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
