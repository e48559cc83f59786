//! The recorders: exact totals and counts, single-writer claims, loss bookkeeping, and totals under
//! concurrent recording.

use std::sync::Arc;
use std::time::{Duration, Instant};

use draftpipe_runtime::telemetry::{
    DrafterPhase, ProducerPhase, StepTokens, Telemetry, TelemetryError,
};
use rand::{RngExt, SeedableRng, rngs::StdRng};

#[test]
fn recorded_spans_sum_exactly_per_phase() {
    let telemetry = Arc::new(Telemetry::new(1, 1, false));
    let drafter = telemetry.drafter(0).unwrap();
    let producer = telemetry.producer(0).unwrap();
    let mut rng = StdRng::seed_from_u64(7);
    let base = Instant::now();
    let mut expected = [Duration::ZERO; DrafterPhase::COUNT];
    let mut counts = [0u64; DrafterPhase::COUNT];
    for _ in 0..1000 {
        let phase = DrafterPhase::ALL[rng.random_range(0..DrafterPhase::COUNT)];
        let offset = Duration::from_nanos(rng.random_range(0..1_000_000));
        let length = Duration::from_nanos(rng.random_range(0..5_000_000));
        drafter.record(phase, base + offset, base + offset + length);
        expected[phase.index()] += length;
        counts[phase.index()] += 1;
    }
    drafter.record_duration(DrafterPhase::AllReduce, base, Duration::from_micros(1500));
    expected[DrafterPhase::AllReduce.index()] += Duration::from_micros(1500);
    counts[DrafterPhase::AllReduce.index()] += 1;
    producer.record(
        ProducerPhase::BlockedFull,
        base,
        base + Duration::from_micros(250),
    );
    // An end before the start counts as zero, not as a wrapped huge number.
    producer.record(
        ProducerPhase::Produce,
        base + Duration::from_millis(1),
        base,
    );

    let snapshot = telemetry.snapshot();
    for phase in DrafterPhase::ALL {
        assert_eq!(
            snapshot.drafters[0].phase(phase).total,
            expected[phase.index()],
            "{phase:?}"
        );
        assert_eq!(
            snapshot.drafters[0].phase(phase).count,
            counts[phase.index()],
            "{phase:?}"
        );
    }
    let busy: Duration = DrafterPhase::ALL[1..]
        .iter()
        .map(|p| expected[p.index()])
        .sum();
    assert_eq!(snapshot.drafters[0].busy(), busy);
    let blocked = snapshot.producers[0].phase(ProducerPhase::BlockedFull);
    assert_eq!(
        (blocked.total, blocked.count),
        (Duration::from_micros(250), 1)
    );
    let produce = snapshot.producers[0].phase(ProducerPhase::Produce);
    assert_eq!((produce.total, produce.count), (Duration::ZERO, 1));
}

#[test]
fn lap_records_consecutive_phases_without_gaps() {
    let telemetry = Arc::new(Telemetry::new(0, 1, false));
    let drafter = telemetry.drafter(0).unwrap();
    let start = Instant::now();
    let mut mark = start;
    for phase in [
        DrafterPhase::Forward,
        DrafterPhase::Loss,
        DrafterPhase::Backward,
    ] {
        std::thread::sleep(Duration::from_millis(2));
        drafter.lap(phase, &mut mark);
    }
    let snapshot = telemetry.snapshot();
    let recorded: Duration = snapshot.drafters[0].phases.iter().map(|p| p.total).sum();
    assert_eq!(recorded, mark - start, "laps tile the interval exactly");
    assert!(snapshot.drafters[0].phase(DrafterPhase::Loss).total >= Duration::from_millis(2));
}

#[test]
fn each_worker_has_one_recorder_at_a_time() {
    let telemetry = Arc::new(Telemetry::new(2, 3, false));
    assert!(matches!(
        telemetry.drafter(3),
        Err(TelemetryError::NoSuchWorker {
            role: "drafter",
            index: 3,
            count: 3
        })
    ));
    assert!(matches!(
        telemetry.producer(2),
        Err(TelemetryError::NoSuchWorker {
            role: "producer",
            index: 2,
            count: 2
        })
    ));
    let first = telemetry.drafter(1).unwrap();
    let error = telemetry
        .drafter(1)
        .err()
        .expect("second recorder for the same drafter");
    assert!(matches!(
        error,
        TelemetryError::AlreadyClaimed {
            role: "drafter",
            index: 1
        }
    ));
    assert!(
        error
            .to_string()
            .contains("drafter 1 already has a recorder"),
        "{error}"
    );
    drop(first);
    assert!(
        telemetry.drafter(1).is_ok(),
        "dropping the recorder frees the slot"
    );
}

#[test]
fn steps_tokens_and_loss_mean_skip_non_finite_values() {
    let telemetry = Arc::new(Telemetry::new(0, 2, false));
    let a = telemetry.drafter(0).unwrap();
    let b = telemetry.drafter(1).unwrap();
    a.step_done(StepTokens::unpadded(100), 2.0);
    a.step_done(StepTokens::unpadded(100), 4.0);
    a.step_done(StepTokens::unpadded(100), f64::NAN);
    a.step_skipped();
    b.step_done(StepTokens::unpadded(50), 1.5);
    let snapshot = telemetry.snapshot();
    let d0 = &snapshot.drafters[0];
    assert_eq!((d0.steps, d0.token_slots, d0.skipped), (3, 300, 1));
    assert_eq!(
        (d0.loss_sum, d0.loss_count, d0.last_loss),
        (6.0, 2, Some(4.0))
    );
    assert_eq!(
        snapshot.step(),
        1,
        "the global step is the slowest drafter's"
    );
    assert_eq!(snapshot.token_slots(), 350);
    assert_eq!(snapshot.skipped(), 1);
    assert_eq!(snapshot.drafters[1].last_loss, Some(1.5));
}

#[test]
fn concurrent_recording_loses_nothing() {
    const DRAFTERS: usize = 4;
    const SPANS: u64 = 20_000;
    let telemetry = Arc::new(Telemetry::new(1, DRAFTERS, true));
    let base = Instant::now();
    let threads: Vec<_> = (0..DRAFTERS)
        .map(|i| {
            let recorder = telemetry.drafter(i).unwrap();
            std::thread::spawn(move || {
                for n in 0..SPANS {
                    let phase = DrafterPhase::ALL[(n as usize + i) % DrafterPhase::COUNT];
                    recorder.record(phase, base, base + Duration::from_nanos(n + 1));
                    recorder.step_done(StepTokens::unpadded(1), 0.5);
                }
            })
        })
        .collect();
    // Read concurrently: snapshots must never run ahead of what is recorded.
    for _ in 0..50 {
        let snapshot = telemetry.snapshot();
        assert!(snapshot.drafters.iter().all(|d| d.steps <= SPANS));
    }
    for thread in threads {
        thread.join().unwrap();
    }
    let snapshot = telemetry.snapshot();
    for drafter in &snapshot.drafters {
        let total: Duration = drafter.phases.iter().map(|p| p.total).sum();
        let count: u64 = drafter.phases.iter().map(|p| p.count).sum();
        assert_eq!(total, Duration::from_nanos(SPANS * (SPANS + 1) / 2));
        assert_eq!(
            (count, drafter.steps, drafter.loss_count),
            (SPANS, SPANS, SPANS)
        );
        assert_eq!(drafter.loss_sum, 0.5 * SPANS as f64);
    }
    assert!(
        snapshot.spans_dropped > 0,
        "rings of 4096 overflow with 20k undrained spans and count it"
    );
}

#[test]
fn a_step_counts_its_slots_its_real_tokens_and_those_with_a_loss() {
    use draftpipe_runtime::batch::HsBatch;
    // Two sequences of 3 and 1 tokens padded to 4; the mask is set on 2 of the first and the padding of the
    // second (which must not count: padding is no token).
    let mut batch = HsBatch::zeroed(4, 2, 8);
    batch.seq_lens = vec![3, 1];
    batch.loss_mask = vec![1, 0, 1, 0, 0, 1, 1, 1];
    assert_eq!(
        StepTokens::of(&batch),
        StepTokens {
            slots: 8,
            real: 4,
            with_loss: 2
        }
    );
    let telemetry = Arc::new(Telemetry::new(0, 1, false));
    let drafter = telemetry.drafter(0).unwrap();
    drafter.step_done(StepTokens::of(&batch), 1.0);
    drafter.step_done(StepTokens::of(&batch), 1.0);
    let snapshot = telemetry.snapshot();
    assert_eq!(
        (
            snapshot.token_slots(),
            snapshot.real_tokens(),
            snapshot.loss_tokens()
        ),
        (16, 8, 4)
    );
}
