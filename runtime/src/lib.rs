//! The draftpipe runtime: executes a compiled [`Plan`](draftpipe_compiler::plan::Plan).
//!
//! ```text
//!  sources (producers) ──▶ HS queue (lock-free, bucketed) ──▶ drafter workers (cpu │ cuda)
//!             └──────────── telemetry, trace, diagnosis, checkpoints ──────────┘
//! ```

pub mod batch;
pub mod cpu;
pub mod cuda;
pub mod params;
