//! The drafter on one CUDA device: [`Drafter::on_device`] opens the device's [`CudaBackend`] with the
//! workspace the plan's model family lays out, and builds the backend-generic [`Drafter`] on it.

use draftpipe_compiler::plan::{
    AdamWSpec, BackendKind, BucketPlan, HsDtype, LaunchMode, LossSpec, ModelPlan, Precision,
    WorkspaceLayout,
};

use super::{Drafter, DrafterError};
use crate::backend::BackendError;
use crate::backend::cuda::{CudaBackend, GradientAllReduce};

/// A drafter on one CUDA device: the backend-generic [`Drafter`] on a [`CudaBackend`].
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
