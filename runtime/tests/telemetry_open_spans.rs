//! Status lines tell the truth every interval: spans still open when a line is printed count for the part
//! inside the interval, tokens per second is taken over a window longer than the slowest step, and the diagnosis
//! judges the steady state apart from start-up, warm-up and shut-down.
//!
//! The real recorders and reporter are driven by an injected clock (instants after the telemetry's epoch, passed
//! to the recorders and to `report_at`), so minutes of 3 s steps take microseconds; one test runs on the real
//! clock to show the same holds with threads and sleeps (its lines are taken while a step is under way, whatever
//! the scheduler does).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use draftpipe_runtime::telemetry::{
    Diagnosis, DrafterPhase, DrafterRecorder, QueueSnapshot, Reporter, ReporterConfig, StatusLine,
    StepTokens, Telemetry,
};

const PERIOD: Duration = Duration::from_secs(1);

fn queue(depth: usize) -> QueueSnapshot {
    QueueSnapshot {
        depth,
        capacity: 16,
        min_ready: 4,
        per_bucket: vec![depth],
        ..Default::default()
    }
}

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s)
}

/// One recorder call at a virtual instant.
enum Call {
    Wait,
    Span(DrafterPhase, f64),
    Done,
}

/// The calls of drafter steps of `step_s` (a 10 ms data wait, then forward, loss, backward, optimizer) from
/// `start_s` until `end_s`, each as `(time it is made, call, end of its span)`.
fn steps(start_s: f64, step_s: f64, end_s: f64) -> Vec<(f64, Call, f64)> {
    let mut calls = Vec::new();
    let mut t = start_s;
    while t + step_s <= end_s {
        calls.push((t, Call::Wait, t));
        let wait_end = t + 0.01;
        calls.push((wait_end, Call::Span(DrafterPhase::DataWait, t), wait_end));
        let phases = [
            (DrafterPhase::Forward, 0.25),
            (DrafterPhase::Loss, 0.5),
            (DrafterPhase::Backward, 0.2),
            (DrafterPhase::Optimizer, 0.05),
        ];
        let mut s = wait_end;
        let compute = step_s - 0.01;
        for (phase, share) in phases {
            let e = s + compute * share;
            // The CPU drafter records its forward, loss and backward only when the step's compute returns.
            calls.push((t + step_s, Call::Span(phase, s), e));
            s = e;
        }
        calls.push((t + step_s, Call::Done, t + step_s));
        t += step_s;
    }
    calls
}

/// Replays `calls` of each drafter on `recorders` in time order, reporting every period until `end_s`.
fn replay(
    telemetry: &Arc<Telemetry>,
    recorders: &[DrafterRecorder],
    mut calls: Vec<(usize, f64, Call, f64)>,
    end_s: f64,
) -> (Vec<StatusLine>, Reporter<Vec<u8>>) {
    let epoch = telemetry.epoch();
    let at = |s: f64| epoch + secs(s);
    calls.sort_by(|a, b| a.1.total_cmp(&b.1));
    let config = ReporterConfig::new("open-spans", PERIOD, 16, 4);
    let mut reporter = Reporter::new(config, Arc::clone(telemetry), Vec::new()).unwrap();
    let mut lines = Vec::new();
    let mut pending = calls.drain(..).peekable();
    let mut report_s = PERIOD.as_secs_f64();
    while report_s <= end_s {
        while let Some((worker, when, call, end)) =
            pending.next_if(|(_, when, _, _)| *when <= report_s)
        {
            let recorder = &recorders[worker];
            match call {
                Call::Wait => recorder.waiting(at(when)),
                Call::Span(phase, span_start) => {
                    recorder.record(phase, at(span_start), at(end));
                    if phase == DrafterPhase::DataWait {
                        recorder.begin_step(256);
                    }
                }
                Call::Done => recorder.step_done(StepTokens::unpadded(2048), 3.0),
            }
        }
        let line = reporter.report_at(at(report_s), &queue(16)).unwrap();
        lines.push(line);
        report_s += PERIOD.as_secs_f64();
    }
    (lines, reporter)
}

#[test]
fn three_second_steps_read_busy_on_every_one_second_line() {
    let telemetry = Arc::new(Telemetry::new(1, 2, false));
    let recorders: Vec<_> = (0..2).map(|i| telemetry.drafter(i).unwrap()).collect();
    let mut calls = Vec::new();
    // The second drafter is out of phase with the first, so lines cut steps at every point.
    for (worker, offset) in [(0, 0.0), (1, 0.4)] {
        calls.extend(
            steps(offset, 3.0, 61.0)
                .into_iter()
                .map(|(when, call, end)| (worker, when, call, end)),
        );
    }
    let (lines, _) = replay(&telemetry, &recorders, calls, 60.0);
    assert_eq!(lines.len(), 60);
    for line in &lines[1..] {
        for drafter in &line.drafters {
            assert!(
                drafter.busy_pct >= 95.0,
                "a line reads {:.1}% busy while both drafters are inside 3 s steps: {line}",
                drafter.busy_pct
            );
        }
    }
    // The first second of drafter 1 holds 0.4 s before its first span: start-up, neither busy nor waiting.
    assert!(lines[0].drafters[0].busy_pct >= 95.0, "{}", lines[0]);
    // Two drafters, 2048 tokens per 3 s step each: every line once both have completed a step reads the true
    // rate, whatever number of completions its window happens to hold.
    let truth = 2.0 * 2048.0 / 3.0;
    for line in lines.iter().filter(|l| l.elapsed_s >= 4.0) {
        let rate = line.real_tokens_per_s.unwrap();
        assert!(
            (rate - truth).abs() / truth < 0.02,
            "{rate} vs {truth}: {line}"
        );
        assert!(line.to_string().contains("real tok/s (10s)"), "{line}");
    }
    assert!(
        lines[1].to_string().contains("- real tok/s"),
        "{}",
        lines[1]
    );
}

#[test]
fn drafters_idle_on_an_empty_queue_read_waiting_on_every_line() {
    // One step each, then an empty queue: a stall of the drafters, on every line.
    let telemetry = Arc::new(Telemetry::new(1, 2, false));
    let recorders: Vec<_> = (0..2).map(|i| telemetry.drafter(i).unwrap()).collect();
    let mut calls = Vec::new();
    for worker in 0..2 {
        calls.extend(
            steps(0.0, 0.5, 0.5)
                .into_iter()
                .map(|(when, call, end)| (worker, when, call, end)),
        );
        calls.push((worker, 0.5, Call::Wait, 0.5));
    }
    let (lines, _) = replay(&telemetry, &recorders, calls, 12.0);
    for line in &lines[1..] {
        assert_eq!(line.first_data_wait_s, None, "{line}");
        for drafter in &line.drafters {
            assert!(drafter.data_wait_pct >= 95.0, "{line}");
            assert!(drafter.busy_pct <= 5.0, "{line}");
        }
        assert!(line.to_string().contains("wait=[100,100]%"), "{line}");
    }
}

#[test]
fn waiting_for_the_first_producer_is_its_own_line_and_no_step_s_time() {
    // Issue 20: 50 s of waiting for the first producer were filed as the first step's warm-up, and the rate's
    // window (twice the longest step) read `tok/s (104s)`. The drafters wait 20 s for their first item, then
    // take 1 s steps.
    let telemetry = Arc::new(Telemetry::new(1, 2, false));
    let recorders: Vec<_> = (0..2).map(|i| telemetry.drafter(i).unwrap()).collect();
    let mut calls = Vec::new();
    for worker in 0..2 {
        calls.push((worker, 0.0, Call::Wait, 0.0));
        calls.push((worker, 20.0, Call::Span(DrafterPhase::DataWait, 0.0), 20.0));
        calls.extend(
            steps(20.0, 1.0, 40.0)
                .into_iter()
                .map(|(when, call, end)| (worker, when, call, end)),
        );
    }
    let (lines, reporter) = replay(&telemetry, &recorders, calls, 40.0);
    for line in &lines[..19] {
        let wait = line.first_data_wait_s.expect("waiting for the first data");
        assert!((wait - line.elapsed_s).abs() < 1e-6, "{line}");
        let text = line.to_string();
        assert!(
            text.contains("waiting for the first data from the producers"),
            "{text}"
        );
        assert!(
            !text.contains("wait=["),
            "not a stall of the drafters: {text}"
        );
    }
    for line in &lines[21..] {
        assert_eq!(line.first_data_wait_s, None, "{line}");
        assert!(
            line.to_string().contains("real tok/s (10s)"),
            "the window is the plain 10 s: {line}"
        );
    }
    let summary = reporter
        .finish_at(telemetry.epoch() + secs(40.0), &queue(16))
        .unwrap();
    let timeline = summary.drafters[0].timeline.as_ref().unwrap();
    assert!(
        (timeline.first_data_wait_s - 20.0).abs() < 1e-6,
        "{timeline:?}"
    );
    assert!(
        (timeline.warmup_wall_s - 1.0).abs() < 1e-6,
        "the first step alone: {timeline:?}"
    );
    assert!((timeline.longest_step_s - 1.0).abs() < 1e-6, "{timeline:?}");
    let diagnosis = Diagnosis::from_summary(&summary);
    let text = diagnosis.to_string();
    assert!(text.contains("waiting for the first data 20 s"), "{text}");
    assert!(
        diagnosis.queue.drafter_wait_pct < 5.0,
        "the first wait is no steady-state wait: {text}"
    );
}

#[test]
fn the_real_clock_and_threads_agree() {
    // 450 ms steps back to back, lines every 150 ms: every line cuts a step that is under way. The lines are
    // taken only while the worker is stepping (from its first step until it is told to stop), so a worker
    // thread that a loaded machine starts late, or a reporter that oversleeps, changes no line.
    let telemetry = Arc::new(Telemetry::new(0, 1, false));
    let recorder = telemetry.drafter(0).unwrap();
    let stepping = Arc::new(Barrier::new(2));
    let stop = Arc::new(AtomicBool::new(false));
    let worker = {
        let (stepping, stop) = (Arc::clone(&stepping), Arc::clone(&stop));
        thread::spawn(move || {
            let mut since = Instant::now();
            let mut first = true;
            while !stop.load(Ordering::Acquire) {
                recorder.waiting(since);
                recorder.lap(DrafterPhase::DataWait, &mut since);
                recorder.begin_step(128);
                if std::mem::take(&mut first) {
                    stepping.wait();
                }
                thread::sleep(Duration::from_millis(450));
                recorder.lap(DrafterPhase::Forward, &mut since);
                recorder.step_done(StepTokens::unpadded(1024), 2.0);
            }
        })
    };
    let config = ReporterConfig::new("real-clock", Duration::from_millis(150), 16, 4);
    let mut reporter = Reporter::new(config, Arc::clone(&telemetry), Vec::new()).unwrap();
    stepping.wait();
    // The interval before the first step (the thread's start) is no step's: this line only sets the baseline.
    reporter.report(&queue(16)).unwrap();
    let mut lines = Vec::new();
    for _ in 0..8 {
        thread::sleep(Duration::from_millis(150));
        lines.push(reporter.report(&queue(16)).unwrap());
    }
    stop.store(true, Ordering::Release);
    worker.join().unwrap();
    for line in &lines {
        assert!(line.drafters[0].busy_pct >= 95.0, "{line}");
    }
}

#[test]
fn a_short_run_diagnoses_its_steady_state_not_its_start_and_end() {
    // 2 s of start-up, then three buckets whose first steps are slow (workspace, capture), then 3 steady steps
    // each, then 2 s of shut-down: 15 steps in all, as in the short `transformers` run.
    let telemetry = Arc::new(Telemetry::new(1, 1, false));
    let recorder = telemetry.drafter(0).unwrap();
    let epoch = telemetry.epoch();
    let at = |s: f64| epoch + secs(s);
    let mut t = 2.0;
    let mut warmup_s = 0.0;
    for bucket in [
        128, 256, 512, 128, 256, 512, 128, 256, 512, 128, 256, 512, 128, 256, 512,
    ] {
        let first = t < 6.0;
        let step = if first { 1.5 } else { 0.5 };
        // The very first data wait is waiting for the first producer, no step's time.
        let first_wait = if t == 2.0 { 0.002 } else { 0.0 };
        recorder.waiting(at(t));
        recorder.record(DrafterPhase::DataWait, at(t), at(t + 0.002));
        recorder.begin_step(bucket);
        recorder.record(DrafterPhase::Forward, at(t + 0.002), at(t + step));
        recorder.step_done(StepTokens::unpadded(2048), 3.0);
        if first {
            warmup_s += step - first_wait;
        }
        t += step;
    }
    let end = t + 2.0;
    let config = ReporterConfig::new("short", Duration::from_secs(1), 16, 4);
    let reporter = Reporter::new(config, Arc::clone(&telemetry), Vec::new()).unwrap();
    let summary = reporter.finish_at(at(end), &queue(16)).unwrap();
    let diagnosis = Diagnosis::from_summary(&summary);
    let text = diagnosis.to_string();
    assert!(!diagnosis.host_side_gaps, "{text}");
    assert!(diagnosis.drafters.busy_pct >= 99.0, "{text}");
    assert_eq!(diagnosis.drafters.steps, 12, "{text}");
    let warmup = diagnosis.warmup.as_ref().unwrap();
    assert!((warmup.startup_s - 2.0).abs() < 1e-6, "{text}");
    assert!((warmup.shutdown_s - 2.0).abs() < 1e-6, "{text}");
    assert_eq!(warmup.warmup_steps, 3.0, "{text}");
    assert!((warmup.warmup_s - warmup_s).abs() < 1e-6, "{text}");
    assert!(text.contains("start-up 2 s"), "{text}");
    // Per-bucket steady step times, for the simulator.
    let buckets = &summary.drafters[0].buckets;
    assert_eq!(buckets.len(), 3);
    for bucket in buckets {
        assert_eq!(bucket.steps, 4);
        assert!((bucket.mean_s - 0.498).abs() < 1e-6, "{bucket:?}");
        assert!(bucket.std_s < 1e-6, "{bucket:?}");
    }
}

#[test]
fn a_gpu_drafter_shows_busy_and_gpu_apart_and_says_which_is_low() {
    // The host is inside the step all the time, the device executes only 60% of it: the seed's gaps in activity.
    let telemetry = Arc::new(Telemetry::new(1, 1, false));
    let recorder = telemetry.drafter(0).unwrap();
    let epoch = telemetry.epoch();
    let at = |s: f64| epoch + secs(s);
    let config = ReporterConfig::new("gpu", Duration::from_secs(1), 16, 4);
    let mut reporter = Reporter::new(config, Arc::clone(&telemetry), Vec::new()).unwrap();
    let mut t = 0.0;
    let mut lines = Vec::new();
    for i in 0..400 {
        recorder.waiting(at(t));
        recorder.record(DrafterPhase::DataWait, at(t), at(t + 0.0001));
        recorder.begin_step(512);
        recorder.record(DrafterPhase::Copy, at(t + 0.0001), at(t + 0.004));
        recorder.record(DrafterPhase::DeviceStep, at(t + 0.004), at(t + 0.01));
        recorder.step_done(StepTokens::unpadded(4096), 2.0);
        t += 0.01;
        if i % 100 == 99 {
            lines.push(reporter.report_at(at(t), &queue(16)).unwrap());
        }
    }
    for line in &lines {
        let gpu = line.drafters[0].gpu_pct.unwrap();
        assert!((gpu - 60.0).abs() < 2.0, "{line}");
        assert!(line.to_string().contains(" gpu=[60]%"), "{line}");
    }
    let summary = reporter.finish_at(at(t), &queue(16)).unwrap();
    let diagnosis = Diagnosis::from_summary(&summary);
    let text = diagnosis.to_string();
    assert!(text.contains("gpu 60.0%"), "{text}");
    assert!(text.contains("gpu is the low one"), "{text}");
}
