//! The acceptance child's output (stdout and stderr, one pipe) on its way to `step-N.log`, capped: the first
//! [`LOG_HEAD_BYTES`] go to the file as they come, after that only the newest [`LOG_TAIL_BYTES`] are kept (in
//! memory) and written at the end behind a line saying how much was left out. A child that prints 300 MB costs
//! the run a bounded log and a bounded buffer, and the log still ends with what the child printed last.
//!
//! ```text
//!  child stdout+stderr ──pipe (non-blocking)──▶ CappedLog::drain (each watcher poll) ──▶ step-N.log
//!                                                             └─ over the cap: ring of the newest bytes ──finish──┘
//! ```

use std::fs::File;
use std::io::{ErrorKind, Read, Write as _};
use std::os::fd::AsRawFd as _;
use std::path::Path;
use std::time::{Duration, Instant};

/// The bytes of a check's output written to its log as they come.
pub const LOG_HEAD_BYTES: usize = 1 << 20;
/// The newest bytes of a longer output that the log ends with.
pub const LOG_TAIL_BYTES: usize = 256 << 10;
/// How long the output left in the pipe after the child's exit is read at most (a process that escaped the
/// group may keep writing).
const FINAL_DRAIN: Duration = Duration::from_secs(1);

/// The read end of the child's output pipe and the log it goes to.
pub(super) struct CappedLog {
    pipe: std::io::PipeReader,
    file: File,
    written: usize,
    /// The newest bytes past the head: the last [`LOG_TAIL_BYTES`] of it are kept (it grows to twice that
    /// before the older half is dropped, so each byte is copied a bounded number of times).
    tail: Vec<u8>,
    /// The bytes past the head, kept or not.
    past_head: u64,
    closed: bool,
}

impl CappedLog {
    /// The log `path` (created, replacing an older one) fed from `pipe`, which is made non-blocking.
    pub(super) fn create(path: &Path, pipe: std::io::PipeReader) -> std::io::Result<Self> {
        // SAFETY: F_GETFL/F_SETFL on a descriptor this process owns change only its own flags.
        unsafe {
            let flags = libc::fcntl(pipe.as_raw_fd(), libc::F_GETFL);
            if flags < 0
                || libc::fcntl(pipe.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) < 0
            {
                return Err(std::io::Error::last_os_error());
            }
        }
        Ok(Self {
            pipe,
            file: File::create(path)?,
            written: 0,
            tail: Vec::new(),
            past_head: 0,
            closed: false,
        })
    }

    /// Waits at most `timeout` for output, then takes all that is in the pipe.
    pub(super) fn wait_and_drain(&mut self, timeout: Duration) -> std::io::Result<()> {
        if self.closed {
            std::thread::sleep(timeout);
            return Ok(());
        }
        let mut ready = libc::pollfd {
            fd: self.pipe.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let millis = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
        // SAFETY: one valid pollfd for a descriptor this process owns; an error (EINTR) only ends the wait early.
        unsafe {
            libc::poll(&raw mut ready, 1, millis);
        }
        // Bounded by the same period: a child that prints without pause still lets the watcher look at it.
        self.drain(Instant::now() + timeout)
    }

    /// After the child (and its group) ended: the output still in the pipe (for at most a second), then the kept
    /// tail with a line saying what was left out.
    pub(super) fn finish(mut self) -> std::io::Result<()> {
        self.drain(Instant::now() + FINAL_DRAIN)?;
        let kept = &self.tail[self.tail.len().saturating_sub(LOG_TAIL_BYTES)..];
        let left_out = self.past_head - kept.len() as u64;
        if left_out > 0 {
            writeln!(
                self.file,
                "\n[draftpipe: {left_out} bytes of this output left out here (the log keeps the first \
                 {LOG_HEAD_BYTES} and the last {})]",
                kept.len()
            )?;
        }
        self.file.write_all(kept)?;
        self.file.flush()
    }

    /// Reads what the pipe holds now (until it would block, ends, or `deadline` passes).
    fn drain(&mut self, deadline: Instant) -> std::io::Result<()> {
        let mut buffer = vec![0u8; 64 << 10];
        while !self.closed && Instant::now() < deadline {
            match self.pipe.read(&mut buffer) {
                Ok(0) => self.closed = true,
                Ok(read) => self.keep(&buffer[..read])?,
                Err(error) if error.kind() == ErrorKind::WouldBlock => break,
                Err(error) if error.kind() == ErrorKind::Interrupted => {}
                Err(error) => return Err(error),
            }
        }
        Ok(())
    }

    fn keep(&mut self, mut bytes: &[u8]) -> std::io::Result<()> {
        let to_file = bytes.len().min(LOG_HEAD_BYTES - self.written);
        if to_file > 0 {
            self.file.write_all(&bytes[..to_file])?;
            self.written += to_file;
            bytes = &bytes[to_file..];
        }
        self.past_head += bytes.len() as u64;
        if self.tail.len() + bytes.len() > 2 * LOG_TAIL_BYTES {
            let keep_from = self.tail.len().saturating_sub(LOG_TAIL_BYTES);
            self.tail.copy_within(keep_from.., 0);
            self.tail.truncate(self.tail.len() - keep_from);
        }
        self.tail.extend_from_slice(bytes);
        Ok(())
    }
}
