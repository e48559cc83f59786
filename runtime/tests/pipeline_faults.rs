//! Faults that used to cost a run its training or hang it, through the whole pipeline ([`run_with_sources`]):
//! a thread the OS refuses, a data error without `--keep-going` (the last good state is saved and marked), a
//! producer failure under `--keep-going` (recorded in `summary.json` and the diagnosis), and a directory another
//! run holds (refused, naming the holder's pid).

use std::io::sink;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::mpsc;
use std::time::Duration;

mod fault_support;

use fault_support::{FAILURE, FailAfter};

use draftpipe_compiler::compile_source;
use draftpipe_compiler::plan::Plan;
use draftpipe_runtime::checkpoint::load_checkpoint;
use draftpipe_runtime::lock::{DirLock, LockError, LockPlace};
use draftpipe_runtime::pipeline::{RunError, RunOptions, RunOutcome, run_with_sources};
use draftpipe_runtime::source::{HsSource, open_sources};
use draftpipe_runtime::telemetry::{Diagnosis, EndReason, load_summary};

/// Threads a run of [`plan`] starts: 2 producers, 2 drafters, the telemetry thread.
const THREADS: usize = 5;
/// A run that has not ended after this long is hung.
const HANG: Duration = Duration::from_secs(120);

fn plan() -> Plan {
    let text = r#"pipeline "faults"

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

drafter draft on cpu x2 {
    model     = mlp(hidden = 32, blocks = 1, intermediate = 64, heads = 2)
    loss      = cross_entropy(head_decay = 0.8)
    optimizer = adamw(lr = 1e-3)
}

telemetry { every = 1s }
"#;
    compile_source("faults.pipe", text).expect("the test plan compiles")
}

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("faults-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs the plan on another thread with producer 1 breaking after `fail_after` batches (never when `None`);
/// a run that does not end within [`HANG`] fails the test instead of hanging it.
fn run(options: RunOptions, fail_after: Option<usize>) -> Result<RunOutcome, RunError> {
    let (done, result) = mpsc::channel();
    std::thread::spawn(move || {
        let plan = plan();
        let open = |plan: &Plan| {
            let sources = open_sources(plan)?;
            Ok(sources
                .into_iter()
                .enumerate()
                .map(|(worker, inner)| match fail_after {
                    Some(batches) if worker == 1 => {
                        Box::new(FailAfter { inner, batches }) as Box<dyn HsSource>
                    }
                    _ => inner,
                })
                .collect())
        };
        let outcome = run_with_sources(
            &plan,
            &options,
            open,
            Arc::new(AtomicBool::new(false)),
            sink(),
        );
        let _ = done.send(outcome);
    });
    result
        .recv_timeout(HANG)
        .expect("the run hung instead of ending")
}

#[test]
fn a_thread_that_cannot_start_is_the_runs_error_and_releases_the_others() {
    // Refuse each thread in turn: the first producer, the second, each drafter, the telemetry thread; the
    // threads started before it must stop, and the run must end with the refusal as its error.
    for allowed in 0..THREADS {
        let mut options = RunOptions::for_plan(&plan());
        options.steps = Some(1000);
        options.fail_spawn_after = Some(allowed);
        match run(options, None) {
            Err(RunError::Spawn { thread, source }) => {
                assert!(
                    source
                        .to_string()
                        .contains("Resource temporarily unavailable"),
                    "{source}"
                );
                let expected = [
                    "producer-0",
                    "producer-1",
                    "drafter-0",
                    "drafter-1",
                    "telemetry",
                ];
                assert_eq!(thread, expected[allowed]);
            }
            other => panic!("spawn {allowed} refused: expected a spawn error, got {other:?}"),
        }
    }
    let mut options = RunOptions::for_plan(&plan());
    options.steps = Some(2);
    options.fail_spawn_after = Some(THREADS);
    run(options, None).expect("with every thread started, the run finishes");
}

#[test]
fn a_data_error_without_keep_going_saves_the_last_good_state_marked_as_such() {
    let dir = scratch("last-good");
    let save = dir.join("ckpt");
    let mut options = RunOptions::for_plan(&plan());
    options.steps = Some(1000);
    options.save_dir = Some(save.clone());
    options.save_every = Some(1000);
    options.run_dir = Some(dir.join("run"));
    match run(options, Some(6)) {
        Err(RunError::StoppedAfterSave { step, dir, source }) => {
            assert_eq!(dir, save);
            assert!(step > 0);
            assert!(
                matches!(*source, RunError::Producer { worker: 1, .. }),
                "{source:?}"
            );
            let checkpoint = load_checkpoint(&save, &plan().model).unwrap();
            assert_eq!(checkpoint.state.step, step);
            let stopped_by = checkpoint
                .stopped_by
                .expect("state.json marks the last good state");
            assert!(stopped_by.contains(FAILURE), "{stopped_by}");
            assert!(checkpoint.params.iter().all(|p| p.is_finite()));
        }
        other => panic!("expected the error with the saved state, got {other:?}"),
    }
    let summary = load_summary(&dir.join("run")).unwrap();
    let ending = summary
        .ending
        .as_ref()
        .expect("the summary says how the run ended");
    assert_eq!(ending.reason, EndReason::Error);
    assert!(ending.saved_after_error.is_some());
    assert!(ending.failed_producers.iter().any(|f| f.contains(FAILURE)));
}

#[test]
fn a_producer_failed_under_keep_going_is_in_the_summary_and_the_diagnosis() {
    let dir = scratch("keep-going");
    let mut options = RunOptions::for_plan(&plan());
    options.steps = Some(20);
    options.keep_going = true;
    options.run_dir = Some(dir.clone());
    let outcome = run(options, Some(2)).expect("one producer is left, so the run finishes");
    assert_eq!(outcome.producer_errors.len(), 1);
    let summary = load_summary(&dir).unwrap();
    let ending = summary.ending.as_ref().unwrap();
    assert_eq!(ending.reason, EndReason::StepLimit);
    assert_eq!(ending.failed_producers.len(), 1);
    assert!(ending.failed_producers[0].contains(FAILURE));
    let diagnosis = Diagnosis::from_summary(&summary).to_string();
    assert!(
        diagnosis.contains("failed producer: producer 1") && diagnosis.contains(FAILURE),
        "{diagnosis}"
    );
}

#[test]
fn a_directory_another_run_holds_is_refused_with_the_holders_pid() {
    let dir = scratch("locked");
    for (held, place) in [("ckpt", LockPlace::Beside), ("run", LockPlace::Inside)] {
        let _holder = DirLock::acquire(&dir.join(held), "the test's directory", place).unwrap();
        let mut options = RunOptions::for_plan(&plan());
        options.steps = Some(2);
        options.save_dir = Some(dir.join("ckpt"));
        options.run_dir = Some(dir.join("run"));
        let refused = match run(options, None) {
            Err(RunError::NotStarted(refused)) => *refused,
            other => panic!("expected {held} to be refused before the start, got {other:?}"),
        };
        match refused {
            RunError::Lock(LockError::Held {
                holder,
                dir: locked,
                ..
            }) => {
                assert_eq!(holder, Some(std::process::id()));
                assert_eq!(locked, dir.join(held));
            }
            other => panic!("expected {held} to be refused as locked, got {other:?}"),
        }
        assert!(
            !dir.join("run/summary.json").exists(),
            "the refused run must not have started"
        );
    }
}
