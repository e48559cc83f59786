//! How `build.rs` tells the user that this build carries no GPU kernels: once, when the build script runs.
//!
//! ```text
//!  build.rs: no PTX (reason) ──announce──▶ the build's terminal (/dev/tty): one line, now
//!                                      └──▶ no terminal (CI, an IDE): `cargo:warning=…` for cargo's log
//! ```
//!
//! Cargo keeps every `cargo:warning=` line of a build script in `target/…/build/<pkg>-<hash>/output` and prints
//! it again on every later build of a workspace package, the build script cached or not (cargo 1.95: `cargo
//! run` with nothing to rebuild still printed it). So a warning given that way appears on every `cargo run`.
//! A line written to the terminal running the build is neither captured nor replayed: it appears once, when the
//! script actually runs (the first build, or after `build.rs`, the kernels or `DRAFTPIPE_NO_PTX` change). Only
//! without a terminal does the notice go through cargo, whose log is then the only place a reader would look.
//! Shared with `runtime/tests/build_notice.rs` through `#[path]`.

use std::io::Write;

/// The notice for a build without PTX, as the user reads it.
pub fn notice(reason: &str) -> String {
    format!("building without GPU kernels: {reason}")
}

/// Says `reason` once: on `terminal` when the build has one (nothing is then left for cargo to replay), else as
/// the `cargo:warning` directive returned for the build script to print.
pub fn announce(reason: &str, terminal: Option<&mut dyn Write>) -> Option<String> {
    let text = notice(reason);
    if let Some(terminal) = terminal {
        // `\r` and erase-line: start clear of cargo's progress bar, which it redraws below.
        if writeln!(terminal, "\r\x1b[Kwarning: draftpipe-runtime: {text}")
            .and_then(|()| terminal.flush())
            .is_ok()
        {
            return None;
        }
    }
    Some(format!("cargo:warning={text}"))
}
