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
//! A file's checks push into one [`Diagnostics`], so a single run reports every error of the file.

use std::fmt;

use crate::span::{Span, line_at, line_col};

/// One error: a message, the span it points at, and optional label, help and related positions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnostic {
    /// The headline after `error: `.
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
            message: message.into(),
            span,
            label: None,
            help: None,
            related: Vec::new(),
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

/// All errors of one file, with the file's name and text so they can be rendered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnostics {
    file_name: String,
    source: String,
    items: Vec<Diagnostic>,
}

impl Diagnostics {
    /// An empty collection for `file_name` with text `source`.
    pub fn new(file_name: &str, source: &str) -> Self {
        Self {
            file_name: file_name.to_owned(),
            source: source.to_owned(),
            items: Vec::new(),
        }
    }

    /// Adds errors, keeping them ordered by position (stable for errors at the same place).
    pub fn extend(&mut self, diagnostics: impl IntoIterator<Item = Diagnostic>) {
        self.items.extend(diagnostics);
        self.items.sort_by_key(|d| d.span.start);
    }

    /// Number of errors.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// True when there are no errors.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// The errors, in source order.
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
        writeln!(f, "error: {}", d.message)?;
        writeln!(
            f,
            "{gutter}--> {}:{}:{}",
            self.file_name, start.line, start.col
        )?;
        writeln!(f, "{gutter} |")?;
        // Tabs would misalign the carets; show them as single spaces.
        writeln!(f, "{} | {}", start.line, line.replace('\t', " "))?;
        let caret_start = self.source[line_start..d.span.start.max(line_start)]
            .chars()
            .count();
        let span_end = d.span.end.min(line_start + line.len()).max(d.span.start);
        let width = self
            .source
            .get(d.span.start..span_end)
            .map_or(0, |s| s.chars().count())
            .max(1);
        write!(
            f,
            "{gutter} | {}{}",
            " ".repeat(caret_start),
            "^".repeat(width)
        )?;
        match &d.label {
            Some(label) => writeln!(f, " {label}")?,
            None => writeln!(f)?,
        }
        if d.help.is_some() || !d.related.is_empty() {
            writeln!(f, "{gutter} |")?;
        }
        for (span, note) in &d.related {
            let at = line_col(&self.source, span.start);
            writeln!(
                f,
                "{gutter} = note: {note} at {}:{}:{}",
                self.file_name, at.line, at.col
            )?;
        }
        if let Some(help) = &d.help {
            writeln!(f, "{gutter} = help: {help}")?;
        }
        Ok(())
    }
}

impl fmt::Display for Diagnostics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for d in &self.items {
            self.render(d, f)?;
            writeln!(f)?;
        }
        let n = self.items.len();
        write!(
            f,
            "error: `{}` has {n} error{}",
            self.file_name,
            if n == 1 { "" } else { "s" }
        )
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
}
