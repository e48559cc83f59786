//! Errors of the CUDA backend.

use cudarc::driver::DriverError;

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
    /// A CUDA driver call failed.
    #[error("CUDA driver error: {0}")]
    Driver(#[from] DriverError),
}
