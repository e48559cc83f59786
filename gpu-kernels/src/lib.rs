//! Single-source drafter kernels.
//!
//! ```text
//!  runtime ── cpu backend ──▶ these kernel bodies (host build, called in a loop over indices)
//!          └─ cuda backend ─▶ the same bodies compiled for nvptx64 → PTX (`ptx` entry points, from the table)
//! ```
//!
//! Every kernel body is a `pub unsafe fn` over raw pointers, sizes and its launch position (an index, a
//! [`plane::Plane`] and a row, or an element chunk). Each kernel is declared once in [`table`] (arguments with
//! their lengths, launch shape, body call); the device entry points (`ptx`), the runtime's host launchers and its
//! CUDA launcher are generated from that declaration. `#![no_std]`, no allocation, no slice indexing (pointer
//! arithmetic under each kernel's `# Safety` contract), so nothing on the device path can panic. Scalar maths
//! lives in [`math`], with a host body and an `nvptx64` body; row reductions run on [`plane`]s (a warp per row
//! on the GPU, the lanes as a loop on the host).
//!
//! All matrices are row-major `[rows, cols]`. "Element range" kernels take `(n, chunk_len, chunk)` and handle
//! elements `chunk · chunk_len .. min(n, (chunk + 1) · chunk_len)`: the GPU launches `chunk_len = 1`, the host
//! long chunks so the inner loop vectorises.
//!
//! | kernel | launch shape | position |
//! | --- | --- | --- |
//! | [`norm::rmsnorm_forward`], [`norm::rmsnorm_backward_input`] | a plane per row | row |
//! | [`norm::rmsnorm_weight_grad_partials`] | a thread per index | `chunk · cols + col` |
//! | [`norm::column_sums`] | a plane per column | column |
//! | [`activation`] kernels, [`adamw::adamw_update`] | element range | chunk |
//! | [`loss::build_labels`] | a thread per index | `head · tokens + token` |
//! | [`loss::head_loss_scales`] | a thread per head | head |
//! | [`loss::vocab_loss_row`] | a plane per token row | row |
//! | [`reduce::sum_partials`], [`reduce::sum_squares_partials`] | a plane per chunk | chunk |
//! | [`reduce::finish_sum`], [`reduce::finish_grad_norm`] | one plane (≤ [`reduce::MAX_PARTIALS`] partials) | — |
//! | [`embedding::embedding_gather`] | element range | chunk |
//! | [`rope::rope`] | element range over (row, pair) | chunk |
//! | [`loss::weighted_vocab_loss_row`] | a plane per token row | row |
//! | [`attention::attention_forward`], [`attention::attention_backward_q`] | a plane per (query tile, head) | `tile · heads + head` |
//! | [`attention::attention_delta`] | a plane per (query, head) | `query · heads + head` |
//! | [`attention::attention_backward_kv`] | a plane per (key tile, kv head) | `tile · kv_heads + kv head` |
//! | [`convert::round_to_half`] | element range | chunk |
//! | [`eagle3::eagle3_attention_forward`], [`eagle3::eagle3_attention_backward_q`] | a plane per (row, head) | `row · heads + head` |
//! | [`eagle3::eagle3_attention_backward_kv`] | a plane per (row, kv head) | `row · kv_heads + kv head` |
//! | [`eagle3::soft_label_loss_row`], [`eagle3::argmax_in_draft_row`] | a plane per row | row |
//! | [`eagle3::shift_rows`], [`eagle3::shift_rows_half`], [`eagle3::concat_columns`], [`eagle3::split_columns`] | element range | chunk |
//! | [`eagle3::shift_ids`], [`eagle3::step_positions`] | a thread per row | row |
//! | [`eagle3::step_mask_counts`] | one plane | — |
//! | [`acceptance::accepted_prefix_sum`] | one plane | — |
//! | [`flash`] forward, backward dq, backward dk/dv (own table, `flash_kernel_table!`) | a block of warps per (DFlash block, kv head) or (64 keys, kv head) | block |
//!
//! Which body each backend runs for attention: the CPU backend its own vector lanes
//! (`runtime/src/cpu/attention/lanes.rs`; the [`attention`] bodies are tested on the host beside them); the
//! CUDA backend the [`attention`] plane bodies (f32, CUDA cores). The [`flash`] bodies (bf16, tensor cores) are
//! compiled to PTX and run on the host only through their warp model in the tests; no backend launches them yet.
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
#![cfg_attr(
    target_arch = "nvptx64",
    feature(abi_ptx, stdarch_nvptx, abi_unadjusted, link_llvm_intrinsics)
)]
#![cfg_attr(target_arch = "nvptx64", allow(internal_features, improper_ctypes))]

pub mod acceptance;
pub mod activation;
pub mod adamw;
pub mod attention;
pub mod convert;
pub mod eagle3;
pub mod embedding;
pub mod flash;
pub mod loss;
pub mod math;
pub mod norm;
pub mod plane;
#[cfg(target_arch = "nvptx64")]
mod ptx;
pub mod reduce;
pub mod rope;
pub mod table;
