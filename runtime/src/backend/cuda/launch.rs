//! The CUDA launcher, generated from the kernel table (`gpu-kernels/src/table.rs`): one method per kernel, its
//! arguments in the table's order (reads, writes, scalars), device buffers as typed [`DevicePtr`]s whose
//! lengths are checked against the table's declared lengths before the launch is enqueued, and
//! [`Launcher::launch`], the generated match from a [`Kernel`] to those methods. No per-launch
//! events or syncs, so the same calls work eagerly and inside stream capture.

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use draftpipe_gpu_kernels::plane::WIDTH;

use super::{CudaBackend, CudaError, KernelModule};
use crate::backend::Kernel;

/// Threads per block of every launch: one thread per index, or eight planes (warps) of 32 lanes.
pub const BLOCK_THREADS: u32 = 256;

/// A typed device address with the number of `T`s from it to the end of its allocation.
#[derive(Debug)]
pub struct DevicePtr<T> {
    addr: CUdeviceptr,
    len: usize,
    element: PhantomData<*const T>,
}

impl<T> Clone for DevicePtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for DevicePtr<T> {}

impl<T> DevicePtr<T> {
    /// The pointer `len` elements of `T` long at `addr`.
    ///
    /// # Safety
    /// `addr` is a device allocation holding at least `len` elements of `T`.
    pub unsafe fn from_raw(addr: CUdeviceptr, len: usize) -> Self {
        Self {
            addr,
            len,
            element: PhantomData,
        }
    }

    /// The raw address (for cuBLAS and memory operations).
    pub fn addr(self) -> CUdeviceptr {
        self.addr
    }

    /// Elements from this address to the end of the allocation.
    pub fn len(self) -> usize {
        self.len
    }

    /// Whether no element lies behind the address.
    pub fn is_empty(self) -> bool {
        self.len == 0
    }

    /// The same bytes seen as elements of `U` (the length rounds down to whole `U`s).
    ///
    /// # Safety
    /// The bytes are valid `U`s, aligned for `U`.
    pub unsafe fn cast<U>(self) -> DevicePtr<U> {
        DevicePtr {
            addr: self.addr,
            len: self.len * size_of::<T>() / size_of::<U>().max(1),
            element: PhantomData,
        }
    }

    /// The first `mid` elements and the rest, or `None` when `mid` is past the end.
    pub fn split_at(self, mid: usize) -> Option<(Self, Self)> {
        let rest = self.offset(mid)?;
        Some((Self { len: mid, ..self }, rest))
    }

    /// The address `index` elements further, or `None` past the end.
    pub fn offset(self, index: usize) -> Option<Self> {
        (index <= self.len).then(|| Self {
            addr: self.addr + (index * size_of::<T>()) as CUdeviceptr,
            len: self.len - index,
            element: PhantomData,
        })
    }
}

/// The grid of a launch shape of the kernel table.
fn config(threads: usize, block: u32) -> Result<LaunchConfig, CudaError> {
    let blocks = threads.div_ceil(block as usize);
    let blocks = u32::try_from(blocks.max(1)).map_err(|_| CudaError::LaunchTooLarge(threads))?;
    Ok(LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// Threads a launch shape runs (`threads`/`elements`: one per index; `planes`: one warp per index; `plane`:
/// one warp), and the block size.
macro_rules! shape {
    (threads($count:expr)) => {
        config($count, BLOCK_THREADS)
    };
    (elements($count:expr)) => {
        config($count, BLOCK_THREADS)
    };
    (planes($count:expr)) => {
        config(($count).saturating_mul(WIDTH), BLOCK_THREADS)
    };
    (plane()) => {
        config(WIDTH, WIDTH as u32)
    };
}

macro_rules! cuda_launcher {
    ($(
        $(#[$doc:meta])*
        $name:ident {
            reads: [$($read:ident: $read_ty:ty = $read_len:expr),* $(,)?],
            writes: [$($write:ident: $write_ty:ty = $write_len:expr),* $(,)?],
            scalars: [$($scalar:ident: $scalar_ty:ty),* $(,)?],
            launch: $shape:ident($($count:expr)?),
            body: |$($bind:ident),*| $body:expr,
        }
    )*) => {
        /// Every entry point the CUDA backend launches, in table order.
        pub const KERNEL_NAMES: &[&str] = &[$(stringify!($name)),*];

        /// Byte width of each argument the launcher pushes, per kernel in table order (the PTX check compares
        /// them with the `.entry` parameter lists of the embedded PTX).
        pub const LAUNCH_ARGUMENT_WIDTHS: &[(&str, &[usize])] = &[$(
            (stringify!($name), &[
                $(pushed_pointer_width::<$read_ty>(),)*
                $(pushed_pointer_width::<$write_ty>(),)*
                $(size_of::<$scalar_ty>(),)*
            ]),
        )*];

        /// The kernels of one [`KernelModule`] bound to a stream.
        #[derive(Debug, Clone)]
        #[allow(missing_docs)]
        pub struct Launcher {
            stream: Arc<CudaStream>,
            $($name: CudaFunction,)*
        }

        impl Launcher {
            /// Resolves every kernel of `module` and binds them to `stream`.
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

            /// Enqueues `kernel` through its method below, the variant's fields in the table's order (the CUDA
            /// backend's [`Backend::launch`](crate::backend::Backend::launch)).
            pub fn launch(&self, kernel: Kernel<'_, CudaBackend>) -> Result<(), CudaError> {
                match kernel {
                    $(Kernel::$name { $($read,)* $($write,)* $($scalar,)* } => {
                        self.$name($($read,)* $($write,)* $($scalar,)*)
                    })*
                }
            }

            $(
                $(#[$doc])*
                ///
                /// Fails with [`CudaError::BufferTooShort`] when a buffer holds fewer elements than the kernel
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
                    let cfg = shape!($shape($($count)?))?;
                    $(let $read = $read.addr();)*
                    $(let $write = $write.addr();)*
                    let mut builder = self.stream.launch_builder(&self.$name);
                    $(builder.arg(&$read);)*
                    $(builder.arg(&$write);)*
                    $(builder.arg(&$scalar);)*
                    // SAFETY: the arguments follow the entry point's declaration in the same table (order and
                    // types; the PTX check compares the widths), and every buffer holds the declared length.
                    unsafe { builder.launch(cfg) }?;
                    Ok(())
                }
            )*
        }
    };
}

/// Bytes the launcher pushes for a [`DevicePtr`] of any element type: its raw address.
#[allow(clippy::extra_unused_type_parameters)] // the table's repetition names the element type
pub(super) const fn pushed_pointer_width<T>() -> usize {
    size_of::<CUdeviceptr>()
}

/// [`CudaError::BufferTooShort`] unless `len ≥ needed`.
pub(super) fn check(
    kernel: &'static str,
    argument: &'static str,
    len: usize,
    needed: usize,
) -> Result<(), CudaError> {
    if len >= needed {
        Ok(())
    } else {
        Err(CudaError::BufferTooShort {
            kernel,
            argument,
            len,
            needed,
        })
    }
}

draftpipe_gpu_kernels::kernel_table!(cuda_launcher);
