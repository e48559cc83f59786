//! What telemetry costs a worker per step: the hot-path recording calls, with and without the trace ring,
//! beside a bare clock read (which every phase boundary needs anyway).
//!
//! Target: recording one whole drafter step (8 phase laps + `step_done`) within 2 µs with the trace on,
//! i.e. within 0.2% of a 1 ms step; most of it is the clock reads the phase boundaries need anyway.
//!
//! The trace ring is drained every [`DRAIN_EVERY`] steps, outside the timed span, as the telemetry thread drains
//! it during a run: a ring left full would time the path that drops spans instead of the one that keeps them.
//! Each traced benchmark ends by checking that no span was dropped.
//!
//! `cargo bench --bench telemetry_record -- --warm-up-time 1 --measurement-time 2`

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use draftpipe_runtime::telemetry::{DrafterPhase, StepTokens, Telemetry, TraceBuffer};

/// Timed iterations between two drains: a step pushes one span per phase (9), so 64 steps fill a seventh of the
/// 4096-span ring.
const DRAIN_EVERY: u64 = 64;

/// Runs `body` `iters` times, timing it in chunks of [`DRAIN_EVERY`] and draining the ring between chunks.
fn timed_with_drains(
    iters: u64,
    telemetry: &Telemetry,
    drained: &mut TraceBuffer,
    mut body: impl FnMut(),
) -> Duration {
    let mut total = Duration::ZERO;
    let mut left = iters;
    while left > 0 {
        let chunk = left.min(DRAIN_EVERY);
        let start = Instant::now();
        for _ in 0..chunk {
            body();
        }
        total += start.elapsed();
        drained.drain(telemetry);
        left -= chunk;
    }
    total
}

fn recording(c: &mut Criterion) {
    let mut group = c.benchmark_group("telemetry");
    group.bench_function("instant_now", |b| b.iter(|| black_box(Instant::now())));

    for trace in [false, true] {
        let telemetry = Arc::new(Telemetry::new(0, 1, trace));
        let drafter = telemetry.drafter(0).unwrap();
        let start = Instant::now();
        let end = Instant::now();
        let mut drained = TraceBuffer::new(0, 1, 1024);
        let suffix = if trace { "traced" } else { "untraced" };
        group.bench_function(format!("record_{suffix}"), |b| {
            b.iter_custom(|iters| {
                timed_with_drains(iters, &telemetry, &mut drained, || {
                    drafter.record(black_box(DrafterPhase::Forward), start, end);
                })
            })
        });
        group.bench_function(format!("step_of_8_laps_{suffix}"), |b| {
            b.iter_custom(|iters| {
                timed_with_drains(iters, &telemetry, &mut drained, || {
                    let mut mark = Instant::now();
                    for phase in DrafterPhase::ALL {
                        drafter.lap(phase, &mut mark);
                    }
                    drafter.step_done(StepTokens::unpadded(2048), black_box(2.5));
                })
            })
        });
        assert_eq!(
            telemetry.snapshot().spans_dropped,
            0,
            "the ring overflowed: the benchmark timed the dropping path"
        );
    }
    group.finish();
}

criterion_group!(benches, recording);
criterion_main!(benches);
