//! `draftpipe report RUN_DIR`: one self-contained HTML page of a run, drawn from the run directory's own files,
//! for a run that ended, crashed or is still going.
//!
//! ```text
//!  RUN_DIR/status.jsonl, summary.json, draftpipe.lock
//!        │ run_files::RunRecord::load (a cut-short last line left out, the run's state)
//!        ▼
//!  charts (plotters → SVG strings) ──▶ page (fixed layout, diagnosis in words, layout comment) ──▶ report.html
//! ```
//!
//! The page fetches nothing and runs no script: the charts are inline `<svg>`, the styles inline CSS.

mod charts;
mod page;
mod run_files;

use std::io::Write as _;
use std::path::{Path, PathBuf};

use crate::output_file::{OutputKind, check_output, write_output};
use crate::telemetry::{STATUS_FILE, SUMMARY_FILE};

pub use charts::{CHART_HEIGHT, CHART_WIDTH, Chart, all_charts};
pub use page::{ChartRegion, LAYOUT_MARKER, Layout, render};
pub use run_files::{RunRecord, RunState, parse_status_lines, simulated_tau, teacher_forced_tau};

/// The report's file name inside the run directory when no `--out` is given.
pub const REPORT_FILE: &str = "report.html";

/// What can stop a report.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// The directory holds neither `status.jsonl` nor `summary.json`.
    #[error(
        "{} is not a run directory: it holds neither status.jsonl nor summary.json (write one with `draftpipe \
         run … --run-dir DIR`)",
        dir.display()
    )]
    NotARunDirectory {
        /// The directory.
        dir: PathBuf,
    },
    /// A file could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A status line (not a cut-short last one) is not a status line.
    #[error("{}:{line}:{column}: not a status line: {source}", path.display())]
    StatusLine {
        /// The file.
        path: PathBuf,
        /// 1-based line.
        line: usize,
        /// 1-based column within the line.
        column: usize,
        /// The cause.
        source: serde_json::Error,
    },
    /// `summary.json` is present but unreadable or of another format.
    #[error("the run summary: {source}")]
    Summary {
        /// The cause.
        source: Box<crate::telemetry::TelemetryError>,
    },
    /// A chart could not be drawn.
    #[error("cannot draw the {chart} chart: {message}")]
    Draw {
        /// The chart's id.
        chart: String,
        /// The drawing library's message.
        message: String,
    },
    /// The layout could not be encoded.
    #[error("cannot encode the page's layout: {source}")]
    Encode {
        /// The cause.
        source: serde_json::Error,
    },
    /// The page could not be written.
    #[error(transparent)]
    Write(#[from] crate::output_file::OutputError),
}

/// Reads `run_dir`, draws its report and writes it to `out` (default `RUN_DIR/report.html`); returns the
/// path written and the record it was drawn from. A file already at the path is replaced only when it is a
/// report, or with `force`; never the run's own files.
pub fn write_report(
    run_dir: &Path,
    out: Option<&Path>,
    force: bool,
) -> Result<(PathBuf, RunRecord), ReportError> {
    let path = out.map_or_else(|| run_dir.join(REPORT_FILE), Path::to_path_buf);
    let inputs = [run_dir.join(STATUS_FILE), run_dir.join(SUMMARY_FILE)];
    check_output(&path, OutputKind::Report, &inputs, force)?;
    let run = RunRecord::load(run_dir)?;
    let html = render(&run)?;
    write_output(&path, |file| file.write_all(html.as_bytes()))?;
    Ok((path, run))
}
