//! Hidden-state files: round trips per dtype, mask trimming, batching order, globbing, and clear errors.

mod source_support;

use std::path::{Path, PathBuf};

use draftpipe_compiler::plan::{Plan, SourceSpec};
use draftpipe_runtime::batch::HsBatch;
use draftpipe_runtime::source::safetensors::wildcard_match;
use draftpipe_runtime::source::{
    BucketShapes, HsSource, SafetensorsDataset, SourceError, open_sources,
};
use draftpipe_runtime::tensor_file::{TensorFileError, TensorProblem};
use safetensors::Dtype;
use source_support::{temp_dir, write_file};

const VOCAB: usize = 50;
const D: usize = 8; // hidden 4 × 2 tap layers

fn plan(pattern: &Path, producers: usize) -> Plan {
    let source = SourceSpec::Safetensors {
        pattern: pattern.to_string_lossy().into_owned(),
        epochs: 1,
        shuffle_seed: None,
    };
    // Bucket 8 holds 4 sequences per item, bucket 16 holds 2.
    source_support::plan(source, VOCAB, 4, 2, &[8, 16], 32, producers)
}

/// Hidden-state values exactly representable in F16 and BF16, distinct per (row, position, feature).
fn hs_value(row: usize, t: usize, k: usize) -> f64 {
    ((row * 131 + t * 17 + k * 5) % 61) as f64 / 8.0 - 3.75
}

fn id_value(row: usize, t: usize) -> f64 {
    ((row * 7 + t * 3) % VOCAB) as f64
}

type Tensor = (&'static str, Dtype, Vec<usize>, Vec<f64>);

fn hs_tensor(dtype: Dtype, rows: usize, seq: usize, width: usize) -> Tensor {
    let values = (0..rows * seq * width)
        .map(|i| hs_value(i / (seq * width), i / width % seq, i % width))
        .collect();
    ("hidden_states", dtype, vec![rows, seq, width], values)
}

fn ids_tensor(dtype: Dtype, rows: usize, seq: usize) -> Tensor {
    (
        "input_ids",
        dtype,
        vec![rows, seq],
        (0..rows * seq)
            .map(|i| id_value(i / seq, i % seq))
            .collect(),
    )
}

/// Every batch of a single-producer stream, in order, into NaN-poisoned buffers.
fn all_batches(source: &mut dyn HsSource, shapes: &BucketShapes) -> Vec<HsBatch> {
    let mut batches = Vec::new();
    while let Some(bucket) = source.next_bucket().unwrap() {
        let mut batch = shapes.buffer();
        shapes.shape_for(&mut batch, bucket);
        batch.hs.fill(f32::NAN);
        batch.input_ids.fill(u32::MAX);
        batch.loss_mask.fill(9);
        source.fill_next(&mut batch).unwrap();
        batches.push(batch);
    }
    batches
}

/// Checks that slot `slot` of `batch` holds row `row` with length `len` and mask `mask`, then clean padding.
fn assert_slot(batch: &HsBatch, slot: usize, row: usize, len: usize, mask: &[u8]) {
    assert_eq!(batch.seq_lens[slot] as usize, len);
    for t in 0..batch.padded_len {
        let i = slot * batch.padded_len + t;
        let hs = batch.hs.to_f32_vec(i * D..(i + 1) * D);
        if t < len {
            assert_eq!(
                batch.input_ids[i] as f64,
                id_value(row, t),
                "row {row} t {t}"
            );
            assert_eq!(Some(&batch.loss_mask[i]), mask.get(t), "row {row} t {t}");
            let expected: Vec<f32> = (0..D).map(|k| hs_value(row, t, k) as f32).collect();
            assert_eq!(hs, expected.as_slice(), "row {row} t {t}");
        } else {
            assert_eq!((batch.input_ids[i], batch.loss_mask[i]), (0, 0));
            assert!(hs.iter().all(|&v| v == 0.0));
        }
    }
}

#[test]
fn every_hidden_state_and_id_dtype_round_trips_exactly() {
    let dir = temp_dir("st-dtypes");
    for hs_dtype in [Dtype::F32, Dtype::BF16, Dtype::F16] {
        for id_dtype in [Dtype::I32, Dtype::I64] {
            let path = dir.join(format!("{hs_dtype:?}-{id_dtype:?}.safetensors"));
            write_file(
                &path,
                &[hs_tensor(hs_dtype, 5, 16, D), ids_tensor(id_dtype, 5, 16)],
            );
            let plan = plan(&path, 1);
            let shapes = BucketShapes::from_plan(&plan);
            let batches = all_batches(open_sources(&plan).unwrap()[0].as_mut(), &shapes);
            // Five full-length rows into items of two: rows (0, 1), (2, 3), then (4) with an empty slot.
            assert_eq!(batches.len(), 3, "{hs_dtype:?}/{id_dtype:?}");
            for (row, (b, slot)) in (0..5).map(|r| (r / 2, r % 2)).enumerate() {
                assert_slot(&batches[b], slot, row, 16, &[1; 16]);
                assert_eq!(batches[b].source_position, b as u64);
            }
            assert_slot(&batches[2], 1, 0, 0, &[]);
        }
    }
}

#[test]
fn the_loss_mask_trims_trailing_positions_and_routes_sequences_by_length() {
    let dir = temp_dir("st-mask");
    let lengths_and_holes = [(5, None), (0, None), (16, Some(3)), (9, None), (8, Some(0))];
    let masks: Vec<Vec<u8>> = lengths_and_holes
        .iter()
        .map(|&(len, hole)| {
            (0..16)
                .map(|t| u8::from(t < len && Some(t) != hole))
                .collect()
        })
        .collect();
    for mask_dtype in [Dtype::BOOL, Dtype::F32, Dtype::I16] {
        let path = dir.join(format!("mask-{mask_dtype:?}.safetensors"));
        let mask_values = masks.iter().flatten().map(|&m| f64::from(m)).collect();
        let mask = ("loss_mask", mask_dtype, vec![5, 16], mask_values);
        write_file(
            &path,
            &[
                hs_tensor(Dtype::F32, 5, 16, D),
                ids_tensor(Dtype::I64, 5, 16),
                mask,
            ],
        );
        let mut plan = plan(&path, 1);
        // One all-masked row of five is over the default `max_bad_mask_share` (tests/source_masks.rs); here it
        // is the skipping that is tested.
        plan.target.masks.max_bad_share = 1.0;
        let shapes = BucketShapes::from_plan(&plan);
        let batches = all_batches(open_sources(&plan).unwrap()[0].as_mut(), &shapes);
        // Row 1 is all masked: skipped. Rows 2 and 3 fill a bucket-16 item first; rows 0 and 4 are flushed last.
        assert_eq!(batches.len(), 2);
        assert_eq!((batches[0].padded_len, batches[1].padded_len), (16, 8));
        assert_slot(&batches[0], 0, 2, 16, &masks[2]);
        assert_slot(&batches[0], 1, 3, 9, &masks[3]);
        assert_slot(&batches[1], 0, 0, 5, &masks[0]);
        assert_slot(&batches[1], 1, 4, 8, &masks[4]);
        assert_slot(&batches[1], 2, 0, 0, &[]);
        assert_slot(&batches[1], 3, 0, 0, &[]);
    }
}

#[test]
fn a_glob_reads_matching_files_in_order_and_producers_split_the_batches() {
    let dir = temp_dir("st-glob");
    for part in [1, 0] {
        let mut hs = hs_tensor(Dtype::F32, 4, 8, D);
        hs.3.iter_mut().for_each(|v| *v += part as f64 * 100.0);
        write_file(
            &dir.join(format!("part-{part}.safetensors")),
            &[hs, ids_tensor(Dtype::I32, 4, 8)],
        );
    }
    write_file(
        &dir.join("other.safetensors"),
        &[hs_tensor(Dtype::F32, 1, 8, 6), ids_tensor(Dtype::I32, 1, 8)],
    );
    let plan = plan(&dir.join("part-?.safetensors"), 2);
    let dataset = SafetensorsDataset::open(
        &dir.join("part-*").to_string_lossy(),
        &plan.target,
        &BucketShapes::from_plan(&plan),
    )
    .unwrap();
    let names: Vec<_> = dataset
        .files()
        .map(|p| p.file_name().unwrap().to_owned())
        .collect();
    assert_eq!(names, ["part-0.safetensors", "part-1.safetensors"]);
    assert_eq!((dataset.sequences(), dataset.batches()), (8, 2));

    let shapes = BucketShapes::from_plan(&plan);
    let mut sources = open_sources(&plan).unwrap();
    let first = all_batches(sources[0].as_mut(), &shapes);
    let second = all_batches(sources[1].as_mut(), &shapes);
    assert_eq!((first.len(), second.len()), (1, 1));
    assert_eq!(
        (first[0].source_position, second[0].source_position),
        (0, 1)
    );
    assert_eq!(first[0].hs.get(0) as f64, hs_value(0, 0, 0));
    assert_eq!(second[0].hs.get(0) as f64, hs_value(0, 0, 0) + 100.0);
    assert!(sources[1].next_bucket().unwrap().is_none());
    let mut past_end = shapes.buffer();
    assert!(matches!(
        sources[1].fill_next(&mut past_end),
        Err(SourceError::Buffer(_))
    ));

    // A directory means all its *.safetensors files, and a restarted producer resumes from its position.
    let all = plan_dir_sequences(&dir);
    assert_eq!(
        all,
        Err("other.safetensors".into()),
        "the odd-width file is read and refused"
    );
    sources[1].seek(1).unwrap();
    assert_eq!(all_batches(sources[1].as_mut(), &shapes), second);
}

fn plan_dir_sequences(dir: &Path) -> Result<usize, String> {
    let plan = plan(dir, 1);
    match SafetensorsDataset::open(
        &dir.to_string_lossy(),
        &plan.target,
        &BucketShapes::from_plan(&plan),
    ) {
        Ok(d) => Ok(d.sequences()),
        Err(SourceError::File(e)) => {
            Err(e.path.file_name().unwrap().to_string_lossy().into_owned())
        }
        Err(e) => panic!("{e}"),
    }
}

/// Opens `tensors` as a one-file dataset and returns the file error.
fn file_error(name: &str, tensors: &[Tensor]) -> (TensorFileError, String) {
    let root = temp_dir(&format!("st-err-{name}"));
    let path = root.join("bad.safetensors");
    write_file(&path, tensors);
    open_error(&path)
}

fn open_error(path: &Path) -> (TensorFileError, String) {
    match open_sources(&plan(path, 1)) {
        Err(SourceError::File(e)) => {
            let message = e.to_string();
            assert!(
                message.contains(&path.display().to_string()),
                "message names the file: {message}"
            );
            (e, message)
        }
        Err(other) => panic!("expected a file error, got {other}"),
        Ok(_) => panic!("expected an error for {}", path.display()),
    }
}

fn tensor_of(e: &TensorFileError) -> &str {
    e.tensor.as_deref().unwrap_or("<file>")
}

#[test]
fn truncated_and_garbled_files_are_reported_with_their_name() {
    let dir = temp_dir("st-trunc");
    let path = dir.join("cut.safetensors");
    write_file(
        &path,
        &[hs_tensor(Dtype::F32, 2, 8, D), ids_tensor(Dtype::I32, 2, 8)],
    );
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 10]).unwrap();
    let (e, message) = open_error(&path);
    assert!(
        matches!(e.problem, TensorProblem::Truncated { actual, needed } if needed == actual + 10),
        "{message}"
    );
    assert!(message.contains("truncated"), "{message}");

    std::fs::write(&path, &bytes[..5]).unwrap();
    assert!(matches!(
        open_error(&path).0.problem,
        TensorProblem::Truncated {
            needed: 8,
            actual: 5
        }
    ));
    let mut garbled = bytes.clone();
    garbled[8..12].copy_from_slice(b"nope");
    std::fs::write(&path, &garbled).unwrap();
    assert!(matches!(
        open_error(&path).0.problem,
        TensorProblem::BadHeader(_)
    ));
    let mut huge = bytes;
    huge[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&path, &huge).unwrap();
    assert!(matches!(
        open_error(&path).0.problem,
        TensorProblem::BadHeader(_)
    ));
}

#[test]
fn wrong_dtypes_ranks_and_shapes_name_the_tensor() {
    let ids = || ids_tensor(Dtype::I32, 2, 8);
    let (e, m) = file_error("hs-dtype", &[hs_tensor(Dtype::I32, 2, 8, D), ids()]);
    assert!(
        matches!(
            e.problem,
            TensorProblem::WrongDtype {
                found: Dtype::I32,
                ..
            }
        ) && tensor_of(&e) == "hidden_states",
        "{m}"
    );
    assert!(m.contains("hidden_states") && m.contains("I32"), "{m}");

    let flat = (
        "hidden_states",
        Dtype::F32,
        vec![2, 8 * D],
        vec![0.5; 2 * 8 * D],
    );
    let (e, m) = file_error("hs-rank", &[flat, ids()]);
    assert!(
        matches!(
            e.problem,
            TensorProblem::WrongRank {
                found: 2,
                expected: 3,
                ..
            }
        ),
        "{m}"
    );

    let (e, m) = file_error("hs-width", &[hs_tensor(Dtype::F32, 2, 8, 6), ids()]);
    assert!(
        matches!(e.problem, TensorProblem::WrongShape { .. }) && tensor_of(&e) == "hidden_states",
        "{m}"
    );
    assert!(m.contains("hidden 4 × 2 tap layers"), "{m}");

    let (e, m) = file_error(
        "ids-shape",
        &[hs_tensor(Dtype::F32, 2, 8, D), ids_tensor(Dtype::I32, 2, 9)],
    );
    assert!(
        matches!(e.problem, TensorProblem::WrongShape { .. }) && tensor_of(&e) == "input_ids",
        "{m}"
    );

    let (e, m) = file_error(
        "ids-dtype",
        &[hs_tensor(Dtype::F32, 2, 8, D), ids_tensor(Dtype::F32, 2, 8)],
    );
    assert!(
        matches!(e.problem, TensorProblem::WrongDtype { .. }) && tensor_of(&e) == "input_ids",
        "{m}"
    );

    let (e, m) = file_error("ids-missing", &[hs_tensor(Dtype::F32, 2, 8, D)]);
    assert!(
        matches!(e.problem, TensorProblem::Missing) && tensor_of(&e) == "input_ids",
        "{m}"
    );
    assert!(m.contains("input_ids") && m.contains("missing"), "{m}");

    let (e, m) = file_error("hs-missing", &[ids()]);
    assert!(
        matches!(e.problem, TensorProblem::Missing) && tensor_of(&e) == "hidden_states",
        "{m}"
    );

    let mask = ("loss_mask", Dtype::U8, vec![3, 8], vec![1.0; 24]);
    let (e, m) = file_error("mask-shape", &[hs_tensor(Dtype::F32, 2, 8, D), ids(), mask]);
    assert!(
        matches!(e.problem, TensorProblem::WrongShape { .. }) && tensor_of(&e) == "loss_mask",
        "{m}"
    );
}

#[test]
fn out_of_range_ids_and_overlong_sequences_are_refused() {
    let mut ids = ids_tensor(Dtype::I64, 2, 8);
    ids.3[8 + 5] = VOCAB as f64;
    let (e, m) = file_error("id-vocab", &[hs_tensor(Dtype::F32, 2, 8, D), ids.clone()]);
    assert!(
        matches!(e.problem, TensorProblem::OutOfRange { value: 50, .. }),
        "{m}"
    );
    assert!(m.contains("[1, 5]") && m.contains("input_ids"), "{m}");
    ids.3[8 + 5] = -100.0;
    let (e, _) = file_error("id-negative", &[hs_tensor(Dtype::F32, 2, 8, D), ids]);
    assert!(matches!(
        e.problem,
        TensorProblem::OutOfRange { value: -100, .. }
    ));

    let (e, m) = file_error(
        "too-long",
        &[
            hs_tensor(Dtype::F32, 2, 20, D),
            ids_tensor(Dtype::I32, 2, 20),
        ],
    );
    assert!(
        m.contains("sequence 0 of 2 has 20 tokens; the largest bucket is 16"),
        "{m}"
    );
    assert_eq!(tensor_of(&e), "input_ids");
}

#[test]
fn patterns_that_match_nothing_or_put_wildcards_in_directories_are_refused() {
    let dir = temp_dir("st-pattern");
    let missing: PathBuf = dir.join("none-*.safetensors");
    assert!(matches!(
        open_sources(&plan(&missing, 1)),
        Err(SourceError::NoMatch { .. })
    ));
    assert!(matches!(
        open_sources(&plan(&dir.join("absent.safetensors"), 1)),
        Err(SourceError::NoMatch { .. })
    ));
    assert!(matches!(
        open_sources(&plan(&dir.join("*/x.safetensors"), 1)),
        Err(SourceError::Config(_))
    ));
}

#[test]
fn wildcards_match_like_a_shell() {
    for (pattern, name, expected) in [
        ("*.safetensors", "a.safetensors", true),
        ("*.safetensors", "a.safetensors.bak", false),
        ("part-?.st", "part-3.st", true),
        ("part-?.st", "part-12.st", false),
        ("a*b*c", "axxbyyc", true),
        ("a*b*c", "axxbyy", false),
        ("*", "", true),
        ("?", "", false),
        ("a**", "a", true),
        ("*aab", "aaab", true),
    ] {
        assert_eq!(
            wildcard_match(pattern, name),
            expected,
            "{pattern} ~ {name}"
        );
    }
}

/// The first hidden-state value of each batch: a batch's fingerprint (rows have distinct values).
fn fingerprints(batches: &[HsBatch]) -> Vec<f32> {
    batches.iter().map(|b| b.hs.get(0)).collect()
}

#[test]
fn epochs_repeat_the_data_in_file_order_or_in_a_seeded_shuffle_that_resumes_exactly() {
    let dir = temp_dir("st-epochs");
    // 24 rows of 8 tokens: bucket 8 holds 4 per item, so 6 batches per epoch.
    write_file(
        &dir.join("data.safetensors"),
        &[
            hs_tensor(Dtype::BF16, 24, 8, D),
            ids_tensor(Dtype::I64, 24, 8),
        ],
    );
    let pattern = dir.join("data.safetensors").to_string_lossy().into_owned();
    let with = |epochs, shuffle_seed| {
        let source = SourceSpec::Safetensors {
            pattern: pattern.clone(),
            epochs,
            shuffle_seed,
        };
        source_support::plan(source, VOCAB, 4, 2, &[8, 16], 32, 1)
    };
    let shapes = BucketShapes::from_plan(&with(1, None));
    let one_pass = fingerprints(&all_batches(
        open_sources(&with(1, None)).unwrap()[0].as_mut(),
        &shapes,
    ));
    assert_eq!(one_pass.len(), 6);

    let in_order = fingerprints(&all_batches(
        open_sources(&with(3, None)).unwrap()[0].as_mut(),
        &shapes,
    ));
    assert_eq!(in_order, one_pass.repeat(3));

    let plan = with(3, Some(7));
    let mut source = open_sources(&plan).unwrap().remove(0);
    let shuffled = all_batches(source.as_mut(), &shapes);
    let shuffled_prints = fingerprints(&shuffled);
    assert_eq!(shuffled_prints.len(), 18);
    let mut sorted_once = one_pass.clone();
    sorted_once.sort_by(f32::total_cmp);
    let epochs: Vec<&[f32]> = shuffled_prints.chunks(6).collect();
    for epoch in &epochs {
        let mut sorted = epoch.to_vec();
        sorted.sort_by(f32::total_cmp);
        assert_eq!(
            sorted, sorted_once,
            "each epoch is a permutation of the batches"
        );
    }
    assert!(
        epochs.iter().any(|e| *e != one_pass.as_slice()),
        "seed 7 leaves every epoch in file order"
    );
    assert_ne!(epochs[0], epochs[1], "two epochs share one order");
    assert!(
        shuffled.iter().map(|b| b.source_position).eq(0..18),
        "positions count on across epochs"
    );

    // The same seed gives the same order, and a seek into the middle of epoch 2 resumes it exactly.
    let again = fingerprints(&all_batches(
        open_sources(&plan).unwrap()[0].as_mut(),
        &shapes,
    ));
    assert_eq!(again, shuffled_prints);
    let mut resumed = open_sources(&plan).unwrap().remove(0);
    resumed.seek(9).unwrap();
    assert_eq!(all_batches(resumed.as_mut(), &shapes), shuffled[9..]);
    let other_seed = fingerprints(&all_batches(
        open_sources(&with(3, Some(8))).unwrap()[0].as_mut(),
        &shapes,
    ));
    assert_ne!(other_seed, shuffled_prints);

    // The status line shows the epoch the producers are in.
    let probe = resumed
        .status_probe()
        .expect("a multi-epoch source reports its epoch");
    assert_eq!(probe.read(), "epoch 3/3");
}
