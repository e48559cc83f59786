//! Files the commands read besides `.pipe` files (which the compiler guards itself): refused before they are
//! opened when they are not regular files (a FIFO would block, `/dev/zero` never ends) or are larger than the
//! command has reason to read.

use std::path::Path;

use anyhow::bail;

/// The largest `summary.json` `diagnose` reads (64 MiB; the summary's series are thinned to a bounded number of
/// points, so a real one is a few hundred KiB even after a week of training).
pub const MAX_SUMMARY_BYTES: u64 = 64 << 20;

/// Fails unless `path` is a regular file of at most `limit` bytes. Checked with `stat`, which neither blocks
/// nor reads.
pub fn require_regular_file(path: &Path, what: &str, limit: u64) -> anyhow::Result<()> {
    let metadata = match std::fs::metadata(path) {
        Ok(metadata) => metadata,
        // A missing file is left to the reader, whose error says what it looked for.
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(error) => {
            return Err(
                anyhow::Error::new(error).context(format!("cannot read {what} {}", path.display()))
            );
        }
    };
    if !metadata.is_file() {
        bail!(
            "cannot read {what} {}: not a regular file ({})",
            path.display(),
            kind(&metadata)
        );
    }
    if metadata.len() > limit {
        bail!(
            "cannot read {what} {}: {} bytes, over the limit of {limit} bytes",
            path.display(),
            metadata.len()
        );
    }
    Ok(())
}

fn kind(metadata: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt as _;
    let file_type = metadata.file_type();
    if file_type.is_dir() {
        "a directory"
    } else if file_type.is_fifo() {
        "a FIFO"
    } else if file_type.is_char_device() || file_type.is_block_device() {
        "a device"
    } else if file_type.is_socket() {
        "a socket"
    } else {
        "not a plain file"
    }
}
