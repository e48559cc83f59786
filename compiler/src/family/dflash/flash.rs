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
    heads: (usize, usize, usize),
    block: usize,
) -> bool {
    backend == BackendKind::Cuda
        && precision == Precision::Bf16
        && flash_refusal(heads, block).is_none()
}

/// Why the flash kernels do not take these heads and block size, in words (`check`'s warning for a CUDA
/// worker at `precision = bf16`, whose attention then falls back to the f32 CUDA-core kernels), or `None` when
/// they do.
pub fn flash_refusal(
    (heads, kv_heads, head_dim): (usize, usize, usize),
    block: usize,
) -> Option<String> {
    if !FLASH_HEAD_DIMS.contains(&head_dim) {
        let [a, b] = FLASH_HEAD_DIMS;
        return Some(format!(
            "head_dim {head_dim} (the flash kernels are built for {a} and {b})"
        ));
    }
    let group = (kv_heads > 0 && heads.is_multiple_of(kv_heads)).then(|| heads / kv_heads);
    if !group.is_some_and(|g| (1..=FLASH_MAX_GROUP).contains(&g)) {
        return Some(format!(
            "{heads} query heads over {kv_heads} kv heads (the flash kernels take 1 to {FLASH_MAX_GROUP} \
             query heads per kv head)"
        ));
    }
    (block != FLASH_BLOCK).then(|| {
        format!("blocks of {block} slots (the flash kernels take blocks of {FLASH_BLOCK})")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_refusal_names_the_first_rule_a_shape_breaks() {
        assert_eq!(flash_refusal((32, 8, 128), 16), None);
        assert!(
            flash_refusal((32, 8, 96), 16)
                .unwrap()
                .starts_with("head_dim 96")
        );
        assert!(
            flash_refusal((32, 2, 64), 16)
                .unwrap()
                .starts_with("32 query heads over 2")
        );
        assert!(
            flash_refusal((6, 4, 64), 16)
                .unwrap()
                .starts_with("6 query heads over 4")
        );
        assert!(
            flash_refusal((8, 8, 64), 8)
                .unwrap()
                .starts_with("blocks of 8")
        );
        assert!(flash_attention(
            BackendKind::Cuda,
            Precision::Bf16,
            (8, 8, 64),
            16
        ));
        assert!(!flash_attention(
            BackendKind::Cuda,
            Precision::F32,
            (8, 8, 64),
            16
        ));
        assert!(!flash_attention(
            BackendKind::Cpu,
            Precision::Bf16,
            (8, 8, 64),
            16
        ));
    }
}
