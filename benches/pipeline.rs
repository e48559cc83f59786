//! The pipeline's own cost: drafter duty cycle with a source faster than the drafter, and the step time inside
//! `draftpipe run` against the bare step on the same batches, measured side by side in one run.
//!
//! `cargo bench --bench pipeline` (options: `--steps N` per measurement, `--rounds R`). Each round measures the
//! bare step loop, then the pipeline (one producer, one drafter: the quickstart's dimensions), so machine noise
//! hits both alike; the report gives medians over rounds and the ratio of the medians.

use std::io::sink;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use draftpipe_compiler::compile_source;
use draftpipe_compiler::plan::Plan;
use draftpipe_runtime::backend::cpu::HostThreads;
use draftpipe_runtime::batch::HsBatch;
use draftpipe_runtime::drafter::cpu::CpuDrafter;
use draftpipe_runtime::params::FlatState;
use draftpipe_runtime::pipeline::{RunOptions, run};
use draftpipe_runtime::source::{BatchPool, Producer, open_sources};
use draftpipe_runtime::telemetry::DrafterPhase;

/// The quickstart pipeline with one drafter worker, so the pipeline step and the bare step do the same work.
fn plan() -> Plan {
    let text = include_str!("../pipelines/quickstart.pipe").replace("on cpu x2 {", "on cpu {");
    compile_source("quickstart-1-drafter.pipe", &text).expect("the quickstart compiles")
}

/// A few real batches from the plan's source, to cycle through in the bare loop.
fn batches(plan: &Plan, count: usize) -> Vec<HsBatch> {
    let pool = BatchPool::for_plan(plan).expect("pool");
    let mut producer = Producer::new(open_sources(plan).expect("sources").remove(0));
    let stop = AtomicBool::new(false);
    (0..count)
        .map(|_| {
            *producer
                .next_batch(&pool, &stop)
                .expect("source")
                .expect("a batch")
        })
        .collect()
}

/// Mean wall time of one bare step (forward, loss, backward, AdamW), after one warm-up step per bucket, on a
/// drafter's threads as the pipeline runs it.
fn bare_step(plan: &Plan, batches: &[HsBatch], steps: usize) -> Duration {
    let threads = HostThreads::new("bare", HostThreads::drafter_threads()).expect("threads");
    threads.run(|| bare_steps(plan, batches, steps))
}

fn bare_steps(plan: &Plan, batches: &[HsBatch], steps: usize) -> Duration {
    let mut state = FlatState::init(&plan.model, 0);
    let mut drafter = CpuDrafter::new(
        &plan.model,
        plan.drafter.loss,
        plan.drafter.optimizer,
        &plan.buckets,
    );
    for batch in batches {
        drafter.forward_backward(&mut state, batch).expect("step");
    }
    let started = Instant::now();
    for batch in batches.iter().cycle().take(steps) {
        drafter.forward_backward(&mut state, batch).expect("step");
        drafter.optimizer_step(&mut state);
    }
    started.elapsed() / steps as u32
}

/// Runs the pipeline for `steps` steps; returns (drafter busy fraction, mean step time excluding data wait).
fn pipeline_step(plan: &Plan, steps: u64) -> (f64, Duration) {
    let mut options = RunOptions::for_plan(plan);
    options.steps = Some(steps);
    options.trace = None;
    let outcome =
        run(plan, &options, Arc::new(AtomicBool::new(false)), sink()).expect("the pipeline runs");
    let drafter = &outcome.summary.drafters[0];
    let busy: f64 = DrafterPhase::ALL
        .iter()
        .filter(|phase| **phase != DrafterPhase::DataWait)
        .map(|phase| drafter.seconds(*phase))
        .sum();
    let wall = busy + drafter.seconds(DrafterPhase::DataWait);
    (
        busy / wall,
        Duration::from_secs_f64(busy / outcome.summary.steps as f64),
    )
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn argument(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let steps = argument("--steps", 16);
    let rounds = argument("--rounds", 3);
    let plan = plan();
    let batches = batches(&plan, 6);
    let (mut bare, mut inside, mut busy) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..rounds {
        let bare_ms = bare_step(&plan, &batches, steps).as_secs_f64() * 1e3;
        let (duty, step) = pipeline_step(&plan, steps as u64);
        let step_ms = step.as_secs_f64() * 1e3;
        println!(
            "round {round}: bare step {bare_ms:.1} ms, pipeline step {step_ms:.1} ms ({:+.2}%), drafter busy {:.2}%",
            100.0 * (step_ms / bare_ms - 1.0),
            100.0 * duty
        );
        bare.push(bare_ms);
        inside.push(step_ms);
        busy.push(100.0 * duty);
    }
    let (bare, inside, busy) = (median(&mut bare), median(&mut inside), median(&mut busy));
    println!();
    println!("| measure (median of {rounds} rounds, {steps} steps each) | value | target |");
    println!("| --- | --- | --- |");
    println!("| drafter busy (duty cycle), source faster than drafter | {busy:.2}% | ≥ 99% |");
    println!(
        "| step inside the pipeline / bare step | {:.4} ({:+.2}%) | overhead ≤ 2% |",
        inside / bare,
        100.0 * (inside / bare - 1.0)
    );
    println!("| bare step | {bare:.1} ms | |");
    println!("| step inside the pipeline | {inside:.1} ms | |");
}
