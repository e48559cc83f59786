//! One module per subcommand; each exposes `run(&Args) -> ExitCode`.

pub mod check;
pub mod compile;
pub mod diagnose;
pub mod run;
pub mod simulate;

use std::process::ExitCode;

/// Exit code for input with errors (usage errors exit 2 through clap).
pub const EXIT_INVALID: u8 = 1;

/// `ExitCode` for a failed command.
pub fn invalid() -> ExitCode {
    ExitCode::from(EXIT_INVALID)
}

/// Prints an error and its causes, `error:` first and one `Caused by:` line per cause. A cause whose text the
/// line before already shows (library errors often print their source inline too) is not repeated.
pub fn report(error: &anyhow::Error) {
    let mut shown = error.to_string();
    eprintln!("error: {shown}");
    for cause in error.chain().skip(1) {
        let text = cause.to_string();
        if !shown.contains(&text) {
            eprintln!("  Caused by: {text}");
        }
        shown = text;
    }
}
