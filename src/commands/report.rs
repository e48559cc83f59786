//! `draftpipe report RUN_DIR [--out FILE.html]`: read a run directory and write its one-page report (the
//! library's `report::write_report`), then say where it went and where the run stands.

use std::process::ExitCode;

use anyhow::Context as _;
use draftpipe_runtime::report::{RunState, write_report};

use super::{CommandResult, say};
use crate::cli::ReportArgs;

/// Writes the report of the run in `args.run_dir`; an error when the directory is no run directory or a file
/// in it cannot be read.
pub fn run(args: &ReportArgs) -> CommandResult {
    let (path, run) = write_report(&args.run_dir, args.out.as_deref(), args.force)
        .with_context(|| format!("cannot report the run in {}", args.run_dir.display()))?;
    let state = match run.state {
        RunState::Ended => "the run ended",
        RunState::Running => "the run is still going: the figures so far",
        RunState::StoppedWithoutSummary => {
            "the run stopped without a summary: what its status lines show"
        }
    };
    say(format!(
        "report: {} ({} status lines; {state})",
        path.display(),
        run.status.len()
    ))?;
    Ok(ExitCode::SUCCESS)
}
