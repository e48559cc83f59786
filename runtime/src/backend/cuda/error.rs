//! Errors of the CUDA backend.

use cudarc::cublas::result::CublasError;
use cudarc::driver::DriverError;

use crate::backend::BackendError;

/// Why the CUDA backend cannot do what was asked.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// No CUDA driver library (`libcuda.so`) could be loaded on this machine.
    #[error("no CUDA driver found (libcuda could not be loaded)")]
    NoDriver,
    /// The runtime was built without the kernels' PTX.
    #[error("built without GPU kernels: {0}")]
    BuiltWithoutKernels(&'static str),
    /// The requested device ordinal does not exist.
    #[error("CUDA device {ordinal} requested but {count} device(s) present")]
    NoSuchDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// Devices the driver reports.
        count: usize,
    },
    /// The embedded PTX lacks a kernel the backend launches (PTX and host code out of step).
    #[error("kernel `{0}` missing from the loaded PTX module")]
    MissingKernel(&'static str),
    /// cuBLAS could not be loaded under any of cudarc's names (`libcublas.so`, `.so.13`, then the CUDA 12 and
    /// older `.so.12` … `.so.9`).
    #[error(
        "cuBLAS not found (none of libcublas.so, libcublas.so.13 or the CUDA 12 name libcublas.so.12 could be loaded; put its directory on LD_LIBRARY_PATH)"
    )]
    NoCublas,
    /// The driver's JIT refused the embedded PTX; `log` is what the JIT said.
    #[error("the driver could not load the kernels' PTX: {source}{}", if log.is_empty() { String::new() } else { format!("\nJIT log:\n{log}") })]
    ModuleLoad {
        /// The driver's error.
        source: DriverError,
        /// The JIT's error log (empty when it wrote none).
        log: String,
    },
    /// NCCL (`libnccl.so`) could not be loaded.
    #[error("NCCL not found (libnccl could not be loaded)")]
    NoNccl,
    /// An NCCL call failed.
    #[error("NCCL error: {0}")]
    Nccl(String),
    /// The all-reduce must be attached before the first step (graphs capture it).
    #[error("gradient all-reduce attached after the first step")]
    LateAllReduce,
    /// A kernel argument's buffer holds fewer elements than the kernel table declares for the launch.
    #[error("kernel `{kernel}`: `{argument}` holds {len} elements, the launch needs {needed}")]
    BufferTooShort {
        /// The kernel.
        kernel: &'static str,
        /// Its argument.
        argument: &'static str,
        /// Elements the buffer holds from the pointer on.
        len: usize,
        /// Elements the launch reads or writes.
        needed: usize,
    },
    /// A launch needs more blocks than a grid can hold.
    #[error("a launch over {0} indices exceeds the grid limit")]
    LaunchTooLarge(usize),
    /// A matrix dimension does not fit cuBLAS's 32-bit sizes.
    #[error("matrix dimension {0} exceeds cuBLAS's 32-bit limit")]
    GemmTooLarge(usize),
    /// The batch does not fit any bucket the drafter was built for.
    #[error("no bucket of padded length {padded_len} with {sequences} sequences and width {din}")]
    NoSuchBucket {
        /// The batch's padded length.
        padded_len: usize,
        /// The batch's sequence count.
        sequences: usize,
        /// The batch's hidden-state width.
        din: usize,
    },
    /// Host data given to the drafter has the wrong length.
    #[error("{what} has {got} elements, expected {expected}")]
    LengthMismatch {
        /// Which buffer.
        what: &'static str,
        /// Its length.
        got: usize,
        /// The length the model or bucket needs.
        expected: usize,
    },
    /// `step` was called without a staged batch.
    #[error("no batch staged: call stage() before step()")]
    NothingStaged,
    /// The model layout lacks a tensor the CUDA step needs, or has it with another shape.
    #[error("model layout: tensor {0} missing or mis-shaped")]
    Layout(String),
    /// A step's outcome is still to be collected with `finish()`.
    #[error("a step is in flight: call finish() first")]
    StepInFlight,
    /// Stream capture produced no graph.
    #[error("stream capture produced no graph")]
    EmptyCapture,
    /// A cuBLAS call failed.
    #[error("cuBLAS error: {0}")]
    Cublas(#[from] CublasError),
    /// A CUDA driver call failed.
    #[error("CUDA driver error: {0}")]
    Driver(#[from] DriverError),
}

/// The CUDA backend's failures as the backend trait's device error (`?` in every CUDA operation).
impl From<CudaError> for BackendError {
    fn from(error: CudaError) -> Self {
        BackendError::Device(Box::new(error))
    }
}
