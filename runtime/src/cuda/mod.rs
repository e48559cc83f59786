//! The CUDA backend: the drafter kernels' PTX (built from `gpu-kernels` by `build.rs`) run through `cudarc`.
//!
//! ```text
//!  build.rs ──▶ embedded PTX ──▶ KernelModule (one CUmodule, a CudaFunction per kernel)
//!  device discovery (never panics without a driver) ──▶ CudaContext ──▶ streams, flat buffers, launches
//! ```
//!
//! Everything loads at run time (`cudarc` with `dynamic-loading`, CUDA 13.0 library names): a binary built
//! here runs on a machine without CUDA and answers with [`CudaError::NoDriver`] instead of failing to start.
//! See `docs/gpu.md` for the PTX build, the checks and the GPU machine script.

mod allreduce;
mod blas;
mod device;
mod drafter;
mod error;
mod launch;
mod module;
mod nccl;
mod step;
mod workspace;

pub use allreduce::{GradientAllReduce, GroupAbort};
pub use blas::{Gemm, Op};
pub use device::{CudaDeviceInfo, discover_devices, open_device};
pub use drafter::{CudaDrafter, StepOutcome};
pub use error::CudaError;
pub use launch::{BLOCK_THREADS, DevicePtr, KERNEL_NAMES, LAUNCH_ARGUMENT_WIDTHS, Launcher};
pub use module::{EMBEDDED_PTX, KernelModule, embedded_ptx};
