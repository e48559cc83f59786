//! Loopback throughput of the stream source: bf16 hidden states from a producer socket into bf16 pooled batches
//! (checked, bucketed, acknowledged), against a plain TCP copy of the same bytes in the same run; and FP8 E4M3
//! hidden states with their per-token scales into fp8 pooled batches beside them, in tokens per second.
//!
//! ```text
//! cargo bench -p draftpipe-runtime --bench stream -- [ROUNDS]
//! ```
//!
//! Each round runs four transfers of 16 messages, one after the other so machine load hits them alike: a plain
//! TCP copy (frames read into a reused buffer in 1 MiB reads, nothing else), the stream with `hidden_states`
//! last in each blob (the Python client's layout: received straight into the batch), the stream with the
//! reference writer's layout (`hidden_states` before `loss_mask`: buffered, then copied), and the same tokens
//! as FP8 (`hidden_states_scale` then the `F8_E4M3` codes last, as the Python client sends them: received
//! straight into the batch, the scales copied from the part read first).
//! Every transfer is timed at the sender, from its first byte to the receiver's answer after the last message,
//! and the stream's producer waits for each acknowledgement before it sends the next message, as a real
//! producer does. The medians, their ratios and the median of the per-round ratios are printed.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use draftpipe_compiler::plan::{Device, HsDtype, Placement, SourceSpec, TargetStage};
use draftpipe_runtime::fp8::quantise_row;
use draftpipe_runtime::source::stream::wire::{Hello, PROTOCOL_VERSION};
use draftpipe_runtime::source::{BatchPool, BucketShapes, Producer, StreamConfig, open_stream};

const HIDDEN: usize = 1024;
const TAPS: usize = 4;
const DIN: usize = HIDDEN * TAPS;
const SEQ: usize = 1024;
const ROWS: usize = 2;
const VOCAB: usize = 32_000;
const MESSAGES: usize = 16;
/// The safetensors header's length in both layouts.
const HEADER_BYTES: usize = 512;

/// The hidden states the messages carry, in f32.
fn values() -> Vec<f32> {
    (0..ROWS * SEQ * DIN)
        .map(|i| (i % 251) as f32 / 64.0 - 2.0)
        .collect()
}

/// One message's safetensors blob of bf16 hidden states, its tensors' data in the order given
/// (`hidden_states` last or not).
fn message(hidden_last: bool) -> Vec<u8> {
    let hs: Vec<u8> = values()
        .iter()
        .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
        .collect();
    let ids: Vec<u8> = (0..ROWS * SEQ)
        .flat_map(|i| ((i * 7 % VOCAB) as i64).to_le_bytes())
        .collect();
    let mask = vec![1u8; ROWS * SEQ];
    let hidden = ("hidden_states", "BF16", vec![ROWS, SEQ, DIN], &hs);
    let input_ids = ("input_ids", "I64", vec![ROWS, SEQ], &ids);
    let loss_mask = ("loss_mask", "U8", vec![ROWS, SEQ], &mask);
    let tensors = if hidden_last {
        vec![input_ids, loss_mask, hidden]
    } else {
        vec![input_ids, hidden, loss_mask]
    };
    blob(&tensors)
}

/// One message's blob of FP8 hidden states: ids, mask, the per-token scales, then the codes.
fn fp8_message() -> Vec<u8> {
    let mut codes = vec![0u8; ROWS * SEQ * DIN];
    let scales: Vec<u8> = values()
        .chunks(DIN)
        .zip(codes.chunks_mut(DIN))
        .flat_map(|(row, codes)| quantise_row(row, codes).to_le_bytes())
        .collect();
    let ids: Vec<u8> = (0..ROWS * SEQ)
        .flat_map(|i| ((i * 7 % VOCAB) as i64).to_le_bytes())
        .collect();
    let mask = vec![1u8; ROWS * SEQ];
    blob(&[
        ("input_ids", "I64", vec![ROWS, SEQ], &ids),
        ("loss_mask", "U8", vec![ROWS, SEQ], &mask),
        ("hidden_states_scale", "F32", vec![ROWS, SEQ], &scales),
        ("hidden_states", "F8_E4M3", vec![ROWS, SEQ, DIN], &codes),
    ])
}

/// A safetensors blob of `(name, dtype, shape, data)`, in that order, its header padded to `HEADER_BYTES`.
fn blob(tensors: &[(&str, &str, Vec<usize>, &Vec<u8>)]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut offset = 0;
    for (name, dtype, shape, data) in tensors {
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + data.len()]}),
        );
        offset += data.len();
    }
    let mut header = serde_json::to_vec(&header).expect("json");
    // Both layouts padded alike, so the two blobs have the same length.
    assert!(header.len() <= HEADER_BYTES);
    header.resize(HEADER_BYTES, b' ');
    let mut blob = (header.len() as u64).to_le_bytes().to_vec();
    blob.extend_from_slice(&header);
    for (_, _, _, data) in tensors {
        blob.extend_from_slice(data);
    }
    blob
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

/// Seconds to move `MESSAGES` frames of `body` over loopback TCP into a reused buffer, nothing else: from the
/// sender's first byte to the receiver's one-byte answer after the last frame.
fn plain_copy(body: &[u8]) -> f64 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let address = listener.local_addr().expect("address");
    std::thread::scope(|scope| {
        scope.spawn(move || {
            let (mut stream, _) = listener.accept().expect("accept");
            stream.set_nodelay(true).expect("nodelay");
            let mut buf = Vec::new();
            for _ in 0..MESSAGES {
                let mut len = [0u8; 8];
                stream.read_exact(&mut len).expect("read");
                let len = u64::from_le_bytes(len) as usize;
                buf.resize(len.max(buf.len()), 0);
                // In 1 MiB reads, as the stream reads rows: measured faster than one 16 MiB read (4.35 against
                // 4.0–4.2 GB/s), so the baseline is the stronger of the two.
                for piece in buf[..len].chunks_mut(1 << 20) {
                    stream.read_exact(piece).expect("read");
                }
            }
            stream.write_all(&[1]).expect("answer");
        });
        let mut stream = TcpStream::connect(address).expect("connect");
        stream.set_nodelay(true).expect("nodelay");
        let start = Instant::now();
        for _ in 0..MESSAGES {
            frame(&mut stream, body);
        }
        stream.read_exact(&mut [0u8]).expect("answer");
        start.elapsed().as_secs_f64()
    })
}

fn target(hs_dtype: HsDtype) -> TargetStage {
    TargetStage {
        name: "bench".into(),
        placement: Placement {
            workers: vec![Device::Cpu],
        },
        hidden: HIDDEN,
        layers: None,
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
        hs_dtype: Some(hs_dtype),
        masks: Default::default(),
    }
}

/// Seconds from the first byte sent to the last acknowledgement: `MESSAGES` messages through the stream source
/// into pooled batches, each acknowledged once its batch was taken.
fn stream_into_pool(body: &[u8], hs_dtype: HsDtype) -> f64 {
    let shapes = BucketShapes {
        buckets: vec![(SEQ, ROWS)],
        din: DIN,
        hs_dtype,
        last_hidden: None,
    };
    let (sources, status) = open_stream(StreamConfig {
        listen: "127.0.0.1:0".into(),
        token: None,
        max_message_bytes: 1 << 30,
        read_timeout: Duration::from_secs(30),
        target: target(hs_dtype),
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
        .unwrap_or(9);
    let (direct, buffered, fp8) = (message(true), message(false), fp8_message());
    assert_eq!(direct.len(), buffered.len());
    let bytes = (direct.len() * MESSAGES) as f64;
    let tokens = (ROWS * SEQ * MESSAGES) as f64;
    let (mut plain, mut streamed, mut copied, mut fp8_tokens) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut direct_ratios, mut buffered_ratios, mut fp8_ratios) =
        (Vec::new(), Vec::new(), Vec::new());
    for round in 0..rounds {
        let p = bytes / plain_copy(&direct) / 1e9;
        let s = bytes / stream_into_pool(&direct, HsDtype::Bf16) / 1e9;
        let c = bytes / stream_into_pool(&buffered, HsDtype::Bf16) / 1e9;
        // Tokens per second: the FP8 messages carry the same tokens in fewer bytes.
        let f = tokens / stream_into_pool(&fp8, HsDtype::Fp8E4m3) / 1e6;
        let bf16_tokens = s * 1e9 / (direct.len() as f64 / (ROWS * SEQ) as f64) / 1e6;
        println!(
            "round {round}: plain TCP copy {p:.2} GB/s | stream, hidden_states last {s:.2} GB/s ({:.0}%) | \
             hidden_states not last {c:.2} GB/s ({:.0}%) | fp8 {f:.2} M tokens/s = {:.2}× bf16's {bf16_tokens:.2}",
            100.0 * s / p,
            100.0 * c / p,
            f / bf16_tokens
        );
        direct_ratios.push(s / p);
        buffered_ratios.push(c / p);
        fp8_ratios.push(f / bf16_tokens);
        plain.push(p);
        streamed.push(s);
        copied.push(c);
        fp8_tokens.push(f);
    }
    let (p, s, c, f) = (
        median(&mut plain),
        median(&mut streamed),
        median(&mut copied),
        median(&mut fp8_tokens),
    );
    let per_token = |blob: &[u8]| blob.len() as f64 / (ROWS * SEQ) as f64;
    println!(
        "stream, {MESSAGES} messages of {:.1} MiB (bf16 hidden {HIDDEN}×{TAPS}, {ROWS}×{SEQ} tokens), medians of {rounds} rounds:",
        direct.len() as f64 / (1 << 20) as f64
    );
    println!(
        "  plain TCP copy {p:.2} GB/s | stream into the pool, hidden_states last {s:.2} GB/s = {:.0}% | \
         hidden_states not last (buffered) {c:.2} GB/s = {:.0}%",
        100.0 * s / p,
        100.0 * c / p
    );
    println!(
        "  median of the per-round ratios: hidden_states last {:.0}% | buffered {:.0}%",
        100.0 * median(&mut direct_ratios),
        100.0 * median(&mut buffered_ratios)
    );
    println!(
        "  bytes per token on the wire (message ÷ tokens): bf16 {:.1}, fp8 {:.1} ({DIN} codes + a 4-byte scale + \
         ids and mask) = {:.3}× | tokens/s: bf16 {:.2} M, fp8 {f:.2} M; median of the per-round fp8 ÷ bf16 \
         ratios {:.2}×",
        per_token(&direct),
        per_token(&fp8),
        per_token(&fp8) / per_token(&direct),
        s * 1e9 / per_token(&direct) / 1e6,
        median(&mut fp8_ratios)
    );
}
