//! The `acceptance` section: the held-out prompts and the target that `draftpipe run`'s draft-and-verify loop
//! measures the drafter with every `every` steps, checked on its own and against the drafter's family.
//!
//! ```text
//!  acceptance { target, prompts, every, ... } ──check_acceptance──▶ AcceptanceSpec ──▶ Plan.acceptance
//!                    └── family without a loop (mlp, eagle3) ──▶ error at the section, the model related
//! ```

use crate::ast::AcceptanceSection;
use crate::check::fields::Fields;
use crate::check::stages::ModelKind;
use crate::check::values;
use crate::diagnostic::Diagnostic;
use crate::family::REGISTRY;
use crate::plan::AcceptanceSpec;

use super::Errs;

/// Tokens each prompt's decode generates when `max_new_tokens` is not given (the Python command's default).
pub const DEFAULT_MAX_NEW_TOKENS: u64 = 64;
/// How long one check may run when `timeout` is not given: past it the child is killed and the run says so.
pub const DEFAULT_TIMEOUT_MS: u64 = 10 * 60 * 1000;

/// Largest accepted `max_new_tokens`: beyond any held-out decode worth waiting for.
const MAX_NEW_TOKENS: u64 = 1 << 20;

/// The `acceptance` section's settings, when it is there and valid (`Some(None)`: absent).
pub(crate) fn check_acceptance(
    section: Option<&AcceptanceSection>,
    model: Option<ModelKind>,
    errs: &mut Errs,
) -> Option<Option<AcceptanceSpec>> {
    let Some(section) = section else {
        return Some(None);
    };
    let mut f = Fields::new(
        &section.block.entries,
        "`acceptance`".to_owned(),
        section.header,
        errs,
    );
    let path = |errs: &mut Errs, key: &'static str, value| {
        values::nonempty_string(errs, key, value).map(str::to_owned)
    };
    let target = f
        .required("target", "\"models/qwen3-8b\"")
        .and_then(|v| path(errs, "target", v));
    let prompts = f
        .required("prompts", "\"held-out.jsonl\"")
        .and_then(|v| path(errs, "prompts", v));
    let every = f
        .required("every", "200")
        .and_then(|v| values::count(errs, "every", v, 1))
        .map(|n| n as u64);
    let max_new_tokens = match f.optional("max_new_tokens") {
        None => Some(DEFAULT_MAX_NEW_TOKENS),
        Some(v) => values::count_in(errs, "max_new_tokens", v, 1, MAX_NEW_TOKENS).map(|n| n as u64),
    };
    let python = match f.optional("python") {
        None => Some(None),
        Some(v) => path(errs, "python", v).map(Some),
    };
    let timeout_ms = match f.optional("timeout") {
        None => Some(DEFAULT_TIMEOUT_MS),
        Some(v) => values::duration_ms(errs, "timeout", v),
    };
    f.finish(errs);
    if let Some(kind) = model
        && !kind.family.acceptance_loop
    {
        let with_loop: Vec<String> = REGISTRY
            .iter()
            .filter(|family| family.acceptance_loop)
            .map(|family| format!("`{}`", family.name))
            .collect();
        errs.push(
            Diagnostic::error(
                section.header,
                format!(
                    "the acceptance loop drafts with {} exports only; this drafter is `{}`",
                    with_loop.join(" and "),
                    kind.family.name
                ),
            )
            .label(format!("no draft-and-verify loop for {} `{}`", kind.family.article, kind.family.name))
            .related(kind.span, format!("model is `{}`", kind.family.name))
            .help(
                "`python -m draftpipe_client.speculative` runs SGLang's DFlash draft-and-verify loop; an \
                 `mlp` drafter has no served form and EAGLE-3's tree loop is not written: remove the \
                 `acceptance` section",
            ),
        );
        return None;
    }
    Some(Some(AcceptanceSpec {
        target: target?,
        prompts: prompts?,
        every: every?,
        max_new_tokens: max_new_tokens?,
        python: python?,
        timeout_ms: timeout_ms?,
    }))
}
