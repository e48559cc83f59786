//! Reading a file another process wrote (the acceptance child's figures and output): the one way the runtime
//! reads such a file, bounded in size and in time.
//!
//! ```text
//!  acceptance watcher ──read_limited(step-N.json, 1 MiB)──▶ bytes or ForeignFileError (FIFO, device, too large)
//!                     └─read_tail(step-N.log, 16 KiB)─────▶ the file's last bytes (a seek from the end)
//! ```
//!
//! The other process chooses what lies at the path: a FIFO (opening it blocks until a writer comes, so the run
//! would wait forever), a link to `/dev/zero` (a read that never ends), a 300 MB file. The path's type is
//! checked with `stat` before it is opened, the open does not block (`O_NONBLOCK`), the type is checked again
//! on the open file (the path may have been replaced in between), and no read goes past its limit, so every
//! read is a bounded amount of regular-file data.

use std::fs::File;
use std::io::{Read as _, Seek as _, SeekFrom};
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

/// Why a file another process wrote was not read.
#[derive(Debug, thiserror::Error)]
pub enum ForeignFileError {
    /// It could not be opened or read (missing, unreadable).
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// It is not a regular file (a FIFO, a device, a directory, a socket): reading it could block or never end.
    #[error("cannot read {}: not a regular file ({kind})", path.display())]
    NotAFile {
        /// The path.
        path: PathBuf,
        /// What it is instead, in words.
        kind: &'static str,
    },
    /// It is larger than what the reader has reason to read.
    #[error("cannot read {}: {bytes} bytes or more, over the limit of {limit} bytes", path.display())]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size (at least: a file that grows while read is cut at the limit).
        bytes: u64,
        /// The limit.
        limit: u64,
    },
}

/// The whole of the regular file at `path`, refused when it holds more than `limit` bytes.
///
/// # Errors
/// [`ForeignFileError`]: not there or unreadable, not a regular file, over `limit`.
pub fn read_limited(path: &Path, limit: u64) -> Result<Vec<u8>, ForeignFileError> {
    let (file, len) = open_regular(path)?;
    let too_large = |bytes| ForeignFileError::TooLarge {
        path: path.to_owned(),
        bytes,
        limit,
    };
    if len > limit {
        return Err(too_large(len));
    }
    let mut bytes = Vec::new();
    file.take(limit.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(|source| io_error(path, source))?;
    if bytes.len() as u64 > limit {
        return Err(too_large(bytes.len() as u64));
    }
    Ok(bytes)
}

/// The last `at_most` bytes of the regular file at `path` (all of it when it is shorter), read after a seek
/// from its end: the cost does not depend on the file's size.
///
/// # Errors
/// [`ForeignFileError`]: not there or unreadable, not a regular file.
pub fn read_tail(path: &Path, at_most: u64) -> Result<Vec<u8>, ForeignFileError> {
    let (mut file, len) = open_regular(path)?;
    file.seek(SeekFrom::Start(len.saturating_sub(at_most)))
        .map_err(|source| io_error(path, source))?;
    let mut bytes = Vec::new();
    file.take(at_most)
        .read_to_end(&mut bytes)
        .map_err(|source| io_error(path, source))?;
    Ok(bytes)
}

/// The regular file at `path`, open for reading, and its length; anything else is refused without blocking.
fn open_regular(path: &Path) -> Result<(File, u64), ForeignFileError> {
    let refuse = |metadata: &std::fs::Metadata| {
        (!metadata.is_file()).then(|| ForeignFileError::NotAFile {
            path: path.to_owned(),
            kind: draftpipe_compiler::file_kind(metadata.file_type()),
        })
    };
    let metadata = std::fs::metadata(path).map_err(|source| io_error(path, source))?;
    if let Some(refused) = refuse(&metadata) {
        // Not opened at all: opening some devices has effects of its own.
        return Err(refused);
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|source| io_error(path, source))?;
    let metadata = file.metadata().map_err(|source| io_error(path, source))?;
    match refuse(&metadata) {
        Some(refused) => Err(refused),
        None => Ok((file, metadata.len())),
    }
}

fn io_error(path: &Path, source: std::io::Error) -> ForeignFileError {
    ForeignFileError::Io {
        path: path.to_owned(),
        source,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("draftpipe-foreign-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_fifo_and_a_device_are_refused_without_blocking() {
        let dir = scratch("fifo");
        let fifo = dir.join("figures.json");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        assert!(made.unwrap().success());
        let error = read_limited(&fifo, 1 << 20).unwrap_err().to_string();
        assert!(error.contains("not a regular file (a FIFO)"), "{error}");
        let link = dir.join("zero.json");
        std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
        let error = read_tail(&link, 100).unwrap_err().to_string();
        assert!(error.contains("(a character device)"), "{error}");
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn reads_stop_at_their_limit_and_the_tail_is_the_end() {
        let dir = scratch("limits");
        let file = dir.join("log");
        std::fs::write(&file, b"0123456789").unwrap();
        assert_eq!(read_limited(&file, 10).unwrap(), b"0123456789");
        let error = read_limited(&file, 9).unwrap_err().to_string();
        assert!(
            error.contains("10 bytes or more, over the limit of 9"),
            "{error}"
        );
        assert_eq!(read_tail(&file, 3).unwrap(), b"789");
        assert_eq!(read_tail(&file, 30).unwrap(), b"0123456789");
        let _ = std::fs::remove_dir_all(dir);
    }
}
