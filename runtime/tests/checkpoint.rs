//! Checkpoints: exact round trips, the file format, plan checks, and atomic replacement under interruption.

mod source_support;

use std::path::Path;

use draftpipe_runtime::checkpoint::*;
use draftpipe_runtime::tensor_file::TensorProblem;
use safetensors::{Dtype, SafeTensors};
use source_support::{small_model, temp_dir, write_file};

/// Fresh values with a spread of magnitudes, signs and special bit patterns.
fn buffers(n: usize, seed: u64) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut state = seed;
    let mut next = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let bits = (state >> 32) as u32;
        // Any f32 bit pattern a trainable weight can hold, subnormals included: a magnitude at or past 2^64
        // (its square overflows, so loading refuses it as untrainable) and the infinities and NaNs fold down
        // by 2^128, keeping every sign and mantissa bit.
        let exponent = (bits >> 23) & 0xff;
        f32::from_bits(if exponent >= 127 + 64 {
            bits & !0x4000_0000
        } else {
            bits
        })
    };
    (
        (0..n).map(|_| next()).collect(),
        (0..n).map(|_| next()).collect(),
        (0..n).map(|_| next().abs()).collect(),
    )
}

fn state(step: u64) -> TrainingState {
    TrainingState {
        step,
        optimizer_step: step.saturating_sub(1),
        plan_name: "quickstart".into(),
        rng_state: vec![step, 42, u64::MAX],
        data_positions: vec![step * 2, step * 2 + 1],
        stream_producers: Vec::new(),
    }
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

fn assert_same(loaded: &Checkpoint, (p, m, v): &(Vec<f32>, Vec<f32>, Vec<f32>), step: u64) {
    assert_eq!(bits(&loaded.params), bits(p));
    assert_eq!(bits(&loaded.exp_avg), bits(m));
    assert_eq!(bits(&loaded.exp_avg_sq), bits(v));
    assert_eq!(loaded.state, state(step));
}

fn save(
    dir: &Path,
    model: &draftpipe_compiler::plan::ModelPlan,
    b: &(Vec<f32>, Vec<f32>, Vec<f32>),
    step: u64,
) {
    save_checkpoint(dir, model, &b.0, &b.1, &b.2, &state(step)).unwrap();
}

#[test]
fn a_checkpoint_round_trips_bit_exactly() {
    let model = small_model(24, 8, 40);
    let root = temp_dir("ckpt-roundtrip");
    let dir = root.join("ckpt");
    let data = buffers(model.parameters, 1);
    save(&dir, &model, &data, 7);
    assert_same(&load_checkpoint(&dir, &model).unwrap(), &data, 7);
    assert_eq!(
        bits(&load_weights(&dir.join(MODEL_FILE), &model).unwrap()),
        bits(&data.0)
    );
    let mut entries: Vec<_> = std::fs::read_dir(dir.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    entries.sort();
    assert_eq!(
        entries,
        ["ckpt"],
        "no staging or previous directory left behind"
    );
}

#[test]
fn the_files_carry_the_plan_names_and_shapes_for_pytorch() {
    let model = small_model(24, 8, 40);
    let root = temp_dir("ckpt-format");
    let dir = root.join("ckpt");
    let data = buffers(model.parameters, 2);
    save(&dir, &model, &data, 3);
    let bytes = std::fs::read(dir.join(MODEL_FILE)).unwrap();
    // The reference reader validates the header strictly (contiguous offsets, exact file length).
    let tensors = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(tensors.len(), model.layout.len());
    for view in &model.layout {
        let t = tensors.tensor(&view.name).unwrap();
        assert_eq!((t.dtype(), t.shape()), (Dtype::F32, view.shape.as_slice()));
        let values: Vec<u32> = t
            .data()
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(values, bits(&data.0[view.range()]), "{}", view.name);
    }
    let (_, metadata) = SafeTensors::read_metadata(&bytes).unwrap();
    assert_eq!(metadata.metadata().as_ref().unwrap()["format"], "pt");
    let optimizer = std::fs::read(training_state_dir(&dir).join(OPTIMIZER_FILE)).unwrap();
    let optimizer = SafeTensors::deserialize(&optimizer).unwrap();
    assert_eq!(optimizer.len(), 2 * model.layout.len());
    let head = optimizer.tensor("exp_avg_sq.lm_head.weight").unwrap();
    assert_eq!(head.shape(), [40, 8]);
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(training_state_dir(&dir).join(STATE_FILE)).unwrap())
            .unwrap();
    assert_eq!(json["step"], 3);
    assert_eq!(json["parameters"], model.parameters);
    assert_eq!(json["plan_name"], "quickstart");
    assert_eq!(json["data_positions"], serde_json::json!([6, 7]));
}

#[test]
fn saving_again_replaces_the_previous_checkpoint() {
    let model = small_model(16, 8, 20);
    let root = temp_dir("ckpt-replace");
    let dir = root.join("ckpt");
    save(&dir, &model, &buffers(model.parameters, 3), 1);
    let newer = buffers(model.parameters, 4);
    save(&dir, &model, &newer, 2);
    assert_same(&load_checkpoint(&dir, &model).unwrap(), &newer, 2);
}

#[test]
fn a_write_interrupted_before_the_renames_leaves_the_previous_checkpoint() {
    let model = small_model(16, 8, 20);
    let root = temp_dir("ckpt-interrupt-stage");
    let dir = root.join("ckpt");
    let old = buffers(model.parameters, 5);
    save(&dir, &model, &old, 10);
    let new = buffers(model.parameters, 6);
    // The process "dies" after staging: the files are in ckpt.tmp, nothing was renamed.
    let staged = stage_checkpoint(&dir, &model, &new.0, &new.1, &new.2, &state(11)).unwrap();
    assert!(
        training_state_dir(&dir.with_file_name("ckpt.tmp"))
            .join(STATE_FILE)
            .is_file()
    );
    drop(staged);
    assert_same(&load_checkpoint(&dir, &model).unwrap(), &old, 10);
    // A half-written staging file (killed mid-write) is likewise ignored, and the next save clears it.
    std::fs::write(
        dir.with_file_name("ckpt.tmp").join(MODEL_FILE),
        b"\x10\x00\x00",
    )
    .unwrap();
    assert_same(&load_checkpoint(&dir, &model).unwrap(), &old, 10);
    save(&dir, &model, &new, 12);
    assert_same(&load_checkpoint(&dir, &model).unwrap(), &new, 12);
    assert!(!dir.with_file_name("ckpt.tmp").exists());
}

#[test]
fn a_write_interrupted_between_the_renames_falls_back_to_the_previous_checkpoint() {
    let model = small_model(16, 8, 20);
    let root = temp_dir("ckpt-interrupt-rename");
    let dir = root.join("ckpt");
    let old = buffers(model.parameters, 7);
    save(&dir, &model, &old, 20);
    let new = buffers(model.parameters, 8);
    let staged = stage_checkpoint(&dir, &model, &new.0, &new.1, &new.2, &state(21)).unwrap();
    drop(staged);
    // Killed after the first rename (ckpt → ckpt.prev) and before the second (ckpt.tmp → ckpt).
    std::fs::rename(&dir, dir.with_file_name("ckpt.prev")).unwrap();
    assert_eq!(
        resolve_checkpoint_dir(&dir).unwrap(),
        dir.with_file_name("ckpt.prev")
    );
    assert_same(&load_checkpoint(&dir, &model).unwrap(), &old, 20);
    let newest = buffers(model.parameters, 9);
    save(&dir, &model, &newest, 22);
    assert_same(&load_checkpoint(&dir, &model).unwrap(), &newest, 22);
    assert!(!dir.with_file_name("ckpt.prev").exists() && !dir.with_file_name("ckpt.tmp").exists());
}

#[test]
fn directories_that_are_not_checkpoints_are_left_alone() {
    let model = small_model(16, 8, 20);
    let home = temp_dir("ckpt-foreign");
    std::fs::write(home.join("notes.txt"), "keep me").unwrap();
    let data = buffers(model.parameters, 10);
    let err = save_checkpoint(&home, &model, &data.0, &data.1, &data.2, &state(1)).unwrap_err();
    assert!(
        matches!(err, CheckpointError::NotACheckpoint { .. }),
        "{err}"
    );
    assert_eq!(
        std::fs::read_to_string(home.join("notes.txt")).unwrap(),
        "keep me"
    );
    assert!(matches!(
        load_checkpoint(&home, &model),
        Err(CheckpointError::NotFound { .. })
    ));
}

#[test]
fn a_checkpoint_for_another_model_or_with_wrong_buffers_is_refused() {
    let model = small_model(16, 8, 20);
    let root = temp_dir("ckpt-mismatch");
    let dir = root.join("ckpt");
    let data = buffers(model.parameters, 11);
    save(&dir, &model, &data, 1);
    let wider = small_model(16, 12, 20);
    assert!(matches!(
        load_checkpoint(&dir, &wider),
        Err(CheckpointError::Mismatch(_))
    ));
    // Same parameter count, different shapes: din and vocab traded.
    let mut swapped = model.clone();
    swapped.layout[0].shape = vec![16, 8];
    let err = load_weights(&dir.join(MODEL_FILE), &swapped).unwrap_err();
    match err {
        CheckpointError::Tensor(e) => {
            assert_eq!(e.tensor.as_deref(), Some("fc.weight"));
            assert!(matches!(e.problem, TensorProblem::WrongShape { .. }));
        }
        other => panic!("{other}"),
    }
    let short = &data.0[1..];
    assert!(matches!(
        save_checkpoint(&dir, &model, short, &data.1, &data.2, &state(2)),
        Err(CheckpointError::Mismatch(_))
    ));
}

#[test]
fn weights_from_pytorch_load_in_half_precision_and_missing_or_extra_tensors_are_errors() {
    let model = small_model(8, 4, 10);
    let dir = temp_dir("ckpt-init");
    let value = |name: &str, i: usize| ((name.len() * 3 + i) % 17) as f64 / 4.0 - 2.0;
    let tensors: Vec<(&str, Dtype, Vec<usize>, Vec<f64>)> = model
        .layout
        .iter()
        .map(|v| {
            (
                v.name.as_str(),
                Dtype::BF16,
                v.shape.clone(),
                (0..v.len()).map(|i| value(&v.name, i)).collect(),
            )
        })
        .collect();
    let path = dir.join("init.safetensors");
    write_file(&path, &tensors);
    let params = load_weights(&path, &model).unwrap();
    for v in &model.layout {
        let expected: Vec<f32> = (0..v.len()).map(|i| value(&v.name, i) as f32).collect();
        assert_eq!(&params[v.range()], expected.as_slice(), "{}", v.name);
    }

    let missing = dir.join("missing.safetensors");
    write_file(&missing, &tensors[1..]);
    let err = load_weights(&missing, &model).unwrap_err();
    assert!(
        err.to_string().contains("fc.weight") && err.to_string().contains("missing"),
        "{err}"
    );

    let mut extra = tensors.clone();
    extra.push(("rotary.inv_freq", Dtype::F32, vec![2], vec![1.0, 2.0]));
    let path_extra = dir.join("extra.safetensors");
    write_file(&path_extra, &extra);
    let err = load_weights(&path_extra, &model).unwrap_err();
    assert!(
        err.to_string().contains("rotary.inv_freq") && err.to_string().contains("unexpected"),
        "{err}"
    );

    let mut ints = tensors;
    ints[0].1 = Dtype::I32;
    let path_ints = dir.join("ints.safetensors");
    write_file(&path_ints, &ints);
    assert!(
        load_weights(&path_ints, &model)
            .unwrap_err()
            .to_string()
            .contains("dtype I32")
    );
}

#[test]
fn truncated_checkpoint_files_and_bad_state_are_reported() {
    let model = small_model(16, 8, 20);
    let root = temp_dir("ckpt-corrupt");
    let dir = root.join("ckpt");
    save(&dir, &model, &buffers(model.parameters, 12), 1);
    let optimizer = training_state_dir(&dir).join(OPTIMIZER_FILE);
    let bytes = std::fs::read(&optimizer).unwrap();
    std::fs::write(&optimizer, &bytes[..bytes.len() - 4]).unwrap();
    let err = load_checkpoint(&dir, &model).unwrap_err();
    assert!(
        err.to_string().contains("optimizer.safetensors") && err.to_string().contains("truncated"),
        "{err}"
    );
    std::fs::write(&optimizer, &bytes).unwrap();

    let state_path = training_state_dir(&dir).join(STATE_FILE);
    let text = std::fs::read_to_string(&state_path).unwrap();
    std::fs::write(
        &state_path,
        text.replace("\"format_version\": 1", "\"format_version\": 99"),
    )
    .unwrap();
    assert!(matches!(
        load_checkpoint(&dir, &model),
        Err(CheckpointError::State { .. })
    ));
    std::fs::write(&state_path, "{").unwrap();
    assert!(matches!(
        load_checkpoint(&dir, &model),
        Err(CheckpointError::State { .. })
    ));
}

#[test]
fn stream_producer_records_round_trip_and_old_states_read_without_them() {
    let mut with = state(3);
    with.stream_producers = vec![
        ProducerRecord {
            name: "gpu0".into(),
            slot: Some(1),
            delivered: 17,
        },
        ProducerRecord {
            name: "gone".into(),
            slot: None,
            delivered: 4,
        },
    ];
    let json = serde_json::to_string(&with).unwrap();
    assert_eq!(serde_json::from_str::<TrainingState>(&json).unwrap(), with);
    // Written before the records were kept (and by runs without a stream): the field is absent.
    let old = serde_json::to_string(&state(3)).unwrap();
    assert!(!old.contains("stream_producers"), "{old}");
    let read: TrainingState = serde_json::from_str(&old).unwrap();
    assert!(read.stream_producers.is_empty());
}
