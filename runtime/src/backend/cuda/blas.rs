//! Row-major matrix products through cuBLAS (column-major), on raw device addresses so they can be captured.
//!
//! A row-major `[m, n]` matrix is the column-major `[n, m]` matrix of the same bytes, so
//! `C = op(A)·op(B)` (row-major) is computed as `Cᵀ = op(B)ᵀ·op(A)ᵀ` (column-major) without any copy.

use std::ffi::c_int;
use std::sync::Arc;

use cudarc::cublas::result;
use cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasHandle_t, cublasOperation_t, cudaDataType_t,
};
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr as _};
use draftpipe_compiler::plan::Precision;
use draftpipe_compiler::workspace::CUBLAS_WORKSPACE_BYTES;

use super::CudaError;

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

/// The element type of both inputs of [`Gemm::row_major_16`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HalfType {
    /// bfloat16 (`CUDA_R_16BF`).
    Bf16,
    /// IEEE half (`CUDA_R_16F`).
    F16,
}

/// A cuBLAS handle bound to one stream, with its own workspace.
///
/// The handle is created and destroyed here rather than through cudarc's `CudaBlas`, whose drop unwraps the
/// result of `cublasDestroy`: after a device fault that call fails, and the panic would replace the fault's
/// error (or abort a thread already unwinding). Here a failed destroy is ignored: there is nothing left to free.
#[derive(Debug)]
pub struct Gemm {
    handle: cublasHandle_t,
    stream: Arc<CudaStream>,
    _workspace: CudaSlice<u8>,
}

// SAFETY: a cuBLAS handle may move between threads; `&self` calls enqueue on the handle's one stream, which
// cuBLAS allows from one thread at a time, as the drafter's `&mut` step guarantees.
unsafe impl Send for Gemm {}

impl Drop for Gemm {
    fn drop(&mut self) {
        // Errors are ignored (see the type's docs); the context must be current for the destroy.
        let _ = self.stream.context().bind_to_thread();
        // SAFETY: the handle was created in `Gemm::with_workspace` and is destroyed once, here.
        let _ = unsafe { result::destroy_handle(self.handle) };
    }
}

fn dim(value: usize) -> Result<c_int, CudaError> {
    c_int::try_from(value).map_err(|_| CudaError::GemmTooLarge(value))
}

impl Gemm {
    /// A handle on `stream` with the plan's cuBLAS workspace size; [`CudaError::NoCublas`] when `libcublas`
    /// cannot be loaded.
    pub fn new(stream: Arc<CudaStream>) -> Result<Self, CudaError> {
        Self::with_workspace(stream, CUBLAS_WORKSPACE_BYTES)
    }

    /// A handle on `stream` with a workspace of `bytes` (the workspace layout's `cublas_workspace`), so that
    /// cuBLAS never allocates (which stream capture forbids).
    pub fn with_workspace(stream: Arc<CudaStream>, bytes: usize) -> Result<Self, CudaError> {
        // SAFETY: only tries to dlopen the library; without this check cudarc panics on first use.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(CudaError::NoCublas);
        }
        stream.context().bind_to_thread()?;
        let workspace = stream.alloc_zeros::<u8>(bytes.max(1))?;
        let handle = result::create_handle()?;
        let gemm = Self {
            handle,
            stream,
            _workspace: workspace,
        };
        let (address, _) = gemm._workspace.device_ptr(&gemm.stream);
        // SAFETY: the handle is live; the workspace lives as long as the handle (both owned by `Gemm`) and is
        // used on its stream.
        unsafe {
            result::set_stream(handle, gemm.stream.cu_stream() as _)?;
            cudarc::cublas::sys::cublasSetWorkspace_v2(handle, address as *mut _, bytes)
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
        (op_a, a): (Op, CUdeviceptr),
        (op_b, b): (Op, CUdeviceptr),
        c: CUdeviceptr,
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

    /// [`Gemm::row_major`] at `precision`: f32 as stored, or with both operands rounded by the tensor cores to
    /// TF32 or bf16 (`CUBLAS_COMPUTE_32F_FAST_TF32` / `_FAST_16BF`), accumulated in f32 into the f32 output.
    ///
    /// # Safety
    /// As [`Gemm::row_major`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn row_major_at(
        &self,
        a: (Op, CUdeviceptr),
        b: (Op, CUdeviceptr),
        c: CUdeviceptr,
        mnk: (usize, usize, usize),
        alpha_beta: (f32, f32),
        precision: Precision,
    ) -> Result<(), CudaError> {
        let compute = match precision {
            Precision::F32 => cublasComputeType_t::CUBLAS_COMPUTE_32F,
            Precision::Tf32 => cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
            Precision::Bf16 => cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_16BF,
        };
        // SAFETY: the caller's contract.
        unsafe {
            self.row_major_ex(
                (a, b, c),
                mnk,
                alpha_beta,
                cudaDataType_t::CUDA_R_32F,
                compute,
            )
        }
    }

    /// [`Gemm::row_major`] with both inputs 16-bit floats of `input` (bf16 or f16) and the output f32,
    /// accumulated in f32 (`CUBLAS_COMPUTE_32F`, on the tensor cores): the product of hidden states held in
    /// 16 bits with a 16-bit copy of the other operand.
    ///
    /// # Safety
    /// As [`Gemm::row_major`], with `a` and `b` holding `input` elements.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn row_major_16(
        &self,
        a: (Op, CUdeviceptr),
        b: (Op, CUdeviceptr),
        c: CUdeviceptr,
        mnk: (usize, usize, usize),
        alpha_beta: (f32, f32),
        input: HalfType,
    ) -> Result<(), CudaError> {
        let input = match input {
            HalfType::Bf16 => cudaDataType_t::CUDA_R_16BF,
            HalfType::F16 => cudaDataType_t::CUDA_R_16F,
        };
        // SAFETY: the caller's contract.
        unsafe {
            self.row_major_ex(
                (a, b, c),
                mnk,
                alpha_beta,
                input,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
            )
        }
    }

    /// `cublasGemmEx` on row-major operands of element type `input`, an f32 output and f32 scalars.
    ///
    /// # Safety
    /// As [`Gemm::row_major`], with `a` and `b` holding `input` elements.
    unsafe fn row_major_ex(
        &self,
        ((op_a, a), (op_b, b), c): ((Op, CUdeviceptr), (Op, CUdeviceptr), CUdeviceptr),
        (m, n, k): (usize, usize, usize),
        (alpha, beta): (f32, f32),
        input: cudaDataType_t,
        compute: cublasComputeType_t,
    ) -> Result<(), CudaError> {
        let lda = if op_a == Op::N { k } else { m };
        let ldb = if op_b == Op::N { n } else { k };
        // SAFETY: as `row_major`: the caller guarantees the buffers; Bᵀ-then-Aᵀ in column-major order.
        unsafe {
            result::gemm_ex(
                self.handle,
                op_b.cublas(),
                op_a.cublas(),
                dim(n)?,
                dim(m)?,
                dim(k)?,
                (&alpha as *const f32).cast(),
                b as *const std::ffi::c_void,
                input,
                dim(ldb)?,
                a as *const std::ffi::c_void,
                input,
                dim(lda)?,
                (&beta as *const f32).cast(),
                c as *mut std::ffi::c_void,
                cudaDataType_t::CUDA_R_32F,
                dim(n)?,
                compute,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )?;
        }
        Ok(())
    }
}
