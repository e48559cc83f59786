//! The acceptance check against a hostile child, driven through the real binary: a FIFO, a device or a huge
//! file where the figures should be, a child that prints hundreds of megabytes or bytes that are not UTF-8,
//! one that leaves processes behind, and one that reports impossible figures. The run must end, stay small,
//! leave nothing running, and record none of it as a measurement.
//!
//! The child is a stand-in for `python -m draftpipe_client.speculative` (given as the interpreter through
//! `DRAFTPIPE_PYTHON`, as in `tests/acceptance.rs`): it takes the loop's arguments and runs the shell snippet in
//! `STANDIN_ACTION`, which sees `$json` (the figures path), `$draft` (the export), `$step` and `$good` (figures
//! of the loop's shape that pass every check).

use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

mod binary_support;

use binary_support::{scratch, text};
use draftpipe_runtime::acceptance::{KEPT_CHECKS, LOG_HEAD_BYTES, LOG_TAIL_BYTES};

const STANDIN: &str = r#"#!/bin/sh
shift 2
while [ $# -gt 0 ]; do
    case "$1" in
        --draft) draft=$2 ;;
        --json) json=$2 ;;
    esac
    shift 2
done
step=${draft##*step-}
good='{"tau": 1.5, "teacher_forced_tau": 2.0, "gap": 0.25, "acceptance_by_position": [0.3, 0.2], "target_forwards_per_token": 0.7, "prompts": 4, "generated_tokens": 96}'
eval "$STANDIN_ACTION"
"#;

/// How long any run here may take before the test calls it hung (a run takes seconds).
const HUNG: Duration = Duration::from_secs(120);

/// A scratch directory holding the DFlash quickstart with a check every `every` steps, its producers held to
/// `rate` batches per second, a target directory, a prompts file and the stand-in.
fn setup(name: &str, every: u64, rate: u32) -> PathBuf {
    let dir = scratch("reliability-acceptance", name);
    let quickstart = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("pipelines/dflash-quickstart.pipe"),
    )
    .unwrap();
    let pipe = quickstart.replace(
        "    source       = synthetic",
        &format!("    max_rate     = {rate}\n    source       = synthetic"),
    ) + &format!(
        "\nacceptance {{\n    target = \"target-model\"\n    prompts = \"held-out.jsonl\"\n    every = {every}\n}}\n"
    );
    std::fs::write(dir.join("run.pipe"), pipe).unwrap();
    std::fs::create_dir_all(dir.join("target-model")).unwrap();
    std::fs::write(dir.join("target-model/config.json"), "{}").unwrap();
    std::fs::write(dir.join("held-out.jsonl"), "{\"text\": \"def f():\"}\n").unwrap();
    let standin = dir.join("standin.sh");
    std::fs::write(&standin, STANDIN).unwrap();
    let made = Command::new("chmod").arg("+x").arg(&standin).status();
    assert!(made.unwrap().success());
    dir
}

/// `draftpipe run run.pipe --steps STEPS` in `dir` with the stand-in doing `action`, not started yet.
fn command(dir: &Path, steps: u64, action: &str) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_draftpipe"));
    command
        .args(["run", "run.pipe", "--steps", &steps.to_string()])
        .current_dir(dir)
        .env("DRAFTPIPE_PYTHON", dir.join("standin.sh"))
        .env("STANDIN_ACTION", action)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    command
}

/// Runs to the end, failing the test (and killing the run) if it has not ended within [`HUNG`].
fn run(dir: &Path, steps: u64, action: &str) -> Output {
    let child = command(dir, steps, action).spawn().unwrap();
    let id = child.id();
    let (done, ended) = mpsc::channel();
    let waiter = std::thread::spawn(move || {
        let output = child.wait_with_output();
        let _ = done.send(());
        output
    });
    if ended.recv_timeout(HUNG).is_err() {
        let _ = Command::new("kill")
            .args(["-KILL", &id.to_string()])
            .status();
        panic!("the run did not end within {HUNG:?} (action: {action})");
    }
    waiter.join().unwrap().unwrap()
}

fn summary(dir: &Path) -> serde_json::Value {
    let path = dir.join("runs/dflash-quickstart/summary.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn checks_dir(dir: &Path) -> PathBuf {
    dir.join("runs/dflash-quickstart/acceptance")
}

/// The run exited 0 and recorded the check of step 10 as failed (no measurement), with a reason containing
/// `expected`, which the warning on stderr quotes too.
fn assert_failed_with(dir: &Path, out: &Output, expected: &str) {
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "stderr:\n{stderr}");
    assert!(
        stderr.contains("warning: acceptance: the check of step 10 gave no figures"),
        "{stderr}"
    );
    assert!(
        stderr.contains(expected),
        "expected `{expected}` in:\n{stderr}"
    );
    let record = &summary(dir)["acceptance"];
    assert_eq!(
        record["measurements"].as_array().unwrap().len(),
        0,
        "{record}"
    );
    let failure = &record["failures"][0];
    assert_eq!(failure["step"], 10, "{record}");
    assert!(
        failure["reason"].as_str().unwrap().contains(expected),
        "{record}"
    );
}

#[test]
fn a_fifo_a_device_or_a_huge_file_where_the_figures_should_be_is_refused_and_the_run_ends() {
    let dir = setup("figures-file", 10, 40);
    let cases = [
        // Opening a FIFO for reading waits for a writer that never comes: the run used to wait forever.
        ("mkfifo \"$json\"", "not a regular file (a FIFO)"),
        (
            "ln -s /dev/zero \"$json\"",
            "not a regular file (a character device)",
        ),
        (
            "head -c 2000000 /dev/zero | tr '\\0' ' ' > \"$json\"",
            "2000000 bytes or more, over the limit of 1048576 bytes",
        ),
    ];
    for (action, expected) in cases {
        let out = run(&dir, 10, action);
        assert_failed_with(&dir, &out, expected);
        assert!(
            text(&out.stderr).contains("exited 0 but its figures were refused"),
            "{}",
            text(&out.stderr)
        );
    }
}

#[test]
fn a_check_that_prints_hundreds_of_megabytes_costs_a_capped_log_and_little_memory() {
    let dir = setup("flood", 10, 10);
    // 200 MB of output, then the line a failure must quote: the whole output used to be read back for it.
    let action = "yes 'a line of a check that prints without end, fifty bytes' | head -c 200000000; \
                  echo 'SpeculativeError: the last line of the flood'; exit 1";
    let mut child = command(&dir, 1_000_000, action).spawn().unwrap();
    let pid = child.id();
    let lines = stderr_lines(&mut child);
    // Observe the failure's whole warning (its tail has been read), then the run's peak memory while it still
    // runs.
    let deadline = Instant::now() + HUNG;
    let mut stderr = String::new();
    while !stderr.contains("(the run goes on)") {
        let Ok(line) = lines.recv_timeout(deadline.saturating_duration_since(Instant::now()))
        else {
            let _ = child.kill();
            panic!("no failure of step 10 within {HUNG:?}; stderr:\n{stderr}");
        };
        stderr += &line;
        stderr += "\n";
    }
    let peak_kib = peak_rss_kib(pid);
    eprintln!("the run's peak RSS after a 200 MB output: {peak_kib} KiB");
    let _ = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(143));
    assert!(
        stderr.contains("SpeculativeError: the last line of the flood"),
        "the quote is the output's end: {stderr}"
    );
    assert!(
        peak_kib < 150 * 1024,
        "the run peaked at {peak_kib} KiB after a 200 MB output"
    );
    let log = checks_dir(&dir).join("step-10.log");
    let size = std::fs::metadata(&log).unwrap().len();
    assert!(
        size <= (LOG_HEAD_BYTES + LOG_TAIL_BYTES + 200) as u64,
        "the log holds {size} bytes"
    );
    let logged = std::fs::read(&log).unwrap();
    let logged = String::from_utf8_lossy(&logged);
    assert!(
        logged.contains("bytes of this output left out here")
            && logged.ends_with("SpeculativeError: the last line of the flood\n"),
        "the log says what it left out and ends with the output's end"
    );
}

#[test]
fn only_the_newest_checks_keep_their_log_and_figures() {
    let dir = setup("kept", 4, 10);
    let out = run(
        &dir,
        48,
        "echo \"check of step $step\"; echo \"$good\" > \"$json\"",
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let record = &summary(&dir)["acceptance"];
    let mut started: Vec<u64> = ["measurements", "failures"]
        .iter()
        .flat_map(|key| record[key].as_array().unwrap().iter())
        .map(|check| check["step"].as_u64().unwrap())
        .collect();
    started.sort_unstable();
    let newest: Vec<u64> = started
        .iter()
        .rev()
        .take(KEPT_CHECKS)
        .rev()
        .copied()
        .collect();
    let mut logs: Vec<u64> = std::fs::read_dir(checks_dir(&dir))
        .unwrap()
        .filter_map(|entry| {
            let name = entry.unwrap().file_name().into_string().unwrap();
            name.strip_prefix("step-")?
                .strip_suffix(".log")?
                .parse()
                .ok()
        })
        .collect();
    logs.sort_unstable();
    assert_eq!(logs, newest, "the logs kept, of the checks {started:?}");
    for step in &started[..started.len() - newest.len()] {
        assert!(!checks_dir(&dir).join(format!("step-{step}.json")).exists());
    }
}

#[test]
fn processes_the_check_started_are_killed_when_it_exits_by_itself() {
    let dir = setup("group", 10, 40);
    let action =
        "sleep 300 >/dev/null 2>&1 & echo $! > \"$draft.left-behind\"; echo \"$good\" > \"$json\"";
    let out = run(&dir, 10, action);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "stderr:\n{stderr}");
    assert!(stderr.contains("acceptance: step 10: τ 1.500"), "{stderr}");
    let pid = std::fs::read_to_string(checks_dir(&dir).join("step-10.left-behind")).unwrap();
    let pid = pid.trim();
    // The kill is sent before the run exits; its delivery is the kernel's, so allow it a moment.
    let deadline = Instant::now() + Duration::from_secs(20);
    while alive(pid) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    if alive(pid) {
        let _ = Command::new("kill").args(["-KILL", pid]).status();
        panic!("the check's `sleep 300` (pid {pid}) outlived the run");
    }
}

#[test]
fn impossible_figures_fail_the_check_naming_the_field_and_the_value() {
    let dir = setup("impossible", 10, 40);
    let cases = [
        ("\"tau\": 1.5", "\"tau\": -5", "`tau` is -5, not in [1, 3]"),
        (
            "\"gap\": 0.25",
            "\"gap\": -4",
            "`gap` is -4, but 1 − tau / teacher_forced_tau_simulated is 0.25",
        ),
        (
            "\\[0.3, 0.2\\]",
            "[1.5, 0.2]",
            "`acceptance_by_position[0]` is 1.5, not a share in [0, 1]",
        ),
        (
            "\"generated_tokens\": 96",
            "\"generated_tokens\": 2",
            "`generated_tokens` is 2, fewer than the 4 prompts",
        ),
    ];
    for (from, to, expected) in cases {
        let action = format!("echo \"$good\" | sed 's/{from}/{to}/' > \"$json\"");
        let out = run(&dir, 10, &action);
        assert_failed_with(&dir, &out, expected);
        assert!(text(&out.stderr).contains("reports impossible figures"));
    }
}

#[test]
fn output_that_is_not_utf8_is_quoted_lossily() {
    let dir = setup("not-utf8", 10, 40);
    let action = "printf 'Traceback\\n\\377\\376 SpeculativeError: bytes \\377 of latin-1 caf\\351\\n' >&2; exit 1";
    let out = run(&dir, 10, action);
    assert_failed_with(
        &dir,
        &out,
        "SpeculativeError: bytes \u{FFFD} of latin-1 caf\u{FFFD}",
    );
    assert!(!text(&out.stderr).contains("(nothing)"));
}

/// The run's standard error, line by line, from a thread.
fn stderr_lines(child: &mut Child) -> mpsc::Receiver<String> {
    let stderr = child.stderr.take().unwrap();
    let (send, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if send.send(line).is_err() {
                break;
            }
        }
    });
    lines
}

/// The peak resident memory of the running process `pid` (`VmHWM`), in KiB.
fn peak_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|value| value.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// Whether process `pid` exists (and is not a zombie).
fn alive(pid: &str) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        !stat
            .split(") ")
            .nth(1)
            .is_some_and(|rest| rest.starts_with('Z'))
    })
}
