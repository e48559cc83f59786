//! Device discovery that never panics: `cudarc` panics when `libcuda` is missing, so its presence is checked
//! before the first driver call.

use std::sync::Arc;

use cudarc::driver::CudaContext;

use super::CudaError;

/// What the driver says about one device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaDeviceInfo {
    /// Device ordinal.
    pub ordinal: usize,
    /// Marketing name, e.g. `NVIDIA H200`.
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// Total device memory in bytes.
    pub total_memory: usize,
}

fn ensure_driver() -> Result<(), CudaError> {
    // SAFETY: only tries to dlopen the driver library by its candidate names; no CUDA call is made.
    if unsafe { cudarc::driver::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(CudaError::NoDriver)
    }
}

/// Lists the CUDA devices; [`CudaError::NoDriver`] on a machine without the driver.
pub fn discover_devices() -> Result<Vec<CudaDeviceInfo>, CudaError> {
    ensure_driver()?;
    let count = usize::try_from(CudaContext::device_count()?).unwrap_or(0);
    (0..count)
        .map(|ordinal| {
            let ctx = CudaContext::new(ordinal)?;
            Ok(CudaDeviceInfo {
                ordinal,
                name: ctx.name()?,
                compute_capability: ctx.compute_capability()?,
                total_memory: ctx.total_mem()?,
            })
        })
        .collect()
}

/// Opens (retains the primary context of) device `ordinal`, checking the driver and the ordinal first.
pub fn open_device(ordinal: usize) -> Result<Arc<CudaContext>, CudaError> {
    ensure_driver()?;
    let count = usize::try_from(CudaContext::device_count()?).unwrap_or(0);
    if ordinal >= count {
        return Err(CudaError::NoSuchDevice { ordinal, count });
    }
    Ok(CudaContext::new(ordinal)?)
}
