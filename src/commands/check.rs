//! `draftpipe check FILE...`: compile every file, print every error, say which files are valid (with their
//! warnings, which do not fail the check).

use std::process::ExitCode;

use draftpipe_compiler::{CompileError, compile_file_with_warnings};

use super::{CommandResult, StdoutClosed, say};
use crate::cli::CheckArgs;

/// Checks each file; exit 0 when all are valid, 1 when any is not. Every file's errors are printed as they
/// come; the count of failed files is the command's error.
pub fn run(args: &CheckArgs) -> CommandResult {
    let mut failed = 0usize;
    for path in &args.files {
        match compile_file_with_warnings(path) {
            Ok((plan, warnings)) => {
                if !warnings.is_empty() {
                    draftpipe_runtime::log_line!("{warnings}\n");
                }
                let said = say(format_args!(
                    "ok: {} (pipeline \"{}\")",
                    path.display(),
                    plan.name
                ));
                // A reader that went away stops the listing, not the check: the exit status still counts.
                if let Err(error) = said
                    && !error.is::<StdoutClosed>()
                {
                    return Err(error);
                }
            }
            Err(CompileError::Invalid(diagnostics)) => {
                failed += 1;
                draftpipe_runtime::log_line!("{diagnostics}\n");
            }
            Err(error) => {
                failed += 1;
                super::report(&anyhow::Error::new(error));
            }
        }
    }
    if failed > 0 {
        anyhow::bail!("{failed} of {} file(s) failed the check", args.files.len());
    }
    Ok(ExitCode::SUCCESS)
}
