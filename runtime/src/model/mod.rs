//! Drafter models written once over the [`Backend`](crate::backend::Backend) trait: each family's forward,
//! loss, backward and update, and the buffers the compiler's workspace layout describes.
//!
//! ```text
//!  Plan (model, buckets, loss, precision) ──▶ model::mlp::Mlp<B>       ──calls──▶ B: CpuBackend │ CudaBackend
//!                                        └──▶ model::dflash::Dflash<B> ──┘
//! ```

pub mod dflash;
pub mod mlp;
