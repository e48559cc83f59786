//! Row-major matrix products through cuBLAS (column-major), on raw device addresses so they can be captured.
//!
//! A row-major `[m, n]` matrix is the column-major `[n, m]` matrix of the same bytes, so
//! `C = op(A)·op(B)` (row-major) is computed as `Cᵀ = op(B)ᵀ·op(A)ᵀ` (column-major) without any copy.

use std::ffi::c_int;
use std::sync::Arc;

use cudarc::cublas::result;
use cudarc::cublas::sys::{cublasHandle_t, cublasOperation_t};
use cudarc::driver::CudaStream;

use super::CudaError;
use super::workspace::Buffer;
use cudarc::driver::sys::CUdeviceptr as DevicePtr;

/// Whether an operand is used as stored or transposed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// As stored.
    N,
    /// Transposed.
    T,
}

impl Op {
    fn cublas(self) -> cublasOperation_t {
        match self {
            Op::N => cublasOperation_t::CUBLAS_OP_N,
            Op::T => cublasOperation_t::CUBLAS_OP_T,
        }
    }
}

/// Bytes of the workspace given to cuBLAS, so it never allocates (which stream capture forbids); NVIDIA
/// recommends 32 MiB on Hopper.
const CUBLAS_WORKSPACE_BYTES: usize = 32 << 20;

/// A cuBLAS handle bound to one stream, with its own workspace.
///
/// The handle is created and destroyed here rather than through cudarc's `CudaBlas`, whose drop unwraps the
/// result of `cublasDestroy`: after a device fault that call fails, and the panic would replace the fault's
/// error (or abort a thread already unwinding). Here a failed destroy is ignored: there is nothing left to free.
#[derive(Debug)]
pub struct Gemm {
    handle: cublasHandle_t,
    stream: Arc<CudaStream>,
    _workspace: Buffer<u8>,
}

// SAFETY: a cuBLAS handle may move between threads; `&self` calls enqueue on the handle's one stream, which
// cuBLAS allows from one thread at a time, as the drafter's `&mut` step guarantees.
unsafe impl Send for Gemm {}

impl Drop for Gemm {
    fn drop(&mut self) {
        // Errors are ignored (see the type's docs); the context must be current for the destroy.
        let _ = self.stream.context().bind_to_thread();
        // SAFETY: the handle was created in `Gemm::new` and is destroyed once, here.
        let _ = unsafe { result::destroy_handle(self.handle) };
    }
}

fn dim(value: usize) -> Result<c_int, CudaError> {
    c_int::try_from(value).map_err(|_| CudaError::GemmTooLarge(value))
}

impl Gemm {
    /// A handle on `stream`; [`CudaError::NoCublas`] when `libcublas` cannot be loaded.
    pub fn new(stream: Arc<CudaStream>) -> Result<Self, CudaError> {
        // SAFETY: only tries to dlopen the library; without this check cudarc panics on first use.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(CudaError::NoCublas);
        }
        stream.context().bind_to_thread()?;
        let workspace = Buffer::<u8>::zeros(&stream, CUBLAS_WORKSPACE_BYTES)?;
        let handle = result::create_handle()?;
        let gemm = Self {
            handle,
            stream,
            _workspace: workspace,
        };
        // SAFETY: the handle is live; the workspace lives as long as the handle (both owned by `Gemm`) and is
        // used on its stream.
        unsafe {
            result::set_stream(handle, gemm.stream.cu_stream() as _)?;
            cudarc::cublas::sys::cublasSetWorkspace_v2(
                handle,
                gemm._workspace.ptr() as *mut _,
                CUBLAS_WORKSPACE_BYTES,
            )
            .result()?;
        }
        Ok(gemm)
    }

    /// Row-major `C[m, n] = alpha · op_a(A)·op_b(B) + beta · C`, where `A` is stored `[m, k]` (`[k, m]` when
    /// transposed) and `B` `[k, n]` (`[n, k]` when transposed).
    ///
    /// # Safety
    /// The three addresses hold the stated matrices on this handle's device; `C` overlaps neither input.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn row_major(
        &self,
        (op_a, a): (Op, DevicePtr),
        (op_b, b): (Op, DevicePtr),
        c: DevicePtr,
        (m, n, k): (usize, usize, usize),
        alpha: f32,
        beta: f32,
    ) -> Result<(), CudaError> {
        let lda = if op_a == Op::N { k } else { m };
        let ldb = if op_b == Op::N { n } else { k };
        // SAFETY: the caller guarantees the buffers; the column-major call below reads Bᵀ-then-Aᵀ as explained
        // in the module docs, with leading dimensions equal to the stored row lengths.
        unsafe {
            result::sgemm(
                self.handle,
                op_b.cublas(),
                op_a.cublas(),
                dim(n)?,
                dim(m)?,
                dim(k)?,
                &alpha,
                b as *const f32,
                dim(ldb)?,
                a as *const f32,
                dim(lda)?,
                &beta,
                c as *mut f32,
                dim(n)?,
            )?;
        }
        Ok(())
    }
}
