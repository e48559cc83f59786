//! The whole pipeline on a stream source, with five producers connected over a unix socket: one vanishes in the
//! middle of a message and comes back under its name; the run ends when every producer has said it is done,
//! every acknowledged batch is trained on (steps = batches acknowledged), and the checkpoint's data positions
//! say how many batches each producer delivered.

mod source_support;
mod stream_support;

use std::io::sink;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use draftpipe_compiler::compile_source;
use draftpipe_compiler::plan::Plan;
use draftpipe_runtime::checkpoint::load_checkpoint;
use draftpipe_runtime::pipeline::{RunOptions, StopReason, run};

use source_support::temp_dir;
use stream_support::{Client, batch, blob};

const PRODUCERS: usize = 5;
const MESSAGES: usize = 4;
const HIDDEN: usize = 8;
const TAPS: usize = 2;
const VOCAB: usize = 64;

fn plan(socket: &Path) -> Plan {
    let text = format!(
        r#"pipeline "stream-five"

target live on cpu x{PRODUCERS} {{
    hidden       = {HIDDEN}
    tap_layers   = [0, 1]
    vocab        = {VOCAB}
    batch_tokens = 64
    source       = stream(listen = "unix:{}", read_timeout = 2s)
}}

queue hs from live to draft {{
    capacity  = 2
    min_ready = 1
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
    compile_source("stream-five.pipe", &text).expect("the test plan compiles")
}

/// Connects, retrying while the run is still binding its socket.
fn connect(address: &str, name: &str) -> Client {
    let deadline = Instant::now() + Duration::from_secs(30);
    let path = address.strip_prefix("unix:").unwrap();
    while !Path::new(path).exists() {
        assert!(
            Instant::now() < deadline,
            "the run never listened on {address}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut client = Client::connect(address);
    let reply = client.hello(&Client::hello_for(HIDDEN, TAPS, VOCAB, "", name));
    assert!(reply.ok, "{name}: {reply:?}");
    client
}

/// Sends `MESSAGES` messages and `done`; returns the batches acknowledged. Producer 2 first sends half a
/// message and vanishes, then reconnects under its name and sends everything.
fn producer(address: &str, index: usize) -> u64 {
    let name = format!("p{index}");
    let mut client = connect(address, &name);
    if index == 2 {
        let ack = client.send(&batch(4, 16, HIDDEN * TAPS, VOCAB, &[16, 9, 30, 5], 99));
        assert!(ack.ok, "{ack:?}");
        let half = blob(&batch(4, 16, HIDDEN * TAPS, VOCAB, &[16; 4], 98));
        client.frame(&half[..half.len() / 2]).unwrap();
        drop(client);
        std::thread::sleep(Duration::from_millis(200));
        client = connect(address, &name);
        return ack.batches.unwrap() + send_all(&mut client, index);
    }
    send_all(&mut client, index)
}

fn send_all(client: &mut Client, index: usize) -> u64 {
    let mut acknowledged = 0;
    for m in 0..MESSAGES {
        let lens = [16, 3 + m, 20 + index, 32 - m];
        let ack = client.send(&batch(
            4,
            32,
            HIDDEN * TAPS,
            VOCAB,
            &lens,
            (index * 100 + m) as u64,
        ));
        assert!(ack.ok, "{ack:?}");
        acknowledged += ack.batches.unwrap();
    }
    assert!(client.done().done);
    acknowledged
}

#[test]
fn five_producers_one_reconnecting_train_on_every_acknowledged_batch() {
    let dir = temp_dir("pipeline-stream");
    let socket = dir.join("hs.sock");
    let plan = plan(&socket);
    let address = format!("unix:{}", socket.display());
    let mut options = RunOptions::for_plan(&plan);
    options.save_dir = Some(dir.join("ckpt"));
    options.run_dir = Some(dir.join("run"));
    let (outcome, acked) = std::thread::scope(|scope| {
        let run = scope.spawn(|| run(&plan, &options, Arc::new(AtomicBool::new(false)), sink()));
        let producers: Vec<_> = (0..PRODUCERS)
            .map(|index| {
                let address = address.clone();
                scope.spawn(move || producer(&address, index))
            })
            .collect();
        let acked: Vec<u64> = producers.into_iter().map(|p| p.join().unwrap()).collect();
        (run.join().unwrap(), acked)
    });
    let outcome = outcome.expect("the run succeeds");
    assert_eq!(outcome.stop, StopReason::SourcesExhausted);
    let total: u64 = acked.iter().sum();
    assert_eq!(
        outcome.step, total,
        "steps trained vs batches acknowledged {acked:?}"
    );
    let checkpoint = load_checkpoint(&dir.join("ckpt"), &plan.model).unwrap();
    let expected: Vec<u64> = acked
        .iter()
        .enumerate()
        .map(|(slot, &batches)| slot as u64 + PRODUCERS as u64 * batches)
        .collect();
    // Slots are assigned in connection order, so compare the multisets of per-slot counts.
    let mut delivered: Vec<u64> = checkpoint
        .state
        .data_positions
        .iter()
        .enumerate()
        .map(|(slot, &p)| (p - slot as u64) / PRODUCERS as u64)
        .collect();
    let mut want: Vec<u64> = expected
        .iter()
        .enumerate()
        .map(|(slot, &p)| (p - slot as u64) / PRODUCERS as u64)
        .collect();
    delivered.sort_unstable();
    want.sort_unstable();
    assert_eq!(delivered, want);
    assert!(!socket.exists(), "the socket file is removed at the end");
}
