//! NCCL loaded at run time by its shipped file name.
//!
//! cudarc 0.19 looks for `libnccl.so`, `libnccl.so.13`, `.12` … `.9` and `.1` (`cudarc::get_lib_name_candidates`),
//! never `libnccl.so.2`, which is the only name the `libnccl2` package and the `nvidia-nccl-cu13` wheel ship
//! (`libnccl.so` comes only with the `-dev` package). So the backend opens the library itself, `libnccl.so.2`
//! first, then cudarc's names, and binds the five functions the gradient all-reduce calls. `DRAFTPIPE_NCCL`
//! names a file to try before all of them (a wheel's `nvidia/nccl/lib/libnccl.so.2`, say).

use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::OnceLock;

use cudarc::driver::sys::CUstream;
use libloading::Library;

use super::CudaError;

/// An NCCL communicator handle (`ncclComm_t`).
pub(crate) type Comm = *mut c_void;

/// `ncclFloat32` of `ncclDataType_t`.
pub(crate) const FLOAT32: c_int = 7;
/// `ncclAvg` of `ncclRedOp_t`.
pub(crate) const AVG: c_int = 4;

/// The NCCL entry points the backend calls.
pub(crate) struct Nccl {
    /// The name the library was opened by.
    pub(crate) file: String,
    get_error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    comm_init_all: unsafe extern "C" fn(*mut Comm, c_int, *const c_int) -> c_int,
    all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        Comm,
        CUstream,
    ) -> c_int,
    comm_abort: unsafe extern "C" fn(Comm) -> c_int,
    _library: Library,
}

/// The file names tried, in order.
pub(crate) fn candidates() -> Vec<String> {
    let mut names: Vec<String> = std::env::var("DRAFTPIPE_NCCL")
        .ok()
        .filter(|path| !path.is_empty())
        .into_iter()
        .collect();
    names.push("libnccl.so.2".into());
    names.extend(cudarc::get_lib_name_candidates("nccl"));
    names
}

/// NCCL, opened once per process; [`CudaError::NoNccl`] when no candidate opens or one lacks a symbol.
pub(crate) fn nccl() -> Result<&'static Nccl, CudaError> {
    static NCCL: OnceLock<Option<Nccl>> = OnceLock::new();
    NCCL.get_or_init(load).as_ref().ok_or(CudaError::NoNccl)
}

fn load() -> Option<Nccl> {
    candidates().into_iter().find_map(|file| {
        // SAFETY: loading NCCL runs its initialisers, which have no preconditions.
        let library = unsafe { Library::new(&file) }.ok()?;
        // SAFETY: the symbols are NCCL's C API with the signatures declared in `Nccl` (nccl.h, 2.x).
        unsafe {
            Some(Nccl {
                get_error_string: *library.get(b"ncclGetErrorString\0").ok()?,
                comm_init_all: *library.get(b"ncclCommInitAll\0").ok()?,
                all_reduce: *library.get(b"ncclAllReduce\0").ok()?,
                comm_abort: *library.get(b"ncclCommAbort\0").ok()?,
                file,
                _library: library,
            })
        }
    })
}

impl Nccl {
    fn check(&self, what: &str, result: c_int) -> Result<(), CudaError> {
        if result == 0 {
            return Ok(());
        }
        // SAFETY: NCCL returns a static string for every result code.
        let text = unsafe { CStr::from_ptr((self.get_error_string)(result)) };
        Err(CudaError::Nccl(format!(
            "{what}: {} (ncclResult {result})",
            text.to_string_lossy()
        )))
    }

    /// One communicator per device of `devices`, all in this process.
    pub(crate) fn comm_init_all(&self, devices: &[c_int]) -> Result<Vec<Comm>, CudaError> {
        let count = c_int::try_from(devices.len())
            .map_err(|_| CudaError::Nccl("too many devices".into()))?;
        let mut comms = vec![std::ptr::null_mut(); devices.len()];
        // SAFETY: both arrays hold `count` elements.
        let result = unsafe { (self.comm_init_all)(comms.as_mut_ptr(), count, devices.as_ptr()) };
        self.check("ncclCommInitAll", result)?;
        Ok(comms)
    }

    /// Enqueues an in-place `op` all-reduce of `count` f32s at `buffer` on `stream`.
    ///
    /// # Safety
    /// `buffer` holds `count` f32s on `comm`'s device; `comm` is live (not aborted).
    pub(crate) unsafe fn all_reduce_f32(
        &self,
        buffer: *mut c_void,
        count: usize,
        op: c_int,
        comm: Comm,
        stream: CUstream,
    ) -> Result<(), CudaError> {
        // SAFETY: the caller's contract.
        let result = unsafe { (self.all_reduce)(buffer, buffer, count, FLOAT32, op, comm, stream) };
        self.check("ncclAllReduce", result)
    }

    /// Aborts `comm`: stops its operations in flight and frees it. Local (not collective), so it cannot hang on
    /// another rank, unlike `ncclCommDestroy`.
    ///
    /// # Safety
    /// `comm` came from [`Nccl::comm_init_all`] and is aborted once.
    pub(crate) unsafe fn comm_abort(&self, comm: Comm) -> Result<(), CudaError> {
        // SAFETY: the caller's contract.
        let result = unsafe { (self.comm_abort)(comm) };
        self.check("ncclCommAbort", result)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_name_comes_before_cudarcs_names() {
        let names = candidates();
        let shipped = names.iter().position(|n| n == "libnccl.so.2").unwrap();
        let dev_only = names.iter().position(|n| n == "libnccl.so").unwrap();
        assert!(shipped < dev_only, "{names:?}");
        assert!(
            names.iter().any(|n| n == "libnccl.so.1"),
            "cudarc's names kept"
        );
    }
}
