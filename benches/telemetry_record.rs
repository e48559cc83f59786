//! What telemetry costs a worker per step: the hot-path recording calls, with and without the trace ring,
//! beside a bare clock read (which every phase boundary needs anyway).
//!
//! Target: recording one whole drafter step (8 phase laps + `step_done`) within 2 µs with the trace on,
//! i.e. within 0.2% of a 1 ms step; most of it is the clock reads the phase boundaries need anyway.
//!
//! `cargo bench --bench telemetry_record -- --warm-up-time 1 --measurement-time 2`

use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use criterion::{Criterion, criterion_group, criterion_main};
use draftpipe_runtime::telemetry::{DrafterPhase, Telemetry, TraceBuffer};

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
            b.iter(|| drafter.record(black_box(DrafterPhase::Forward), start, end))
        });
        group.bench_function(format!("step_of_8_laps_{suffix}"), |b| {
            b.iter(|| {
                let mut mark = Instant::now();
                for phase in DrafterPhase::ALL {
                    drafter.lap(phase, &mut mark);
                }
                drafter.step_done(2048, black_box(2.5));
            });
            // Keep the ring from sitting full, as the telemetry thread's drains do in a run.
            drained.drain(&telemetry);
        });
    }
    group.finish();
}

criterion_group!(benches, recording);
criterion_main!(benches);
