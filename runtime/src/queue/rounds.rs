//! Rounds for a data-parallel drafter group (`sync = allreduce`): the queue hands the group one bucket at a
//! time, one batch of it per member, so every replica of a step pads to the same length and the all-reduce
//! waits for no slower bucket.
//!
//! ```text
//!  producers ──push──▶ [bucket 0 │ bucket 1 │ … ] ──claim_round(members)──▶ slots[0..members] ──▶ member m
//!                       the pull policy picks the bucket      (one CAS of `claimed` by `members`)
//! ```
//!
//! # Semantics
//!
//! - A round is claimed whole: the first member to ask for it claims `members` items of one bucket in one
//!   compare-and-swap of the queue's `claimed` counter, moves them into the group's slots, and every member
//!   takes its own slot. No member ever gets an item of another bucket in that round, and a member that asks
//!   for the next round before all have taken this one waits, so round `r`'s items all go to round `r`.
//! - **Watermark**: a round is claimed only while at least `max(min_ready, members)` items are queued (the
//!   single pop's rule, counting the round's own items) and its bucket holds `members`; otherwise the members
//!   wait on the queue, parked like a consumer below the watermark (in the statistics' `consumer_blocked`).
//! - **Pull policy**: the bucket goes round-robin over the buckets that can fill a round, from a cursor moved
//!   past the one served, so every bucket that holds a round is served within `buckets.len()` rounds; inside
//!   the bucket `random_in_bucket` takes uniformly random items and `round_robin` the oldest. `fifo` has one
//!   order over all buckets, which a round of one bucket cannot keep: under rounds it orders each bucket
//!   oldest-first and takes buckets in turn (with one bucket, that is `fifo` exactly).
//! - **Capacity**: [`HsQueue::with_rounds`] refuses a capacity below `buckets × (members − 1) + 1`, since a
//!   full queue of fewer than `members` items per bucket would hold no round, with producers waiting for room
//!   and members for a round, forever. At that capacity a full queue always holds a round (pigeonhole).
//! - **End of data**: after [`HsQueue::close`] the watermark is lifted; rounds go on while a bucket holds
//!   `members` items, then every member gets [`PopError::Closed`]. What is left, fewer than `members` items of
//!   each bucket (at most `buckets × (members − 1)`), is never handed out: a round the whole group cannot step
//!   would not be trained by any replica. It stays in the queue (its `depth`) and is dropped with it.
//! - **A member leaves** ([`HsQueue::leave_rounds`]: it stopped, or failed): no later round is claimed, since
//!   the group can no longer step together, and every member's pop returns [`PopError::GroupLeft`].
//! - Items of a queue with rounds leave only by rounds: its single pops return [`PopError::NotAMember`], so
//!   nothing takes an item of a bucket between a round's count and its take.
//!
//! # Why it is correct
//!
//! Round claims are serialized by the group's mutex (`filling` stays set from the claim until the items are in
//! the slots), and only rounds take items, so while a member claims no one else removes from the store: the
//! per-bucket depth it read can only have grown by the time it takes. The claim itself is the single pop's
//! claim by `members` at once: `claimed` moves from `c` to `c + members` only after `published − c` read at
//! least the round's watermark, so the items are published, and the chosen bucket held `members` of them in
//! the store, so the `members` takes that follow all succeed. The slots are released (`slots −= members`) and
//! the producers woken before the items go out. Waiting happens in the queue's consumer [`Parker`]; every
//! change of the group's state that may let a waiting member proceed (a round put in the slots, the last slot
//! taken, a member leaving) is made under the group's mutex and followed by `notify_all`, and the waiter's
//! re-check takes the same mutex after registering, so no wake-up is lost. A publish wakes one parked member
//! as it wakes one consumer; every woken member re-checks.
//!
//! [`Parker`]: super::park::Parker

use std::sync::PoisonError;
use std::time::{Duration, Instant};

use super::sync::{AtomicU64, Mutex, Ordering, seqcst_order_point};
use super::{HsQueue, PopError, QueueConfig, QueueConfigError};

/// One member's batch of a round: the round's number (from 0), its bucket and the item.
pub struct RoundItem<T> {
    /// The round's number since the queue was built.
    pub round: u64,
    /// The bucket every member of this round got an item of.
    pub bucket: usize,
    /// This member's item.
    pub item: T,
}

// By hand, so `T` (a hidden-state batch) needs no `Debug` and is not printed.
impl<T> std::fmt::Debug for RoundItem<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RoundItem")
            .field("round", &self.round)
            .field("bucket", &self.bucket)
            .finish_non_exhaustive()
    }
}

/// The group's side of a queue with rounds.
pub(crate) struct Rounds<T> {
    pub(crate) members: usize,
    state: Mutex<RoundState<T>>,
    /// Rounds claimed since creation (the statistics' `rounds`).
    pub(crate) claimed: AtomicU64,
}

struct RoundState<T> {
    /// The current round's items not yet taken, one per member.
    slots: Vec<Option<T>>,
    /// The current round's number and bucket.
    round: u64,
    bucket: usize,
    /// A member has claimed the next round and is moving its items into `slots`.
    filling: bool,
    /// Where the pull policy's round-robin over buckets starts next.
    cursor: usize,
    /// A member left: no round is claimed any more.
    left: bool,
}

impl<T> Rounds<T> {
    pub(crate) fn new(members: usize) -> Self {
        Self {
            members,
            state: Mutex::new(RoundState {
                slots: (0..members).map(|_| None).collect(),
                round: 0,
                bucket: 0,
                filling: false,
                cursor: 0,
                left: false,
            }),
            claimed: AtomicU64::new(0),
        }
    }
}

/// What one look at the group's state found for a member.
enum Attempt<T> {
    /// The member's item of the current round.
    Took(RoundItem<T>),
    /// The member claimed the next round of this bucket and must fill it.
    Fill { bucket: usize },
    /// Closed, and no bucket holds a round.
    Exhausted,
    /// A member left the group.
    Left,
}

/// The outcome of a round claim on the queue's counters.
enum RoundClaim {
    Claimed {
        bucket: usize,
    },
    /// Open (or closed with pushes still landing) and no round can be claimed yet.
    Wait,
    /// Closed, every push landed, and no bucket holds a round.
    Exhausted,
}

impl<T> HsQueue<T> {
    /// Builds an empty queue that hands rounds to a group of `members` (see [`RoundItem`] and
    /// [`pop_round`](Self::pop_round)): one bucket per round, one item of it per member.
    ///
    /// # Errors
    /// [`QueueConfigError`] when the configuration fails [`QueueConfig::validate`], or
    /// [`QueueConfigError::NoMembers`], or [`QueueConfigError::CapacityBelowRound`] when a full queue
    /// could hold no round (`capacity < buckets × (members − 1) + 1`).
    ///
    /// # Examples
    ///
    /// A group of two drafters taking rounds: both get the same bucket every round.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::thread;
    /// use draftpipe_runtime::queue::{HsQueue, PullPolicy, QueueConfig, SeqLen};
    ///
    /// struct Len(usize);
    /// impl SeqLen for Len {
    ///     fn seq_len(&self) -> usize {
    ///         self.0
    ///     }
    /// }
    ///
    /// let config = QueueConfig {
    ///     capacity: 8,
    ///     min_ready: 2,
    ///     buckets: vec![256, 1024],
    ///     pull: PullPolicy::RandomInBucket,
    ///     seed: 1,
    /// };
    /// // At least buckets × (members − 1) + 1 = 3, so a full queue always holds a round.
    /// let queue = Arc::new(HsQueue::with_rounds(config, 2)?);
    /// let producer = {
    ///     let queue = Arc::clone(&queue);
    ///     thread::spawn(move || {
    ///         for i in 0..101 {
    ///             queue.push(Len(if i % 3 == 0 { 900 } else { 100 })).unwrap();
    ///         }
    ///         queue.close();
    ///     })
    /// };
    /// let members: Vec<_> = (0..2)
    ///     .map(|member| {
    ///         let queue = Arc::clone(&queue);
    ///         thread::spawn(move || {
    ///             let mut buckets = Vec::new();
    ///             // Parks until the group can claim a round; None once no bucket holds one.
    ///             while let Some(round) = queue.pop_round(member) {
    ///                 buckets.push(round.bucket);
    ///             }
    ///             buckets
    ///         })
    ///     })
    ///     .collect();
    /// producer.join().unwrap();
    /// let seen: Vec<Vec<usize>> = members.into_iter().map(|m| m.join().unwrap()).collect();
    /// assert_eq!(seen[0], seen[1]);
    /// // 67 short and 34 long items: 33 and 17 rounds; one short item is no round and stays queued.
    /// assert_eq!(seen[0].len(), 50);
    /// assert_eq!(queue.stats().per_bucket, vec![1, 0]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn with_rounds(config: QueueConfig, members: usize) -> Result<Self, QueueConfigError> {
        config.validate()?;
        if members == 0 {
            return Err(QueueConfigError::NoMembers);
        }
        let needed = config.round_capacity(members);
        if config.capacity < needed {
            return Err(QueueConfigError::CapacityBelowRound {
                capacity: config.capacity,
                buckets: config.buckets.len(),
                members,
                needed,
            });
        }
        Ok(Self::build(config, Some(Rounds::new(members))))
    }

    /// Takes this member's batch of the next round if it can be had now, without blocking.
    ///
    /// # Errors
    /// [`PopError::Empty`] or [`PopError::BelowWatermark`] while no round can be claimed yet (or this member
    /// already took the current round and the others have not), [`PopError::Closed`] once closed and no bucket
    /// holds a round, [`PopError::GroupLeft`] after [`leave_rounds`](Self::leave_rounds),
    /// [`PopError::NotAMember`] for a queue without rounds or a member number out of range.
    pub fn try_pop_round(&self, member: usize) -> Result<RoundItem<T>, PopError> {
        let rounds = self.rounds_for(member)?;
        let attempt = self
            .round_attempt(rounds, member)
            .inspect_err(|_| self.saw_no_round())?;
        self.finish_attempt(rounds, member, attempt)
    }

    /// Takes this member's batch of the next round, parking until the group can claim one; `None` once the
    /// queue is closed and no bucket holds a round, or a member left, or `member` is not one.
    pub fn pop_round(&self, member: usize) -> Option<RoundItem<T>> {
        self.pop_round_until(member, None, None).ok()
    }

    /// Like [`pop_round`](Self::pop_round), giving up after `timeout`.
    ///
    /// # Errors
    /// [`PopError::Timeout`], and those of [`try_pop_round`](Self::try_pop_round) but `Empty` and
    /// `BelowWatermark`.
    pub fn pop_round_timeout(
        &self,
        member: usize,
        timeout: Duration,
    ) -> Result<RoundItem<T>, PopError> {
        self.pop_round_until(member, Instant::now().checked_add(timeout), None)
    }

    /// Like [`pop_round`](Self::pop_round), but a member that has to wait gives up once `stop` returns true,
    /// which it asks at least every `poll` (see [`pop_unless`](Self::pop_unless)).
    ///
    /// # Errors
    /// [`PopError::Stopped`], and those of [`try_pop_round`](Self::try_pop_round) but `Empty` and
    /// `BelowWatermark`.
    pub fn pop_round_unless(
        &self,
        member: usize,
        stop: impl Fn() -> bool,
        poll: Duration,
    ) -> Result<RoundItem<T>, PopError> {
        self.pop_round_until(member, None, Some((&stop, poll)))
    }

    /// Takes a member out of the group for good: no later round is claimed, and every member's pop returns
    /// [`PopError::GroupLeft`] (a group that cannot step together takes no more data). Items already in the
    /// slots and in the queue stay there. A queue without rounds ignores it.
    pub fn leave_rounds(&self) {
        let Some(rounds) = &self.rounds else { return };
        rounds
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .left = true;
        self.consumers.notify_all();
    }

    /// The size of the group this queue hands rounds to (`None`: single pops).
    pub fn round_members(&self) -> Option<usize> {
        self.rounds.as_ref().map(|rounds| rounds.members)
    }

    /// Counts a round pop that found no round to take (the statistics' `seen_below_watermark`).
    fn saw_no_round(&self) {
        self.counters
            .seen_below_watermark
            .fetch_add(1, Ordering::Relaxed);
    }

    fn rounds_for(&self, member: usize) -> Result<&Rounds<T>, PopError> {
        match &self.rounds {
            Some(rounds) if member < rounds.members => Ok(rounds),
            rounds => Err(PopError::NotAMember {
                member: Some(member),
                members: rounds.as_ref().map_or(0, |rounds| rounds.members),
            }),
        }
    }

    fn pop_round_until(
        &self,
        member: usize,
        deadline: Option<Instant>,
        stop: Option<(&dyn Fn() -> bool, Duration)>,
    ) -> Result<RoundItem<T>, PopError> {
        let rounds = self.rounds_for(member)?;
        match self.round_attempt(rounds, member) {
            Ok(attempt) => return self.finish_attempt(rounds, member, attempt),
            Err(_) => self.saw_no_round(),
        }
        let since = Instant::now();
        let outcome =
            self.wait_consumer(deadline, stop, || self.round_attempt(rounds, member).ok());
        self.counters.consumer_waited(since);
        self.finish_attempt(rounds, member, outcome?)
    }

    /// One look at the group's state (inside the consumers' parker: it notifies no consumer). The error
    /// says why the member must wait: [`PopError::BelowWatermark`] when items are queued but no round can
    /// be claimed, [`PopError::Empty`] otherwise (nothing queued, or the others have yet to take theirs).
    fn round_attempt(&self, rounds: &Rounds<T>, member: usize) -> Result<Attempt<T>, PopError> {
        let mut state = rounds.state.lock().unwrap_or_else(PoisonError::into_inner);
        if state.left {
            return Ok(Attempt::Left);
        }
        let (round, bucket) = (state.round, state.bucket);
        if let Some(item) = state.slots[member].take() {
            return Ok(Attempt::Took(RoundItem {
                round,
                bucket,
                item,
            }));
        }
        // Another member is filling the next round, or has yet to take its item of this one.
        if state.filling || state.slots.iter().any(Option::is_some) {
            return Err(PopError::Empty);
        }
        match self.claim_round(rounds.members, &mut state.cursor) {
            RoundClaim::Claimed { bucket } => {
                state.filling = true;
                Ok(Attempt::Fill { bucket })
            }
            RoundClaim::Wait if self.is_empty() => Err(PopError::Empty),
            RoundClaim::Wait => Err(PopError::BelowWatermark),
            RoundClaim::Exhausted => Ok(Attempt::Exhausted),
        }
    }

    fn finish_attempt(
        &self,
        rounds: &Rounds<T>,
        member: usize,
        attempt: Attempt<T>,
    ) -> Result<RoundItem<T>, PopError> {
        match attempt {
            Attempt::Took(item) => {
                // The last member to take its item lets the next round be claimed.
                self.consumers.notify_all();
                Ok(item)
            }
            Attempt::Fill { bucket } => Ok(self.fill_round(rounds, member, bucket)),
            Attempt::Exhausted => {
                // The members still parked see the same end.
                self.consumers.notify_all();
                Err(PopError::Closed)
            }
            Attempt::Left => Err(PopError::GroupLeft),
        }
    }

    /// Claims a round on the counters: a bucket holding `members` items, chosen round-robin from `cursor`,
    /// while at least the round's watermark are published and unclaimed.
    fn claim_round(&self, members: usize, cursor: &mut usize) -> RoundClaim {
        let closed = self.is_closed();
        let need = if closed {
            members
        } else {
            self.watermark.max(members)
        } as u64;
        // Only rounds take items, and this claimant is the only one: these depths can only grow until it takes.
        let depths = self.store.depths();
        let buckets = depths.len();
        let chosen = (0..buckets)
            .map(|offset| (*cursor + offset) % buckets)
            .find(|&bucket| depths[bucket] >= members);
        let mut claimed = self.claimed.load(Ordering::SeqCst);
        loop {
            let ready = self.published.load(Ordering::SeqCst) - claimed;
            let bucket = match chosen {
                Some(bucket) if ready >= need => bucket,
                _ if !closed => return RoundClaim::Wait,
                // Closed: a push that reserved before the close may still land and complete a round.
                _ if self.len() as u64 > ready => return RoundClaim::Wait,
                _ => return RoundClaim::Exhausted,
            };
            match self.claimed.compare_exchange_weak(
                claimed,
                claimed + members as u64,
                Ordering::SeqCst,
                Ordering::SeqCst,
            ) {
                Ok(_) => {
                    *cursor = bucket + 1;
                    return RoundClaim::Claimed { bucket };
                }
                Err(current) => claimed = current,
            }
        }
    }

    /// Moves a claimed round's items from `bucket` into the slots and returns `member`'s.
    fn fill_round(&self, rounds: &Rounds<T>, member: usize, bucket: usize) -> RoundItem<T> {
        let own = self.store.take_from(bucket);
        let slots: Vec<Option<T>> = (0..rounds.members)
            .map(|other| (other != member).then(|| self.store.take_from(bucket)))
            .collect();
        self.slots.fetch_sub(rounds.members, Ordering::SeqCst);
        seqcst_order_point();
        self.producers.notify_all();
        let round = rounds.claimed.fetch_add(1, Ordering::Relaxed);
        {
            let mut state = rounds.state.lock().unwrap_or_else(PoisonError::into_inner);
            state.slots = slots;
            state.round = round;
            state.bucket = bucket;
            state.filling = false;
        }
        self.consumers.notify_all();
        RoundItem {
            round,
            bucket,
            item: own,
        }
    }
}
