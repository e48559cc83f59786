//! Status lines (values over an interval, the three output forms) and the run directory (`status.jsonl`,
//! `summary.json` written and read back, clear errors on bad files).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use draftpipe_runtime::telemetry::{
    DrafterCounts, DrafterPhase, OutputMode, PhaseCount, QueueSnapshot, Reporter, ReporterConfig,
    RunSummary, StatusLine, StepTokens, Taus, Telemetry, TelemetryError, TelemetrySnapshot,
    load_summary,
};

fn temp_dir(name: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    std::env::temp_dir().join(format!(
        "draftpipe-telemetry-{name}-{}-{nanos}",
        std::process::id()
    ))
}

fn drafter(
    wait_ms: u64,
    forward_ms: u64,
    steps: u64,
    tokens: u64,
    losses: &[f64],
) -> DrafterCounts {
    // 90% of the slots hold a real token, half of them a loss.
    let mut counts = DrafterCounts {
        steps,
        token_slots: tokens,
        real_tokens: tokens * 9 / 10,
        loss_tokens: tokens / 2,
        ..Default::default()
    };
    counts.phases[DrafterPhase::DataWait.index()] = PhaseCount {
        total: Duration::from_millis(wait_ms),
        count: steps,
    };
    counts.phases[DrafterPhase::Forward.index()] = PhaseCount {
        total: Duration::from_millis(forward_ms),
        count: steps,
    };
    counts.loss_sum = losses.iter().sum();
    counts.loss_count = losses.len() as u64;
    counts.last_loss = losses.last().copied();
    counts
}

fn queue(depth: usize, per_bucket: Vec<usize>) -> QueueSnapshot {
    QueueSnapshot {
        depth,
        capacity: 20,
        min_ready: 10,
        per_bucket,
        ..Default::default()
    }
}

#[test]
fn a_status_line_measures_the_interval_not_the_whole_run() {
    let previous = TelemetrySnapshot {
        elapsed: Duration::from_secs(8),
        drafters: vec![
            drafter(1000, 3000, 10, 4000, &[5.0, 4.0]),
            drafter(0, 4000, 10, 4000, &[5.0]),
        ],
        ..Default::default()
    };
    let current = TelemetrySnapshot {
        elapsed: Duration::from_secs(10),
        drafters: vec![
            drafter(1400, 4500, 14, 5600, &[5.0, 4.0, 3.0, 2.0]),
            drafter(0, 6000, 15, 6000, &[5.0, 3.0]),
        ],
        ..Default::default()
    };
    let line = StatusLine::between(&previous, &current, &queue(18, vec![3, 10, 5]), Some(100));
    assert_eq!(line.step, 14);
    assert_eq!(
        (line.token_slots, line.real_tokens, line.loss_tokens),
        (11_600, 10_440, 5_800)
    );
    let near = |rate: Option<f64>, expected: f64| (rate.unwrap() - expected).abs() < 1e-9;
    assert!(near(line.token_slots_per_s, 3600.0 / 2.0), "{line:?}");
    assert!(near(line.real_tokens_per_s, 3240.0 / 2.0), "{line:?}");
    assert!(near(line.loss_tokens_per_s, 1800.0 / 2.0), "{line:?}");
    assert!(near(line.real_tokens_per_s_overall, 1044.0), "{line:?}");
    assert!(
        (line.drafters[0].busy_pct - 75.0).abs() < 1e-9,
        "{:?}",
        line.drafters
    );
    assert!((line.drafters[0].data_wait_pct - 20.0).abs() < 1e-9);
    assert!((line.drafters[1].busy_pct - 100.0).abs() < 1e-9);
    assert!(
        (line.loss.unwrap() - 8.0 / 3.0).abs() < 1e-12,
        "mean of 3, 2 and 3 over the interval"
    );
    let text = line.to_string();
    for expected in [
        "step 14/100",
        "1.62k real tok/s",
        "of 1.8k slots/s: 90% real, 50% with loss",
        "q_hs=[18/20]",
        "q_hsb=[3,10,5]",
        "busy=[75,100]%",
        "wait=[20,0]%",
    ] {
        assert!(text.contains(expected), "{expected:?} missing in {text:?}");
    }
    let progress = line.progress_line(10);
    assert!(progress.starts_with("[#.........] "), "{progress}");
}

#[test]
fn an_interval_without_losses_shows_the_latest_one() {
    let snapshot = TelemetrySnapshot {
        elapsed: Duration::from_secs(1),
        drafters: vec![drafter(0, 0, 1, 1, &[2.5])],
        ..Default::default()
    };
    let line = StatusLine::between(&snapshot, &snapshot, &queue(0, vec![0]), None);
    assert_eq!(line.loss, Some(2.5));
    assert_eq!(line.real_tokens_per_s, Some(0.0));
}

/// The interval's two acceptance lengths are the means of its steps' (each kind on its own), the human line
/// names which is which, and a status line of an older build (its one `tau`, the simulated figure) reads back
/// as `tau_simulated`.
#[test]
fn both_acceptance_lengths_are_named_and_old_lines_read_as_simulated() {
    let before = TelemetrySnapshot {
        elapsed: Duration::from_secs(1),
        drafters: vec![drafter(0, 0, 1, 1, &[2.5])],
        ..Default::default()
    };
    let mut now = before.clone();
    now.elapsed = Duration::from_secs(2);
    now.drafters[0].tau_sum = Taus {
        exact: 2.0 + 3.0,
        simulated: 1.5 + 2.0,
    };
    now.drafters[0].tau_count = 2;
    let line = StatusLine::between(&before, &now, &queue(0, vec![0]), None);
    assert_eq!(
        (line.tau_exact, line.tau_simulated),
        (Some(2.5), Some(1.75))
    );
    assert!(
        line.to_string().contains("τ 2.500 exact (1.750 simulated)"),
        "{line}"
    );
    let json = serde_json::to_value(&line).unwrap();
    assert_eq!(
        (json["tau_exact"].as_f64(), json["tau_simulated"].as_f64()),
        (Some(2.5), Some(1.75))
    );
    let mut old = json.clone();
    let object = old.as_object_mut().unwrap();
    object.remove("tau_exact");
    let simulated = object.remove("tau_simulated").unwrap();
    object.insert("tau".into(), simulated);
    let read: StatusLine = serde_json::from_value(old).unwrap();
    assert_eq!((read.tau_exact, read.tau_simulated), (None, Some(1.75)));
    assert!(read.to_string().contains("τ 1.750 simulated"), "{read}");
}

#[test]
fn before_the_first_step_the_rates_are_null_not_zero() {
    let start = TelemetrySnapshot {
        elapsed: Duration::from_secs(1),
        drafters: vec![drafter(1000, 0, 0, 0, &[])],
        ..Default::default()
    };
    let later = TelemetrySnapshot {
        elapsed: Duration::from_secs(2),
        drafters: vec![drafter(2000, 0, 0, 0, &[])],
        ..Default::default()
    };
    let line = StatusLine::between(&start, &later, &queue(0, vec![0]), None)
        .with_rate_window(&start, &later);
    let json: serde_json::Value = serde_json::to_value(&line).unwrap();
    for field in [
        "real_tokens_per_s",
        "token_slots_per_s",
        "loss_tokens_per_s",
        "real_tokens_per_s_overall",
    ] {
        assert!(json[field].is_null(), "{field} in {json}");
    }
    let text = line.to_string();
    assert!(
        text.contains("| - real tok/s (1s) (avg -) of - slots/s: - real, - with loss |"),
        "{text}"
    );
}

fn run_reporter(mode: OutputMode, dir: Option<PathBuf>, reports: usize) -> RunSummary {
    let telemetry = Arc::new(Telemetry::new(1, 2, false));
    let recorders = [telemetry.drafter(0).unwrap(), telemetry.drafter(1).unwrap()];
    let mut config = ReporterConfig::new("status-test", Duration::from_secs(3600), 20, 10);
    config.mode = mode;
    config.total_steps = Some(reports as u64);
    config.run_dir = dir;
    let mut reporter = Reporter::new(config, Arc::clone(&telemetry), Vec::new()).unwrap();
    let start = Instant::now();
    for step in 0..reports {
        for recorder in &recorders {
            recorder.record(
                DrafterPhase::Forward,
                start,
                start + Duration::from_micros(10),
            );
            recorder.step_done(StepTokens::unpadded(64), 10.0 / (step + 1) as f64);
        }
        let depth = step % 21;
        reporter.sample(&queue(depth, vec![depth / 2, depth - depth / 2]));
        reporter
            .report(&queue(depth, vec![depth / 2, depth - depth / 2]))
            .unwrap();
    }
    reporter.finish(&queue(0, vec![0, 0])).unwrap()
}

fn output_of(mode: OutputMode, reports: usize) -> String {
    let telemetry = Arc::new(Telemetry::new(0, 1, false));
    let recorder = telemetry.drafter(0).unwrap();
    let mut config = ReporterConfig::new("output-test", Duration::from_secs(3600), 20, 10);
    config.mode = mode;
    config.total_steps = Some(reports as u64);
    let mut out = Vec::new();
    {
        let mut reporter = Reporter::new(config, Arc::clone(&telemetry), &mut out).unwrap();
        for step in 0..reports {
            recorder.step_done(StepTokens::unpadded(64), 1.0 + step as f64);
            reporter.report(&queue(step % 21, vec![step % 21])).unwrap();
        }
        reporter.finish(&queue(0, vec![0])).unwrap();
    }
    String::from_utf8(out).unwrap()
}

#[test]
fn json_mode_writes_one_parseable_object_per_line() {
    let text = output_of(OutputMode::Json, 30);
    let lines: Vec<StatusLine> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 31, "one per report plus the final one");
    assert!(lines.iter().all(|l| l.q_hs.depth <= l.q_hs.capacity));
    assert_eq!(lines[29].step, 30);
    assert_eq!(lines[4].q_hs.depth, 4);
}

#[test]
fn plain_mode_writes_lines_and_progress_mode_redraws_one() {
    let plain = output_of(OutputMode::Plain, 5);
    assert_eq!(plain.lines().count(), 6);
    assert!(!plain.contains('\r'));
    let progress = output_of(OutputMode::Progress, 5);
    assert_eq!(progress.matches('\r').count(), 6);
    assert_eq!(
        progress.matches('\n').count(),
        1,
        "one newline, after the last redraw"
    );
    assert!(
        progress.contains("[########################] "),
        "the bar is full at the end: {progress:?}"
    );
}

#[test]
fn the_run_directory_holds_status_lines_and_a_summary_that_reads_back() {
    let dir = temp_dir("rundir");
    let summary = run_reporter(OutputMode::Json, Some(dir.clone()), 40);
    let status = std::fs::read_to_string(dir.join("status.jsonl")).unwrap();
    let lines: Vec<StatusLine> = status
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 41);
    let loaded = load_summary(&dir).unwrap();
    assert_eq!(loaded, summary);
    assert_eq!(loaded.plan, "status-test");
    assert_eq!(
        (loaded.steps, loaded.token_slots, loaded.real_tokens),
        (40, 2 * 40 * 64, 2 * 40 * 64)
    );
    assert_eq!(loaded.drafters.len(), 2);
    assert_eq!(
        loaded.drafters[1].seconds(DrafterPhase::Forward),
        40.0 * 10e-6
    );
    // The last ten steps of both drafters, not the last step alone (10/40).
    let last_ten: f64 = (31..=40).map(|n| 10.0 / f64::from(n)).sum::<f64>() / 10.0;
    assert_eq!(loaded.final_steps, 10);
    assert!(
        (loaded.final_loss.unwrap() - last_ten).abs() < 1e-12,
        "{:?}",
        loaded.final_loss
    );
    assert_eq!(
        loaded.loss_curve.len(),
        40,
        "one point per interval that had losses"
    );
    assert_eq!(loaded.queue.samples(), 41);
    assert_eq!(loaded.queue.depth_histogram.len(), 21);
    assert_eq!(loaded.queue.max_depth, 20);
    assert_eq!(loaded.queue.timeline.len(), 41);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn long_runs_keep_bounded_evenly_spread_series() {
    let summary = run_reporter(OutputMode::Json, None, 10_000);
    let curve = &summary.loss_curve;
    assert!(
        curve.len() <= 4096 && curve.len() >= 2048,
        "{}",
        curve.len()
    );
    assert_eq!(curve[0].step, 1);
    assert!(
        curve.last().unwrap().step > 9_000,
        "the curve reaches the end of the run"
    );
    let gaps: Vec<u64> = curve.windows(2).map(|w| w[1].step - w[0].step).collect();
    assert!(
        gaps.iter().all(|&g| g == gaps[0]),
        "points are evenly spaced"
    );
    assert!(summary.queue.timeline.len() <= 4096);
}

#[test]
fn bad_summaries_give_clear_errors() {
    let dir = temp_dir("bad");
    let missing = load_summary(&dir).unwrap_err();
    assert!(matches!(missing, TelemetryError::Io { action: "read", .. }));
    assert!(missing.to_string().contains("summary.json"), "{missing}");

    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("summary.json"), "{ not json").unwrap();
    assert!(matches!(
        load_summary(&dir),
        Err(TelemetryError::Parse { .. })
    ));

    std::fs::write(dir.join("summary.json"), r#"{"format": 99, "plan": "x"}"#).unwrap();
    let error = load_summary(&dir).unwrap_err();
    assert!(
        matches!(
            error,
            TelemetryError::Format {
                found: Some(99),
                expected: 1,
                ..
            }
        ),
        "{error}"
    );

    std::fs::write(dir.join("summary.json"), r#"{"format": 1, "plan": "x"}"#).unwrap();
    let error = load_summary(&dir).unwrap_err();
    assert!(error.to_string().contains("missing field"), "{error}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_status_line_gives_each_drafters_all_reduce_share_of_the_interval() {
    let previous = TelemetrySnapshot {
        elapsed: Duration::from_secs(8),
        drafters: vec![drafter(0, 1000, 5, 1000, &[5.0])],
        ..Default::default()
    };
    let mut now = drafter(0, 1500, 9, 1800, &[5.0, 4.0]);
    now.phases[DrafterPhase::AllReduce.index()] = PhaseCount {
        total: Duration::from_millis(500),
        count: 4,
    };
    let current = TelemetrySnapshot {
        elapsed: Duration::from_secs(10),
        drafters: vec![now],
        ..Default::default()
    };
    let line = StatusLine::between(&previous, &current, &queue(5, vec![5]), None);
    assert!(
        (line.drafters[0].all_reduce_pct - 25.0).abs() < 1e-9,
        "500 ms of a 2 s interval: {:?}",
        line.drafters
    );
    let old_line = serde_json::json!({"busy_pct": 90.0, "data_wait_pct": 10.0});
    let old: draftpipe_runtime::telemetry::DrafterStatus =
        serde_json::from_value(old_line).unwrap();
    assert_eq!(old.all_reduce_pct, 0.0, "status lines of older builds read");
}
