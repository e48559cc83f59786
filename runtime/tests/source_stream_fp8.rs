//! FP8 hidden states over the stream: `F8_E4M3` `hidden_states` with their `hidden_states_scale` into an fp8
//! server, on the direct path (scales first, codes last: read into the batch) and the buffered one; bf16
//! messages into an fp8 server quantised per token; FP8 messages into a bf16 server dequantised; and a missing,
//! misshapen or non-finite scale refused naming the peer, the message's tensor and the token, after which the
//! server still serves a good producer.

mod source_support;
mod stream_support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use draftpipe_compiler::plan::{HsDtype, SourceSpec};
use draftpipe_runtime::batch::{HsBatch, HsData};
use draftpipe_runtime::fp8::{Fp8Rows, decode, quantise_row};
use draftpipe_runtime::source::{
    BatchPool, BucketShapes, Producer, StreamConfig, StreamStatus, open_stream,
};
use stream_support::Client;

const HIDDEN: usize = 4;
const TAPS: usize = 2;
const DIN: usize = HIDDEN * TAPS;
const VOCAB: usize = 50;
/// Four rows of eight tokens: one full item of the 8-token bucket (so the direct path may take it).
const ROWS: usize = 4;
const SEQ: usize = 8;

/// A one-slot server holding hidden states in `hs_dtype`, its status and pool.
fn server(hs_dtype: HsDtype) -> (Producer, StreamStatus, BatchPool) {
    let spec = SourceSpec::Stream {
        listen: "127.0.0.1:0".into(),
        token_env: None,
        max_message_bytes: 1 << 20,
        read_timeout_ms: 300,
    };
    let mut plan = source_support::plan(spec, VOCAB, HIDDEN, TAPS, &[8, 16], 32, 1);
    plan.target.hs_dtype = Some(hs_dtype);
    let shapes = BucketShapes::from_plan(&plan);
    let (sources, status) = open_stream(StreamConfig {
        listen: "127.0.0.1:0".into(),
        token: None,
        max_message_bytes: 1 << 20,
        read_timeout: Duration::from_millis(300),
        target: plan.target.clone(),
        shapes: shapes.clone(),
        producers: 1,
        log: std::sync::Arc::new(|_: &str| {}),
    })
    .unwrap();
    let producer = Producer::new(Box::new(sources.into_iter().next().unwrap()));
    (producer, status, BatchPool::new(shapes, 4).unwrap())
}

/// Hidden-state values of a message, with a zero token (its scale is 1) and a spread of magnitudes.
fn values() -> Vec<f32> {
    (0..ROWS * SEQ * DIN)
        .map(|i| {
            let token = i / DIN;
            if token == 5 {
                0.0
            } else {
                ((i * 37 % 101) as f32 - 50.0) * (1 + token % 4) as f32 / 8.0
            }
        })
        .collect()
}

/// A raw safetensors blob of `(name, dtype, shape, bytes)` in the order given.
fn blob(tensors: &[(&str, &str, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut offset = 0;
    for (name, dtype, shape, data) in tensors {
        let entry = serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + data.len()]});
        header.insert(name.to_string(), entry);
        offset += data.len();
    }
    let mut header = serde_json::to_vec(&header).unwrap();
    header.resize(header.len().next_multiple_of(8), b' ');
    let mut blob = (header.len() as u64).to_le_bytes().to_vec();
    blob.extend_from_slice(&header);
    tensors
        .iter()
        .for_each(|(.., data)| blob.extend_from_slice(data));
    blob
}

fn ids() -> Vec<u8> {
    (0..ROWS * SEQ)
        .flat_map(|i| ((i * 3 % VOCAB) as i64).to_le_bytes())
        .collect()
}

/// The codes and the scales' bytes of `values()`, quantised as the Python producer does.
fn quantised() -> (Vec<u8>, Vec<u8>) {
    let mut codes = vec![0u8; ROWS * SEQ * DIN];
    let scales = values()
        .chunks(DIN)
        .zip(codes.chunks_mut(DIN))
        .flat_map(|(row, codes)| quantise_row(row, codes).to_le_bytes())
        .collect();
    (codes, scales)
}

/// An FP8 message: `scale_first` puts ids and scales before the codes (the Python client's order, the direct
/// path), else the codes come first (buffered). `scale` replaces the scale tensor (`None`: leave it out).
fn fp8_message(scale_first: bool, scale: Option<(Vec<usize>, Vec<u8>)>) -> Vec<u8> {
    let (codes, scales) = quantised();
    let scale = scale.map(|(shape, bytes)| ("hidden_states_scale", "F32", shape, bytes));
    let hs = ("hidden_states", "F8_E4M3", vec![ROWS, SEQ, DIN], codes);
    let mut tensors = vec![("input_ids", "I64", vec![ROWS, SEQ], ids())];
    let scale = scale.unwrap_or(("hidden_states_scale", "F32", vec![ROWS, SEQ], scales));
    if scale_first {
        tensors.extend([scale, hs]);
    } else {
        tensors.extend([hs, scale]);
    }
    blob(&tensors)
}

/// Sends `message` from a fresh producer and returns the batch the server queued, or the error it replied.
fn exchange(hs_dtype: HsDtype, message: &[u8]) -> Result<HsBatch, String> {
    let (mut producer, status, pool) = server(hs_dtype);
    let address = status.address().to_string();
    let stop = AtomicBool::new(false);
    let (to_test, batches) = mpsc::channel::<HsBatch>();
    std::thread::scope(|scope| {
        let (stop, pool) = (&stop, &pool);
        scope.spawn(move || {
            while let Ok(Some(batch)) = producer.next_batch(pool, stop) {
                to_test.send((*batch).clone()).unwrap();
                pool.give_back(batch).unwrap();
            }
        });
        let mut client = Client::connect(&address);
        let reply = client.hello(&Client::hello_for(HIDDEN, TAPS, VOCAB, "", "fp8"));
        assert!(reply.ok, "{reply:?}");
        client.frame(message).unwrap();
        let reply = client.reply();
        let peer = client.local_name();
        let outcome = if reply.ok {
            Ok(batches.recv_timeout(Duration::from_secs(10)).unwrap())
        } else {
            let error = reply.error.unwrap_or_default();
            assert!(
                error.contains(&peer),
                "the error names the peer {peer}: {error}"
            );
            Err(error)
        };
        stop.store(true, Ordering::Release);
        outcome
    })
}

#[test]
fn fp8_messages_are_held_as_sent_on_the_direct_and_the_buffered_path() {
    let (codes, scales) = quantised();
    let scales: Vec<f32> = scales
        .chunks(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let mut want = Fp8Rows::zeroed(DIN, ROWS * SEQ * DIN);
    want.parts_mut().0.copy_from_slice(&codes);
    want.parts_mut().1.copy_from_slice(&scales);
    for scale_first in [true, false] {
        let batch = exchange(HsDtype::Fp8E4m3, &fp8_message(scale_first, None)).unwrap();
        assert_eq!(batch.seq_lens, [8; 4]);
        assert_eq!(
            batch.hs,
            HsData::Fp8E4m3(want.clone()),
            "scales first: {scale_first}"
        );
        assert_eq!(want.parts_mut().1[5], 1.0, "the zero token's scale");
    }
}

#[test]
fn bf16_into_an_fp8_server_is_quantised_and_fp8_into_a_bf16_server_dequantised() {
    let values = values();
    let bf16_bytes: Vec<u8> = values
        .iter()
        .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
        .collect();
    let message = blob(&[
        ("input_ids", "I64", vec![ROWS, SEQ], ids()),
        ("hidden_states", "BF16", vec![ROWS, SEQ, DIN], bf16_bytes),
    ]);
    let batch = exchange(HsDtype::Fp8E4m3, &message).unwrap();
    let rounded: Vec<f32> = values
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_f32())
        .collect();
    let mut want = Fp8Rows::zeroed(DIN, rounded.len());
    want.store_f32(0, &rounded);
    assert_eq!(batch.hs, HsData::Fp8E4m3(want));

    let (codes, scales) = quantised();
    let batch = exchange(HsDtype::Bf16, &fp8_message(true, None)).unwrap();
    for (i, &code) in codes.iter().enumerate() {
        let scale =
            f32::from_le_bytes(scales[4 * (i / DIN)..4 * (i / DIN) + 4].try_into().unwrap());
        assert_eq!(
            batch.hs.get(i),
            half::bf16::from_f32(decode(code) * scale).to_f32(),
            "element {i}"
        );
    }
}

#[test]
fn a_missing_misshapen_or_non_finite_scale_is_refused_naming_the_tensor() {
    let ones = |n: usize| {
        (0..n)
            .flat_map(|_| 1.0f32.to_le_bytes())
            .collect::<Vec<u8>>()
    };
    let mut nan = ones(ROWS * SEQ);
    nan[4 * 9..4 * 10].copy_from_slice(&f32::INFINITY.to_le_bytes());
    for scale_first in [true, false] {
        let missing = blob(&[
            ("input_ids", "I64", vec![ROWS, SEQ], ids()),
            (
                "hidden_states",
                "F8_E4M3",
                vec![ROWS, SEQ, DIN],
                quantised().0,
            ),
        ]);
        let error = exchange(HsDtype::Fp8E4m3, &missing).unwrap_err();
        assert!(
            error.contains("hidden_states_scale") && error.contains("missing"),
            "{error}"
        );
        let shape = fp8_message(
            scale_first,
            Some((vec![ROWS, SEQ - 1], ones(ROWS * (SEQ - 1)))),
        );
        let error = exchange(HsDtype::Fp8E4m3, &shape).unwrap_err();
        assert!(
            error.contains("hidden_states_scale") && error.contains("[4, 7]"),
            "{error}"
        );
        let infinite = fp8_message(scale_first, Some((vec![ROWS, SEQ], nan.clone())));
        let error = exchange(HsDtype::Fp8E4m3, &infinite).unwrap_err();
        assert!(
            error.contains("hidden_states_scale") && error.contains("element 9 "),
            "{scale_first}: {error}"
        );
    }
    // A NaN code is the hidden states' NaN, refused with its element.
    let (mut codes, scales) = quantised();
    codes[17] = 0xFF;
    let message = blob(&[
        ("input_ids", "I64", vec![ROWS, SEQ], ids()),
        ("hidden_states_scale", "F32", vec![ROWS, SEQ], scales),
        ("hidden_states", "F8_E4M3", vec![ROWS, SEQ, DIN], codes),
    ]);
    let error = exchange(HsDtype::Fp8E4m3, &message).unwrap_err();
    assert!(
        error.contains("hidden_states") && error.contains("element 17 "),
        "{error}"
    );
}
