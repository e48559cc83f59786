//! Byte spans into the source text and their line/column positions.
//!
//! Every AST node carries a [`Span`]; diagnostics turn spans into `file:line:col` and source snippets.

use serde::{Deserialize, Serialize};

/// A half-open byte range `start..end` into the source text (always on `char` boundaries).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct Span {
    /// First byte.
    pub start: usize,
    /// One past the last byte.
    pub end: usize,
}

impl Span {
    /// A span covering `start..end`.
    pub fn new(start: usize, end: usize) -> Self {
        Self { start, end }
    }

    /// The smallest span covering both.
    pub fn join(self, other: Span) -> Span {
        Span::new(self.start.min(other.start), self.end.max(other.end))
    }

    /// The text this span covers.
    pub fn text(self, source: &str) -> &str {
        source.get(self.start..self.end).unwrap_or("")
    }
}

impl From<pest::Span<'_>> for Span {
    fn from(span: pest::Span<'_>) -> Self {
        Span::new(span.start(), span.end())
    }
}

/// A 1-based line and column (columns count `char`s, not bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LineCol {
    /// Line, from 1.
    pub line: usize,
    /// Column in characters, from 1.
    pub col: usize,
}

/// Line and column of byte `offset` in `source` (offsets past the end clamp to the end).
pub fn line_col(source: &str, offset: usize) -> LineCol {
    let offset = floor_char_boundary(source, offset);
    let before = &source[..offset];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    LineCol {
        line,
        col: source[line_start..offset].chars().count() + 1,
    }
}

/// The full text of the line that holds byte `offset`, without its newline, and the line's start offset.
pub fn line_at(source: &str, offset: usize) -> (usize, &str) {
    let offset = floor_char_boundary(source, offset);
    let start = source[..offset].rfind('\n').map_or(0, |i| i + 1);
    let end = source[offset..]
        .find('\n')
        .map_or(source.len(), |i| offset + i);
    (start, source[start..end].trim_end_matches('\r'))
}

fn floor_char_boundary(source: &str, offset: usize) -> usize {
    let mut offset = offset.min(source.len());
    while !source.is_char_boundary(offset) {
        offset -= 1;
    }
    offset
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_and_column_count_chars_from_one() {
        let src = "ab\ncé d\n";
        assert_eq!(line_col(src, 0), LineCol { line: 1, col: 1 });
        assert_eq!(line_col(src, 3), LineCol { line: 2, col: 1 });
        // 'é' is two bytes; the space after it is the third character.
        assert_eq!(line_col(src, 6), LineCol { line: 2, col: 3 });
        assert_eq!(line_col(src, 99), LineCol { line: 3, col: 1 });
        assert_eq!(line_at(src, 4), (3, "cé d"));
    }
}
