//! The draftpipe runtime: executes a compiled [`Plan`](draftpipe_compiler::plan::Plan).
//!
//! ```text
//!  sources (producers) ──▶ HS queue (lock-free, bucketed) ──▶ drafter workers (cpu │ cuda)
//!             └──────────── telemetry, trace, diagnosis, checkpoints ──────────┘
//! ```

pub mod allreduce;
pub mod batch;
pub mod queue;
pub mod cpu;
pub mod params;
pub mod checkpoint;
pub mod source;
pub mod tensor_file;
pub mod telemetry;
pub mod pipeline;
