//! Data-parallel drafters under `sync = allreduce` take rounds of one bucket through the whole pipeline: with
//! two CPU drafters and two buckets, every stepped round's replicas have the same padded length (the drafters'
//! own check, `mixed_rounds`), the queue counts a round per step, and the two drafters' steps per bucket are
//! the same, bucket by bucket. Without rounds each drafter pops its own bucket and they differ.

use std::io::sink;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use draftpipe_compiler::compile_source;
use draftpipe_runtime::pipeline::{RunOptions, run};
use draftpipe_runtime::telemetry::{DrafterSummary, load_summary};

const STEPS: u64 = 30;

fn plan_text(sync: &str) -> String {
    format!(
        r#"pipeline "rounds"

target toy on cpu x2 {{
    hidden       = 32
    tap_layers   = [0, 1]
    vocab        = 256
    batch_tokens = 256
    source       = synthetic(seed = 11, lengths = 8..64)
}}

queue hs from toy to draft {{
    capacity  = 6
    min_ready = 2
    buckets   = [32, 64]
    pull      = random_in_bucket
}}

drafter draft on cpu x2 {{
    model     = mlp(hidden = 32, blocks = 1, intermediate = 64, heads = 2)
    loss      = cross_entropy(head_decay = 0.8)
    optimizer = adamw(lr = 1e-3)
    sync      = {sync}
}}

telemetry {{ every = 1s }}
"#
    )
}

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("rounds-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Steps per padded length of one drafter: its warm-up step of each bucket plus the steady ones.
fn steps_per_bucket(drafter: &DrafterSummary, warmup_lengths: &[usize]) -> Vec<(usize, u64)> {
    let mut steps: Vec<(usize, u64)> = drafter
        .buckets
        .iter()
        .map(|bucket| (bucket.padded_len, bucket.steps))
        .collect();
    for &len in warmup_lengths {
        match steps.iter_mut().find(|(padded, _)| *padded == len) {
            Some(entry) => entry.1 += 1,
            None => steps.push((len, 1)),
        }
    }
    steps.sort_unstable();
    steps
}

#[test]
fn allreduce_drafters_step_every_round_on_one_bucket() {
    let plan = compile_source("rounds.pipe", &plan_text("allreduce")).unwrap();
    let dir = scratch("allreduce");
    let mut options = RunOptions::for_plan(&plan);
    options.steps = Some(STEPS);
    options.run_dir = Some(dir.clone());
    run(&plan, &options, Arc::new(AtomicBool::new(false)), sink()).unwrap();
    let summary = load_summary(&dir).unwrap();
    assert_eq!(
        summary.queue.mixed_rounds, 0,
        "a stepped round mixed buckets"
    );
    // One round per step; a member may have taken its batch of one more round before the stop reached it.
    assert!(
        (STEPS..=STEPS + 1).contains(&summary.queue.rounds),
        "{} rounds for {STEPS} steps",
        summary.queue.rounds
    );
    assert_eq!(summary.drafters.len(), 2);
    for drafter in &summary.drafters {
        assert_eq!(drafter.steps, STEPS);
    }
    // The same rounds reach both drafters, so their steps per bucket agree bucket by bucket, and both buckets
    // were trained (lengths 8..64 over buckets of 32 and 64). Each bucket's first step is its warm-up.
    let both_buckets = [32, 64];
    let first = steps_per_bucket(&summary.drafters[0], &both_buckets);
    let second = steps_per_bucket(&summary.drafters[1], &both_buckets);
    assert_eq!(first, second);
    assert_eq!(first.len(), 2, "{first:?}");
    assert_eq!(first.iter().map(|(_, n)| n).sum::<u64>(), STEPS);
}

#[test]
fn without_allreduce_each_drafter_pulls_its_own_batches() {
    let plan = compile_source("rounds.pipe", &plan_text("none")).unwrap();
    let dir = scratch("none");
    let mut options = RunOptions::for_plan(&plan);
    options.steps = Some(STEPS);
    options.run_dir = Some(dir.clone());
    run(&plan, &options, Arc::new(AtomicBool::new(false)), sink()).unwrap();
    let summary = load_summary(&dir).unwrap();
    assert_eq!(summary.queue.rounds, 0);
    assert_eq!(summary.queue.mixed_rounds, 0);
}
