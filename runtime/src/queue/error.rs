//! Errors of the queue. Push errors hand the item back (backpressure, as crossbeam's
//! `ArrayQueue::push` does), so a producer never loses a batch it could not enqueue.

use std::fmt;

/// A queue configuration the queue cannot honour.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QueueConfigError {
    /// `capacity` is 0: nothing could ever be queued.
    #[error("queue capacity must be at least 1")]
    ZeroCapacity,
    /// `capacity` is above [`MAX_CAPACITY`](super::config::MAX_CAPACITY).
    #[error("queue capacity {capacity} is above the supported maximum {max}")]
    CapacityTooLarge {
        /// The requested capacity.
        capacity: usize,
        /// The largest accepted capacity.
        max: usize,
    },
    /// `min_ready > capacity`: consumers would wait for more items than the queue can hold.
    #[error("min_ready {min_ready} is above the capacity {capacity}; consumers would wait forever")]
    WatermarkAboveCapacity {
        /// The requested watermark.
        min_ready: usize,
        /// The queue capacity.
        capacity: usize,
    },
    /// No bucket bounds were given.
    #[error("a queue needs at least one bucket")]
    NoBuckets,
    /// The first bucket bound is 0.
    #[error("bucket bounds must be at least 1")]
    ZeroBucket,
    /// A queue with rounds for no member.
    #[error("a queue with rounds needs at least one member")]
    NoMembers,
    /// A full queue could hold fewer than `members` items of every bucket, so no round: producers
    /// would wait for room and the group for a round, forever.
    #[error(
        "queue capacity {capacity} is below {needed}: a group of {members} takes rounds of one bucket, and a \
         full queue of {buckets} buckets holds a round only from buckets × (members − 1) + 1 = {needed} items"
    )]
    CapacityBelowRound {
        /// The queue capacity.
        capacity: usize,
        /// The number of buckets.
        buckets: usize,
        /// The group's members.
        members: usize,
        /// The least capacity that always holds a round.
        needed: usize,
    },
    /// Two consecutive bucket bounds do not strictly increase.
    #[error("bucket bounds must strictly increase, but {next} follows {previous}")]
    BucketsNotIncreasing {
        /// The earlier bound.
        previous: usize,
        /// The bound that follows it.
        next: usize,
    },
}

/// A push that did not enqueue its item; the item comes back.
pub enum PushError<T> {
    /// The queue holds `capacity` items.
    Full(T),
    /// The queue was closed.
    Closed(T),
    /// The item's sequence length is above the largest bucket bound.
    TooLong {
        /// The refused item.
        item: T,
        /// Its sequence length.
        len: usize,
        /// The largest bucket bound.
        max: usize,
    },
    /// A timed push found no room before its deadline.
    Timeout(T),
}

impl<T> PushError<T> {
    /// The item that was not enqueued.
    pub fn into_inner(self) -> T {
        match self {
            Self::Full(item)
            | Self::Closed(item)
            | Self::TooLong { item, .. }
            | Self::Timeout(item) => item,
        }
    }
}

// By hand rather than derived, so `T` (a hidden-state batch) needs no `Debug` and is not printed.
impl<T> fmt::Debug for PushError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Full(_) => f.write_str("Full(..)"),
            Self::Closed(_) => f.write_str("Closed(..)"),
            Self::TooLong { len, max, .. } => f
                .debug_struct("TooLong")
                .field("len", len)
                .field("max", max)
                .finish_non_exhaustive(),
            Self::Timeout(_) => f.write_str("Timeout(..)"),
        }
    }
}

impl<T> fmt::Display for PushError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Full(_) => f.write_str("queue is full"),
            Self::Closed(_) => f.write_str("queue is closed"),
            Self::TooLong { len, max, .. } => write!(
                f,
                "sequence length {len} is longer than the largest bucket ({max})"
            ),
            Self::Timeout(_) => f.write_str("timed out waiting for room in the queue"),
        }
    }
}

impl<T> std::error::Error for PushError<T> {}

/// Why a pop returned no item.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PopError {
    /// Nothing is queued (or the last items are still being published after close).
    #[error("queue is empty")]
    Empty,
    /// Items are queued, but fewer than `min_ready` and the queue is open.
    #[error("fewer than min_ready items are queued")]
    BelowWatermark,
    /// The queue is closed and fully drained.
    #[error("queue is closed and drained")]
    Closed,
    /// A timed pop found nothing it could take before its deadline.
    #[error("timed out waiting for an item")]
    Timeout,
    /// [`HsQueue::pop_unless`](super::HsQueue::pop_unless) was told to stop waiting.
    #[error("stopped waiting for an item")]
    Stopped,
    /// A single pop on a queue with rounds (`member: None`), or a round pop by a member the queue
    /// has no slot for (`members: 0`: a queue without rounds).
    #[error("{}", not_a_member(*member, *members))]
    NotAMember {
        /// The member that asked for a round, `None` for a single pop.
        member: Option<usize>,
        /// The members of the queue's group (0: it has none).
        members: usize,
    },
    /// A member left the group ([`HsQueue::leave_rounds`](super::HsQueue::leave_rounds)): the group
    /// can no longer step together, so no round is handed out.
    #[error("a member left the group: no more rounds")]
    GroupLeft,
}

fn not_a_member(member: Option<usize>, members: usize) -> String {
    match (member, members) {
        (None, members) => format!(
            "this queue hands out rounds to a group of {members}: take items with pop_round, not pop"
        ),
        (Some(_), 0) => "this queue has no rounds (build it with HsQueue::with_rounds)".to_owned(),
        (Some(member), members) => {
            format!("member {member} is not one of the group's {members} (0..{members})")
        }
    }
}
