//! TensorBoard event files, written natively by the telemetry thread at each status line
//! (`telemetry { tensorboard = "DIR" }`): W&B (`wandb sync --sync-tensorboard`) and MLflow read the same files.
//!
//! ```text
//!  Reporter::report ─▶ StatusLine ─▶ tags::scalars ─▶ Event{wall_time, step, Summary} ─▶ record::frame ─▶ DIR/events.out.tfevents.…
//! ```
//!
//! Each process opens its own file (`events.out.tfevents.<secs>.<host>.<pid>.<n>`, TensorBoard's own naming), so
//! a resumed run adds a file beside the earlier ones, its steps continuing from the checkpoint's, and two
//! processes never share one. One telemetry thread writes it: the drafters' figures reach it through the status
//! line, never from their own threads.

mod event;
mod record;
mod tags;

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use prost::Message;

pub use event::{Event, FILE_VERSION, Summary, SummaryValue, What};
pub use record::{RecordError, frame, masked_crc32c, read_records};
pub use tags::{TAGS, Tag, scalars};

use super::TelemetryError;
use super::status::StatusLine;

/// Files opened by this process so far: the last part of the name, as TensorBoard's writers number theirs.
static FILES_OPENED: AtomicU64 = AtomicU64::new(0);

/// One event file being written.
pub struct EventWriter {
    path: PathBuf,
    file: BufWriter<File>,
}

impl EventWriter {
    /// Creates `dir` (with its parents) and a new event file in it, and writes the file-version event.
    ///
    /// # Errors
    /// The directory or the file cannot be created or written.
    pub fn create(dir: &Path) -> Result<Self, TelemetryError> {
        std::fs::create_dir_all(dir).map_err(|source| TelemetryError::Io {
            action: "create",
            path: dir.to_path_buf(),
            source,
        })?;
        let now = wall_time();
        let name = format!(
            "events.out.tfevents.{:010}.{}.{}.{}",
            now as u64,
            host_name(),
            std::process::id(),
            FILES_OPENED.fetch_add(1, Ordering::Relaxed)
        );
        let path = dir.join(name);
        // `create_new`: a file of another writer is never appended to, whatever the clock says.
        let file = File::options()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|source| TelemetryError::Io {
                action: "create",
                path: path.clone(),
                source,
            })?;
        let mut writer = Self {
            path,
            file: BufWriter::new(file),
        };
        writer.write_event(&Event {
            wall_time: now,
            step: 0,
            what: Some(What::FileVersion(FILE_VERSION.to_owned())),
        })?;
        Ok(writer)
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes every scalar of `line` ([`scalars`]) as one event at the line's step, and flushes, so TensorBoard
    /// (and a crash) sees every line written so far. A line with no scalar writes nothing.
    ///
    /// # Errors
    /// The file cannot be written.
    pub fn write_line(&mut self, line: &StatusLine) -> Result<(), TelemetryError> {
        let value: Vec<SummaryValue> = scalars(line)
            .into_iter()
            .map(|(tag, value)| SummaryValue {
                tag,
                simple_value: Some(value as f32),
            })
            .collect();
        if value.is_empty() {
            return Ok(());
        }
        self.write_event(&Event {
            wall_time: wall_time(),
            step: i64::try_from(line.step).unwrap_or(i64::MAX),
            what: Some(What::Summary(Summary { value })),
        })
    }

    fn write_event(&mut self, event: &Event) -> Result<(), TelemetryError> {
        self.file
            .write_all(&frame(&event.encode_to_vec()))
            .and_then(|()| self.file.flush())
            .map_err(|source| TelemetryError::Io {
                action: "write",
                path: self.path.clone(),
                source,
            })
    }
}

/// Seconds since the Unix epoch, as TensorBoard's `wall_time`.
fn wall_time() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |since| since.as_secs_f64())
}

/// This machine's name for the file name (`localhost` if it has none that reads as text).
fn host_name() -> String {
    let mut name = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname writes at most that many bytes.
    let status = unsafe { libc::gethostname(name.as_mut_ptr().cast(), name.len()) };
    let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    match std::str::from_utf8(&name[..end]) {
        Ok(host) if status == 0 && !host.is_empty() => host.replace(['/', '\\'], "_"),
        _ => "localhost".to_owned(),
    }
}

#[cfg(test)]
mod tests;
