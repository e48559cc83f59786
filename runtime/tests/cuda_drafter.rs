//! The CUDA drafter against the CPU drafter: the same initial weights and batches for 20 steps give the same
//! loss curve (each step within 2e-3 relative: fp32 GEMMs in another order and the device's approximate `exp`
//! compound through AdamW), and the graph and eager launch modes give the same losses (within 1e-6 relative).
//! Skips with one line without a GPU.

mod common;

use common::{gpu_or_skip, rng};
use draftpipe_compiler::plan::{AdamWSpec, BucketPlan, LaunchMode, LossSpec, MlpSpec, ModelPlan};
use draftpipe_runtime::batch::HsBatch;
use draftpipe_runtime::cpu::CpuDrafter;
use draftpipe_runtime::cuda::{CudaDrafter, GradientAllReduce};
use draftpipe_runtime::params::FlatState;
use rand::RngExt;
use rand::rngs::Xoshiro256PlusPlus;

const STEPS: usize = 20;

fn setup() -> (ModelPlan, LossSpec, AdamWSpec, Vec<BucketPlan>) {
    let spec = MlpSpec {
        din: 64,
        hidden: 48,
        blocks: 2,
        intermediate: 96,
        heads: 3,
        vocab: 257,
    };
    let model = ModelPlan::new(spec);
    // 48-token chunks over 128 tokens: the last chunk is partial.
    let loss = LossSpec {
        head_decay: 0.8,
        chunk_tokens: 48,
    };
    let adamw = AdamWSpec {
        lr: 3e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.01,
        clip_grad_norm: Some(1.0),
    };
    let bucket = BucketPlan {
        padded_len: 32,
        sequences: 4,
        tokens: 128,
        step_flops: 0,
        step_bytes: 0,
    };
    (model, loss, adamw, vec![bucket])
}

/// A learnable batch: the id at position p + 1 is a fixed function of the hidden state at p (its first four
/// signs), so head 0 can learn it and the loss falls.
fn batch(rng: &mut Xoshiro256PlusPlus, spec: &MlpSpec) -> HsBatch {
    let mut b = HsBatch::zeroed(32, 4, spec.din);
    for s in 0..b.sequences {
        let len = rng.random_range(8..=32u32);
        b.seq_lens[s] = len;
        for p in 0..len as usize {
            let t = s * 32 + p;
            for v in &mut b.hs[t * spec.din..(t + 1) * spec.din] {
                *v = rng.random_range(-1.0..1.0);
            }
            b.input_ids[t] = if p == 0 {
                rng.random_range(0..spec.vocab as u32)
            } else {
                let prev = &b.hs[(t - 1) * spec.din..][..4];
                prev.iter()
                    .fold(0u32, |acc, &v| acc * 2 + u32::from(v > 0.0))
            };
            b.loss_mask[t] = 1;
        }
    }
    b
}

fn cuda_losses(launch: LaunchMode, init: &FlatState, batches: &[HsBatch]) -> (Vec<f32>, FlatState) {
    let (model, loss, adamw, buckets) = setup();
    let mut drafter =
        CudaDrafter::new(0, &model, loss, adamw, &buckets, launch).expect("CUDA drafter");
    drafter.upload_state(init).expect("upload");
    let mut losses = Vec::new();
    for b in batches {
        drafter.stage(b).expect("stage");
        losses.extend(drafter.step().expect("step").map(|o| o.loss));
    }
    losses.extend(drafter.finish().expect("finish").map(|o| o.loss));
    let mut state = init.clone();
    drafter.download_state(&mut state).expect("download");
    (losses, state)
}

#[test]
fn twenty_steps_follow_the_cpu_loss_curve_and_graph_equals_eager() {
    if gpu_or_skip("twenty_steps_follow_the_cpu_loss_curve_and_graph_equals_eager").is_none() {
        return;
    }
    let (model, loss, adamw, buckets) = setup();
    let (mut r, seed) = rng();
    let batches: Vec<HsBatch> = (0..STEPS).map(|_| batch(&mut r, &model.spec)).collect();
    let init = FlatState::init(&model, seed);

    let mut cpu = CpuDrafter::new(&model, loss, adamw, &buckets);
    let mut state = init.clone();
    let cpu_losses: Vec<f32> = batches
        .iter()
        .map(|b| {
            let out = cpu.forward_backward(&mut state, b).expect("cpu step");
            cpu.optimizer_step(&mut state);
            out.loss
        })
        .collect();

    let (graph, graph_state) = cuda_losses(LaunchMode::Graph, &init, &batches);
    let (eager, _) = cuda_losses(LaunchMode::Eager, &init, &batches);
    assert_eq!(graph.len(), STEPS, "one outcome per step");
    for (i, ((&g, &e), &c)) in graph.iter().zip(&eager).zip(&cpu_losses).enumerate() {
        assert!(
            (g - c).abs() <= 2e-3 * c.abs(),
            "step {i}: cuda {g} vs cpu {c} (seed {seed})"
        );
        assert!(
            (g - e).abs() <= 1e-6 * e.abs(),
            "step {i}: graph {g} vs eager {e} (seed {seed})"
        );
    }
    assert!(
        cpu_losses[STEPS - 1] < 0.7 * cpu_losses[0],
        "the task is learnable (measured on the CPU: 5.7 → 3.1): {cpu_losses:?} (seed {seed})"
    );
    assert_eq!(graph_state.step, state.step, "applied AdamW steps");
}

/// Replicas on every device, fed the same batches, average identical gradients: each must follow the single
/// drafter's losses (with one device this checks that the NCCL call is captured and is the identity).
#[test]
fn all_reduced_replicas_follow_the_single_drafter() {
    let test = "all_reduced_replicas_follow_the_single_drafter";
    if gpu_or_skip(test).is_none() {
        return;
    }
    let devices = draftpipe_runtime::cuda::discover_devices().expect("devices");
    let ordinals: Vec<usize> = devices.iter().map(|d| d.ordinal).collect();
    let comms = match GradientAllReduce::for_devices(&ordinals) {
        Ok(comms) => comms,
        Err(e) => return eprintln!("{test} skipped: {e}"),
    };
    let (model, loss, adamw, buckets) = setup();
    let (mut r, seed) = rng();
    let batches: Vec<HsBatch> = (0..5).map(|_| batch(&mut r, &model.spec)).collect();
    let init = FlatState::init(&model, seed);
    let (single, _) = cuda_losses(LaunchMode::Graph, &init, &batches);
    let replicas: Vec<Vec<f32>> = std::thread::scope(|scope| {
        let handles: Vec<_> = ordinals
            .iter()
            .zip(comms)
            .map(|(&ordinal, comm)| {
                let (model, batches, init, buckets) = (&model, &batches, &init, &buckets);
                scope.spawn(move || {
                    let mut d =
                        CudaDrafter::new(ordinal, model, loss, adamw, buckets, LaunchMode::Graph)
                            .expect("drafter");
                    d.attach_all_reduce(comm).expect("attach");
                    d.upload_state(init).expect("upload");
                    let mut losses = Vec::new();
                    for b in batches {
                        d.stage(b).expect("stage");
                        losses.extend(d.step().expect("step").map(|o| o.loss));
                    }
                    losses.extend(d.finish().expect("finish").map(|o| o.loss));
                    losses
                })
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
