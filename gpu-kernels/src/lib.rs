//! Single-source drafter kernels.
//!
//! ```text
//!  runtime ── cpu backend ──▶ these kernel bodies (host build, called in a loop over indices)
//!          └─ cuda backend ─▶ the same bodies compiled for nvptx64 → PTX (`ptx` wrappers, one thread per index)
//! ```
//!
//! Every kernel is a `pub unsafe fn` over raw pointers, sizes and one trailing index. The host calls it for
//! every index of its launch; a GPU wrapper calls it with `index = blockIdx.x · blockDim.x + threadIdx.x` after
//! checking `index < count`. `#![no_std]`, no allocation, no slice indexing (pointer arithmetic under each
//! kernel's `# Safety` contract), so nothing on the device path can panic. Scalar maths lives in [`math`], with
//! a host body and an `nvptx64` body.
//!
//! All matrices are row-major `[rows, cols]`. "Element range" kernels take `(n, chunk_len, chunk)` and handle
//! elements `chunk · chunk_len .. min(n, (chunk + 1) · chunk_len)`: the GPU launches `chunk_len = 1`, the host
//! long chunks so the inner loop vectorises.
//!
//! | kernel | index means | indices |
//! | --- | --- | --- |
//! | [`norm::rmsnorm_forward`] | row | `rows` |
//! | [`norm::rmsnorm_backward_input`] | row | `rows` |
//! | [`norm::rmsnorm_weight_grad_partials`] | `chunk · cols + col` | `ceil(rows / rows_per_chunk) · cols` |
//! | [`norm::column_sums`] | column | `cols` |
//! | [`activation::swiglu_forward`] | element chunk | `ceil(rows · inter / chunk_len)` |
//! | [`activation::swiglu_backward`] | element chunk | `ceil(rows · inter / chunk_len)` |
//! | [`activation::head_residual_forward`] | element chunk | `ceil(n / chunk_len)` |
//! | [`activation::head_residual_backward`] | element chunk | `ceil(n / chunk_len)` |
//! | [`loss::build_labels`] | `head · tokens + token` | `heads · tokens` |
//! | [`loss::head_loss_scales`] | head | `heads` |
//! | [`loss::vocab_loss_row`] | token row of the chunk | rows in the chunk |
//! | [`reduce::sum_partials`] | chunk | `ceil(n / chunk_len)` |
//! | [`reduce::sum_squares_partials`] | chunk | `ceil(n / chunk_len)` |
//! | [`reduce::finish_sum`] | — | 1 |
//! | [`reduce::finish_grad_norm`] | — | 1 |
//! | [`adamw::adamw_update`] | element chunk | `ceil(n / chunk_len)` |
//!
//! One training step in kernel order (GEMMs are the caller's):
//!
//! ```text
//!  forward   GEMM x = hs·fcᵀ; per block: rmsnorm_forward, GEMM gate_up, swiglu_forward, GEMM x += act·downᵀ
//!            rmsnorm_forward (final norm); per head: GEMM a = z·Wᵀ, head_residual_forward
//!  loss      build_labels, head_loss_scales; per head, per chunk: GEMM logits, vocab_loss_row, GEMMs dh, dlm
//!            sum_partials + finish_sum (loss total)
//!  backward  per head: head_residual_backward, GEMMs dz += da·W, dW = daᵀ·z; rmsnorm_backward_input and
//!            rmsnorm_weight_grad_partials + column_sums for every norm; swiglu_backward between the block GEMMs
//!  optimizer sum_squares_partials + finish_grad_norm, adamw_update
//! ```
#![no_std]
#![cfg_attr(target_arch = "nvptx64", feature(asm_experimental_arch))]
#![cfg_attr(target_arch = "nvptx64", feature(abi_ptx, stdarch_nvptx))]

pub mod activation;
pub mod adamw;
pub mod loss;
pub mod math;
pub mod norm;
pub mod plane;
#[cfg(target_arch = "nvptx64")]
mod ptx;
pub mod reduce;
pub mod table;
