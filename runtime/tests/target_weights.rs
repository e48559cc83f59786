//! Loading the target's frozen embedding and `lm_head`: one file, shards in a directory, a glob, tied heads,
//! every accepted dtype, and an error naming the file and tensor for each way a checkpoint can be wrong; and the
//! synthetic target's own tables.

mod source_support;

use draftpipe_compiler::plan::{Device, Placement, SourceSpec, TargetStage, WeightsSpec};
use draftpipe_runtime::source::synthetic::SyntheticTarget;
use draftpipe_runtime::target_weights::{EMBEDDING, LM_HEAD, TargetWeights, TargetWeightsError};
use draftpipe_runtime::tensor_file::TensorProblem;
use safetensors::Dtype;
use source_support::{temp_dir, write_file};

const VOCAB: usize = 11;
const HIDDEN: usize = 6;

/// Fresh values with both signs and a spread of magnitudes, exactly representable in bf16 (so every dtype
/// must give them back exactly).
fn values(seed: u64) -> Vec<f64> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..VOCAB * HIDDEN)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let mantissa = (state >> 57) as f64 - 64.0; // -64..63
            let exponent = ((state >> 40) % 9) as i32 - 8;
            mantissa * 2f64.powi(exponent) / 64.0
        })
        .collect()
}

fn as_f32(values: &[f64]) -> Vec<f32> {
    values.iter().map(|&v| v as f32).collect()
}

fn target(weights: Option<String>, source: SourceSpec) -> TargetStage {
    TargetStage {
        name: "t".into(),
        placement: Placement {
            workers: vec![Device::Cpu],
        },
        hidden: HIDDEN,
        layers: None,
        tap_layers: vec![1, 2],
        vocab: VOCAB,
        batch_tokens: 64,
        source,
        max_rate: None,
        weights: weights.map(|path| WeightsSpec::Safetensors { path }),
        hs_dtype: None,
        masks: Default::default(),
    }
}

fn file_source() -> SourceSpec {
    SourceSpec::Safetensors {
        pattern: "data/*.safetensors".into(),
        epochs: 1,
        shuffle_seed: None,
    }
}

#[test]
fn one_file_in_every_float_dtype_reads_back_exactly() {
    let dir = temp_dir("target-weights-dtypes");
    let (embedding, head) = (values(1), values(2));
    for dtype in [Dtype::F32, Dtype::F16, Dtype::BF16] {
        let path = dir.join(format!("{dtype:?}.safetensors"));
        write_file(
            &path,
            &[
                (EMBEDDING, dtype, vec![VOCAB, HIDDEN], embedding.clone()),
                (LM_HEAD, dtype, vec![VOCAB, HIDDEN], head.clone()),
                ("model.norm.weight", dtype, vec![HIDDEN], vec![1.0; HIDDEN]),
            ],
        );
        let stage = target(Some(path.display().to_string()), file_source());
        let weights = TargetWeights::load(&stage).unwrap();
        assert_eq!(weights.embedding(), as_f32(&embedding), "{dtype:?}");
        assert_eq!(weights.lm_head(), as_f32(&head), "{dtype:?}");
        assert!(!weights.is_tied());
        assert_eq!((weights.vocab(), weights.hidden()), (VOCAB, HIDDEN));
    }
}

#[test]
fn shards_in_a_directory_or_a_glob_and_a_tied_head() {
    let dir = temp_dir("target-weights-shards");
    let embedding = values(3);
    write_file(
        &dir.join("model-00001-of-00002.safetensors"),
        &[(
            EMBEDDING,
            Dtype::BF16,
            vec![VOCAB, HIDDEN],
            embedding.clone(),
        )],
    );
    write_file(
        &dir.join("model-00002-of-00002.safetensors"),
        &[(
            "model.norm.weight",
            Dtype::BF16,
            vec![HIDDEN],
            vec![1.0; HIDDEN],
        )],
    );
    for pattern in [
        dir.display().to_string(),
        dir.join("model-*.safetensors").display().to_string(),
    ] {
        let weights = TargetWeights::from_safetensors(&pattern, VOCAB, HIDDEN).unwrap();
        assert!(weights.is_tied(), "{pattern}");
        assert_eq!(weights.embedding(), as_f32(&embedding));
        assert_eq!(weights.lm_head(), weights.embedding());
    }
}

/// The error's text, which must name `file` and `tensor`.
fn assert_names(err: &TargetWeightsError, file: &str, tensor: &str) {
    let text = err.to_string();
    assert!(text.contains(file), "`{text}` does not name {file}");
    assert!(text.contains(tensor), "`{text}` does not name {tensor}");
}

#[test]
fn a_missing_embedding_names_the_files_searched() {
    let dir = temp_dir("target-weights-missing");
    let path = dir.join("head-only.safetensors");
    write_file(
        &path,
        &[(LM_HEAD, Dtype::F32, vec![VOCAB, HIDDEN], values(4))],
    );
    let err =
        TargetWeights::from_safetensors(&path.display().to_string(), VOCAB, HIDDEN).unwrap_err();
    assert!(matches!(err, TargetWeightsError::Missing { tensor, .. } if tensor == EMBEDDING));
    assert_names(&err, "head-only.safetensors", EMBEDDING);
}

#[test]
fn a_wrong_shape_names_file_tensor_and_the_expected_shape() {
    let dir = temp_dir("target-weights-shape");
    let path = dir.join("w.safetensors");
    write_file(
        &path,
        &[
            (EMBEDDING, Dtype::F32, vec![VOCAB, HIDDEN], values(5)),
            // Hidden and vocab swapped: the same element count, so only the shape check can catch it.
            (LM_HEAD, Dtype::F32, vec![HIDDEN, VOCAB], values(6)),
        ],
    );
    let err =
        TargetWeights::from_safetensors(&path.display().to_string(), VOCAB, HIDDEN).unwrap_err();
    assert_names(&err, "w.safetensors", LM_HEAD);
    let TargetWeightsError::File(file_err) = &err else {
        panic!("expected a file error, got {err}");
    };
    assert!(matches!(
        &file_err.problem,
        TensorProblem::WrongShape { found, .. } if *found == [HIDDEN, VOCAB]
    ));
    assert!(err.to_string().contains(&format!("[{VOCAB}, {HIDDEN}]")));
}

#[test]
fn a_wrong_dtype_names_file_and_tensor() {
    let dir = temp_dir("target-weights-dtype");
    let path = dir.join("ints.safetensors");
    write_file(
        &path,
        &[(EMBEDDING, Dtype::I32, vec![VOCAB, HIDDEN], values(7))],
    );
    let err =
        TargetWeights::from_safetensors(&path.display().to_string(), VOCAB, HIDDEN).unwrap_err();
    assert_names(&err, "ints.safetensors", EMBEDDING);
    assert!(matches!(
        &err,
        TargetWeightsError::File(e) if matches!(e.problem, TensorProblem::WrongDtype { found: Dtype::I32, .. })
    ));
}

#[test]
fn an_unreadable_file_and_a_non_finite_weight_are_errors_naming_the_file() {
    let dir = temp_dir("target-weights-unreadable");
    let path = dir.join("broken.safetensors");
    std::fs::write(&path, b"\x0a\x00\x00\x00\x00\x00\x00\x00{not json}").unwrap();
    let err =
        TargetWeights::from_safetensors(&path.display().to_string(), VOCAB, HIDDEN).unwrap_err();
    assert!(err.to_string().contains("broken.safetensors"), "{err}");
    assert!(
        matches!(&err, TargetWeightsError::File(e) if matches!(e.problem, TensorProblem::BadHeader(_)))
    );

    // A shard cut short: its header promises more data than it holds.
    let path = dir.join("cut.safetensors");
    write_file(
        &path,
        &[(EMBEDDING, Dtype::F32, vec![VOCAB, HIDDEN], values(8))],
    );
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 5]).unwrap();
    let err =
        TargetWeights::from_safetensors(&path.display().to_string(), VOCAB, HIDDEN).unwrap_err();
    assert!(err.to_string().contains("cut.safetensors"), "{err}");
    assert!(
        matches!(&err, TargetWeightsError::File(e) if matches!(e.problem, TensorProblem::Truncated { .. }))
    );
    std::fs::remove_file(&path).unwrap();

    let mut poisoned = values(8);
    poisoned[17] = f64::NAN;
    let path = dir.join("nan.safetensors");
    write_file(
        &path,
        &[(EMBEDDING, Dtype::F16, vec![VOCAB, HIDDEN], poisoned)],
    );
    let err =
        TargetWeights::from_safetensors(&path.display().to_string(), VOCAB, HIDDEN).unwrap_err();
    assert_names(&err, "nan.safetensors", EMBEDDING);
    assert!(
        matches!(&err, TargetWeightsError::File(e) if matches!(e.problem, TensorProblem::NonFinite { at: 17, .. }))
    );

    let err = TargetWeights::from_safetensors(
        &dir.join("absent-*.safetensors").display().to_string(),
        VOCAB,
        HIDDEN,
    )
    .unwrap_err();
    assert!(matches!(err, TargetWeightsError::Files { .. }), "{err}");
}

#[test]
fn the_same_tensor_in_two_shards_is_refused() {
    let dir = temp_dir("target-weights-duplicate");
    for shard in ["a", "b"] {
        write_file(
            &dir.join(format!("{shard}.safetensors")),
            &[(EMBEDDING, Dtype::F32, vec![VOCAB, HIDDEN], values(9))],
        );
    }
    let err =
        TargetWeights::from_safetensors(&dir.display().to_string(), VOCAB, HIDDEN).unwrap_err();
    assert!(matches!(err, TargetWeightsError::Duplicate { .. }), "{err}");
    assert_names(&err, "a.safetensors", EMBEDDING);
}

#[test]
fn a_file_target_without_weights_is_an_error_not_a_panic() {
    let err = TargetWeights::load(&target(None, file_source())).unwrap_err();
    assert!(matches!(err, TargetWeightsError::NoWeights { .. }), "{err}");
}

#[test]
fn the_synthetic_target_embeds_with_the_tables_its_hidden_states_use() {
    let source = SourceSpec::Synthetic {
        seed: 5,
        min_len: 4,
        max_len: 9,
    };
    let weights = TargetWeights::load(&target(None, source)).unwrap();
    let again = TargetWeights::synthetic(5, VOCAB, HIDDEN, 2).unwrap();
    assert_eq!(weights, again, "deterministic in the seed");
    let other = TargetWeights::synthetic(6, VOCAB, HIDDEN, 2).unwrap();
    assert_ne!(weights.embedding(), other.embedding());
    // The head is the embedding scaled by 1/√hidden, so the logits of the embedding of `x` peak at `x`.
    let scale = 1.0 / (HIDDEN as f32).sqrt();
    for (h, e) in weights.lm_head().iter().zip(weights.embedding()) {
        assert!((h - e * scale).abs() <= 1e-6 * e.abs().max(1.0));
    }
    // At a realistic width (random vectors of 6 elements are too short to be near-orthogonal).
    let (vocab, hidden) = (64, 64);
    let wide = TargetWeights::synthetic(5, vocab, hidden, 2).unwrap();
    for x in 0..vocab {
        let row = &wide.embedding()[x * hidden..][..hidden];
        let logits: Vec<f32> = wide
            .lm_head()
            .chunks_exact(hidden)
            .map(|head| head.iter().zip(row).map(|(a, b)| a * b).sum())
            .collect();
        let best = (0..vocab)
            .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
            .unwrap();
        assert_eq!(best, x, "logits {logits:?}");
    }
    let synthetic = SyntheticTarget::new(5, VOCAB, HIDDEN, 2).unwrap();
    assert_eq!(synthetic.embedding_table(), weights.embedding());
}
