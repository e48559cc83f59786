//! The CUDA launcher of the flash-attention table (`flash_kernel_table!`, `gpu-kernels/src/flash/`),
//! generated like the main table's (`launch.rs`): one method per entry, lengths checked against the table,
//! and [`FlashLauncher::launch`], the CUDA backend's `Backend::launch_flash`.
//!
//! ```text
//!  Backend's flash operations (backend/flash.rs) ──▶ launch_flash(FlashKernel) ──▶ FlashLauncher::NAME(DevicePtr…)
//!      grid = the table's block count, block = 32 · warps threads, shared memory static in the PTX entry
//! ```
//!
//! No per-launch events or syncs, so the launches are captured into a step's graph like every other.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use draftpipe_gpu_kernels::plane::WIDTH;

use super::launch::{DevicePtr, check, pushed_pointer_width};
use super::{CudaBackend, CudaError, KernelModule};
use crate::backend::FlashKernel;

/// The grid of `blocks` thread blocks of `warps` warps, or `None` when there is no block to run (a zero grid is
/// a launch error). The shared memory is the entry's static array, so none is asked for at launch.
fn block_config(blocks: usize, warps: usize) -> Result<Option<LaunchConfig>, CudaError> {
    if blocks == 0 {
        return Ok(None);
    }
    let grid = u32::try_from(blocks).map_err(|_| CudaError::LaunchTooLarge(blocks))?;
    let threads = u32::try_from(warps * WIDTH).map_err(|_| CudaError::LaunchTooLarge(blocks))?;
    Ok(Some(LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }))
}

macro_rules! cuda_flash_launcher {
    ($(
        $(#[$doc:meta])*
        $name:ident {
            reads: [$($read:ident: $read_ty:ty = $read_len:expr),* $(,)?],
            writes: [$($write:ident: $write_ty:ty = $write_len:expr),* $(,)?],
            scalars: [$($scalar:ident: $scalar_ty:ty),* $(,)?],
            launch: blocks($count:expr, $warps:expr, $shared:expr),
            body: |$($bind:ident),*| $body:expr,
        }
    )*) => {
        /// Every flash entry point the CUDA backend launches, in table order.
        pub const FLASH_KERNEL_NAMES: &[&str] = &[$(stringify!($name)),*];

        /// Byte width of each argument the flash launcher pushes, per kernel in table order (the PTX check
        /// compares them with the entries' parameter lists).
        pub const FLASH_LAUNCH_ARGUMENT_WIDTHS: &[(&str, &[usize])] = &[$(
            (stringify!($name), &[
                $(pushed_pointer_width::<$read_ty>(),)*
                $(pushed_pointer_width::<$write_ty>(),)*
                $(size_of::<$scalar_ty>(),)*
            ]),
        )*];

        /// The flash kernels of one [`KernelModule`] bound to a stream.
        #[derive(Debug, Clone)]
        #[allow(missing_docs)]
        pub struct FlashLauncher {
            stream: Arc<CudaStream>,
            $($name: CudaFunction,)*
        }

        impl FlashLauncher {
            /// Resolves every flash kernel of `module` and binds them to `stream`.
            pub fn new(module: &KernelModule, stream: Arc<CudaStream>) -> Result<Self, CudaError> {
                Ok(Self {
                    stream,
                    $($name: module.function(stringify!($name))?.clone(),)*
                })
            }

            /// The stream every launch goes to.
            pub fn stream(&self) -> &Arc<CudaStream> {
                &self.stream
            }

            /// Enqueues `kernel` through its method below (the CUDA backend's
            /// [`Backend::launch_flash`](crate::backend::Backend::launch_flash)).
            pub fn launch(&self, kernel: FlashKernel<'_, CudaBackend>) -> Result<(), CudaError> {
                match kernel {
                    $(FlashKernel::$name { $($read,)* $($write,)* $($scalar,)* } => {
                        self.$name($($read,)* $($write,)* $($scalar,)*)
                    })*
                }
            }

            $(
                $(#[$doc])*
                ///
                /// Fails with [`CudaError::BufferTooShort`] when a buffer holds fewer elements than the flash
                /// table declares for these sizes.
                #[allow(clippy::too_many_arguments)]
                pub fn $name(
                    &self,
                    $($read: DevicePtr<$read_ty>,)*
                    $($write: DevicePtr<$write_ty>,)*
                    $($scalar: $scalar_ty,)*
                ) -> Result<(), CudaError> {
                    $(check(stringify!($name), stringify!($read), $read.len(), $read_len)?;)*
                    $(check(stringify!($name), stringify!($write), $write.len(), $write_len)?;)*
                    let Some(cfg) = block_config($count, $warps)? else {
                        return Ok(());
                    };
                    $(let $read = $read.addr();)*
                    $(let $write = $write.addr();)*
                    let mut builder = self.stream.launch_builder(&self.$name);
                    $(builder.arg(&$read);)*
                    $(builder.arg(&$write);)*
                    $(builder.arg(&$scalar);)*
                    // SAFETY: the arguments follow the entry point's declaration in the same table (order and
                    // types; the PTX check compares the widths), every buffer holds the declared length, and
                    // the block has the table's `32 · warps` threads.
                    unsafe { builder.launch(cfg) }?;
                    Ok(())
                }
            )*
        }
    };
}

draftpipe_gpu_kernels::flash_kernel_table!(cuda_flash_launcher);
