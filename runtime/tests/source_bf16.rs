//! Hidden states kept in the precision they arrive in: a bf16 file fills a bf16 pool and crosses the queue bit
//! for bit, the files decide the precision when the plan does not, the first layer's products read bf16 (and
//! f16) rows a tile at a time as an f64 reference computes them, and a bf16 run trains as an f32 run on the same
//! values does.

mod source_support;

use draftpipe_compiler::plan::{
    AdamWSpec, BucketPlan, HsDtype, LossSpec, LrSchedule, Precision, SourceSpec, WorkspaceLayout,
};
use draftpipe_compiler::workspace::{BackendKind, Dtype as LayoutDtype, WorkspaceBuffer};
use draftpipe_runtime::backend::cpu::CpuBackend;
use draftpipe_runtime::backend::{Backend, HsBuf, HsOperand, Operand};
use draftpipe_runtime::batch::{HsBatch, HsData};
use draftpipe_runtime::drafter::Drafter;
use draftpipe_runtime::params::FlatState;
use draftpipe_runtime::pipeline::queue_config;
use draftpipe_runtime::queue::HsQueue;
use draftpipe_runtime::source::{BatchPool, Producer, open_sources, resolve_hs_dtype};
use half::{bf16, f16};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};
use safetensors::Dtype;
use source_support::{temp_dir, write_file};

const VOCAB: usize = 40;
const D: usize = 12; // hidden 6 × 2 tap layers

/// Finite bf16 values with every mantissa pattern likely, as f64 (exact).
fn random_bf16(rng: &mut Xoshiro256PlusPlus, n: usize) -> Vec<f64> {
    (0..n)
        .map(|_| {
            let sign = u16::from(rng.random_range(0..2u8)) << 15;
            let exponent = rng.random_range(100u16..150) << 7;
            let mantissa = rng.random_range(0u16..128);
            bf16::from_bits(sign | exponent | mantissa).to_f64()
        })
        .collect()
}

fn file_plan(pattern: &str, hs_dtype: Option<HsDtype>) -> draftpipe_compiler::plan::Plan {
    let source = SourceSpec::Safetensors {
        pattern: pattern.to_owned(),
        epochs: 1,
        shuffle_seed: None,
    };
    let mut plan = source_support::plan(source, VOCAB, 6, 2, &[8], 32, 1);
    plan.target.hs_dtype = hs_dtype;
    plan
}

#[test]
fn a_bf16_file_fills_a_bf16_pool_and_crosses_the_queue_bit_for_bit() {
    let dir = temp_dir("bf16_round_trip");
    let (rows, seq) = (8, 8);
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(3);
    let hs = random_bf16(&mut rng, rows * seq * D);
    let ids: Vec<f64> = (0..rows * seq).map(|i| (i * 7 % VOCAB) as f64).collect();
    let path = dir.join("a.safetensors");
    write_file(
        &path,
        &[
            ("hidden_states", Dtype::BF16, vec![rows, seq, D], hs.clone()),
            ("input_ids", Dtype::I64, vec![rows, seq], ids),
        ],
    );
    let plan = resolve_hs_dtype(&file_plan(&path.to_string_lossy(), None)).unwrap();
    assert_eq!(
        plan.target.hs_dtype,
        Some(HsDtype::Bf16),
        "the file decides"
    );

    let pool = BatchPool::for_plan(&plan).unwrap();
    let queue = HsQueue::new(queue_config(&plan.queue, 1)).unwrap();
    let mut producer = Producer::new(open_sources(&plan).unwrap().remove(0));
    let stop = std::sync::atomic::AtomicBool::new(false);
    while let Some(batch) = producer.next_batch(&pool, &stop).unwrap() {
        queue.try_push(batch).map_err(|_| "queue full").unwrap();
    }
    queue.close();
    let mut batches = 0;
    while let Some(batch) = queue.pop() {
        let HsData::Bf16(got) = &batch.hs else {
            panic!("a {:?} batch from a bf16 file", batch.hs.dtype());
        };
        // Four sequences of 8 tokens per item, rows in file order (fifo, one producer).
        let first = batches * 4 * seq * D;
        let want: Vec<u16> = hs[first..first + 4 * seq * D]
            .iter()
            .map(|&v| bf16::from_f64(v).to_bits())
            .collect();
        let got: Vec<u16> = got.iter().map(|v| v.to_bits()).collect();
        assert_eq!(got, want, "batch {batches}");
        pool.give_back(batch).unwrap();
        batches += 1;
    }
    assert_eq!(batches, 2);
    assert_eq!(pool.available(), pool.items());
}

#[test]
fn files_of_two_precisions_are_held_in_the_wider_and_a_set_hs_dtype_wins() {
    let dir = temp_dir("bf16_mixed");
    let ids: Vec<f64> = vec![1.0; 8];
    for (name, dtype) in [
        ("a.safetensors", Dtype::BF16),
        ("b.safetensors", Dtype::F16),
    ] {
        let tensors = [
            ("hidden_states", dtype, vec![1, 8, D], vec![0.5; 8 * D]),
            ("input_ids", Dtype::I64, vec![1, 8], ids.clone()),
        ];
        write_file(&dir.join(name), &tensors);
    }
    let pattern = dir.join("*.safetensors").to_string_lossy().into_owned();
    let resolved = resolve_hs_dtype(&file_plan(&pattern, None)).unwrap();
    assert_eq!(resolved.target.hs_dtype, Some(HsDtype::F32));
    let set = resolve_hs_dtype(&file_plan(&pattern, Some(HsDtype::F16))).unwrap();
    assert_eq!(set.target.hs_dtype, Some(HsDtype::F16));
    // Both files' rows arrive in f16 (bf16 0.5 is exact in f16).
    let pool = BatchPool::for_plan(&set).unwrap();
    let mut producer = Producer::new(open_sources(&set).unwrap().remove(0));
    let stop = std::sync::atomic::AtomicBool::new(false);
    let batch = producer.next_batch(&pool, &stop).unwrap().unwrap();
    assert_eq!(batch.hs.dtype(), HsDtype::F16);
    assert_eq!(batch.hs.to_f32_vec(0..2 * 8 * D), vec![0.5; 2 * 8 * D]);
}

/// `Σ_k a[i, k]·b[k, j]` in f64 for row-major stored operands used as `op(a)`, `op(b)`.
fn reference(
    a: &[f64],
    (a_rows, a_cols, a_t): (usize, usize, bool),
    b: &[f64],
    (b_rows, b_cols, b_t): (usize, usize, bool),
) -> (Vec<f64>, Vec<f64>, usize) {
    let (m, k) = if a_t {
        (a_cols, a_rows)
    } else {
        (a_rows, a_cols)
    };
    let n = if b_t { b_rows } else { b_cols };
    let at = |i: usize, p: usize| {
        if a_t {
            a[p * a_cols + i]
        } else {
            a[i * a_cols + p]
        }
    };
    let bt = |p: usize, j: usize| {
        if b_t {
            b[j * b_cols + p]
        } else {
            b[p * b_cols + j]
        }
    };
    let mut c = vec![0.0; m * n];
    let mut magnitude = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            for p in 0..k {
                c[i * n + j] += at(i, p) * bt(p, j);
                magnitude[i * n + j] += (at(i, p) * bt(p, j)).abs();
            }
        }
    }
    (c, magnitude, n)
}

fn tiled_backend(cols: usize) -> CpuBackend {
    let layout = WorkspaceLayout {
        tokens: 0,
        sequences: 0,
        chunk_rows: 0,
        input_slots: 0,
        hs_operand_elements: 0,
        buffers: vec![WorkspaceBuffer {
            name: "hs_tile".into(),
            dtype: LayoutDtype::F32,
            elements: draftpipe_compiler::workspace::HS_TILE_ROWS * cols,
        }],
    };
    CpuBackend::new(&layout)
}

#[test]
fn products_with_narrow_hidden_states_match_an_f64_reference_on_every_side() {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(11);
    // 600 stored rows: two full tiles and a partial one.
    let (rows, cols, other) = (600, 24, 10);
    for dtype in [HsDtype::Bf16, HsDtype::F16] {
        for (hs_is_a, transposed) in [(true, false), (true, true), (false, false), (false, true)] {
            for beta in [0.0f32, 0.5] {
                let mut be = tiled_backend(cols);
                let hs: Vec<f64> = (0..rows * cols)
                    .map(|_| rng.random_range(-4.0..4.0))
                    .collect();
                let hs_buf = match dtype {
                    HsDtype::Bf16 => {
                        let mut buf = be.alloc::<bf16>(hs.len()).unwrap();
                        let data: Vec<bf16> = hs.iter().map(|&v| bf16::from_f64(v)).collect();
                        be.upload(buf.all_mut(), &data).unwrap();
                        HsBuf::Bf16(buf)
                    }
                    _ => {
                        let mut buf = be.alloc::<f16>(hs.len()).unwrap();
                        let data: Vec<f16> = hs.iter().map(|&v| f16::from_f64(v)).collect();
                        be.upload(buf.all_mut(), &data).unwrap();
                        HsBuf::F16(buf)
                    }
                };
                let hs: Vec<f64> = match &hs_buf {
                    HsBuf::Bf16(b) => b.as_slice().iter().map(|v| v.to_f64()).collect(),
                    HsBuf::F16(b) => b.as_slice().iter().map(|v| v.to_f64()).collect(),
                    HsBuf::F32(_) => unreachable!(),
                };
                // The other operand shares the hidden states' stored-row dimension where the product needs it.
                let hs_used_rows = if transposed { cols } else { rows };
                let hs_used_cols = if transposed { rows } else { cols };
                let (o_rows, o_cols) = if hs_is_a {
                    (hs_used_cols, other) // b = [k, other]
                } else {
                    (other, hs_used_rows) // a = [other, k]
                };
                let o: Vec<f32> = (0..o_rows * o_cols)
                    .map(|_| rng.random_range(-1.0f32..1.0))
                    .collect();
                let mut o_buf = be.alloc::<f32>(o.len()).unwrap();
                be.upload(o_buf.all_mut(), &o).unwrap();
                let o64: Vec<f64> = o.iter().map(|&v| f64::from(v)).collect();
                let hs_shape = (rows, cols, transposed);
                let (want, magnitude, n) = if hs_is_a {
                    reference(&hs, hs_shape, &o64, (o_rows, o_cols, false))
                } else {
                    reference(&o64, (o_rows, o_cols, false), &hs, hs_shape)
                };
                let start: Vec<f32> = (0..want.len()).map(|i| (i % 7) as f32 - 3.0).collect();
                let poison = if beta == 0.0 {
                    vec![f32::NAN; want.len()]
                } else {
                    start.clone()
                };
                let mut c = be.alloc::<f32>(want.len()).unwrap();
                be.upload(c.all_mut(), &poison).unwrap();
                let hs_op = HsOperand::new(hs_buf.at(0, rows * cols), rows, cols);
                let hs_op = if transposed { hs_op.t() } else { hs_op };
                let o_op: HsOperand<'_, CpuBackend> =
                    Operand::new(o_buf.all(), o_rows, o_cols).into();
                let (a, b) = if hs_is_a {
                    (hs_op, o_op)
                } else {
                    (o_op, hs_op)
                };
                be.gemm_hs(c.all_mut(), a, b, 1.0, beta, Precision::F32)
                    .unwrap();
                for (i, &got) in c.as_slice().iter().enumerate() {
                    let expected = want[i] + f64::from(beta) * f64::from(start[i]);
                    // The classic bound for an f32 sum of `k` products: k·ε·Σ|terms|.
                    let k = if hs_is_a != transposed { cols } else { rows };
                    let tolerance =
                        (k as f64 + 2.0) * f64::from(f32::EPSILON) * (magnitude[i] + 4.0);
                    assert!(
                        (f64::from(got) - expected).abs() <= tolerance,
                        "{dtype:?} hs_is_a {hs_is_a} transposed {transposed} beta {beta}: c[{}, {}] = {got}, \
                         f64 {expected}",
                        i / n,
                        i % n
                    );
                }
            }
        }
    }
}

/// Batches of bf16-representable hidden states, in `dtype`, with a learnable next-token signal.
fn batches(dtype: HsDtype, count: usize) -> Vec<HsBatch> {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(5);
    (0..count)
        .map(|_| {
            let mut batch = HsBatch::zeroed_in(dtype, 8, 4, D);
            for s in 0..4 {
                let len = rng.random_range(4..=8);
                batch.seq_lens[s] = len as u32;
                for t in 0..len {
                    let i = s * 8 + t;
                    let id = rng.random_range(0..VOCAB as u32);
                    batch.input_ids[i] = id;
                    batch.loss_mask[i] = 1;
                    let row: Vec<f32> = (0..D)
                        .map(|d| {
                            bf16::from_f32(
                                ((id as usize * 5 + d) % 9) as f32 / 4.0 - 1.0
                                    + rng.random_range(-0.1f32..0.1),
                            )
                            .to_f32()
                        })
                        .collect();
                    batch.hs.store_f32(i * D, &row);
                }
            }
            batch
        })
        .collect()
}

fn losses(slots: HsDtype, data: &[HsBatch], precision: Precision) -> Vec<f32> {
    let model = source_support::small_model(D, 8, VOCAB);
    let bucket = BucketPlan {
        padded_len: 8,
        sequences: 4,
        tokens: 32,
        step_flops: 0,
        step_bytes: 0,
    };
    let loss = LossSpec {
        head_decay: 0.8,
        position_decay: None,
        step_decay: None,
        chunk_tokens: 16,
    };
    let adamw = AdamWSpec {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
        clip_grad_norm: None,
        schedule: LrSchedule::CONSTANT,
    };
    let layout = WorkspaceLayout::of_model(
        &model.spec,
        std::slice::from_ref(&bucket),
        &loss,
        BackendKind::Cpu,
        precision,
    )
    .and_then(|l| l.with_hs_dtype(BackendKind::Cpu, slots))
    .unwrap();
    let mut drafter = Drafter::with_hs_dtype(
        CpuBackend::new(&layout),
        &model,
        (loss, adamw, precision),
        &[bucket],
        slots,
    )
    .unwrap();
    // What the drafter allocates is what the layout (and so `compile`) counts: the state and, for narrow
    // slots, the slots in that precision plus the f32 tile.
    assert_eq!(
        drafter.allocated_bytes(),
        layout.bytes().unwrap() + 16 * model.parameters as u64
    );
    drafter.upload_state(&FlatState::init(&model, 9)).unwrap();
    data.iter()
        .map(|batch| {
            drafter.stage(batch).unwrap();
            drafter
                .step()
                .unwrap()
                .expect("the CPU step is synchronous")
                .loss
        })
        .collect()
}

#[test]
fn a_bf16_run_trains_as_an_f32_run_on_the_same_values() {
    let bf16_data = batches(HsDtype::Bf16, 12);
    let f32_data = batches(HsDtype::F32, 12);
    for precision in [Precision::F32, Precision::Bf16] {
        let reference = losses(HsDtype::F32, &f32_data, precision);
        let bf16_slots = losses(HsDtype::Bf16, &bf16_data, precision);
        let widened = losses(HsDtype::F32, &bf16_data, precision);
        assert!(
            reference.last() < reference.first(),
            "{precision:?}: {reference:?}"
        );
        for (step, ((&r, &b), &w)) in reference.iter().zip(&bf16_slots).zip(&widened).enumerate() {
            // Tiles along the depth may group the sums otherwise than one product (the `gemm` crate's depth
            // blocks are 512 or more): close, not equal; a batch widened into f32 slots is the f32 run exactly.
            assert!(
                (r - b).abs() <= 1e-6 * r.abs() && r == w,
                "{precision:?} step {step}: f32 {r}, bf16 slots {b}, widened {w}"
            );
        }
    }
}
