//! What the run sees of a stream server: the status line's `producers=[…]` field, and the producers' names and
//! counts that a checkpoint saves and a resumed run gives back (`TrainingState::stream_producers`).
//!
//! ```text
//!  ServerState (slots, known names) ──StreamStatus──▶ status line (describe), checkpoint (records),
//!                                                      resume (restore, before any producer connects)
//! ```

use std::sync::Arc;

use super::ServerState;
use crate::checkpoint::ProducerRecord;

/// What the status line shows of a stream: producers connected out of those expected.
#[derive(Clone)]
pub struct StreamStatus {
    pub(super) state: Arc<ServerState>,
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

    /// `producers=[3/5 connected]`, and while some are missing, which ones the run waits for:
    /// `producers=[1/3 connected; waiting for gpu1 (lost, may reconnect), slot 2 (never connected)]`.
    pub fn describe(&self) -> String {
        let slots = self.state.slots();
        let connected = slots.iter().filter(|s| s.connected.is_some()).count();
        let waiting: Vec<String> = slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.connected.is_none() && !s.done)
            .map(|(w, s)| match &s.name {
                Some(name) => format!("{name} (lost, may reconnect)"),
                None => format!("slot {w} (never connected)"),
            })
            .collect();
        let mut line = format!("producers=[{connected}/{} connected", slots.len());
        if !waiting.is_empty() {
            line.push_str("; waiting for ");
            line.push_str(&waiting.join(", "));
        }
        line.push(']');
        line
    }

    /// Messages acknowledged per slot so far (of the producer that holds it now).
    pub fn delivered(&self) -> Vec<u64> {
        self.state.slots().iter().map(|s| s.delivered).collect()
    }

    /// Every named producer seen: its slot (if it still holds one) and its messages acknowledged.
    pub fn records(&self) -> Vec<ProducerRecord> {
        let slots = self.state.slots();
        let known = self.state.known();
        let held = slots.iter().enumerate().filter_map(|(w, slot)| {
            slot.name.as_ref().map(|name| ProducerRecord {
                name: name.clone(),
                slot: Some(w),
                delivered: slot.delivered,
            })
        });
        let released = known.iter().map(|(name, &delivered)| ProducerRecord {
            name: name.clone(),
            slot: None,
            delivered,
        });
        held.chain(released).collect()
    }

    /// Gives the producers of a checkpoint back their slots and counts (before any connects): a producer that
    /// reconnects under its name then learns where its acknowledged messages end.
    pub fn restore(&self, records: &[ProducerRecord]) {
        let mut slots = self.state.slots();
        let mut known = self.state.known();
        for record in records {
            match record.slot.and_then(|w| slots.get_mut(w)) {
                Some(slot) if slot.name.is_none() => {
                    slot.name = Some(record.name.clone());
                    slot.delivered = record.delivered;
                }
                _ => {
                    known.insert(record.name.clone(), record.delivered);
                }
            }
        }
    }

    /// The address producers connect to.
    pub fn address(&self) -> &str {
        &self.state.address
    }
}
