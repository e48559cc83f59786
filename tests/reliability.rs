//! The run's promise as an operator under a batch system meets it, through the real binary: a signal stops a
//! stream run whose producers never came, a closed standard error changes no exit code, file-size and memory
//! limits are errors that keep the previous checkpoint, and output paths that would collide are refused before
//! the first step.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

mod binary_support;

use binary_support::{SYNTHETIC, draftpipe, text};
use draftpipe_compiler::compile_file;
use draftpipe_runtime::checkpoint::load_checkpoint;

fn scratch(name: &str) -> PathBuf {
    binary_support::scratch("reliability", name)
}

/// A small pipeline, fed by `source` (a stream leaves a watermark of 2 that one message cannot meet).
fn tiny_pipe(dir: &Path, source: &str) -> PathBuf {
    binary_support::tiny_pipe(dir, (1, 1), "fifo", source, None)
}

fn stream_source(dir: &Path) -> String {
    format!(
        r#"stream(listen = "unix:{}")"#,
        dir.join("hs.sock").display()
    )
}

/// [`draftpipe`], failing the test when the command is still running after `limit` (it was training).
fn draftpipe_within(args: &[&str], cwd: &Path, limit: Duration) -> Output {
    let mut child = KillOnDrop(
        Command::new(env!("CARGO_BIN_EXE_draftpipe"))
            .args(args)
            .current_dir(cwd)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let started = Instant::now();
    while child.0.try_wait().unwrap().is_none() {
        assert!(
            started.elapsed() < limit,
            "draftpipe {args:?} still running after {limit:?}: it trained instead of refusing"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut stderr = Vec::new();
    std::io::Read::read_to_end(child.0.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    Output {
        status: child.0.wait().unwrap(),
        stdout: Vec::new(),
        stderr,
    }
}

/// A pipe whose reading end is closed: writing to it fails with EPIPE.
fn broken_pipe() -> std::io::PipeWriter {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    writer
}

/// A child killed if the test fails before it is waited for.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts a stream run in `dir` (stderr to `stderr`) and waits until it listens and has written a status line:
/// it is running, its drafters waiting for data.
fn start_stream_run(dir: &Path, stderr: Stdio) -> KillOnDrop {
    let pipe = tiny_pipe(dir, &stream_source(dir));
    let child = Command::new(env!("CARGO_BIN_EXE_draftpipe"))
        .args(["run", pipe.to_str().unwrap(), "--save", "ckpt"])
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .unwrap();
    let started = Instant::now();
    let status_log = dir.join("runs/tiny/status.jsonl");
    let has_a_line = || std::fs::read_to_string(&status_log).is_ok_and(|log| log.contains('\n'));
    while !(dir.join("hs.sock").exists() && has_a_line()) {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "never listened and wrote a status line"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    KillOnDrop(child)
}

/// Sends SIGTERM and waits at most 10 s for the exit; returns the exit code and the seconds it took.
fn terminate(child: &mut KillOnDrop) -> (Option<i32>, f64) {
    let sent = Command::new("kill")
        .args(["-TERM", &child.0.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    let sent_at = Instant::now();
    loop {
        if let Some(status) = child.0.try_wait().unwrap() {
            return (status.code(), sent_at.elapsed().as_secs_f64());
        }
        assert!(
            sent_at.elapsed() < Duration::from_secs(10),
            "still running 10 s after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn summary_reason(dir: &Path) -> serde_json::Value {
    let summary = std::fs::read_to_string(dir.join("runs/tiny/summary.json")).unwrap();
    serde_json::from_str::<serde_json::Value>(&summary).unwrap()["ending"]["reason"].clone()
}

#[test]
fn sigterm_stops_a_stream_run_whose_producers_never_connected() {
    let dir = scratch("sigterm-stream");
    let mut child = start_stream_run(&dir, Stdio::null());
    let (code, seconds) = terminate(&mut child);
    assert_eq!(code, Some(143));
    assert!(seconds < 3.0, "{seconds:.1} s from SIGTERM to exit");
    assert_eq!(summary_reason(&dir), "interrupted");
}

#[test]
fn a_closed_stderr_changes_no_exit_code() {
    let dir = scratch("closed-stderr");
    std::fs::write(dir.join("bad.pipe"), "pipeline \"bad\"\ntarget {\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_draftpipe"))
        .args(["check", "bad.pipe"])
        .current_dir(&dir)
        .stderr(broken_pipe())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    // The stream server logs every connection: with stderr closed it still listens, and stops at a signal.
    let mut child = start_stream_run(&dir, broken_pipe().into());
    let (code, _) = terminate(&mut child);
    assert_eq!(code, Some(143));
    assert_eq!(summary_reason(&dir), "interrupted");
}

#[test]
fn a_file_size_limit_fails_the_save_and_keeps_the_previous_checkpoint() {
    let dir = scratch("ulimit-f");
    let pipe = tiny_pipe(&dir, SYNTHETIC);
    let first = draftpipe(
        &["run", "tiny.pipe", "--steps", "3", "--save", "ckpt"],
        &dir,
    );
    assert!(first.status.success(), "{}", text(&first.stderr));
    // 64 blocks of 512 bytes (dash) or 1024 (bash): above the run directory's files, below the weights.
    let limited = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ulimit -f 64 && exec '{}' run tiny.pipe --steps 6 --save ckpt",
            env!("CARGO_BIN_EXE_draftpipe")
        ))
        .current_dir(&dir)
        .output()
        .unwrap();
    let stderr = text(&limited.stderr);
    assert_eq!(limited.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("ulimit -f"), "{stderr}");
    assert!(
        stderr.contains("the previous checkpoint is kept in ckpt"),
        "{stderr}"
    );
    let plan = compile_file(&pipe).unwrap();
    let kept = load_checkpoint(&dir.join("ckpt"), &plan.model).unwrap();
    assert_eq!(kept.state.step, 3);
    assert!(!dir.join("ckpt.tmp").exists());
}

#[test]
fn save_paths_that_collide_with_the_run_directory_are_refused_before_training() {
    let dir = scratch("save-conflicts");
    tiny_pipe(&dir, SYNTHETIC);
    std::fs::create_dir_all(dir.join("stale.prev")).unwrap();
    std::fs::write(dir.join("stale.prev/notes.txt"), "mine").unwrap();
    for (args, expected) in [
        (
            &["--save", "out", "--run-dir", "out"][..],
            "is the checkpoint directory or inside it",
        ),
        (
            &["--save", "out", "--run-dir", "out/run"][..],
            "is the checkpoint directory or inside it",
        ),
        (
            &["--save", "out", "--run-dir", "./out.prev"][..],
            "SAVE.tmp or SAVE.prev",
        ),
        (
            &["--save", "out", "--run-dir", "out.tmp"][..],
            "SAVE.tmp or SAVE.prev",
        ),
        (
            &["--save", "stale"][..],
            "stale.prev exists and is not a checkpoint",
        ),
    ] {
        let mut all = vec!["run", "tiny.pipe", "--steps", "100000"];
        all.extend_from_slice(args);
        let out = draftpipe_within(&all, &dir, Duration::from_secs(20));
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
    assert_eq!(
        std::fs::read_to_string(dir.join("stale.prev/notes.txt")).unwrap(),
        "mine"
    );
}

#[test]
fn an_address_space_limit_below_the_plan_is_a_clear_error() {
    let dir = scratch("ulimit-v");
    // A queue of 16384 items of 256 tokens × 64 values: about 1 GiB of pooled hidden states.
    let pipe = tiny_pipe(&dir, SYNTHETIC);
    let text_of_pipe = std::fs::read_to_string(&pipe)
        .unwrap()
        .replace("capacity  = 8", "capacity  = 16384");
    std::fs::write(&pipe, text_of_pipe).unwrap();
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ulimit -v 524288 && exec '{}' run tiny.pipe --steps 1",
            env!("CARGO_BIN_EXE_draftpipe")
        ))
        .current_dir(&dir)
        .output()
        .unwrap();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("host memory but") && stderr.contains("ulimit -v"),
        "{stderr}"
    );
}
