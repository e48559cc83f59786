//! What-ifs: `--set` assignments change the model, and bad ones get the checker's spanned errors.

use draftpipe_compiler::plan::PullPolicy;
use draftpipe_runtime::simulate::{BucketModel, Model, parse_what_ifs};

fn base() -> Model {
    Model {
        name: "base".into(),
        capacity: 20,
        min_ready: 4,
        pull: PullPolicy::RandomInBucket,
        buckets: vec![BucketModel {
            padded_len: 512,
            tokens: 2048,
            share: 1.0,
            step_mean_s: 0.5,
            step_std_s: 0.05,
        }],
        producers: 2,
        produce_mean_s: 0.1,
        produce_std_s: 0.01,
        drafters: 3,
        lockstep: true,
        rounds: true,
        all_reduce_s: 0.0,
        step_common_share: 0.0,
        real_share: None,
        producer_origin: "test".into(),
        drafter_origin: "test".into(),
    }
}

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

/// The rendered errors of applying `sets` together to the base model.
fn errors(sets: &[&str]) -> String {
    match parse_what_ifs(&args(sets)) {
        Err(diagnostics) => diagnostics.to_string(),
        Ok(what_ifs) => what_ifs
            .apply_together(&base())
            .expect_err("the what-if should be refused")
            .to_string(),
    }
}

#[test]
fn assignments_change_the_model() {
    let what_ifs = parse_what_ifs(&args(&[
        "queue.capacity=60,queue.min_ready=10",
        "drafter.devices=4",
        "producer.rate=1.5x",
        "drafter.step_time=0.8x",
        "queue.pull=fifo",
    ]))
    .unwrap();
    let m = what_ifs.apply_together(&base()).unwrap();
    assert_eq!((m.capacity, m.min_ready, m.drafters), (60, 10, 4));
    assert!((m.produce_mean_s - 0.1 / 1.5).abs() < 1e-12);
    assert!(
        (m.produce_std_s - 0.01 / 1.5).abs() < 1e-12,
        "the spread scales too"
    );
    assert!((m.buckets[0].step_mean_s - 0.4).abs() < 1e-12);
    assert_eq!(m.pull, PullPolicy::Fifo);

    let absolute = parse_what_ifs(&args(&["producer.rate=4", "drafter.step_time=250ms"]))
        .unwrap()
        .apply_together(&base())
        .unwrap();
    assert!((absolute.produce_mean_s - 0.25).abs() < 1e-12);
    assert!((absolute.buckets[0].step_mean_s - 0.25).abs() < 1e-12);

    let each = parse_what_ifs(&args(&[
        "queue.capacity=60,queue.min_ready=10",
        "drafter.devices=4",
    ]))
    .unwrap()
    .apply_each(&base())
    .unwrap();
    assert_eq!(each.len(), 2);
    assert_eq!(each[0].0, "queue.capacity=60,queue.min_ready=10");
    assert_eq!((each[0].1.capacity, each[0].1.drafters), (60, 3));
    assert_eq!((each[1].1.capacity, each[1].1.drafters), (20, 4));
}

#[test]
fn an_unknown_key_is_a_spanned_error_with_a_suggestion() {
    let text = errors(&["queue.capacity=60", "queue.capcity=60"]);
    assert!(
        text.contains("error: unknown what-if key `queue.capcity`"),
        "{text}"
    );
    assert!(text.contains("--> --set:1:19"), "{text}");
    assert!(text.contains("^^^^^^^^^^^^^ unknown key"), "{text}");
    assert!(text.contains("did you mean `queue.capacity`?"), "{text}");
}

#[test]
fn min_ready_above_capacity_points_at_the_assignment() {
    let text = errors(&["queue.min_ready=30"]);
    assert!(
        text.contains("`queue.min_ready` (30) is above `queue.capacity` (20)"),
        "{text}"
    );
    assert!(text.contains("--> --set:1:17"), "{text}");
    assert!(text.contains("^^ above the capacity"), "{text}");
    // Lowering the capacity under the plan's watermark points at the capacity.
    let text = errors(&["queue.capacity=2"]);
    assert!(
        text.contains("`queue.min_ready` (4) is above `queue.capacity` (2)"),
        "{text}"
    );
    assert!(text.contains("--> --set:1:16"), "{text}");
}

#[test]
fn bad_values_are_spanned_errors_and_all_are_reported() {
    let text = errors(&[
        "producer.rate=-2",
        "drafter.devices=0,queue.pull=lifo",
        "drafter.step_time=5",
    ]);
    assert!(
        text.contains("`producer.rate` must be positive, found -2"),
        "{text}"
    );
    assert!(text.contains("^^ negative"), "{text}");
    assert!(
        text.contains("`drafter.devices` must be at least 1, found 0"),
        "{text}"
    );
    assert!(text.contains("unknown pull policy `lifo`"), "{text}");
    assert!(text.contains("takes a duration or a factor"), "{text}");
    assert!(text.contains("error: `--set` has 4 errors"), "{text}");
    let text = errors(&["queue.capacity"]);
    assert!(
        text.contains("expected KEY=VALUE, found `queue.capacity`"),
        "{text}"
    );
    let text = errors(&["producer.rate=fast"]);
    assert!(text.contains("not a number"), "{text}");
    let text = errors(&["producer.rate=-1.5x"]);
    assert!(text.contains("must be positive"), "{text}");
}
