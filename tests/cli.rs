//! Drives the real `draftpipe` binary: exit codes of `check` and `compile` (0 valid, 1 errors, 2 usage), their
//! output, and a `check` of every shipped pipeline.

use std::path::Path;
use std::process::{Command, Output};

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

#[test]
fn help_exists_on_every_command() {
    for args in [
        &["--help"][..],
        &["check", "--help"][..],
        &["compile", "--help"][..],
    ] {
        let out = draftpipe(args);
        assert_eq!(out.status.code(), Some(0));
        assert!(text(&out.stdout).contains("Usage: draftpipe"), "{args:?}");
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
        "189,664,256 parameters",
        "memory per device",
        "gpu 7",
        "cost per step",
        "16384",
    ] {
        assert!(stdout.contains(needle), "missing `{needle}` in\n{stdout}");
    }
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
