//! `draftpipe eval` and the dflash checkpoint end to end through the binary: the loss `eval` reports for a
//! checkpoint is the loss training computes at those weights on the same batch, `--save-dtype bf16` writes a
//! bf16 weights file that `eval` and `--init` take, and bad input gets errors naming the file.

use std::path::{Path, PathBuf};
use std::process::Output;

use safetensors::tensor::{Dtype, TensorView};

mod binary_support;

use binary_support::{rewrite, text};

fn scratch(name: &str) -> PathBuf {
    binary_support::scratch("eval", name)
}

/// The binary, run in the target's scratch folder (every path the tests give it is absolute).
fn draftpipe(args: &[&str]) -> Output {
    binary_support::draftpipe(args, Path::new(env!("CARGO_TARGET_TMPDIR")))
}

fn succeed(args: &[&str]) -> Output {
    let out = draftpipe(args);
    assert!(
        out.status.success(),
        "draftpipe {args:?}: {}\n{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    out
}

const HIDDEN: usize = 16;
const TAPS: usize = 2;
const VOCAB: usize = 64;
const SEQ: usize = 32;
const ROWS_PER_BATCH: usize = 2;

/// A tiny dflash pipeline reading `data` with the frozen target tables in `target`.
fn pipe(dir: &Path) -> PathBuf {
    let text = format!(
        r#"pipeline "eval-test"

target t on cpu {{
    hidden       = {HIDDEN}
    tap_layers   = [1, 2]
    vocab        = {VOCAB}
    batch_tokens = {}
    weights      = safetensors(path = "{}")
    source       = safetensors(path = "{}")
}}

queue hs from t to d {{
    capacity  = 4
    min_ready = 1
    buckets   = [{SEQ}]
    pull      = fifo
}}

drafter d on cpu {{
    model     = dflash(layers = 2, heads = 4, kv_heads = 2, head_dim = 8, intermediate = 32, block = 4, anchors = {SEQ}, mask_token = {}, rope_theta = 10000)
    loss      = cross_entropy(position_decay = 4.0)
    optimizer = adamw(lr = 1e-2)
    steps     = 4
}}
"#,
        SEQ * ROWS_PER_BATCH,
        dir.join("target.safetensors").display(),
        dir.join("train.safetensors").display(),
        VOCAB - 1,
    );
    let path = dir.join("eval.pipe");
    std::fs::write(&path, text).unwrap();
    path
}

/// A deterministic value in [-1, 1) from an index (no RNG dependency in the test); a multiple of 1/64, so bf16
/// holds it exactly.
fn wave(i: usize, salt: usize) -> f32 {
    (((i * 2_654_435_761 + salt * 97) % 128) as f32 / 64.0) - 1.0
}

fn write_target(path: &Path) {
    let embed: Vec<u8> = (0..VOCAB * HIDDEN)
        .flat_map(|i| wave(i, 1).to_le_bytes())
        .collect();
    let head: Vec<u8> = (0..VOCAB * HIDDEN)
        .flat_map(|i| (wave(i, 2) / 4.0).to_le_bytes())
        .collect();
    let tensors = [
        (
            "model.embed_tokens.weight",
            TensorView::new(Dtype::F32, vec![VOCAB, HIDDEN], &embed).unwrap(),
        ),
        (
            "lm_head.weight",
            TensorView::new(Dtype::F32, vec![VOCAB, HIDDEN], &head).unwrap(),
        ),
    ];
    safetensors::serialize_to_file(tensors, None, path).unwrap();
}

/// `rows` full sequences whose next token is predictable from the hidden states; the first two tokens of each
/// are unmasked (a prompt), so fewer anchors than positions are valid.
fn write_data(path: &Path, rows: usize, salt: usize) {
    write_data_as(path, rows, salt, Dtype::F32);
}

/// [`write_data`] with the hidden states stored as `dtype` (F32 or BF16; the values are exact in both).
fn write_data_as(path: &Path, rows: usize, salt: usize, dtype: Dtype) {
    let ids: Vec<i64> = (0..rows * SEQ)
        .map(|i| ((i * 7 + salt * 13 + i / SEQ) % (VOCAB - 1)) as i64)
        .collect();
    let width = HIDDEN * TAPS;
    let hs: Vec<u8> = (0..rows * SEQ * width)
        .flat_map(|i| {
            let bits = wave(i, salt).to_bits();
            match dtype {
                Dtype::BF16 => ((bits >> 16) as u16).to_le_bytes().to_vec(),
                _ => bits.to_le_bytes().to_vec(),
            }
        })
        .collect();
    let mask: Vec<u8> = (0..rows * SEQ).map(|i| u8::from(i % SEQ >= 2)).collect();
    let ids: Vec<u8> = ids.iter().flat_map(|v| v.to_le_bytes()).collect();
    let tensors = [
        (
            "hidden_states",
            TensorView::new(dtype, vec![rows, SEQ, width], &hs).unwrap(),
        ),
        (
            "input_ids",
            TensorView::new(Dtype::I64, vec![rows, SEQ], &ids).unwrap(),
        ),
        (
            "loss_mask",
            TensorView::new(Dtype::U8, vec![rows, SEQ], &mask).unwrap(),
        ),
    ];
    safetensors::serialize_to_file(tensors, None, path).unwrap();
}

fn setup(name: &str) -> (PathBuf, PathBuf) {
    let dir = scratch(name);
    write_target(&dir.join("target.safetensors"));
    write_data(&dir.join("train.safetensors"), 4 * ROWS_PER_BATCH, 0);
    let pipe = pipe(&dir);
    (dir, pipe)
}

fn arg(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// Trains `pipe` for `steps` steps from fresh weights with the status lines as JSON, saving the checkpoint in
/// `checkpoint` and the run in `run_dir`; `extra` adds options.
fn train(pipe: &Path, steps: &str, checkpoint: &Path, run_dir: &Path, extra: &[&str]) {
    let mut args = vec![
        "run",
        arg(pipe),
        "--steps",
        steps,
        "--save",
        arg(checkpoint),
    ];
    args.extend_from_slice(extra);
    args.extend(["--json", "--run-dir", arg(run_dir)]);
    succeed(&args);
}

/// The arguments of `draftpipe eval CHECKPOINT --pipeline PIPE --data DATA`.
fn eval_args<'a>(checkpoint: &'a Path, pipe: &'a Path, data: &'a Path) -> Vec<&'a str> {
    vec![
        "eval",
        arg(checkpoint),
        "--pipeline",
        arg(pipe),
        "--data",
        arg(data),
    ]
}

/// The JSON report of a `draftpipe eval` that must succeed.
fn eval_json(checkpoint: &Path, pipe: &Path, data: &Path) -> serde_json::Value {
    let mut args = eval_args(checkpoint, pipe, data);
    args.push("--json");
    serde_json::from_slice(&succeed(&args).stdout).unwrap()
}

/// A copy of `pipe` named `name` beside it, with `from` replaced by `to`.
fn edited_pipe(pipe: &Path, name: &str, from: &str, to: &str) -> PathBuf {
    let path = pipe.with_file_name(name);
    rewrite(pipe, from, to, &path);
    path
}

#[test]
fn eval_reports_the_loss_training_computes_at_the_same_weights() {
    let (dir, pipe) = setup("same-loss");
    let ckpt = dir.join("ckpt");
    train(&pipe, "2", &ckpt, &dir.join("r1"), &[]);
    // One more step from the checkpoint's weights on a one-batch file: its loss is computed at those weights.
    let one = dir.join("one.safetensors");
    write_data(&one, ROWS_PER_BATCH, 5);
    let one_pipe = edited_pipe(&pipe, "one.pipe", "train.safetensors", "one.safetensors");
    let run_dir = dir.join("r2");
    succeed(&[
        "run",
        arg(&one_pipe),
        "--init",
        arg(&ckpt),
        "--steps",
        "1",
        "--json",
        "--run-dir",
        arg(&run_dir),
    ]);
    let summary: serde_json::Value =
        serde_json::from_slice(&std::fs::read(run_dir.join("summary.json")).unwrap()).unwrap();
    let trained = summary["final_loss"].as_f64().unwrap();

    let report = eval_json(&ckpt, &pipe, &one);
    assert_eq!(report["batches"], 1);
    assert_eq!(report["sequences"], ROWS_PER_BATCH);
    assert_eq!(report["tokens"], ROWS_PER_BATCH * SEQ);
    let loss = report["loss"].as_f64().unwrap();
    assert!(
        (loss - trained).abs() <= 1e-5 * trained.abs(),
        "eval {loss} vs the training step's {trained}"
    );
    // Every valid anchor is taken (fewer than `anchors`), so the labels per slot are known exactly: anchors
    // a in 2..SEQ−1 (mask[a] and mask[a+1]), slot k labelled while a + k < SEQ.
    let labelled: Vec<u64> = report["slot_labelled"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    let expected: Vec<u64> = (1..4)
        .map(|k| (ROWS_PER_BATCH * (2..SEQ - 1).filter(|a| a + k < SEQ).count()) as u64)
        .collect();
    assert_eq!(labelled, expected);
    let accuracy: Vec<f64> = report["slot_accuracy"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    assert!(accuracy.iter().all(|a| (0.0..=1.0).contains(a)));
    let chain: f64 = accuracy
        .iter()
        .scan(1.0, |p, a| {
            *p *= a;
            Some(*p)
        })
        .sum();
    assert!((report["tau_simulated"].as_f64().unwrap() - 1.0 - chain).abs() < 1e-9);
    // The exact figure counts blocks' prefixes: with at least one counted block it lies in [1, block].
    assert!(report["blocks"].as_u64().unwrap() > 0);
    let exact = report["tau_exact"].as_f64().unwrap();
    assert!((1.0..=4.0).contains(&exact), "τ exact {exact}");
}

#[test]
fn a_bf16_checkpoint_is_evaluated_and_its_text_report_names_every_slot() {
    let (dir, pipe) = setup("bf16");
    let ckpt = dir.join("ckpt");
    train(&pipe, "2", &ckpt, &dir.join("r"), &["--save-dtype", "bf16"]);
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(ckpt.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["torch_dtype"], "bfloat16");
    assert_eq!(
        config["dflash_config"]["target_layer_ids"],
        serde_json::json!([0, 1])
    );
    let train_data = dir.join("train.safetensors");
    let out = succeed(&eval_args(&ckpt, &pipe, &train_data));
    let report = text(&out.stdout);
    assert!(
        report.contains("4 batches, 8 sequences, 256 tokens"),
        "{report}"
    );
    for slot in ["   1  ", "   2  ", "   3  "] {
        assert!(report.contains(slot), "{report}");
    }
    assert!(
        report.contains("acceptance length") && report.contains("τ"),
        "{report}"
    );
    // Not a terminal: no progress bar on standard error, and no warning for the checkpoint's own plan.
    assert!(out.stderr.is_empty(), "{}", text(&out.stderr));
    // The same shapes under another pipeline's name: evaluated, with a warning naming both plans.
    let other = edited_pipe(
        &pipe,
        "other.pipe",
        "pipeline \"eval-test\"",
        "pipeline \"another-plan\"",
    );
    let out = succeed(&eval_args(&ckpt, &other, &train_data));
    let warning = text(&out.stderr);
    assert!(
        warning.starts_with("warning: ")
            && warning.contains("was trained by pipeline \"eval-test\", not \"another-plan\""),
        "{warning}"
    );
    assert!(text(&out.stdout).contains("4 batches"));
}

#[test]
fn bf16_data_is_read_in_its_own_precision_and_gives_the_same_loss() {
    let (dir, pipe) = setup("bf16-data");
    let ckpt = dir.join("ckpt");
    train(&pipe, "1", &ckpt, &dir.join("r"), &[]);
    let (f32_file, bf16_file) = (dir.join("f32.safetensors"), dir.join("bf16.safetensors"));
    write_data_as(&f32_file, 2 * ROWS_PER_BATCH, 3, Dtype::F32);
    write_data_as(&bf16_file, 2 * ROWS_PER_BATCH, 3, Dtype::BF16);
    let wide = eval_json(&ckpt, &pipe, &f32_file);
    let narrow = eval_json(&ckpt, &pipe, &bf16_file);
    let (a, b) = (
        wide["loss"].as_f64().unwrap(),
        narrow["loss"].as_f64().unwrap(),
    );
    assert!((a - b).abs() <= 1e-5 * a, "f32 {a} vs bf16 {b}");
    assert_eq!(wide["slot_labelled"], narrow["slot_labelled"]);
}

#[test]
fn eval_errors_name_the_file_and_what_is_wrong() {
    let (dir, pipe) = setup("errors");
    let ckpt = dir.join("ckpt");
    train(&pipe, "1", &ckpt, &dir.join("r"), &[]);
    // Data of another width.
    let wide = dir.join("wide.safetensors");
    let hs: Vec<u8> = vec![0; 2 * SEQ * 40 * 4];
    let ids: Vec<u8> = vec![0; 2 * SEQ * 8];
    safetensors::serialize_to_file(
        [
            (
                "hidden_states",
                TensorView::new(Dtype::F32, vec![2, SEQ, 40], &hs).unwrap(),
            ),
            (
                "input_ids",
                TensorView::new(Dtype::I64, vec![2, SEQ], &ids).unwrap(),
            ),
        ],
        None,
        &wide,
    )
    .unwrap();
    let out = draftpipe(&eval_args(&ckpt, &pipe, &wide));
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.contains("wide.safetensors") && err.contains("hidden_states"),
        "{err}"
    );

    // A checkpoint of another drafter: its config.json says which key differs.
    let config = ckpt.join("config.json");
    let edited = std::fs::read_to_string(&config)
        .unwrap()
        .replace("\"num_hidden_layers\": 2", "\"num_hidden_layers\": 3");
    std::fs::write(&config, edited).unwrap();
    let out = draftpipe(&eval_args(&ckpt, &pipe, &dir.join("train.safetensors")));
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.contains("config.json") && err.contains("`num_hidden_layers` is 3"),
        "{err}"
    );
    // The same file refuses `--init` before any training.
    let out = draftpipe(&["run", arg(&pipe), "--init", arg(&ckpt), "--steps", "1"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("`num_hidden_layers` is 3"));
}
