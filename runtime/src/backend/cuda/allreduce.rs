//! Gradient all-reduce between drafter replicas on the devices of one process, through NCCL (loaded at run
//! time by `nccl.rs`). One communicator per device; each drafter enqueues an in-place average of its flat
//! gradient buffer on its own step stream, between backward and the optimizer.
//!
//! Teardown never calls `ncclCommDestroy`: it is collective within a node, so one thread dropping several
//! communicators, or one rank dropping its own while another still waits in a collective, hangs. Instead:
//!
//! ```text
//!  any error  ──▶ GradientAllReduce::abort_group (or the host AllReduce's on_abort hook): ncclCommAbort on
//!                 every communicator of the group, which also ends collectives other ranks are blocked in
//!  normal end ──▶ the last rank handle of the group dropped: every communicator aborted (local; by then no
//!                 rank has an operation in flight)
//! ```

use std::ffi::c_int;
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::sys::CUstream;

use super::CudaError;
use super::nccl::{AVG, Comm, nccl};
use cudarc::driver::sys::CUdeviceptr;

/// The communicators of one group, aborted together exactly once.
#[derive(Debug)]
struct CommGroup {
    /// `None` once aborted.
    comms: Mutex<Option<Vec<Comm>>>,
}

// SAFETY: NCCL communicators may be aborted from any thread; the mutex serialises the one abort.
unsafe impl Send for CommGroup {}
// SAFETY: as above; the handles are only read under the mutex.
unsafe impl Sync for CommGroup {}

impl CommGroup {
    /// Aborts every communicator (once; later calls do nothing). Returns the first NCCL error, if any.
    fn abort(&self) -> Result<(), CudaError> {
        let comms = self
            .comms
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let Some(comms) = comms else {
            return Ok(());
        };
        let nccl = nccl()?;
        let mut first_error = Ok(());
        for comm in comms {
            // SAFETY: each communicator came from `comm_init_all` and is aborted here, once.
            let result = unsafe { nccl.comm_abort(comm) };
            if first_error.is_ok() {
                first_error = result;
            }
        }
        first_error
    }

    fn is_aborted(&self) -> bool {
        self.comms
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_none()
    }
}

impl Drop for CommGroup {
    fn drop(&mut self) {
        // Every rank handle is gone, so nothing is in flight: aborting only frees. An error here has no one to
        // report to.
        let _ = self.abort();
    }
}

/// Aborts a whole communicator group from anywhere (the host all-reduce's abort hook holds one).
#[derive(Debug, Clone)]
pub struct GroupAbort(Arc<CommGroup>);

impl GroupAbort {
    /// Aborts every communicator of the group (once).
    pub fn abort(&self) -> Result<(), CudaError> {
        self.0.abort()
    }
}

/// One rank's NCCL communicator: the average of the gradient buffers of all ranks, in place.
#[derive(Debug)]
pub struct GradientAllReduce {
    group: Arc<CommGroup>,
    comm: Comm,
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
        let nccl = nccl()?;
        let devices = ordinals
            .iter()
            .map(|&o| {
                c_int::try_from(o).map_err(|_| CudaError::NoSuchDevice {
                    ordinal: o,
                    count: 0,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let comms = nccl.comm_init_all(&devices)?;
        let group = Arc::new(CommGroup {
            comms: Mutex::new(Some(comms.clone())),
        });
        let world_size = comms.len();
        Ok(comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| Self {
                group: Arc::clone(&group),
                comm,
                rank,
                world_size,
            })
            .collect())
    }

    /// The file NCCL was loaded from (`libnccl.so.2`, ...), or why it could not be.
    pub fn library() -> Result<&'static str, CudaError> {
        nccl().map(|n| n.file.as_str())
    }

    /// This communicator's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// A handle that aborts every communicator of this group, for error paths on any thread.
    pub fn group_abort(&self) -> GroupAbort {
        GroupAbort(Arc::clone(&self.group))
    }

    /// Aborts every communicator of this group: what a rank does on any error, so that no other rank stays
    /// blocked in a collective this one will never join.
    pub fn abort_group(&self) -> Result<(), CudaError> {
        self.group.abort()
    }

    /// Enqueues `grads[..n] ← average over ranks` on `stream`.
    ///
    /// # Safety
    /// `grads` holds `n` f32s on this communicator's device; every rank enqueues the same call.
    pub(crate) unsafe fn enqueue_average(
        &self,
        grads: CUdeviceptr,
        n: usize,
        stream: CUstream,
    ) -> Result<(), CudaError> {
        // An aborted communicator must not be used again; NCCL would read freed memory.
        let comms = self
            .group
            .comms
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if comms.is_none() {
            return Err(CudaError::Nccl("the communicator group was aborted".into()));
        }
        // SAFETY: the caller's contract; the group is live while its lock is held.
        unsafe { nccl()?.all_reduce_f32(grads as *mut _, n, AVG, self.comm, stream) }
    }

    /// Whether the group has been aborted.
    pub fn is_aborted(&self) -> bool {
        self.group.is_aborted()
    }
}
