//! Parking for the slow paths: a waiter count that notifiers read without a lock, and a
//! `Mutex<()>` + `Condvar` pair that only threads that must sleep (and those that wake them) touch.
//!
//! No lost wake-ups (the Dekker argument): a waiter increments `waiters`, issues a `SeqCst`
//! fence, *then* re-checks the queue state while holding the lock; a notifier changes the state,
//! issues a `SeqCst` fence, *then* reads `waiters`. The two fences are ordered one way or the
//! other in the single `SeqCst` order, so either the waiter's re-check sees the new state, or the
//! notifier sees the waiter. In the second case the notifier takes the lock before notifying, and
//! the waiter holds that lock from its increment until `Condvar::wait` releases it atomically, so
//! the notification cannot fall between the re-check and the sleep.
//!
//! Fences rather than `SeqCst` accesses alone carry the argument because loom models `SeqCst`
//! fences but treats `SeqCst` accesses as `AcqRel`; the fence is also the cheapest full barrier
//! (it stays on the core, unlike an RMW on the shared waiter count).

use std::sync::PoisonError;
use std::time::Instant;

use super::sync::{AtomicUsize, Backoff, Condvar, Mutex, Ordering, fence};

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
            fence(Ordering::SeqCst);
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

    /// Wakes one parked waiter, if any: for a state change that lets exactly one waiter proceed.
    /// The caller issues [`fence`]`(SeqCst)` between its state change and this call.
    pub(crate) fn notify_one(&self) {
        if self.waiters.load(Ordering::SeqCst) != 0 {
            drop(self.lock.lock().unwrap_or_else(PoisonError::into_inner));
            self.cond.notify_one();
        }
    }

    /// Wakes every parked waiter: for close, and for drain progress after close. The caller
    /// issues [`fence`]`(SeqCst)` between its state change and this call.
    pub(crate) fn notify_all(&self) {
        if self.waiters.load(Ordering::SeqCst) != 0 {
            drop(self.lock.lock().unwrap_or_else(PoisonError::into_inner));
            self.cond.notify_all();
        }
    }
}
