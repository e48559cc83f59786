//! Synchronisation primitives for the queue, swapped for loom's model-checked ones under `cfg(loom)`
//! (crossbeam's habit), so the code loom explores is the code that ships.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
#[cfg(loom)]
pub(crate) use loom::sync::{Condvar, Mutex};

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::{Condvar, Mutex};

#[cfg(loom)]
pub(crate) use loom::cell::UnsafeCell;

/// `std::cell::UnsafeCell` behind loom's closure API, so slot accesses read the same in both builds.
#[cfg(not(loom))]
#[derive(Debug)]
pub(crate) struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

#[cfg(not(loom))]
impl<T> UnsafeCell<T> {
    pub(crate) const fn new(value: T) -> Self {
        Self(std::cell::UnsafeCell::new(value))
    }

    pub(crate) fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        f(self.0.get())
    }
}

/// The bounded spin before a waiter parks: a few exponential `spin_loop` rounds, then a few
/// `yield_now`s, then [`Backoff::is_completed`] says it is time to park.
#[cfg(not(loom))]
pub(crate) use crossbeam_utils::Backoff;

/// Under loom spinning only multiplies the interleavings to explore: park at once.
#[cfg(loom)]
pub(crate) struct Backoff;

#[cfg(loom)]
impl Backoff {
    pub(crate) fn new() -> Self {
        Self
    }

    pub(crate) fn snooze(&self) {
        loom::thread::yield_now();
    }

    pub(crate) fn spin(&self) {
        loom::thread::yield_now();
    }

    pub(crate) fn is_completed(&self) -> bool {
        true
    }
}

/// Marks the point between a `SeqCst` write and a `SeqCst` read of another location on which the
/// no-lost-wake-up argument rests (see `park.rs`).
///
/// In the real build it is empty: the C11 model puts all `SeqCst` accesses in one total order,
/// which is exactly what the argument uses, and on x86-64 the locked read-modify-write before it
/// is already a full barrier. Loom treats `SeqCst` accesses as `AcqRel` (its README: a source of
/// false alarms), but models `SeqCst` fences, so under loom a fence here restores the order the
/// real build gets. Without it loom reports a (false) deadlock, which shows the models do test
/// the parking protocol.
#[cfg(loom)]
pub(crate) fn seqcst_order_point() {
    loom::sync::atomic::fence(Ordering::SeqCst);
}

/// See the loom build's documentation of this function.
#[cfg(not(loom))]
#[inline(always)]
pub(crate) fn seqcst_order_point() {}
