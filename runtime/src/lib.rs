//! The draftpipe runtime: executes a compiled [`Plan`](draftpipe_compiler::plan::Plan).
//!
//! ```text
//!  sources (producers) ──▶ HS queue (lock-free, bucketed) ──▶ drafter workers (cpu │ cuda)
//!             └──────────── telemetry, trace, diagnosis, checkpoints ──────────┘
//! ```

pub mod allreduce;
pub mod batch;
pub mod checkpoint;
pub mod cpu;
pub mod cuda;
pub mod lock;
pub mod params;
pub mod pipeline;
pub mod queue;
pub mod simulate;
pub mod source;
pub mod telemetry;
pub mod tensor_file;
