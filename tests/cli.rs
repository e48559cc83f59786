//! Drives the real `draftpipe` binary: exit codes of `check` and `compile` (0 valid, 1 errors, 2 usage), their
//! output, a `check` of every shipped pipeline, and hostile inputs: devices, FIFOs, huge files, a closed stdout,
//! corrupt summaries.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn draftpipe(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_draftpipe"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("the draftpipe binary runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn every_shipped_pipeline_passes_check() {
    let mut files: Vec<String> =
        std::fs::read_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join("pipelines"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "pipe"))
            .map(|p| format!("pipelines/{}", p.file_name().unwrap().to_str().unwrap()))
            .collect();
    files.sort();
    assert!(
        files.iter().any(|f| f.ends_with("quickstart.pipe"))
            && files.iter().any(|f| f.ends_with("dflash-5x3.pipe"))
    );
    let args: Vec<&str> = std::iter::once("check")
        .chain(files.iter().map(String::as_str))
        .collect();
    let out = draftpipe(&args);
    assert_eq!(out.status.code(), Some(0), "stderr:\n{}", text(&out.stderr));
    for f in &files {
        assert!(
            text(&out.stdout).contains(&format!("ok: {f}")),
            "{f} not reported ok"
        );
    }
}

#[test]
fn check_exits_1_with_all_errors_when_any_file_is_invalid() {
    let out = draftpipe(&[
        "check",
        "pipelines/quickstart.pipe",
        "tests/invalid/many_errors_in_one_file.pipe",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    let golden = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/invalid/many_errors_in_one_file.expected"),
    )
    .unwrap();
    assert!(stderr.contains(golden.trim_end()), "stderr:\n{stderr}");
    assert!(stderr.contains("has 6 errors"));
    assert!(text(&out.stdout).contains("ok: pipelines/quickstart.pipe"));
}

#[test]
fn check_exits_1_on_a_missing_file() {
    let out = draftpipe(&["check", "pipelines/no-such-file.pipe"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("cannot read `pipelines/no-such-file.pipe`"));
}

#[test]
fn usage_errors_exit_2() {
    for args in [
        &[][..],
        &["check"][..],
        &["frobnicate"][..],
        &["compile", "pipelines/quickstart.pipe", "--emit", "yaml"][..],
    ] {
        let out = draftpipe(args);
        assert_eq!(
            out.status.code(),
            Some(2),
            "args {args:?}: stderr {}",
            text(&out.stderr)
        );
    }
}

/// The subcommands `draftpipe --help` lists.
fn subcommands() -> Vec<String> {
    let out = draftpipe(&["--help"]);
    assert_eq!(out.status.code(), Some(0));
    let help = text(&out.stdout);
    let commands = help
        .split("Commands:")
        .nth(1)
        .and_then(|rest| rest.split("\n\n").next())
        .expect("a Commands: section");
    commands
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .filter(|name| *name != "help")
        .map(str::to_owned)
        .collect()
}

#[test]
fn help_exists_on_every_command() {
    let commands = subcommands();
    for expected in ["check", "compile", "run", "diagnose"] {
        assert!(commands.iter().any(|c| c == expected), "{commands:?}");
    }
    for command in &commands {
        let out = draftpipe(&[command, "--help"]);
        assert_eq!(out.status.code(), Some(0), "{command}");
        let usage = format!("Usage: draftpipe {command}");
        assert!(text(&out.stdout).contains(&usage), "{command}");
    }
}

#[test]
fn compile_text_summarises_the_plan() {
    let out = draftpipe(&["compile", "pipelines/dflash-5x3.pipe"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    for needle in [
        "pipeline \"dflash-qwen3-8b\"",
        "on gpu 0..5",
        "on gpu 5..8",
        "capacity 60",
        "model dflash",
        "1,048,626,432 parameters",
        "layers.{i}.mlp.gate_proj.weight             [12288, 4096]     50,331,648      5      251,658,240",
        "memory per device",
        "frozen",
        "gpu 7",
        "cost per step",
        "8192",
        // The GPU time model: a row per bucket, the MFU over the mix, the assumptions with their sources.
        "GPU step model (a model, not a measurement: H200 assumed, precision bf16, CUDA graphs, 3 replicas)",
        "      8192    49.3 ms    93.5 ms     9.3 ms    15.1 ms   167.1 ms",
        "2048 7.0%, 4096 18.6%, 8192 74.4%): 208.7 ms per step, MFU 51.0%",
        "today's f32 CUDA-core kernels at 5-8 TFLOP/s: 1.21-1.93 s",
        "arXiv:2407.08608",
        "nccl-tests/issues/212",
    ] {
        assert!(stdout.contains(needle), "missing `{needle}` in\n{stdout}");
    }
}

#[test]
fn compile_json_carries_the_gpu_model_beside_the_plan() {
    let out = draftpipe(&["compile", "pipelines/dflash-5x3.pipe", "--emit", "json"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("valid JSON");
    let model = &json["gpu_step_model"];
    assert_eq!(model["buckets"].as_array().map(Vec::len), Some(3));
    let mfu = model["mfu"].as_f64().expect("an MFU");
    assert!((0.5..0.55).contains(&mfu), "{mfu}");
    // The plan's own fields are all there: it still reads back as the plan.
    let plan: draftpipe_compiler::Plan = serde_json::from_value(json.clone()).expect("the plan");
    assert_eq!(plan.buckets.len(), 3);
    // A CPU plan has no GPU model.
    let out = draftpipe(&["compile", "pipelines/quickstart.pipe", "--emit", "json"]);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("valid JSON");
    assert!(json.get("gpu_step_model").is_none());
}

#[test]
fn compile_json_is_the_plan() {
    let out = draftpipe(&["compile", "pipelines/quickstart.pipe", "--emit", "json"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let from_cli: draftpipe_compiler::Plan =
        serde_json::from_slice(&out.stdout).expect("valid plan JSON");
    let direct = draftpipe_compiler::compile_file(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("pipelines/quickstart.pipe"),
    )
    .unwrap();
    assert_eq!(from_cli, direct);
}

#[test]
fn compile_exits_1_on_an_invalid_file() {
    let out = draftpipe(&[
        "compile",
        "tests/invalid/unknown_key_typo.pipe",
        "--emit",
        "json",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty());
    assert!(text(&out.stderr).contains("unknown key `capcity`"));
}

/// A fresh directory for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("cli-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs the binary and fails the test (killing it) if it has not exited within `limit`: the inputs these tests
/// give used to make it block or read forever.
fn draftpipe_within(args: &[&str], limit: Duration) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_draftpipe"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > limit {
            child.kill().unwrap();
            let out = child.wait_with_output().unwrap();
            panic!(
                "draftpipe {args:?} still running after {limit:?}; stderr:\n{}",
                text(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// Makes a FIFO at `path` (nothing ever writes to it).
fn fifo(path: &Path) {
    let made = Command::new("mkfifo").arg(path).status().unwrap();
    assert!(made.success());
}

#[test]
fn devices_fifos_and_directories_are_refused_without_blocking() {
    let dir = scratch("non-regular");
    let pipe = dir.join("blocks.pipe");
    fifo(&pipe);
    let run_dir = dir.join("run");
    std::fs::create_dir_all(&run_dir).unwrap();
    fifo(&run_dir.join("summary.json"));
    let limit = Duration::from_secs(30);
    for (args, kind) in [
        (vec!["check", "/dev/zero"], "a character device"),
        (vec!["check", pipe.to_str().unwrap()], "a FIFO"),
        (vec!["compile", pipe.to_str().unwrap()], "a FIFO"),
        (vec!["run", pipe.to_str().unwrap()], "a FIFO"),
        (vec!["check", dir.to_str().unwrap()], "a directory"),
        (vec!["diagnose", run_dir.to_str().unwrap()], "a FIFO"),
    ] {
        let out = draftpipe_within(&args, limit);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(
            stderr.contains(&format!("not a regular file ({kind})")),
            "{args:?}: {stderr}"
        );
    }
}

#[test]
fn a_file_over_the_size_limit_is_refused_at_once() {
    let dir = scratch("huge");
    let path = dir.join("huge.pipe");
    // 200 MB of repeated unknown keys, as a sparse file: the size is what counts.
    let file = std::fs::File::create(&path).unwrap();
    file.set_len(200_000_000).unwrap();
    let out = draftpipe_within(&["check", path.to_str().unwrap()], Duration::from_secs(30));
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("200000000 bytes, over the limit of 1048576 bytes"),
        "{stderr}"
    );
}

#[test]
fn a_file_of_many_errors_prints_the_first_hundred_and_a_count() {
    let dir = scratch("many-errors");
    let path = dir.join("many.pipe");
    // Just under the 1 MiB limit: about 50,000 unknown keys in one section.
    let mut source = String::from("pipeline \"p\"\ntelemetry {\n");
    while source.len() < 1_000_000 {
        source.push_str("    no_such_key = 1\n");
    }
    source.push_str("}\n");
    std::fs::write(&path, &source).unwrap();
    let out = draftpipe_within(&["check", path.to_str().unwrap()], Duration::from_secs(60));
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    let shown = stderr.matches(" --> ").count();
    assert_eq!(shown, 100, "{} bytes of stderr", stderr.len());
    assert!(
        stderr.contains("more errors (the first 100 are shown)"),
        "{}",
        &stderr[stderr.len() - 500..]
    );
    assert!(stderr.len() < 100_000, "{} bytes of stderr", stderr.len());
}

#[test]
fn a_huge_line_is_quoted_as_a_window_around_the_error() {
    let dir = scratch("long-line");
    let path = dir.join("long.pipe");
    let line = format!("pipeline \"p\" {}", "@".repeat(900_000));
    std::fs::write(&path, &line).unwrap();
    let out = draftpipe_within(&["check", path.to_str().unwrap()], Duration::from_secs(30));
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr.len() < 4_000,
        "{} bytes of stderr:\n{}",
        stderr.len(),
        &stderr[..2000]
    );
    assert!(stderr.contains('…') && stderr.contains('^'), "{stderr}");
}

/// Runs the binary with its standard output already closed by the reader, as `draftpipe … | head -0` would.
fn with_closed_stdout(args: &[&str]) -> Output {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    Command::new(env!("CARGO_BIN_EXE_draftpipe"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .unwrap()
}

#[test]
fn a_closed_stdout_ends_compile_check_and_diagnose_quietly() {
    let dir = scratch("closed-stdout");
    let run_dir = dir.join("run");
    std::fs::create_dir_all(&run_dir).unwrap();
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/summary.json"),
        run_dir.join("summary.json"),
    )
    .unwrap();
    for args in [
        vec!["compile", "pipelines/dflash-5x3.pipe"],
        vec!["compile", "pipelines/quickstart.pipe", "--emit", "json"],
        vec!["check", "pipelines/quickstart.pipe"],
        vec!["diagnose", run_dir.to_str().unwrap()],
    ] {
        let out = with_closed_stdout(&args);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {stderr}");
        assert!(stderr.is_empty(), "{args:?}: {stderr}");
    }
    // The check still checks every file after its reader went away, and its exit status says so.
    let out = with_closed_stdout(&[
        "check",
        "pipelines/quickstart.pipe",
        "tests/invalid/unknown_key_typo.pipe",
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("unknown key `capcity`"));
}

#[test]
fn diagnose_refuses_a_summary_with_impossible_values_naming_the_field() {
    let dir = scratch("bad-summary");
    let good: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/summary.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let out = draftpipe(&["diagnose", "tests/data"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    for (name, edit, field) in [
        (
            "negative-wall",
            ("/wall_s", serde_json::json!(-3.0)),
            "`wall_s` is -3",
        ),
        (
            "phase-longer-than-run",
            ("/drafters/0/phases/2/total_s", serde_json::json!(1e300)),
            "`drafters[0].phases`",
        ),
        (
            "negative-phase",
            ("/producers/0/phases/0/total_s", serde_json::json!(-1.0)),
            "`producers[0].phases.produce.total_s` is -1",
        ),
        (
            "huge-blocked",
            ("/queue/producer_blocked_s", serde_json::json!(1e308)),
            "`queue.producer_blocked_s`",
        ),
    ] {
        let mut summary = good.clone();
        *summary.pointer_mut(edit.0).unwrap() = edit.1;
        let run_dir = dir.join(name);
        std::fs::create_dir_all(&run_dir).unwrap();
        std::fs::write(run_dir.join("summary.json"), summary.to_string()).unwrap();
        let out = draftpipe(&["diagnose", run_dir.to_str().unwrap()]);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{name}: {stderr}");
        assert!(
            stderr.starts_with("error: cannot diagnose"),
            "{name}: {stderr}"
        );
        assert!(stderr.contains(field), "{name}: {stderr}");
        assert!(out.stdout.is_empty(), "{name}");
    }
}

#[test]
fn every_command_reports_its_error_once_with_its_causes() {
    let dir = scratch("errors-once");
    for args in [
        vec!["compile", "pipelines/no-such-file.pipe"],
        vec!["run", "pipelines/no-such-file.pipe"],
        vec!["diagnose", dir.to_str().unwrap()],
    ] {
        let out = draftpipe(&args);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let lines: Vec<&str> = stderr.lines().collect();
        assert!(lines[0].starts_with("error: "), "{args:?}: {stderr}");
        assert_eq!(stderr.matches("error:").count(), 1, "{args:?}: {stderr}");
        assert!(
            lines[1..].iter().all(|l| l.starts_with("  Caused by: ")),
            "{args:?}: {stderr}"
        );
    }
}

#[test]
fn report_refuses_a_directory_without_run_files_and_says_where_a_report_went() {
    let dir = std::env::temp_dir().join(format!("draftpipe-cli-report-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let dir_arg = dir.to_str().unwrap();
    let out = draftpipe(&["report", dir_arg]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr)
            .contains("is not a run directory: it holds neither status.jsonl nor summary.json"),
        "{}",
        text(&out.stderr)
    );
    std::fs::copy(
        "runtime/tests/data/report/quickstart-status.jsonl",
        dir.join("status.jsonl"),
    )
    .unwrap();
    let out = draftpipe(&["report", dir_arg]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout)
            .contains("report.html (3 status lines; the run stopped without a summary"),
        "{}",
        text(&out.stdout)
    );
    assert!(dir.join("report.html").is_file());
}
