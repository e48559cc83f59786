//! A producer whose source fails mid-run, through the whole pipeline ([`run_with_sources`] with a source that
//! breaks after a few batches): under `keep_going` the run trains on with the other producer and reports the
//! failure; without it the run stops with the producer's error; when every producer fails, `keep_going` still
//! ends in an error, after the drafters have drained what was queued.

use std::io::sink;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

mod fault_support;

use fault_support::{FAILURE, FailAfter};

use draftpipe_compiler::compile_source;
use draftpipe_compiler::plan::Plan;
use draftpipe_runtime::pipeline::{RunError, RunOptions, RunOutcome, StopReason, run_with_sources};
use draftpipe_runtime::source::{HsSource, open_sources};

/// Far more steps than the failing producer needs to reach its failure, so the failure always comes mid-run.
const STEPS: u64 = 60;

fn plan() -> Plan {
    let text = r#"pipeline "producer-failure"

target toy on cpu x2 {
    hidden       = 32
    tap_layers   = [0, 1]
    vocab        = 256
    batch_tokens = 256
    source       = synthetic(seed = 5, lengths = 16..64)
}

queue hs from toy to draft {
    capacity  = 4
    min_ready = 1
    buckets   = [32, 64]
    pull      = fifo
}

drafter draft on cpu {
    model     = mlp(hidden = 32, blocks = 1, intermediate = 64, heads = 2)
    loss      = cross_entropy(head_decay = 0.8)
    optimizer = adamw(lr = 1e-3)
}

telemetry { every = 1s }
"#;
    compile_source("producer-failure.pipe", text).expect("the test plan compiles")
}

/// Runs the plan with the producers in `failing` breaking after 2 batches each.
fn run(keep_going: bool, failing: &[usize]) -> Result<RunOutcome, RunError> {
    let plan = plan();
    let mut options = RunOptions::for_plan(&plan);
    options.steps = Some(STEPS);
    options.keep_going = keep_going;
    let open = |plan: &Plan| {
        let sources = open_sources(plan)?;
        Ok(sources
            .into_iter()
            .enumerate()
            .map(|(worker, inner)| {
                if failing.contains(&worker) {
                    Box::new(FailAfter { inner, batches: 2 }) as Box<dyn HsSource>
                } else {
                    inner
                }
            })
            .collect())
    };
    run_with_sources(
        &plan,
        &options,
        open,
        Arc::new(AtomicBool::new(false)),
        sink(),
    )
}

#[test]
fn keep_going_trains_on_with_the_other_producer_and_reports_the_failure() {
    let outcome = run(true, &[1]).expect("one producer is left, so the run finishes");
    assert_eq!(outcome.stop, StopReason::StepLimit);
    assert_eq!(outcome.step, STEPS);
    assert_eq!(
        outcome.producer_errors.len(),
        1,
        "{:?}",
        outcome.producer_errors
    );
    let error = &outcome.producer_errors[0];
    assert!(
        error.starts_with("producer 1:") && error.contains(FAILURE),
        "{error}"
    );
}

#[test]
fn without_keep_going_a_producer_failure_stops_the_run() {
    match run(false, &[1]) {
        Err(RunError::Producer { worker, source }) => {
            assert_eq!(worker, 1);
            assert!(source.to_string().contains(FAILURE), "{source}");
        }
        other => panic!("expected producer 1's error, got {other:?}"),
    }
}

#[test]
fn keep_going_with_every_producer_failed_is_still_an_error() {
    match run(true, &[0, 1]) {
        Err(RunError::AllProducersFailed(message)) => {
            assert!(
                message.contains("producer 0:") && message.contains("producer 1:"),
                "{message}"
            );
        }
        other => panic!("expected every producer to have failed, got {other:?}"),
    }
}
