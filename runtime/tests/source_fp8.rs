//! FP8 hidden states through the files source: `F8_E4M3` `hidden_states` with their `hidden_states_scale` held
//! as they are in an fp8 plan and dequantised into a bf16 one, bf16 files quantised at load into an fp8 plan,
//! the refusals of a missing, misshapen or non-finite scale naming the file and the tensor, and the quantiser's
//! error against f32 on hidden-state-like rows (the figures docs/sources.md states).

mod source_support;

use std::path::Path;

use draftpipe_compiler::plan::{HsDtype, SourceSpec};
use draftpipe_runtime::batch::{HsBatch, HsData};
use draftpipe_runtime::fp8::{Fp8Rows, decode, quantise_row};
use draftpipe_runtime::source::{BatchPool, Producer, SourceError, open_sources, resolve_hs_dtype};
use half::bf16;
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};
use safetensors::Dtype;
use safetensors::tensor::TensorView;
use source_support::temp_dir;

const VOCAB: usize = 64;
/// Width of a token's hidden states in `source_support::plan` (hidden 6 × 2 taps).
const D: usize = 12;
const ROWS: usize = 8;
const SEQ: usize = 8;

fn file_plan(pattern: &Path, hs_dtype: Option<HsDtype>) -> draftpipe_compiler::plan::Plan {
    let source = SourceSpec::Safetensors {
        pattern: pattern.to_string_lossy().into_owned(),
        epochs: 1,
        shuffle_seed: None,
    };
    let mut plan = source_support::plan(source, VOCAB, 6, 2, &[8], 32, 1);
    plan.target.hs_dtype = hs_dtype;
    resolve_hs_dtype(&plan).unwrap()
}

/// Hidden-state-like values: most channels small and Gaussian-ish, a few "massive activation" channels two
/// orders of magnitude larger, as LLM residual streams have.
fn hidden_like(rng: &mut Xoshiro256PlusPlus, n: usize, width: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let normal: f32 = (0..4).map(|_| rng.random_range(-1.0f32..1.0)).sum::<f32>() * 0.8;
            if i % width == 3 {
                normal * 80.0 + 120.0
            } else {
                normal
            }
        })
        .collect()
}

/// Writes a safetensors file of raw little-endian tensors `(name, dtype, shape, bytes)`.
fn write_raw(path: &Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            (
                name.to_string(),
                TensorView::new(*dtype, shape.clone(), bytes).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// The quantised form of `values` (rows of `D`): codes and the scales' little-endian bytes.
fn quantised(values: &[f32]) -> (Vec<u8>, Vec<u8>) {
    let mut codes = vec![0u8; values.len()];
    let scales: Vec<u8> = values
        .chunks(D)
        .zip(codes.chunks_mut(D))
        .flat_map(|(row, codes)| quantise_row(row, codes).to_le_bytes())
        .collect();
    (codes, scales)
}

fn ids() -> Vec<u8> {
    (0..ROWS * SEQ)
        .flat_map(|i| ((i * 7 % VOCAB) as i64).to_le_bytes())
        .collect()
}

/// An FP8 file of `values` with the scale tensor `scale` (`None`: the right one, or none for a `missing` file).
fn fp8_file(path: &Path, values: &[f32], scale: Option<(Dtype, Vec<usize>, Vec<u8>)>) {
    let (codes, scales) = quantised(values);
    let mut tensors = vec![
        ("hidden_states", Dtype::F8_E4M3, vec![ROWS, SEQ, D], codes),
        ("input_ids", Dtype::I64, vec![ROWS, SEQ], ids()),
    ];
    match scale {
        Some((dtype, shape, bytes)) => tensors.push(("hidden_states_scale", dtype, shape, bytes)),
        None if path.to_string_lossy().contains("missing") => {}
        None => tensors.push(("hidden_states_scale", Dtype::F32, vec![ROWS, SEQ], scales)),
    }
    write_raw(path, &tensors);
}

/// Every batch of `plan`'s files, in file order (one producer, FIFO).
fn read_all(plan: &draftpipe_compiler::plan::Plan) -> Result<Vec<HsBatch>, SourceError> {
    let pool = BatchPool::for_plan(plan).unwrap();
    let mut producer = Producer::new(open_sources(plan)?.remove(0));
    let stop = std::sync::atomic::AtomicBool::new(false);
    let mut batches = Vec::new();
    while let Some(batch) = producer.next_batch(&pool, &stop)? {
        batches.push((*batch).clone());
        pool.give_back(batch).unwrap();
    }
    Ok(batches)
}

#[test]
fn an_fp8_file_is_held_as_it_is_in_an_fp8_plan_and_dequantised_into_a_bf16_one() {
    let dir = temp_dir("fp8_file");
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(5);
    let values = hidden_like(&mut rng, ROWS * SEQ * D, D);
    let path = dir.join("a.safetensors");
    fp8_file(&path, &values, None);
    let (codes, scales) = quantised(&values);
    let scales: Vec<f32> = scales
        .chunks(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();

    let fp8 = file_plan(&path, None);
    assert_eq!(
        fp8.target.hs_dtype,
        Some(HsDtype::Fp8E4m3),
        "the file decides"
    );
    let batches = read_all(&fp8).unwrap();
    assert_eq!(batches.len(), 2);
    for (b, batch) in batches.iter().enumerate() {
        let HsData::Fp8E4m3(rows) = &batch.hs else {
            panic!("a {:?} batch", batch.hs.dtype())
        };
        let mut rows = rows.clone();
        let (got_codes, got_scales) = rows.parts_mut();
        let tokens = 4 * SEQ;
        assert_eq!(
            got_codes,
            &codes[b * tokens * D..(b + 1) * tokens * D],
            "batch {b}"
        );
        assert_eq!(
            got_scales,
            &scales[b * tokens..(b + 1) * tokens],
            "batch {b}"
        );
    }

    let into_bf16 = read_all(&file_plan(&path, Some(HsDtype::Bf16))).unwrap();
    let HsData::Bf16(got) = &into_bf16[0].hs else {
        panic!("not bf16")
    };
    for (i, got) in got.iter().enumerate() {
        let want = bf16::from_f32(decode(codes[i]) * scales[i / D]);
        assert_eq!(got.to_bits(), want.to_bits(), "element {i}");
    }
}

#[test]
fn a_bf16_file_is_quantised_per_token_when_it_is_read_into_an_fp8_plan() {
    let dir = temp_dir("fp8_from_bf16");
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(6);
    let values: Vec<f32> = hidden_like(&mut rng, ROWS * SEQ * D, D)
        .iter()
        .map(|&v| bf16::from_f32(v).to_f32())
        .collect();
    let path = dir.join("b.safetensors");
    let hs: Vec<u8> = values
        .iter()
        .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
        .collect();
    write_raw(
        &path,
        &[
            ("hidden_states", Dtype::BF16, vec![ROWS, SEQ, D], hs),
            ("input_ids", Dtype::I64, vec![ROWS, SEQ], ids()),
        ],
    );
    let batches = read_all(&file_plan(&path, Some(HsDtype::Fp8E4m3))).unwrap();
    let mut want = Fp8Rows::zeroed(D, 4 * SEQ * D);
    want.store_f32(0, &values[..4 * SEQ * D]);
    assert_eq!(batches[0].hs, HsData::Fp8E4m3(want));
}

#[test]
fn a_missing_misshapen_or_non_finite_scale_is_refused_naming_the_file_and_the_tensor() {
    let dir = temp_dir("fp8_refusals");
    let values = vec![1.0f32; ROWS * SEQ * D];
    let refused = |name: &str, scale: Option<(Dtype, Vec<usize>, Vec<u8>)>| -> String {
        let path = dir.join(name);
        fp8_file(&path, &values, scale);
        let plan = file_plan(&path, Some(HsDtype::Fp8E4m3));
        let error = read_all(&plan).expect_err(name).to_string();
        assert!(error.contains(name), "{error}");
        assert!(error.contains("hidden_states_scale"), "{error}");
        error
    };
    let ones = |n: usize| {
        (0..n)
            .flat_map(|_| 1.0f32.to_le_bytes())
            .collect::<Vec<u8>>()
    };
    let missing = refused("missing.safetensors", None);
    assert!(missing.contains("missing"), "{missing}");
    let shape = refused(
        "shape.safetensors",
        Some((Dtype::F32, vec![ROWS, SEQ + 1], ones(ROWS * (SEQ + 1)))),
    );
    assert!(shape.contains("[8, 9]"), "{shape}");
    let dtype = refused(
        "dtype.safetensors",
        Some((Dtype::F16, vec![ROWS, SEQ], vec![0; ROWS * SEQ * 2])),
    );
    assert!(dtype.contains("F32"), "{dtype}");
    let mut nan = ones(ROWS * SEQ);
    nan[4 * 13..4 * 14].copy_from_slice(&f32::NAN.to_le_bytes());
    let nan = refused("nan.safetensors", Some((Dtype::F32, vec![ROWS, SEQ], nan)));
    assert!(nan.contains("element 13 "), "the token is named: {nan}");
}

/// The quantiser's error against f32 on hidden-state-like rows, beside bf16's: per element, the largest
/// relative error over elements in E4M3's normal range (the rest are within a fixed step of 2⁻⁹ · scale), and
/// the RMS error relative to the rows' RMS. Printed for docs/sources.md; bounded by the format.
#[test]
fn the_quantisation_error_against_f32_is_e4m3s_half_step() {
    let width = 4096;
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(32);
    let values = hidden_like(&mut rng, 64 * width, width);
    let mut rows = Fp8Rows::zeroed(width, values.len());
    rows.store_f32(0, &values);
    let (mut worst, mut worst_bf16) = (0.0f64, 0.0f64);
    let (mut err2, mut err2_bf16, mut sum2) = (0.0f64, 0.0f64, 0.0f64);
    for (i, &x) in values.iter().enumerate() {
        let (q, b) = (rows.get(i) as f64, bf16::from_f32(x).to_f32() as f64);
        let x = x as f64;
        let scale = rows.parts_mut().1[i / width] as f64;
        if x.abs() >= scale / 64.0 {
            worst = worst.max((q - x).abs() / x.abs());
        }
        if x != 0.0 {
            worst_bf16 = worst_bf16.max((b - x).abs() / x.abs());
        }
        err2 += (q - x).powi(2);
        err2_bf16 += (b - x).powi(2);
        sum2 += x * x;
    }
    let (rms, rms_bf16) = ((err2 / sum2).sqrt(), (err2_bf16 / sum2).sqrt());
    println!(
        "fp8_e4m3 per-token scale: max relative error {worst:.4} (normal range), RMS error / RMS {rms:.5}; \
         bf16: max relative {worst_bf16:.5}, RMS {rms_bf16:.6}"
    );
    assert!(worst <= 1.0 / 16.0 + 1e-6, "{worst}");
    assert!(worst_bf16 <= 1.0 / 256.0 + 1e-9, "{worst_bf16}");
    assert!(rms < 0.04, "{rms}");
}

/// The Python producer's quantiser (`clients/python/draftpipe_client/_fp8.py`) and the runtime's give the same
/// codes and scales: `tests/data/fp8_golden.safetensors` holds f32 rows (a zero row, a row of scale 1 with ties
/// and subnormals, one with an outlier, random rows over eight decades) and what the Python side made of them
/// (`python scripts/fp8_golden.py runtime/tests/data/fp8_golden.safetensors` writes it).
#[test]
fn the_python_producers_codes_and_scales_are_the_runtimes() {
    let bytes = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/fp8_golden.safetensors"
    ))
    .unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let tensor = |name: &str| file.tensor(name).unwrap();
    assert_eq!(tensor("hidden_states").dtype(), Dtype::F8_E4M3);
    let values: Vec<f32> = tensor("values")
        .data()
        .chunks(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let width = tensor("values").shape()[1];
    let mut codes = vec![0u8; values.len()];
    let scales: Vec<u8> = values
        .chunks(width)
        .zip(codes.chunks_mut(width))
        .flat_map(|(row, codes)| quantise_row(row, codes).to_le_bytes())
        .collect();
    assert_eq!(scales, tensor("hidden_states_scale").data());
    let python = tensor("hidden_states").data();
    for (i, (ours, theirs)) in codes.iter().zip(python).enumerate() {
        assert_eq!(ours, theirs, "element {i} ({})", values[i]);
    }
}
