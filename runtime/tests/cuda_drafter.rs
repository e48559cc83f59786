//! What only CUDA has: the graph and eager launch modes give the same steps (losses within 1e-6 relative,
//! parameters within 1e-6 relative L2 after 5 steps), replicas on every device that average identical
//! gradients with NCCL (eagerly, between the captured parts) follow the single drafter, and a DFlash bucket's
//! steps after its first neither synchronise nor allocate (the backend's step-path counter reads 0). The comparisons with
//! the CPU are in `backend_step.rs`, for every backend. Skips only without a driver (and the NCCL test without
//! NCCL), saying so; `DRAFTPIPE_REQUIRE_GPU=1` makes both skips failures.

mod backends;
mod cpu_step_support;
mod dflash_support;

use cpu_step_support::{adamw, bucket, loss, model, random_batch};
use draftpipe_compiler::plan::{
    DFLASH_RMS_NORM_EPS, DflashSpec, LaunchMode, MlpSpec, ModelPlan, Precision,
};
use draftpipe_runtime::backend::cuda::{GradientAllReduce, discover_devices};
use draftpipe_runtime::batch::{HsBatch, HsDtype};
use draftpipe_runtime::drafter::cuda::CudaDrafter;
use draftpipe_runtime::params::FlatState;
use rand::SeedableRng;
use rand::rngs::Xoshiro256PlusPlus;

const SPEC: MlpSpec = MlpSpec {
    din: 64,
    hidden: 48,
    blocks: 2,
    intermediate: 96,
    heads: 3,
    vocab: 257,
};

fn run(
    ordinal: usize,
    launch: LaunchMode,
    all_reduce: Option<GradientAllReduce>,
    init: &FlatState,
    batches: &[HsBatch],
) -> (Vec<f32>, FlatState) {
    let model = model(SPEC);
    let mut drafter = CudaDrafter::on_device(
        ordinal,
        &model,
        (loss(0.8, 48), adamw(3e-3), Precision::Bf16),
        (&[bucket(32, 4)], HsDtype::F32),
        launch,
        all_reduce,
    )
    .expect("CUDA drafter");
    drafter.upload_state(init).expect("upload");
    let mut losses = Vec::new();
    for batch in batches {
        drafter.stage(batch).expect("stage");
        losses.extend(drafter.step().expect("step").map(|o| o.loss));
    }
    losses.extend(drafter.finish().expect("finish").map(|o| o.loss));
    assert_eq!(losses.len(), batches.len(), "one outcome per step");
    let mut state = init.clone();
    drafter.download_state(&mut state).expect("download");
    (losses, state)
}

fn batches(seed: u64, count: usize) -> Vec<HsBatch> {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    (0..count)
        .map(|_| random_batch(&mut rng, 32, 4, SPEC.din, SPEC.vocab))
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-check.sh runs it with --include-ignored"]
fn graph_launches_equal_eager_launches() {
    if backends::cuda_or_skip("graph_launches_equal_eager_launches").is_none() {
        return;
    }
    let seed = rand::random();
    let batches = batches(seed, 5);
    let init = FlatState::init(&model(SPEC), seed);
    let (graph, graph_state) = run(0, LaunchMode::Graph, None, &init, &batches);
    let (eager, eager_state) = run(0, LaunchMode::Eager, None, &init, &batches);
    for (i, (&g, &e)) in graph.iter().zip(&eager).enumerate() {
        assert!(
            (g - e).abs() <= 1e-6 * e.abs(),
            "step {i}: graph {g} vs eager {e} (seed {seed})"
        );
    }
    let diff: f64 = graph_state
        .params
        .iter()
        .zip(&eager_state.params)
        .map(|(a, b)| f64::from(a - b).powi(2))
        .sum();
    let norm: f64 = eager_state
        .params
        .iter()
        .map(|b| f64::from(*b).powi(2))
        .sum();
    assert!(
        (diff / norm).sqrt() <= 1e-6,
        "parameters differ (seed {seed})"
    );
    assert_eq!(graph_state.step, eager_state.step);
}

/// Replicas on every device, fed the same batches, average identical gradients: each must follow the single
/// drafter's losses (with one device this checks that the eager NCCL call between the graphs is the identity).
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-check.sh runs it with --include-ignored"]
fn all_reduced_replicas_follow_the_single_drafter() {
    let test = "all_reduced_replicas_follow_the_single_drafter";
    if backends::cuda_or_skip(test).is_none() {
        return;
    }
    let ordinals: Vec<usize> = discover_devices()
        .expect("devices")
        .iter()
        .map(|d| d.ordinal)
        .collect();
    let comms = match GradientAllReduce::for_devices(&ordinals) {
        Ok(comms) => comms,
        Err(e) => {
            assert!(
                !backends::gpu_required(),
                "{test}: DRAFTPIPE_REQUIRE_GPU=1 but {e}"
            );
            return eprintln!("{test}: skipped (no NCCL: {e})");
        }
    };
    let seed = rand::random();
    let batches = batches(seed, 5);
    let init = FlatState::init(&model(SPEC), seed);
    let (single, _) = run(0, LaunchMode::Graph, None, &init, &batches);
    let replicas: Vec<Vec<f32>> = std::thread::scope(|scope| {
        let handles: Vec<_> = ordinals
            .iter()
            .zip(comms)
            .map(|(&ordinal, comm)| {
                let (init, batches) = (&init, &batches);
                scope.spawn(move || run(ordinal, LaunchMode::Graph, Some(comm), init, batches).0)
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("replica thread"))
            .collect()
    });
    for (rank, losses) in replicas.iter().enumerate() {
        for (i, (&got, &want)) in losses.iter().zip(&single).enumerate() {
            assert!(
                (got - want).abs() <= 1e-6 * want.abs(),
                "rank {rank} step {i}: {got} vs {want} (seed {seed})"
            );
        }
    }
}

/// Three steps of one DFlash bucket (graphs on: eager first run, capture, replay), each batch staged while the
/// step before runs: after the bucket's first step, no stream synchronisation, device allocation or pinned
/// allocation happened on the step path (before the plan went through the slot's pinned arena, every staged
/// batch made nine of each).
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-check.sh runs it with --include-ignored"]
fn a_dflash_bucket_stages_and_steps_without_syncs_or_allocations_after_its_first_step() {
    if backends::cuda_or_skip("a_dflash_bucket_stages_and_steps_without_syncs").is_none() {
        return;
    }
    let spec = DflashSpec {
        hidden: 32,
        taps: 2,
        tap_layers: vec![1, 2],
        vocab: 64,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 8,
        intermediate: 48,
        block: 4,
        anchors: 4,
        mask_token: 63,
        rope_theta: 10000.0,
        rms_norm_eps: DFLASH_RMS_NORM_EPS,
    };
    let model = ModelPlan::new(spec.clone());
    let (padded_len, sequences) = (32, 2);
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(5);
    let mut drafter = CudaDrafter::on_device(
        0,
        &model,
        (loss(1.0, 32), adamw(3e-3), Precision::Bf16),
        (&[bucket(padded_len, sequences)], HsDtype::F32),
        LaunchMode::Graph,
        None,
    )
    .expect("CUDA drafter");
    let frozen: Vec<f32> = dflash_support::uniform(&mut rng, spec.vocab * spec.hidden, 1.0)
        .iter()
        .map(|&x| x as f32)
        .collect();
    drafter.upload_frozen(&frozen, &frozen).expect("frozen");
    drafter
        .upload_state(&FlatState::init(&model, 1))
        .expect("upload");
    let din = spec.taps * spec.hidden;
    let mut outcomes = Vec::new();
    for _ in 0..3 {
        let batch = dflash_support::random_batch(&mut rng, padded_len, sequences, din, spec.vocab);
        drafter.stage(&batch).expect("stage");
        outcomes.extend(drafter.step().expect("step"));
    }
    outcomes.extend(drafter.finish().expect("finish"));
    assert_eq!(outcomes.len(), 3);
    assert!(outcomes.iter().all(|o| o.loss.is_finite()), "{outcomes:?}");
    let counts = drafter.backend().step_path_counts();
    println!("step path: {counts:?}");
    assert_eq!(counts.steady.total(), 0, "{counts:?}");
}
