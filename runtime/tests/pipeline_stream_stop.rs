//! A stream run stops when asked, whatever its producers do: drafters parked on a queue below `min_ready`
//! (no producer connected, or one gone quiet) wake at the interrupt, and a producer in the middle of a message
//! is told the message was not queued and dropped, instead of holding the run until its read timeout.

mod source_support;
mod stream_support;

use std::io::{Write, sink};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use draftpipe_compiler::compile_source;
use draftpipe_compiler::plan::Plan;
use draftpipe_runtime::checkpoint::load_checkpoint;
use draftpipe_runtime::pipeline::{RunOptions, RunOutcome, StopReason, run};

use source_support::temp_dir;
use stream_support::{Client, batch, blob};

const HIDDEN: usize = 8;
const TAPS: usize = 2;
const VOCAB: usize = 64;

/// One producer slot, a read timeout far longer than any test waits, and a watermark of 2 so one message
/// leaves the drafter waiting.
fn plan(socket: &Path) -> Plan {
    let text = format!(
        r#"pipeline "stream-stop"

target live on cpu x1 {{
    hidden       = {HIDDEN}
    tap_layers   = [0, 1]
    vocab        = {VOCAB}
    batch_tokens = 64
    source       = stream(listen = "unix:{}", read_timeout = 120s)
}}

queue hs from live to draft {{
    capacity  = 4
    min_ready = 2
    buckets   = [16, 32]
    pull      = fifo
}}

drafter draft on cpu {{
    model     = mlp(hidden = 16, blocks = 1, intermediate = 32, heads = 2)
    loss      = cross_entropy(head_decay = 0.8)
    optimizer = adamw(lr = 1e-3)
}}

telemetry {{ every = 1s }}
"#,
        socket.display()
    );
    compile_source("stream-stop.pipe", &text).expect("the test plan compiles")
}

fn connect(socket: &Path) -> Client {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !socket.exists() {
        assert!(Instant::now() < deadline, "the run never listened");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut client = Client::connect(&format!("unix:{}", socket.display()));
    let reply = client.hello(&Client::hello_for(HIDDEN, TAPS, VOCAB, "", "p0"));
    assert!(reply.ok, "{reply:?}");
    client
}

/// Runs the plan, raising the interrupt once the producer `feed` has done its part and the run's status log
/// shows step `min_step`; returns the outcome, the seconds from the interrupt to the run's return, and what
/// `feed` returned. A run that does not stop within 20 s fails the test (the run's thread is left behind rather
/// than waited for).
fn interrupted_run<T>(
    dir: &Path,
    min_step: u64,
    feed: impl FnOnce(&Path) -> T,
) -> (RunOutcome, f64, T) {
    let socket = dir.join("hs.sock");
    let plan = plan(&socket);
    let mut options = RunOptions::for_plan(&plan);
    options.save_dir = Some(dir.join("ckpt"));
    options.run_dir = Some(dir.join("run"));
    let interrupt = Arc::new(AtomicBool::new(false));
    let (done, outcome) = mpsc::channel();
    let flag = Arc::clone(&interrupt);
    std::thread::spawn(move || {
        // The receiver is gone only when the test has already failed.
        let _ = done.send(run(&plan, &options, flag, sink()));
    });
    let fed = feed(&socket);
    wait_for_status_step(&dir.join("run"), min_step);
    interrupt.store(true, Ordering::Release);
    let raised = Instant::now();
    let outcome = outcome
        .recv_timeout(Duration::from_secs(20))
        .expect("the run did not stop within 20 s of the interrupt")
        .expect("an interrupted run succeeds");
    (outcome, raised.elapsed().as_secs_f64(), fed)
}

/// Waits until the run's `status.jsonl` has a line at `min_step` or later: the run is up (its first line comes a
/// second in), and its drafters have trained that many steps or, at step 0, are waiting for data.
fn wait_for_status_step(run_dir: &Path, min_step: u64) {
    let path = run_dir.join("status.jsonl");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let log = std::fs::read_to_string(&path).unwrap_or_default();
        // A line still being written does not parse, and is read again on the next look.
        let reached = log
            .lines()
            .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
            .any(|line| line["step"].as_u64().is_some_and(|step| step >= min_step));
        if reached {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{} shows no step {min_step} within 30 s:\n{log}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn an_interrupt_wakes_drafters_waiting_for_producers_that_never_came() {
    let dir = temp_dir("stream-stop-idle");
    let (outcome, seconds, ()) = interrupted_run(&dir, 0, |socket| {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !socket.exists() {
            assert!(Instant::now() < deadline, "the run never listened");
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    assert_eq!(outcome.stop, StopReason::Interrupted);
    assert_eq!(outcome.step, 0);
    assert!(seconds < 2.0, "the run took {seconds:.1} s to stop");
    assert!(dir.join("run/summary.json").exists());
}

#[test]
fn an_interrupt_saves_and_drops_a_producer_in_the_middle_of_a_message() {
    let dir = temp_dir("stream-stop-mid-message");
    let (outcome, seconds, mut client) = interrupted_run(&dir, 1, |socket| {
        let mut client = connect(socket);
        // Each message fills one queue item (4 sequences of bucket 16 at batch_tokens 64): a message of
        // fewer rows would only be held in the slot's open item.
        for salt in 0..2 {
            let ack = client.send(&batch(4, 16, HIDDEN * TAPS, VOCAB, &[16; 4], salt));
            assert!(ack.ok, "{ack:?}");
        }
        // The length of a third message and half of it, then nothing: the producer is stuck inside a frame.
        let third = blob(&batch(1, 16, HIDDEN * TAPS, VOCAB, &[16], 7));
        let stream = &mut client.stream;
        stream
            .write_all(&(third.len() as u64).to_le_bytes())
            .unwrap();
        stream.write_all(&third[..third.len() / 2]).unwrap();
        client
    });
    assert_eq!(outcome.stop, StopReason::Interrupted);
    assert!(seconds < 2.0, "the run took {seconds:.1} s to stop");
    // Two messages were acknowledged, the watermark let one train before the interrupt, and the other
    // waits below it: the checkpoint holds what was trained.
    let plan = plan(&dir.join("hs.sock"));
    let checkpoint = load_checkpoint(&dir.join("ckpt"), &plan.model).unwrap();
    assert_eq!(checkpoint.state.step, outcome.step);
    assert!(outcome.step >= 1);
    let reply = client.reply();
    assert!(!reply.ok);
    assert!(
        reply.ended,
        "the producer is told the run ends, not that it failed"
    );
    let error = reply.error.unwrap_or_default();
    assert!(
        error.contains("the run is stopping") && error.contains("not queued"),
        "{error}"
    );
}
