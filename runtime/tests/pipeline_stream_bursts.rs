//! A stream whose producer delivers in bursts, through the whole pipeline: it sends for a second as fast as the
//! run takes its messages (the queue fills and its push blocks: the drafter's step, some milliseconds, is the
//! slower side), then sends nothing for a second (the queue drains and the drafter waits). The run's diagnosis
//! names it bursty (issue 20), by the rule `simulate` uses.

mod source_support;
mod stream_support;

use std::io::sink;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use draftpipe_compiler::compile_source;
use draftpipe_runtime::pipeline::{RunOptions, StopReason, run};
use draftpipe_runtime::telemetry::{Bottleneck, Diagnosis, load_summary};

use source_support::temp_dir;
use stream_support::{Client, batch};

const HIDDEN: usize = 8;
const TAPS: usize = 2;
const VOCAB: usize = 64;
/// Bursts and the silences between them.
const BURSTS: usize = 3;
const BURST: Duration = Duration::from_millis(1000);

#[test]
fn a_producer_sending_in_bursts_is_diagnosed_bursty() {
    let dir = temp_dir("pipeline-stream-bursts");
    let socket = dir.join("hs.sock");
    let text = format!(
        r#"pipeline "stream-bursts"

target live on cpu {{
    hidden       = {HIDDEN}
    tap_layers   = [0, 1]
    vocab        = {VOCAB}
    batch_tokens = 128
    source       = stream(listen = "unix:{}", read_timeout = 5s)
}}

queue hs from live to draft {{
    capacity  = 2
    min_ready = 1
    buckets   = [32]
    pull      = fifo
}}

drafter draft on cpu {{
    model     = mlp(hidden = 256, blocks = 1, intermediate = 512, heads = 2)
    loss      = cross_entropy(head_decay = 0.8)
    optimizer = adamw(lr = 1e-3)
}}

telemetry {{ every = 1s }}
"#,
        socket.display()
    );
    let plan = compile_source("stream-bursts.pipe", &text).expect("the test plan compiles");
    let mut options = RunOptions::for_plan(&plan);
    options.run_dir = Some(dir.join("run"));
    let address = format!("unix:{}", socket.display());
    let outcome = std::thread::scope(|scope| {
        let run = scope.spawn(|| run(&plan, &options, Arc::new(AtomicBool::new(false)), sink()));
        let deadline = Instant::now() + Duration::from_secs(30);
        while !Path::new(&socket).exists() {
            assert!(Instant::now() < deadline, "the run never listened");
            std::thread::sleep(Duration::from_millis(20));
        }
        let mut client = Client::connect(&address);
        assert!(
            client
                .hello(&Client::hello_for(HIDDEN, TAPS, VOCAB, "", "bursty"))
                .ok
        );
        let mut seed = 0;
        for _ in 0..BURSTS {
            // One full item per message (4 sequences of 32 tokens): as many as the run takes in a second.
            let burst = Instant::now();
            while burst.elapsed() < BURST {
                let ack = client.send(&batch(4, 32, HIDDEN * TAPS, VOCAB, &[32; 4], seed));
                assert!(ack.ok, "{ack:?}");
                seed += 1;
            }
            std::thread::sleep(BURST);
        }
        assert!(client.done().done);
        run.join().unwrap()
    });
    assert_eq!(
        outcome.expect("the run succeeds").stop,
        StopReason::SourcesExhausted
    );
    let diagnosis = Diagnosis::from_summary(&load_summary(&dir.join("run")).unwrap());
    assert_eq!(diagnosis.bottleneck, Bottleneck::Bursty, "{diagnosis}");
}
