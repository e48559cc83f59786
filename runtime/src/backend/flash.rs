//! DFlash attention on the flash kernels (`gpu-kernels/src/flash/`, tensor cores, bf16 Q/K/V), as operations
//! of every backend written once over [`Backend::launch_flash`](super::Backend::launch_flash), beside the f32
//! attention operations of `operations.rs` (same shapes, same saved views, same outputs, the same size checks
//! of `attention.rs`).
//!
//! ```text
//!  producers (the model, per layer)  rope_bf16: q, k_ctx, k_blk rotated in place + their bf16 copies
//!                                    round_to_bf16: v_ctx, v_blk (the v products write f32 only)
//!                                    ─▶ the layout's flash_* copies, one set per layer, kept for the backward
//!  forward   flash_forward_d{64,128}: out (f32) and its bf16 copy (the o_proj operand), lse
//!                                                                       one block per (DFlash block, kv head)
//!  backward  flash_backward_q_d{64,128}: delta, dq, dout's bf16 copy    one block per (DFlash block, kv head)
//!            flash_backward_kv_d{64,128} × 2: dk, dv of the context keys (key_ranges_ctx), then of the block
//!            keys (key_ranges_blk)                                      one block per (64 keys, kv head)
//! ```
//!
//! Which worker takes this path is the compiler's rule (`draftpipe_compiler::family::dflash::flash`): CUDA at
//! `precision = bf16` with head_dim 64 or 128, 1–8 heads per kv head and blocks of 16; the layout then holds
//! the `flash_*` copies and the model calls these operations, and everything else (`f32`, `tf32`, other
//! shapes, the CPU's steps) calls the f32 attention operations (`check` warns where a CUDA worker at `bf16`
//! falls back). The CPU backend runs these through the warp model (`cpu/flash.rs`), which is how the host
//! tests what the CUDA backend launches. A shape the kernels are not built for is
//! [`BackendError::Unsupported`](super::BackendError::Unsupported) with the kernels' message.

use draftpipe_gpu_kernels::flash::check_head_dim;

use super::{AttentionShape, BackendError, BackendResult};

/// [`BackendError::Unsupported`] with the flash kernels' reason when they do not take this shape.
pub(crate) fn check_flash_shape(queries: usize, shape: &AttentionShape) -> BackendResult {
    check_head_dim(queries, shape.heads, shape.kv_heads, shape.head_dim)
        .map_err(|e| BackendError::Unsupported(e.to_string()))
}

/// The [`FlashKernel`](super::FlashKernel) of `$d64` or `$d128` for `$head_dim` with these fields, or a return
/// of [`BackendError::Unsupported`] for another head dimension.
macro_rules! flash_variant {
    ($head_dim:expr, [$d64:ident, $d128:ident] { $($field:ident: $value:expr),* $(,)? }) => {
        match $head_dim {
            64 => $crate::backend::FlashKernel::$d64 { $($field: $value),* },
            128 => $crate::backend::FlashKernel::$d128 { $($field: $value),* },
            other => {
                return Err($crate::backend::BackendError::Unsupported(
                    draftpipe_gpu_kernels::flash::FlashShapeError::HeadDim(other).to_string(),
                ))
            }
        }
    };
}
pub(super) use flash_variant;

/// The flash operations as provided [`Backend`](super::Backend) methods, expanded inside the trait in
/// `backend/mod.rs`.
macro_rules! flash_operations {
    () => {
        /// [`Backend::attention_forward`] on the flash kernels over the bf16 copies in `inputs`: `out [Q, heads,
        /// head_dim]` and `lse [Q, heads]` as the f32 path writes them, and `out16`, `out` rounded to bf16
        /// (`backend/flash.rs`).
        fn flash_attention_forward(
            &mut self,
            inputs: AttentionInputs<'_, Self, half::bf16>,
            shape: AttentionShape,
            (out, out16): (Dst<'_, Self, f32>, Dst<'_, Self, half::bf16>),
            lse: Dst<'_, Self, f32>,
        ) -> BackendResult {
            let AttentionSizes { queries, context } =
                attention::check_forward(&shape, &inputs, out.len(), lse.len());
            assert_eq!(out16.len(), out.len(), "flash_attention_forward: out16");
            crate::backend::flash::check_flash_shape(queries, &shape)?;
            let kernel = crate::backend::flash::flash_variant!(
                shape.head_dim,
                [flash_forward_d64, flash_forward_d128] {
                    q: Self::reinterpret_read(Self::read(inputs.q)),
                    k_ctx: Self::reinterpret_read(Self::read(inputs.k_ctx)),
                    v_ctx: Self::reinterpret_read(Self::read(inputs.v_ctx)),
                    k_blk: Self::reinterpret_read(Self::read(inputs.k_blk)),
                    v_blk: Self::reinterpret_read(Self::read(inputs.v_blk)),
                    query_ranges: Self::read(inputs.query_ranges),
                    out: Self::write(out),
                    out_bf16: Self::reinterpret_write(Self::write(out16)),
                    lse: Self::write(lse),
                    queries: queries,
                    context: context,
                    heads: shape.heads,
                    kv_heads: shape.kv_heads,
                    scale: shape.scale,
                }
            );
            self.launch_flash(kernel)
        }

        /// [`Backend::attention_backward`] on the flash kernels over the forward's bf16 copies in `inputs`:
        /// every gradient of `grads` overwritten (deterministic, no atomics), `delta [Q, heads]` and
        /// `dout16 [Q, heads, head_dim]` scratch (`backend/flash.rs`).
        #[allow(clippy::too_many_arguments)]
        fn flash_attention_backward(
            &mut self,
            inputs: AttentionInputs<'_, Self, half::bf16>,
            shape: AttentionShape,
            saved: AttentionSaved<'_, Self>,
            (mut delta, mut dout16): (Dst<'_, Self, f32>, Dst<'_, Self, half::bf16>),
            grads: AttentionGrads<'_, Self>,
        ) -> BackendResult {
            let AttentionSizes { queries, context } =
                attention::check_backward(&shape, &inputs, &saved, delta.len(), &grads);
            assert_eq!(dout16.len(), saved.dout.len(), "flash_attention_backward: dout16");
            crate::backend::flash::check_flash_shape(queries, &shape)?;
            let AttentionShape {
                heads,
                kv_heads,
                head_dim,
                scale,
            } = shape;
            let q = inputs.q;
            let kernel = crate::backend::flash::flash_variant!(
                head_dim,
                [flash_backward_q_d64, flash_backward_q_d128] {
                    q: Self::reinterpret_read(Self::read(q)),
                    k_ctx: Self::reinterpret_read(Self::read(inputs.k_ctx)),
                    v_ctx: Self::reinterpret_read(Self::read(inputs.v_ctx)),
                    k_blk: Self::reinterpret_read(Self::read(inputs.k_blk)),
                    v_blk: Self::reinterpret_read(Self::read(inputs.v_blk)),
                    query_ranges: Self::read(inputs.query_ranges),
                    out: Self::read(saved.out),
                    dout: Self::read(saved.dout),
                    lse: Self::read(saved.lse),
                    delta: Self::write(delta.reborrow()),
                    dq: Self::write(grads.dq),
                    dout_bf16: Self::reinterpret_write(Self::write(dout16.reborrow())),
                    queries: queries,
                    context: context,
                    heads: heads,
                    kv_heads: kv_heads,
                    scale: scale,
                }
            );
            self.launch_flash(kernel)?;
            let (delta, dout16) = (delta.into_read(), dout16.into_read());
            let key_sets = [
                (
                    context,
                    inputs.k_ctx,
                    inputs.v_ctx,
                    saved.key_ranges_ctx,
                    grads.dk_ctx,
                    grads.dv_ctx,
                ),
                (
                    queries,
                    inputs.k_blk,
                    inputs.v_blk,
                    saved.key_ranges_blk,
                    grads.dk_blk,
                    grads.dv_blk,
                ),
            ];
            for (keys, k, v, key_ranges, dk, dv) in key_sets {
                let kernel = crate::backend::flash::flash_variant!(
                    head_dim,
                    [flash_backward_kv_d64, flash_backward_kv_d128] {
                        q: Self::reinterpret_read(Self::read(q)),
                        dout: Self::reinterpret_read(Self::read(dout16)),
                        lse: Self::read(saved.lse),
                        delta: Self::read(delta),
                        k: Self::reinterpret_read(Self::read(k)),
                        v: Self::reinterpret_read(Self::read(v)),
                        key_ranges: Self::read(key_ranges),
                        dk: Self::write(dk),
                        dv: Self::write(dv),
                        keys: keys,
                        queries: queries,
                        heads: heads,
                        kv_heads: kv_heads,
                        scale: scale,
                    }
                );
                self.launch_flash(kernel)?;
            }
            Ok(())
        }
    };
}
pub(super) use flash_operations;
