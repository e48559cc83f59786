//! Files that must be refused with a clear error instead of poisoning a run: checkpoints with corrupt counters
//! or non-finite values (loaded or about to be saved), `--init` weights with a NaN, hidden-state files whose
//! header declares a huge empty tensor or whose data holds a NaN.

mod source_support;

use std::path::Path;

use draftpipe_compiler::plan::SourceSpec;
use draftpipe_runtime::checkpoint::*;
use draftpipe_runtime::source::{BucketShapes, SafetensorsDataset, SourceError, open_sources};
use draftpipe_runtime::tensor_file::TensorProblem;
use safetensors::Dtype;
use source_support::{small_model, temp_dir, write_file};

fn state(step: u64) -> TrainingState {
    TrainingState {
        step,
        optimizer_step: step,
        plan_name: "validation".into(),
        rng_state: vec![0],
        data_positions: vec![step],
        stream_producers: Vec::new(),
    }
}

/// Finite buffers with distinct values; second moments positive.
fn buffers(n: usize) -> [Vec<f32>; 3] {
    let value = |i: usize, salt: usize| ((i * 31 + salt * 7) % 97) as f32 / 97.0 - 0.5;
    [
        (0..n).map(|i| value(i, 1)).collect(),
        (0..n).map(|i| value(i, 2)).collect(),
        (0..n).map(|i| value(i, 3).abs() + 1e-3).collect(),
    ]
}

fn save(dir: &Path, model: &draftpipe_compiler::plan::ModelPlan, b: &[Vec<f32>; 3], step: u64) {
    save_checkpoint(dir, model, &b[0], &b[1], &b[2], &state(step)).unwrap();
}

/// Rewrites one field of `dir/state.json`.
fn edit_state(dir: &Path, field: &str, value: serde_json::Value) {
    let path = training_state_dir(dir).join(STATE_FILE);
    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    json[field] = value;
    std::fs::write(&path, serde_json::to_vec(&json).unwrap()).unwrap();
}

#[test]
fn corrupt_counters_in_state_json_are_refused() {
    let root = temp_dir("ckpt-counters");
    let model = small_model(8, 8, 32);
    let b = buffers(model.parameters);
    for (field, value, expected) in [
        // 2^64 − 1 wrapped to 0 in the bias correction and turned every weight into NaN.
        (
            "optimizer_step",
            serde_json::json!(u64::MAX),
            "optimizer_step",
        ),
        ("step", serde_json::json!(u64::MAX), "step"),
        ("optimizer_step", serde_json::json!(11), "exceeds step 10"),
        (
            "data_positions",
            serde_json::json!([u64::MAX]),
            "data position",
        ),
    ] {
        let dir = root.join(format!("{field}-{value}"));
        save(&dir, &model, &b, 10);
        edit_state(&dir, field, value);
        match load_checkpoint(&dir, &model) {
            Err(error @ CheckpointError::State { .. }) => {
                let text = error.to_string();
                assert!(text.contains(expected), "{field}: {text}");
                assert!(text.contains(STATE_FILE), "{field}: {text}");
            }
            other => panic!("{field}: expected a state error, got {other:?}"),
        }
    }
}

#[test]
fn non_finite_or_negative_tensor_values_are_refused_on_load_naming_the_tensor() {
    let root = temp_dir("ckpt-values");
    let model = small_model(8, 8, 32);
    let name = &model.layout[1].name;
    for (file, tensor, value) in [
        (MODEL_FILE, name.clone(), f64::NAN),
        (
            OPTIMIZER_FILE,
            format!("{EXP_AVG_PREFIX}{name}"),
            f64::INFINITY,
        ),
        (OPTIMIZER_FILE, format!("{EXP_AVG_SQ_PREFIX}{name}"), -1.0),
    ] {
        let dir = root.join(&tensor);
        save(&dir, &model, &buffers(model.parameters), 3);
        let path = match file {
            MODEL_FILE => dir.join(file),
            _ => training_state_dir(&dir).join(file),
        };
        // Rewrite the file with the same tensors and one value replaced.
        let bytes = std::fs::read(&path).unwrap();
        let parsed = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let tensors: Vec<(String, Dtype, Vec<usize>, Vec<f64>)> = parsed
            .tensors()
            .into_iter()
            .map(|(n, view)| {
                let mut values: Vec<f64> = view
                    .data()
                    .chunks_exact(4)
                    .map(|c| f64::from(f32::from_le_bytes(c.try_into().unwrap())))
                    .collect();
                if n == tensor {
                    values[2] = value;
                }
                (n, view.dtype(), view.shape().to_vec(), values)
            })
            .collect();
        let borrowed: Vec<_> = tensors
            .iter()
            .map(|(n, d, s, v)| (n.as_str(), *d, s.clone(), v.clone()))
            .collect();
        write_file(&path, &borrowed);
        let error = load_checkpoint(&dir, &model).unwrap_err();
        let text = error.to_string();
        assert!(
            text.contains(&tensor) && text.contains(file),
            "{tensor}: {text}"
        );
        if file == MODEL_FILE {
            // `--init` reads the same file the same way.
            let error = load_weights(&dir.join(MODEL_FILE), &model).unwrap_err();
            assert!(
                matches!(
                    &error,
                    CheckpointError::Tensor(e) if matches!(e.problem, TensorProblem::NonFinite { at: 2, .. })
                ),
                "{error}"
            );
        }
    }
}

#[test]
fn a_non_finite_buffer_is_never_saved_and_the_previous_checkpoint_is_kept() {
    let root = temp_dir("ckpt-nonfinite-save");
    let model = small_model(8, 8, 32);
    let dir = root.join("ckpt");
    let good = buffers(model.parameters);
    save(&dir, &model, &good, 5);
    let before = std::fs::read(dir.join(MODEL_FILE)).unwrap();
    for buffer in 0..3 {
        let mut bad = good.clone();
        let at = model.layout[2].range().start + 4;
        bad[buffer][at] = f32::NAN;
        let error = save_checkpoint(&dir, &model, &bad[0], &bad[1], &bad[2], &state(6))
            .expect_err("a NaN must not be saved");
        let text = error.to_string();
        assert!(
            matches!(&error, CheckpointError::NonFinite { tensor, at: 4, .. } if *tensor == model.layout[2].name),
            "{text}"
        );
        assert!(text.contains("is kept"), "{text}");
    }
    assert_eq!(std::fs::read(dir.join(MODEL_FILE)).unwrap(), before);
    assert_eq!(load_checkpoint(&dir, &model).unwrap().state.step, 5);
}

/// A plan reading hidden states (width 8) from `pattern`, buckets 8 and 16.
fn data_plan(pattern: &Path) -> draftpipe_compiler::plan::Plan {
    let source = SourceSpec::Safetensors {
        pattern: pattern.to_string_lossy().into_owned(),
        epochs: 1,
        shuffle_seed: None,
    };
    source_support::plan(source, 64, 4, 2, &[8, 16], 32, 1)
}

#[test]
fn a_header_declaring_a_huge_empty_tensor_is_refused_without_allocating_by_it() {
    let root = temp_dir("st-huge-empty");
    let plan = data_plan(&root.join("x.safetensors"));
    let shapes = BucketShapes::from_plan(&plan);
    // Zero elements and no data, so the file is valid safetensors; 2^40 positions per row would have been an
    // 8 TiB allocation (the process aborted).
    for (name, rows, seq) in [("long", 0usize, 1usize << 40), ("many", 1 << 40, 0)] {
        let path = root.join(format!("{name}.safetensors"));
        write_file(
            &path,
            &[
                ("hidden_states", Dtype::F32, vec![rows, seq, 8], vec![]),
                ("input_ids", Dtype::I32, vec![rows, seq], vec![]),
            ],
        );
        match SafetensorsDataset::open(&path.to_string_lossy(), &plan.target, &shapes) {
            Err(SourceError::Config(message)) => {
                assert!(message.contains("holds no sequence"), "{message}");
            }
            other => panic!("{name}: expected an empty-data error, got {other:?}"),
        }
    }
}

#[test]
fn a_nan_in_the_hidden_states_names_the_file_and_tensor() {
    let root = temp_dir("st-nan");
    let path = root.join("poisoned.safetensors");
    let (rows, seq, width) = (4usize, 8usize, 8usize);
    let mut hs: Vec<f64> = (0..rows * seq * width)
        .map(|i| (i % 13) as f64 / 13.0)
        .collect();
    hs[2 * seq * width + 5] = f64::NAN;
    write_file(
        &path,
        &[
            ("hidden_states", Dtype::F32, vec![rows, seq, width], hs),
            (
                "input_ids",
                Dtype::I32,
                vec![rows, seq],
                vec![1.0; rows * seq],
            ),
        ],
    );
    let plan = data_plan(&path);
    let shapes = BucketShapes::from_plan(&plan);
    let mut source = open_sources(&plan).unwrap().remove(0);
    let bucket = source.next_bucket().unwrap().unwrap();
    let mut batch = shapes.buffer();
    shapes.shape_for(&mut batch, bucket);
    match source.fill_next(&mut batch) {
        Err(SourceError::File(error)) => {
            assert_eq!(error.path, path);
            assert_eq!(error.tensor.as_deref(), Some("hidden_states"));
            assert!(
                matches!(error.problem, TensorProblem::NonFinite { at, .. } if at == 2 * seq * width + 5),
                "{error}"
            );
        }
        other => panic!("expected the file's error, got {other:?}"),
    }
}
