//! The `.pipe` language and its compiler.
//!
//! ```text
//!  .pipe text ──pest──▶ AST (spans) ──check──▶ Plan ──▶ runtime
//!  ^^^^^^^^^^^^^^^^^^^ this crate ^^^^^^^^^^^^^^^^^^^^^
//! ```
//!
//! The [`plan::Plan`] is plain data: everything the runtime needs to run a pipeline, and nothing it has to
//! re-derive from the source text.

pub mod plan;
