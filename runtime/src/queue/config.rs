//! Queue configuration, validated once at construction. The queue is a data structure of its own: it knows
//! nothing of the `.pipe` language or the plan, and the pipeline translates the plan's queue block into this
//! (`pipeline::queue_config`).

use super::error::QueueConfigError;

/// The largest accepted capacity. The top bit of the slot counter marks the queue closed, and every
/// bucket preallocates `capacity` slots, so an absurd capacity is refused instead of allocated.
pub const MAX_CAPACITY: usize = 1 << 20;

/// Which queued item a consumer takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PullPolicy {
    /// Round-robin over non-empty buckets, uniform at random inside the chosen bucket.
    RandomInBucket,
    /// Round-robin over non-empty buckets, oldest item first inside a bucket.
    RoundRobin,
    /// Oldest item over all buckets.
    Fifo,
}

/// What an [`HsQueue`](super::HsQueue) (or its [`MutexQueue`](super::baseline::MutexQueue)
/// baseline) is built from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueConfig {
    /// The most items queued over all buckets together.
    pub capacity: usize,
    /// Consumers take an item only while at least this many are queued (until the queue closes).
    /// `0` behaves as `1`: a consumer always needs an item to take.
    pub min_ready: usize,
    /// Strictly increasing upper bounds on sequence length; an item goes to the first bucket whose
    /// bound is at least its length.
    pub buckets: Vec<usize>,
    /// Which queued item a consumer takes.
    pub pull: PullPolicy,
    /// Seed of the random choice inside a bucket ([`PullPolicy::RandomInBucket`]).
    pub seed: u64,
}

impl QueueConfig {
    /// Checks the invariants the queue relies on.
    ///
    /// # Errors
    /// Zero or oversized capacity, a watermark above capacity (consumers could never take before
    /// close), no buckets, a zero bound, or bounds that do not strictly increase.
    pub fn validate(&self) -> Result<(), QueueConfigError> {
        if self.capacity == 0 {
            return Err(QueueConfigError::ZeroCapacity);
        }
        if self.capacity > MAX_CAPACITY {
            return Err(QueueConfigError::CapacityTooLarge {
                capacity: self.capacity,
                max: MAX_CAPACITY,
            });
        }
        if self.min_ready > self.capacity {
            return Err(QueueConfigError::WatermarkAboveCapacity {
                min_ready: self.min_ready,
                capacity: self.capacity,
            });
        }
        let Some(&first) = self.buckets.first() else {
            return Err(QueueConfigError::NoBuckets);
        };
        if first == 0 {
            return Err(QueueConfigError::ZeroBucket);
        }
        if let Some(pair) = self.buckets.windows(2).find(|pair| pair[0] >= pair[1]) {
            return Err(QueueConfigError::BucketsNotIncreasing {
                previous: pair[0],
                next: pair[1],
            });
        }
        Ok(())
    }

    /// The bucket that holds an item of length `len`, or `None` when it is longer than every bound.
    pub fn bucket_of(&self, len: usize) -> Option<usize> {
        let bucket = self.buckets.partition_point(|&bound| bound < len);
        (bucket < self.buckets.len()).then_some(bucket)
    }

    /// The longest length any bucket takes.
    pub fn max_len(&self) -> usize {
        self.buckets.last().copied().unwrap_or(0)
    }

    /// The number of queued items a consumer needs to see before taking one, while open.
    pub(crate) fn watermark(&self) -> usize {
        self.min_ready.max(1)
    }

    /// The least capacity at which a full queue always holds a round of `members` items of one
    /// bucket: with `members − 1` in every bucket, one more item completes a round (pigeonhole).
    pub fn round_capacity(&self, members: usize) -> usize {
        self.buckets.len() * members.saturating_sub(1) + 1
    }
}

/// SplitMix64's output function: turns a counter into a well-mixed 64-bit value. The random pull
/// policy of both queues draws from it, so a seed gives the same choices to both.
pub(crate) fn mix64(counter: u64) -> u64 {
    let mut z = counter;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// SplitMix64's counter increment.
pub(crate) const GOLDEN_GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// An index uniform in `0..n` from 64 random bits (Lemire's multiply-shift; `n > 0`).
pub(crate) fn below(bits: u64, n: usize) -> usize {
    ((u128::from(bits) * n as u128) >> 64) as usize
}
