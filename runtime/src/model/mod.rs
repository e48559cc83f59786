//! Drafter models written once over the [`Backend`](crate::backend::Backend) trait: each family's forward,
//! loss, backward and update in its own folder, the [`Family`](family::Family) trait the drafter calls them
//! through, the one [`registry`] that names them, and what they share (the step's types, the update).
//!
//! ```text
//!  Plan (model, buckets, loss, precision) ──registry::build──▶ Box<dyn Family<B>>: mlp::Mlp<B> │ dflash::Dflash<B>
//!                                                               │                   │ eagle3::Eagle3<B>
//!                                                               └──calls──▶ B: CpuBackend │ CudaBackend
//! ```

pub mod dflash;
pub mod eagle3;
pub mod family;
pub mod layers;
pub mod mlp;
pub mod registry;
pub mod serving;
pub mod step;
pub mod update;

pub use family::{BlockMetrics, BuildError, Family};
