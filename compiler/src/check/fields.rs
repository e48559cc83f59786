//! Key lookup in a block or call: duplicates, missing required keys, and unknown keys with suggestions.
//!
//! Checks ask for the keys they understand; whatever was written but never asked for is unknown. So the list
//! of valid keys lives in exactly one place, the code that interprets them.

use crate::ast::{Entry, Value};
use crate::check::suggest;
use crate::diagnostic::Diagnostic;
use crate::span::Span;

/// The entries of one block or call, as checks consume them.
pub(crate) struct Fields<'a> {
    context: String,
    owner: Span,
    entries: Vec<&'a Entry>,
    known: Vec<&'static str>,
    /// Required keys not given, with an example value; reported by `finish`.
    missing: Vec<(&'static str, String)>,
}

impl<'a> Fields<'a> {
    /// Indexes `entries`, reporting every repeated key. `context` names the owner in messages (e.g.
    /// "queue `hs`"); missing-key errors point at `owner`.
    pub(crate) fn new(
        entries: &'a [Entry],
        context: String,
        owner: Span,
        errs: &mut Vec<Diagnostic>,
    ) -> Self {
        let mut firsts: Vec<&'a Entry> = Vec::with_capacity(entries.len());
        for entry in entries {
            match firsts.iter().find(|e| e.key.name == entry.key.name) {
                Some(first) => errs.push(
                    Diagnostic::error(
                        entry.key.span,
                        format!("duplicate key `{}` in {context}", entry.key.name),
                    )
                    .label("set again here")
                    .related(first.key.span, "first set")
                    .help("remove one of the two settings"),
                ),
                None => firsts.push(entry),
            }
        }
        Self {
            context,
            owner,
            entries: firsts,
            known: Vec::new(),
            missing: Vec::new(),
        }
    }

    /// The value of `key`, when given.
    pub(crate) fn optional(&mut self, key: &'static str) -> Option<&'a Value> {
        self.known.push(key);
        self.entries
            .iter()
            .find(|e| e.key.name == key)
            .map(|e| &e.value)
    }

    /// The value of `key`; when it is missing, `finish` reports it, suggesting `key = example`.
    pub(crate) fn required(&mut self, key: &'static str, example: &str) -> Option<&'a Value> {
        let value = self.optional(key);
        if value.is_none() {
            self.missing.push((key, example.to_owned()));
        }
        value
    }

    /// Reports every key no check asked for, and every missing required key, except that a misspelt key
    /// close to a missing one is reported once, as the misspelling.
    pub(crate) fn finish(self, errs: &mut Vec<Diagnostic>) {
        let mut explained: Vec<&str> = Vec::new();
        for entry in &self.entries {
            if self.known.contains(&entry.key.name.as_str()) {
                continue;
            }
            let mut help = suggest::help(&entry.key.name, "valid keys are", &self.known);
            if let Some(best) = suggest::closest(&entry.key.name, self.known.iter().copied())
                && self.missing.iter().any(|(k, _)| *k == best)
            {
                explained.push(best);
                help = format!("did you mean `{best}`? (`{best}` is required)");
            }
            errs.push(
                Diagnostic::error(
                    entry.key.span,
                    format!("unknown key `{}` in {}", entry.key.name, self.context),
                )
                .label("unknown key")
                .help(help),
            );
        }
        for (key, example) in &self.missing {
            if !explained.contains(key) {
                errs.push(
                    Diagnostic::error(
                        self.owner,
                        format!("missing required key `{key}` in {}", self.context),
                    )
                    .label(format!("needs `{key}`"))
                    .help(format!("add `{key} = {example}`")),
                );
            }
        }
    }
}
