//! The queue's signals for the bottleneck diagnosis: depth (the status line's `q_hs` and
//! `q_hsb`), traffic, and how long each side waited for the other.

use std::time::{Duration, Instant};

use serde::Serialize;

use super::sync::{AtomicU64, Ordering};

/// A snapshot of a queue's state and counters, read without stopping it. Fields are read one by
/// one, so under traffic they may disagree by the few operations in flight.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct QueueStats {
    /// Items in the queue, counting pushes and pops in flight; never above `capacity`.
    pub depth: usize,
    /// Published items per bucket, in bucket order. Each bucket is read on its own, so under
    /// traffic the sum may briefly differ from `depth` (an item taken from a bucket already read
    /// while another lands in one not yet read counts twice).
    pub per_bucket: Vec<usize>,
    /// The most items the queue holds.
    pub capacity: usize,
    /// The consumers' watermark.
    pub min_ready: usize,
    /// Items pushed since creation.
    pub pushes: u64,
    /// Items popped since creation (counted when a consumer claims one).
    pub pops: u64,
    /// Total time producers spent waiting for room (blocking and timed pushes).
    pub producer_blocked: Duration,
    /// Total time consumers spent waiting for the watermark or the drain (blocking and timed pops).
    pub consumer_blocked: Duration,
    /// Push calls that found the queue full at least once.
    pub seen_full: u64,
    /// Pop calls that found fewer than `min_ready` items queued (empty included) at least once;
    /// on a queue with rounds, round pops that found no round to claim.
    pub seen_below_watermark: u64,
    /// Rounds handed to the group of a queue [with rounds](super::HsQueue::with_rounds) (0 without).
    pub rounds: u64,
}

/// The slow-path counters behind [`QueueStats`] (pushes and pops are the queue's own
/// `published` and `claimed` counters, so the fast paths pay nothing extra for them).
pub(crate) struct Counters {
    producer_blocked_ns: AtomicU64,
    consumer_blocked_ns: AtomicU64,
    pub(crate) seen_full: AtomicU64,
    pub(crate) seen_below_watermark: AtomicU64,
}

impl Counters {
    pub(crate) fn new() -> Self {
        Self {
            producer_blocked_ns: AtomicU64::new(0),
            consumer_blocked_ns: AtomicU64::new(0),
            seen_full: AtomicU64::new(0),
            seen_below_watermark: AtomicU64::new(0),
        }
    }

    pub(crate) fn producer_waited(&self, since: Instant) {
        self.producer_blocked_ns
            .fetch_add(nanos(since.elapsed()), Ordering::Relaxed);
    }

    pub(crate) fn consumer_waited(&self, since: Instant) {
        self.consumer_blocked_ns
            .fetch_add(nanos(since.elapsed()), Ordering::Relaxed);
    }

    pub(crate) fn producer_blocked(&self) -> Duration {
        Duration::from_nanos(self.producer_blocked_ns.load(Ordering::Relaxed))
    }

    pub(crate) fn consumer_blocked(&self) -> Duration {
        Duration::from_nanos(self.consumer_blocked_ns.load(Ordering::Relaxed))
    }
}

/// Saturating: 2^64 ns is 584 years of waiting.
fn nanos(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX)
}
