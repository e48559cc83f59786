//! Loss masks through the real binary: a file source whose bad masks are over `max_bad_mask_share` is refused
//! before the first step with the file, the rows, each kind and the bound; one within it trains, and its
//! `summary.json` and diagnosis carry the counts.

use std::path::{Path, PathBuf};
use std::process::Output;

use safetensors::tensor::{Dtype, TensorView};

mod binary_support;

use binary_support::{rewrite, text, tiny_pipe};

const SEQ: usize = 32;
const WIDTH: usize = 64; // hidden 32 × 2 tap layers
const END: i64 = 9;

/// Which mask a row of the shard has.
#[derive(Clone, Copy)]
enum Row {
    /// A prompt of 4 tokens, a reply of 16 ending on END, padding.
    Good,
    /// The same tokens with the prompt trained on too.
    AllOnes,
    /// The same tokens and no loss.
    AllZeros,
}

fn write_shard(path: &Path, rows: &[Row]) {
    let n = rows.len();
    let mut ids = vec![0i64; n * SEQ];
    let mut mask = vec![0u8; n * SEQ];
    for (r, row) in rows.iter().enumerate() {
        for t in 0..20 {
            ids[r * SEQ + t] = if t == 19 {
                END
            } else {
                10 + (r * 7 + t) as i64 % 200
            };
            mask[r * SEQ + t] = match row {
                Row::Good => u8::from(t >= 4),
                Row::AllOnes => 1,
                Row::AllZeros => 0,
            };
        }
    }
    let hs: Vec<u8> = (0..n * SEQ * WIDTH)
        .flat_map(|i| ((i % 17) as f32 / 16.0 - 0.5).to_le_bytes())
        .collect();
    let ids: Vec<u8> = ids.iter().flat_map(|v| v.to_le_bytes()).collect();
    let tensors = [
        (
            "hidden_states",
            TensorView::new(Dtype::F32, vec![n, SEQ, WIDTH], &hs).unwrap(),
        ),
        (
            "input_ids",
            TensorView::new(Dtype::I64, vec![n, SEQ], &ids).unwrap(),
        ),
        (
            "loss_mask",
            TensorView::new(Dtype::U8, vec![n, SEQ], &mask).unwrap(),
        ),
    ];
    safetensors::serialize_to_file(tensors, None, path).unwrap();
}

/// The tiny pipeline over `dir/chat.safetensors` for chat data ending turns on END, within `max_share`.
fn chat_pipe(dir: &Path, max_share: &str) -> PathBuf {
    let data = dir.join("chat.safetensors");
    let source = format!("safetensors(path = \"{}\")", data.display());
    let pipe = tiny_pipe(dir, (1, 1), "fifo", &source, None);
    let settings = format!(
        "batch_tokens = 256\n    end_of_turn = {END}\n    max_bad_mask_share = {max_share}\n"
    );
    rewrite(&pipe, "batch_tokens = 256\n", &settings, &pipe);
    pipe
}

fn run(pipe: &Path, run_dir: &Path) -> Output {
    let args = [
        "run",
        pipe.to_str().unwrap(),
        "--run-dir",
        run_dir.to_str().unwrap(),
    ];
    binary_support::draftpipe(&args, Path::new(env!("CARGO_TARGET_TMPDIR")))
}

#[test]
fn bad_masks_over_the_bound_refuse_the_run_before_its_first_step() {
    let dir = binary_support::scratch("masks", "refused");
    let data = dir.join("chat.safetensors");
    let rows = [Row::Good, Row::AllOnes, Row::Good, Row::AllZeros];
    write_shard(&data, &[rows.as_slice(); 4].concat());
    let out = run(&chat_pipe(&dir, "0.01"), &dir.join("run"));
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    let row = |r: usize| format!("{} row {r}", data.display());
    for needle in [
        format!("loss masks of {}", data.display()),
        "8 of 16 sequences (50.0%)".into(),
        "`max_bad_mask_share` = 0.01".into(),
        format!(
            "all ones 4 ({}, {}, {}, {})",
            row(1),
            row(5),
            row(9),
            row(13)
        ),
        format!("all zeros 4 ({}, ", row(3)),
        "missing end of turn 0".into(),
    ] {
        assert!(stderr.contains(&needle), "{needle}:\n{stderr}");
    }
    assert!(!stdout.contains("step "), "no step ran:\n{stdout}");
    assert!(!dir.join("run").join("summary.json").exists());
}

#[test]
fn masks_within_the_bound_train_and_the_summary_carries_their_counts() {
    let dir = binary_support::scratch("masks", "within");
    let mut rows = vec![Row::Good; 15];
    rows.push(Row::AllZeros);
    write_shard(&dir.join("chat.safetensors"), &rows);
    let run_dir = dir.join("run");
    let out = run(&chat_pipe(&dir, "0.1"), &run_dir);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let summary: serde_json::Value =
        serde_json::from_slice(&std::fs::read(run_dir.join("summary.json")).unwrap()).unwrap();
    let masks = &summary["masks"];
    assert_eq!(masks["sequences"], 16, "{masks}");
    assert_eq!(masks["tokens"], 15 * 20, "{masks}");
    assert_eq!(masks["loss_tokens"], 15 * 16, "{masks}");
    assert_eq!(masks["all_zeros"]["count"], 1, "{masks}");
    assert_eq!(masks["all_ones"]["count"], 0, "{masks}");
    assert_eq!(masks["bad_sequences"], 1, "{masks}");
    assert!((masks["loss_token_share"].as_f64().unwrap() - 0.8).abs() < 1e-9);
    let first = masks["all_zeros"]["first_ids"][0]
        .as_str()
        .unwrap()
        .to_string();
    assert!(first.ends_with("chat.safetensors row 15"), "{first}");
    let printed = format!("{stdout}{stderr}");
    assert!(
        printed
            .contains("loss masks: 16 sequences, loss on 80.0% of 300 tokens; bad masks 1 (6.2%)"),
        "{printed}"
    );
}
