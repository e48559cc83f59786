//! Hidden states pushed over a socket by producer processes that run the target (`source = stream(...)`).
//!
//! ```text
//!  producer processes ──TCP / unix socket──▶ Listener ──acceptor thread──▶ handshake thread per connection
//!        (hello checked: protocol, hidden, tap_layers, vocab, token; a slot assigned by producer name)
//!                                                         │ Connection
//!                                                         ▼
//!  StreamSource (slot w, run by producer thread w) ──reads a message (receive.rs)──▶ checked like a file
//!        one item, hidden_states last: rows read straight into a staged batch ──fill_next swaps it──▶ HsBatch
//!        otherwise: the whole message buffered, cut into items ──fill_next copies each──▶ HsBatch
//!        HsBatch ──producer thread──▶ HS queue;  ack once all of a message's items are in
//! ```
//!
//! The target stage's `on …` workers are the producer slots: slot `w` is one producer thread of the pipeline,
//! which owns the connection of the producer process in that slot, so a full queue blocks that thread and the
//! producer waiting for its acknowledgement exactly as an in-process producer would be blocked, and the
//! telemetry counts it the same way. A message is acknowledged when the producer thread asks for the batch after
//! its last one, which it does only after that one was pushed; nothing unacknowledged counts as delivered.
//!
//! Any fault of a connection (bad hello, wrong token, a message that fails the file source's checks, a frame
//! over the limit, a truncated frame, a stall past `read_timeout`) gets one error reply, is logged with the
//! peer's address, and closes that connection only; the slot waits for a reconnect. A producer that sends
//! `done` retires its slot; when every slot is done the sources are exhausted and the run drains and ends.
//!
//! Positions: slot `w`'s `k`-th batch has position `w + k·W`, so a checkpoint's data positions say how many
//! batches each producer had delivered, and a resumed run continues the count.

mod handshake;
mod message;
mod receive;
mod scan;
pub mod wire;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use draftpipe_compiler::plan::TargetStage;

use self::handshake::accept_loop;
use self::message::Message;
use self::receive::{DirectReceiver, ReceiveError, Received};
use self::wire::{Connection, Listener, POLL, Reply, WireError};
use super::{BucketShapes, HsSource, SourceError, check_owned};
use crate::batch::HsBatch;

/// Where a stream source's events go (listening address, refused connections, faults): one line each.
pub type StreamLog = Arc<dyn Fn(&str) + Send + Sync>;

/// A log that writes each line to standard error, prefixed `stream:` (a closed standard error loses the line,
/// never the connection: see [`crate::log`]).
pub fn stderr_log() -> StreamLog {
    Arc::new(|line| crate::log_line!("stream: {line}"))
}

/// Settings of a stream listener, as the plan gives them.
#[derive(Clone)]
pub struct StreamConfig {
    /// `IP:PORT`, `localhost:PORT` or `unix:/path`.
    pub listen: String,
    /// The token producers must present; `None`: no token.
    pub token: Option<String>,
    /// The largest message accepted.
    pub max_message_bytes: u64,
    /// Stall allowed inside a hello or a message.
    pub read_timeout: Duration,
    /// What a hello must match.
    pub target: TargetStage,
    /// Bucket shapes batches are cut to.
    pub shapes: BucketShapes,
    /// Producer slots (the target stage's workers).
    pub producers: usize,
    /// Where events are logged.
    pub log: StreamLog,
}

/// One producer slot's bookkeeping, shared by the handshake threads and the slot's source.
#[derive(Debug, Default, Clone)]
struct Slot {
    name: Option<String>,
    /// The generation of the connection now held, if any.
    connected: Option<u64>,
    done: bool,
    /// Messages acknowledged, over reconnects.
    delivered: u64,
}

struct ServerState {
    config: StreamConfig,
    address: String,
    stop: AtomicBool,
    slots: Mutex<Vec<Slot>>,
    handoff: Vec<Sender<(Connection, u64)>>,
    /// Per slot: a newer connection waits in `handoff` (wakes a source idle on its old connection).
    replacement: Vec<AtomicBool>,
    generation: AtomicUsize,
}

impl ServerState {
    fn slots(&self) -> std::sync::MutexGuard<'_, Vec<Slot>> {
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn log(&self, line: &str) {
        (self.config.log)(line);
    }
}

/// The listener and its acceptor thread; dropped (stopping the thread) with the last source.
struct Server {
    state: Arc<ServerState>,
    acceptor: Mutex<Option<JoinHandle<()>>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::Release);
        if let Some(handle) = self
            .acceptor
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            let _ = handle.join();
        }
    }
}

/// What the status line shows of a stream: producers connected out of those expected.
#[derive(Clone)]
pub struct StreamStatus {
    state: Arc<ServerState>,
}

impl StreamStatus {
    /// `(connected, expected)`.
    pub fn connected(&self) -> (usize, usize) {
        let slots = self.state.slots();
        (
            slots.iter().filter(|s| s.connected.is_some()).count(),
            slots.len(),
        )
    }

    /// `producers=[3/5 connected]`.
    pub fn describe(&self) -> String {
        let (connected, expected) = self.connected();
        format!("producers=[{connected}/{expected} connected]")
    }

    /// Messages acknowledged per slot so far.
    pub fn delivered(&self) -> Vec<u64> {
        self.state.slots().iter().map(|s| s.delivered).collect()
    }

    /// The address producers connect to.
    pub fn address(&self) -> &str {
        &self.state.address
    }
}

/// Binds the listener, starts accepting, and returns one source per producer slot plus the status handle.
pub fn open_stream(config: StreamConfig) -> Result<(Vec<StreamSource>, StreamStatus), SourceError> {
    let listener = Listener::bind(&config.listen)
        .map_err(|e| SourceError::Config(format!("cannot listen on `{}`: {e}", config.listen)))?;
    let address = listener.address();
    let producers = config.producers;
    let (senders, receivers): (Vec<_>, Vec<_>) = (0..producers).map(|_| channel()).unzip();
    let state = Arc::new(ServerState {
        address: address.clone(),
        stop: AtomicBool::new(false),
        slots: Mutex::new(vec![Slot::default(); producers]),
        handoff: senders,
        replacement: (0..producers).map(|_| AtomicBool::new(false)).collect(),
        generation: AtomicUsize::new(1),
        config,
    });
    state.log(&format!(
        "listening on {address} for {producers} producer{}",
        if producers == 1 { "" } else { "s" }
    ));
    let acceptor = {
        let state = Arc::clone(&state);
        std::thread::Builder::new()
            .name("stream-accept".into())
            .spawn(move || accept_loop(&listener, &state))
            .map_err(|e| SourceError::Config(format!("cannot start the stream acceptor: {e}")))?
    };
    let server = Arc::new(Server {
        state: Arc::clone(&state),
        acceptor: Mutex::new(Some(acceptor)),
    });
    let sources = receivers
        .into_iter()
        .enumerate()
        .map(|(slot, incoming)| StreamSource {
            server: Arc::clone(&server),
            slot,
            incoming,
            connection: None,
            buffer: Vec::new(),
            receiver: DirectReceiver::default(),
            message: None,
            ack_due: None,
            next: slot as u64,
            finished: false,
        })
        .collect();
    Ok((sources, StreamStatus { state }))
}

fn release_slot(state: &ServerState, slot: usize, generation: u64) {
    let mut slots = state.slots();
    if slots[slot].connected == Some(generation) {
        slots[slot].connected = None;
    }
}

/// An acknowledgement owed for a message whose batches have all been handed out.
#[derive(Debug, Clone, Copy)]
struct AckDue {
    batches: u64,
    sequences: u64,
}

/// The message whose batches are being handed out.
#[derive(Debug)]
enum Current {
    /// Read whole into the buffer, checked; its items are copied out one by one.
    Buffered(Box<Message>),
    /// One item, received straight into the receiver's staged batch, handed out by a swap.
    Staged {
        bucket: usize,
        sequences: usize,
        handed: bool,
    },
}

impl Current {
    fn exhausted(&self) -> bool {
        match self {
            Self::Buffered(message) => message.exhausted(),
            Self::Staged { handed, .. } => *handed,
        }
    }

    fn next_bucket(&self) -> Option<usize> {
        match self {
            Self::Buffered(message) => message.next_bucket(),
            Self::Staged { bucket, handed, .. } => (!handed).then_some(*bucket),
        }
    }

    /// `(batches, sequences)` the whole message makes.
    fn counts(&self) -> (usize, usize) {
        match self {
            Self::Buffered(message) => (message.batches(), message.sequences()),
            Self::Staged { sequences, .. } => (1, *sequences),
        }
    }
}

/// One producer slot of a stream: the connection of the producer process in that slot, read on demand.
pub struct StreamSource {
    server: Arc<Server>,
    slot: usize,
    incoming: Receiver<(Connection, u64)>,
    connection: Option<(Connection, u64)>,
    buffer: Vec<u8>,
    receiver: DirectReceiver,
    message: Option<Current>,
    ack_due: Option<AckDue>,
    next: u64,
    finished: bool,
}

impl StreamSource {
    fn state(&self) -> &ServerState {
        &self.server.state
    }

    /// Drops the current connection after a fault: error reply, log line with the peer, slot free again.
    fn drop_connection(&mut self, problem: &str) {
        if let Some((connection, generation)) = self.connection.take() {
            let state = &self.server.state;
            state.log(&format!(
                "{}: slot {}: {problem}; connection closed",
                connection.peer(),
                self.slot
            ));
            connection.refuse(problem);
            release_slot(state, self.slot, generation);
        }
    }

    /// Sends the acknowledgement owed for the last message, now that its last batch was pushed.
    fn settle_ack(&mut self) {
        let Some(due) = self.ack_due.take() else {
            return;
        };
        let delivered = {
            let mut slots = self.state().slots();
            slots[self.slot].delivered += 1;
            slots[self.slot].delivered
        };
        let reply = Reply {
            ok: true,
            delivered: Some(delivered),
            batches: Some(due.batches),
            sequences: Some(due.sequences),
            ..Reply::default()
        };
        if let Some((connection, _)) = &mut self.connection
            && let Err(e) = connection.send(&reply)
        {
            self.drop_connection(&format!("cannot send the acknowledgement: {e}"));
        }
    }

    /// Waits until a message with batches left is at hand, the slot's producer is done, or `stop` is set.
    fn await_message(&mut self, stop: &AtomicBool) -> Result<(), SourceError> {
        loop {
            if self.finished
                || stop.load(Ordering::Acquire)
                || self.message.as_ref().is_some_and(|m| !m.exhausted())
            {
                return Ok(());
            }
            // A newer connection from this slot replaces the one held (the producer reconnected).
            if let Ok((connection, generation)) = self.incoming.try_recv() {
                if self.connection.is_some() {
                    self.drop_connection("replaced by a newer connection of the same producer");
                }
                self.connection = Some((connection, generation));
            }
            let Some((connection, _)) = &mut self.connection else {
                match self.incoming.recv_timeout(POLL) {
                    Ok(handed) => self.connection = Some(handed),
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => self.finished = true,
                }
                continue;
            };
            let config = &self.server.state.config;
            let replacement = &self.server.state.replacement[self.slot];
            let read =
                connection.read_frame_len(config.max_message_bytes, config.read_timeout, || {
                    !stop.load(Ordering::Acquire) && !replacement.swap(false, Ordering::AcqRel)
                });
            match read {
                Ok(0) => self.finish_slot(),
                Ok(len) => self.receive_message(len, stop),
                Err(WireError::Stopped) => {}
                Err(WireError::Closed) => {
                    let (connection, generation) =
                        self.connection.take().expect("a connection was read");
                    self.state().log(&format!(
                        "{}: slot {}: producer disconnected",
                        connection.peer(),
                        self.slot
                    ));
                    release_slot(self.state(), self.slot, generation);
                }
                Err(e) => self.drop_connection(&e.to_string()),
            }
        }
    }

    /// The producer said `done`: acknowledge, close, and end this slot's stream.
    fn finish_slot(&mut self) {
        let (mut connection, generation) = self.connection.take().expect("a connection was read");
        let delivered = {
            let mut slots = self.state().slots();
            slots[self.slot].done = true;
            slots[self.slot].delivered
        };
        let _ = connection.send(&Reply {
            ok: true,
            done: true,
            delivered: Some(delivered),
            ..Reply::default()
        });
        self.state().log(&format!(
            "{}: slot {}: producer done after {delivered} messages",
            connection.peer(),
            self.slot
        ));
        connection.close();
        release_slot(self.state(), self.slot, generation);
        self.finished = true;
    }

    /// Reads the body of a message frame of `len` bytes and makes it the current message; a bad one (or a
    /// connection that fails inside it) drops the connection.
    fn receive_message(&mut self, len: u64, stop: &AtomicBool) {
        let Some((connection, _)) = &mut self.connection else {
            return;
        };
        let state = &self.server.state;
        let delivered = state.slots()[self.slot].delivered;
        let origin = PathBuf::from(format!("{} message {}", connection.peer(), delivered + 1));
        let config = &state.config;
        if let Some(Current::Buffered(message)) = self.message.take() {
            self.buffer = message.into_bytes();
        }
        let received = self.receiver.receive(
            connection,
            len,
            config,
            (&origin, &|| stop.load(Ordering::Acquire)),
            &mut self.buffer,
        );
        match received {
            Ok(Received::Buffered) => self.accept_message(origin, len as usize),
            Ok(Received::Staged { bucket, sequences }) => {
                self.message = Some(Current::Staged {
                    bucket,
                    sequences,
                    handed: false,
                });
            }
            Err(ReceiveError::Wire(e)) => self.drop_connection(&e.to_string()),
            Err(ReceiveError::Content(e)) => self.drop_connection(&e.to_string()),
        }
    }

    /// Checks a message read whole into the buffer and makes it the current one; a bad one drops the
    /// connection.
    fn accept_message(&mut self, origin: PathBuf, len: usize) {
        let buffer = std::mem::take(&mut self.buffer);
        let config = &self.server.state.config;
        match Message::parse(origin, buffer, len, &config.target, &config.shapes) {
            Ok(message) => {
                if message.exhausted() {
                    // Every row was empty: nothing to queue, acknowledged at once.
                    self.ack_due = Some(AckDue {
                        batches: 0,
                        sequences: 0,
                    });
                    self.settle_ack();
                }
                self.message = Some(Current::Buffered(Box::new(message)));
            }
            Err((error, bytes)) => {
                self.buffer = bytes;
                self.drop_connection(&error.to_string());
            }
        }
    }
}

impl HsSource for StreamSource {
    fn next_bucket(&mut self) -> Result<Option<usize>, SourceError> {
        let never = AtomicBool::new(false);
        self.next_bucket_until(&never)
    }

    fn next_bucket_until(&mut self, stop: &AtomicBool) -> Result<Option<usize>, SourceError> {
        self.settle_ack();
        self.await_message(stop)?;
        Ok(self
            .message
            .as_ref()
            .filter(|m| !m.exhausted())
            .and_then(Current::next_bucket))
    }

    fn fill_next(&mut self, out: &mut HsBatch) -> Result<(), SourceError> {
        let shapes = &self.server.state.config.shapes;
        let Some(message) = self.message.as_mut().filter(|m| !m.exhausted()) else {
            return Err(SourceError::Buffer(format!(
                "stream slot {} has no message to fill from",
                self.slot
            )));
        };
        let fill = match message {
            Current::Buffered(message) => message.fill_next(out, shapes),
            Current::Staged { bucket, handed, .. } => {
                match self.receiver.staged_mut() {
                    Some(staged) if shapes.matches(out, *bucket) => {
                        // The pooled batch becomes the next message's staging buffer: no copy.
                        std::mem::swap(out, staged);
                        *handed = true;
                        Ok(())
                    }
                    _ => Err(SourceError::Buffer(format!(
                        "a batch of bucket {bucket} {:?} needs its shape, got a {}×{} buffer",
                        shapes.buckets[*bucket], out.sequences, out.padded_len
                    ))),
                }
            }
        };
        match fill {
            Ok(()) => {
                out.source_position = self.next;
                self.next += self.server.state.config.producers as u64;
                if message.exhausted() {
                    let (batches, sequences) = message.counts();
                    self.ack_due = Some(AckDue {
                        batches: batches as u64,
                        sequences: sequences as u64,
                    });
                }
                Ok(())
            }
            Err(error) => {
                // The message passed its checks, so this is a buffer mismatch: the run's fault, not the peer's.
                self.message = None;
                Err(error)
            }
        }
    }

    fn position(&self) -> u64 {
        self.next
    }

    fn seek(&mut self, position: u64) -> Result<(), SourceError> {
        check_owned(position, self.slot, self.server.state.config.producers)?;
        self.next = position;
        Ok(())
    }

    fn status_probe(&self) -> Option<super::SourceStatusProbe> {
        let status = StreamStatus {
            state: Arc::clone(&self.server.state),
        };
        Some(super::SourceStatusProbe::new(move || status.describe()))
    }
}

impl std::fmt::Debug for StreamSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamSource")
            .field("slot", &self.slot)
            .field("address", &self.server.state.address)
            .field("next", &self.next)
            .finish_non_exhaustive()
    }
}
