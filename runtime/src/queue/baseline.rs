//! The comparison baseline: the same queue semantics (capacity, buckets, watermark, pull
//! policies, close and drain, timeouts) built the plain way, one `Mutex` around per-bucket
//! `VecDeque`s and two `Condvar`s. Benchmarks and tests run it beside [`HsQueue`](super::HsQueue)
//! so every speed-up is measured against this, in the same run.
//!
//! It is the careful version of the plain design: it counts waiters under the lock and notifies
//! only when someone waits, because std's `Condvar::notify_one` makes a futex system call even
//! when nobody sleeps, which would flatter the lock-free queue.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::config::{GOLDEN_GAMMA, below, mix64};
use super::{PopError, PullPolicy, PushError, QueueConfig, QueueConfigError, SeqLen};

/// `Mutex<VecDeque>` + `Condvar` queue with [`HsQueue`](super::HsQueue)'s semantics.
///
/// # Examples
///
/// ```
/// use draftpipe_runtime::queue::baseline::MutexQueue;
/// use draftpipe_runtime::queue::{PullPolicy, QueueConfig, SeqLen};
///
/// struct Len(usize);
/// impl SeqLen for Len {
///     fn seq_len(&self) -> usize {
///         self.0
///     }
/// }
///
/// let queue = MutexQueue::new(QueueConfig {
///     capacity: 4,
///     min_ready: 1,
///     buckets: vec![64],
///     pull: PullPolicy::Fifo,
///     seed: 0,
/// })?;
/// queue.push(Len(3))?;
/// assert_eq!(queue.pop().map(|l| l.0), Some(3));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct MutexQueue<T> {
    config: QueueConfig,
    watermark: usize,
    state: Mutex<State<T>>,
    not_full: Condvar,
    ready: Condvar,
}

struct State<T> {
    /// Per bucket: (arrival number, item), oldest first.
    buckets: Vec<VecDeque<(u64, T)>>,
    len: usize,
    arrivals: u64,
    cursor: usize,
    rng: u64,
    closed: bool,
    waiting_producers: usize,
    waiting_consumers: usize,
}

impl<T> State<T> {
    fn take(&mut self, pull: PullPolicy) -> T {
        let bucket = match pull {
            PullPolicy::Fifo => (0..self.buckets.len())
                .filter_map(|b| self.buckets[b].front().map(|&(arrival, _)| (arrival, b)))
                .min()
                .map(|(_, b)| b),
            PullPolicy::RoundRobin | PullPolicy::RandomInBucket => (0..self.buckets.len())
                .map(|offset| (self.cursor + offset) % self.buckets.len())
                .find(|&b| !self.buckets[b].is_empty()),
        };
        let bucket = bucket.unwrap_or_default();
        self.cursor = bucket + 1;
        let items = &mut self.buckets[bucket];
        let index = if pull == PullPolicy::RandomInBucket {
            self.rng = self.rng.wrapping_add(GOLDEN_GAMMA);
            below(mix64(self.rng), items.len())
        } else {
            0
        };
        // Order inside a random bucket does not matter, so the O(1) swap-removal is fair to use.
        let (_, item) = items
            .swap_remove_front(index)
            .unwrap_or_else(|| unreachable!("take is only called with len > 0"));
        self.len -= 1;
        item
    }
}

impl<T> MutexQueue<T> {
    /// Builds an empty queue.
    ///
    /// # Errors
    /// [`QueueConfigError`] when the configuration fails [`QueueConfig::validate`].
    pub fn new(config: QueueConfig) -> Result<Self, QueueConfigError> {
        config.validate()?;
        let state = State {
            buckets: config
                .buckets
                .iter()
                .map(|_| VecDeque::with_capacity(config.capacity))
                .collect(),
            len: 0,
            arrivals: 0,
            cursor: 0,
            rng: config.seed,
            closed: false,
            waiting_producers: 0,
            waiting_consumers: 0,
        };
        Ok(Self {
            watermark: config.watermark(),
            config,
            state: Mutex::new(state),
            not_full: Condvar::new(),
            ready: Condvar::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State<T>> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Items in the queue.
    pub fn len(&self) -> usize {
        self.lock().len
    }

    /// Whether the queue holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Closes the queue and wakes every waiter.
    pub fn close(&self) {
        self.lock().closed = true;
        self.not_full.notify_all();
        self.ready.notify_all();
    }

    fn can_take(&self, state: &State<T>) -> bool {
        state.len >= if state.closed { 1 } else { self.watermark }
    }

    /// Takes an item under the lock, then wakes a waiting producer if there is one.
    fn take(&self, mut state: MutexGuard<'_, State<T>>) -> T {
        let item = state.take(self.config.pull);
        let wake = state.waiting_producers > 0;
        drop(state);
        if wake {
            self.not_full.notify_one();
        }
        item
    }

    /// Takes an item if one may be taken now.
    ///
    /// # Errors
    /// As [`HsQueue::try_pop`](super::HsQueue::try_pop).
    pub fn try_pop(&self) -> Result<T, PopError> {
        let state = self.lock();
        if self.can_take(&state) {
            return Ok(self.take(state));
        }
        Err(match (state.closed, state.len) {
            (true, _) => PopError::Closed,
            (false, 0) => PopError::Empty,
            (false, _) => PopError::BelowWatermark,
        })
    }

    /// Takes an item, waiting for the watermark; `None` once closed and drained.
    pub fn pop(&self) -> Option<T> {
        self.pop_until(None).ok()
    }

    /// Like [`pop`](Self::pop), giving up after `timeout`.
    ///
    /// # Errors
    /// As [`HsQueue::pop_timeout`](super::HsQueue::pop_timeout).
    pub fn pop_timeout(&self, timeout: Duration) -> Result<T, PopError> {
        self.pop_until(Instant::now().checked_add(timeout))
    }

    fn pop_until(&self, deadline: Option<Instant>) -> Result<T, PopError> {
        let mut state = self.lock();
        loop {
            if self.can_take(&state) {
                return Ok(self.take(state));
            }
            if state.closed {
                return Err(PopError::Closed);
            }
            state.waiting_consumers += 1;
            let (woken, expired) = wait(&self.ready, state, deadline);
            state = woken;
            state.waiting_consumers -= 1;
            if expired {
                return Err(PopError::Timeout);
            }
        }
    }
}

impl<T: SeqLen> MutexQueue<T> {
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

    /// Inserts under the lock, then wakes a waiting consumer if the watermark is met.
    fn insert(&self, mut state: MutexGuard<'_, State<T>>, bucket: usize, item: T) {
        let arrival = state.arrivals;
        state.arrivals += 1;
        state.buckets[bucket].push_back((arrival, item));
        state.len += 1;
        let wake = state.waiting_consumers > 0 && self.can_take(&state);
        drop(state);
        if wake {
            self.ready.notify_one();
        }
    }

    /// Enqueues `item` if there is room now.
    ///
    /// # Errors
    /// As [`HsQueue::try_push`](super::HsQueue::try_push).
    pub fn try_push(&self, item: T) -> Result<(), PushError<T>> {
        let (bucket, item) = self.bucket_of(item)?;
        let state = self.lock();
        if state.closed {
            return Err(PushError::Closed(item));
        }
        if state.len >= self.config.capacity {
            return Err(PushError::Full(item));
        }
        self.insert(state, bucket, item);
        Ok(())
    }

    /// Enqueues `item`, waiting while the queue is full.
    ///
    /// # Errors
    /// As [`HsQueue::push`](super::HsQueue::push).
    pub fn push(&self, item: T) -> Result<(), PushError<T>> {
        self.push_until(item, None)
    }

    /// Like [`push`](Self::push), giving up after `timeout`.
    ///
    /// # Errors
    /// As [`HsQueue::push_timeout`](super::HsQueue::push_timeout).
    pub fn push_timeout(&self, item: T, timeout: Duration) -> Result<(), PushError<T>> {
        self.push_until(item, Instant::now().checked_add(timeout))
    }

    fn push_until(&self, item: T, deadline: Option<Instant>) -> Result<(), PushError<T>> {
        let (bucket, item) = self.bucket_of(item)?;
        let mut state = self.lock();
        loop {
            if state.closed {
                return Err(PushError::Closed(item));
            }
            if state.len < self.config.capacity {
                self.insert(state, bucket, item);
                return Ok(());
            }
            state.waiting_producers += 1;
            let (woken, expired) = wait(&self.not_full, state, deadline);
            state = woken;
            state.waiting_producers -= 1;
            if expired {
                return Err(PushError::Timeout(item));
            }
        }
    }
}

/// Waits on `cond` until notified (or spuriously woken). With a deadline that has already
/// passed it does not wait and says so (`true`), so callers re-check their condition first.
fn wait<'a, S>(
    cond: &Condvar,
    guard: MutexGuard<'a, S>,
    deadline: Option<Instant>,
) -> (MutexGuard<'a, S>, bool) {
    match deadline {
        None => (
            cond.wait(guard).unwrap_or_else(PoisonError::into_inner),
            false,
        ),
        Some(deadline) => {
            let now = Instant::now();
            if now >= deadline {
                return (guard, true);
            }
            let guard = match cond.wait_timeout(guard, deadline - now) {
                Ok((guard, _)) => guard,
                Err(poisoned) => poisoned.into_inner().0,
            };
            (guard, false)
        }
    }
}
