//! Hidden states pushed over a socket by producer processes that run the target (`source = stream(...)`).
//!
//! ```text
//!  producer processes ──TCP / unix socket──▶ Listener ──acceptor thread: every waiting hello read as it arrives
//!        (hello checked: protocol, hidden, tap_layers, vocab, token; a slot assigned by producer name)
//!                                                         │ Connection
//!                                                         ▼
//!  StreamSource (slot w, run by producer thread w) ──reads a message (receive.rs)──▶ checked like a file
//!        one bucket with room, hidden_states last: rows read straight into the slot's open item of it
//!        otherwise: the whole message buffered, each row copied into its bucket's open item (message.rs)
//!        open item full ──fill_next swaps it with a pooled HsBatch──▶ producer thread ──▶ HS queue
//!        ack once every row of the message is queued or held in an open item (open_items.rs)
//! ```
//!
//! The target stage's `on …` workers are the producer slots: slot `w` is one producer thread of the pipeline,
//! which owns the connection of the producer process in that slot, so a full queue blocks that thread and the
//! producer waiting for its acknowledgement exactly as an in-process producer would be blocked, and the
//! telemetry counts it the same way. A message is acknowledged when its last row is placed and the items it
//! filled were pushed; nothing unacknowledged counts as delivered. Part-filled items stay open for the next
//! message and go to the queue (padded) when the producer says `done`, disconnects, is dropped for a fault, or
//! sends nothing for `read_timeout`.
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
mod open_items;
mod receive;
mod scan;
mod status;
pub mod wire;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use draftpipe_compiler::plan::TargetStage;

use self::handshake::accept_loop;
use self::message::Message;
use self::open_items::OpenItems;
use self::receive::{DirectReceiver, ReceiveError, Received};
pub use self::status::StreamStatus;
use self::wire::{Connection, Listener, POLL, Reply, WireError};
use super::mask_check::{MaskRefusal, MaskReport};
use super::{BucketShapes, HsSource, SourceError, check_owned};
use crate::batch::HsBatch;

/// The fewest sequences a connection's bad masks are judged over: at 1% the first bad sequence alone does not
/// refuse a producer, the second within its first 100 does.
pub const STREAM_MASK_FLOOR: u64 = 100;

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

/// One producer slot's bookkeeping, shared by the acceptor (which checks hellos) and the slot's source.
#[derive(Debug, Default, Clone)]
struct Slot {
    name: Option<String>,
    /// The generation of the connection now held, if any.
    connected: Option<u64>,
    done: bool,
    /// Messages of the producer named `name` acknowledged, over reconnects.
    delivered: u64,
}

impl Slot {
    /// Gives the slot to producer `name` (`None`: unnamed), whose count follows it: the count of the name
    /// that held the slot goes to `known`, the new name's comes from there (0 for a name never seen).
    fn take_over(&mut self, name: Option<&String>, known: &mut BTreeMap<String, u64>) {
        if self.name.as_ref() == name {
            return;
        }
        if let Some(old) = self.name.take() {
            known.insert(old, self.delivered);
        }
        self.delivered = name.and_then(|n| known.remove(n)).unwrap_or(0);
        self.name = name.cloned();
    }
}

struct ServerState {
    config: StreamConfig,
    address: String,
    stop: AtomicBool,
    slots: Mutex<Vec<Slot>>,
    /// Counts of the names that gave their slot to another name (taken with `slots` held).
    known: Mutex<BTreeMap<String, u64>>,
    handoff: Vec<Sender<(Connection, u64)>>,
    /// Per slot: a newer connection waits in `handoff` (wakes a source idle on its old connection).
    replacement: Vec<AtomicBool>,
    generation: AtomicUsize,
    /// What the loss masks of every accepted message hold, for the run's summary.
    masks: Mutex<MaskReport>,
}

impl ServerState {
    fn slots(&self) -> std::sync::MutexGuard<'_, Vec<Slot>> {
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn known(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, u64>> {
        self.known.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn log(&self, line: &str) {
        (self.config.log)(line);
    }

    fn masks(&self) -> std::sync::MutexGuard<'_, MaskReport> {
        self.masks.lock().unwrap_or_else(PoisonError::into_inner)
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
        known: Mutex::new(BTreeMap::new()),
        handoff: senders,
        replacement: (0..producers).map(|_| AtomicBool::new(false)).collect(),
        generation: AtomicUsize::new(1),
        masks: Mutex::new(MaskReport::new(&config.target.masks)),
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
    let buckets = state.config.shapes.buckets.len();
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
            open: OpenItems::new(buckets),
            message: None,
            ready: None,
            flush: false,
            done_pending: false,
            ack_due: None,
            cut: 0,
            next: slot as u64,
            finished: false,
            connection_masks: MaskReport::new(&state.config.target.masks),
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

/// An acknowledgement owed for a message whose rows are all placed.
#[derive(Debug, Clone, Copy)]
struct AckDue {
    /// Items handed out while its rows were placed.
    batches: u64,
    sequences: u64,
}

/// One producer slot of a stream: the connection of the producer process in that slot, read on demand.
pub struct StreamSource {
    server: Arc<Server>,
    slot: usize,
    incoming: Receiver<(Connection, u64)>,
    connection: Option<(Connection, u64)>,
    buffer: Vec<u8>,
    receiver: DirectReceiver,
    /// Part-filled items, one per bucket, kept across messages.
    open: OpenItems,
    /// A buffered message whose rows are being placed.
    message: Option<Box<Message>>,
    /// The bucket whose open item is to be handed out next.
    ready: Option<usize>,
    /// Hand out every part-filled item (the producer is done, gone or idle).
    flush: bool,
    /// The producer said `done`; its acknowledgement waits until the rows held open are queued.
    done_pending: bool,
    ack_due: Option<AckDue>,
    /// Items handed out since the current message began.
    cut: u64,
    next: u64,
    finished: bool,
    /// What the loss masks of the current connection's accepted messages hold (judged against the bound).
    connection_masks: MaskReport,
}

impl StreamSource {
    fn state(&self) -> &ServerState {
        &self.server.state
    }

    /// Holds a connection handed to this slot; its mask count starts afresh, so a producer restarted with
    /// mended data is not held to what its last connection sent.
    fn take_connection(&mut self, handed: (Connection, u64)) {
        self.connection = Some(handed);
        self.connection_masks = MaskReport::new(&self.server.state.config.target.masks);
    }

    /// Counts a checked message's loss masks into its connection's, or refuses it (the reason for the peer)
    /// when the connection's bad masks go over `max_bad_mask_share`, judged over at least
    /// [`STREAM_MASK_FLOOR`] sequences. Only an admitted message counts in the run's summary.
    fn admit_masks(&mut self, masks: &MaskReport) -> Result<(), String> {
        let mut judged = self.connection_masks.clone();
        judged.merge(masks);
        let state = &self.server.state;
        let max_share = state.config.target.masks.max_bad_share;
        if judged.over(max_share, STREAM_MASK_FLOOR) {
            let data = self
                .connection
                .as_ref()
                .map_or_else(String::new, |(connection, _)| {
                    format!("this connection ({})", connection.peer())
                });
            return Err(MaskRefusal {
                data,
                report: judged,
                max_share,
            }
            .to_string());
        }
        self.connection_masks = judged;
        state.masks().merge(masks);
        Ok(())
    }

    /// Drops the current connection after a fault: error reply, log line with the peer, slot free again.
    fn drop_connection(&mut self, problem: &str) {
        self.drop_connection_as(problem, false);
    }

    /// [`Self::drop_connection`], the reply marked `ended` when the run is ending (the producer is told to stop,
    /// not to reconnect or count it as its own fault).
    fn drop_connection_as(&mut self, problem: &str, ended: bool) {
        if let Some((connection, generation)) = self.connection.take() {
            let state = &self.server.state;
            state.log(&format!(
                "{}: slot {}: {problem}; connection closed",
                connection.peer(),
                self.slot
            ));
            // Free before the peer reads the reason: a producer told of its fault may reconnect at once.
            release_slot(state, self.slot, generation);
            connection.refuse_with(Reply {
                ended,
                ..Reply::error(problem)
            });
        }
        // The message refused half-way takes back its rows; those of acknowledged messages go to the queue.
        if self.message.take().is_some() {
            self.open.roll_back();
        }
        self.ack_due = None;
        self.flush = true;
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

    /// Waits until an item is ready to hand out, the slot's producer is done, or `stop` is set; reads and
    /// places messages meanwhile.
    fn await_message(&mut self, stop: &AtomicBool) -> Result<(), SourceError> {
        let mut idle_since = Instant::now();
        loop {
            if self.ready.is_some() || stop.load(Ordering::Acquire) {
                return Ok(());
            }
            if self.message.is_some() {
                self.place_message();
                continue;
            }
            if self.ack_due.is_some() {
                self.settle_ack();
                continue;
            }
            if self.flush {
                self.ready = self.open.first_held();
                self.flush = self.ready.is_some();
                continue;
            }
            if self.done_pending {
                self.finish_slot();
                continue;
            }
            if self.finished {
                return Ok(());
            }
            // A newer connection from this slot replaces the one held (the producer reconnected).
            if let Ok((connection, generation)) = self.incoming.try_recv() {
                if self.connection.is_some() {
                    self.drop_connection("replaced by a newer connection of the same producer");
                }
                self.take_connection((connection, generation));
            }
            let Some((connection, _)) = &mut self.connection else {
                match self.incoming.recv_timeout(POLL) {
                    Ok(handed) => self.take_connection(handed),
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => {
                        self.finished = true;
                        self.flush = true;
                    }
                }
                continue;
            };
            let config = &self.server.state.config;
            let replacement = &self.server.state.replacement[self.slot];
            // Part-filled items wait for more rows as long as a message may stall, then go as they are.
            let holding = self.open.held() > 0;
            let mut idle = false;
            let read =
                connection.read_frame_len(config.max_message_bytes, config.read_timeout, || {
                    idle = holding && idle_since.elapsed() >= config.read_timeout;
                    !idle
                        && !stop.load(Ordering::Acquire)
                        && !replacement.swap(false, Ordering::AcqRel)
                });
            match read {
                Ok(0) => self.producer_done(),
                Ok(len) => {
                    self.receive_message(len, stop);
                    idle_since = Instant::now();
                }
                Err(WireError::Stopped) => {
                    if idle {
                        self.flush = true;
                        idle_since = Instant::now();
                    }
                }
                Err(WireError::Closed) => {
                    let (connection, generation) =
                        self.connection.take().expect("a connection was read");
                    self.state().log(&format!(
                        "{}: slot {}: producer disconnected",
                        connection.peer(),
                        self.slot
                    ));
                    release_slot(self.state(), self.slot, generation);
                    self.flush = true;
                }
                Err(e) => self.drop_connection(&e.to_string()),
            }
        }
    }

    /// Places the current buffered message's rows until an item is full or every row is placed (then its
    /// acknowledgement is due); a row that fails its conversion drops the connection.
    fn place_message(&mut self) {
        let Some(message) = self.message.as_mut() else {
            return;
        };
        match message.place_next(&mut self.open, &self.server.state.config.shapes) {
            Ok(Some(bucket)) => self.ready = Some(bucket),
            Ok(None) => {
                let message = self.message.take().expect("a message is being placed");
                self.ack_due = Some(AckDue {
                    batches: self.cut,
                    sequences: message.sequences() as u64,
                });
                self.buffer = message.into_bytes();
            }
            Err(error) => self.drop_connection(&error.to_string()),
        }
    }

    /// The producer said `done`: hand out the rows held open, then [`Self::finish_slot`].
    fn producer_done(&mut self) {
        self.done_pending = true;
        self.flush = true;
        self.cut = 0;
    }

    /// Acknowledges `done` (every row of the producer is queued), closes, and ends this slot's stream.
    fn finish_slot(&mut self) {
        self.done_pending = false;
        let Some((mut connection, generation)) = self.connection.take() else {
            self.finished = true;
            return;
        };
        let delivered = {
            let mut slots = self.state().slots();
            slots[self.slot].done = true;
            slots[self.slot].delivered
        };
        let _ = connection.send(&Reply {
            ok: true,
            done: true,
            delivered: Some(delivered),
            // The part-filled items its last rows were in, queued before this reply.
            batches: Some(self.cut),
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

    /// Reads the body of a message frame of `len` bytes and places its rows (at once when it was read straight
    /// into an open item, else through [`Self::place_message`]); a bad one (or a connection that fails inside
    /// it) drops the connection. A stop raised while the body arrives abandons it (see the receiver).
    fn receive_message(&mut self, len: u64, stop: &AtomicBool) {
        let Some((connection, _)) = &mut self.connection else {
            return;
        };
        let state = &self.server.state;
        let delivered = state.slots()[self.slot].delivered;
        let origin = PathBuf::from(format!("{} message {}", connection.peer(), delivered + 1));
        let config = &state.config;
        self.open.mark();
        self.cut = 0;
        let received = self.receiver.receive(
            connection,
            len,
            config,
            (&origin, &|| stop.load(Ordering::Acquire)),
            &mut self.buffer,
            &mut self.open,
        );
        match received {
            Ok(Received::Buffered) => self.accept_message(origin, len as usize),
            Ok(Received::Placed {
                bucket,
                sequences,
                masks,
            }) => {
                // Not yet counted as filled: refused here, the rows read into the open item are dropped.
                if let Err(problem) = self.admit_masks(&masks) {
                    self.drop_connection(&problem);
                    return;
                }
                let config = &self.server.state.config;
                if self.open.filled(bucket, sequences, &config.shapes) {
                    self.ready = Some(bucket);
                }
                self.ack_due = Some(AckDue {
                    batches: u64::from(self.ready.is_some()),
                    sequences: sequences as u64,
                });
            }
            // A message cut off by the run's end: the producer stops (`hf` exits 0), and resumes after it.
            Err(ReceiveError::Wire(e @ WireError::Abandoned { .. })) => {
                self.drop_connection_as(&e.to_string(), true);
            }
            Err(ReceiveError::Wire(e)) => self.drop_connection(&e.to_string()),
            Err(ReceiveError::Content(e)) => self.drop_connection(&e.to_string()),
        }
    }

    /// Checks a message read whole into the buffer and makes it the one whose rows are placed next; a bad one
    /// drops the connection.
    fn accept_message(&mut self, origin: PathBuf, len: usize) {
        let buffer = std::mem::take(&mut self.buffer);
        let config = &self.server.state.config;
        match Message::parse(origin, buffer, len, &config.target, &config.shapes) {
            Ok(message) => match self.admit_masks(&message.masks) {
                Ok(()) => self.message = Some(Box::new(message)),
                Err(problem) => {
                    self.buffer = message.into_bytes();
                    self.drop_connection(&problem);
                }
            },
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
        self.await_message(stop)?;
        Ok(self.ready)
    }

    fn fill_next(&mut self, out: &mut HsBatch) -> Result<(), SourceError> {
        let shapes = &self.server.state.config.shapes;
        let Some(bucket) = self.ready else {
            return Err(SourceError::Buffer(format!(
                "stream slot {} has no batch to fill from",
                self.slot
            )));
        };
        if !self.open.hand_out(bucket, out, shapes) {
            // Its rows passed their checks, so this is a buffer mismatch: the run's fault, not the peer's.
            return Err(SourceError::Buffer(format!(
                "a batch of bucket {bucket} {:?} needs its shape, got a {}×{} buffer",
                shapes.buckets[bucket], out.sequences, out.padded_len
            )));
        }
        self.ready = None;
        self.cut += 1;
        out.source_position = self.next;
        self.next += self.server.state.config.producers as u64;
        Ok(())
    }

    fn position(&self) -> u64 {
        self.next
    }

    fn seek(&mut self, position: u64) -> Result<(), SourceError> {
        check_owned(position, self.slot, self.server.state.config.producers)?;
        self.next = position;
        Ok(())
    }

    fn mask_probe(&self) -> Option<super::MaskProbe> {
        let state = Arc::clone(&self.server.state);
        Some(super::MaskProbe::new(move || state.masks().clone()))
    }

    fn stream_status(&self) -> Option<StreamStatus> {
        Some(StreamStatus {
            state: Arc::clone(&self.server.state),
        })
    }

    fn status_probe(&self) -> Option<super::SourceStatusProbe> {
        let status = StreamStatus {
            state: Arc::clone(&self.server.state),
        };
        Some(super::SourceStatusProbe::new(move || status.describe()))
    }
}

impl Drop for StreamSource {
    /// A producer still connected when the run stops is told so (it then exits rather than retrying).
    fn drop(&mut self) {
        if let Some((mut connection, generation)) = self.connection.take() {
            let _ = connection.send(&Reply {
                ended: true,
                ..Reply::error(wire::RUN_ENDED)
            });
            connection.close();
            release_slot(self.state(), self.slot, generation);
        }
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
