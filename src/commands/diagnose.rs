//! `draftpipe diagnose RUN_DIR`: re-read a finished run's summary, check it, and explain it.

use std::process::ExitCode;

use anyhow::Context as _;
use draftpipe_runtime::telemetry::{Diagnosis, SUMMARY_FILE, load_summary, validate_summary};

use super::input::{MAX_SUMMARY_BYTES, require_regular_file};
use super::{CommandResult, say};
use crate::cli::DiagnoseArgs;

/// Prints the diagnosis of the run in `args.run_dir`; an error when its summary cannot be read or holds values
/// no run writes.
pub fn run(args: &DiagnoseArgs) -> CommandResult {
    let context = || format!("cannot diagnose the run in {}", args.run_dir.display());
    let path = args.run_dir.join(SUMMARY_FILE);
    require_regular_file(&path, "the run summary", MAX_SUMMARY_BYTES).with_context(context)?;
    let summary = load_summary(&args.run_dir).with_context(context)?;
    validate_summary(&summary)
        .with_context(|| format!("{} holds values no run writes", path.display()))
        .with_context(context)?;
    let diagnosis = Diagnosis::from_summary(&summary);
    if args.json {
        say(serde_json::to_string_pretty(&diagnosis)?)?;
    } else {
        say(diagnosis)?;
    }
    Ok(ExitCode::SUCCESS)
}
