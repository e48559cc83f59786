//! The CPU's launcher of the flash-attention table (`flash_kernel_table!`): each thread block of a launch
//! run on the host through the warp model (`draftpipe_gpu_kernels::flash::warp::ModelWarp`: `mma`,
//! `ldmatrix` and shuffles computed lane by lane from the PTX ISA's fragment layouts, one host thread per warp,
//! the block barrier a host barrier).
//!
//! ```text
//!  Backend's flash operations (backend/flash.rs) ──▶ launch_flash(FlashKernel) ──▶ run_flash: lengths checked,
//!      then for each block index: `warps` threads, zeroed shared memory, the table's body with a ModelWarp
//! ```
//!
//! The CPU's training steps never come here: its layouts hold no flash scratch (the flash path is CUDA's at
//! `bf16`, `backend::flash::flash_attention_applies`), and its attention runs its own lanes (`HOST_BODIES`).
//! This launcher is what lets the host run the very operations the CUDA backend runs, with the buffers, strides
//! and ranges it would pass, against an f64 reference (`runtime/tests/flash_operations.rs`); at a few hundred
//! times the cost of the lanes it is a model, not a path.
//!
//! # Panics
//! When a slice is shorter than the table declares (a bug in the operation, as for the main table).

use std::sync::Barrier;

use draftpipe_gpu_kernels::flash::warp::{BlockBarrier, LayoutMutation, ModelWarp};

use super::CpuBackend;
use super::kernels::SharedPtr;
use crate::backend::FlashKernel;

/// A block's barrier on the host: its warps are threads.
struct HostBarrier(Barrier);

impl BlockBarrier for HostBarrier {
    fn wait(&self) {
        self.0.wait();
    }
}

/// Runs `body(warp, smem, index)` for every block index below `count`: `warps` host threads per block sharing
/// a barrier and `smem_bytes` of zeroed, 16-byte aligned shared memory (the device gives no zeros; the bodies
/// write every shared byte they read).
fn run_blocks(
    count: usize,
    warps: usize,
    smem_bytes: usize,
    body: impl Fn(ModelWarp<'_>, *mut u8, usize) + Sync,
) {
    for index in 0..count {
        let mut smem = vec![0u128; smem_bytes.div_ceil(16)];
        let smem = SharedPtr(smem.as_mut_ptr().cast::<u8>());
        let barrier = HostBarrier(Barrier::new(warps));
        std::thread::scope(|scope| {
            for w in 0..warps {
                let (barrier, body) = (&barrier, &body);
                scope.spawn(move || {
                    body(
                        ModelWarp::new(w, barrier, LayoutMutation::None),
                        smem.get(),
                        index,
                    )
                });
            }
        });
    }
}

macro_rules! host_flash_dispatch {
    ($(
        $(#[$doc:meta])*
        $name:ident {
            reads: [$($read:ident: $read_ty:ty = $read_len:expr),* $(,)?],
            writes: [$($write:ident: $write_ty:ty = $write_len:expr),* $(,)?],
            scalars: [$($scalar:ident: $scalar_ty:ty),* $(,)?],
            launch: blocks($count:expr, $warps:expr, $shared:expr),
            body: |$warp:ident, $smem:ident, $index:ident| $body:expr,
        }
    )*) => {
        /// The CPU's `Backend::launch_flash`: the kernel's slices checked against the table's lengths, then its
        /// blocks through the warp model.
        pub(crate) fn run_flash(kernel: FlashKernel<'_, CpuBackend>) {
            match kernel {
                $(FlashKernel::$name { $($read,)* $($write,)* $($scalar,)* } => {
                    $(assert!(
                        $read.len() >= $read_len,
                        concat!(stringify!($name), ": ", stringify!($read), " holds {} elements, needs {}"),
                        $read.len(),
                        $read_len
                    );)*
                    $(assert!(
                        $write.len() >= $write_len,
                        concat!(stringify!($name), ": ", stringify!($write), " holds {} elements, needs {}"),
                        $write.len(),
                        $write_len
                    );)*
                    let (count, warps, shared) = ($count, $warps, $shared);
                    $(let $read = SharedPtr($read.as_ptr());)*
                    $(let $write = SharedPtr($write.as_mut_ptr());)*
                    run_blocks(count, warps, shared, |$warp, $smem, $index| {
                        $(let $read = $read.get();)*
                        $(let $write = $write.get();)*
                        // SAFETY: every slice holds the table's length for these scalars (checked above) and
                        // stays borrowed until the blocks are done; each output element is written by one lane
                        // of one block, the body's contract.
                        unsafe { $body }
                    });
                })*
            }
        }
    };
}

draftpipe_gpu_kernels::flash_kernel_table!(host_flash_dispatch);
