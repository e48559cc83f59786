//! Where queued items live, one layout per pull policy. The store never decides *whether* an
//! insert or a take may happen; [`HsQueue`](super::HsQueue)'s counters do that first (a producer
//! holds a reserved slot, a consumer holds a claim on a published item), so the store only has
//! to place and find items:
//!
//! - `fifo`: one `ArrayQueue` over all buckets, so the oldest item overall leaves first. The
//!   bucket index rides along; per-bucket depth is `added - removed`, two counters written by
//!   producers only and consumers only, so the two sides do not bounce one cache line.
//! - `round_robin`: one `ArrayQueue` per bucket; consumers visit buckets from a shared cursor.
//! - `random_in_bucket`: per bucket, a slot array with two bitmaps, `used` (a producer owns or
//!   filled the slot) and `full` (the item is published). A consumer picks the k-th set bit of
//!   `full` with `k` uniform, so the choice is uniform over the items it sees.
//!
//! Every bucket has room for `capacity` items, since all of them may have the same length.

use std::mem::MaybeUninit;

use crossbeam_queue::ArrayQueue;
use crossbeam_utils::CachePadded;

use super::config::{GOLDEN_GAMMA, PullPolicy, below, mix64};
use super::sync::{AtomicU64, AtomicUsize, Backoff, Ordering, UnsafeCell};

/// The items of one queue, laid out for its pull policy.
pub(crate) enum Store<T> {
    Fifo {
        items: ArrayQueue<(usize, T)>,
        added: Box<[CachePadded<AtomicUsize>]>,
        removed: Box<[CachePadded<AtomicUsize>]>,
    },
    RoundRobin {
        buckets: Box<[ArrayQueue<T>]>,
        cursor: CachePadded<AtomicUsize>,
    },
    RandomInBucket {
        buckets: Box<[SlotBucket<T>]>,
        cursor: CachePadded<AtomicUsize>,
        rng: CachePadded<AtomicU64>,
    },
}

impl<T> Store<T> {
    pub(crate) fn new(pull: PullPolicy, buckets: usize, capacity: usize, seed: u64) -> Self {
        match pull {
            PullPolicy::Fifo => Self::Fifo {
                items: ArrayQueue::new(capacity),
                added: counters(buckets),
                removed: counters(buckets),
            },
            PullPolicy::RoundRobin => Self::RoundRobin {
                buckets: (0..buckets).map(|_| ArrayQueue::new(capacity)).collect(),
                cursor: CachePadded::new(AtomicUsize::new(0)),
            },
            PullPolicy::RandomInBucket => Self::RandomInBucket {
                buckets: (0..buckets).map(|_| SlotBucket::new(capacity)).collect(),
                cursor: CachePadded::new(AtomicUsize::new(0)),
                rng: CachePadded::new(AtomicU64::new(seed)),
            },
        }
    }

    /// Places `item` in `bucket`. The caller holds a reserved slot, so there is room: at most
    /// `capacity - 1` other items exist, counting those still being inserted or taken.
    pub(crate) fn insert(&self, bucket: usize, item: T) {
        match self {
            Self::Fifo { items, added, .. } => {
                push_with_room(items, (bucket, item));
                added[bucket].fetch_add(1, Ordering::Relaxed);
            }
            Self::RoundRobin { buckets, .. } => push_with_room(&buckets[bucket], item),
            Self::RandomInBucket { buckets, .. } => buckets[bucket].insert(item),
        }
    }

    /// Removes one item by the pull policy. The caller holds a claim on a published item; since
    /// claims never outnumber published items still in the store, the search always ends.
    pub(crate) fn take(&self) -> T {
        let backoff = Backoff::new();
        loop {
            if let Some(item) = self.take_once() {
                return item;
            }
            // Only reached while another claimant takes the item this scan saw last.
            backoff.spin();
        }
    }

    /// Removes one item of `bucket` by the pull policy (the oldest, or a uniformly random one). The
    /// caller is the only taker, and the bucket holds an item (a round's claimant: see `rounds.rs`).
    pub(crate) fn take_from(&self, bucket: usize) -> T {
        let backoff = Backoff::new();
        loop {
            let item = match self {
                // Rounds use the per-bucket layout (`HsQueue::with_rounds`); with one bucket the
                // oldest overall is the oldest of the bucket.
                Self::Fifo { .. } => self.take_once(),
                Self::RoundRobin { buckets, .. } => buckets[bucket].pop(),
                Self::RandomInBucket { buckets, rng, .. } => buckets[bucket].take_random(|| {
                    mix64(
                        rng.fetch_add(GOLDEN_GAMMA, Ordering::Relaxed)
                            .wrapping_add(GOLDEN_GAMMA),
                    )
                }),
            };
            if let Some(item) = item {
                return item;
            }
            // Only reached while the item's push is still writing it (`ArrayQueue`'s stamp).
            backoff.spin();
        }
    }

    fn take_once(&self) -> Option<T> {
        match self {
            Self::Fifo { items, removed, .. } => {
                let (bucket, item) = items.pop()?;
                removed[bucket].fetch_add(1, Ordering::Relaxed);
                Some(item)
            }
            Self::RoundRobin { buckets, cursor } => {
                round_robin(buckets.len(), cursor, |bucket| buckets[bucket].pop())
            }
            Self::RandomInBucket {
                buckets,
                cursor,
                rng,
            } => round_robin(buckets.len(), cursor, |bucket| {
                buckets[bucket].take_random(|| {
                    mix64(
                        rng.fetch_add(GOLDEN_GAMMA, Ordering::Relaxed)
                            .wrapping_add(GOLDEN_GAMMA),
                    )
                })
            }),
        }
    }

    /// Items per bucket, read without stopping producers or consumers (a snapshot per bucket,
    /// not across buckets).
    pub(crate) fn depths(&self) -> Vec<usize> {
        match self {
            Self::Fifo { added, removed, .. } => added
                .iter()
                .zip(removed.iter())
                // `removed` first: a removal always follows its addition, so this cannot go
                // negative except through a stale `added`, which the saturation absorbs.
                .map(|(added, removed)| {
                    let removed = removed.load(Ordering::Relaxed);
                    added.load(Ordering::Relaxed).saturating_sub(removed)
                })
                .collect(),
            Self::RoundRobin { buckets, .. } => buckets.iter().map(ArrayQueue::len).collect(),
            Self::RandomInBucket { buckets, .. } => buckets.iter().map(SlotBucket::len).collect(),
        }
    }
}

fn counters(buckets: usize) -> Box<[CachePadded<AtomicUsize>]> {
    (0..buckets)
        .map(|_| CachePadded::new(AtomicUsize::new(0)))
        .collect()
}

/// Pushes into an `ArrayQueue` the caller knows has room. `ArrayQueue::push` only fails on a full
/// queue; a slot a concurrent pop has not finished releasing makes it wait inside, not fail.
fn push_with_room<T>(queue: &ArrayQueue<T>, item: T) {
    let mut item = item;
    let backoff = Backoff::new();
    while let Err(back) = queue.push(item) {
        item = back;
        backoff.spin();
    }
}

/// Visits buckets starting at the shared cursor, takes from the first that yields, and moves the
/// cursor past it, so every non-empty bucket is served within one round of `buckets` takes.
fn round_robin<T>(
    buckets: usize,
    cursor: &AtomicUsize,
    mut take_from: impl FnMut(usize) -> Option<T>,
) -> Option<T> {
    let start = cursor.load(Ordering::Relaxed);
    (0..buckets).find_map(|offset| {
        let bucket = (start + offset) % buckets;
        let item = take_from(bucket)?;
        cursor.store(bucket + 1, Ordering::Relaxed);
        Some(item)
    })
}

const WORD_BITS: usize = 64;

/// One bucket of the random policy: `slots[i]` is owned by whoever set bit `i` of `used`, and
/// readable by whoever clears bit `i` of `full`.
///
/// Slot life cycle: free → (producer sets `used`, Acquire) → written → (producer sets `full`,
/// Release) → published → (consumer clears `full`, Acquire: sees the write) → read → (consumer
/// clears `used`, Release: the next producer's Acquire sees the read finished) → free.
pub(crate) struct SlotBucket<T> {
    slots: Box<[UnsafeCell<MaybeUninit<T>>]>,
    used: Box<[AtomicU64]>,
    full: Box<[AtomicU64]>,
}

// SAFETY: a slot is accessed only by the one thread that owns it through the bitmaps (see the
// life cycle above), so sharing the bucket moves `T`s between threads but never shares one.
unsafe impl<T: Send> Send for SlotBucket<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for SlotBucket<T> {}

impl<T> SlotBucket<T> {
    fn new(capacity: usize) -> Self {
        let words = capacity.div_ceil(WORD_BITS);
        // Bits past `capacity` start set in `used`, so no producer ever claims them.
        let used = (0..words)
            .map(|word| {
                let valid = (capacity - word * WORD_BITS).min(WORD_BITS);
                AtomicU64::new(if valid == WORD_BITS { 0 } else { !0 << valid })
            })
            .collect();
        Self {
            slots: (0..capacity)
                .map(|_| UnsafeCell::new(MaybeUninit::uninit()))
                .collect(),
            used,
            full: (0..words).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    fn len(&self) -> usize {
        self.full
            .iter()
            .map(|word| word.load(Ordering::Relaxed).count_ones() as usize)
            .sum()
    }

    fn insert(&self, item: T) {
        let backoff = Backoff::new();
        loop {
            for (word_index, word) in self.used.iter().enumerate() {
                let mut seen = word.load(Ordering::Relaxed);
                while seen != !0 {
                    let bit = 1u64 << (!seen).trailing_zeros();
                    let before = word.fetch_or(bit, Ordering::Acquire);
                    if before & bit == 0 {
                        let index = word_index * WORD_BITS + bit.trailing_zeros() as usize;
                        // SAFETY: setting the `used` bit made this thread the slot's only owner,
                        // and the Acquire saw the last reader finish with it.
                        self.slots[index].with_mut(|slot| unsafe { (*slot).write(item) });
                        self.full[word_index].fetch_or(bit, Ordering::Release);
                        return;
                    }
                    seen = before | bit;
                }
            }
            // Every slot looked taken: a consumer is between clearing `full` and `used`.
            backoff.spin();
        }
    }

    /// Takes an item chosen uniformly among the published ones, or `None` if the bucket looked
    /// empty. `random` is called once per attempt.
    fn take_random(&self, mut random: impl FnMut() -> u64) -> Option<T> {
        loop {
            let count = self.len();
            if count == 0 {
                return None;
            }
            // The words may change between the count and this second read; a target that moved
            // away just means another try.
            let Some((word_index, bit)) = self.nth_published(below(random(), count)) else {
                continue;
            };
            let before = self.full[word_index].fetch_and(!bit, Ordering::Acquire);
            if before & bit != 0 {
                let index = word_index * WORD_BITS + bit.trailing_zeros() as usize;
                // SAFETY: clearing the `full` bit made this thread the slot's only owner, and the
                // Acquire saw the producer's write.
                let item = self.slots[index].with_mut(|slot| unsafe { (*slot).assume_init_read() });
                self.used[word_index].fetch_and(!bit, Ordering::Release);
                return Some(item);
            }
        }
    }

    /// The word index and bit mask of the `n`-th (0-based) published slot, if there are that many.
    fn nth_published(&self, mut n: usize) -> Option<(usize, u64)> {
        for (index, word) in self.full.iter().enumerate() {
            let mut bits = word.load(Ordering::Relaxed);
            let ones = bits.count_ones() as usize;
            if n < ones {
                for _ in 0..n {
                    bits &= bits - 1;
                }
                return Some((index, bits & bits.wrapping_neg()));
            }
            n -= ones;
        }
        None
    }
}

impl<T> Drop for SlotBucket<T> {
    fn drop(&mut self) {
        // `&mut self`: every push and pop has returned, so `full` lists exactly the live items.
        for (word_index, word) in self.full.iter().enumerate() {
            let mut bits = word.load(Ordering::Relaxed);
            while bits != 0 {
                let index = word_index * WORD_BITS + bits.trailing_zeros() as usize;
                // SAFETY: a set `full` bit marks an initialised item nobody has taken.
                self.slots[index].with_mut(|slot| unsafe { (*slot).assume_init_drop() });
                bits &= bits - 1;
            }
        }
    }
}
