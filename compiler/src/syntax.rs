//! Syntax errors: pest's "expected rules at a position" turned into a readable [`Diagnostic`], and recovery
//! so that one run reports a syntax error in every broken top-level section, not only the first.
//!
//! Recovery splits the text before every line that starts (in column 1) with a letter, the conventional start
//! of a top-level section, and parses each piece on its own. A piece's error is more local than the
//! whole-file one (an unclosed block fails at its own end, not deep inside the next section), so piece errors
//! are reported; the whole-file error only when no piece fails on its own.

use pest::Parser as _;
use pest::error::{Error, ErrorVariant, InputLocation};

use crate::diagnostic::Diagnostic;
use crate::grammar::{PipeParser, Rule};
use crate::span::Span;

/// Every syntax error found in `source`, given the error of the whole-file parse.
pub(crate) fn recover(source: &str, whole_file: &Error<Rule>) -> Vec<Diagnostic> {
    let found: Vec<Diagnostic> = section_starts(source)
        .windows(2)
        .filter_map(|w| {
            let piece = &source[w[0]..w[1]];
            PipeParser::parse(Rule::file, piece)
                .err()
                .map(|e| to_diagnostic(source, w[0], &e))
        })
        .collect();
    if found.is_empty() {
        vec![to_diagnostic(source, 0, whole_file)]
    } else {
        found
    }
}

/// Byte offsets where top-level sections start, with `0` first and `source.len()` last.
fn section_starts(source: &str) -> Vec<usize> {
    let mut starts = vec![0];
    let mut offset = 0;
    for line in source.split_inclusive('\n') {
        if offset > 0 && line.starts_with(|c: char| c.is_ascii_alphabetic()) {
            starts.push(offset);
        }
        offset += line.len();
    }
    starts.push(source.len());
    starts
}

/// The diagnostic for `error`, raised while parsing the piece of `source` that starts at byte `base`.
fn to_diagnostic(source: &str, base: usize, error: &Error<Rule>) -> Diagnostic {
    let pos = base
        + match error.location {
            InputLocation::Pos(p) => p,
            InputLocation::Span((start, _)) => start,
        };
    if let Some(missing) = missing_value(source, pos) {
        return missing;
    }
    let found = token_at(source, pos);
    let span = Span::new(pos, pos + found.len());
    let found_text = if found.is_empty() {
        "end of input".to_owned()
    } else {
        format!("`{found}`")
    };
    let positives: &[Rule] = match &error.variant {
        ErrorVariant::ParsingError { positives, .. } => positives,
        ErrorVariant::CustomError { .. } => &[],
    };
    let mut expected: Vec<&str> = positives.iter().map(|r| describe(*r)).collect();
    expected.sort_unstable();
    expected.dedup();
    let message = match expected.as_slice() {
        [] => format!("unexpected {found_text}"),
        names => format!("expected {}, found {found_text}", one_of(names)),
    };
    Diagnostic::error(span, message)
        .label("unexpected here")
        .help(help_for(positives))
}

/// `key =` followed by the next `other = ...` parses as `key = other` and fails at the second `=`; say what
/// actually happened: `key` has no value.
fn missing_value(source: &str, pos: usize) -> Option<Diagnostic> {
    if !source[pos..].starts_with('=') {
        return None;
    }
    let is_word = |c: char| c.is_alphanumeric() || c == '_';
    let before = source[..pos].trim_end();
    let next_key = before.trim_end_matches(is_word);
    if next_key.len() == before.len() {
        return None;
    }
    let first_eq = next_key.trim_end();
    let key_part = first_eq.strip_suffix('=')?.trim_end();
    let key = &key_part[key_part.trim_end_matches(is_word).len()..];
    if key.is_empty() {
        return None;
    }
    let eq = first_eq.len() - 1;
    Some(
        Diagnostic::error(Span::new(eq, eq + 1), format!("missing value for `{key}`"))
            .label("no value after `=`")
            .help(VALUE_HELP),
    )
}

/// The word, number or single character at `pos` (empty at the end of input).
fn token_at(chunk: &str, pos: usize) -> &str {
    let rest = chunk.get(pos..).unwrap_or("");
    let word_len: usize = rest
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .map(char::len_utf8)
        .sum();
    match (word_len, rest.chars().next()) {
        (0, Some(c)) => &rest[..c.len_utf8()],
        (n, _) => &rest[..n],
    }
}

fn describe(rule: Rule) -> &'static str {
    match rule {
        Rule::pipeline_decl
        | Rule::devices_section
        | Rule::target_section
        | Rule::queue_section
        | Rule::drafter_section
        | Rule::telemetry_section
        | Rule::acceptance_section
        | Rule::unknown_section
        | Rule::section => "a section",
        Rule::EOI => "end of input",
        Rule::device_decl => "a device declaration (`gpu 0..8 { ... }`)",
        Rule::device_class | Rule::placement => "`cpu` or `gpu`",
        Rule::worker_count => "a worker count (`x2`)",
        Rule::device_ids => "device numbers (`0`, `0..4` or `[0, 2]`)",
        Rule::entry => "a setting (`key = value`)",
        Rule::argument => "an argument (`key = value`)",
        Rule::value | Rule::call | Rule::tuple | Rule::list | Rule::quantity => "a value",
        Rule::env_ref => "an environment variable (`env(\"NAME\")`)",
        Rule::kw_env => "`env`",
        Rule::range => "a range (`a..b`)",
        Rule::number => "a number",
        Rule::unit => "a unit",
        Rule::string | Rule::string_inner => "a string",
        Rule::ident | Rule::keyword => "a name",
        Rule::kw_pipeline => "`pipeline`",
        Rule::kw_devices => "`devices`",
        Rule::kw_target => "`target`",
        Rule::kw_queue => "`queue`",
        Rule::kw_drafter => "`drafter`",
        Rule::kw_telemetry => "`telemetry`",
        Rule::kw_acceptance => "`acceptance`",
        Rule::kw_on => "`on`",
        Rule::kw_from => "`from`",
        Rule::kw_to => "`to`",
        Rule::block | Rule::lbrace => "`{`",
        Rule::rbrace => "`}`",
        Rule::lparen => "`(`",
        Rule::rparen => "`)`",
        Rule::lbracket => "`[`",
        Rule::rbracket => "`]`",
        Rule::comma => "`,`",
        Rule::equals => "`=`",
        Rule::file | Rule::WHITESPACE | Rule::COMMENT | Rule::ident_char => "a .pipe file",
    }
}

fn one_of(names: &[&str]) -> String {
    match names {
        [only] => (*only).to_owned(),
        [init @ .., last] => format!("{} or {last}", init.join(", ")),
        [] => String::new(),
    }
}

const VALUE_HELP: &str = "a value is a number (`16`, `1e-3`), a size (`141GiB`), a duration (`1s`), a string, \
                          a range (`64..512`), a list (`[1, 2]`), a tuple (`(0.9, 0.95)`), a name or a call \
                          (`mlp(hidden = 256)`)";

fn help_for(positives: &[Rule]) -> &'static str {
    help_for_rules(positives).unwrap_or("the syntax is described in docs/language.md")
}

fn help_for_rules(positives: &[Rule]) -> Option<&'static str> {
    let has = |r: Rule| positives.contains(&r);
    if has(Rule::pipeline_decl) || has(Rule::unknown_section) {
        Some(
            "top-level sections are `pipeline \"NAME\"`, `devices { }`, `target NAME on DEVICES { }`, \
             `queue NAME from TARGET to DRAFTER { }`, `drafter NAME on DEVICES { }`, `telemetry { }` and `acceptance { }`",
        )
    } else if has(Rule::value) {
        Some(VALUE_HELP)
    } else if has(Rule::string) || has(Rule::string_inner) {
        Some("strings are written in double quotes on one line, e.g. \"runs/trace.json\"")
    } else if has(Rule::equals) {
        Some("settings are written `key = value`")
    } else if has(Rule::placement) || has(Rule::device_class) {
        Some("stages run `on cpu`, `on cpu x2` (two workers) or `on gpu 0..4` (one worker per GPU)")
    } else if has(Rule::entry) || has(Rule::rbrace) {
        Some("a block holds `key = value` settings, one after another, and ends with `}`")
    } else if has(Rule::comma) {
        Some("separate arguments and elements with `,`")
    } else if has(Rule::kw_on) || has(Rule::kw_from) || has(Rule::kw_to) || has(Rule::ident) {
        Some(
            "headers read `target NAME on DEVICES`, `queue NAME from TARGET to DRAFTER`, `drafter NAME on DEVICES`",
        )
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sections_start_at_column_one_letters() {
        let src =
            "pipeline \"p\"\n# c\ntarget t on cpu {\n  hidden = 1\n}\nqueue q from t to d {\n}\n";
        let starts = section_starts(src);
        assert_eq!(&src[starts[1]..starts[1] + 6], "target");
        assert_eq!(&src[starts[2]..starts[2] + 5], "queue");
        assert_eq!(*starts.last().unwrap(), src.len());
    }

    #[test]
    fn tokens_are_words_or_single_chars() {
        assert_eq!(token_at("abc def", 0), "abc");
        assert_eq!(token_at("{x", 0), "{");
        assert_eq!(token_at("é", 0), "é");
        assert_eq!(token_at("ab", 2), "");
    }
}
