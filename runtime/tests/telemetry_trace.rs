//! The Perfetto/Chrome trace: written, parsed back, and checked event by event against what was recorded;
//! and its memory bounds (per-worker buffer, ring overflow).

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use draftpipe_runtime::telemetry::{
    DRAFTER_PID, DrafterPhase, PRODUCER_PID, ProducerPhase, QueueSnapshot, Reporter,
    ReporterConfig, Telemetry, TraceBuffer,
};
use serde_json::Value;

fn temp_path(name: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    std::env::temp_dir()
        .join(format!(
            "draftpipe-trace-{name}-{}-{nanos}",
            std::process::id()
        ))
        .join("trace.json")
}

fn events(path: &PathBuf) -> (Vec<Value>, Value) {
    let json: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    (
        json["traceEvents"].as_array().unwrap().clone(),
        json["otherData"].clone(),
    )
}

#[test]
fn the_trace_has_one_named_track_per_worker_and_one_event_per_span() {
    let telemetry = Arc::new(Telemetry::new(2, 2, true));
    let epoch = telemetry.epoch();
    let mut expected = Vec::new();
    for i in 0..2 {
        let producer = telemetry.producer(i).unwrap();
        let drafter = telemetry.drafter(i).unwrap();
        for n in 0..5u64 {
            let start = epoch + Duration::from_micros(1000 * n + 10 * i as u64);
            let end = start + Duration::from_micros(300 + n);
            producer.record(ProducerPhase::ALL[n as usize % 2], start, end);
            expected.push((
                PRODUCER_PID,
                i,
                ProducerPhase::ALL[n as usize % 2].name(),
                start,
                end,
            ));
            let phase = DrafterPhase::ALL[n as usize];
            drafter.record(phase, start, end);
            expected.push((DRAFTER_PID, i, phase.name(), start, end));
        }
    }
    let path = temp_path("tracks");
    let mut config = ReporterConfig::new("trace-test", Duration::from_secs(60), 4, 1);
    config.trace_path = Some(path.clone());
    let reporter = Reporter::new(config, Arc::clone(&telemetry), std::io::sink()).unwrap();
    reporter
        .finish(&QueueSnapshot {
            capacity: 4,
            min_ready: 1,
            ..Default::default()
        })
        .unwrap();

    let (events, other) = events(&path);
    let tracks: BTreeSet<(u64, u64, String)> = events
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "thread_name")
        .map(|e| {
            (
                e["pid"].as_u64().unwrap(),
                e["tid"].as_u64().unwrap(),
                e["args"]["name"].as_str().unwrap().into(),
            )
        })
        .collect();
    let want: BTreeSet<(u64, u64, String)> = [
        (1, 0, "producer 0"),
        (1, 1, "producer 1"),
        (2, 0, "drafter 0"),
        (2, 1, "drafter 1"),
    ]
    .into_iter()
    .map(|(p, t, n)| (p, t, n.to_string()))
    .collect();
    assert_eq!(tracks, want);
    let processes: Vec<&str> = events
        .iter()
        .filter(|e| e["name"] == "process_name")
        .map(|e| e["args"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(processes, ["producers", "drafters"]);

    let complete: Vec<&Value> = events.iter().filter(|e| e["ph"] == "X").collect();
    assert_eq!(complete.len(), expected.len());
    for (pid, tid, name, start, end) in expected {
        let ts = (start - epoch).as_nanos() as f64 / 1e3;
        let dur = (end - start).as_nanos() as f64 / 1e3;
        let found = complete.iter().any(|e| {
            e["pid"] == pid
                && e["tid"] == tid
                && e["name"] == name
                && (e["ts"].as_f64().unwrap() - ts).abs() < 1e-6
                && (e["dur"].as_f64().unwrap() - dur).abs() < 1e-6
        });
        assert!(
            found,
            "no event for {name} on pid {pid} tid {tid} at {ts} µs"
        );
    }
    assert_eq!(other["spans_evicted"], 0);
    assert_eq!(other["spans_dropped_in_rings"], 0);
    std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
}

#[test]
fn memory_stays_bounded_keeping_the_latest_spans() {
    let telemetry = Arc::new(Telemetry::with_ring_capacity(0, 1, Some(4)));
    let drafter = telemetry.drafter(0).unwrap();
    let base = Instant::now();
    let mut buffer = TraceBuffer::new(0, 1, 3);
    // Ten spans into a ring of four without draining: the six oldest are overwritten and counted.
    for n in 0..10u64 {
        let start = base + Duration::from_millis(n);
        drafter.record(
            DrafterPhase::Forward,
            start,
            start + Duration::from_micros(100),
        );
    }
    assert_eq!(telemetry.snapshot().spans_dropped, 6);
    // Four reach the buffer, which keeps the last three.
    buffer.drain(&telemetry);
    assert_eq!((buffer.len(), buffer.evicted()), (3, 1));

    let path = temp_path("bounded");
    buffer
        .write(&path, telemetry.snapshot().spans_dropped)
        .unwrap();
    let (events, other) = events(&path);
    let starts: Vec<f64> = events
        .iter()
        .filter(|e| e["ph"] == "X")
        .map(|e| e["ts"].as_f64().unwrap())
        .collect();
    let epoch_offset = (base - telemetry.epoch()).as_nanos() as f64 / 1e3;
    let want: Vec<f64> = (7..10).map(|n| epoch_offset + 1000.0 * n as f64).collect();
    assert_eq!(starts.len(), 3);
    for (got, want) in starts.iter().zip(&want) {
        assert!(
            (got - want).abs() < 1e-3,
            "kept the latest spans: {starts:?} vs {want:?}"
        );
    }
    assert_eq!(other["spans_evicted"], 1);
    assert_eq!(other["spans_dropped_in_rings"], 6);
    std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
}

#[test]
fn without_a_trace_no_spans_are_kept() {
    let telemetry = Arc::new(Telemetry::new(1, 1, false));
    assert!(!telemetry.tracing());
    let drafter = telemetry.drafter(0).unwrap();
    let now = Instant::now();
    drafter.record(DrafterPhase::Loss, now, now + Duration::from_millis(1));
    let mut buffer = TraceBuffer::new(1, 1, 16);
    buffer.drain(&telemetry);
    assert!(buffer.is_empty());
    assert_eq!(telemetry.snapshot().spans_dropped, 0);
}

#[test]
fn a_trace_without_span_rings_is_refused() {
    let telemetry = Arc::new(Telemetry::new(1, 1, false));
    let mut config = ReporterConfig::new("no-rings", Duration::from_secs(1), 4, 1);
    config.trace_path = Some(temp_path("refused"));
    let error = Reporter::new(config, telemetry, std::io::sink())
        .err()
        .expect("refused");
    assert!(error.to_string().contains("needs span rings"), "{error}");
}
