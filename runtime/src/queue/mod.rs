//! The hidden-state queue between target-model producers and drafter consumers: bounded,
//! bucketed by sequence length, with a `min_ready` watermark and a pull policy, lock-free on its
//! fast paths.
//!
//! ```text
//!  sources ──try_push/push──▶ [bucket 0 │ bucket 1 │ … ] ──pop (≥ min_ready queued)──▶ drafters
//!                               capacity over all buckets        pull policy picks the item
//! ```
//!
//! Items are handles (`Box<HsBatch>`, a pooled buffer): the queue moves them, never the bytes. An
//! item goes to the first bucket whose bound holds its [`SeqLen::seq_len`]; a longer one is
//! refused with [`PushError::TooLong`], which names both numbers.
//!
//! # Semantics
//!
//! - **Capacity**: the items queued over all buckets never exceed [`QueueConfig::capacity`].
//!   [`HsQueue::try_push`] hands the item back in [`PushError::Full`] (backpressure);
//!   [`HsQueue::push`] parks until there is room; [`HsQueue::push_timeout`] gives up at a deadline.
//! - **Watermark**: a consumer takes an item only while at least `min_ready` are queued, so a
//!   random pull always chooses among several. After [`HsQueue::close`] the watermark is lifted:
//!   consumers drain what is left, then [`HsQueue::pop`] returns `None`. Pushes after close fail
//!   with [`PushError::Closed`]; a push that reserved its slot before the close still lands and
//!   is drained, so nothing a producer was told is queued is ever lost.
//! - **Pull policies** ([`PullPolicy`]): `random_in_bucket` visits the non-empty buckets
//!   round-robin and takes a uniformly random item of the chosen bucket (diversity; seeded by
//!   [`QueueConfig::seed`]); `round_robin` visits them the same way and takes the oldest item of
//!   the bucket; `fifo` takes the oldest item overall. Round-robin serves every non-empty bucket
//!   within one round of `buckets.len()` takes, so no bucket starves.
//! - **Rounds** ([`HsQueue::with_rounds`], [`HsQueue::pop_round`]): a queue built for a
//!   data-parallel group of `members` hands out rounds instead of single items: one bucket per
//!   round, chosen by the pull policy among the buckets that hold `members` items, one item of it
//!   per member, claimed whole, so the replicas of one all-reduce step never mix bucket lengths.
//!   The semantics, end of data included: docs/queue.md, "Rounds", and `rounds.rs`.
//! - **Statistics** ([`HsQueue::stats`]) are atomics read without a lock: depth in total and per
//!   bucket, pushes, pops, time each side spent blocked, and how often the queue was seen full or
//!   below the watermark: a queue pinned at capacity means the consumers are the bottleneck, one
//!   under the watermark means the producers are.
//!
//! # Why the protocol is correct
//!
//! Counters decide every operation before any item moves; a store per policy (`store.rs`) only
//! places and finds items:
//!
//! - `slots` counts reserved capacity: items queued plus pushes and pops in flight. Its top bit
//!   is the closed flag, so "open and below capacity" is checked and the slot reserved by one
//!   compare-and-swap; no push can reserve after `close` has set the bit.
//! - `published` and `claimed` count items made visible by producers and taken on by consumers
//!   since creation; `published - claimed` are the items ready to take. A consumer claims by a
//!   compare-and-swap of `claimed` from `c` to `c + 1`, made only after reading
//!   `published - c ≥ min_ready` (`≥ 1` once closed); `published` only grows, so the watermark
//!   held at the instant the swap succeeded, and the check and the claim are one atomic step.
//!   The two counters are also the statistics' `pushes` and `pops`, so counting costs nothing.
//!
//! A push: (1) reserve on `slots`; (2) write the item into the store; (3) publish with
//! `published += 1`; (4) wake a consumer if that met the watermark. A pop: (1) claim on
//! `claimed`; (2) take an item from the store; (3) release with `slots -= 1`; (4) wake a
//! producer. Hence `published-but-untaken items ≥ outstanding claims` at every instant, so a
//! claimant's search of the store always ends, and `items in the store ≤ slots ≤ capacity`, so
//! an insert by a slot holder always finds room. Exactly-once delivery follows because each
//! published item is matched to one claim, and the store hands each item to one taker
//! (crossbeam's `ArrayQueue`, or a `fetch_and` on the slot's `full` bit).
//!
//! Memory orderings: the counters use `SeqCst`. Their read-modify-writes include
//! release/acquire, so a consumer whose claim read `published` sees everything the publishing
//! producer did before its increment (the store's own orderings cover the item itself:
//! `ArrayQueue`'s stamps, or `full`'s Release/Acquire); and all `SeqCst` accesses form one total
//! order, which the parking argument below needs. On x86-64 every read-modify-write is a locked
//! instruction and a `SeqCst` load a plain load, so this costs nothing over `AcqRel`. The slot
//! bitmaps use Acquire to claim and Release to hand over (see `store.rs`); per-bucket depth
//! counters and blocked-time statistics are `Relaxed` (they order nothing).
//!
//! Parking (no lost wake-ups, no spinning a core): a waiter spins a short bounded while, then
//! increments its side's waiter count and re-checks the counters under a mutex before sleeping
//! on a condition variable; a notifier changes a counter and then reads the waiter count, taking
//! the mutex only when someone waits. In the `SeqCst` total order either the waiter's re-check
//! sees the change or the notifier sees the waiter (the Dekker pattern), and the mutex closes the
//! gap between re-check and sleep. So a publish that finds no waiter registered stops there,
//! without reading the consumers' counters. One publish past the watermark allows one more
//! claim and one release allows one reservation, so each wakes one waiter; every woken waiter
//! re-checks before sleeping again or timing out, so a wake-up is used or was made unnecessary
//! by another thread. `close` wakes all; after it, a publish below the watermark and every
//! release wake all consumers, since draining ones wait for the last in-flight push or pop to
//! settle.
//! `tests/queue_loom.rs` checks all of this with loom.
//!
//! # Examples
//!
//! ```
//! use draftpipe_runtime::queue::{HsQueue, PopError, PullPolicy, PushError, QueueConfig, SeqLen};
//!
//! struct Batch(usize);
//! impl SeqLen for Batch {
//!     fn seq_len(&self) -> usize {
//!         self.0
//!     }
//! }
//!
//! let config = QueueConfig {
//!     capacity: 3,
//!     min_ready: 2,
//!     buckets: vec![128, 512],
//!     pull: PullPolicy::RoundRobin,
//!     seed: 7,
//! };
//! let queue = HsQueue::new(config)?;
//! queue.try_push(Batch(100))?;
//! // One item is below the watermark of two: a consumer would wait.
//! assert_eq!(queue.try_pop().err(), Some(PopError::BelowWatermark));
//! queue.try_push(Batch(400))?;
//! queue.try_push(Batch(90))?;
//! // Full: the batch comes back to the producer.
//! let refused = queue.try_push(Batch(10)).unwrap_err();
//! assert!(matches!(refused, PushError::Full(_)));
//! // Too long for every bucket: refused with both numbers.
//! let err = queue.try_push(Batch(600)).unwrap_err();
//! assert_eq!(err.to_string(), "sequence length 600 is longer than the largest bucket (512)");
//!
//! assert_eq!(queue.stats().per_bucket, vec![2, 1]);
//! // Round-robin over buckets, oldest first inside one.
//! assert_eq!(queue.pop().map(|b| b.0), Some(100));
//! assert_eq!(queue.pop().map(|b| b.0), Some(400));
//! // After close the watermark no longer holds back the last item.
//! queue.close();
//! assert_eq!(queue.pop().map(|b| b.0), Some(90));
//! assert!(queue.pop().is_none());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Producers and consumers on their own threads:
//!
//! ```
//! use std::sync::Arc;
//! use std::thread;
//! use draftpipe_runtime::queue::{HsQueue, PullPolicy, QueueConfig, SeqLen};
//!
//! struct Len(usize);
//! impl SeqLen for Len {
//!     fn seq_len(&self) -> usize {
//!         self.0
//!     }
//! }
//!
//! let queue = Arc::new(HsQueue::new(QueueConfig {
//!     capacity: 20,
//!     min_ready: 10,
//!     buckets: vec![256, 1024, 4096],
//!     pull: PullPolicy::RandomInBucket,
//!     seed: 1,
//! })?);
//! let producer = {
//!     let queue = Arc::clone(&queue);
//!     thread::spawn(move || {
//!         for i in 0..1000 {
//!             // Parks while the queue is full.
//!             if queue.push(Len(i % 4096 + 1)).is_err() {
//!                 break;
//!             }
//!         }
//!         queue.close();
//!     })
//! };
//! let mut taken = 0;
//! while let Some(item) = queue.pop() {
//!     assert!(item.0 >= 1);
//!     taken += 1;
//! }
//! producer.join().unwrap();
//! assert_eq!(taken, 1000);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod baseline;
mod config;
mod error;
mod park;
mod rounds;
mod stats;
mod store;
mod sync;

use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;

pub use config::{MAX_CAPACITY, PullPolicy, QueueConfig};
pub use error::{PopError, PushError, QueueConfigError};
pub use rounds::RoundItem;
pub use stats::QueueStats;

use park::Parker;
use rounds::Rounds;
use stats::Counters;
use store::Store;
use sync::{AtomicU64, AtomicUsize, Ordering, seqcst_order_point};

/// What the queue routes an item by: its (longest) sequence length in tokens.
pub trait SeqLen {
    /// The length that picks the item's bucket.
    fn seq_len(&self) -> usize;
}

/// The top bit of `slots`: set once by [`HsQueue::close`].
const CLOSED: usize = 1 << (usize::BITS - 1);

/// The lock-free bucketed hidden-state queue; see the [module docs](self) for its semantics and
/// why the protocol is correct.
pub struct HsQueue<T> {
    config: QueueConfig,
    watermark: usize,
    /// Reserved capacity (queued items plus pushes and pops in flight), with the [`CLOSED`] bit.
    slots: CachePadded<AtomicUsize>,
    /// Items published since creation (monotone).
    published: CachePadded<AtomicU64>,
    /// Items claimed by consumers since creation (monotone, never above `published`).
    claimed: CachePadded<AtomicU64>,
    store: Store<T>,
    producers: Parker,
    consumers: Parker,
    counters: Counters,
    /// The data-parallel group this queue hands rounds to (`None`: single pops).
    rounds: Option<Rounds<T>>,
}

/// The outcome of a producer's reservation attempt.
enum Reserve {
    Reserved,
    Full,
    Closed,
}

/// The outcome of a consumer's claim attempt.
enum Claim {
    /// The caller holds a claim and must take one item.
    Claimed,
    /// Open, and fewer than the watermark are ready (possibly none).
    Below { ready: u64 },
    /// Closed, nothing ready, but a push or pop is still in flight.
    Settling,
    /// Closed and drained.
    Drained,
}

impl<T> HsQueue<T> {
    /// Builds an empty queue.
    ///
    /// # Errors
    /// [`QueueConfigError`] when the configuration fails [`QueueConfig::validate`].
    pub fn new(config: QueueConfig) -> Result<Self, QueueConfigError> {
        config.validate()?;
        Ok(Self::build(config, None))
    }

    fn build(config: QueueConfig, rounds: Option<Rounds<T>>) -> Self {
        // A round takes from one bucket, which one queue over all buckets cannot do: under rounds
        // `fifo` keeps its order per bucket.
        let layout = match config.pull {
            PullPolicy::Fifo if rounds.is_some() => PullPolicy::RoundRobin,
            pull => pull,
        };
        Self {
            watermark: config.watermark(),
            slots: CachePadded::new(AtomicUsize::new(0)),
            published: CachePadded::new(AtomicU64::new(0)),
            claimed: CachePadded::new(AtomicU64::new(0)),
            store: Store::new(layout, config.buckets.len(), config.capacity, config.seed),
            producers: Parker::new(),
            consumers: Parker::new(),
            counters: Counters::new(),
            rounds,
            config,
        }
    }

    /// The configuration the queue was built with.
    pub fn config(&self) -> &QueueConfig {
        &self.config
    }

    /// The most items the queue holds.
    pub fn capacity(&self) -> usize {
        self.config.capacity
    }

    /// Items in the queue, counting pushes and pops in flight.
    pub fn len(&self) -> usize {
        self.slots.load(Ordering::SeqCst) & !CLOSED
    }

    /// Whether nothing is in the queue (nor in flight).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether [`close`](Self::close) was called.
    pub fn is_closed(&self) -> bool {
        self.slots.load(Ordering::SeqCst) & CLOSED != 0
    }

    /// Closes the queue: later pushes fail with [`PushError::Closed`], and consumers drain what is
    /// left without waiting for the watermark. Waiting producers and consumers wake up.
    pub fn close(&self) {
        self.slots.fetch_or(CLOSED, Ordering::SeqCst);
        seqcst_order_point();
        self.producers.notify_all();
        self.consumers.notify_all();
    }

    /// A snapshot of depth and counters, taken without stopping the queue.
    pub fn stats(&self) -> QueueStats {
        QueueStats {
            depth: self.len(),
            per_bucket: self.store.depths(),
            capacity: self.config.capacity,
            min_ready: self.config.min_ready,
            pushes: self.published.load(Ordering::Relaxed),
            pops: self.claimed.load(Ordering::Relaxed),
            producer_blocked: self.counters.producer_blocked(),
            consumer_blocked: self.counters.consumer_blocked(),
            seen_full: self.counters.seen_full.load(Ordering::Relaxed),
            seen_below_watermark: self.counters.seen_below_watermark.load(Ordering::Relaxed),
            rounds: self
                .rounds
                .as_ref()
                .map_or(0, |rounds| rounds.claimed.load(Ordering::Relaxed)),
        }
    }

    fn reserve(&self) -> Reserve {
        let mut slots = self.slots.load(Ordering::SeqCst);
        loop {
            if slots & CLOSED != 0 {
                return Reserve::Closed;
            }
            if slots >= self.config.capacity {
                return Reserve::Full;
            }
            match self.slots.compare_exchange_weak(
                slots,
                slots + 1,
                Ordering::SeqCst,
                Ordering::SeqCst,
            ) {
                Ok(_) => return Reserve::Reserved,
                Err(current) => slots = current,
            }
        }
    }

    /// Steps 2–4 of a push, for a producer that holds a reserved slot.
    fn publish(&self, bucket: usize, item: T) {
        self.store.insert(bucket, item);
        let published = self.published.fetch_add(1, Ordering::SeqCst) + 1;
        seqcst_order_point();
        // The common case under load: nobody sleeps, so skip reading the consumers' lines.
        if !self.consumers.has_waiters() {
            return;
        }
        // Claims read after the publish: if they already took the queue back below the watermark,
        // those claimers used the items, and any waiter could not claim anyway.
        let ready = published.saturating_sub(self.claimed.load(Ordering::SeqCst));
        if ready >= self.watermark as u64 {
            self.consumers.notify_one();
        } else if self.is_closed() {
            // Draining consumers wait for any item, or for the last in-flight push to land.
            self.consumers.notify_all();
        }
    }

    fn claim(&self) -> Claim {
        let closed = self.is_closed();
        let need = if closed { 1 } else { self.watermark as u64 };
        let mut claimed = self.claimed.load(Ordering::SeqCst);
        loop {
            // Read after `claimed`, so `published >= claimed` and the difference is a lower
            // bound on the items ready now: a claim it allows is always backed by an item.
            let ready = self.published.load(Ordering::SeqCst) - claimed;
            if ready < need {
                return match (closed, self.len()) {
                    (false, _) => Claim::Below { ready },
                    (true, 0) => Claim::Drained,
                    (true, _) => Claim::Settling,
                };
            }
            match self.claimed.compare_exchange_weak(
                claimed,
                claimed + 1,
                Ordering::SeqCst,
                Ordering::SeqCst,
            ) {
                Ok(_) => return Claim::Claimed,
                Err(current) => claimed = current,
            }
        }
    }

    /// Steps 2–4 of a pop, for a consumer that holds a claim.
    fn take_claimed(&self) -> T {
        let item = self.store.take();
        let before = self.slots.fetch_sub(1, Ordering::SeqCst);
        seqcst_order_point();
        self.producers.notify_one();
        if before & CLOSED != 0 {
            // A draining consumer may be waiting for this last in-flight pop to finish.
            self.consumers.notify_all();
        }
        item
    }

    /// Takes an item if one may be taken now, without blocking.
    ///
    /// # Errors
    /// [`PopError::Empty`] or [`PopError::BelowWatermark`] while open (`Empty` also while a push
    /// that reserved before close is still landing), [`PopError::Closed`] once closed and drained,
    /// [`PopError::NotAMember`] on a queue [with rounds](Self::with_rounds).
    pub fn try_pop(&self) -> Result<T, PopError> {
        self.single_pops()?;
        match self.claim() {
            Claim::Claimed => Ok(self.take_claimed()),
            Claim::Below { ready } => {
                self.counters
                    .seen_below_watermark
                    .fetch_add(1, Ordering::Relaxed);
                Err(if ready == 0 {
                    PopError::Empty
                } else {
                    PopError::BelowWatermark
                })
            }
            Claim::Settling => Err(PopError::Empty),
            Claim::Drained => Err(PopError::Closed),
        }
    }

    /// Takes an item, parking until at least `min_ready` are queued; after [`close`](Self::close)
    /// takes what is left and returns `None` once the queue is drained.
    pub fn pop(&self) -> Option<T> {
        self.pop_until(None, None).ok()
    }

    /// Like [`pop`](Self::pop), giving up after `timeout`.
    ///
    /// # Errors
    /// [`PopError::Timeout`] when nothing could be taken in time, [`PopError::Closed`] once closed
    /// and drained, [`PopError::NotAMember`] on a queue [with rounds](Self::with_rounds).
    pub fn pop_timeout(&self, timeout: Duration) -> Result<T, PopError> {
        self.pop_until(Instant::now().checked_add(timeout), None)
    }

    /// Like [`pop`](Self::pop), but a consumer that has to wait gives up once `stop` returns true,
    /// which it asks at least every `poll`: for a flag raised where no one can wake the queue (a
    /// signal handler only stores it). An item that can be taken at once is taken whatever `stop`
    /// says. Counts as one wait in the statistics, however many polls it took.
    ///
    /// # Errors
    /// [`PopError::Stopped`] when `stop` said so while waiting, [`PopError::Closed`] once closed
    /// and drained, [`PopError::NotAMember`] on a queue [with rounds](Self::with_rounds).
    pub fn pop_unless(&self, stop: impl Fn() -> bool, poll: Duration) -> Result<T, PopError> {
        self.pop_until(None, Some((&stop, poll)))
    }

    /// Items of a queue with rounds leave only by rounds, so that a round's bucket keeps the items
    /// it was counted with.
    fn single_pops(&self) -> Result<(), PopError> {
        match &self.rounds {
            Some(rounds) => Err(PopError::NotAMember {
                member: None,
                members: rounds.members,
            }),
            None => Ok(()),
        }
    }

    fn pop_until(
        &self,
        deadline: Option<Instant>,
        stop: Option<(&dyn Fn() -> bool, Duration)>,
    ) -> Result<T, PopError> {
        self.single_pops()?;
        match self.claim() {
            Claim::Claimed => return Ok(self.take_claimed()),
            Claim::Drained => return Err(PopError::Closed),
            Claim::Below { .. } => {
                self.counters
                    .seen_below_watermark
                    .fetch_add(1, Ordering::Relaxed);
            }
            Claim::Settling => {}
        }
        let since = Instant::now();
        let outcome = self.wait_consumer(deadline, stop, || match self.claim() {
            Claim::Claimed => Some(true),
            Claim::Drained => Some(false),
            Claim::Below { .. } | Claim::Settling => None,
        });
        self.counters.consumer_waited(since);
        match outcome {
            Ok(true) => Ok(self.take_claimed()),
            Ok(false) => Err(PopError::Closed),
            Err(error) => Err(error),
        }
    }

    /// Parks a consumer until `attempt` returns `Some`, the deadline passes, or `stop` says so
    /// (asked at least every `poll`). `attempt` runs inside the parker and must notify no consumer.
    fn wait_consumer<R>(
        &self,
        deadline: Option<Instant>,
        stop: Option<(&dyn Fn() -> bool, Duration)>,
        mut attempt: impl FnMut() -> Option<R>,
    ) -> Result<R, PopError> {
        loop {
            let wake = match stop {
                Some((_, poll)) => {
                    let next_poll = Instant::now().checked_add(poll);
                    match (deadline, next_poll) {
                        (Some(deadline), Some(next_poll)) => Some(deadline.min(next_poll)),
                        (deadline, next_poll) => deadline.or(next_poll),
                    }
                }
                None => deadline,
            };
            match (self.consumers.wait_for(wake, &mut attempt), stop) {
                (Some(done), _) => return Ok(done),
                (None, _) if deadline.is_some_and(|d| Instant::now() >= d) => {
                    return Err(PopError::Timeout);
                }
                (None, Some((stop, _))) if stop() => return Err(PopError::Stopped),
                (None, Some(_)) => {}
                (None, None) => return Err(PopError::Timeout),
            }
        }
    }
}

impl<T: SeqLen> HsQueue<T> {
    fn bucket_of(&self, item: T) -> Result<(usize, T), PushError<T>> {
        let len = item.seq_len();
        match self.config.bucket_of(len) {
            Some(bucket) => Ok((bucket, item)),
            None => Err(PushError::TooLong {
                item,
                len,
                max: self.config.max_len(),
            }),
        }
    }

    /// Enqueues `item` if there is room now, without blocking.
    ///
    /// # Errors
    /// [`PushError::Full`], [`PushError::Closed`] or [`PushError::TooLong`], each with the item.
    pub fn try_push(&self, item: T) -> Result<(), PushError<T>> {
        let (bucket, item) = self.bucket_of(item)?;
        match self.reserve() {
            Reserve::Reserved => {
                self.publish(bucket, item);
                Ok(())
            }
            Reserve::Full => {
                self.counters.seen_full.fetch_add(1, Ordering::Relaxed);
                Err(PushError::Full(item))
            }
            Reserve::Closed => Err(PushError::Closed(item)),
        }
    }

    /// Enqueues `item`, parking while the queue is full.
    ///
    /// # Errors
    /// [`PushError::Closed`] (also when the queue closes while waiting) or [`PushError::TooLong`],
    /// each with the item.
    pub fn push(&self, item: T) -> Result<(), PushError<T>> {
        self.push_until(item, None)
    }

    /// Like [`push`](Self::push), giving up after `timeout` with [`PushError::Timeout`].
    ///
    /// # Errors
    /// [`PushError::Timeout`], [`PushError::Closed`] or [`PushError::TooLong`], each with the item.
    pub fn push_timeout(&self, item: T, timeout: Duration) -> Result<(), PushError<T>> {
        self.push_until(item, Instant::now().checked_add(timeout))
    }

    fn push_until(&self, item: T, deadline: Option<Instant>) -> Result<(), PushError<T>> {
        let (bucket, item) = self.bucket_of(item)?;
        match self.reserve() {
            Reserve::Reserved => {
                self.publish(bucket, item);
                return Ok(());
            }
            Reserve::Closed => return Err(PushError::Closed(item)),
            Reserve::Full => {
                self.counters.seen_full.fetch_add(1, Ordering::Relaxed);
            }
        }
        let since = Instant::now();
        let outcome = self.producers.wait_for(deadline, || match self.reserve() {
            Reserve::Reserved => Some(true),
            Reserve::Closed => Some(false),
            Reserve::Full => None,
        });
        self.counters.producer_waited(since);
        match outcome {
            Some(true) => {
                self.publish(bucket, item);
                Ok(())
            }
            Some(false) => Err(PushError::Closed(item)),
            None => Err(PushError::Timeout(item)),
        }
    }
}

// Items left in the queue are dropped with it: the stores own them (`ArrayQueue` drops its
// contents, `SlotBucket` drops its published slots).

impl<T> std::fmt::Debug for HsQueue<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HsQueue")
            .field("config", &self.config)
            .field("len", &self.len())
            .field("closed", &self.is_closed())
            .finish_non_exhaustive()
    }
}
