//! Accepting producer connections and checking their hellos, all on the acceptor thread: every connection
//! waiting for its hello is read as its bytes arrive (`poll(2)` over the listener and the waiting sockets), not
//! by a thread of its own, so a flood of connections costs a table entry each and can never leave a producer
//! unanswered because no thread could be started.
//!
//! ```text
//!  Listener ──accept──▶ waiting hellos (≤ 64 in all, ≤ 8 per remote address; a hello whole within
//!        read_timeout of the accept) ──hello checked, slot chosen by name──▶ handoff[w]
//! ```
//!
//! Nobody can hold the door: a connection that arrives when its address (or the whole table) has no place left
//! takes the place of the oldest waiting connection of that address (or of the address holding the most
//! places), which is refused with `retry`. An attacker's connections therefore only ever displace each other,
//! or, on this machine, where every process is one address, the oldest first; and a producer, which sends its
//! hello as it connects, is read in the acceptor's next round, long before it is the oldest. Once its hello is
//! whole and checked (the right token; without one, on loopback, its name) it no longer needs a place.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::wire::{
    Connection, Hello, Listener, POLL, PROTOCOL_VERSION, PartialFrame, Reply, WireError,
};
use super::{ServerState, StreamConfig, release_slot};

/// Connections waiting for their hello, in all.
pub(super) const MAX_WAITING_HELLOS: usize = 64;

/// Connections waiting for their hello from one remote address (loopback and unix peers, this machine's
/// processes, share the whole table: they cannot be told apart by address).
pub(super) const MAX_WAITING_PER_ADDRESS: usize = 8;

/// Connections accepted per round before the waiting ones are read again, so the hellos already sent are
/// read before a burst of newer connections could displace them.
const ACCEPTS_PER_ROUND: usize = MAX_WAITING_PER_ADDRESS;

/// How often at most the acceptor logs the connections that gave their place to newer ones (an attack must
/// not flood the log).
const DISPLACED_LOG_EVERY: Duration = Duration::from_secs(1);

/// A connection whose hello has not arrived whole yet.
struct Waiting {
    connection: Connection,
    hello: PartialFrame,
    /// The accept plus `read_timeout`: the whole hello must be in by then.
    deadline: Instant,
}

/// The connections waiting for their hello, oldest first, and the count of those displaced since the last log.
struct WaitingHellos {
    waiting: Vec<Waiting>,
    displaced: u64,
    /// When displaced connections were last logged (`None`: never, so the first is logged at once).
    displaced_logged: Option<Instant>,
}

pub(super) fn accept_loop(listener: &Listener, state: &Arc<ServerState>) {
    let mut hellos = WaitingHellos {
        waiting: Vec::with_capacity(MAX_WAITING_HELLOS),
        displaced: 0,
        displaced_logged: None,
    };
    while !state.stop.load(Ordering::Acquire) {
        hellos.read_all(state);
        let accepted = accept_some(listener, &mut hellos, state);
        hellos.log_displaced(state);
        if accepted < ACCEPTS_PER_ROUND {
            hellos.wait_for_bytes(listener);
        }
    }
    for waiting in hellos.waiting {
        waiting.connection.refuse_with(Reply {
            ended: true,
            ..Reply::error(super::wire::RUN_ENDED)
        });
    }
}

/// Accepts up to [`ACCEPTS_PER_ROUND`] connections: each hello already whole is checked at once, the others
/// wait for theirs. Returns how many were accepted.
fn accept_some(listener: &Listener, hellos: &mut WaitingHellos, state: &ServerState) -> usize {
    for accepted in 0..ACCEPTS_PER_ROUND {
        let connection = match listener.accept() {
            Ok(Some(connection)) => connection,
            Ok(None) => return accepted,
            Err(e) => {
                // Out of file descriptors, say: the pending connection stays queued; try again shortly.
                state.log(&format!("accept failed: {e}"));
                std::thread::sleep(POLL);
                return accepted;
            }
        };
        let configured = connection
            .set_write_timeout(state.config.read_timeout)
            .and_then(|()| connection.set_nonblocking(true));
        if let Err(e) = configured {
            refuse(
                state,
                connection,
                &format!("cannot configure the socket: {e}"),
            );
            continue;
        }
        let mut waiting = Waiting {
            connection,
            hello: PartialFrame::default(),
            deadline: Instant::now() + state.config.read_timeout,
        };
        match waiting.hello.read_from(&mut waiting.connection) {
            Ok(Some(body)) => handshake(waiting.connection, &body, state),
            Ok(None) => {
                hellos.make_room(waiting.connection.remote());
                hellos.waiting.push(waiting);
            }
            Err(e) => hello_failed(state, waiting.connection, &e),
        }
    }
    ACCEPTS_PER_ROUND
}

impl WaitingHellos {
    /// Reads what every waiting connection has sent: a whole hello is checked (and leaves the table), a
    /// connection past its deadline or failed is refused.
    fn read_all(&mut self, state: &ServerState) {
        let now = Instant::now();
        let mut index = 0;
        while index < self.waiting.len() {
            let waiting = &mut self.waiting[index];
            match waiting.hello.read_from(&mut waiting.connection) {
                Ok(None) if now < waiting.deadline => index += 1,
                Ok(None) => {
                    let late = self.waiting.remove(index);
                    let error = WireError::Late {
                        got: late.hello.received(),
                        expected: late.hello.expected(),
                        timeout: state.config.read_timeout,
                    };
                    hello_failed(state, late.connection, &error);
                }
                Ok(Some(body)) => {
                    let whole = self.waiting.remove(index);
                    handshake(whole.connection, &body, state);
                }
                Err(e) => {
                    let failed = self.waiting.remove(index);
                    hello_failed(state, failed.connection, &e);
                }
            }
        }
    }

    /// Frees a place for a connection from `remote` (`None`: this machine): the oldest waiting connection of
    /// that address when it holds its share, else, when the table is full, the oldest of the address holding
    /// the most places gives way, refused with `retry`.
    fn make_room(&mut self, remote: Option<IpAddr>) {
        let held = |address: Option<IpAddr>| {
            self.waiting
                .iter()
                .filter(|w| w.connection.remote() == address)
                .count()
        };
        let victim = if remote.is_some() && held(remote) >= MAX_WAITING_PER_ADDRESS {
            remote
        } else if self.waiting.len() >= MAX_WAITING_HELLOS {
            let mut places: BTreeMap<Option<IpAddr>, usize> = BTreeMap::new();
            for waiting in &self.waiting {
                *places.entry(waiting.connection.remote()).or_default() += 1;
            }
            places
                .into_iter()
                .max_by_key(|&(_, count)| count)
                .map(|(address, _)| address)
                .unwrap_or(remote)
        } else {
            return;
        };
        let Some(oldest) = self
            .waiting
            .iter()
            .position(|w| w.connection.remote() == victim)
        else {
            return;
        };
        let displaced = self.waiting.remove(oldest);
        self.displaced += 1;
        displaced.connection.refuse_with(Reply {
            retry: true,
            ..Reply::error(format!(
                "{} of {} bytes of the hello had arrived when newer connections needed the place \
                 ({MAX_WAITING_HELLOS} connections may wait for their hello, {MAX_WAITING_PER_ADDRESS} from one \
                 remote address): try again, sending the hello as you connect",
                displaced.hello.received(),
                displaced.hello.expected()
            ))
        });
    }

    fn log_displaced(&mut self, state: &ServerState) {
        let due = self
            .displaced_logged
            .is_none_or(|logged| logged.elapsed() >= DISPLACED_LOG_EVERY);
        if self.displaced > 0 && due {
            state.log(&format!(
                "{} connections waiting for their hello gave their place to newer ones (refused for now; \
                 {MAX_WAITING_HELLOS} may wait, {MAX_WAITING_PER_ADDRESS} from one remote address)",
                self.displaced
            ));
            self.displaced = 0;
            self.displaced_logged = Some(Instant::now());
        }
    }

    /// Sleeps until the listener or a waiting connection has something to read, the nearest hello deadline,
    /// or [`POLL`] (to look at the stop flag), whichever comes first.
    fn wait_for_bytes(&self, listener: &Listener) {
        let now = Instant::now();
        let timeout = self
            .waiting
            .iter()
            .map(|w| w.deadline.saturating_duration_since(now))
            .fold(POLL, Duration::min);
        let mut fds: Vec<libc::pollfd> = std::iter::once(listener.as_raw_fd())
            .chain(self.waiting.iter().map(|w| w.connection.as_raw_fd()))
            .map(|fd| libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        let millis = libc::c_int::try_from(timeout.as_millis().max(1)).unwrap_or(libc::c_int::MAX);
        // SAFETY: `fds` is a live, exclusively borrowed array of `fds.len()` pollfd entries for the duration of
        // the call, and every descriptor in it stays open (owned by `listener` and `self.waiting`) meanwhile.
        // An error (EINTR) just ends the wait early.
        unsafe {
            libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, millis);
        }
    }
}

/// A connection whose hello did not arrive (closed, cut, too large, late): refused with the reason.
fn hello_failed(state: &ServerState, connection: Connection, error: &WireError) {
    match error {
        WireError::Late { .. } => refuse(state, connection, &format!("no hello: {error}")),
        _ => refuse(state, connection, &format!("bad hello: {error}")),
    }
}

/// Checks a hello against the plan and hands the connection to a slot, or refuses it.
fn handshake(mut connection: Connection, body: &[u8], state: &ServerState) {
    let config = &state.config;
    let hello: Hello = match serde_json::from_slice(body) {
        Ok(hello) => hello,
        Err(e) => {
            let error = WireError::Malformed {
                what: "hello",
                detail: e.to_string(),
            };
            return hello_failed(state, connection, &error);
        }
    };
    if let Err(problem) = check_hello(&hello, config) {
        return refuse(state, connection, &problem);
    }
    let generation = state.generation.fetch_add(1, Ordering::Relaxed) as u64;
    let assigned = {
        let mut slots = state.slots();
        let slot = match &hello.producer {
            Some(name) => slots.iter().position(|s| s.name.as_ref() == Some(name)),
            None => None,
        }
        .or_else(|| {
            slots
                .iter()
                .position(|s| s.name.is_none() && s.connected.is_none())
        })
        .or_else(|| slots.iter().position(|s| s.connected.is_none() && !s.done));
        match slot {
            Some(w) if slots[w].done => {
                let problem = format!(
                    "producer `{}` already said it is done",
                    hello.producer.as_deref().unwrap_or("?")
                );
                drop(slots);
                return refuse(state, connection, &problem);
            }
            Some(w) => {
                let slot = &mut slots[w];
                // Counts belong to names: a new name in a slot starts from its own count, not the slot's.
                slot.take_over(hello.producer.as_ref(), &mut state.known());
                slot.connected = Some(generation);
                Ok((w, slot.delivered))
            }
            None if slots.iter().all(|s| s.done) => {
                let problem = format!("all {} producers already said they are done", slots.len());
                drop(slots);
                return refuse(state, connection, &problem);
            }
            // Every slot not done holds a connection: one may drop (a producer restarting), so try again.
            None => Err(Busy(format!(
                "all {} producer slots are connected or done",
                slots.len()
            ))),
        }
    };
    let (slot, delivered) = match assigned {
        Ok(assigned) => assigned,
        Err(Busy(problem)) => return refuse_for_now(state, connection, &problem),
    };
    let reply = Reply {
        ok: true,
        slot: Some(slot),
        max_message_bytes: Some(config.max_message_bytes),
        delivered: Some(delivered),
        largest_bucket: config.shapes.buckets.last().map(|&(len, _)| len),
        batch_tokens: Some(config.target.batch_tokens),
        last_hidden_states: config.shapes.last_hidden.is_some(),
        ..Reply::default()
    };
    let peer = connection.peer().to_string();
    // Sent while non-blocking: a fresh connection's send buffer holds the small reply, so the acceptor never
    // waits on a peer; then blocking again, for the slot's thread that reads the messages.
    let answered = connection
        .send(&reply)
        .and_then(|()| connection.set_nonblocking(false).map_err(WireError::from));
    if let Err(e) = answered {
        state.log(&format!("{peer}: cannot answer the hello: {e}"));
        release_slot(state, slot, generation);
        return;
    }
    state.log(&format!(
        "{peer}: producer `{}` connected as slot {slot}",
        hello.producer.as_deref().unwrap_or("unnamed")
    ));
    if state.handoff[slot].send((connection, generation)).is_err() {
        // The slot's source is gone: the run is ending.
        release_slot(state, slot, generation);
    } else {
        state.replacement[slot].store(true, Ordering::Release);
    }
}

fn check_hello(hello: &Hello, config: &StreamConfig) -> Result<(), String> {
    if hello.protocol != PROTOCOL_VERSION {
        return Err(format!(
            "protocol version {} is not supported (this server speaks {PROTOCOL_VERSION})",
            hello.protocol
        ));
    }
    if let Some(token) = &config.token
        && !constant_time_eq(token.as_bytes(), hello.token.as_bytes())
    {
        return Err("wrong token".into());
    }
    let target = &config.target;
    if hello.hidden != target.hidden {
        return Err(format!(
            "hidden {} does not match the plan's hidden {}",
            hello.hidden, target.hidden
        ));
    }
    if hello.tap_layers != target.tap_layers {
        return Err(format!(
            "tap_layers {:?} do not match the plan's tap_layers {:?}",
            hello.tap_layers, target.tap_layers
        ));
    }
    if hello.vocab != target.vocab {
        return Err(format!(
            "vocab {} does not match the plan's vocab {}",
            hello.vocab, target.vocab
        ));
    }
    Ok(())
}

/// Compares two tokens in time that depends on their lengths only, so timing does not reveal a prefix.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn refuse(state: &ServerState, connection: Connection, problem: &str) {
    state.log(&format!("{}: refused: {problem}", connection.peer()));
    connection.refuse(problem);
}

/// A refusal that is only for now: every producer slot is taken.
struct Busy(String);

/// Refuses with `retry` set, so the producer tries again after a while instead of giving up.
fn refuse_for_now(state: &ServerState, connection: Connection, problem: &str) {
    state.log(&format!(
        "{}: refused for now: {problem}",
        connection.peer()
    ));
    connection.refuse_with(Reply {
        retry: true,
        ..Reply::error(problem)
    });
}
