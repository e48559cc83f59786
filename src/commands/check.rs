//! `draftpipe check FILE...`: compile every file, print every error, say which files are valid.

use std::process::ExitCode;

use draftpipe_compiler::{CompileError, compile_file};

use crate::cli::CheckArgs;

/// Checks each file; exit 0 when all are valid, 1 when any is not.
pub fn run(args: &CheckArgs) -> ExitCode {
    let mut failed = 0usize;
    for path in &args.files {
        match compile_file(path) {
            Ok(plan) => println!("ok: {} (pipeline \"{}\")", path.display(), plan.name),
            Err(error @ CompileError::Io { .. }) => {
                failed += 1;
                eprintln!("error: {error}");
            }
            Err(CompileError::Invalid(diagnostics)) => {
                failed += 1;
                eprintln!("{diagnostics}\n");
            }
        }
    }
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        eprintln!("{failed} of {} file(s) failed the check", args.files.len());
        super::invalid()
    }
}
