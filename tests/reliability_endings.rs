//! How a run begins and ends, through the real binary (issue 33): a lockstep run whose data never fills a round
//! says it trained nothing and exits 3; a resume at the step limit is refused as a run that did not start and
//! leaves no run directory; a resumed run says so and counts on from its step; every save is one line; a
//! telemetry file that cannot be written is one warning while the training, the checkpoint and the summary go on.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

mod binary_support;

use binary_support::{SYNTHETIC, draftpipe, text, tiny_pipe};
use draftpipe_compiler::compile_file;
use draftpipe_runtime::checkpoint::load_checkpoint;

fn scratch(name: &str) -> PathBuf {
    binary_support::scratch("endings", name)
}

/// Checks that `out` exited with `code`; its standard error.
fn exits(out: &Output, code: i32) -> String {
    let stderr = text(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(code),
        "stderr:\n{stderr}\nstdout:\n{}",
        text(&out.stdout)
    );
    stderr
}

fn summary_json(run_dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(run_dir.join("summary.json")).unwrap()).unwrap()
}

fn json_lines(output: &Output) -> Vec<serde_json::Value> {
    text(&output.stdout)
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}")))
        .collect()
}

/// `rows` sequences of 32 tokens with `hidden` features (the tiny pipeline's 2 taps × 32), one file.
fn write_hidden_states(path: &Path, rows: usize, hidden: usize) {
    use safetensors::tensor::{Dtype, TensorView};
    let tokens = 32usize;
    let hs: Vec<u8> = (0..rows * tokens * hidden)
        .flat_map(|i| (((i % 17) as f32 - 8.0) / 8.0).to_le_bytes())
        .collect();
    let ids: Vec<u8> = (0..rows * tokens)
        .flat_map(|i| ((i * 7 % 256) as i32).to_le_bytes())
        .collect();
    let tensors = [
        (
            "hidden_states",
            TensorView::new(Dtype::F32, vec![rows, tokens, hidden], &hs).unwrap(),
        ),
        (
            "input_ids",
            TensorView::new(Dtype::I32, vec![rows, tokens], &ids).unwrap(),
        ),
    ];
    safetensors::serialize_to_file(tensors, None, path).unwrap();
}

#[test]
fn a_lockstep_run_whose_data_never_fills_a_round_exits_3_and_names_what_it_left_untrained() {
    let dir = scratch("no-round");
    std::fs::create_dir_all(dir.join("data")).unwrap();
    // 8 sequences of 32 tokens: one batch of bucket 32 (256 tokens a batch), for two lockstep drafters.
    write_hidden_states(&dir.join("data/one-batch.safetensors"), 8, 64);
    let source = format!(
        r#"safetensors(path = "{}/data/*.safetensors")"#,
        dir.display()
    );
    let pipe = tiny_pipe(&dir, (1, 2), "round_robin", &source, None);
    let out = draftpipe(&["run", pipe.to_str().unwrap(), "--save", "ckpt"], &dir);
    let stderr = exits(&out, 3);
    assert!(
        stderr.contains("the data ran out at step 0 before this run's first step (exit status 3)"),
        "{stderr}"
    );
    let stdout = text(&out.stdout);
    for said in [
        "note: the data ended at step 0 before this run's first step: nothing was trained and no checkpoint was \
         written",
        "note: 1 batch(es) of the data were not trained (bucket 32: 1): the 2 lockstep drafters step only on a \
         round of 2 batches of one bucket, and the drafters waited for a round these could not fill",
        "checkpoint: none written to ckpt (no step was trained)",
        // The verdict: not "balanced", and no breakdown of steps that never ran ("busy 100%").
        "no step was trained: the 2 lockstep drafters waited for a round of 2 batches of one bucket, and the \
         data ended with 1 of bucket 32",
        "drafters: no step completed, so there is no step time to break down",
    ] {
        assert!(stdout.contains(said), "missing `{said}` in:\n{stdout}");
    }
    assert!(
        !stdout.contains("balanced") && !stdout.contains("busy 100"),
        "{stdout}"
    );
    assert!(
        !dir.join("ckpt").exists(),
        "a checkpoint of untrained weights"
    );
    let ending = &summary_json(&dir.join("runs/tiny"))["ending"];
    assert_eq!(ending["reason"], "data_exhausted_early");
    assert_eq!(ending["steps_this_run"], 0);
    assert_eq!(
        ending["untrained"],
        serde_json::json!([{ "padded_len": 32, "batches": 1 }])
    );
    // `diagnose` reads the same from the summary.
    let diagnose = draftpipe(&["diagnose", "runs/tiny"], &dir);
    assert!(
        text(&diagnose.stdout).contains("the drafters waited for a round these could not fill"),
        "{}",
        text(&diagnose.stdout)
    );
}

#[test]
fn a_resume_at_or_past_the_step_limit_is_refused_before_it_starts_and_leaves_no_run_directory() {
    let dir = scratch("resume-past-limit");
    let pipe = tiny_pipe(&dir, (1, 1), "fifo", SYNTHETIC, None);
    let pipe = pipe.to_str().unwrap();
    exits(
        &draftpipe(&["run", pipe, "--steps", "4", "--save", "ckpt"], &dir),
        0,
    );
    for limit in ["4", "3"] {
        let out = draftpipe(
            &[
                "run",
                pipe,
                "--steps",
                limit,
                "--resume",
                "ckpt",
                "--save",
                "ckpt",
                "--run-dir",
                "fresh/run",
            ],
            &dir,
        );
        let stderr = exits(&out, 1);
        assert!(
            stderr.contains(&format!("pipeline \"tiny\" ({pipe}) did not start")),
            "{stderr}"
        );
        assert!(
            stderr.contains(&format!(
                "its step 4 is already at or past the step limit {limit}"
            )),
            "{stderr}"
        );
        assert!(
            !dir.join("fresh").exists(),
            "a run that did not start left its run directory behind"
        );
    }
    let plan = compile_file(Path::new(pipe)).unwrap();
    assert_eq!(
        load_checkpoint(&dir.join("ckpt"), &plan.model)
            .unwrap()
            .state
            .step,
        4
    );
}

#[test]
fn a_resumed_run_says_so_and_counts_on_from_its_step_and_every_save_is_one_line() {
    let dir = scratch("resumed");
    let pipe = tiny_pipe(&dir, (1, 1), "fifo", SYNTHETIC, None);
    let pipe = pipe.to_str().unwrap();
    let first = draftpipe(
        &[
            "run",
            pipe,
            "--steps",
            "4",
            "--save",
            "ckpt",
            "--save-every",
            "2",
        ],
        &dir,
    );
    let stderr = exits(&first, 0);
    let saves: Vec<&str> = stderr
        .lines()
        .filter(|line| line.starts_with("saved the checkpoint"))
        .collect();
    assert_eq!(
        saves,
        [
            "saved the checkpoint at step 2 to ckpt",
            "saved the checkpoint at step 4 to ckpt"
        ],
        "{stderr}"
    );
    let resumed = draftpipe(
        &[
            "run", pipe, "--steps", "7", "--resume", "ckpt", "--save", "ckpt", "--json",
        ],
        &dir,
    );
    let stderr = exits(&resumed, 0);
    assert!(
        stderr.contains("resuming from step 4 of ckpt, 3 steps left of the 7 asked for"),
        "{stderr}"
    );
    let lines = json_lines(&resumed);
    assert!(
        lines.iter().all(|line| line["total_steps"] == 7),
        "{lines:?}"
    );
    assert!(
        lines.iter().all(|line| line["step"].as_u64().unwrap() >= 4),
        "{lines:?}"
    );
    assert_eq!(lines.last().unwrap()["step"], 7);
    let summary = summary_json(&dir.join("runs/tiny"));
    assert_eq!(summary["steps"], 3, "the summary counts this run's steps");
    assert_eq!(summary["ending"]["step"], 7);
}

#[test]
fn a_status_log_that_cannot_be_written_is_one_warning_and_the_run_goes_on() {
    let dir = scratch("status-unwritable");
    let pipe = tiny_pipe(&dir, (1, 1), "fifo", SYNTHETIC, None);
    // Every write of status.jsonl fails (ENOSPC), as at a full disk or past `ulimit -f`.
    std::fs::create_dir_all(dir.join("runs/tiny")).unwrap();
    std::os::unix::fs::symlink("/dev/full", dir.join("runs/tiny/status.jsonl")).unwrap();
    let out = draftpipe(
        &[
            "run",
            pipe.to_str().unwrap(),
            "--steps",
            "6",
            "--save",
            "ckpt",
            "--json",
        ],
        &dir,
    );
    let stderr = exits(&out, 0);
    let warnings: Vec<&str> = stderr
        .lines()
        .filter(|line| line.starts_with("warning:"))
        .collect();
    assert_eq!(warnings.len(), 1, "{stderr}");
    assert!(
        warnings[0].contains("status.jsonl is no longer written")
            && warnings[0].contains("No space left on device"),
        "{stderr}"
    );
    assert_eq!(json_lines(&out).last().unwrap()["step"], 6);
    let plan = compile_file(&pipe).unwrap();
    assert_eq!(
        load_checkpoint(&dir.join("ckpt"), &plan.model)
            .unwrap()
            .state
            .step,
        6
    );
    assert_eq!(
        summary_json(&dir.join("runs/tiny"))["ending"]["reason"],
        "step_limit"
    );
}

/// A child killed if the test fails before it is waited for.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn past_a_file_size_limit_the_status_log_stops_and_the_run_goes_on_to_its_summary() {
    let dir = scratch("status-fsize");
    // No step limit, a status line every 10 ms: status.jsonl (about 700 bytes a line) reaches the limit within
    // a second or two of training, while the summary, a few bytes a line, stays far below it.
    let pipe = tiny_pipe(&dir, (1, 1), "fifo", SYNTHETIC, None);
    binary_support::rewrite(&pipe, "every = 100ms", "every = 10ms", &pipe);
    let mut child = KillOnDrop(
        Command::new("prlimit")
            .arg(format!("--fsize={FILE_SIZE_LIMIT}"))
            .arg(env!("CARGO_BIN_EXE_draftpipe"))
            .args(["run", "tiny.pipe", "--json"])
            .current_dir(&dir)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    // Wait for the warning, then see that the run still trains and ends as asked (SIGTERM: saved, summarised).
    let stderr = BufReader::new(child.0.stderr.take().unwrap());
    let (lines, seen) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in stderr.lines().map_while(Result::ok) {
            let _ = lines.send(line);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    let warning = loop {
        let line = seen
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .expect("no warning about status.jsonl within 60 s");
        if line.contains("status.jsonl") {
            break line;
        }
    };
    assert!(
        warning.starts_with("warning: ")
            && warning.contains("ulimit -f")
            && warning.contains("status.jsonl is no longer written"),
        "{warning}"
    );
    let sent = Command::new("kill")
        .args(["-TERM", &child.0.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    let status = child.0.wait().unwrap();
    assert_eq!(status.code(), Some(143));
    // The reader ends at the end of the child's standard error.
    let rest: Vec<String> = seen.iter().collect();
    assert!(
        !rest.iter().any(|line| line.starts_with("warning:")),
        "warned more than once: {rest:?}"
    );
    assert!(
        std::fs::metadata(dir.join("runs/tiny/status.jsonl"))
            .unwrap()
            .len()
            <= FILE_SIZE_LIMIT
    );
    let summary = summary_json(&dir.join("runs/tiny"));
    assert_eq!(summary["ending"]["reason"], "interrupted");
    assert!(summary["steps"].as_u64().unwrap() > 0);
}

/// Bytes a file may grow to in [`past_a_file_size_limit_the_status_log_stops_and_the_run_goes_on_to_its_summary`].
const FILE_SIZE_LIMIT: u64 = 64 * 1024;
