//! The GPU model's arithmetic on hand-computed cases: every expected figure below is written out from the
//! assumptions' numbers (75% / 60% / 35% GEMMs, 80% of 4.8 TB/s, FlashAttention-2's table, 370 GB/s NCCL,
//! 1 µs per launch), so a changed efficiency or a phase left out fails a test.

use super::*;
use crate::compile_source;

fn close(actual: f64, expected: f64) -> bool {
    (actual - expected).abs() <= 1e-9 * expected.abs().max(1e-30)
}

#[test]
fn each_kernel_kind_takes_its_assumed_share_of_the_h200() {
    let bf16 = Precision::Bf16;
    // A large GEMM is compute-bound: 2·4096³ at 75% of 989 TFLOP/s.
    let large = Work::new(
        "large",
        Phase::Forward,
        Kernel::Gemm {
            m: 4096.0,
            n: 4096.0,
            k: 4096.0,
            accumulate: false,
            f32_operands: false,
        },
    );
    let (kind, s) = time(&H200, bf16, &large);
    assert_eq!(kind, KernelKind::Gemm);
    assert!(close(s, 2.0 * 4096f64.powi(3) / (0.75 * 989e12)), "{s}");
    // Medium: the smallest dimension 512, 60%.
    let medium = Work::new(
        "medium",
        Phase::Forward,
        Kernel::Gemm {
            m: 8192.0,
            n: 512.0,
            k: 8192.0,
            accumulate: false,
            f32_operands: false,
        },
    );
    let (_, s) = time(&H200, bf16, &medium);
    assert!(
        close(s, 2.0 * 8192.0 * 512.0 * 8192.0 / (0.60 * 989e12)),
        "{s}"
    );
    // A skinny GEMM is bandwidth-bound: 2 bytes per operand, 4 per output read and written (accumulate), at
    // 80% of 4.8 TB/s; at f32 its operands are 4 bytes.
    let skinny = Work::new(
        "skinny",
        Phase::Backward,
        Kernel::Gemm {
            m: 65536.0,
            n: 16.0,
            k: 4096.0,
            accumulate: true,
            f32_operands: false,
        },
    );
    let bytes = 2.0 * (65536.0 * 4096.0 + 4096.0 * 16.0) + 8.0 * 65536.0 * 16.0;
    let (_, s) = time(&H200, bf16, &skinny);
    assert!(close(s, bytes / (0.8 * 4.8e12)), "{s}");
    let f32_bytes = 4.0 * (65536.0 * 4096.0 + 4096.0 * 16.0) + 8.0 * 65536.0 * 16.0;
    let f32_compute: f64 = 2.0 * 65536.0 * 16.0 * 4096.0 / (0.35 * 66.9e12);
    let (_, s) = time(&H200, Precision::F32, &skinny);
    assert!(close(s, f32_compute.max(f32_bytes / (0.8 * 4.8e12))), "{s}");
    // Flash attention, head_dim 128, 4096 mean keys over a span of 8192: FA2's 368 forward, 310 backward (at
    // 2.5× the forward's FLOPs), both times the spread 333 / 368.
    let attention = |backward| {
        Work::new(
            "attention",
            Phase::Forward,
            Kernel::Attention {
                backward,
                pairs: 1e9,
                heads: 32.0,
                head_dim: 128,
                mean_keys: 4096.0,
                span: 8192.0,
            },
        )
    };
    let flops = 4.0 * 128.0 * 32.0 * 1e9;
    let spread = 333.0 / 368.0;
    let (kind, s) = time(&H200, bf16, &attention(false));
    assert_eq!(kind, KernelKind::Attention);
    assert!(close(s, flops / (368e12 * spread)), "{s}");
    let (_, s) = time(&H200, bf16, &attention(true));
    assert!(close(s, 2.5 * flops / (310e12 * spread)), "{s}");
    // At f32 the CUDA-core kernels, 6.5 TFLOP/s.
    let (_, s) = time(&H200, Precision::F32, &attention(false));
    assert!(close(s, flops / 6.5e12), "{s}");
    // A stream of 1 GB, three times.
    let stream = Work::new("stream", Phase::Optimizer, Kernel::Stream { bytes: 1e9 }).times(3.0);
    assert!(close(time(&H200, bf16, &stream).1, 3e9 / 3.84e12));
    // NCCL over 3 ranks: 2·2/3 of the bytes at 370 GB/s.
    let reduce = Work::new(
        "reduce",
        Phase::AllReduce,
        Kernel::AllReduce {
            bytes: 4e9,
            ranks: 3.0,
        },
    );
    assert!(close(time(&H200, bf16, &reduce).1, 4.0 / 3.0 * 4e9 / 370e9));
}

#[test]
fn a_bucket_adds_its_phases_launches_and_model_flops() {
    let gemm = Kernel::Gemm {
        m: 4096.0,
        n: 4096.0,
        k: 4096.0,
        accumulate: false,
        f32_operands: false,
    };
    let work = [
        Work::new("forward", Phase::Forward, gemm).times(2.0),
        Work::new("backward", Phase::Backward, gemm).times(4.0),
        Work::new("adamw", Phase::Optimizer, Kernel::Stream { bytes: 3.84e9 }).launches(2.0),
        Work::new(
            "reduce",
            Phase::AllReduce,
            Kernel::AllReduce {
                bytes: 370e9 / 4.0,
                ranks: 2.0,
            },
        ),
    ];
    let bucket = bucket_time(&H200, Precision::Bf16, 2048, &work);
    let one = 2.0 * 4096f64.powi(3) / (0.75 * 989e12);
    let expected = [2.0 * one + 2e-6, 4.0 * one + 4e-6, 1e-3 + 2e-6, 0.25 + 1e-6];
    for (phase, (actual, expected)) in PHASES.iter().zip(bucket.phase_s.iter().zip(expected)) {
        assert!(
            close(*actual, expected),
            "{phase:?}: {actual} vs {expected}"
        );
    }
    assert_eq!(bucket.launches, 9.0);
    assert!(close(bucket.of_kind(KernelKind::Launch), 9e-6));
    assert!(close(bucket.of_kind(KernelKind::Gemm), 6.0 * one));
    assert!(close(bucket.model_flops, 6.0 * 2.0 * 4096f64.powi(3)));
    let step = expected.iter().sum::<f64>();
    assert!(close(bucket.step_s(), step));
    assert!(close(bucket.compute_s(), step - expected[3]));
    assert!(close(bucket.mfu, bucket.model_flops / (step * 989e12)));
    assert_eq!(bucket.largest.0, "reduce");
}

#[test]
fn the_mix_weighs_each_bucket_by_the_items_it_is_fed() {
    let gemm = |m| Kernel::Gemm {
        m,
        n: 4096.0,
        k: 4096.0,
        accumulate: false,
        f32_operands: false,
    };
    let a = bucket_time(
        &H200,
        Precision::Bf16,
        1,
        &[Work::new("a", Phase::Forward, gemm(4096.0))],
    );
    let b = bucket_time(
        &H200,
        Precision::Bf16,
        2,
        &[Work::new("b", Phase::Forward, gemm(8192.0))],
    );
    let shares = [0.75, 0.25];
    let mfu = mix_mfu(&H200, &[a.clone(), b.clone()], &shares);
    let expected = (0.75 * a.model_flops + 0.25 * b.model_flops)
        / ((0.75 * a.step_s() + 0.25 * b.step_s()) * 989e12);
    assert!(close(mfu, expected));
}

const SMALL_GPU_PLAN: &str = r#"
pipeline "small"
target t on gpu 0 {
    hidden = 64
    layers = 4
    tap_layers = [1, 2, 3]
    vocab = 512
    batch_tokens = 64
    source = synthetic(seed = 1, lengths = 8..32)
}
queue hs from t to d {
    capacity = 8
    min_ready = 1
    buckets = [16, 32]
}
drafter d on gpu 1..3 {
    model = dflash(layers = 2, heads = 4, kv_heads = 2, head_dim = 16, intermediate = 128, block = 4,
                   anchors = 8, mask_token = 511, rope_theta = 10000)
    loss = cross_entropy(chunk_tokens = 32)
    optimizer = adamw(lr = 1e-3)
    sync = allreduce
}
"#;

#[test]
fn a_gpu_plan_gets_every_phase_per_bucket_and_the_mix() {
    let plan = compile_source("small.pipe", SMALL_GPU_PLAN).expect("valid");
    let model = gpu_step_model(&plan).expect("a dflash drafter on GPUs");
    assert_eq!(model.replicas, 2);
    assert_eq!(model.buckets.len(), 2);
    // Lengths 8..32 uniform: bucket 16 takes 8..=16 (9 lengths, 4 sequences per item), 32 takes 17..=31 (15, 2).
    let rates = [9.0 / 4.0, 15.0 / 2.0];
    for (share, rate) in model.shares.iter().zip(rates) {
        assert!(close(*share, rate / 9.75), "{share}");
    }
    let gradient = 4.0 * plan.model.parameters as f64;
    for bucket in &model.buckets {
        assert!(bucket.phase_s.iter().all(|s| *s > 0.0), "{bucket:?}");
        // Two ranks: the whole buffer once at 370 GB/s, plus its launch.
        assert!(close(bucket.phase_s[3], gradient / 370e9 + 1e-6));
    }
    assert!(close(
        model.mfu,
        mix_mfu(&H200, &model.buckets, &model.shares)
    ));
    // A CPU drafter has no GPU model.
    let cpu = SMALL_GPU_PLAN.replace("drafter d on gpu 1..3", "drafter d on cpu x2");
    let plan = compile_source("small.pipe", &cpu).expect("valid");
    assert!(gpu_step_model(&plan).is_none());
}
