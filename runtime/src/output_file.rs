//! The one rule every single-file output goes through (`draftpipe vocab --out`, a run's `telemetry.trace`),
//! the file-sized counterpart of the checkpoint directory's rule (`checkpoint::check_save_target`):
//!
//! ```text
//!  command start ──check_output(path, kind, inputs, force)──▶ refused before any work, or
//!  command end   ──write_output(path, bytes)──▶ PATH.draftpipe-tmp (0644 under the umask) ──rename──▶ PATH
//! ```
//!
//! A path is written only when it is a new path or a regular file, never one of the files the command reads
//! (compared by device and inode, so a hard link or a symbolic link to an input is refused too), and, unless
//! `force`, only when the file already there is the command's own kind of output (or empty). A symbolic link
//! to a regular file is written through: the file it names is replaced and the link stays.

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Read as _};
use std::os::unix::fs::{FileTypeExt as _, MetadataExt as _};
use std::path::{Path, PathBuf};

use draftpipe_compiler::plan::{Plan, SourceSpec, WeightsSpec};

use crate::source::safetensors::expand_pattern;
use crate::tensor_file::TensorFile;

/// What a single-file output holds, which decides what an existing file at its path must be to be replaced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputKind {
    /// `draftpipe vocab --out`: a safetensors file of exactly `d2t` and `t2d`.
    VocabMap,
    /// A run's Chrome trace (`telemetry.trace`): JSON that opens with `{"displayTimeUnit":`.
    Trace,
    /// `draftpipe report --out`: a page that opens with [`REPORT_PREFIX`].
    Report,
}

/// The first bytes of every trace this build writes.
pub const TRACE_PREFIX: &[u8] = b"{\"displayTimeUnit\":";

/// The first bytes of every report page this build writes.
pub const REPORT_PREFIX: &[u8] = b"<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>draftpipe report";

impl OutputKind {
    /// The output in words, for errors.
    pub fn what(self) -> &'static str {
        match self {
            Self::VocabMap => "a draft vocabulary map (d2t, t2d)",
            Self::Trace => "a trace",
            Self::Report => "a draftpipe report",
        }
    }

    /// Whether the regular file at `path` is this kind of output, so replacing it loses nothing the user
    /// did not ask for again. An empty file holds nothing to lose.
    fn recognises(self, path: &Path) -> bool {
        if fs::metadata(path).is_ok_and(|m| m.len() == 0) {
            return true;
        }
        match self {
            Self::VocabMap => TensorFile::open(path).is_ok_and(|file| {
                let names = file.names();
                names
                    == [
                        crate::model::eagle3::vocab::D2T,
                        crate::model::eagle3::vocab::T2D,
                    ]
            }),
            Self::Trace => starts_with(path, TRACE_PREFIX),
            Self::Report => starts_with(path, REPORT_PREFIX),
        }
    }
}

/// Whether the file at `path` opens with `prefix`.
fn starts_with(path: &Path, prefix: &[u8]) -> bool {
    let mut head = vec![0u8; prefix.len()];
    File::open(path)
        .and_then(|mut f| f.read_exact(&mut head))
        .is_ok_and(|()| head == prefix)
}

/// Why an output path is refused or could not be written.
#[derive(Debug, thiserror::Error)]
pub enum OutputError {
    /// The path is something other than a regular file or a new path (a directory, a device, a FIFO, a
    /// socket, a dangling symbolic link).
    #[error(
        "{}: is {found}; the output must be a new path or a regular file (refusing to replace it)",
        path.display()
    )]
    NotRegular {
        /// The output path.
        path: PathBuf,
        /// What is there, in words.
        found: &'static str,
    },
    /// The path is one of the files the command reads.
    #[error(
        "refusing to write {}: it is {}, which this command reads (an output never replaces an input)",
        path.display(),
        input.display()
    )]
    IsInput {
        /// The output path.
        path: PathBuf,
        /// The input it names.
        input: PathBuf,
    },
    /// A regular file of another kind is there and `--force` was not given.
    #[error(
        "{}: exists and is not {}; refusing to replace it (remove it, pick another path, or pass --force)",
        path.display(),
        kind.what()
    )]
    OtherKind {
        /// The output path.
        path: PathBuf,
        /// The output's kind.
        kind: OutputKind,
    },
    /// Creating, writing or renaming the file failed.
    #[error("cannot {action} {}: {source}", path.display())]
    Io {
        /// What was being done.
        action: &'static str,
        /// The file concerned.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
}

/// Fails unless `path` may receive `kind`: a new path (its parent is created when missing, so an unwritable
/// place is found now) or a regular file that is none of `inputs` and, unless `force`, of `kind` already.
/// `inputs` may hold directories: each file directly inside one counts as read.
///
/// # Errors
/// [`OutputError`] naming the path and what is there.
pub fn check_output(
    path: &Path,
    kind: OutputKind,
    inputs: &[PathBuf],
    force: bool,
) -> Result<(), OutputError> {
    let Some(existing) = existing_target(path)? else {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            fs::create_dir_all(parent).map_err(io_error("create the directory of", path))?;
        }
        // Created and removed again: proves the directory writable before the work, not after it.
        OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(io_error("create", path))?;
        return fs::remove_file(path).map_err(io_error("remove the probe", path));
    };
    if let Some(input) = input_at(&existing, inputs) {
        return Err(OutputError::IsInput {
            path: path.to_path_buf(),
            input,
        });
    }
    if !force && !kind.recognises(path) {
        return Err(OutputError::OtherKind {
            path: path.to_path_buf(),
            kind,
        });
    }
    Ok(())
}

/// Writes the file at `path` by `write`: into a new sibling file, fsynced, then renamed over `path`, so a crash
/// leaves the old file or the new one, never half of one. A new file gets the usual mode (0666 less the
/// umask; its missing parent directories are created); a replaced one keeps its permissions. What is at `path`
/// is checked again first (a new path or a regular file; [`check_output`] decided the rest when the command
/// started).
///
/// # Errors
/// [`OutputError`] naming the file; the temporary file is removed on failure.
pub fn write_output(
    path: &Path,
    write: impl FnOnce(&mut BufWriter<File>) -> io::Result<()>,
) -> Result<(), OutputError> {
    let existing = existing_target(path)?;
    // Written through a symbolic link: the file it names is replaced, the link stays.
    let destination = match &existing {
        Some(_) => fs::canonicalize(path).map_err(io_error("resolve", path))?,
        None => {
            if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
                fs::create_dir_all(parent).map_err(io_error("create the directory of", path))?;
            }
            path.to_path_buf()
        }
    };
    let mut name = destination.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".draftpipe-tmp-{}", std::process::id()));
    let staging = destination.with_file_name(name);
    let written = (|| {
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&staging)
            .map_err(io_error("create", &staging))?;
        if let Some(metadata) = &existing {
            fs::set_permissions(&staging, metadata.permissions())
                .map_err(io_error("set the permissions of", &staging))?;
        }
        let mut out = BufWriter::new(file);
        write(&mut out)
            .and_then(|()| out.into_inner().map_err(io::IntoInnerError::into_error))
            .and_then(|file| file.sync_all())
            .map_err(io_error("write", &staging))?;
        fs::rename(&staging, &destination).map_err(io_error("rename into place", &destination))
    })();
    if written.is_err() {
        let _ = fs::remove_file(&staging);
    }
    written
}

fn io_error(action: &'static str, path: &Path) -> impl FnOnce(io::Error) -> OutputError + use<> {
    let path = path.to_path_buf();
    move |source| OutputError::Io {
        action,
        path,
        source,
    }
}

/// The metadata of the regular file at `path` (through symbolic links), `None` for a new path, an error for
/// anything else there.
fn existing_target(path: &Path) -> Result<Option<fs::Metadata>, OutputError> {
    let link = match fs::symlink_metadata(path) {
        Ok(link) => link,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(io_error("inspect", path)(source)),
    };
    let not_regular = |found| OutputError::NotRegular {
        path: path.to_path_buf(),
        found,
    };
    let metadata = match fs::metadata(path) {
        Ok(metadata) => metadata,
        Err(_) if link.file_type().is_symlink() => {
            return Err(not_regular("a symbolic link to nothing"));
        }
        Err(source) => return Err(io_error("inspect", path)(source)),
    };
    let file_type = metadata.file_type();
    let found = if file_type.is_file() {
        return Ok(Some(metadata));
    } else if file_type.is_dir() {
        "a directory"
    } else if file_type.is_char_device() {
        "a character device"
    } else if file_type.is_block_device() {
        "a block device"
    } else if file_type.is_fifo() {
        "a FIFO"
    } else if file_type.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    };
    Err(not_regular(found))
}

/// The input (or the file inside an input directory) that is the same file as `output`, by device and inode.
fn input_at(output: &fs::Metadata, inputs: &[PathBuf]) -> Option<PathBuf> {
    let same = |path: &Path| {
        fs::metadata(path).is_ok_and(|m| m.dev() == output.dev() && m.ino() == output.ino())
    };
    for input in inputs {
        if same(input) {
            return Some(input.clone());
        }
        if input.is_dir()
            && let Ok(entries) = fs::read_dir(input)
            && let Some(inside) = entries.flatten().map(|e| e.path()).find(|p| same(p))
        {
            return Some(inside);
        }
    }
    None
}

/// The files a run (or a count) of `plan` reads besides its `.pipe` file: the source's files, the target's
/// weights and the drafter's `vocab_map`. A pattern that matches nothing adds nothing (reading it reports that).
pub fn plan_inputs(plan: &Plan) -> Vec<PathBuf> {
    let mut inputs = Vec::new();
    if let SourceSpec::Safetensors { pattern, .. } = &plan.target.source {
        inputs.extend(expand_pattern(pattern).unwrap_or_default());
    }
    if let Some(WeightsSpec::Safetensors { path }) = &plan.target.weights {
        inputs.extend(expand_pattern(path).unwrap_or_else(|_| vec![PathBuf::from(path)]));
    }
    inputs.extend(plan.drafter.vocab_map.iter().map(PathBuf::from));
    inputs
}
