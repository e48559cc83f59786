//! Parking for the slow paths: a waiter count that notifiers read without a lock, and a
//! `Mutex<()>` + `Condvar` pair that only threads that must sleep (and those that wake them) touch.
//!
//! No lost wake-ups (the Dekker argument): a waiter increments `waiters` *then* re-checks the
//! queue counters while holding the lock; a notifier changes a counter *then* reads `waiters`,
//! all four accesses `SeqCst`. In the single total order of `SeqCst` operations, if the re-check
//! missed the change it came before it, so the notifier's later read comes after the increment
//! and sees the waiter (a cycle otherwise). The notifier then takes the lock before notifying,
//! and the waiter holds that lock from its increment until `Condvar::wait` releases it
//! atomically, so the notification cannot fall between the re-check and the sleep.
//! [`seqcst_order_point`] marks the two places this order is relied on (a fence under loom).

use std::sync::PoisonError;
use std::time::Instant;

use super::sync::{AtomicUsize, Backoff, Condvar, Mutex, Ordering, seqcst_order_point};

/// One group of waiters (all producers, or all consumers) of one queue.
#[derive(Debug)]
pub(crate) struct Parker {
    waiters: AtomicUsize,
    lock: Mutex<()>,
    cond: Condvar,
}

impl Parker {
    pub(crate) fn new() -> Self {
        Self {
            waiters: AtomicUsize::new(0),
            lock: Mutex::new(()),
            cond: Condvar::new(),
        }
    }

    /// Calls `attempt` until it returns `Some`: a short bounded spin first (the common case under
    /// load is that the state changes within a few hundred nanoseconds), then parks. Returns `None`
    /// when `deadline` passes first.
    ///
    /// Every wake-up, including a timed-out one, is followed by one more `attempt`, so a
    /// `notify_one` aimed at this thread is never dropped: either this thread uses the change it
    /// announced, or another thread already did.
    pub(crate) fn wait_for<R>(
        &self,
        deadline: Option<Instant>,
        mut attempt: impl FnMut() -> Option<R>,
    ) -> Option<R> {
        let backoff = Backoff::new();
        while !backoff.is_completed() {
            backoff.snooze();
            if let Some(done) = attempt() {
                return Some(done);
            }
        }
        let mut guard = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            self.waiters.fetch_add(1, Ordering::SeqCst);
            seqcst_order_point();
            if let Some(done) = attempt() {
                self.waiters.fetch_sub(1, Ordering::SeqCst);
                return Some(done);
            }
            guard = match deadline {
                None => self
                    .cond
                    .wait(guard)
                    .unwrap_or_else(PoisonError::into_inner),
                Some(deadline) => {
                    let now = Instant::now();
                    if now >= deadline {
                        self.waiters.fetch_sub(1, Ordering::SeqCst);
                        return None;
                    }
                    match self.cond.wait_timeout(guard, deadline - now) {
                        Ok((guard, _)) => guard,
                        Err(poisoned) => poisoned.into_inner().0,
                    }
                }
            };
            self.waiters.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Whether a waiter is registered. Read after the caller's `SeqCst` state change and
    /// [`seqcst_order_point`], `false` means no waiter can have missed that change.
    pub(crate) fn has_waiters(&self) -> bool {
        self.waiters.load(Ordering::SeqCst) != 0
    }

    /// Wakes one parked waiter, if any: for a state change that lets exactly one waiter proceed.
    /// The caller changes the state with a `SeqCst` access, then calls [`seqcst_order_point`].
    pub(crate) fn notify_one(&self) {
        if self.waiters.load(Ordering::SeqCst) != 0 {
            drop(self.lock.lock().unwrap_or_else(PoisonError::into_inner));
            self.cond.notify_one();
        }
    }

    /// Wakes every parked waiter: for close, and for drain progress after close. The caller
    /// changes the state with a `SeqCst` access, then calls [`seqcst_order_point`].
    pub(crate) fn notify_all(&self) {
        if self.waiters.load(Ordering::SeqCst) != 0 {
            drop(self.lock.lock().unwrap_or_else(PoisonError::into_inner));
            self.cond.notify_all();
        }
    }
}
