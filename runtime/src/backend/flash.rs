//! DFlash attention on the flash kernels (`gpu-kernels/src/flash/`, tensor cores, bf16 Q/K/V), as operations
//! of every backend written once over [`Backend::launch_flash`](super::Backend::launch_flash), beside the f32
//! attention operations of `operations.rs` (same inputs, same saved views, same outputs).
//!
//! ```text
//!  q, k_ctx, v_ctx, k_blk, v_blk (f32) ──round_to_half──▶ FlashCopies (bf16, the layout's flash_* scratch)
//!  forward   flash_forward_d{64,128}: out (f32), lse                    one block per (DFlash block, kv head)
//!  backward  the five copies again (the scratch holds one layer), then
//!            flash_backward_q_d{64,128}: delta, dq, dout's bf16 copy    one block per (DFlash block, kv head)
//!            flash_backward_kv_d{64,128} × 2: dk, dv of the context keys (key_ranges_ctx), then of the block
//!            keys (key_ranges_blk)                                      one block per (64 keys, kv head)
//! ```
//!
//! Which worker takes this path is the compiler's rule (`draftpipe_compiler::family::dflash::flash`): CUDA at
//! `precision = bf16` with head_dim 64 or 128, 1–8 heads per kv head and blocks of 16; the layout then holds
//! the `flash_*` scratch and the model calls these operations, and everything else (`f32`, `tf32`, other
//! shapes, the CPU's steps) calls the f32 attention operations. The CPU backend runs these through the warp
//! model (`cpu/flash.rs`), which is how the host tests what the CUDA backend launches. A shape the kernels are
//! not built for is [`BackendError::Unsupported`](super::BackendError::Unsupported) with the kernels' message.
//!
//! Converting the f32 operands is a pass of its own, not yet an extra output of the kernels that produce them
//! (RoPE for q and k, the v projection): five element-wise passes per layer and direction, about
//! `2 · 6 · (Q·heads + 2·(T + Q)·kv_heads) · head_dim` bytes.

use draftpipe_gpu_kernels::flash::check_head_dim;

use super::{AttentionShape, Backend, BackendError, BackendResult, Dst};

/// The flash path's bf16 copies of one layer's attention operands (`[Q, heads, D]`, `[T, kv_heads, D]` twice,
/// `[Q, kv_heads, D]` twice): the layout's `flash_q`, `flash_k_ctx`, `flash_v_ctx`, `flash_k_blk`,
/// `flash_v_blk`, overwritten by each call.
pub struct FlashCopies<'a, B: Backend> {
    /// Queries.
    pub q: Dst<'a, B, half::bf16>,
    /// Context keys.
    pub k_ctx: Dst<'a, B, half::bf16>,
    /// Context values.
    pub v_ctx: Dst<'a, B, half::bf16>,
    /// Block keys.
    pub k_blk: Dst<'a, B, half::bf16>,
    /// Block values.
    pub v_blk: Dst<'a, B, half::bf16>,
}

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

/// The flash operations as provided [`Backend`] methods, expanded inside the trait in `backend/mod.rs`.
macro_rules! flash_operations {
    () => {
        /// [`Backend::attention_forward`] on the flash kernels: `inputs` rounded to bf16 into `copies`, then
        /// `out [Q, heads, head_dim]` and `lse [Q, heads]` as the f32 path writes them (`backend/flash.rs`).
        fn flash_attention_forward(
            &mut self,
            inputs: AttentionInputs<'_, Self>,
            shape: AttentionShape,
            copies: crate::backend::flash::FlashCopies<'_, Self>,
            out: Dst<'_, Self, f32>,
            lse: Dst<'_, Self, f32>,
        ) -> BackendResult {
            let AttentionSizes { queries, context } = shape.sizes(inputs.lens());
            assert!(
                out.len() == inputs.q.len() && lse.len() == queries * shape.heads,
                "flash_attention_forward: output sizes"
            );
            crate::backend::flash::check_flash_shape(queries, &shape)?;
            let [q, k_ctx, v_ctx, k_blk, v_blk] = self.flash_copies(inputs, copies)?;
            let kernel = crate::backend::flash::flash_variant!(
                shape.head_dim,
                [flash_forward_d64, flash_forward_d128] {
                    q: Self::reinterpret_read(Self::read(q)),
                    k_ctx: Self::reinterpret_read(Self::read(k_ctx)),
                    v_ctx: Self::reinterpret_read(Self::read(v_ctx)),
                    k_blk: Self::reinterpret_read(Self::read(k_blk)),
                    v_blk: Self::reinterpret_read(Self::read(v_blk)),
                    query_ranges: Self::read(inputs.query_ranges),
                    out: Self::write(out),
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

        /// [`Backend::attention_backward`] on the flash kernels: every gradient of `grads` overwritten
        /// (deterministic, no atomics), `delta [Q, heads]` and `dout16 [Q, heads, head_dim]` scratch, `copies`
        /// rounded again from `inputs` (`backend/flash.rs`).
        #[allow(clippy::too_many_arguments)]
        fn flash_attention_backward(
            &mut self,
            inputs: AttentionInputs<'_, Self>,
            shape: AttentionShape,
            saved: AttentionSaved<'_, Self>,
            mut delta: Dst<'_, Self, f32>,
            (copies, mut dout16): (
                crate::backend::flash::FlashCopies<'_, Self>,
                Dst<'_, Self, half::bf16>,
            ),
            grads: AttentionGrads<'_, Self>,
        ) -> BackendResult {
            let sizes = shape.sizes(inputs.lens());
            attention::check_backward_lens(
                &shape,
                sizes,
                [
                    saved.out.len(),
                    saved.dout.len(),
                    saved.lse.len(),
                    saved.key_ranges_ctx.len(),
                    saved.key_ranges_blk.len(),
                ],
                delta.len(),
                [
                    grads.dq.len(),
                    grads.dk_ctx.len(),
                    grads.dv_ctx.len(),
                    grads.dk_blk.len(),
                    grads.dv_blk.len(),
                ],
            );
            assert_eq!(dout16.len(), saved.dout.len(), "flash_attention_backward: dout16");
            let AttentionSizes { queries, context } = sizes;
            crate::backend::flash::check_flash_shape(queries, &shape)?;
            let AttentionShape {
                heads,
                kv_heads,
                head_dim,
                scale,
            } = shape;
            let [q, k_ctx, v_ctx, k_blk, v_blk] = self.flash_copies(inputs, copies)?;
            let kernel = crate::backend::flash::flash_variant!(
                head_dim,
                [flash_backward_q_d64, flash_backward_q_d128] {
                    q: Self::reinterpret_read(Self::read(q)),
                    k_ctx: Self::reinterpret_read(Self::read(k_ctx)),
                    v_ctx: Self::reinterpret_read(Self::read(v_ctx)),
                    k_blk: Self::reinterpret_read(Self::read(k_blk)),
                    v_blk: Self::reinterpret_read(Self::read(v_blk)),
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
                    k_ctx,
                    v_ctx,
                    saved.key_ranges_ctx,
                    grads.dk_ctx,
                    grads.dv_ctx,
                ),
                (
                    queries,
                    k_blk,
                    v_blk,
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

        /// The five operands of `inputs` rounded to bf16 into `copies`, returned as read views in the order
        /// `[q, k_ctx, v_ctx, k_blk, v_blk]`.
        fn flash_copies<'c>(
            &mut self,
            inputs: AttentionInputs<'_, Self>,
            copies: crate::backend::flash::FlashCopies<'c, Self>,
        ) -> BackendResult<[Src<'c, Self, half::bf16>; 5]> {
            let crate::backend::flash::FlashCopies {
                mut q,
                mut k_ctx,
                mut v_ctx,
                mut k_blk,
                mut v_blk,
            } = copies;
            self.round_to_bf16(inputs.q, q.reborrow())?;
            self.round_to_bf16(inputs.k_ctx, k_ctx.reborrow())?;
            self.round_to_bf16(inputs.v_ctx, v_ctx.reborrow())?;
            self.round_to_bf16(inputs.k_blk, k_blk.reborrow())?;
            self.round_to_bf16(inputs.v_blk, v_blk.reborrow())?;
            Ok([
                q.into_read(),
                k_ctx.into_read(),
                v_ctx.into_read(),
                k_blk.into_read(),
                v_blk.into_read(),
            ])
        }
    };
}
pub(super) use flash_operations;
