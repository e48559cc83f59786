//! Loopback throughput of the stream source: bf16 hidden states from a producer socket into bf16 pooled batches
//! (checked, bucketed, copied, acknowledged), against a plain TCP copy of the same bytes in the same run.
//!
//! ```text
//! cargo bench -p draftpipe-runtime --bench stream -- [ROUNDS]
//! ```
//!
//! Rounds alternate the two paths so machine load hits both alike; the medians and their ratio are printed.
//! The producer waits for each acknowledgement before sending the next message, as a real producer does.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use draftpipe_compiler::plan::{Device, HsDtype, Placement, SourceSpec, TargetStage};
use draftpipe_runtime::source::stream::wire::{Hello, PROTOCOL_VERSION};
use draftpipe_runtime::source::{BatchPool, BucketShapes, Producer, StreamConfig, open_stream};
use safetensors::Dtype;
use safetensors::tensor::TensorView;

const HIDDEN: usize = 1024;
const TAPS: usize = 4;
const DIN: usize = HIDDEN * TAPS;
const SEQ: usize = 1024;
const ROWS: usize = 2;
const VOCAB: usize = 32_000;
const MESSAGES: usize = 16;

fn message() -> Vec<u8> {
    let hs: Vec<u8> = (0..ROWS * SEQ * DIN)
        .flat_map(|i| half::bf16::from_f32((i % 251) as f32 / 64.0 - 2.0).to_le_bytes())
        .collect();
    let ids: Vec<u8> = (0..ROWS * SEQ)
        .flat_map(|i| ((i * 7 % VOCAB) as i64).to_le_bytes())
        .collect();
    let mask = vec![1u8; ROWS * SEQ];
    let views = vec![
        (
            "hidden_states".to_string(),
            TensorView::new(Dtype::BF16, vec![ROWS, SEQ, DIN], &hs).expect("view"),
        ),
        (
            "input_ids".to_string(),
            TensorView::new(Dtype::I64, vec![ROWS, SEQ], &ids).expect("view"),
        ),
        (
            "loss_mask".to_string(),
            TensorView::new(Dtype::U8, vec![ROWS, SEQ], &mask).expect("view"),
        ),
    ];
    safetensors::serialize(views, None).expect("serialize")
}

fn frame(stream: &mut TcpStream, body: &[u8]) {
    stream
        .write_all(&(body.len() as u64).to_le_bytes())
        .expect("write");
    stream.write_all(body).expect("write");
}

fn read_frame(stream: &mut TcpStream, buf: &mut Vec<u8>) -> usize {
    let mut len = [0u8; 8];
    stream.read_exact(&mut len).expect("read");
    let len = u64::from_le_bytes(len) as usize;
    buf.resize(len.max(buf.len()), 0);
    stream.read_exact(&mut buf[..len]).expect("read");
    len
}

/// Seconds to move `MESSAGES` frames of `body` over loopback TCP into a reused buffer, nothing else.
fn plain_copy(body: &[u8]) -> f64 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let address = listener.local_addr().expect("address");
    std::thread::scope(|scope| {
        let receiver = scope.spawn(move || {
            let (mut stream, _) = listener.accept().expect("accept");
            let mut buf = Vec::new();
            let start = Instant::now();
            for _ in 0..MESSAGES {
                read_frame(&mut stream, &mut buf);
            }
            start.elapsed().as_secs_f64()
        });
        let mut stream = TcpStream::connect(address).expect("connect");
        stream.set_nodelay(true).expect("nodelay");
        for _ in 0..MESSAGES {
            frame(&mut stream, body);
        }
        receiver.join().expect("receiver")
    })
}

fn target() -> TargetStage {
    TargetStage {
        name: "bench".into(),
        placement: Placement {
            workers: vec![Device::Cpu],
        },
        hidden: HIDDEN,
        tap_layers: (0..TAPS as u32).collect(),
        vocab: VOCAB,
        batch_tokens: ROWS * SEQ,
        source: SourceSpec::Stream {
            listen: "127.0.0.1:0".into(),
            token_env: None,
            max_message_bytes: 1 << 30,
            read_timeout_ms: 30_000,
        },
        max_rate: None,
        weights: None,
        hs_dtype: Some(HsDtype::Bf16),
    }
}

/// Seconds from the first byte sent to the last acknowledgement: `MESSAGES` messages through the stream source
/// into pooled batches, each acknowledged once its batch was taken.
fn stream_into_pool(body: &[u8]) -> f64 {
    let shapes = BucketShapes {
        buckets: vec![(SEQ, ROWS)],
        din: DIN,
        hs_dtype: HsDtype::Bf16,
    };
    let (sources, status) = open_stream(StreamConfig {
        listen: "127.0.0.1:0".into(),
        token: None,
        max_message_bytes: 1 << 30,
        read_timeout: Duration::from_secs(30),
        target: target(),
        shapes: shapes.clone(),
        producers: 1,
        log: Arc::new(|_: &str| {}),
    })
    .expect("listen");
    let pool = BatchPool::new(shapes, 4).expect("pool");
    let stop = AtomicBool::new(false);
    let taken = Mutex::new(0usize);
    std::thread::scope(|scope| {
        let mut producer = Producer::new(Box::new(sources.into_iter().next().expect("one slot")));
        let (pool, stop, taken) = (&pool, &stop, &taken);
        scope.spawn(move || {
            while let Some(batch) = producer.next_batch(pool, stop).expect("batch") {
                *taken.lock().expect("count") += 1;
                pool.give_back(batch).expect("pool");
            }
        });
        let mut stream = TcpStream::connect(status.address()).expect("connect");
        stream.set_nodelay(true).expect("nodelay");
        let hello = Hello {
            protocol: PROTOCOL_VERSION,
            hidden: HIDDEN,
            tap_layers: (0..TAPS as u32).collect(),
            vocab: VOCAB,
            token: String::new(),
            producer: Some("bench".into()),
        };
        frame(&mut stream, &serde_json::to_vec(&hello).expect("json"));
        let mut reply = Vec::new();
        read_frame(&mut stream, &mut reply);
        let start = Instant::now();
        for _ in 0..MESSAGES {
            frame(&mut stream, body);
            read_frame(&mut stream, &mut reply);
        }
        let elapsed = start.elapsed().as_secs_f64();
        frame(&mut stream, &[]);
        read_frame(&mut stream, &mut reply);
        elapsed
    })
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() {
    // `cargo bench` passes `--bench`; a number among the arguments sets the rounds.
    let rounds = std::env::args()
        .skip(1)
        .find_map(|a| a.parse::<usize>().ok())
        .unwrap_or(5);
    let body = message();
    let bytes = (body.len() * MESSAGES) as f64;
    let (mut plain, mut streamed) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        let p = bytes / plain_copy(&body) / 1e9;
        let s = bytes / stream_into_pool(&body) / 1e9;
        println!("round {round}: plain TCP copy {p:.2} GB/s, stream into the pool {s:.2} GB/s");
        plain.push(p);
        streamed.push(s);
    }
    let (p, s) = (median(&mut plain), median(&mut streamed));
    println!(
        "stream, {MESSAGES} messages of {:.1} MiB (bf16 hidden {HIDDEN}×{TAPS}, {ROWS}×{SEQ} tokens), medians of {rounds} rounds:",
        body.len() as f64 / (1 << 20) as f64
    );
    println!(
        "  plain TCP copy {p:.2} GB/s | stream into the pool {s:.2} GB/s | ratio {:.0}%",
        100.0 * s / p
    );
}
