//! What the end-to-end tests of the binary share (`tests/run.rs`, `tests/eval.rs`, `tests/reliability.rs`, …): a
//! scratch directory per test, the small pipeline they train, edits of a pipeline file, and running the real
//! `draftpipe`.
#![allow(dead_code)] // each test target uses a different subset

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A fresh directory under the target dir for one test, named `{prefix}-{name}`.
pub fn scratch(prefix: &str, name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("{prefix}-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A synthetic source of short sequences.
pub const SYNTHETIC: &str = "synthetic(seed = 3, lengths = 16..64)";

/// A small pipeline, the quickstart's shape scaled down so a test trains in seconds: `producers` target
/// workers feeding `drafters` CPU drafters from `source` through a queue pulled by `pull`, with the drafter's
/// `steps` limit when given.
pub fn tiny_pipe(
    dir: &Path,
    (producers, drafters): (usize, usize),
    pull: &str,
    source: &str,
    steps: Option<u64>,
) -> PathBuf {
    let steps = steps.map_or(String::new(), |steps| format!("    steps     = {steps}\n"));
    let text = format!(
        r#"pipeline "tiny"

target toy on cpu x{producers} {{
    hidden       = 32
    tap_layers   = [0, 1]
    vocab        = 256
    batch_tokens = 256
    source       = {source}
}}

queue hs from toy to draft {{
    capacity  = 8
    min_ready = 2
    buckets   = [32, 64]
    pull      = {pull}
}}

drafter draft on cpu x{drafters} {{
    model     = mlp(hidden = 64, blocks = 1, intermediate = 128, heads = 2)
    loss      = cross_entropy(head_decay = 0.8, chunk_tokens = 128)
    optimizer = adamw(lr = 3e-3)
{steps}}}

telemetry {{ every = 100ms }}
"#
    );
    let path = dir.join("tiny.pipe");
    std::fs::write(&path, text).unwrap();
    path
}

/// Runs the real binary in `cwd` and waits for it.
pub fn draftpipe(args: &[&str], cwd: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_draftpipe"))
        .args(args)
        .current_dir(cwd)
        .output()
        .expect("the draftpipe binary runs")
}

/// Output bytes as text.
pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Writes `source`'s text with `from` replaced by `to` into `target` (which may be `source` itself); `from` must
/// be there, so an edit that no longer matches the file fails the test instead of testing the unedited file.
pub fn rewrite(source: &Path, from: &str, to: &str, target: &Path) {
    let text = std::fs::read_to_string(source).unwrap();
    assert!(text.contains(from), "{} has no `{from}`", source.display());
    std::fs::write(target, text.replace(from, to)).unwrap();
}
