//! One module per subcommand; each exposes `run(&Args) -> ExitCode`.

pub mod check;
pub mod compile;

use std::process::ExitCode;

/// Exit code for input with errors (usage errors exit 2 through clap).
pub const EXIT_INVALID: u8 = 1;

/// `ExitCode` for a failed command.
pub fn invalid() -> ExitCode {
    ExitCode::from(EXIT_INVALID)
}
