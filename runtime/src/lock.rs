//! Advisory locks that keep two runs from writing the same checkpoint or run directory.
//!
//! ```text
//!  draftpipe run --save DIR --run-dir RUN ──DirLock::acquire──▶ DIR.lock, RUN/draftpipe.lock (held for the run)
//!  a second run with either directory ──▶ LockError::Held { holder pid } before it trains
//! ```
//!
//! A lock is an exclusive `flock` on a small file holding the owner's pid, released by the kernel when the
//! process ends in any way (SIGKILL included), so a crashed run never leaves a stale lock behind. The file of a
//! checkpoint directory sits beside it (`DIR.lock`), because a save renames `DIR` and refuses to replace a
//! directory holding anything but checkpoint files; a run directory holds its lock file inside.
//!
//! A run that ends removes its lock files, while it still holds the lock. A second run that opened the file just
//! before and locks it just after would then hold a lock on a removed file, beside a third run's new one; so a
//! lock counts only when the path still names the file locked, and acquiring retries otherwise.

use std::fs::{self, File, OpenOptions, TryLockError};
use std::io::{self, Read as _, Seek as _, SeekFrom, Write as _};
use std::path::{Path, PathBuf};

/// Why a directory could not be locked.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Another process holds the lock.
    #[error(
        "{} is in use by another draftpipe run ({}); wait for it to finish or choose another directory",
        what_and_path(what, dir),
        holder.map_or_else(|| "its pid is not known yet".to_string(), |pid| format!("pid {pid}"))
    )]
    Held {
        /// What the directory is for (`the checkpoint directory`, `the run directory`).
        what: &'static str,
        /// The directory.
        dir: PathBuf,
        /// The pid written by the holder, when it could be read.
        holder: Option<u32>,
    },
    /// The lock file cannot be created or locked (an unwritable or missing parent, a read-only filesystem).
    #[error("cannot lock {} with {}: {source}", what_and_path(what, dir), file.display())]
    Io {
        /// What the directory is for.
        what: &'static str,
        /// The directory.
        dir: PathBuf,
        /// The lock file.
        file: PathBuf,
        /// The cause.
        source: io::Error,
    },
}

fn what_and_path(what: &str, dir: &Path) -> String {
    format!("{what} {}", dir.display())
}

/// Where a lock file goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockPlace {
    /// Beside the directory, as `DIR.lock` (for a directory that is replaced by renames, like a checkpoint's).
    Beside,
    /// Inside the directory, as `DIR/draftpipe.lock` (created if missing).
    Inside,
}

/// File name of the lock inside a directory ([`LockPlace::Inside`]).
pub const INSIDE_LOCK_FILE: &str = "draftpipe.lock";

/// An exclusive lock on a directory, held until dropped.
#[derive(Debug)]
pub struct DirLock {
    file: File,
    path: PathBuf,
}

impl DirLock {
    /// Locks `dir` for this process without waiting, writing this process's pid into the lock file. Creates the
    /// directory's parent (and, for [`LockPlace::Inside`], the directory) when missing, so an unwritable location
    /// is found here, before any training.
    ///
    /// # Errors
    /// [`LockError::Held`] naming the holder's pid when another process holds it; [`LockError::Io`] when the
    /// lock file cannot be made.
    pub fn acquire(dir: &Path, what: &'static str, place: LockPlace) -> Result<Self, LockError> {
        let path = lock_path(dir, place);
        let io_error = |source| LockError::Io {
            what,
            dir: dir.to_path_buf(),
            file: path.clone(),
            source,
        };
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            fs::create_dir_all(parent).map_err(io_error)?;
        }
        let mut file = loop {
            let mut file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .map_err(io_error)?;
            match file.try_lock() {
                Ok(()) if still_named(&file, &path).map_err(io_error)? => break file,
                // The holder ended and removed the file between the open and the lock: try the new one.
                Ok(()) => continue,
                Err(TryLockError::WouldBlock) => {
                    let mut text = String::new();
                    let holder = file
                        .read_to_string(&mut text)
                        .ok()
                        .and_then(|_| text.trim().parse().ok());
                    return Err(LockError::Held {
                        what,
                        dir: dir.to_path_buf(),
                        holder,
                    });
                }
                Err(TryLockError::Error(source)) => return Err(io_error(source)),
            }
        };
        file.set_len(0)
            .and_then(|()| file.seek(SeekFrom::Start(0)))
            .and_then(|_| writeln!(file, "{}", std::process::id()))
            .and_then(|()| file.flush())
            .map_err(io_error)?;
        Ok(Self { file, path })
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for DirLock {
    fn drop(&mut self) {
        // The file goes while the lock is held (see the module docs); a file already gone is no error. Closing
        // the file releases the lock too; unlocking first makes the release independent of other handles to the
        // same file that this process might hold.
        let _ = fs::remove_file(&self.path);
        let _ = self.file.unlock();
    }
}

/// Whether `path` still names the open `file` (same device and inode).
fn still_named(file: &File, path: &Path) -> io::Result<bool> {
    use std::os::unix::fs::MetadataExt as _;
    let open = file.metadata()?;
    match fs::metadata(path) {
        Ok(named) => Ok(named.dev() == open.dev() && named.ino() == open.ino()),
        Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(error) => Err(error),
    }
}

/// The lock file of `dir` for `place`.
pub fn lock_path(dir: &Path, place: LockPlace) -> PathBuf {
    match place {
        LockPlace::Inside => dir.join(INSIDE_LOCK_FILE),
        LockPlace::Beside => {
            let mut name = dir
                .file_name()
                .map(std::ffi::OsStr::to_os_string)
                .unwrap_or_else(|| ".".into());
            name.push(".lock");
            dir.with_file_name(name)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("draftpipe-lock-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_lock_removes_its_file_when_it_ends() {
        let dir = scratch("removed");
        let checkpoint = dir.join("ckpt");
        let lock =
            DirLock::acquire(&checkpoint, "the checkpoint directory", LockPlace::Beside).unwrap();
        let path = lock.path().to_path_buf();
        assert_eq!(path, dir.join("ckpt.lock"));
        assert!(path.exists());
        let held = DirLock::acquire(&checkpoint, "the checkpoint directory", LockPlace::Beside);
        assert!(
            matches!(held, Err(LockError::Held { holder: Some(pid), .. }) if pid == std::process::id()),
            "{held:?}"
        );
        drop(lock);
        assert!(!path.exists(), "the lock file outlived its run");
        let run_dir = dir.join("run");
        drop(DirLock::acquire(&run_dir, "the run directory", LockPlace::Inside).unwrap());
        assert!(run_dir.is_dir() && !run_dir.join(INSIDE_LOCK_FILE).exists());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_lock_on_a_file_its_holder_removed_does_not_count() {
        // A second run opens the file, the first ends (removing it), the second locks what it opened: a removed
        // file, which must not count as the lock, or a third run would lock a new file beside it.
        let dir = scratch("race");
        let checkpoint = dir.join("ckpt");
        let first =
            DirLock::acquire(&checkpoint, "the checkpoint directory", LockPlace::Beside).unwrap();
        let path = first.path().to_path_buf();
        let racer = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        drop(first);
        racer.try_lock().unwrap();
        assert!(!still_named(&racer, &path).unwrap());
        let second =
            DirLock::acquire(&checkpoint, "the checkpoint directory", LockPlace::Beside).unwrap();
        assert!(still_named(&second.file, &path).unwrap());
        assert!(
            DirLock::acquire(&checkpoint, "the checkpoint directory", LockPlace::Beside).is_err()
        );
        drop(second);
        fs::remove_dir_all(&dir).unwrap();
    }
}
