//! The embedded PTX and the loaded module: one `CudaFunction` per kernel, looked up once at start.
//!
//! The driver JIT-compiles the PTX for the card it finds, once per driver and PTX: its compute cache
//! (`~/.nv/ComputeCache`, on unless `CUDA_CACHE_DISABLE=1`) keeps the result, so only the first start on a
//! machine pays for it. When the JIT refuses the PTX, the module is loaded a second time with the JIT's error log
//! asked for, so the error says which entry and line failed instead of only `CUDA_ERROR_INVALID_PTX`.

use std::ffi::{CString, c_void};
use std::sync::Arc;

use cudarc::driver::sys::{CUjit_option, CUmodule, CUresult, cuModuleLoadDataEx, cuModuleUnload};
use cudarc::driver::{CudaContext, CudaFunction};
use cudarc::nvrtc::Ptx;

use super::CudaError;
use super::launch::FLASH_KERNEL_NAMES;
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
    /// Loads the embedded PTX into `ctx` and resolves every kernel in [`KERNEL_NAMES`] and
    /// [`FLASH_KERNEL_NAMES`].
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Self, CudaError> {
        let ptx = embedded_ptx()?;
        let module = match ctx.load_module(Ptx::from_src(ptx)) {
            Ok(module) => module,
            Err(source) => {
                ctx.bind_to_thread()?;
                return Err(CudaError::ModuleLoad {
                    source,
                    log: jit_error_log(ptx),
                });
            }
        };
        let functions = names()
            .map(|name| {
                module
                    .load_function(name)
                    .map_err(|_| CudaError::MissingKernel(name))
            })
            .collect::<Result<_, _>>()?;
        Ok(Self { functions })
    }

    /// The function named `name` (one of [`KERNEL_NAMES`] or [`FLASH_KERNEL_NAMES`]).
    pub fn function(&self, name: &'static str) -> Result<&CudaFunction, CudaError> {
        names()
            .position(|n| n == name)
            .map(|i| &self.functions[i])
            .ok_or(CudaError::MissingKernel(name))
    }
}

/// Every entry point the module resolves: the main table's, then the flash table's.
fn names() -> impl Iterator<Item = &'static str> {
    KERNEL_NAMES.iter().chain(FLASH_KERNEL_NAMES).copied()
}

/// Bytes of the JIT error log asked for (ptxas's messages are a line per problem).
const JIT_LOG_BYTES: usize = 16 << 10;

/// The JIT's error log for `ptx`, loaded again on the context bound to this thread with the log asked for
/// (the module, should it load this time, is unloaded at once); empty when the driver wrote none.
fn jit_error_log(ptx: &str) -> String {
    let Ok(source) = CString::new(ptx) else {
        return "the PTX holds a NUL byte".into();
    };
    let mut log = vec![0u8; JIT_LOG_BYTES];
    let mut options = [
        CUjit_option::CU_JIT_ERROR_LOG_BUFFER,
        CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
    ];
    // The driver reads an option's value from the pointer's bits when the value is an integer.
    let mut values = [
        log.as_mut_ptr().cast::<c_void>(),
        JIT_LOG_BYTES as *mut c_void,
    ];
    let mut module: CUmodule = std::ptr::null_mut();
    // SAFETY: `source` is NUL-terminated PTX, the log buffer outlives the call and its size is the one given,
    // and `options` and `values` have the same length.
    let result = unsafe {
        cuModuleLoadDataEx(
            &raw mut module,
            source.as_ptr().cast(),
            options.len() as u32,
            options.as_mut_ptr(),
            values.as_mut_ptr(),
        )
    };
    if result == CUresult::CUDA_SUCCESS && !module.is_null() {
        // SAFETY: the module was just loaded and nothing else holds it.
        unsafe { cuModuleUnload(module) };
    }
    log_text(&log)
}

/// The text of a NUL-terminated log buffer, trimmed.
fn log_text(buffer: &[u8]) -> String {
    let end = buffer.iter().position(|&b| b == 0).unwrap_or(buffer.len());
    String::from_utf8_lossy(&buffer[..end]).trim().to_owned()
}

#[cfg(test)]
mod tests {
    use super::log_text;

    #[test]
    fn the_jit_log_is_read_up_to_its_nul_and_trimmed() {
        let mut buffer =
            b"ptxas application ptx input, line 12; error   : Unknown symbol 'x'\n".to_vec();
        buffer.extend_from_slice(&[0, b'g', b'a', b'r']);
        assert_eq!(
            log_text(&buffer),
            "ptxas application ptx input, line 12; error   : Unknown symbol 'x'"
        );
        assert_eq!(log_text(&[0; 8]), "");
        assert_eq!(log_text(b"no terminator"), "no terminator");
    }
}
