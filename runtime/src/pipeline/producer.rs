//! One producer thread: fill pooled batches from its source and push them into the queue.

use std::sync::PoisonError;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::queue::PushError;
use crate::source::Producer;
use crate::telemetry::{ProducerPhase, ProducerRecorder};

use super::{RunError, Shared};

/// Produces until the source is exhausted, the queue closes, or the drafters are done. A source error stops
/// the run, or only this producer under `keep_going`.
pub(super) fn run(
    worker: usize,
    mut producer: Producer,
    shared: &Shared,
    recorder: &ProducerRecorder,
    keep_going: bool,
    max_rate: Option<f64>,
) {
    let mut since = Instant::now();
    let mut pace = max_rate.map(|rate| (Instant::now(), Duration::from_secs_f64(1.0 / rate)));
    while !shared.producers_stop.load(Ordering::Acquire) {
        // `max_rate`: the target makes one item per period at most; the wait counts as producing.
        if let Some((next, period)) = &mut pace {
            let now = Instant::now();
            std::thread::sleep(next.saturating_duration_since(now));
            *next = (*next).max(now) + *period;
        }
        let batch = match producer.next_batch(&shared.pool, &shared.producers_stop) {
            Ok(Some(batch)) => batch,
            Ok(None) => break,
            Err(source) => {
                if keep_going {
                    shared
                        .producer_errors
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .push(format!("producer {worker}: {source}"));
                } else {
                    shared.fail(RunError::Producer { worker, source });
                }
                break;
            }
        };
        recorder.lap(ProducerPhase::Produce, &mut since);
        let tokens = batch.tokens() as u64;
        match shared.queue.push(batch) {
            Ok(()) => {
                recorder.lap(ProducerPhase::BlockedFull, &mut since);
                recorder.item_done(tokens);
            }
            Err(PushError::TooLong { item, len, max }) => {
                // The source routes sequences by the plan's buckets, so this is a source bug, not bad input;
                // it still stops the run with the numbers rather than a panic.
                let _ = shared.pool.give_back(item);
                shared.fail(RunError::Unsupported(format!(
                    "producer {worker} made a batch of length {len}, longer than the largest bucket {max}"
                )));
                break;
            }
            Err(error) => {
                let _ = shared.pool.give_back(error.into_inner());
                break;
            }
        }
    }
    shared.producer_finished();
}
