//! Nothing a command reads or keeps is lost, through the real binary: every single-file output (`vocab --out`,
//! a run's trace) follows one rule (never an input, never a device, a directory or a dangling link, another
//! kind of file only with `--force`, created 0644 under the umask); a resumed `eagle3` run keeps the draft
//! vocabulary its checkpoint was trained with; a checkpoint weight too large to train is named at load; `t2d`
//! may be U8; what the README's commands write is ignored by git.

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod binary_support;

use binary_support::{draftpipe, rewrite, text};
use draftpipe_runtime::model::eagle3::vocab::VocabMap;
use safetensors::Dtype;
use safetensors::tensor::TensorView;

fn scratch(name: &str) -> PathBuf {
    binary_support::scratch("outputs", name)
}

/// The exit status is `code`; returns standard error.
fn exits(out: &Output, code: i32) -> String {
    let stderr = text(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(code),
        "stdout: {}\nstderr: {stderr}",
        text(&out.stdout)
    );
    stderr
}

/// A tiny `eagle3` pipeline (target hidden 16, vocabulary 40, draft vocabulary 6) on a synthetic source;
/// `extra` goes into the drafter block.
fn eagle3_pipe(dir: &Path, name: &str, extra: &str) -> PathBuf {
    let text = format!(
        r#"pipeline "outputs"

target t on cpu {{
    hidden       = 16
    tap_layers   = [1, 2, 3]
    vocab        = 40
    batch_tokens = 32
    source       = synthetic(seed = 3, lengths = 4..16)
}}

queue hs from t to d {{
    capacity  = 4
    min_ready = 1
    buckets   = [8, 16]
}}

drafter d on cpu {{
    model     = eagle3(heads = 2, kv_heads = 1, head_dim = 8, intermediate = 32, ttt = 2, draft_vocab = 6,
                       rope_theta = 10000)
    loss      = cross_entropy(step_decay = 0.8)
    optimizer = adamw(lr = 1e-3)
    steps     = 2
{extra}}}
"#
    );
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// `draftpipe vocab PIPE --out OUT [extra…]` in `dir`.
fn vocab(dir: &Path, pipe: &Path, out: &str, extra: &[&str]) -> Output {
    let mut args = vec![
        "vocab",
        pipe.to_str().unwrap(),
        "--out",
        out,
        "--batches",
        "3",
    ];
    args.extend(extra);
    draftpipe(&args, dir)
}

#[test]
fn vocab_out_never_replaces_its_input_another_kind_of_file_or_a_non_regular_file() {
    let dir = scratch("vocab-out");
    let pipe = eagle3_pipe(&dir, "vocab.pipe", "");
    let pipe_text = std::fs::read(&pipe).unwrap();

    // The pipeline it reads: refused even with --force, and left as it was.
    for extra in [&[][..], &["--force"][..]] {
        let stderr = exits(&vocab(&dir, &pipe, "vocab.pipe", extra), 1);
        assert!(
            stderr.contains("which this command reads") && stderr.contains("vocab.pipe"),
            "{stderr}"
        );
        assert_eq!(std::fs::read(&pipe).unwrap(), pipe_text);
    }
    // A hard link to it is the same file.
    std::fs::hard_link(&pipe, dir.join("linked.pipe")).unwrap();
    let stderr = exits(&vocab(&dir, &pipe, "linked.pipe", &["--force"]), 1);
    assert!(stderr.contains("which this command reads"), "{stderr}");

    // Another kind of file (a checkpoint's weights, notes): refused, kept, and replaced only with --force.
    std::fs::write(dir.join("notes.txt"), "precious").unwrap();
    let stderr = exits(&vocab(&dir, &pipe, "notes.txt", &[]), 1);
    assert!(
        stderr.contains("is not a draft vocabulary map") && stderr.contains("--force"),
        "{stderr}"
    );
    assert_eq!(std::fs::read(dir.join("notes.txt")).unwrap(), b"precious");
    exits(&vocab(&dir, &pipe, "notes.txt", &["--force"]), 0);
    VocabMap::read(&dir.join("notes.txt"), Some((6, 40))).unwrap();

    // Not a regular file: a directory, a device behind a symbolic link, a dangling link.
    std::fs::create_dir(dir.join("a-dir")).unwrap();
    std::os::unix::fs::symlink("/dev/null", dir.join("null-link")).unwrap();
    std::os::unix::fs::symlink("nowhere/at-all", dir.join("dangling")).unwrap();
    for (path, found) in [
        ("a-dir", "a directory"),
        ("null-link", "a character device"),
        ("dangling", "a symbolic link to nothing"),
    ] {
        let stderr = exits(&vocab(&dir, &pipe, path, &["--force"]), 1);
        assert!(
            stderr.contains(path) && stderr.contains(found),
            "{path}: {stderr}"
        );
    }
    assert!(
        std::fs::symlink_metadata(dir.join("null-link"))
            .unwrap()
            .file_type()
            .is_symlink()
    );
    assert!(dir.join("a-dir").is_dir());
}

#[test]
fn vocab_out_replaces_an_earlier_map_and_creates_files_with_the_usual_mode() {
    let dir = scratch("vocab-mode");
    let pipe = eagle3_pipe(&dir, "vocab.pipe", "");
    let run = |out: &str| {
        Command::new("sh")
            .arg("-c")
            .arg(format!(
                "umask 022 && exec \"$0\" vocab {} --out {out} --batches 3",
                pipe.display()
            ))
            .arg(env!("CARGO_BIN_EXE_draftpipe"))
            .current_dir(&dir)
            .output()
            .unwrap()
    };
    exits(&run("map.safetensors"), 0);
    let mode = |path: &str| {
        std::fs::metadata(dir.join(path))
            .unwrap()
            .permissions()
            .mode()
            & 0o777
    };
    assert_eq!(mode("map.safetensors"), 0o644);
    // Its own kind of output is replaced (the workflow: recount into the pipeline's vocab_map), and a
    // symbolic link to it stays a link.
    std::os::unix::fs::symlink("map.safetensors", dir.join("map-link")).unwrap();
    exits(&run("map-link"), 0);
    assert!(
        std::fs::symlink_metadata(dir.join("map-link"))
            .unwrap()
            .file_type()
            .is_symlink()
    );
    VocabMap::read(&dir.join("map.safetensors"), Some((6, 40))).unwrap();
    assert_eq!(mode("map.safetensors"), 0o644);
    assert!(
        std::fs::read_dir(&dir).unwrap().all(|e| !e
            .unwrap()
            .file_name()
            .to_string_lossy()
            .contains("tmp")),
        "a temporary file was left behind"
    );
}

#[test]
fn a_trace_path_follows_the_same_rule() {
    let dir = scratch("trace");
    let pipe = binary_support::tiny_pipe(&dir, (1, 1), "fifo", binary_support::SYNTHETIC, Some(2));
    let traced = |trace: &str| {
        let path = dir.join(format!("traced-{}.pipe", trace.replace('/', "-")));
        rewrite(
            &pipe,
            "telemetry { every = 100ms }",
            &format!("telemetry {{ every = 100ms  trace = \"{trace}\" }}"),
            &path,
        );
        path
    };
    let run = |pipe: &Path, extra: &[&str]| {
        let mut args = vec!["run", pipe.to_str().unwrap(), "--run-dir", "r"];
        args.extend(extra);
        draftpipe(&args, &dir)
    };

    // Its own pipeline file, even with --force.
    let own = dir.join("traced-self.pipe");
    rewrite(
        &pipe,
        "telemetry { every = 100ms }",
        "telemetry { every = 100ms  trace = \"traced-self.pipe\" }",
        &own,
    );
    let own_text = std::fs::read(&own).unwrap();
    let stderr = exits(&run(&own, &["--force"]), 1);
    assert!(stderr.contains("which this command reads"), "{stderr}");
    assert_eq!(std::fs::read(&own).unwrap(), own_text);
    assert!(!dir.join("r/summary.json").exists(), "it trained first");

    // Another kind of file: refused before training; replaced with --force.
    std::fs::write(dir.join("notes.json"), "{\"mine\": true}").unwrap();
    let notes = traced("notes.json");
    let stderr = exits(&run(&notes, &[]), 1);
    assert!(
        stderr.contains("notes.json") && stderr.contains("is not a trace"),
        "{stderr}"
    );
    assert_eq!(
        std::fs::read(dir.join("notes.json")).unwrap(),
        b"{\"mine\": true}"
    );
    exits(&run(&notes, &["--force"]), 0);
    let written = std::fs::read(dir.join("notes.json")).unwrap();
    assert!(written.starts_with(b"{\"displayTimeUnit\":"));
    // A trace is replaced by the next run's without --force.
    exits(&run(&notes, &[]), 0);
}

/// Trains `pipe` for its 2 steps into `ckpt` and returns the weights file.
fn train_eagle3(dir: &Path, pipe: &Path) -> PathBuf {
    let run = draftpipe(
        &[
            "run",
            pipe.to_str().unwrap(),
            "--run-dir",
            "r",
            "--save",
            "ckpt",
        ],
        dir,
    );
    exits(&run, 0);
    dir.join("ckpt/model.safetensors")
}

/// A valid draft vocabulary of 6 of 40 ids: the first six, or the last six.
fn map_of(first: bool) -> VocabMap {
    let ids: Vec<usize> = if first {
        (0..6).collect()
    } else {
        (34..40).collect()
    };
    VocabMap {
        d2t: ids
            .iter()
            .enumerate()
            .map(|(i, &id)| (id - i) as i64)
            .collect(),
        t2d: (0..40).map(|id| ids.contains(&id)).collect(),
    }
}

#[test]
fn a_resumed_eagle3_run_keeps_the_checkpoints_draft_vocabulary() {
    let dir = scratch("resume-vocab");
    map_of(true).write(&dir.join("first.safetensors")).unwrap();
    map_of(false).write(&dir.join("last.safetensors")).unwrap();
    let trained = eagle3_pipe(
        &dir,
        "first.pipe",
        "    vocab_map = \"first.safetensors\"\n",
    );
    let weights = train_eagle3(&dir, &trained);
    assert_eq!(VocabMap::read(&weights, None).unwrap(), map_of(true));

    // Another map given explicitly: an error naming both files, before any step.
    let other = eagle3_pipe(&dir, "last.pipe", "    vocab_map = \"last.safetensors\"\n");
    let resume = |pipe: &Path, steps: &str| {
        draftpipe(
            &[
                "run",
                pipe.to_str().unwrap(),
                "--run-dir",
                "r2",
                "--resume",
                "ckpt",
                "--save",
                "ckpt",
                "--steps",
                steps,
            ],
            &dir,
        )
    };
    let stderr = exits(&resume(&other, "3"), 1);
    assert!(
        stderr.contains("last.safetensors")
            && stderr.contains("ckpt/model.safetensors")
            && stderr.contains("another draft vocabulary"),
        "{stderr}"
    );
    // No map given: the checkpoint's wins over a fresh count of the source (which picks other ids).
    let counted = eagle3_pipe(&dir, "counted.pipe", "");
    exits(
        &draftpipe(
            &["vocab", "counted.pipe", "--out", "counted.safetensors"],
            &dir,
        ),
        0,
    );
    let count = VocabMap::read(&dir.join("counted.safetensors"), None).unwrap();
    assert_ne!(
        count,
        map_of(true),
        "the test needs a count that picks other ids"
    );
    exits(&resume(&counted, "3"), 0);
    assert_eq!(VocabMap::read(&weights, None).unwrap(), map_of(true));
    // The same map given again is fine.
    exits(&resume(&trained, "4"), 0);
    assert_eq!(VocabMap::read(&weights, None).unwrap(), map_of(true));
}

/// `name`'s element 0 in the F32 weights file `path` set to `value`, the other tensors as they were.
fn poison(path: &Path, name: &str, value: f32) {
    let bytes = std::fs::read(path).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = file
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, t.dtype(), t.shape().to_vec(), t.data().to_vec()))
        .collect();
    let poisoned = tensors.iter_mut().find(|t| t.0 == name).unwrap();
    assert_eq!(poisoned.1, Dtype::F32);
    poisoned.3[..4].copy_from_slice(&value.to_le_bytes());
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

#[test]
fn a_resumed_weight_too_large_to_train_is_named_not_blamed_on_the_learning_rate() {
    let dir = scratch("resume-huge");
    let pipe = eagle3_pipe(&dir, "e.pipe", "");
    let weights = train_eagle3(&dir, &pipe);
    for (value, said) in [
        (3e38_f32, "too large to train"),
        (f32::INFINITY, "non-finite"),
    ] {
        poison(&weights, "fc.weight", value);
        let resumed = draftpipe(
            &[
                "run",
                pipe.to_str().unwrap(),
                "--run-dir",
                "r2",
                "--resume",
                "ckpt",
                "--steps",
                "4",
            ],
            &dir,
        );
        let stderr = exits(&resumed, 1);
        assert!(
            stderr.contains("fc.weight") && stderr.contains("element 0") && stderr.contains(said),
            "{stderr}"
        );
        assert!(!stderr.contains("learning rate"), "{stderr}");
    }
}

/// The map file `map` rewritten with `t2d` as U8, its byte at `at` set to `byte` when given.
fn t2d_as_u8(map: &Path, out: &Path, poke: Option<(usize, u8)>) {
    let read = VocabMap::read(map, None).unwrap();
    let (d2t, mut t2d) = read.tensor_bytes();
    if let Some((at, byte)) = poke {
        t2d[at] = byte;
    }
    let views = [
        ("d2t", TensorView::new(Dtype::I64, vec![6], &d2t).unwrap()),
        ("t2d", TensorView::new(Dtype::U8, vec![40], &t2d).unwrap()),
    ];
    safetensors::serialize_to_file(views, None, out).unwrap();
}

#[test]
fn a_t2d_of_u8_zeros_and_ones_is_read_and_another_byte_is_named() {
    let dir = scratch("t2d-u8");
    map_of(true).write(&dir.join("bool.safetensors")).unwrap();
    t2d_as_u8(
        &dir.join("bool.safetensors"),
        &dir.join("u8.safetensors"),
        None,
    );
    let pipe = eagle3_pipe(&dir, "u8.pipe", "    vocab_map = \"u8.safetensors\"\n");
    exits(
        &draftpipe(&["run", pipe.to_str().unwrap(), "--run-dir", "r"], &dir),
        0,
    );
    t2d_as_u8(
        &dir.join("bool.safetensors"),
        &dir.join("u8.safetensors"),
        Some((7, 2)),
    );
    let stderr = exits(
        &draftpipe(&["run", pipe.to_str().unwrap(), "--run-dir", "r"], &dir),
        1,
    );
    assert!(
        stderr.contains("u8.safetensors") && stderr.contains("`t2d`") && stderr.contains("[7]"),
        "{stderr}"
    );
}

#[test]
fn what_the_readme_commands_write_is_ignored_by_git() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(repo.join("README.md")).unwrap();
    let written = [
        "exports/dflash-quickstart",
        "ckpt",
        "ckpt.prev",
        "ckpt.lock",
        "eagle3-vocab.safetensors",
    ];
    for path in [
        "--save exports/",
        "--save ckpt",
        "--out eagle3-vocab.safetensors",
    ] {
        assert!(readme.contains(path), "the README no longer writes {path}");
    }
    // `--no-index` reads the .gitignore files only, so a fresh checkout and a dirty one answer alike.
    let check = Command::new("git")
        .args(["check-ignore", "--no-index", "--verbose"])
        .args(written)
        .current_dir(repo)
        .output()
        .expect("git runs");
    let listed = text(&check.stdout);
    for path in written {
        assert!(
            listed.lines().any(|l| l.ends_with(&format!("\t{path}"))),
            "{path} is not ignored:\n{listed}{}",
            text(&check.stderr)
        );
    }
}
