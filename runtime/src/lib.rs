//! The draftpipe runtime: executes a compiled [`Plan`](draftpipe_compiler::plan::Plan).
//!
//! ```text
//!  source (synthetic │ safetensors │ stream) ──▶ queue (lock-free, bucketed) ──▶ drafter workers (pipeline::worker)
//!             └──────────── telemetry, trace, diagnosis, checkpoints ──────────┘        │
//!        drafter::Drafter ──▶ model::Family (model::registry: mlp │ dflash │ eagle3) ──▶ backend: cpu │ cuda
//!
//!  beside a run: acceptance (draft-and-verify checks), eval, export_check, report, simulate
//! ```

pub mod acceptance;
pub mod allreduce;
pub mod backend;
pub mod batch;
pub mod checkpoint;
pub mod drafter;
pub mod eval;
pub mod export_check;
pub mod figures;
pub mod foreign_file;
pub mod fp8;
pub mod lock;
pub mod log;
pub mod model;
pub mod output_file;
pub mod params;
pub mod pipeline;
pub mod queue;
pub mod report;
pub mod simulate;
pub mod source;
pub mod target_depth;
pub mod target_weights;
pub mod telemetry;
pub mod tensor_file;
