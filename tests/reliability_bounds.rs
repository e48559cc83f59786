//! Issue 33's bounds and numbers, through the binary: `simulate` and `vocab` bound their work and say which
//! bound, implausible rates and corrupt summaries are refused with numbers of a sane length, a `--set` key
//! given twice is refused by name, and `simulate` labels token slots as slots (and real tokens as real).

mod binary_support;

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use binary_support::{draftpipe, scratch, text, tiny_pipe};

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Runs the binary in the repository and fails the test, instead of hanging it, when it is still running after
/// `limit` (what these commands did before their work was bounded).
fn draftpipe_within(args: &[&str], limit: Duration) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_draftpipe"))
        .args(args)
        .current_dir(repo())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the draftpipe binary runs");
    let deadline = Instant::now() + limit;
    while child.try_wait().expect("the child can be polled").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("`draftpipe {}` still ran after {limit:?}", args.join(" "));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("the child's output")
}

/// The longest run of digits in `text`: a figure printed with a sane number of digits has a handful.
fn longest_digit_run(text: &str) -> usize {
    text.split(|c: char| !c.is_ascii_digit())
        .map(str::len)
        .max()
        .unwrap_or(0)
}

/// Exit 1 with every `needle` in stderr, no panic and no number longer than a step count.
fn assert_refused(out: &Output, needles: &[&str]) {
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}{}", text(&out.stdout));
    for needle in needles {
        assert!(stderr.contains(needle), "{needle:?} missing in\n{stderr}");
    }
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        longest_digit_run(&stderr) <= 12,
        "a long number in\n{stderr}"
    );
}

const LIMIT: Duration = Duration::from_secs(60);

#[test]
fn simulate_refuses_more_events_than_a_prediction_processes() {
    let out = draftpipe_within(
        &[
            "simulate",
            "pipelines/quickstart.pipe",
            "--producer-rate",
            "1e8",
            "--step-time",
            "1e-9",
            "--duration",
            "10",
        ],
        LIMIT,
    );
    assert_refused(&out, &["events", "100M", "give a --duration of at most"]);
}

#[test]
fn vocab_refuses_more_synthetic_batches_than_a_count_makes() {
    let dir = scratch("bounds", "vocab-batches");
    let map = dir.join("map.safetensors");
    let out = draftpipe_within(
        &[
            "vocab",
            "pipelines/eagle3-quickstart.pipe",
            "--out",
            map.to_str().unwrap(),
            "--batches",
            &u64::MAX.to_string(),
        ],
        LIMIT,
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("more than a count makes (1000000)"),
        "{stderr}"
    );
    assert!(!map.exists(), "a refused count wrote {}", map.display());
}

#[test]
fn implausible_rates_are_refused_with_short_numbers() {
    for args in [
        &["--producer-rate", "1e308"][..],
        &["--producer-rate", "1e-300"][..],
        &["--producer-rate", "50", "--set", "producer.rate=1e300"][..],
    ] {
        let mut all = vec![
            "simulate",
            "pipelines/quickstart.pipe",
            "--step-time",
            "0.8",
        ];
        all.extend_from_slice(args);
        let out = draftpipe_within(&all, LIMIT);
        assert_refused(
            &out,
            &["the producer rate must be between 1e-6 and 1e9 items per second per worker"],
        );
    }
    let out = draftpipe_within(
        &[
            "simulate",
            "pipelines/quickstart.pipe",
            "--producer-rate",
            "50",
            "--step-time",
            "1e300",
        ],
        LIMIT,
    );
    assert_refused(&out, &["the drafter step time", "found 1e300"]);
}

#[test]
fn a_what_if_key_given_twice_is_refused_by_name() {
    let base = [
        "simulate",
        "pipelines/quickstart.pipe",
        "--producer-rate",
        "50",
        "--step-time",
        "0.8",
    ];
    for set in [
        &["--set", "queue.capacity=8,queue.capacity=99"][..],
        &["--set", "queue.capacity=8", "--set", "queue.capacity=99"][..],
    ] {
        let mut all = base.to_vec();
        all.extend_from_slice(set);
        let out = draftpipe_within(&all, LIMIT);
        assert_refused(&out, &["`queue.capacity` is set twice", "first set here"]);
    }
    // Compared, each `--set` is its own variant: the same key in two of them is two what-ifs, not a conflict.
    let mut all = base.to_vec();
    all.extend([
        "--compare",
        "--set",
        "queue.capacity=8",
        "--set",
        "queue.capacity=99",
    ]);
    let out = draftpipe_within(&all, LIMIT);
    assert!(out.status.success(), "{}", text(&out.stderr));
}

#[test]
fn simulate_labels_slots_as_slots() {
    let out = draftpipe_within(
        &[
            "simulate",
            "pipelines/quickstart.pipe",
            "--producer-rate",
            "50",
            "--step-time",
            "0.8",
            "--compare",
            "--set",
            "drafter.devices=3",
        ],
        LIMIT,
    );
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    assert!(!stdout.contains("tokens/s"), "{stdout}");
    assert!(stdout.contains("throughput: "), "{stdout}");
    assert!(
        stdout.contains(" slots/s (token slots, padding included"),
        "{stdout}"
    );
    assert!(
        stdout.contains("\nslots/s "),
        "the comparison's row\n{stdout}"
    );
}

/// A finished run of the tiny pipeline in `dir/run`.
fn finished_run(dir: &Path) -> std::path::PathBuf {
    let pipe = tiny_pipe(dir, (1, 1), "round_robin", binary_support::SYNTHETIC, None);
    let run_dir = dir.join("run");
    let out = draftpipe(
        &[
            "run",
            pipe.to_str().unwrap(),
            "--steps",
            "4",
            "--run-dir",
            run_dir.to_str().unwrap(),
        ],
        dir,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    run_dir
}

#[test]
fn simulate_from_a_run_gives_real_tokens_beside_slots_as_run_does() {
    let dir = scratch("bounds", "simulate-from");
    let run_dir = finished_run(&dir);
    let out = draftpipe_within(
        &[
            "simulate",
            dir.join("tiny.pipe").to_str().unwrap(),
            "--from",
            run_dir.to_str().unwrap(),
            "--duration",
            "60",
        ],
        LIMIT,
    );
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    assert!(stdout.contains(" real tok/s of "), "{stdout}");
    assert!(
        stdout.contains("of the slots were real tokens in the run"),
        "{stdout}"
    );
    assert!(!stdout.contains("tokens/s"), "{stdout}");
}

#[test]
fn a_corrupt_summary_is_refused_with_a_short_number() {
    let dir = scratch("bounds", "diagnose");
    let run_dir = finished_run(&dir);
    let good = draftpipe_within(&["diagnose", run_dir.to_str().unwrap()], LIMIT);
    let report = text(&good.stdout);
    assert!(good.status.success(), "{}", text(&good.stderr));
    assert!(longest_digit_run(&report) <= 12, "{report}");

    let path = run_dir.join("summary.json");
    let original: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    for (edit, field) in [
        (
            &(|s: &mut serde_json::Value| {
                s["drafters"][0]["timeline"]["last_span_end_s"] = 1e308.into()
            }) as &dyn Fn(&mut serde_json::Value),
            "`drafters[0].timeline.last_span_end_s` is 1e308",
        ),
        (
            &|s: &mut serde_json::Value| s["wall_s"] = 1e308.into(),
            "`wall_s` is 1e308",
        ),
    ] {
        let mut summary = original.clone();
        edit(&mut summary);
        std::fs::write(&path, serde_json::to_string(&summary).unwrap()).unwrap();
        for command in ["diagnose", "simulate"] {
            let mut args = vec![command];
            let pipe = dir.join("tiny.pipe");
            if command == "simulate" {
                args.extend([pipe.to_str().unwrap(), "--from"]);
            }
            args.push(run_dir.to_str().unwrap());
            let out = draftpipe_within(&args, LIMIT);
            assert_refused(&out, &[field, "holds values no run writes"]);
        }
    }
}
