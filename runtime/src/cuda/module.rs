//! The embedded PTX and the loaded module: one `CudaFunction` per kernel, looked up once at start.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction};
use cudarc::nvrtc::Ptx;

use super::CudaError;
use super::launch::KERNEL_NAMES;

include!(concat!(env!("OUT_DIR"), "/embedded_ptx.rs"));

/// The kernels' PTX, or [`CudaError::BuiltWithoutKernels`] with the reason the build script gave.
pub fn embedded_ptx() -> Result<&'static str, CudaError> {
    EMBEDDED_PTX.map_err(CudaError::BuiltWithoutKernels)
}

/// The drafter kernels loaded into one context; the driver JIT-compiles the PTX for the card it finds.
#[derive(Debug, Clone)]
pub struct KernelModule {
    functions: Vec<CudaFunction>,
}

impl KernelModule {
    /// Loads the embedded PTX into `ctx` and resolves every kernel in [`KERNEL_NAMES`].
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Self, CudaError> {
        let module = ctx.load_module(Ptx::from_src(embedded_ptx()?))?;
        let functions = KERNEL_NAMES
            .iter()
            .map(|&name| {
                module
                    .load_function(name)
                    .map_err(|_| CudaError::MissingKernel(name))
            })
            .collect::<Result<_, _>>()?;
        Ok(Self { functions })
    }

    /// The function named `name` (one of [`KERNEL_NAMES`]).
    pub fn function(&self, name: &'static str) -> Result<&CudaFunction, CudaError> {
        KERNEL_NAMES
            .iter()
            .position(|&n| n == name)
            .map(|i| &self.functions[i])
            .ok_or(CudaError::MissingKernel(name))
    }
}
