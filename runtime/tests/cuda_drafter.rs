//! What only CUDA has: the graph and eager launch modes give the same steps (losses within 1e-6 relative,
//! parameters within 1e-6 relative L2 after 5 steps), and replicas on every device that average identical
//! gradients with NCCL (eagerly, between the captured parts) follow the single drafter. The comparisons with
//! the CPU are in `backend_step.rs`, for every backend. Skips only without a driver (and the NCCL test without
//! NCCL), saying so; `DRAFTPIPE_REQUIRE_GPU=1` makes both skips failures.

mod backends;
mod cpu_step_support;

use cpu_step_support::{adamw, bucket, loss, model, random_batch};
use draftpipe_compiler::plan::{LaunchMode, MlpSpec, Precision};
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
