//! The acceptance check of `draftpipe run` (`acceptance { ... }`), driven through the real binary: the
//! schedule (every N steps, the export without optimizer state), the status-line column and `summary.json`,
//! a check still running skips the next one and the end waits for it, a failing or missing command is a
//! warning and the run goes on, the timeout, and a signal kills the running check.
//!
//! The command here is a stand-in for the draft-and-verify loop: `standin.sh`, given as the interpreter
//! (`DRAFTPIPE_PYTHON`), takes the loop's arguments and writes figures of the loop's `--json` shape whose τ
//! is `1.5 + step / 1000` (the gap `1 − τ / 2` to match, as the run checks), so each row can be told apart.
//! The real loop runs in `scripts/acceptance-walk.sh --tiny` (CI's Python tests), which requires the run's τ
//! to equal the stand-alone loop's on the same export.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

mod binary_support;

use binary_support::{scratch, text};

/// The stand-in for `python -m draftpipe_client.speculative`: checks its arguments and the export, then acts
/// as `STANDIN_MODE` says (`ok`, `fail`, `garbage`) after sleeping `STANDIN_SLEEP` seconds.
const STANDIN: &str = r#"#!/bin/sh
[ "$1 $2" = "-m draftpipe_client.speculative" ] || { echo "not the loop's module: $*" >&2; exit 9; }
shift 2
while [ $# -gt 0 ]; do
    case "$1" in
        --draft) draft=$2 ;;
        --json) json=$2 ;;
        --target|--prompts|--max-new-tokens) ;;
        *) echo "unexpected argument $1" >&2; exit 9 ;;
    esac
    shift 2
done
echo $$ > "$draft.pid"
[ -f "$draft/config.json" ] && [ -f "$draft/model.safetensors" ] || { echo "no export in $draft" >&2; exit 8; }
[ -e "$draft/training_state" ] && { echo "optimizer state in the export" >&2; exit 8; }
sleep "${STANDIN_SLEEP:-0}"
step=${draft##*step-}
case "${STANDIN_MODE:-ok}" in
    fail) echo "Traceback (most recent call last):" >&2; echo "SpeculativeError: stand-in failure at step $step" >&2; exit 1 ;;
    garbage) echo "{not json" > "$json" ;;
    *) milli=$((1500 + step)) gap=$((2500 - 5 * step))
       printf '{"tau": %d.%03d, "teacher_forced_tau_exact": 2.25, "teacher_forced_tau_simulated": 2.0, "gap": 0.%04d, "acceptance_by_position": [0.5, 0.25, 0.1], "target_forwards_per_token": 0.7, "prompts": 4, "generated_tokens": 96}\n' $((milli / 1000)) $((milli % 1000)) $gap > "$json" ;;
esac
"#;

/// A scratch directory holding the DFlash quickstart with an `acceptance` section (`every` steps, `extra`
/// settings), its producers slowed to `rate` batches per second so steps come at a known pace, a target
/// directory, a prompts file and the stand-in.
fn setup(name: &str, every: u64, rate: u32, extra: &str) -> PathBuf {
    let dir = scratch("acceptance", name);
    let quickstart = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("pipelines/dflash-quickstart.pipe"),
    )
    .unwrap();
    let pipe = quickstart
        .replace(
            "    source       = synthetic",
            &format!("    max_rate     = {rate}\n    source       = synthetic"),
        )
        .replace(
            "telemetry { every = 1s }",
            "telemetry { every = 200ms  trace = \"trace.json\" }",
        )
        + &format!(
            "\nacceptance {{\n    target = \"target-model\"\n    prompts = \"held-out.jsonl\"\n    every = {every}\n    {extra}\n}}\n"
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

/// `draftpipe run run.pipe --steps STEPS` in `dir` with the stand-in as the interpreter and `env` set.
fn run(dir: &Path, steps: u64, env: &[(&str, &str)]) -> Output {
    command(dir, steps, env).output().unwrap()
}

fn command(dir: &Path, steps: u64, env: &[(&str, &str)]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_draftpipe"));
    command
        .args(["run", "run.pipe", "--steps", &steps.to_string()])
        .current_dir(dir)
        .env("DRAFTPIPE_PYTHON", dir.join("standin.sh"))
        .envs(env.iter().copied());
    command
}

fn summary(dir: &Path) -> serde_json::Value {
    let path = dir.join("runs/dflash-quickstart/summary.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn steps_of(rows: &serde_json::Value) -> Vec<u64> {
    rows.as_array()
        .unwrap()
        .iter()
        .map(|row| row["step"].as_u64().or(row.as_u64()).unwrap())
        .collect()
}

#[test]
fn checks_run_every_n_steps_on_the_export_and_show_in_the_status_line_and_the_summary() {
    // 10 batches per second per producer: a due step comes every 0.5 s or more, time for the stand-in to finish
    // on a loaded machine, so every due step is measured.
    let dir = setup("schedule", 10, 10, "max_new_tokens = 24");
    let out = run(&dir, 40, &[]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "stderr:\n{stderr}");
    let record = &summary(&dir)["acceptance"];
    assert_eq!(record["every"], 10, "{record}");
    assert_eq!(
        steps_of(&record["measurements"]),
        [10, 20, 30, 40],
        "{record}"
    );
    assert_eq!(record["failures"].as_array().unwrap().len(), 0, "{record}");
    let last = &record["measurements"][3];
    assert!(
        (last["tau"].as_f64().unwrap() - 1.540).abs() < 1e-12,
        "{last}"
    );
    assert_eq!(last["teacher_forced_tau_simulated"], 2.0);
    assert_eq!(last["teacher_forced_tau_exact"], 2.25);
    assert_eq!(last["acceptance_by_position"].as_array().unwrap().len(), 3);
    assert_eq!(
        (last["prompts"].as_u64(), last["generated_tokens"].as_u64()),
        (Some(4), Some(96))
    );
    assert!(last["wall_s"].as_f64().unwrap() > 0.0);
    // Only the newest export keeps its weights; every check's figures and output stay.
    let checks = dir.join("runs/dflash-quickstart/acceptance");
    assert!(checks.join("step-40/model.safetensors").is_file());
    assert!(!checks.join("step-10").exists());
    assert!(checks.join("step-10.json").is_file() && checks.join("step-10.log").is_file());
    // The column: in the plain status lines and in status.jsonl.
    assert!(stdout.contains("| accept τ 1.5"), "stdout:\n{stdout}");
    assert!(
        stderr.contains("acceptance: step 40: τ 1.540, teacher-forced 2.000"),
        "{stderr}"
    );
    let status = std::fs::read_to_string(dir.join("runs/dflash-quickstart/status.jsonl")).unwrap();
    let final_line: serde_json::Value =
        serde_json::from_str(status.lines().last().unwrap()).unwrap();
    assert_eq!(final_line["acceptance"]["step"], 40, "{final_line}");
    let trace = std::fs::read_to_string(dir.join("trace.json")).unwrap();
    assert!(
        trace.contains("\"name\":\"acceptance τ\""),
        "a counter track in the trace"
    );
}

#[test]
fn a_check_still_running_skips_the_next_due_step_and_the_end_waits_for_it() {
    // Checks every 5 steps take 1 s each while the producers hold the run to at most 10 batches per second
    // each (60 steps: at least 3 s however fast the drafter is), so a due step often finds the previous check
    // running, and later checks still start after skipped ones.
    let dir = setup("busy", 5, 10, "");
    let started = Instant::now();
    let out = run(&dir, 60, &[("STANDIN_SLEEP", "1.0")]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "stderr:\n{stderr}");
    let record = &summary(&dir)["acceptance"];
    let (measured, skipped) = (
        steps_of(&record["measurements"]),
        steps_of(&record["skipped_busy"]),
    );
    assert!(measured.len() >= 2 && !skipped.is_empty(), "{record}");
    assert_eq!(measured[0], 5, "{record}");
    assert_eq!(
        measured.len() + skipped.len(),
        12,
        "every due step is measured or skipped: {record}"
    );
    assert!(stderr.contains("is still running at step"), "{stderr}");
    assert!(started.elapsed() < Duration::from_secs(60));

    // A check due at the last step outlives training (1.5 s against a few ms): the run's end waits for it and
    // records it.
    let dir = setup("busy-end", 30, 40, "");
    let out = run(&dir, 30, &[("STANDIN_SLEEP", "1.5")]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "stderr:\n{stderr}");
    assert!(
        stderr.contains("acceptance: waiting for the check of step 30"),
        "{stderr}"
    );
    assert_eq!(steps_of(&summary(&dir)["acceptance"]["measurements"]), [30]);
}

#[test]
fn a_failing_missing_or_garbled_check_is_a_warning_and_the_run_goes_on() {
    let dir = setup("failures", 10, 40, "");
    let out = run(&dir, 20, &[("STANDIN_MODE", "fail")]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "stderr:\n{stderr}");
    assert!(
        stderr.contains("warning: acceptance: the check of step 10 gave no figures"),
        "{stderr}"
    );
    assert!(
        stderr.contains("draftpipe_client.speculative --draft"),
        "names the command: {stderr}"
    );
    assert!(stderr.contains("exited with status 1"), "{stderr}");
    assert!(
        stderr.contains("SpeculativeError: stand-in failure at step 10"),
        "quotes its stderr: {stderr}"
    );
    let record = &summary(&dir)["acceptance"];
    assert_eq!(steps_of(&record["failures"]), [10, 20], "{record}");
    assert_eq!(record["measurements"].as_array().unwrap().len(), 0);

    let out = run(&dir, 10, &[("DRAFTPIPE_PYTHON", "/nonexistent/python3")]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "stderr:\n{stderr}");
    assert!(
        stderr.contains("cannot start `/nonexistent/python3 -m draftpipe_client.speculative"),
        "{stderr}"
    );
    assert!(
        stderr.contains("DRAFTPIPE_PYTHON"),
        "says how to name one: {stderr}"
    );

    let out = run(&dir, 10, &[("STANDIN_MODE", "garbage")]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "stderr:\n{stderr}");
    assert!(
        stderr.contains("step-10.json is not the loop's figures"),
        "{stderr}"
    );
}

#[test]
fn a_check_past_its_timeout_is_killed() {
    let dir = setup("timeout", 10, 40, "timeout = 1s");
    let started = Instant::now();
    let out = run(&dir, 10, &[("STANDIN_SLEEP", "60")]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "stderr:\n{stderr}");
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "the wait is bounded by the timeout"
    );
    assert!(
        stderr.contains("was killed: it ran past the acceptance section's timeout (1 s)"),
        "{stderr}"
    );
    let pid =
        std::fs::read_to_string(dir.join("runs/dflash-quickstart/acceptance/step-10.pid")).unwrap();
    assert!(!alive(pid.trim()), "the stand-in {pid} was left running");
}

#[test]
fn a_signal_kills_the_running_check_saves_and_exits() {
    let dir = setup("signal", 10, 40, "");
    let mut child = command(&dir, 100_000, &[("STANDIN_SLEEP", "120")])
        .args(["--save", "ckpt"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid_file = dir.join("runs/dflash-quickstart/acceptance/step-10.pid");
    // The stand-in's `echo $$ >` creates the file before it writes the pid: wait for the whole line.
    let started = Instant::now();
    let check = loop {
        let written = std::fs::read_to_string(&pid_file).unwrap_or_default();
        if written.ends_with('\n') && written.trim().parse::<u32>().is_ok() {
            break written;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the check wrote no pid to {} within 60 s",
            pid_file.display()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(alive(check.trim()), "the check runs in the background");
    let sent = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    assert!(sent.unwrap().success());
    let signalled = Instant::now();
    let status = child.wait().unwrap();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert_eq!(status.code(), Some(143), "stderr:\n{stderr}");
    assert!(
        signalled.elapsed() < Duration::from_secs(20),
        "exits promptly"
    );
    assert!(!alive(check.trim()), "the check {check} was left running");
    assert!(
        stderr.contains("was killed: the run was interrupted"),
        "{stderr}"
    );
    assert!(
        dir.join("ckpt/model.safetensors").is_file(),
        "the run saved"
    );
    let record = &summary(&dir)["acceptance"];
    assert_eq!(steps_of(&record["failures"])[0], 10, "{record}");
}

/// Whether process `pid` exists (and is not a zombie: a reaped child is gone).
fn alive(pid: &str) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        !stat
            .split(") ")
            .nth(1)
            .is_some_and(|rest| rest.starts_with('Z'))
    })
}
