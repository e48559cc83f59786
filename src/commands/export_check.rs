//! `draftpipe export-check DIR`: prints, per serving engine, whether it would load the export, and exits 1 when
//! one would not (the rules are the runtime's `export_check`).

use std::process::ExitCode;

use draftpipe_runtime::export_check::{CheckOptions, check_export};

use super::{CommandResult, EXIT_INVALID, say};
use crate::cli::ExportCheckArgs;

/// Checks the export; exit 0 when every engine loads it (warnings allowed), 1 when one would not.
pub fn run(args: &ExportCheckArgs) -> CommandResult {
    let options = CheckOptions {
        tokenizer: args.tokenizer.clone(),
        speculative_tokens: args.speculative_tokens,
    };
    let report = check_export(&args.dir, &options)?;
    say(format_args!("{}", report.to_string().trim_end()))?;
    Ok(if report.all_load() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(EXIT_INVALID)
    })
}
