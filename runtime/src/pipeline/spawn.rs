//! Starting the run's threads without panicking: a thread the OS refuses (`ulimit -u`, address space, memory)
//! becomes the run's error, and the threads already started are released so the run ends instead of hanging.

use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::{Builder, Scope, ScopedJoinHandle};

use super::RunError;

/// Starts named scoped threads, turning a refusal into [`RunError::Spawn`].
#[derive(Debug)]
pub(super) struct Spawner {
    /// Spawns left before they fail as if the OS refused them ([`RunOptions::fail_spawn_after`]).
    ///
    /// [`RunOptions::fail_spawn_after`]: super::RunOptions::fail_spawn_after
    allowed: Option<AtomicUsize>,
}

impl Spawner {
    /// A spawner whose spawns fail after the first `fail_after` when it is set.
    pub(super) fn new(fail_after: Option<usize>) -> Self {
        Self {
            allowed: fail_after.map(AtomicUsize::new),
        }
    }

    /// Spawns `body` on a thread named `name` inside `scope`.
    pub(super) fn spawn<'scope, 'env, T: Send + 'scope>(
        &self,
        scope: &'scope Scope<'scope, 'env>,
        name: String,
        body: impl FnOnce() -> T + Send + 'scope,
    ) -> Result<ScopedJoinHandle<'scope, T>, RunError> {
        let refused = self.allowed.as_ref().is_some_and(|allowed| {
            allowed
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
                .is_err()
        });
        let spawned = if refused {
            Err(io::Error::new(
                io::ErrorKind::WouldBlock,
                "Resource temporarily unavailable (injected by fail_spawn_after)",
            ))
        } else {
            Builder::new().name(name.clone()).spawn_scoped(scope, body)
        };
        spawned.map_err(|source| RunError::Spawn {
            thread: name,
            source,
        })
    }
}
