//! Which attention kernels a `dflash` worker runs, decided once here so the workspace layout (which holds the
//! flash path's bf16 scratch only where it runs), the runtime (which takes the flash path exactly when its
//! layout holds that scratch) and the cost model agree.
//!
//! ```text
//!  backend, precision, heads / kv_heads, head_dim, block ──flash_attention──▶ true:  flash kernels (bf16 Q/K/V,
//!                                                                                     tensor cores), CUDA only
//!                                                                             false: the f32 attention kernels
//! ```
//!
//! The flash kernels (`draftpipe_gpu_kernels::flash`) run on CUDA at `precision = bf16`, for head_dim 64 or
//! 128, 1 to 8 query heads per kv head (one warp each) and DFlash blocks of 16 slots (one `mma` tile of rows).
//! Everything else takes the f32 CUDA-core kernels, by choice rather than by error: `precision = f32` asks for
//! f32 attention (rounding Q/K/V to bf16 would break its promise), `tf32` keeps f32 attention as it keeps f32
//! element-wise kernels, and a shape the flash kernels are not built for still trains, slower. The runtime's
//! test `flash_rule_agrees_with_the_kernels` holds these constants to the kernels' own check.

use crate::plan::stages::Precision;
use crate::workspace::BackendKind;

/// Head dimensions the flash kernels are built for (`draftpipe_gpu_kernels::flash::HEAD_DIMS`).
pub const FLASH_HEAD_DIMS: [usize; 2] = [64, 128];
/// Most query heads per kv head: a flash block has one warp per head of a group, at most 8.
pub const FLASH_MAX_GROUP: usize = 8;
/// DFlash block slots the flash kernels take: one block's rows are one `m16` tile
/// (`draftpipe_gpu_kernels::flash::BLOCK`).
pub const FLASH_BLOCK: usize = 16;

/// Whether a `dflash` worker on `backend` at `precision` runs the flash-attention kernels for these heads and
/// block size (see the module docs for the rule and why the rest falls back to the f32 kernels).
pub fn flash_attention(
    backend: BackendKind,
    precision: Precision,
    (heads, kv_heads, head_dim): (usize, usize, usize),
    block: usize,
) -> bool {
    backend == BackendKind::Cuda
        && precision == Precision::Bf16
        && FLASH_HEAD_DIMS.contains(&head_dim)
        && kv_heads > 0
        && heads.is_multiple_of(kv_heads)
        && (1..=FLASH_MAX_GROUP).contains(&(heads / kv_heads))
        && block == FLASH_BLOCK
}
