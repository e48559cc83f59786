use prost::Message;

use super::*;

fn line(step: u64, loss: f64, wait: f64) -> StatusLine {
    serde_json::from_value(serde_json::json!({
        "elapsed_s": 1.5, "step": step, "total_steps": 100, "token_slots": 512,
        "real_tokens_per_s": 900.25, "token_slots_per_s": 1024.0, "loss_tokens_per_s": 800.0,
        "real_tokens_per_s_overall": 850.0, "q_hs": {"depth": 5, "capacity": 16}, "q_hsb": [2, 3],
        "drafters": [{"busy_pct": 97.5, "data_wait_pct": wait}], "loss": loss, "tau": 1.75,
        "slot_accuracy": [0.5, 0.25, 0.125], "learning_rate": 1e-3, "grad_norm": 0.75, "skipped": 0,
        "acceptance": {"tau": 2.5, "step": 40, "skipped": 1, "failed": 0}
    }))
    .unwrap()
}

fn events(path: &Path) -> Vec<Event> {
    let bytes = std::fs::read(path).unwrap();
    read_records(&bytes)
        .unwrap()
        .into_iter()
        .map(|record| Event::decode(record).unwrap())
        .collect()
}

fn values(event: &Event) -> Vec<(String, f32)> {
    let Some(What::Summary(summary)) = &event.what else {
        panic!("not a summary: {event:?}");
    };
    summary
        .value
        .iter()
        .map(|v| {
            (
                v.tag.clone(),
                v.simple_value.expect("a value is always set"),
            )
        })
        .collect()
}

#[test]
fn the_file_opens_with_its_version_then_one_event_per_line() {
    let dir = std::env::temp_dir().join(format!("draftpipe-tb-{}-a", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut writer = EventWriter::create(&dir).unwrap();
    writer.write_line(&line(10, 2.5, 0.0)).unwrap();
    writer.write_line(&line(20, 2.25, 2.5)).unwrap();
    let name = writer
        .path()
        .file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .to_owned();
    assert!(name.starts_with("events.out.tfevents."), "{name}");
    assert!(
        name.contains(&format!(".{}.", std::process::id())),
        "{name}"
    );

    let events = events(writer.path());
    assert_eq!(events.len(), 3);
    assert_eq!(
        events[0].what,
        Some(What::FileVersion("brain.Event:2".into()))
    );
    assert_eq!((events[1].step, events[2].step), (10, 20));
    assert!(events[1].wall_time > 1.6e9);
    let first: std::collections::BTreeMap<_, _> = values(&events[1]).into_iter().collect();
    for (tag, value) in [
        ("train/loss", 2.5),
        ("train/tau_simulated", 1.75),
        ("train/slot_accuracy/1", 0.5),
        ("train/slot_accuracy/3", 0.125),
        ("train/learning_rate", 1e-3),
        ("train/grad_norm", 0.75),
        ("throughput/real_tokens_per_s", 900.25),
        ("throughput/token_slots_per_s", 1024.0),
        ("queue/depth", 5.0),
        ("queue/bucket_0", 2.0),
        ("queue/bucket_1", 3.0),
        ("drafter_0/busy_pct", 97.5),
        // A zero is on the wire too: `simple_value` is a oneof member, kept even when 0.
        ("drafter_0/data_wait_pct", 0.0),
        ("acceptance/tau", 2.5),
        ("acceptance/measured_step", 40.0),
        ("acceptance/skipped", 1.0),
    ] {
        assert_eq!(first.get(tag), Some(&(value as f32)), "{tag}");
    }
    assert!(
        !first.contains_key("drafter_0/gpu_pct"),
        "no GPU share on a CPU line"
    );
    assert!(!first.contains_key("acceptance/teacher_forced_tau_simulated"));
    assert_eq!(values(&events[2])[0], ("train/loss".to_owned(), 2.25));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn each_writer_has_its_own_file() {
    let dir = std::env::temp_dir().join(format!("draftpipe-tb-{}-b", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut first = EventWriter::create(&dir).unwrap();
    let mut second = EventWriter::create(&dir).unwrap();
    assert_ne!(first.path(), second.path());
    first.write_line(&line(5, 1.0, 0.0)).unwrap();
    second.write_line(&line(6, 1.0, 0.0)).unwrap();
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 2);
    assert_eq!(events(first.path())[1].step, 5);
    assert_eq!(events(second.path())[1].step, 6);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn every_tag_and_its_field_are_in_the_docs_table() {
    let docs = include_str!("../../../../docs/telemetry.md");
    for row in TAGS {
        let documented = format!("| `{}` |", row.tag);
        assert!(
            docs.contains(&documented),
            "docs/telemetry.md has no row {documented}"
        );
        let field = format!("| `{}` |", row.field);
        let line = docs.lines().find(|l| l.starts_with(&documented)).unwrap();
        assert!(
            line.ends_with(&field),
            "the row of {} must end with {field}: {line}",
            row.tag
        );
    }
}
