//! The `.pipe` language and its compiler.
//!
//! ```text
//!  .pipe text ──pest──▶ AST (spans) ──check──▶ Plan ──▶ runtime
//!  ^^^^^^^^^^^^^^^^^^^ this crate ^^^^^^^^^^^^^^^^^^^^^
//! ```
//!
//! [`parse`] turns text into a spanned [`ast`]; the checks turn the AST into a [`plan::Plan`], plain data with
//! everything the runtime needs, or into [`Diagnostics`] that list every error of the file. [`cost`] holds the
//! cost and memory model the plan's figures come from, and [`summary`] renders a plan for people.
//!
//! # Examples
//!
//! ```
//! let source = r#"
//! pipeline "tiny"
//! target t on cpu {
//!     hidden = 64
//!     tap_layers = [0, 1]
//!     vocab = 512
//!     batch_tokens = 256
//!     source = synthetic(seed = 1, lengths = 8..128)
//! }
//! queue q from t to d { capacity = 4  buckets = [64, 128] }
//! drafter d on cpu { model = mlp(hidden = 32, blocks = 1, intermediate = 64, heads = 2) }
//! "#;
//! let plan = draftpipe_compiler::compile_source("tiny.pipe", source).unwrap();
//! assert_eq!(plan.model.spec.din, 128);
//! assert_eq!(plan.buckets[0].sequences, 4);
//! ```

pub mod ast;
mod check;
pub mod cost;
pub mod diagnostic;
mod parse;
pub mod plan;
pub mod span;
pub mod summary;
mod syntax;
pub mod workspace;

use std::path::{Path, PathBuf};

pub use check::{
    DEFAULT_CHUNK_TOKENS, DEFAULT_EVERY_MS, DEFAULT_HEAD_DECAY, DEFAULT_MIN_READY, MAX_DEVICES,
    MAX_PARAMETERS, adamw_defaults, device_name,
};
pub use diagnostic::{Diagnostic, Diagnostics};
pub use parse::parse;
pub use plan::Plan;

/// Why a file could not be compiled.
#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    /// The file could not be read.
    #[error("cannot read `{}`: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The file has errors; the diagnostics list all of them.
    #[error("{0}")]
    Invalid(Diagnostics),
}

/// Parses and checks `source`, returning its plan or all of its errors. `file_name` appears in diagnostics.
pub fn compile_source(file_name: &str, source: &str) -> Result<Plan, Diagnostics> {
    let file = parse(file_name, source)?;
    check::check(&file).map_err(|mut errors| {
        if errors.is_empty() {
            // A check gave up without recording why: a bug, but the user still gets an error, not silence.
            errors.push(
                Diagnostic::error(
                    file.span,
                    "internal error: the checks rejected this file without a reason",
                )
                .help("please report this file to the draftpipe developers"),
            );
        }
        let mut diagnostics = Diagnostics::new(file_name, source);
        diagnostics.extend(errors);
        diagnostics
    })
}

/// Reads and compiles a `.pipe` file.
pub fn compile_file(path: &Path) -> Result<Plan, CompileError> {
    let source = std::fs::read_to_string(path).map_err(|source| CompileError::Io {
        path: path.to_owned(),
        source,
    })?;
    compile_source(&path.display().to_string(), &source).map_err(CompileError::Invalid)
}
