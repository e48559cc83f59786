//! The stream source over real loopback sockets, with a Rust producer: batches arrive as sent, the
//! acknowledgement waits for the queue, and every kind of bad input is refused with a clear error on both sides
//! while the source goes on serving the next producer.

mod source_support;
mod stream_support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use draftpipe_compiler::plan::{HsDtype, SourceSpec};
use draftpipe_runtime::batch::HsBatch;
use draftpipe_runtime::source::stream::wire::{Hello, PROTOCOL_VERSION};
use draftpipe_runtime::source::{
    BatchPool, BucketShapes, Producer, StreamConfig, StreamStatus, open_stream,
};
use safetensors::Dtype;

use source_support::plan;
use stream_support::{Client, LAYOUTS, Layout, Tensors, batch, blob, blob_in};

const HIDDEN: usize = 4;
const TAPS: usize = 2;
const DIN: usize = HIDDEN * TAPS;
const VOCAB: usize = 50;

/// A listener on a free loopback port with `producers` slots; its log lines are collected.
fn server(producers: usize, token: Option<&str>, max_message_bytes: u64) -> Server {
    server_holding(producers, token, max_message_bytes, None)
}

/// The sources, the status, the pool and the log of a test server.
type Server = (
    Vec<Producer>,
    StreamStatus,
    BatchPool,
    Arc<Mutex<Vec<String>>>,
);

/// [`server`] whose batches hold hidden states in `hs_dtype` (`None`: as the plan's default decides).
fn server_holding(
    producers: usize,
    token: Option<&str>,
    max_message_bytes: u64,
    hs_dtype: Option<HsDtype>,
) -> Server {
    let mut plan = plan(
        SourceSpec::Stream {
            listen: "127.0.0.1:0".into(),
            token_env: None,
            max_message_bytes,
            read_timeout_ms: 300,
        },
        VOCAB,
        HIDDEN,
        TAPS,
        &[8, 16],
        32,
        producers,
    );
    plan.target.hs_dtype = hs_dtype;
    let log = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&log);
    let shapes = BucketShapes::from_plan(&plan);
    let (sources, status) = open_stream(StreamConfig {
        listen: "127.0.0.1:0".into(),
        token: token.map(str::to_string),
        max_message_bytes,
        read_timeout: Duration::from_millis(300),
        target: plan.target.clone(),
        shapes: shapes.clone(),
        producers,
        log: Arc::new(move |line: &str| sink.lock().unwrap().push(line.to_string())),
    })
    .unwrap();
    let producers = sources
        .into_iter()
        .map(|s| Producer::new(Box::new(s)))
        .collect();
    (producers, status, BatchPool::new(shapes, 8).unwrap(), log)
}

/// Raises the consumer's stop flag when dropped, so a failed assertion ends the test instead of hanging it.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// Takes every batch `producer` makes until it ends or `stop` is raised, showing each to `seen` before its
/// buffer goes back to the pool: the consumer side of a test server.
fn consume(
    mut producer: Producer,
    pool: &BatchPool,
    stop: &AtomicBool,
    mut seen: impl FnMut(&HsBatch),
) {
    while let Some(batch) = producer.next_batch(pool, stop).unwrap() {
        seen(&batch);
        pool.give_back(batch).unwrap();
    }
}

/// Runs `client_side` while a thread takes `producer`'s batches (stopped if `client_side` panics); the number
/// of batches taken.
fn counted(producer: Producer, pool: &BatchPool, client_side: impl FnOnce()) -> usize {
    let stop = AtomicBool::new(false);
    let mut taken = 0;
    std::thread::scope(|scope| {
        let (stop, taken) = (&stop, &mut taken);
        scope.spawn(move || consume(producer, pool, stop, |_| *taken += 1));
        let _stop_on_panic = StopOnDrop(stop);
        client_side();
    });
    taken
}

/// Waits until the server has noticed that every producer hung up.
fn wait_disconnected(status: &StreamStatus) {
    while status.connected().0 != 0 {
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn hello(token: &str, name: &str) -> Hello {
    Client::hello_for(HIDDEN, TAPS, VOCAB, token, name)
}

fn bf16(v: f64) -> f32 {
    half::bf16::from_f64(v).to_f32()
}

/// Checks that slot `slot` of `got` holds the first `len` tokens of row `row` of `tensors` (seq 16), then padding.
fn assert_slot(got: &HsBatch, slot: usize, tensors: &Tensors, row: usize) {
    let (hs, ids) = (&tensors[0].3, &tensors[1].3);
    let (len, padded) = (got.seq_lens[slot] as usize, got.padded_len);
    for t in 0..padded {
        let at = slot * padded + t;
        let (want_id, want_mask) = if t < len {
            (ids[row * 16 + t] as u32, 1)
        } else {
            (0, 0)
        };
        assert_eq!(
            (got.input_ids[at], got.loss_mask[at]),
            (want_id, want_mask),
            "slot {slot} token {t}"
        );
        for d in 0..DIN {
            let want = if t < len {
                bf16(hs[(row * 16 + t) * DIN + d])
            } else {
                0.0
            };
            assert_eq!(
                got.hs.get(at * DIN + d),
                want,
                "slot {slot} token {t} dim {d}"
            );
        }
    }
}

#[test]
fn rows_of_consecutive_messages_fill_one_item_and_the_ack_waits_for_the_consumer() {
    for layout in LAYOUTS {
        let (mut producers, status, pool, log) = server(1, None, 1 << 20);
        let address = status.address().to_string();
        let stop = AtomicBool::new(false);
        let (to_test, batches) = mpsc::channel::<HsBatch>();
        let (resume, resumed) = mpsc::channel::<()>();
        std::thread::scope(|scope| {
            let stop = &stop;
            let pool = &pool;
            scope.spawn(move || {
                let mut taken = 0;
                consume(producers.remove(0), pool, stop, |batch| {
                    to_test.send(batch.clone()).unwrap();
                    taken += 1;
                    if taken == 2 {
                        // Hold the second batch "in the queue" until the test has checked there is no ack yet.
                        resumed.recv().unwrap();
                    }
                });
            });

            let _stop_on_panic = StopOnDrop(stop);
            let mut client = Client::connect(&address);
            let reply = client.hello(&hello("", "p0"));
            assert!(reply.ok, "{reply:?}");
            assert_eq!((reply.slot, reply.delivered), (Some(0), Some(0)));
            assert_eq!(
                (reply.largest_bucket, reply.batch_tokens),
                (Some(16), Some(32))
            );
            assert_eq!(status.connected(), (1, 1));
            // Rows 0, 1, 3 go to bucket 8 (4 slots), row 2 to bucket 16 (2 slots): no item is full, so
            // nothing is queued and the message is acknowledged at once, its rows held open.
            let first = batch(4, 16, DIN, VOCAB, &[5, 8, 12, 3], 7);
            let ack = client.send_in(layout, &first);
            assert!(ack.ok, "{ack:?}");
            assert_eq!(
                (ack.batches, ack.sequences, ack.delivered),
                (Some(0), Some(4), Some(1))
            );
            assert!(batches.recv_timeout(Duration::from_millis(100)).is_err());
            // The next message's rows fill both open items.
            let second = batch(2, 16, DIN, VOCAB, &[6, 14], 8);
            client.frame(&blob_in(layout, &second)).unwrap();
            let small = batches.recv_timeout(Duration::from_secs(10)).unwrap();
            let large = batches.recv_timeout(Duration::from_secs(10)).unwrap();
            client.set_timeout(Duration::from_millis(300));
            let mut byte = [0u8; 1];
            let early = std::io::Read::read(&mut client.stream, &mut byte);
            assert!(
                early.is_err(),
                "acknowledged before the last batch was queued"
            );
            client.set_timeout(Duration::from_secs(10));
            resume.send(()).unwrap();
            let ack = client.reply();
            assert!(ack.ok, "{ack:?}");
            assert_eq!(
                (ack.batches, ack.sequences, ack.delivered),
                (Some(2), Some(2), Some(2))
            );

            assert_eq!((small.padded_len, small.sequences), (8, 4));
            assert_eq!(small.seq_lens, [5, 8, 3, 6]);
            assert_eq!((large.padded_len, large.sequences), (16, 2));
            assert_eq!(large.seq_lens, [12, 14]);
            assert_eq!((small.source_position, large.source_position), (0, 1));
            for (slot, tensors, row) in [
                (0, &first, 0),
                (1, &first, 1),
                (2, &first, 3),
                (3, &second, 0),
            ] {
                assert_slot(&small, slot, tensors, row);
            }
            assert_slot(&large, 0, &first, 2);
            assert_slot(&large, 1, &second, 1);

            let done = client.done();
            assert!(done.ok && done.done, "{done:?}");
        });
        assert_eq!(status.delivered(), [2]);
        let log = log.lock().unwrap().join("\n");
        assert!(log.contains("producer done after 2 messages"), "{log}");
    }
}

#[test]
fn part_filled_items_are_queued_when_the_producer_is_done_or_idle() {
    let (mut producers, status, pool, _log) = server(1, None, 1 << 20);
    let address = status.address().to_string();
    let stop = AtomicBool::new(false);
    let (to_test, batches) = mpsc::channel::<HsBatch>();
    std::thread::scope(|scope| {
        let stop = &stop;
        let pool = &pool;
        scope.spawn(move || {
            consume(producers.remove(0), pool, stop, |batch| {
                to_test.send(batch.clone()).unwrap();
            });
        });
        let _stop_on_panic = StopOnDrop(stop);
        let mut client = Client::connect(&address);
        assert!(client.hello(&hello("", "p0")).ok);
        let tensors = batch(2, 16, DIN, VOCAB, &[5, 12], 3);
        assert!(client.send(&tensors).ok);
        // Nothing more comes for read_timeout (300 ms): the part-filled items go as they are, bucket order.
        let small = batches.recv_timeout(Duration::from_secs(10)).unwrap();
        let large = batches.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(
            (small.seq_lens.as_slice(), large.seq_lens.as_slice()),
            (&[5, 0, 0, 0][..], &[12, 0][..])
        );
        assert_slot(&small, 0, &tensors, 0);
        assert_slot(&large, 0, &tensors, 1);
        // One-bucket messages with hidden_states last are read straight into the open item, after the rows it
        // holds; a row held when the producer says done is queued before the slot ends.
        let one = batch(1, 16, DIN, VOCAB, &[7], 4);
        assert!(client.send_in(Layout::HiddenLast, &one).ok);
        let two = batch(2, 16, DIN, VOCAB, &[6, 3], 5);
        assert!(client.send_in(Layout::HiddenLast, &two).ok);
        assert!(client.done().done);
        let last = batches.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(last.seq_lens, [7, 6, 3, 0]);
        assert_slot(&last, 0, &one, 0);
        assert_slot(&last, 1, &two, 0);
        assert_slot(&last, 2, &two, 1);
    });
}

/// Runs `misbehave` on a connection to a one-slot server (it returns the error the server gave it), checks the
/// server's log names that connection, then checks a well-behaved producer still delivers.
fn refused_then_recovers(
    token: Option<&str>,
    max_message_bytes: u64,
    misbehave: impl FnOnce(&mut Client) -> String,
) {
    refused_then_recovers_holding(None, token, max_message_bytes, misbehave);
}

/// [`refused_then_recovers`] for a producer whose hello is accepted and whose next message is refused.
fn refused_after_hello(max_message_bytes: u64, misbehave: impl FnOnce(&mut Client) -> String) {
    refused_then_recovers(None, max_message_bytes, |client| {
        assert!(client.hello(&hello("", "bad")).ok);
        misbehave(client)
    });
}

/// [`refused_then_recovers`] on a server holding hidden states in `hs_dtype`.
fn refused_then_recovers_holding(
    hs_dtype: Option<HsDtype>,
    token: Option<&str>,
    max_message_bytes: u64,
    misbehave: impl FnOnce(&mut Client) -> String,
) {
    let (mut producers, status, pool, log) = server_holding(1, token, max_message_bytes, hs_dtype);
    let address = status.address().to_string();
    let taken = counted(producers.remove(0), &pool, || {
        let mut client = Client::connect(&address);
        let peer = client.local_name();
        let client_error = misbehave(&mut client);
        drop(client);
        let server_log = log.lock().unwrap().join("\n");
        assert!(
            server_log.contains(&peer),
            "the server's log names the peer {peer}:\n{server_log}"
        );
        assert!(!client_error.is_empty());

        let mut good = Client::connect(&address);
        let reply = good.hello(&hello(token.unwrap_or(""), "good"));
        assert!(reply.ok, "{reply:?}");
        let ack = good.send(&batch(2, 8, DIN, VOCAB, &[8, 4], 1));
        assert!(ack.ok, "{ack:?}");
        assert!(good.done().done);
    });
    assert_eq!(taken, 1, "only the good producer's batch was queued");
    assert_eq!(status.delivered(), [1]);
}

/// Asserts that `reply` is an error that mentions `needle`, and returns its text.
fn expect_error(reply: draftpipe_runtime::source::stream::wire::Reply, needle: &str) -> String {
    assert!(
        !reply.ok,
        "expected an error mentioning `{needle}`, got {reply:?}"
    );
    let error = reply.error.unwrap_or_default();
    assert!(
        error.contains(needle),
        "`{error}` should mention `{needle}`"
    );
    error
}

#[test]
fn a_wrong_token_is_refused() {
    refused_then_recovers(Some("s3cret"), 1 << 20, |client| {
        expect_error(client.hello(&hello("guess", "bad")), "wrong token")
    });
}

#[test]
fn a_wrong_protocol_version_is_refused() {
    refused_then_recovers(None, 1 << 20, |client| {
        let mut old = hello("", "bad");
        old.protocol = PROTOCOL_VERSION + 98;
        expect_error(client.hello(&old), "protocol version 99")
    });
}

#[test]
fn a_hello_for_another_target_is_refused() {
    refused_then_recovers(None, 1 << 20, |client| {
        let mut other = hello("", "bad");
        other.hidden = HIDDEN + 1;
        expect_error(client.hello(&other), "hidden 5 does not match")
    });
}

#[test]
fn hidden_states_of_the_wrong_width_are_refused() {
    for layout in LAYOUTS {
        refused_after_hello(1 << 20, |client| {
            let wide = batch(2, 8, DIN + 1, VOCAB, &[8, 8], 3);
            let error = expect_error(client.send_in(layout, &wide), "hidden_states");
            assert!(
                error.contains("[N, S, 8]") && error.contains(&client.local_name()),
                "{layout:?}: {error}"
            );
            error
        });
    }
}

#[test]
fn a_header_that_lies_about_its_length_is_refused() {
    for layout in LAYOUTS {
        refused_after_hello(1 << 20, |client| {
            let mut lying = blob_in(layout, &batch(2, 8, DIN, VOCAB, &[8, 8], 4));
            let header_len = u64::from_le_bytes(lying[..8].try_into().unwrap());
            lying[..8].copy_from_slice(&(header_len + 4096).to_le_bytes());
            client.frame(&lying).unwrap();
            expect_error(client.reply(), "truncated")
        });
    }
}

#[test]
fn a_tensor_size_that_lies_about_the_frame_is_refused() {
    // The header is valid JSON, but its tensors need more bytes than the frame holds.
    for layout in LAYOUTS {
        refused_after_hello(1 << 20, |client| {
            let mut short = blob_in(layout, &batch(2, 8, DIN, VOCAB, &[8, 8], 4));
            short.truncate(short.len() - 2 * DIN);
            client.frame(&short).unwrap();
            expect_error(client.reply(), "the header declares")
        });
    }
}

#[test]
fn a_message_over_the_limit_is_refused_before_it_is_read() {
    refused_after_hello(64 << 10, |client| {
        let large = blob(&batch(16, 16, DIN * 32, VOCAB, &[16; 16], 5));
        assert!(large.len() > 64 << 10);
        std::io::Write::write_all(&mut client.stream, &(large.len() as u64).to_le_bytes()).unwrap();
        expect_error(client.reply(), "exceeds the limit of 65536 bytes")
    });
}

#[test]
fn half_a_message_then_a_stall_times_out() {
    for layout in LAYOUTS {
        refused_after_hello(1 << 20, |client| {
            let message = blob_in(layout, &batch(2, 8, DIN, VOCAB, &[8, 8], 6));
            // Past the header and the small tensors: inside the hidden states' rows.
            let cut = 8 + message.len() * 3 / 4;
            let mut framed = (message.len() as u64).to_le_bytes().to_vec();
            framed.extend_from_slice(&message);
            std::io::Write::write_all(&mut client.stream, &framed[..cut]).unwrap();
            let error = expect_error(client.reply(), "read timeout");
            let expected = format!("of {} bytes of a frame", framed.len());
            assert!(error.contains(&expected), "{layout:?}: {error}");
            error
        });
    }
}

#[test]
fn a_producer_that_vanishes_mid_message_loses_nothing_acknowledged_and_may_reconnect() {
    for layout in LAYOUTS {
        vanish_then_reconnect(layout);
    }
}

fn vanish_then_reconnect(layout: Layout) {
    let (mut producers, status, pool, _log) = server(1, None, 1 << 20);
    let address = status.address().to_string();
    let taken = counted(producers.remove(0), &pool, || {
        let mut first = Client::connect(&address);
        assert!(first.hello(&hello("", "p")).ok);
        assert_eq!(
            first
                .send_in(layout, &batch(2, 8, DIN, VOCAB, &[8, 2], 1))
                .delivered,
            Some(1)
        );
        let message = blob_in(layout, &batch(2, 8, DIN, VOCAB, &[8, 8], 2));
        // The frame announces the whole message; the producer dies three quarters of the way into it.
        let mut framed = (message.len() as u64).to_le_bytes().to_vec();
        framed.extend_from_slice(&message[..message.len() * 3 / 4]);
        std::io::Write::write_all(&mut first.stream, &framed).unwrap_or(());
        drop(first);
        // Wait for the server to notice, then come back under the same name.
        wait_disconnected(&status);
        let mut again = Client::connect(&address);
        let reply = again.hello(&hello("", "p"));
        assert_eq!(
            (reply.slot, reply.delivered),
            (Some(0), Some(1)),
            "{reply:?}"
        );
        assert_eq!(
            again
                .send_in(layout, &batch(2, 8, DIN, VOCAB, &[8, 8], 2))
                .delivered,
            Some(2)
        );
        assert!(again.done().done);
    });
    assert_eq!(taken, 2);
    assert_eq!(status.delivered(), [2]);
}

#[test]
fn a_stop_ends_a_source_that_waits_for_producers() {
    let (mut producers, _status, pool, _log) = server(2, None, 1 << 20);
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let waiting = scope.spawn(|| producers[1].next_batch(&pool, &stop).unwrap().is_none());
        std::thread::sleep(Duration::from_millis(100));
        stop.store(true, Ordering::Release);
        assert!(waiting.join().unwrap());
    });
}

#[test]
fn f32_and_f16_messages_decode_exactly() {
    for (dtype, layout) in [Dtype::F32, Dtype::F16]
        .into_iter()
        .flat_map(|d| LAYOUTS.map(|l| (d, l)))
    {
        let (mut producers, status, pool, _log) = server(1, None, 1 << 20);
        let mut client = Client::connect(status.address());
        assert!(client.hello(&hello("", "p")).ok);
        let mut tensors = batch(4, 8, DIN, VOCAB, &[8; 4], 9);
        tensors[0].1 = dtype;
        client.frame(&blob_in(layout, &tensors)).unwrap();
        let stop = AtomicBool::new(false);
        let got = producers[0].next_batch(&pool, &stop).unwrap().unwrap();
        let want: Vec<f32> = tensors[0].3.iter().map(|&v| v as f32).collect();
        assert_eq!(
            got.hs.to_f32_vec(0..want.len()),
            want,
            "{dtype:?} {layout:?}"
        );
        pool.give_back(got).unwrap();
    }
}

#[test]
fn a_nan_in_the_hidden_states_is_refused() {
    for (layout, value) in LAYOUTS
        .into_iter()
        .flat_map(|l| [(l, f64::NAN), (l, f64::NEG_INFINITY)])
    {
        refused_after_hello(1 << 20, |client| {
            let mut tensors = batch(2, 8, DIN, VOCAB, &[8, 5], 8);
            tensors[0].3[(8 + 2) * DIN + 3] = value; // row 1, token 2: inside its kept length
            tensors[0].3[(8 + 6) * DIN] = f64::NAN; // row 1, token 6: padding, never read
            let error = expect_error(client.send_in(layout, &tensors), "non-finite value");
            assert!(
                error.contains(&format!("element {}", (8 + 2) * DIN + 3)),
                "{layout:?}: {error}"
            );
            error
        });
    }
}

#[test]
fn a_finite_f32_that_overflows_bf16_refuses_that_message_only() {
    for layout in LAYOUTS {
        refused_then_recovers_holding(Some(HsDtype::Bf16), None, 1 << 20, |client| {
            assert!(client.hello(&hello("", "bad")).ok);
            let mut tensors = batch(2, 8, DIN, VOCAB, &[8, 5], 8);
            tensors[0].1 = Dtype::F32;
            tensors[0].3[(8 + 2) * DIN + 3] = 3.4e38; // finite in f32, above bf16's largest (3.39e38)
            let reply = client.send_in(layout, &tensors);
            let error = expect_error(reply, "bf16");
            assert!(
                error.contains(&format!("element {}", (8 + 2) * DIN + 3)),
                "{layout:?}: {error}"
            );
            error
        });
    }
}

/// Every batch a one-producer server makes of `messages`, sent in `layout` into a pool whose buffers hold
/// poison (NaN hidden states, nonzero ids and masks), and whether each came out of the pool's own buffers.
fn received(layout: Layout, messages: &[Tensors]) -> Vec<(HsBatch, bool)> {
    let (mut producers, status, pool, _log) = server(1, None, 1 << 20);
    let mut buffers: Vec<_> = std::iter::from_fn(|| pool.take(0)).collect();
    let pooled: Vec<_> = buffers.iter().map(|b| b.hs.as_ptr()).collect();
    for buffer in &mut buffers {
        buffer.hs.fill(f32::NAN);
        buffer.input_ids.fill(7);
        buffer.loss_mask.fill(1);
        buffer.seq_lens.fill(99);
    }
    buffers.into_iter().for_each(|b| pool.give_back(b).unwrap());
    let mut client = Client::connect(status.address());
    assert!(client.hello(&hello("", "p")).ok);
    let stop = AtomicBool::new(false);
    let mut batches = Vec::new();
    for tensors in messages {
        client.frame(&blob_in(layout, tensors)).unwrap();
        let batch = producers[0].next_batch(&pool, &stop).unwrap().unwrap();
        batches.push(((*batch).clone(), pooled.contains(&batch.hs.as_ptr())));
        pool.give_back(batch).unwrap();
        // Asking for the next batch acknowledges this message.
        let next = std::thread::scope(|scope| {
            let waiting = scope.spawn(|| producers[0].next_batch(&pool, &stop));
            let ack = client.reply();
            stop.store(true, Ordering::Release);
            assert!(waiting.join().unwrap().unwrap().is_none());
            ack
        });
        stop.store(false, Ordering::Release);
        assert!(next.ok && next.batches == Some(1), "{layout:?}: {next:?}");
    }
    batches
}

#[test]
fn one_item_messages_are_received_into_the_batch_exactly_as_buffered_ones_are_copied() {
    // Each message fills one item exactly (4 rows of bucket 8, or 2 of bucket 16), so each is handed out alone.
    let mut with_f32 = batch(4, 8, DIN, VOCAB, &[8, 7, 8, 1], 14);
    with_f32[0].1 = Dtype::F32; // converted to the pool's bf16 a chunk at a time
    let mut with_padding_nan = batch(4, 8, DIN, VOCAB, &[5, 8, 3, 6], 11);
    with_padding_nan[0].3[6 * DIN + 1] = f64::NAN; // row 0, token 6: past its length, never read
    let mut dropped_row_nan = batch(5, 8, DIN, VOCAB, &[8, 0, 2, 7, 4], 13);
    dropped_row_nan[0].3[8 * DIN + 5] = f64::INFINITY; // row 1 has no kept token
    let messages = [
        with_padding_nan,
        batch(2, 16, DIN, VOCAB, &[12, 9], 12), // the larger bucket
        dropped_row_nan,
        batch(4, 16, DIN, VOCAB, &[6, 3, 5, 2], 15), // 16-token rows that fit bucket 8
        with_f32,
    ];
    let copied = received(Layout::Reference, &messages);
    let direct = received(Layout::HiddenLast, &messages);
    assert!(
        !copied[0].1 && !direct[0].1,
        "either path hands out the slot's open item itself (a swap with the pooled buffer, not a copy)"
    );
    for (i, ((want, _), (got, _))) in copied.iter().zip(&direct).enumerate() {
        assert_eq!(
            (got.padded_len, got.sequences, &got.seq_lens),
            (want.padded_len, want.sequences, &want.seq_lens),
            "message {i}"
        );
        // NaN poison left anywhere makes the batches unequal.
        assert!(got == want, "message {i}: the batches differ");
    }
    assert_eq!(copied[0].0.seq_lens, [5, 8, 3, 6]);
    assert_eq!(copied[2].0.seq_lens, [8, 2, 7, 4]);
    assert_eq!(copied[3].0.seq_lens, [6, 3, 5, 2]);
}

#[test]
fn a_nan_early_in_a_large_direct_message_is_answered_after_the_whole_message() {
    // One row of 4M tokens (8 kept): 84 MB, more than loopback's socket buffers hold. The NaN is in the first
    // chunk the server reads; it still reads the rest before answering, so the producer finishes sending and
    // reads the error instead of a reset connection.
    const SEQ: usize = 4 << 20;
    let mut hs = vec![0u8; SEQ * DIN * 2];
    hs[(2 * DIN + 1) * 2..(2 * DIN + 1) * 2 + 2].copy_from_slice(&half::bf16::NAN.to_le_bytes());
    let ids = vec![0u8; SEQ * 4];
    let mut mask = vec![0u8; SEQ];
    mask[..8].fill(1);
    let header = serde_json::json!({
        "input_ids": {"dtype": "I32", "shape": [1, SEQ], "data_offsets": [0, ids.len()]},
        "loss_mask": {"dtype": "U8", "shape": [1, SEQ], "data_offsets": [ids.len(), ids.len() + SEQ]},
        "hidden_states": {"dtype": "BF16", "shape": [1, SEQ, DIN],
                          "data_offsets": [ids.len() + SEQ, ids.len() + SEQ + hs.len()]},
    });
    let header = serde_json::to_vec(&header).unwrap();
    let mut message = (header.len() as u64).to_le_bytes().to_vec();
    for part in [&header, &ids, &mask, &hs] {
        message.extend_from_slice(part);
    }
    refused_after_hello(128 << 20, |client| {
        client.frame(&message).expect("the whole message is read");
        let error = expect_error(client.reply(), "non-finite value NaN");
        assert!(
            error.contains(&format!("element {}", 2 * DIN + 1)),
            "{error}"
        );
        error
    });
}

#[test]
fn a_sequence_longer_than_the_largest_bucket_is_named_by_row_and_length() {
    for layout in LAYOUTS {
        refused_after_hello(1 << 20, |client| {
            let tensors = batch(2, 20, DIN, VOCAB, &[8, 20], 21);
            expect_error(
                client.send_in(layout, &tensors),
                "sequence 1 of 2 has 20 tokens; the largest bucket is 16",
            )
        });
    }
}

#[test]
fn counts_belong_to_names_and_a_restored_server_gives_them_back() {
    let (mut producers, status, pool, _log) = server(1, None, 1 << 20);
    let address = status.address().to_string();
    counted(producers.remove(0), &pool, || {
        let mut first = Client::connect(&address);
        assert!(first.hello(&hello("", "p")).ok);
        assert_eq!(
            first.send(&batch(2, 8, DIN, VOCAB, &[8, 2], 1)).delivered,
            Some(1)
        );
        drop(first);
        wait_disconnected(&status);
        // A new name takes the free slot but not `p`'s count: it has delivered nothing.
        let mut other = Client::connect(&address);
        assert_eq!(other.hello(&hello("", "q")).delivered, Some(0));
        assert_eq!(
            other.send(&batch(1, 8, DIN, VOCAB, &[3], 2)).delivered,
            Some(1)
        );
        assert_eq!(
            other.send(&batch(1, 8, DIN, VOCAB, &[4], 3)).delivered,
            Some(2)
        );
        drop(other);
        wait_disconnected(&status);
        let mut again = Client::connect(&address);
        assert_eq!(again.hello(&hello("", "p")).delivered, Some(1));
        drop(again);
        wait_disconnected(&status);
    });
    assert_eq!(
        status.describe(),
        "producers=[0/1 connected; waiting for p (lost, may reconnect)]"
    );
    let records = status.records();
    let counts: Vec<_> = records
        .iter()
        .map(|r| (r.name.as_str(), r.slot, r.delivered))
        .collect();
    assert_eq!(counts, [("p", Some(0), 1), ("q", None, 2)]);

    // A resumed run's server starts from the checkpoint's records.
    let (_producers, restored, _pool, _log) = server(1, None, 1 << 20);
    assert_eq!(
        restored.describe(),
        "producers=[0/1 connected; waiting for slot 0 (never connected)]"
    );
    restored.restore(&records);
    assert_eq!(restored.records(), records);
    let mut client = Client::connect(restored.address());
    assert_eq!(client.hello(&hello("", "q")).delivered, Some(2));
}
