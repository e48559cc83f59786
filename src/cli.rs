//! Command-line arguments (clap derive) and the dispatch from a [`Command`] to its module in `commands/`.
//!
//! Exit codes: 0 success, 1 the input has errors (or cannot be read), 2 usage errors (clap's own code).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::commands;

/// Train speculative-decoding drafters from a frozen target's hidden states.
#[derive(Debug, Parser)]
#[command(name = "draftpipe", version, about, propagate_version = true)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands; each has one `run` function in `commands/`.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Check `.pipe` files and report every error (exit 0 when all are valid, 1 when any has errors).
    Check(CheckArgs),
    /// Compile a `.pipe` file and print its plan (stages, queue, model, memory per device, cost per step).
    Compile(CompileArgs),
}

impl Command {
    /// Runs the command and returns the process exit code.
    pub fn run(self) -> ExitCode {
        match self {
            Command::Check(args) => commands::check::run(&args),
            Command::Compile(args) => commands::compile::run(&args),
        }
    }
}

/// Arguments of `draftpipe check`.
#[derive(Debug, Args)]
pub struct CheckArgs {
    /// The `.pipe` files to check.
    #[arg(required = true, value_name = "FILE")]
    pub files: Vec<PathBuf>,
}

/// Arguments of `draftpipe compile`.
#[derive(Debug, Args)]
pub struct CompileArgs {
    /// The `.pipe` file to compile.
    #[arg(value_name = "FILE")]
    pub file: PathBuf,
    /// Output format: a readable summary, or the full plan as JSON.
    #[arg(long, value_enum, default_value_t = Emit::Text)]
    pub emit: Emit,
}

/// Output formats of `draftpipe compile`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Emit {
    /// A readable summary.
    Text,
    /// The plan as JSON (exactly what the runtime executes).
    Json,
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory as _;

    #[test]
    fn clap_definition_is_consistent() {
        super::Cli::command().debug_assert();
    }
}
