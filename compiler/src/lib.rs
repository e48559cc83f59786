//! The `.pipe` language and its compiler.
//!
//! ```text
//!  .pipe text ──pest──▶ AST (spans) ──check──▶ Plan ──▶ runtime
//!  ^^^^^^^^^^^^^^^^^^^ this crate ^^^^^^^^^^^^^^^^^^^^^
//! ```
//!
//! [`parse`] turns text into a spanned [`ast`]; the checks turn the AST into a [`plan::Plan`], plain data with
//! everything the runtime needs, or into [`Diagnostics`] that list every error of the file. Each drafter family
//! is one module under [`family`] (spec, argument checks, cost, workspace, tensor table), registered once;
//! [`cost`] puts the families' figures together into the plan's cost and memory, and [`summary`] renders a
//! plan for people.
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
//! assert_eq!(plan.model.spec.as_mlp().unwrap().din, 128);
//! assert_eq!(plan.buckets[0].sequences, 4);
//! ```

pub mod ast;
mod check;
pub mod cost;
pub mod diagnostic;
pub mod family;
mod grammar;
mod parse;
pub mod plan;
pub mod span;
pub mod summary;
mod syntax;
pub mod workspace;

use std::path::{Path, PathBuf};

pub use check::{
    DEFAULT_CHUNK_TOKENS, DEFAULT_EVERY_MS, DEFAULT_HEAD_DECAY, DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_MIN_READY, DEFAULT_STEP_DECAY, DEFAULT_TIMEOUT_MS, MAX_DEVICES, MAX_PARAMETERS,
    adamw_defaults, closest, device_name,
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
    /// The path is not a regular file (a directory, a FIFO, a device such as `/dev/zero`): reading it could
    /// block or never end, so it is refused before it is opened.
    #[error("cannot read `{}`: not a regular file ({kind})", path.display())]
    NotAFile {
        /// The path.
        path: PathBuf,
        /// What it is instead, in words.
        kind: &'static str,
    },
    /// The file is larger than any pipeline description has reason to be.
    #[error(
        "cannot read `{}`: {bytes} bytes, over the limit of {limit} bytes for a `.pipe` file",
        path.display()
    )]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size (at least; a file that grows while read is cut at the limit).
        bytes: u64,
        /// [`MAX_SOURCE_BYTES`].
        limit: u64,
    },
    /// The file has errors; the diagnostics list all of them.
    #[error("{0}")]
    Invalid(Diagnostics),
}

/// The largest `.pipe` file [`compile_file`] reads (1 MiB; the shipped pipelines are under 2 KiB). Checking
/// and rendering cost time and memory linear in the file, so the limit bounds both.
pub const MAX_SOURCE_BYTES: u64 = 1 << 20;

/// What a path that is not a regular file is, in words (the runtime's reads of other processes' files say it
/// the same way).
pub fn file_kind(file_type: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt as _;
    if file_type.is_dir() {
        "a directory"
    } else if file_type.is_fifo() {
        "a FIFO"
    } else if file_type.is_char_device() {
        "a character device"
    } else if file_type.is_block_device() {
        "a block device"
    } else if file_type.is_socket() {
        "a socket"
    } else {
        "not a plain file"
    }
}

/// Reads a regular file of at most `limit` bytes into a string. The type is checked before opening (opening a
/// FIFO blocks until a writer comes) and the read stops at the limit even if the file grows meanwhile.
fn read_source(path: &Path, limit: u64) -> Result<String, CompileError> {
    use std::io::Read as _;
    let io_error = |source| CompileError::Io {
        path: path.to_owned(),
        source,
    };
    let metadata = std::fs::metadata(path).map_err(io_error)?;
    if !metadata.is_file() {
        return Err(CompileError::NotAFile {
            path: path.to_owned(),
            kind: file_kind(metadata.file_type()),
        });
    }
    let too_large = |bytes| CompileError::TooLarge {
        path: path.to_owned(),
        bytes,
        limit,
    };
    if metadata.len() > limit {
        return Err(too_large(metadata.len()));
    }
    let mut source = String::new();
    std::fs::File::open(path)
        .map_err(io_error)?
        .take(limit + 1)
        .read_to_string(&mut source)
        .map_err(io_error)?;
    if source.len() as u64 > limit {
        return Err(too_large(source.len() as u64));
    }
    Ok(source)
}

/// Parses and checks `source`, returning its plan or all of its errors. `file_name` appears in diagnostics.
pub fn compile_source(file_name: &str, source: &str) -> Result<Plan, Diagnostics> {
    compile_source_with_warnings(file_name, source).map(|(plan, _)| plan)
}

/// [`compile_source`] that also returns the plan's warnings (empty when there are none): what the plan will
/// do that the file's author may not expect, such as a CUDA drafter's attention falling back to the f32
/// kernels.
pub fn compile_source_with_warnings(
    file_name: &str,
    source: &str,
) -> Result<(Plan, Diagnostics), Diagnostics> {
    let file = parse(file_name, source)?;
    let collect = |items: Vec<Diagnostic>| {
        let mut diagnostics = Diagnostics::new(file_name, source);
        diagnostics.extend(items);
        diagnostics
    };
    check::check(&file)
        .map(|(plan, warnings)| (plan, collect(warnings)))
        .map_err(|mut errors| {
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
            collect(errors)
        })
}

/// Reads and compiles a `.pipe` file: a regular file of at most [`MAX_SOURCE_BYTES`].
pub fn compile_file(path: &Path) -> Result<Plan, CompileError> {
    compile_file_with_warnings(path).map(|(plan, _)| plan)
}

/// [`compile_file`] with the plan's warnings ([`compile_source_with_warnings`]).
pub fn compile_file_with_warnings(path: &Path) -> Result<(Plan, Diagnostics), CompileError> {
    let source = read_source(path, MAX_SOURCE_BYTES)?;
    compile_source_with_warnings(&path.display().to_string(), &source)
        .map_err(CompileError::Invalid)
}
