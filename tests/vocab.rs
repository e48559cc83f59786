//! `draftpipe vocab PIPE --out FILE [--batches N]` end to end: the map it writes for a synthetic and a files
//! source (SpecForge's rule over the loss-masked tokens), and its refusals (another family, a stream source, an
//! unwritable output), each with exit 1 and one clear line.

mod binary_support;

use std::path::Path;

use binary_support::{draftpipe, scratch, text};
use draftpipe_runtime::model::eagle3::vocab::VocabMap;
use safetensors::Dtype;
use safetensors::tensor::TensorView;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// An eagle3 pipeline over `source` (a target of hidden 16, vocabulary 40) with a draft vocabulary of 6.
fn eagle3_pipe(dir: &Path, source: &str, extra: &str) -> std::path::PathBuf {
    // Only a run reads the target's weights (a recorded source needs them named).
    let weights = if source.starts_with("synthetic") {
        ""
    } else {
        "    weights      = safetensors(path = \"target.safetensors\")\n"
    };
    let text = format!(
        r#"pipeline "vocab-test"

target t on cpu {{
    hidden       = 16
    tap_layers   = [1, 2, 3]
    vocab        = 40
    batch_tokens = 32
    source       = {source}
{weights}}}

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
{extra}}}
"#
    );
    let path = dir.join("vocab.pipe");
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn a_synthetic_pipeline_gets_its_draft_vocabulary() {
    let dir = scratch("vocab", "synthetic");
    let out = dir.join("map.safetensors");
    let pipe = repo().join("pipelines/eagle3-quickstart.pipe");
    let run = draftpipe(
        &[
            "vocab",
            pipe.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--batches",
            "40",
        ],
        &dir,
    );
    assert_eq!(run.status.code(), Some(0), "{}", text(&run.stderr));
    let said = text(&run.stdout);
    assert!(
        said.contains("draft_vocab 256 of 512") && said.contains("in 40 batches"),
        "{said}"
    );
    let map = VocabMap::read(&out, Some((256, 512))).unwrap();
    assert_eq!(map.t2d.iter().filter(|&&b| b).count(), 256);
}

#[test]
fn a_files_pipeline_counts_the_loss_masked_tokens_of_its_files() {
    let dir = scratch("vocab", "files");
    // Masked counts: 7 ×3, 5 ×2, 9 ×2, 2 ×1, 11 ×1, 12 ×1, 30 ×1 (11 tokens); the masked-out 20s never count.
    let ids: [i64; 16] = [
        7, 7, 5, 9, 20, 20, 20, 20, /**/ 7, 5, 9, 30, 2, 11, 12, 20,
    ];
    let mask: [u8; 16] = [1, 1, 1, 1, 0, 0, 0, 0, /**/ 1, 1, 1, 1, 1, 1, 1, 0];
    let hs = vec![0u8; 2 * 8 * 48 * 4];
    let id_bytes: Vec<u8> = ids.iter().flat_map(|v| v.to_le_bytes()).collect();
    let last = vec![0u8; 2 * 8 * 16 * 4];
    let views = [
        (
            "hidden_states",
            TensorView::new(Dtype::F32, vec![2, 8, 48], &hs).unwrap(),
        ),
        (
            "input_ids",
            TensorView::new(Dtype::I64, vec![2, 8], &id_bytes).unwrap(),
        ),
        (
            "loss_mask",
            TensorView::new(Dtype::U8, vec![2, 8], &mask).unwrap(),
        ),
        (
            "last_hidden_states",
            TensorView::new(Dtype::F32, vec![2, 8, 16], &last).unwrap(),
        ),
    ];
    safetensors::serialize_to_file(views, None, &dir.join("data.safetensors")).unwrap();
    let pipe = eagle3_pipe(&dir, r#"safetensors(path = "data.safetensors")"#, "");
    let run = draftpipe(
        &["vocab", pipe.to_str().unwrap(), "--out", "map.safetensors"],
        &dir,
    );
    assert_eq!(run.status.code(), Some(0), "{}", text(&run.stderr));
    // The six most common: 7, then 5 and 9, then three of the four seen once, all first seen in the second
    // sequence, which adds them ascending: 2, 11, 12 (30 loses the tie).
    let map = VocabMap::read(&dir.join("map.safetensors"), Some((6, 40))).unwrap();
    let used: Vec<usize> = map.target_ids().collect();
    assert_eq!(used, [2, 5, 7, 9, 11, 12]);
    assert!(
        text(&run.stdout).contains("11 loss-masked tokens, 7 distinct"),
        "{}",
        text(&run.stdout)
    );
}

#[test]
fn refusals_exit_1_with_their_reason() {
    let dir = scratch("vocab", "refusals");
    let out = dir.join("map.safetensors");
    let out = out.to_str().unwrap();
    let mlp = repo().join("pipelines/quickstart.pipe");
    let run = draftpipe(&["vocab", mlp.to_str().unwrap(), "--out", out], &dir);
    assert_eq!(run.status.code(), Some(1));
    assert!(
        text(&run.stderr).contains("belongs to an `eagle3` drafter"),
        "{}",
        text(&run.stderr)
    );

    let stream = eagle3_pipe(
        &dir,
        r#"stream(listen = "127.0.0.1:0")"#,
        "    vocab_map = \"given.safetensors\"\n",
    );
    let run = draftpipe(&["vocab", stream.to_str().unwrap(), "--out", out], &dir);
    assert_eq!(run.status.code(), Some(1), "{}", text(&run.stderr));
    assert!(
        text(&run.stderr).contains("a stream source cannot be counted"),
        "{}",
        text(&run.stderr)
    );

    let synthetic = eagle3_pipe(&dir, "synthetic(seed = 1, lengths = 4..16)", "");
    // Under a regular file: no directory can be made there (a missing directory is created, as for a trace).
    std::fs::write(dir.join("not-a-dir"), "a file").unwrap();
    let nowhere = dir.join("not-a-dir/map.safetensors");
    let run = draftpipe(
        &[
            "vocab",
            synthetic.to_str().unwrap(),
            "--out",
            nowhere.to_str().unwrap(),
            "--batches",
            "2",
        ],
        &dir,
    );
    assert_eq!(run.status.code(), Some(1));
    assert!(
        text(&run.stderr).contains("not-a-dir/map.safetensors"),
        "{}",
        text(&run.stderr)
    );

    let run = draftpipe(
        &[
            "vocab",
            synthetic.to_str().unwrap(),
            "--out",
            out,
            "--batches",
            "0",
        ],
        &dir,
    );
    assert_eq!(run.status.code(), Some(2), "clap refuses --batches 0");
}

#[test]
fn a_run_trains_with_the_given_vocab_map_and_refuses_one_of_other_sizes() {
    let dir = scratch("vocab", "run");
    let source = "synthetic(seed = 2, lengths = 4..16)";
    let counted = eagle3_pipe(&dir, source, "    steps     = 3\n");
    let made = draftpipe(
        &[
            "vocab",
            counted.to_str().unwrap(),
            "--out",
            "map.safetensors",
            "--batches",
            "5",
        ],
        &dir,
    );
    assert_eq!(made.status.code(), Some(0), "{}", text(&made.stderr));
    let given = eagle3_pipe(
        &dir,
        source,
        "    steps     = 3\n    vocab_map = \"map.safetensors\"\n",
    );
    let run = draftpipe(&["run", given.to_str().unwrap(), "--run-dir", "r"], &dir);
    assert_eq!(run.status.code(), Some(0), "{}", text(&run.stderr));
    // Without the key the run counts the source itself.
    let run = draftpipe(&["run", counted.to_str().unwrap(), "--run-dir", "r2"], &dir);
    assert_eq!(run.status.code(), Some(0), "{}", text(&run.stderr));

    // A map for another draft vocabulary (the identity over all 40 ids) is refused before training.
    let identity = VocabMap::identity(40);
    identity.write(&dir.join("map.safetensors")).unwrap();
    let run = draftpipe(&["run", given.to_str().unwrap(), "--run-dir", "r3"], &dir);
    assert_eq!(run.status.code(), Some(1), "{}", text(&run.stderr));
    let stderr = text(&run.stderr);
    assert!(
        stderr.contains("map.safetensors")
            && stderr.contains("`d2t`")
            && stderr.contains("draft_vocab"),
        "{stderr}"
    );
}

/// `--save` of an eagle3 run writes SGLang's `LlamaForCausalLMEagle3` export: `config.json` with its
/// architecture and draft vocabulary, `model.safetensors` with the trained tensors and the run's `d2t` (I64) and
/// `t2d` (BOOL), no embedding; `export-check` passes it for both engines, and `--resume` reads it back (the
/// vocabulary tensors are not part of the replica).
#[test]
fn a_saved_eagle3_run_is_sglangs_export_and_resumes() {
    let dir = scratch("vocab", "save");
    let pipe = eagle3_pipe(
        &dir,
        "synthetic(seed = 3, lengths = 4..16)",
        "    steps     = 3\n",
    );
    let run = draftpipe(
        &[
            "run",
            pipe.to_str().unwrap(),
            "--run-dir",
            "r",
            "--save",
            "out",
        ],
        &dir,
    );
    assert_eq!(run.status.code(), Some(0), "{}", text(&run.stderr));
    let out = dir.join("out");
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(
        config["architectures"][0], "LlamaForCausalLMEagle3",
        "{config}"
    );
    assert_eq!(config["draft_vocab_size"], 6, "{config}");
    let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
    let weights = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let d2t: TensorView<'_> = weights.tensor("d2t").unwrap();
    assert_eq!((d2t.dtype(), d2t.shape()), (Dtype::I64, &[6usize][..]));
    let t2d = weights.tensor("t2d").unwrap();
    assert_eq!((t2d.dtype(), t2d.shape()), (Dtype::BOOL, &[40usize][..]));
    assert!(weights.tensor("fc.weight").is_ok() && weights.tensor("lm_head.weight").is_ok());
    assert!(weights.names().iter().all(|n| !n.contains("embed")));

    let check = draftpipe(&["export-check", out.to_str().unwrap()], &dir);
    assert_eq!(
        check.status.code(),
        Some(0),
        "{}{}",
        text(&check.stdout),
        text(&check.stderr)
    );

    let resumed = draftpipe(
        &[
            "run",
            pipe.to_str().unwrap(),
            "--run-dir",
            "r2",
            "--resume",
            "out",
            "--steps",
            "5",
        ],
        &dir,
    );
    assert_eq!(resumed.status.code(), Some(0), "{}", text(&resumed.stderr));
}
