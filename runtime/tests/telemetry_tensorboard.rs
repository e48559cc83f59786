//! The status line's figures that TensorBoard shows and `status.jsonl` did not carry before (gradient norm,
//! per-slot accuracy, learning rate), from the recorders through the reporter into the event file.

use std::sync::Arc;
use std::time::{Duration, Instant};

use draftpipe_compiler::plan::{LrSchedule, ScheduleKind};
use draftpipe_runtime::telemetry::tensorboard::{Event, What, read_records};
use draftpipe_runtime::telemetry::{
    DrafterPhase, LearningRate, QueueSnapshot, Reporter, ReporterConfig, StepTokens, Taus,
    Telemetry,
};
use prost::Message;

fn queue() -> QueueSnapshot {
    QueueSnapshot {
        depth: 3,
        capacity: 8,
        min_ready: 1,
        per_bucket: vec![1, 2],
        ..Default::default()
    }
}

/// The scalars of the last summary event in the directory's only event file.
fn last_scalars(dir: &std::path::Path) -> Vec<(String, f32)> {
    let files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let bytes = std::fs::read(&files[0]).unwrap();
    let records = read_records(&bytes).unwrap();
    let event = Event::decode(*records.last().unwrap()).unwrap();
    let Some(What::Summary(summary)) = event.what else {
        panic!("the last event holds no summary: {event:?}");
    };
    summary
        .value
        .into_iter()
        .map(|v| (v.tag, v.simple_value.unwrap()))
        .collect()
}

#[test]
fn gradient_norm_slot_accuracy_and_learning_rate_reach_the_line_and_the_event_file() {
    let dir = std::env::temp_dir().join(format!("draftpipe-tb-status-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let telemetry = Arc::new(Telemetry::new(0, 2, false));
    let recorders = [telemetry.drafter(0).unwrap(), telemetry.drafter(1).unwrap()];
    let mut config = ReporterConfig::new("tb", Duration::from_secs(3600), 8, 1);
    config.tensorboard_dir = Some(dir.clone());
    let schedule = LrSchedule {
        kind: ScheduleKind::Linear,
        warmup_steps: 0,
    };
    config.learning_rate = Some(LearningRate {
        lr: 0.5,
        schedule,
        schedule_total: 10,
    });
    let mut reporter = Reporter::new(config, Arc::clone(&telemetry), Vec::new()).unwrap();

    let step =
        |recorder: &draftpipe_runtime::telemetry::DrafterRecorder, norm: f64, acc: [f32; 2]| {
            let now = Instant::now();
            recorder.record(DrafterPhase::Forward, now, now + Duration::from_micros(5));
            recorder.block_metrics(
                Taus {
                    exact: 1.5,
                    simulated: 1.5,
                },
                &acc,
            );
            recorder.grad_norm(norm);
            recorder.step_done(StepTokens::unpadded(16), 2.0);
        };
    // Interval 1: drafter 0 takes two steps, drafter 1 one; a non-finite norm is no applied step's.
    step(&recorders[0], 1.0, [0.5, 0.25]);
    step(&recorders[0], 3.0, [1.0, 0.75]);
    step(&recorders[1], 2.0, [0.0, 0.5]);
    recorders[1].grad_norm(f64::NAN);
    let first = reporter.report(&queue()).unwrap();
    assert_eq!(first.grad_norm, Some(2.0), "the mean of 1, 3 and 2");
    assert_eq!(first.slot_accuracy, vec![0.5, 0.5]);
    // Step 1 (the slower drafter's count): the first step's rate, 0.5 × (10 − 0) / 10.
    assert_eq!(first.learning_rate, Some(0.5));

    // Interval 2: one more step each; the line is the interval's mean, not the run's.
    step(&recorders[0], 10.0, [0.0, 0.0]);
    step(&recorders[1], 20.0, [1.0, 1.0]);
    let second = reporter.report(&queue()).unwrap();
    assert_eq!(second.grad_norm, Some(15.0));
    assert_eq!(second.slot_accuracy, vec![0.5, 0.5]);
    assert_eq!(second.learning_rate, Some(0.5 * 9.0 / 10.0));

    // An interval without steps shows the latest figures.
    let idle = reporter.report(&queue()).unwrap();
    assert!(
        idle.grad_norm
            .is_some_and(|norm| norm == 10.0 || norm == 20.0)
    );
    assert_eq!(idle.slot_accuracy.len(), 2);

    let json: serde_json::Value = serde_json::to_value(&second).unwrap();
    assert_eq!(json["grad_norm"], 15.0);
    assert_eq!(json["slot_accuracy"], serde_json::json!([0.5, 0.5]));

    let scalars = last_scalars(&dir);
    let get = |tag: &str| scalars.iter().find(|(t, _)| t == tag).map(|(_, v)| *v);
    assert_eq!(get("train/grad_norm"), idle.grad_norm.map(|v| v as f32));
    assert_eq!(get("train/learning_rate"), Some((0.5f64 * 0.9) as f32));
    assert_eq!(
        get("train/slot_accuracy/2"),
        Some(idle.slot_accuracy[1] as f32)
    );
    assert_eq!(get("queue/bucket_1"), Some(2.0));
    assert_eq!(
        get("drafter_1/busy_pct"),
        Some(idle.drafters[1].busy_pct as f32)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_event_directory_that_cannot_be_made_stops_the_reporter_before_the_run() {
    let file = std::env::temp_dir().join(format!("draftpipe-tb-file-{}", std::process::id()));
    std::fs::write(&file, b"not a directory").unwrap();
    let telemetry = Arc::new(Telemetry::new(0, 1, false));
    let mut config = ReporterConfig::new("tb", Duration::from_secs(1), 8, 1);
    config.tensorboard_dir = Some(file.join("tb"));
    let error = Reporter::new(config, telemetry, Vec::new())
        .err()
        .unwrap()
        .to_string();
    assert!(
        error.contains(&file.join("tb").display().to_string()),
        "{error}"
    );
    std::fs::remove_file(&file).unwrap();
}
