//! Gradient all-reduce between drafter replicas on the devices of one process, through NCCL (loaded at run
//! time like the rest of CUDA). One communicator per device; each drafter enqueues an in-place average of its
//! flat gradient buffer on its own step stream, between backward and the optimizer, so it is captured into the
//! step's graph like every other operation.

use std::ffi::c_int;

use cudarc::driver::sys::CUstream;
use cudarc::nccl::result as nccl;
use cudarc::nccl::sys::{ncclComm_t, ncclDataType_t, ncclRedOp_t};

use super::CudaError;
use cudarc::driver::sys::CUdeviceptr as DevicePtr;

fn nccl_error(e: nccl::NcclError) -> CudaError {
    CudaError::Nccl(format!("{e:?}"))
}

/// One rank's NCCL communicator: the average of the gradient buffers of all ranks, in place.
#[derive(Debug)]
pub struct GradientAllReduce {
    comm: ncclComm_t,
    rank: usize,
    world_size: usize,
}

// SAFETY: an NCCL communicator may be used from any thread, one operation at a time; `&mut`/ownership of the
// drafter that holds it serialises its use.
unsafe impl Send for GradientAllReduce {}

impl GradientAllReduce {
    /// Communicators for `ordinals` (rank `i` on device `ordinals[i]`), all in this process
    /// (`ncclCommInitAll`). [`CudaError::NoNccl`] when `libnccl` cannot be loaded.
    pub fn for_devices(ordinals: &[usize]) -> Result<Vec<Self>, CudaError> {
        // SAFETY: only tries to dlopen the library; cudarc panics on first use without it.
        if !unsafe { cudarc::nccl::sys::is_culib_present() } {
            return Err(CudaError::NoNccl);
        }
        let devices = ordinals
            .iter()
            .map(|&o| {
                c_int::try_from(o).map_err(|_| CudaError::NoSuchDevice {
                    ordinal: o,
                    count: 0,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let count = c_int::try_from(devices.len())
            .map_err(|_| CudaError::Nccl("too many devices".into()))?;
        let mut comms = vec![std::ptr::null_mut(); devices.len()];
        // SAFETY: `comms` and `devices` both hold `count` elements.
        unsafe { nccl::comm_init_all(comms.as_mut_ptr(), count, devices.as_ptr()) }
            .map_err(nccl_error)?;
        let world_size = comms.len();
        Ok(comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| Self {
                comm,
                rank,
                world_size,
            })
            .collect())
    }

    /// This communicator's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Enqueues `grads[..n] ← average over ranks` on `stream`.
    ///
    /// # Safety
    /// `grads` holds `n` f32s on this communicator's device; every rank enqueues the same call.
    pub(crate) unsafe fn enqueue_average(
        &self,
        grads: DevicePtr,
        n: usize,
        stream: CUstream,
    ) -> Result<(), CudaError> {
        let buffer = grads as *mut std::ffi::c_void;
        // SAFETY: the caller's contract; NCCL reads and writes the same buffer (in place).
        unsafe {
            nccl::all_reduce(
                buffer,
                buffer,
                n,
                ncclDataType_t::ncclFloat32,
                ncclRedOp_t::ncclAvg,
                self.comm,
                stream as _,
            )
        }
        .map_err(nccl_error)?;
        Ok(())
    }
}

impl Drop for GradientAllReduce {
    fn drop(&mut self) {
        // SAFETY: the communicator was created by `comm_init_all` and is destroyed once; a failure here leaves
        // nothing to recover, so it is ignored.
        let _ = unsafe { nccl::comm_destroy(self.comm) };
    }
}
