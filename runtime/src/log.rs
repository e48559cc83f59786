//! Lines for the operator on standard error, written so that logging can never take the run down.
//!
//! ```text
//!  stream server events, warnings, the binary's error report ──log_line!──▶ stderr (one write per line)
//! ```
//!
//! `eprintln!` panics when standard error cannot be written (a closed pipe: EPIPE); in a stream handshake
//! thread that left a slot marked connected with no one serving it, and in the binary it turned exit 1 into
//! 101. A line that cannot be written is lost; the run and its exit code are not.

use std::io::Write;

/// Writes `line` and a newline to standard error in one write, ignoring any error.
pub fn write_line(line: std::fmt::Arguments<'_>) {
    let mut text = line.to_string();
    text.push('\n');
    let _ = std::io::stderr().lock().write_all(text.as_bytes());
}

/// `eprintln!` that never panics: formats its arguments as `format!` does and writes them with
/// [`write_line`](crate::log::write_line).
#[macro_export]
macro_rules! log_line {
    ($($arg:tt)*) => {
        $crate::log::write_line(::std::format_args!($($arg)*))
    };
}
