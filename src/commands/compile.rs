//! `draftpipe compile FILE [--emit text|json]`: print the plan of a valid file. For GPU drafters the JSON
//! carries the GPU time model beside the plan's own fields, as `gpu_step_model` (the text prints it too).

use std::process::ExitCode;

use anyhow::Context as _;
use draftpipe_compiler::compile_file;
use draftpipe_compiler::cost::gpu::PlanJson;
use draftpipe_compiler::summary::Summary;

use super::{CommandResult, compile_failure, say};
use crate::cli::{CompileArgs, Emit};

/// Prints the plan; an error (all diagnostics on stderr) when the file is invalid or unreadable.
pub fn run(args: &CompileArgs) -> CommandResult {
    let plan = compile_file(&args.file).map_err(compile_failure)?;
    match args.emit {
        Emit::Text => say(Summary(&plan))?,
        Emit::Json => {
            let json = PlanJson::of(&plan);
            say(serde_json::to_string_pretty(&json).context("cannot serialise the plan")?)?
        }
    }
    Ok(ExitCode::SUCCESS)
}
