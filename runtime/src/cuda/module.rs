//! The embedded PTX and the loaded module: one `CudaFunction` per kernel, looked up once at start.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction};
use cudarc::nvrtc::Ptx;

use super::CudaError;

include!(concat!(env!("OUT_DIR"), "/embedded_ptx.rs"));

/// The kernels' PTX, or [`CudaError::BuiltWithoutKernels`] with the reason the build script gave.
pub fn embedded_ptx() -> Result<&'static str, CudaError> {
    EMBEDDED_PTX.map_err(CudaError::BuiltWithoutKernels)
}

/// Every entry point the CUDA backend launches (`gpu-kernels/src/ptx.rs` exports them; the PTX check test
/// asserts each is present).
pub const KERNEL_NAMES: [&str; 17] = [
    "rmsnorm_forward",
    "rmsnorm_backward_input",
    "rmsnorm_weight_grad_partials",
    "column_sums",
    "swiglu_forward",
    "swiglu_backward",
    "head_residual_forward",
    "head_residual_backward",
    "build_labels",
    "head_loss_scales",
    "vocab_loss_row",
    "sum_partials",
    "sum_squares_partials",
    "finish_sum",
    "finish_grad_norm",
    "adamw_update",
    "adamw_advance",
];

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
