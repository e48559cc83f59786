//! One module per subcommand; each exposes `run(&Args) -> CommandResult`. Every error comes back here and is
//! printed once by [`finish`]: `error:` and one `Caused by:` line per cause, or a file's rendered diagnostics.
//!
//! Exit codes (documented in the README's reliability section):
//!
//! | code | meaning |
//! | --- | --- |
//! | 0 | success (for `run`: the step limit was reached, or the data ended and no limit was asked for) |
//! | 1 | an error: invalid or unreadable input, a failed run (the last good state is saved when it can be) |
//! | 2 | usage error (clap) |
//! | 3 | `run`: the data ran out before the step limit (what was trained is saved and summarised) |
//! | 128 + N | `run`: stopped by signal N (SIGINT 130, SIGTERM 143, SIGHUP 129) after saving |

pub mod check;
pub mod compile;
pub mod diagnose;
pub mod eval;
pub mod export_check;
pub mod input;
pub mod report;
pub mod run;
pub mod signals;
pub mod simulate;
pub mod vocab;

use std::fmt::Display;
use std::io::Write as _;
use std::process::ExitCode;

use draftpipe_compiler::{CompileError, Diagnostics};

use crate::cli::Command;

/// What a command returns: the exit status it chose, or the error [`finish`] reports.
pub type CommandResult = anyhow::Result<ExitCode>;

/// Runs `command` by its module; its error goes to [`finish`].
pub fn dispatch(command: Command) -> CommandResult {
    match command {
        Command::Check(args) => check::run(&args),
        Command::Compile(args) => compile::run(&args),
        Command::Run(args) => run::run(&args),
        Command::Diagnose(args) => diagnose::run(&args),
        Command::Eval(args) => eval::run(&args),
        Command::Report(args) => report::run(&args),
        Command::Simulate(args) => simulate::run(&args),
        Command::ExportCheck(args) => export_check::run(&args),
        Command::Vocab(args) => vocab::run(&args),
    }
}

/// Exit code for input with errors and failed runs (usage errors exit 2 through clap).
pub const EXIT_INVALID: u8 = 1;

/// Standard output was closed by its reader (`draftpipe compile … | head -1`): nothing is left to say, so the
/// process ends quietly instead of reporting (or panicking on) the broken pipe.
#[derive(Debug)]
pub struct StdoutClosed;

impl Display for StdoutClosed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("standard output was closed")
    }
}

impl std::error::Error for StdoutClosed {}

/// Writes `text` and a newline to standard output. A closed pipe becomes [`StdoutClosed`]; any other failure an
/// error that says what could not be written.
pub fn say(text: impl Display) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{text}")
        .and_then(|()| out.flush())
        .map_err(|error| match error.kind() {
            std::io::ErrorKind::BrokenPipe => anyhow::Error::new(StdoutClosed),
            _ => anyhow::Error::new(error).context("cannot write to standard output"),
        })
}

/// Turns a command's result into the process exit code, printing its error once.
pub fn finish(result: CommandResult) -> ExitCode {
    match result {
        Ok(code) => code,
        Err(error) if error.is::<StdoutClosed>() => ExitCode::SUCCESS,
        Err(error) => {
            report(&error);
            ExitCode::from(EXIT_INVALID)
        }
    }
}

/// Prints an error: a file's diagnostics as rendered, anything else as `error:` then one `Caused by:` line per
/// cause. A cause whose text the line before already shows (library errors often print their source inline
/// too) is not repeated.
pub fn report(error: &anyhow::Error) {
    if let Some(diagnostics) = error.downcast_ref::<Diagnostics>() {
        draftpipe_runtime::log_line!("{diagnostics}");
        return;
    }
    let mut shown = error.to_string();
    draftpipe_runtime::log_line!("error: {shown}");
    for cause in error.chain().skip(1) {
        let text = cause.to_string();
        if !shown.contains(&text) {
            draftpipe_runtime::log_line!("  Caused by: {text}");
        }
        shown = text;
    }
}

/// A compile error as the error [`finish`] reports: diagnostics stay diagnostics (rendered as they are), the
/// other kinds keep their causes.
pub fn compile_failure(error: CompileError) -> anyhow::Error {
    match error {
        CompileError::Invalid(diagnostics) => anyhow::Error::new(diagnostics),
        other => anyhow::Error::new(other),
    }
}
