//! CUDA through `cudarc`: device discovery, the drafter kernels' PTX (built from `gpu-kernels` by `build.rs`),
//! their launchers, cuBLAS and NCCL — what [`CudaBackend`] (in `crate::backend::cuda`) is made of.
//!
//! ```text
//!  build.rs ──▶ embedded PTX ──▶ KernelModule (one CUmodule, a CudaFunction per kernel) ──▶ Launcher
//!  device discovery (never panics without a driver) ──▶ CudaContext ──▶ CudaBackend ──▶ CudaDrafter
//! ```
//!
//! Everything loads at run time (`cudarc` with `dynamic-loading`, CUDA 13.0 library names): a binary built
//! here runs on a machine without CUDA and answers with [`CudaError::NoDriver`] instead of failing to start.
//! See `docs/gpu.md` for the PTX build, the checks and the GPU machine script.

mod allreduce;
mod blas;
mod device;
mod error;
mod graphs;
mod launch;
mod module;
mod nccl;
mod staging;

pub use crate::backend::cuda::CudaBackend;
pub use allreduce::{GradientAllReduce, GroupAbort};
pub use blas::{Gemm, HalfType, Op};
pub use device::{CudaDeviceInfo, discover_devices, open_device};
pub use error::CudaError;
pub(crate) use graphs::{PartGraphs, PartRun, ended_capture};
pub use launch::{BLOCK_THREADS, DevicePtr, KERNEL_NAMES, LAUNCH_ARGUMENT_WIDTHS, Launcher};
pub use module::{EMBEDDED_PTX, KernelModule, embedded_ptx};
pub(crate) use staging::{PinnedInput, SlotHs, SlotPointers};

use draftpipe_compiler::plan::{
    AdamWSpec, BackendKind, BucketPlan, HsDtype, LaunchMode, LossSpec, ModelPlan, Precision,
    WorkspaceLayout,
};

use crate::backend::BackendError;
use crate::drafter::{Drafter, DrafterError};

/// The `mlp` drafter on one CUDA device: the backend-generic [`Drafter`] on a [`CudaBackend`].
pub type CudaDrafter = Drafter<CudaBackend>;

impl Drafter<CudaBackend> {
    /// A drafter on device `ordinal`, with the workspace of `buckets` at `precision` for batches whose hidden
    /// states are held in `hs_dtype` (the plan's `hs_dtype`: at `bf16` precision the input slots hold them so),
    /// and the launch mode; `all_reduce` averages its gradients with the other ranks every step. Parameters
    /// start at zero: load them with [`Drafter::upload_state`].
    ///
    /// # Errors
    /// [`CudaError`]s (no driver, no such device, no kernels, no cuBLAS) inside [`DrafterError::Backend`];
    /// layout errors.
    #[allow(clippy::too_many_arguments)]
    pub fn on_device(
        ordinal: usize,
        model: &ModelPlan,
        (loss, optimizer, precision): (LossSpec, AdamWSpec, Precision),
        (buckets, hs_dtype): (&[BucketPlan], HsDtype),
        launch: LaunchMode,
        all_reduce: Option<GradientAllReduce>,
    ) -> Result<Self, DrafterError> {
        let layout =
            WorkspaceLayout::of_model(&model.spec, buckets, &loss, BackendKind::Cuda, precision)
                .and_then(|layout| layout.with_hs_dtype(BackendKind::Cuda, hs_dtype))
                .ok_or(DrafterError::WorkspaceTooLarge)?;
        let mut backend = CudaBackend::new(ordinal, launch, &layout).map_err(BackendError::from)?;
        if let Some(all_reduce) = all_reduce {
            backend = backend.with_all_reduce(all_reduce);
        }
        Drafter::with_hs_dtype(
            backend,
            model,
            (loss, optimizer, precision),
            buckets,
            hs_dtype,
        )
    }
}
