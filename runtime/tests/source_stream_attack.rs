//! The stream server's door under attack, over real loopback sockets: a reconnecting slowloris (connections
//! that never finish their hello, each reopened the moment the server drops it) must not keep a producer that
//! presents the right token out, and connections waiting for their hello must cost no thread each (at
//! `ulimit -u` a thread per connection turned a producer's hello into a reset).

mod source_support;
mod stream_support;

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use draftpipe_compiler::plan::SourceSpec;
use draftpipe_runtime::source::{BucketShapes, StreamConfig, StreamSource, open_stream};

use source_support::plan;
use stream_support::Client;

const HIDDEN: usize = 4;
const TAPS: usize = 2;
const VOCAB: usize = 50;
const TOKEN: &str = "s3cret";

/// The thread count is the process's: the tests of this file take turns.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn one_at_a_time() -> MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A token-protected listener on a free loopback port with one producer slot; its log lines are collected.
fn server(read_timeout: Duration) -> (Vec<StreamSource>, String, Arc<Mutex<Vec<String>>>) {
    let plan = plan(
        SourceSpec::Stream {
            listen: "127.0.0.1:0".into(),
            token_env: None,
            max_message_bytes: 1 << 20,
            read_timeout_ms: read_timeout.as_millis() as u64,
        },
        VOCAB,
        HIDDEN,
        TAPS,
        &[8, 16],
        32,
        1,
    );
    let log = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&log);
    let (sources, status) = open_stream(StreamConfig {
        listen: "127.0.0.1:0".into(),
        token: Some(TOKEN.into()),
        max_message_bytes: 1 << 20,
        read_timeout,
        target: plan.target.clone(),
        shapes: BucketShapes::from_plan(&plan),
        producers: 1,
        log: Arc::new(move |line: &str| {
            let mut lines = sink.lock().unwrap_or_else(PoisonError::into_inner);
            lines.push(line.to_string());
        }),
    })
    .unwrap();
    (sources, status.address().to_string(), log)
}

fn producer_hello() -> draftpipe_runtime::source::stream::wire::Hello {
    Client::hello_for(HIDDEN, TAPS, VOCAB, TOKEN, "node0")
}

/// Threads of this process now.
fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

/// Connections that send the first `sent` bytes of a hello's length prefix and then nothing: slowloris.
fn slow_hello(address: &str, sent: usize) -> std::io::Result<TcpStream> {
    let mut stream = TcpStream::connect(address)?;
    stream.write_all(&[0u8; 8][..sent])?;
    stream.set_nonblocking(true)?;
    Ok(stream)
}

/// Whether the server has answered or closed `stream` (a refusal), without waiting.
fn dropped_by_server(stream: &mut TcpStream) -> bool {
    let mut byte = [0u8; 1];
    // A byte is the refusal's reply, 0 the close: either way the server is done with it.
    match stream.read(&mut byte) {
        Ok(0 | 1) => true,
        Ok(_) => unreachable!("a one-byte buffer"),
        Err(e) => e.kind() != ErrorKind::WouldBlock,
    }
}

/// The attack: `sockets` slow hellos held open, each reopened at once when the server drops it, until `stop`
/// or `until`; counts every connection opened and every one the server dropped.
fn slowloris(
    address: String,
    sockets: usize,
    stop: Arc<AtomicBool>,
    until: Instant,
    (opened, dropped): (Arc<AtomicU64>, Arc<AtomicU64>),
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut held: Vec<Option<TcpStream>> = (0..sockets).map(|_| None).collect();
        while !stop.load(Ordering::Acquire) && Instant::now() < until {
            for socket in &mut held {
                if socket.as_mut().is_some_and(dropped_by_server) {
                    dropped.fetch_add(1, Ordering::Relaxed);
                    *socket = None;
                }
                if socket.is_none() {
                    *socket = slow_hello(&address, 1).ok();
                    opened.fetch_add(1, Ordering::Relaxed);
                }
            }
            // Pacing, so the attack does not starve a loaded machine; it still reopens within milliseconds.
            std::thread::sleep(Duration::from_millis(2));
        }
    })
}

#[test]
fn a_reconnecting_slowloris_does_not_keep_a_producer_with_the_token_out() {
    let _turn = one_at_a_time();
    // Each slow hello could hold its place for 20 s; the producer must be in within 5.
    let (_sources, address, log) = server(Duration::from_secs(20));
    let stop = Arc::new(AtomicBool::new(false));
    let counts = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let until = Instant::now() + Duration::from_secs(30);
    let attackers: Vec<_> = (0..4)
        .map(|_| {
            let counts = (Arc::clone(&counts.0), Arc::clone(&counts.1));
            slowloris(address.clone(), 32, Arc::clone(&stop), until, counts)
        })
        .collect();
    // The attack holds the door: 128 slow hellos against 64 places, so the server has dropped some.
    let full_by = Instant::now() + Duration::from_secs(20);
    while counts.1.load(Ordering::Relaxed) == 0 {
        assert!(
            Instant::now() < full_by,
            "the server never dropped a slow hello ({} opened)",
            counts.0.load(Ordering::Relaxed)
        );
        std::thread::sleep(Duration::from_millis(10));
    }

    let started = Instant::now();
    let bound = Duration::from_secs(5);
    let mut refusals = Vec::new();
    let admitted = loop {
        let mut client = Client::connect(&address);
        let reply = client.hello(&producer_hello());
        if reply.ok {
            break Some(reply);
        }
        assert!(reply.retry, "a refusal that is not for now: {reply:?}");
        refusals.push(reply.error.unwrap_or_default());
        if started.elapsed() > bound {
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let waited = started.elapsed();
    let attack_ran = Instant::now() < until;
    // The producer's admission is logged after its reply, and the displaced hellos counted, once a second at
    // most: wait for both lines while the attack goes on.
    let logged = |needle: &str| {
        log.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .any(|l| l.contains(needle))
    };
    let (displaced, connected) = (
        "gave their place to newer ones",
        "producer `node0` connected as slot 0",
    );
    let logged_by = Instant::now() + Duration::from_secs(10);
    while !(logged(displaced) && logged(connected)) && Instant::now() < logged_by {
        std::thread::sleep(Duration::from_millis(10));
    }
    stop.store(true, Ordering::Release);
    attackers.into_iter().for_each(|a| a.join().unwrap());
    let (opened, dropped) = (
        counts.0.load(Ordering::Relaxed),
        counts.1.load(Ordering::Relaxed),
    );
    let admitted = admitted.unwrap_or_else(|| {
        panic!(
            "the producer was kept out for {waited:?} by {opened} slow hellos ({} refusals, the last: {:?})",
            refusals.len(),
            refusals.last()
        )
    });
    assert!(attack_ran, "the attack ended before the producer got in");
    assert_eq!(admitted.slot, Some(0));
    eprintln!(
        "admitted after {waited:?} and {} refusals; the attack opened {opened} connections, {dropped} dropped",
        refusals.len()
    );
    let log = log.lock().unwrap_or_else(PoisonError::into_inner);
    assert!(
        log.iter().any(|l| l.contains(displaced)) && log.iter().any(|l| l.contains(connected)),
        "the displaced hellos and the producer are logged: {log:?}"
    );
}

#[test]
fn waiting_hellos_cost_no_thread_each_and_a_late_one_is_told_why() {
    let _turn = one_at_a_time();
    let timeout = Duration::from_millis(800);
    let (_sources, address, log) = server(timeout);
    let before = threads();
    let slow: Vec<TcpStream> = (0..40).map(|_| slow_hello(&address, 3).unwrap()).collect();
    // Connections are accepted in order: once the producer is answered, the 40 slow ones were taken in.
    let mut client = Client::connect(&address);
    let reply = client.hello(&producer_hello());
    assert!(reply.ok, "{reply:?}");
    let during = threads();
    // One thread of slack: the test harness may start the other test's thread meanwhile.
    assert!(
        during <= before + 1,
        "40 connections waiting for their hello took {} threads ({before} before, {during} now)",
        during.saturating_sub(before)
    );

    // Each slow hello gets a reply it can read when its deadline, counted from the accept, has passed.
    for mut stream in slow {
        stream.set_nonblocking(false).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        let mut reply = Vec::new();
        stream.read_to_end(&mut reply).unwrap();
        assert!(reply.len() > 8, "a slow hello was closed without a reply");
        let reply: serde_json::Value = serde_json::from_slice(&reply[8..]).unwrap();
        let error = reply["error"].as_str().unwrap_or_default();
        assert!(
            error.contains(
                "no hello: only 3 of 8 bytes of a frame arrived within 800ms of connecting"
            ),
            "{reply}"
        );
    }
    let log = log.lock().unwrap_or_else(PoisonError::into_inner);
    assert!(
        log.iter()
            .any(|l| l.contains("refused: no hello: only 3 of 8 bytes")),
        "{log:?}"
    );
}
