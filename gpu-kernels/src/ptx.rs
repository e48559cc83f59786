//! Device entry points (nvptx64 build only), generated from the kernel table ([`crate::table`]): one
//! `extern "ptx-kernel"` per kernel, with the launch shape of its declaration.
//!
//! ```text
//!  runtime::cuda::Launcher::NAME(reads, writes, scalars) ──▶ NAME(reads, writes, scalars)
//!      threads(count)  index = blockIdx.x · blockDim.x + threadIdx.x, return when index ≥ count
//!      planes(count)   warp w of block b takes index b · (blockDim.x / 32) + w, return when index ≥ count
//!      plane()         the first warp of the launch
//!      elements(n)     as threads(n), the body with chunk_len = 1
//!  then the shared body (the one the CPU backend runs in a loop)
//! ```
//!
//! Flags cross the kernel ABI as `u32` (non-zero is true) and AdamW's per-step scalars through device memory,
//! so the host passes only plain `DeviceRepr` values.

use core::arch::nvptx::{_block_dim_x, _block_idx_x, _thread_idx_x};

use crate::flash::warp::DeviceWarp;
use crate::plane::{WIDTH, Warp};

/// This thread's index in a one-dimensional launch.
#[inline(always)]
fn global_index() -> usize {
    // SAFETY: reading the special registers has no preconditions inside a kernel.
    unsafe { _block_idx_x() as usize * _block_dim_x() as usize + _thread_idx_x() as usize }
}

/// Runs `body(index)` for this thread when `index < count`.
#[inline(always)]
fn for_index(count: usize, body: impl FnOnce(usize)) {
    let index = global_index();
    if index < count {
        body(index);
    }
}

/// Runs `body(warp, index)` for this thread's warp when its index is below `count` (the whole warp takes the
/// same branch, so the shuffles inside see all 32 lanes).
#[inline(always)]
fn for_plane(count: usize, body: impl FnOnce(Warp, usize)) {
    let global = global_index();
    let index = global / WIDTH;
    if index < count {
        // SAFETY: all lanes of this warp share `index` and run `body` together.
        body(unsafe { Warp::new(global % WIDTH) }, index);
    }
}

macro_rules! entry_points {
    ($(
        $(#[$doc:meta])*
        $name:ident {
            reads: [$($read:ident: $read_ty:ty = $read_len:expr),* $(,)?],
            writes: [$($write:ident: $write_ty:ty = $write_len:expr),* $(,)?],
            scalars: [$($scalar:ident: $scalar_ty:ty),* $(,)?],
            launch: $shape:ident($($count:expr)?),
            body: |$($bind:ident),*| $body:expr,
        }
    )*) => {$(
        $(#[$doc])*
        ///
        /// # Safety
        /// The buffers hold the lengths the kernel table declares for these scalars.
        #[unsafe(no_mangle)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe extern "ptx-kernel" fn $name(
            $($read: *const $read_ty,)*
            $($write: *mut $write_ty,)*
            $($scalar: $scalar_ty,)*
        ) {
            entry_points!(@run $shape($($count)?) |$($bind),*| $body);
        }
    )*};
    (@run threads($count:expr) |$index:ident| $body:expr) => {
        for_index($count, |$index| unsafe { $body });
    };
    (@run planes($count:expr) |$plane:ident, $index:ident| $body:expr) => {
        for_plane($count, |$plane, $index| unsafe { $body });
    };
    (@run plane() |$plane:ident| $body:expr) => {
        for_plane(1, |$plane, _| unsafe { $body });
    };
    (@run elements($n:expr) |$chunk_len:ident, $chunk:ident| $body:expr) => {
        for_index($n, |$chunk| {
            let $chunk_len = 1;
            unsafe { $body }
        });
    };
}

crate::kernel_table!(entry_points);

/// A device panic (unreachable by the bodies' contracts: they index by pointer arithmetic) traps the kernel, so
/// the host sees a launch error instead of wrong numbers.
#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    // SAFETY: `trap` aborts the kernel; it has no preconditions.
    unsafe { core::arch::nvptx::trap() }
}

/// Runs `body(warp, smem, index)` for this thread when its block's index is below `count`, `smem` the
/// entry's static shared memory.
#[inline(always)]
fn for_block(count: usize, smem: *mut u8, body: impl FnOnce(DeviceWarp, *mut u8, usize)) {
    // SAFETY: reading the special registers has no preconditions inside a kernel.
    let (index, thread) = unsafe { (_block_idx_x() as usize, _thread_idx_x() as usize) };
    if index < count {
        // SAFETY: every thread of the block takes this branch (`index` is the block's) and runs `body`.
        body(unsafe { DeviceWarp::new(thread) }, smem, index);
    }
}

macro_rules! flash_entry_points {
    ($(
        $(#[$doc:meta])*
        $name:ident {
            reads: [$($read:ident: $read_ty:ty = $read_len:expr),* $(,)?],
            writes: [$($write:ident: $write_ty:ty = $write_len:expr),* $(,)?],
            scalars: [$($scalar:ident: $scalar_ty:ty),* $(,)?],
            launch: blocks($count:expr, $warps:expr, $shared:expr),
            body: |$warp:ident, $smem:ident, $index:ident| $body:expr,
        }
    )*) => {$(
        // The entry's shared memory: a module-scope `.shared` array only this entry names.
        core::arch::global_asm!(
            concat!(".shared .align 16 .b8 ", stringify!($name), "_smem[{bytes}];"),
            bytes = const $shared,
        );

        $(#[$doc])*
        ///
        /// # Safety
        /// The buffers hold the lengths the flash table declares for these scalars; the launch has the
        /// table's block count and `32 · warps` threads per block.
        #[unsafe(no_mangle)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe extern "ptx-kernel" fn $name(
            $($read: *const $read_ty,)*
            $($write: *mut $write_ty,)*
            $($scalar: $scalar_ty,)*
        ) {
            let smem: u64;
            // SAFETY: converting the address of this module's shared array has no preconditions.
            unsafe {
                core::arch::asm!(
                    concat!("cvta.shared.u64 {smem}, ", stringify!($name), "_smem;"),
                    smem = out(reg64) smem,
                )
            };
            for_block($count, smem as *mut u8, |$warp, $smem, $index| unsafe { $body });
        }
    )*};
}

crate::flash_kernel_table!(flash_entry_points);
