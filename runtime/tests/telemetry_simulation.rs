//! The diagnosis on measured timings: producer and drafter threads with sleeps, joined by a small bounded
//! channel with a watermark (a `Mutex<VecDeque>` + `Condvar`, standing in for the real queue), recorded by the
//! real recorders and sampled by the real reporter loop. Speed ratios are 6×, so the verdicts hold on a
//! loaded machine.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use draftpipe_runtime::telemetry::{
    Bottleneck, Diagnosis, DrafterPhase, ProducerPhase, QueueSnapshot, Reporter, ReporterConfig,
    RunSummary, StepTokens, Telemetry, load_summary,
};

const CAPACITY: usize = 8;
const MIN_READY: usize = 2;

struct Channel {
    items: Mutex<(VecDeque<u64>, bool)>,
    changed: Condvar,
}

impl Channel {
    /// Blocks while full; `false` once closed.
    fn push(&self, item: u64) -> bool {
        let mut state = self.items.lock().unwrap();
        while state.0.len() == CAPACITY && !state.1 {
            state = self.changed.wait(state).unwrap();
        }
        if state.1 {
            return false;
        }
        state.0.push_back(item);
        self.changed.notify_all();
        true
    }

    /// Blocks until `MIN_READY` items are queued.
    fn pop(&self) -> u64 {
        let mut state = self.items.lock().unwrap();
        while state.0.len() < MIN_READY {
            state = self.changed.wait(state).unwrap();
        }
        let item = state.0.pop_front().unwrap();
        self.changed.notify_all();
        item
    }

    fn close(&self) {
        self.items.lock().unwrap().1 = true;
        self.changed.notify_all();
    }

    fn snapshot(&self) -> QueueSnapshot {
        let depth = self.items.lock().unwrap().0.len();
        QueueSnapshot {
            depth,
            capacity: CAPACITY,
            min_ready: MIN_READY,
            per_bucket: vec![depth],
            ..Default::default()
        }
    }
}

/// Per step: `compute` split over forward, loss, backward and optimizer, then `unrecorded` of work that no
/// phase covers (a host-side gap).
struct Shape {
    produce: Duration,
    compute: Duration,
    unrecorded: Duration,
    steps: u64,
}

fn simulate(name: &str, shape: Shape) -> RunSummary {
    let steps = shape.steps;
    let telemetry = Arc::new(Telemetry::new(1, 1, false));
    let channel = Arc::new(Channel {
        items: Mutex::new((VecDeque::new(), false)),
        changed: Condvar::new(),
    });
    let producer = {
        let (recorder, channel) = (telemetry.producer(0).unwrap(), Arc::clone(&channel));
        thread::spawn(move || {
            let mut mark = Instant::now();
            for item in 0.. {
                thread::sleep(shape.produce);
                recorder.lap(ProducerPhase::Produce, &mut mark);
                let pushed = channel.push(item);
                recorder.lap(ProducerPhase::BlockedFull, &mut mark);
                if !pushed {
                    break;
                }
                recorder.item_done(100);
            }
        })
    };
    let drafter = {
        let (recorder, channel) = (telemetry.drafter(0).unwrap(), Arc::clone(&channel));
        thread::spawn(move || {
            for step in 0..shape.steps {
                let mut mark = Instant::now();
                channel.pop();
                recorder.lap(DrafterPhase::DataWait, &mut mark);
                for (phase, share) in [
                    (DrafterPhase::Forward, 5),
                    (DrafterPhase::Loss, 1),
                    (DrafterPhase::Backward, 3),
                ]
                .into_iter()
                .chain([(DrafterPhase::Optimizer, 1)])
                {
                    thread::sleep(shape.compute * share / 10);
                    recorder.lap(phase, &mut mark);
                }
                recorder.step_done(StepTokens::unpadded(100), 1.0 / (step + 1) as f64);
                thread::sleep(shape.unrecorded);
            }
            channel.close();
        })
    };
    let dir = std::env::temp_dir().join(format!("draftpipe-sim-{name}-{}", std::process::id()));
    let mut config = ReporterConfig::new(name, Duration::from_millis(50), CAPACITY, MIN_READY);
    config.run_dir = Some(dir.clone());
    let mut reporter = Reporter::new(config, Arc::clone(&telemetry), std::io::sink()).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let stopper = {
        let stop = Arc::clone(&stop);
        thread::spawn(move || {
            drafter.join().unwrap();
            producer.join().unwrap();
            stop.store(true, Ordering::Release);
        })
    };
    reporter.run(&stop, || channel.snapshot()).unwrap();
    stopper.join().unwrap();
    let summary = reporter.finish(&channel.snapshot()).unwrap();
    let loaded = load_summary(&dir).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(loaded, summary);
    assert_eq!((summary.steps, summary.drafters[0].steps), (steps, steps));
    assert_eq!(summary.token_slots, 100 * steps);
    loaded
}

#[test]
fn measured_slow_drafters_are_the_bottleneck() {
    let summary = simulate(
        "slow-drafter",
        Shape {
            produce: Duration::from_millis(1),
            compute: Duration::from_millis(6),
            unrecorded: Duration::ZERO,
            steps: 60,
        },
    );
    let diagnosis = Diagnosis::from_summary(&summary);
    assert_eq!(diagnosis.bottleneck, Bottleneck::Consumers, "{diagnosis}");
    assert!(diagnosis.queue.samples >= 20, "{diagnosis}");
    assert!(diagnosis.queue.producer_blocked_pct > 50.0, "{diagnosis}");
    assert!(diagnosis.drafters.busy_pct > 90.0, "{diagnosis}");
    assert!(!diagnosis.host_side_gaps, "{diagnosis}");
    println!("{diagnosis}");
}

#[test]
fn measured_slow_producers_are_the_bottleneck() {
    let summary = simulate(
        "slow-producer",
        Shape {
            produce: Duration::from_millis(6),
            compute: Duration::from_millis(1),
            unrecorded: Duration::ZERO,
            steps: 50,
        },
    );
    let diagnosis = Diagnosis::from_summary(&summary);
    assert_eq!(diagnosis.bottleneck, Bottleneck::Producers, "{diagnosis}");
    assert!(diagnosis.queue.below_watermark_pct > 70.0, "{diagnosis}");
    assert!(diagnosis.queue.drafter_wait_pct > 50.0, "{diagnosis}");
}

#[test]
fn measured_gaps_between_steps_are_flagged_as_host_side() {
    let summary = simulate(
        "host-gaps",
        Shape {
            produce: Duration::from_millis(1),
            compute: Duration::from_millis(4),
            unrecorded: Duration::from_millis(3),
            steps: 50,
        },
    );
    let diagnosis = Diagnosis::from_summary(&summary);
    assert_eq!(diagnosis.bottleneck, Bottleneck::Consumers, "{diagnosis}");
    assert!(diagnosis.host_side_gaps, "{diagnosis}");
    assert!(diagnosis.drafters.untracked_pct > 25.0, "{diagnosis}");
}
