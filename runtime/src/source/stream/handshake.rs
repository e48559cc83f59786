//! Accepting producer connections: the acceptor thread, and one handshake thread per connection that checks
//! its hello against the plan and hands it to a producer slot (or refuses it with the reason).
//!
//! ```text
//!  Listener ──accept_loop──▶ handshake thread (≤ 64 waiting) ──hello checked, slot chosen by name──▶ handoff[w]
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::wire::{Connection, Hello, Listener, POLL, PROTOCOL_VERSION, Reply, WireError};
use super::{ServerState, StreamConfig, release_slot};

/// Hellos checked at once; more connections waiting for their hello are refused, so a flood of idle
/// connections cannot make the server start a thread for each.
const MAX_PENDING_HELLOS: usize = 64;

pub(super) fn accept_loop(listener: &Listener, state: &Arc<ServerState>) {
    let pending = Arc::new(AtomicUsize::new(0));
    while !state.stop.load(Ordering::Acquire) {
        match listener.accept() {
            Ok(Some(connection)) => {
                if let Err(e) = connection.set_write_timeout(state.config.read_timeout) {
                    refuse(
                        state,
                        connection,
                        &format!("cannot configure the socket: {e}"),
                    );
                    continue;
                }
                if pending.fetch_add(1, Ordering::AcqRel) >= MAX_PENDING_HELLOS {
                    pending.fetch_sub(1, Ordering::AcqRel);
                    refuse_for_now(
                        state,
                        connection,
                        &format!(
                            "{MAX_PENDING_HELLOS} connections are already waiting for their hello"
                        ),
                    );
                    continue;
                }
                let (shared, count) = (Arc::clone(state), Arc::clone(&pending));
                let spawned = std::thread::Builder::new()
                    .name("stream-hello".into())
                    .spawn(move || {
                        handshake(connection, &shared);
                        count.fetch_sub(1, Ordering::AcqRel);
                    });
                if let Err(e) = spawned {
                    pending.fetch_sub(1, Ordering::AcqRel);
                    state.log(&format!("cannot start a handshake thread: {e}"));
                }
            }
            Ok(None) => std::thread::sleep(POLL),
            Err(e) => {
                state.log(&format!("accept failed: {e}"));
                std::thread::sleep(POLL);
            }
        }
    }
}

/// Checks a hello against the plan and hands the connection to a slot, or refuses it.
fn handshake(mut connection: Connection, state: &ServerState) {
    let config = &state.config;
    let hello: Hello = match connection.read_json("hello", config.read_timeout, &state.stop) {
        Ok(hello) => hello,
        Err(WireError::Stopped) if !state.stop.load(Ordering::Acquire) => {
            return refuse(
                state,
                connection,
                &format!("no hello within {:?}", config.read_timeout),
            );
        }
        Err(e) => return refuse(state, connection, &format!("bad hello: {e}")),
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
    if let Err(e) = connection.send(&reply) {
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

/// A refusal that is only for now: every handshake or producer slot is taken.
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
