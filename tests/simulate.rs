//! `draftpipe simulate` end to end: a prediction, a comparison, and clear errors (exit 1, no panic) for bad
//! what-ifs, missing rates and unreadable runs.

use std::process::{Command, Output};

fn draftpipe(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_draftpipe"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("the binary runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn a_comparison_prints_every_variant_and_the_verdict() {
    let out = draftpipe(&[
        "simulate",
        "pipelines/quickstart.pipe",
        "--producer-rate",
        "50",
        "--step-time",
        "0.8",
        "--compare",
        "--set",
        "queue.capacity=60,queue.min_ready=10",
        "--set",
        "drafter.devices=3",
    ]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    for expected in [
        "── plan",
        "── queue.capacity=60,queue.min_ready=10",
        "── drafter.devices=3",
        "bottleneck: the drafters (consumers)",
        "tokens/s",
        "(+0.0%)",
        "(+50.0%)",
        "A larger queue or more producers will not change throughput",
        "simulated in",
    ] {
        assert!(
            stdout.contains(expected),
            "{expected:?} missing in\n{stdout}"
        );
    }
}

#[test]
fn bad_what_ifs_and_missing_figures_exit_1_with_clear_errors() {
    let out = draftpipe(&[
        "simulate",
        "pipelines/quickstart.pipe",
        "--producer-rate",
        "50",
        "--set",
        "queue.min_ready=30",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert!(stderr.contains("--> --set:1:17"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");

    let out = draftpipe(&["simulate", "pipelines/quickstart.pipe"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("no producer rate"),
        "{}",
        text(&out.stderr)
    );

    let out = draftpipe(&[
        "simulate",
        "pipelines/quickstart.pipe",
        "--from",
        "no/such/run",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("cannot read the run"),
        "{}",
        text(&out.stderr)
    );

    let out = draftpipe(&[
        "simulate",
        "pipelines/quickstart.pipe",
        "--producer-rate=-3",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("--producer-rate"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn out_of_range_inputs_are_refused_as_the_checker_refuses_them() {
    for (args, needle) in [
        (
            &["--set", "queue.capacity=4294967296"][..],
            "at most 1048576",
        ),
        (
            &["--set", "drafter.devices=9223372036854775808"][..],
            "at most 1024",
        ),
        (&["--set", "producer.workers=100000000"][..], "at most 1024"),
        (&["--duration", "NaN"][..], "--duration must be"),
        (&["--duration", "inf"][..], "--duration must be"),
        (&["--duration", "-5"][..], "--duration must be"),
        (&["--producer-rate", "-3"][..], "--producer-rate must be"),
        (&["--step-time", "-1"][..], "--step-time must be"),
    ] {
        let mut all = vec!["simulate", "pipelines/quickstart.pipe"];
        if !args.contains(&"--producer-rate") {
            all.extend(["--producer-rate", "50"]);
        }
        all.extend_from_slice(args);
        let out = draftpipe(&all);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}
