//! `draftpipe compile FILE [--emit text|json]`: print the plan of a valid file.

use std::process::ExitCode;

use draftpipe_compiler::summary::Summary;
use draftpipe_compiler::{CompileError, compile_file};

use crate::cli::{CompileArgs, Emit};

/// Prints the plan; exit 1 (with all errors on stderr) when the file is invalid or unreadable.
pub fn run(args: &CompileArgs) -> ExitCode {
    let plan = match compile_file(&args.file) {
        Ok(plan) => plan,
        Err(error @ CompileError::Io { .. }) => {
            eprintln!("error: {error}");
            return super::invalid();
        }
        Err(CompileError::Invalid(diagnostics)) => {
            eprintln!("{diagnostics}");
            return super::invalid();
        }
    };
    match args.emit {
        Emit::Text => println!("{}", Summary(&plan)),
        Emit::Json => match serde_json::to_string_pretty(&plan) {
            Ok(json) => println!("{json}"),
            Err(error) => {
                eprintln!("error: cannot serialise the plan: {error}");
                return super::invalid();
            }
        },
    }
    ExitCode::SUCCESS
}
