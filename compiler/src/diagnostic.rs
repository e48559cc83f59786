//! Errors with source positions, rendered rustc/miette style.
//!
//! ```text
//! error: unknown key `capcity` in queue `hs`
//!   --> pipelines/quickstart.pipe:14:5
//!    |
//! 14 |     capcity   = 16
//!    |     ^^^^^^^ unknown key
//!    |
//!    = help: did you mean `capacity`?
//! ```
//!
//! A file's checks push into one [`Diagnostics`], so a single run reports every error of the file, up to
//! [`MAX_SHOWN`]: a file of a million errors prints the first hundred and a count of the rest, so output and
//! rendering time stay bounded whatever the input. A quoted source line is cut to a window of
//! [`MAX_SNIPPET_CHARS`] around the error, so one huge line is never echoed whole.

use std::fmt;

use crate::span::{Span, line_at, line_col};

/// Whether a diagnostic stops the file (an error) or only tells the user something the plan will do that they
/// may not expect (a warning: the plan is still built).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Severity {
    /// The file has no plan.
    Error,
    /// The file has a plan; this is worth knowing about it.
    Warning,
}

impl Severity {
    /// The word a rendered diagnostic starts with.
    pub fn word(self) -> &'static str {
        match self {
            Self::Error => "error",
            Self::Warning => "warning",
        }
    }
}

/// One error or warning: a message, the span it points at, and optional label, help and related positions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnostic {
    /// Error or warning.
    pub severity: Severity,
    /// The headline after `error: ` (or `warning: `).
    pub message: String,
    /// The offending source text.
    pub span: Span,
    /// Short text printed after the carets.
    pub label: Option<String>,
    /// What to do about it.
    pub help: Option<String>,
    /// Other places that explain the error (e.g. where a name was first defined).
    pub related: Vec<(Span, String)>,
}

impl Diagnostic {
    /// An error at `span`.
    pub fn error(span: Span, message: impl Into<String>) -> Self {
        Self {
            severity: Severity::Error,
            message: message.into(),
            span,
            label: None,
            help: None,
            related: Vec::new(),
        }
    }

    /// A warning at `span`.
    pub fn warning(span: Span, message: impl Into<String>) -> Self {
        Self {
            severity: Severity::Warning,
            ..Self::error(span, message)
        }
    }

    /// Sets the label printed after the carets.
    pub fn label(mut self, label: impl Into<String>) -> Self {
        self.label = Some(label.into());
        self
    }

    /// Sets the help line.
    pub fn help(mut self, help: impl Into<String>) -> Self {
        self.help = Some(help.into());
        self
    }

    /// Adds a note that points at another place in the file.
    pub fn related(mut self, span: Span, note: impl Into<String>) -> Self {
        self.related.push((span, note.into()));
        self
    }
}

/// Errors kept and rendered per file; the rest are counted ("and N more").
pub const MAX_SHOWN: usize = 100;

/// Characters of a source line quoted under an error; a longer line shows a window around the error.
pub const MAX_SNIPPET_CHARS: usize = 120;

/// Characters of a message, label or help line beyond which it is shortened (they quote names from the file).
pub const MAX_MESSAGE_CHARS: usize = 400;

/// Characters of context kept before the error's start when a long line is cut.
const SNIPPET_CONTEXT_BEFORE: usize = 40;

/// All errors of one file, with the file's name and text so they can be rendered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnostics {
    file_name: String,
    source: String,
    /// The first [`MAX_SHOWN`] errors by position.
    items: Vec<Diagnostic>,
    /// Errors beyond those, counted but not kept.
    omitted: usize,
}

impl Diagnostics {
    /// An empty collection for `file_name` with text `source`.
    pub fn new(file_name: &str, source: &str) -> Self {
        Self {
            file_name: file_name.to_owned(),
            source: source.to_owned(),
            items: Vec::new(),
            omitted: 0,
        }
    }

    /// Adds errors, keeping the first [`MAX_SHOWN`] by position (stable for errors at the same place) and
    /// counting the others.
    pub fn extend(&mut self, diagnostics: impl IntoIterator<Item = Diagnostic>) {
        self.items.extend(diagnostics);
        self.items.sort_by_key(|d| d.span.start);
        if self.items.len() > MAX_SHOWN {
            self.omitted += self.items.len() - MAX_SHOWN;
            self.items.truncate(MAX_SHOWN);
        }
    }

    /// Number of errors, those beyond [`MAX_SHOWN`] included.
    pub fn len(&self) -> usize {
        self.items.len() + self.omitted
    }

    /// True when there are no errors.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// The errors kept (the first [`MAX_SHOWN`]), in source order.
    pub fn iter(&self) -> impl Iterator<Item = &Diagnostic> {
        self.items.iter()
    }

    /// The file name the errors refer to.
    pub fn file_name(&self) -> &str {
        &self.file_name
    }

    /// `(line, column)` of a diagnostic's start, 1-based.
    pub fn position(&self, diagnostic: &Diagnostic) -> (usize, usize) {
        let lc = line_col(&self.source, diagnostic.span.start);
        (lc.line, lc.col)
    }

    fn render(&self, d: &Diagnostic, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let start = line_col(&self.source, d.span.start);
        let (line_start, line) = line_at(&self.source, d.span.start);
        let gutter = " ".repeat(start.line.to_string().len());
        writeln!(f, "{}: {}", d.severity.word(), shorten(&d.message))?;
        writeln!(
            f,
            "{gutter}--> {}:{}:{}",
            self.file_name, start.line, start.col
        )?;
        writeln!(f, "{gutter} |")?;
        let span_start = d.span.start.clamp(line_start, line_start + line.len());
        let span_end = d.span.end.clamp(span_start, line_start + line.len());
        let snippet = Snippet::cut(line, span_start - line_start, span_end - line_start);
        // Tabs would misalign the carets; show them as single spaces.
        writeln!(f, "{} | {}", start.line, snippet.text.replace('\t', " "))?;
        let (caret_start, width) = (snippet.caret_start, snippet.caret_width);
        write!(
            f,
            "{gutter} | {}{}",
            " ".repeat(caret_start),
            "^".repeat(width)
        )?;
        match &d.label {
            Some(label) => writeln!(f, " {}", shorten(label))?,
            None => writeln!(f)?,
        }
        if d.help.is_some() || !d.related.is_empty() {
            writeln!(f, "{gutter} |")?;
        }
        for (span, note) in &d.related {
            let at = line_col(&self.source, span.start);
            writeln!(
                f,
                "{gutter} = note: {} at {}:{}:{}",
                shorten(note),
                self.file_name,
                at.line,
                at.col
            )?;
        }
        if let Some(help) = &d.help {
            writeln!(f, "{gutter} = help: {}", shorten(help))?;
        }
        Ok(())
    }
}

/// `text` whole when it is short; otherwise its first and last characters around a `…`. Messages quote names
/// from the file, and a name may be a megabyte long.
fn shorten(text: &str) -> std::borrow::Cow<'_, str> {
    let keep = MAX_MESSAGE_CHARS;
    let Some((head_end, _)) = text.char_indices().nth(keep) else {
        return text.into();
    };
    let tail_start = text
        .char_indices()
        .rev()
        .nth(keep / 2)
        .map_or(text.len(), |(i, _)| i);
    if tail_start <= head_end {
        return text.into();
    }
    format!("{}…{}", &text[..head_end], &text[tail_start..]).into()
}

/// The part of a source line quoted under an error, and where its carets go (in characters).
struct Snippet {
    text: String,
    caret_start: usize,
    caret_width: usize,
}

impl Snippet {
    /// Quotes `line` with carets under bytes `start..end` (on char boundaries); a line longer than
    /// [`MAX_SNIPPET_CHARS`] is cut to a window that starts a little before `start`, marked with `…`. Only the
    /// window's neighbourhood is walked, so a line of hundreds of megabytes costs no more than a short one.
    fn cut(line: &str, start: usize, end: usize) -> Self {
        let before = line[..start]
            .char_indices()
            .rev()
            .take(SNIPPET_CONTEXT_BEFORE)
            .last()
            .map_or(start, |(i, _)| i);
        let from = if line.len() > MAX_SNIPPET_CHARS {
            before
        } else {
            0
        };
        let to = line[from..]
            .char_indices()
            .nth(MAX_SNIPPET_CHARS)
            .map_or(line.len(), |(i, _)| from + i);
        let mut text = String::new();
        if from > 0 {
            text.push('…');
        }
        text.push_str(&line[from..to]);
        if to < line.len() {
            text.push('…');
        }
        let caret_start = usize::from(from > 0) + line[from..start].chars().count();
        let caret_width = line[start..end.min(to).max(start)].chars().count().max(1);
        Self {
            text,
            caret_start,
            caret_width,
        }
    }
}

impl fmt::Display for Diagnostics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for d in &self.items {
            self.render(d, f)?;
            writeln!(f)?;
        }
        if self.omitted > 0 {
            writeln!(
                f,
                "… and {} more error{} (the first {MAX_SHOWN} are shown)\n",
                self.omitted,
                if self.omitted == 1 { "" } else { "s" }
            )?;
        }
        let n = self.len();
        let plural = if n == 1 { "" } else { "s" };
        // A file's diagnostics are all warnings (its plan was built) or hold its errors.
        if self.items.iter().all(|d| d.severity == Severity::Warning) {
            write!(f, "warning: `{}` has {n} warning{plural}", self.file_name)
        } else {
            write!(f, "error: `{}` has {n} error{plural}", self.file_name)
        }
    }
}

impl std::error::Error for Diagnostics {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_position_snippet_caret_and_help() {
        let source = "queue hs {\n    capcity = 16\n}\n";
        let mut diags = Diagnostics::new("q.pipe", source);
        diags.extend([
            Diagnostic::error(Span::new(15, 22), "unknown key `capcity`")
                .label("unknown key")
                .help("did you mean `capacity`?"),
        ]);
        let expected = "error: unknown key `capcity`\n --> q.pipe:2:5\n  |\n2 |     capcity = 16\n  |     ^^^^^^^ \
                        unknown key\n  |\n  = help: did you mean `capacity`?\n\nerror: `q.pipe` has 1 error";
        assert_eq!(diags.to_string(), expected);
    }

    #[test]
    fn a_span_at_the_end_of_input_gets_one_caret() {
        let mut diags = Diagnostics::new("e.pipe", "pipeline");
        diags.extend([Diagnostic::error(Span::new(8, 8), "expected a string")]);
        assert!(
            diags.to_string().contains("1 | pipeline\n  |         ^\n"),
            "{diags}"
        );
    }

    #[test]
    fn only_the_first_hundred_errors_are_kept_and_the_rest_counted() {
        let source = "k = 1\n".repeat(250);
        let mut diags = Diagnostics::new("many.pipe", &source);
        // Pushed in reverse, so keeping the first by position is not keeping the first pushed.
        diags.extend(
            (0..250).rev().map(|i| {
                Diagnostic::error(Span::new(i * 6, i * 6 + 1), format!("error number {i}"))
            }),
        );
        assert_eq!(diags.len(), 250);
        assert_eq!(diags.iter().count(), MAX_SHOWN);
        assert!(diags.iter().all(|d| d.span.start < MAX_SHOWN * 6));
        let text = diags.to_string();
        assert_eq!(text.matches(" --> ").count(), MAX_SHOWN);
        assert!(text.contains("error number 99\n") && !text.contains("error number 100\n"));
        assert!(
            text.contains("… and 150 more errors (the first 100 are shown)"),
            "{text}"
        );
        assert!(text.ends_with("has 250 errors"), "{text}");
    }

    #[test]
    fn a_long_line_is_quoted_as_a_window_with_the_carets_under_the_error() {
        let line = format!("{}BAD{}", "a".repeat(5_000), "b".repeat(5_000));
        let mut diags = Diagnostics::new("long.pipe", &line);
        diags.extend([Diagnostic::error(Span::new(5_000, 5_003), "bad").label("here")]);
        let text = diags.to_string();
        let quoted = text.lines().find(|l| l.starts_with("1 | ")).unwrap();
        let carets = text.lines().find(|l| l.contains('^')).unwrap();
        assert!(quoted.chars().count() < MAX_SNIPPET_CHARS + 10, "{quoted}");
        assert!(
            quoted.starts_with("1 | …") && quoted.ends_with('…'),
            "{quoted}"
        );
        let bad_at = quoted.chars().position(|c| c == 'B').unwrap();
        assert_eq!(
            carets.chars().position(|c| c == '^'),
            Some(bad_at),
            "{text}"
        );
        assert!(carets.contains("^^^ here"), "{text}");
    }

    #[test]
    fn a_long_message_is_shortened() {
        let name = "x".repeat(100_000);
        let mut diags = Diagnostics::new("m.pipe", "k");
        diags.extend([Diagnostic::error(
            Span::new(0, 1),
            format!("unknown key `{name}`"),
        )]);
        let text = diags.to_string();
        assert!(text.len() < 2 * MAX_MESSAGE_CHARS, "{} bytes", text.len());
        assert!(text.contains("unknown key `xxx") && text.contains('…'));
    }
}
