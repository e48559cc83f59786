//! `draftpipe vocab PIPE --out FILE [--batches N]`: counts the loss-masked tokens of the pipeline's source and
//! writes the `eagle3` drafter's draft vocabulary (`d2t`, `t2d`) with SpecForge's rule
//! (`draftpipe_runtime::model::eagle3::vocab`), for the pipeline's `vocab_map = "FILE"`. `--out` follows the
//! output rule (`draftpipe_runtime::output_file`): never an input, never a non-regular file, and another kind
//! of file only with `--force`.

use std::process::ExitCode;

use anyhow::{Context as _, bail};
use draftpipe_compiler::compile_file;
use draftpipe_runtime::model::eagle3::vocab::{VocabMap, count_source_tokens, coverage};
use draftpipe_runtime::output_file::{OutputKind, check_output, plan_inputs};

use super::{CommandResult, compile_failure, say};
use crate::cli::VocabArgs;

/// Counts, builds and writes the map; prints what was counted and how much of it the draft vocabulary covers.
pub fn run(args: &VocabArgs) -> CommandResult {
    let plan = compile_file(&args.file).map_err(compile_failure)?;
    let Some(spec) = plan.model.spec.as_eagle3() else {
        bail!(
            "{}: the drafter is `{}`; a draft vocabulary belongs to an `eagle3` drafter",
            args.file.display(),
            plan.model.spec.kind()
        );
    };
    // Refused before counting, which can take minutes: the map replaces no input and nothing but an earlier map.
    let mut inputs = plan_inputs(&plan);
    inputs.push(args.file.clone());
    check_output(&args.out, OutputKind::VocabMap, &inputs, args.force)?;
    let (counts, batches) = count_source_tokens(&plan, args.batches)
        .with_context(|| format!("cannot count the tokens of {}", args.file.display()))?;
    let map = VocabMap::from_counts(&counts, spec.draft_vocab)?;
    map.write(&args.out)?;
    say(format_args!(
        "vocab: {} (draft_vocab {} of {}): {} loss-masked tokens, {} distinct, in {batches} batches; the draft \
         vocabulary covers {:.2}% of them",
        args.out.display(),
        spec.draft_vocab,
        spec.vocab,
        counts.total(),
        counts.distinct(),
        100.0 * coverage(&counts, &map)
    ))?;
    Ok(ExitCode::SUCCESS)
}
