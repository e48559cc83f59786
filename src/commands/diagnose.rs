//! `draftpipe diagnose RUN_DIR`: re-read a finished run's summary and explain it.

use std::process::ExitCode;

use anyhow::Context as _;
use draftpipe_runtime::telemetry::{Diagnosis, load_summary};

use crate::cli::DiagnoseArgs;

/// Prints the diagnosis of the run in `args.run_dir`; exit 1 when its summary cannot be read.
pub fn run(args: &DiagnoseArgs) -> ExitCode {
    let diagnose = || -> anyhow::Result<()> {
        let summary = load_summary(&args.run_dir)
            .with_context(|| format!("cannot diagnose the run in {}", args.run_dir.display()))?;
        let diagnosis = Diagnosis::from_summary(&summary);
        if args.json {
            println!("{}", serde_json::to_string_pretty(&diagnosis)?);
        } else {
            println!("{diagnosis}");
        }
        Ok(())
    };
    match diagnose() {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            super::report(&error);
            super::invalid()
        }
    }
}
