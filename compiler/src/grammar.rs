//! The pest parser generated from `grammar.pest`: the one recogniser that both the lowering to an AST
//! (`parse`) and the per-section recovery of syntax errors (`syntax`) drive.

/// The pest parser generated from `grammar.pest` (its `Rule` enum is generated beside it).
#[derive(pest_derive::Parser)]
#[grammar = "grammar.pest"]
pub(crate) struct PipeParser;
