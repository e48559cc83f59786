//! The acceptance child's process group: the child runs in a group of its own, and every way a check ends
//! (its own exit, a failure, the timeout, a kill request, the run's second signal) kills the whole group, so
//! nothing the child started outlives the check.
//!
//! ```text
//!  Watch::spawn ──process_group(0)──▶ ChildGroup::register ──▶ LIVE_GROUPS
//!  watcher: has_exited (the child stays unreaped) ──▶ kill_and_reap: SIGKILL to the group, then reap
//!  signals thread, second signal: kill_live_groups() just before process::exit
//! ```
//!
//! The group's id is the child's pid, which stays taken while the child is unreaped (a zombie included), so a
//! group is signalled only while it is in [`LIVE_GROUPS`], and it leaves that list before the child is reaped.

use std::process::{Child, ExitStatus};
use std::sync::{Mutex, PoisonError};

/// The groups of the checks whose child is not reaped yet.
static LIVE_GROUPS: Mutex<Vec<libc::pid_t>> = Mutex::new(Vec::new());

/// A started child that leads its own process group.
pub(super) struct ChildGroup {
    child: Child,
    group: Option<libc::pid_t>,
}

impl ChildGroup {
    /// Takes charge of `child`, started with `process_group(0)`.
    pub(super) fn register(child: Child) -> Self {
        let group = libc::pid_t::try_from(child.id()).ok();
        if let Some(group) = group {
            LIVE_GROUPS
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(group);
        }
        Self { child, group }
    }

    /// Whether the child has exited, without reaping it (its group id stays valid for the kill that follows).
    pub(super) fn has_exited(&mut self) -> std::io::Result<bool> {
        let Some(pid) = self.group.and_then(|pid| libc::id_t::try_from(pid).ok()) else {
            return Ok(self.child.try_wait()?.is_some());
        };
        // SAFETY: `waitid` writes into the zeroed `info` it is given; WNOWAIT leaves the child unreaped.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        let waited = unsafe {
            libc::waitid(
                libc::P_PID,
                pid,
                &raw mut info,
                libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
            )
        };
        if waited != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: after a successful `waitid`, `si_pid` is set (0 when no child has exited yet).
        Ok(unsafe { info.si_pid() } != 0)
    }

    /// Kills every process of the group (the child too, when it still runs) and reaps the child, returning how
    /// it ended: its own exit status when it had exited already.
    pub(super) fn kill_and_reap(&mut self) -> std::io::Result<ExitStatus> {
        if let Some(group) = self.group.take() {
            let mut live = LIVE_GROUPS.lock().unwrap_or_else(PoisonError::into_inner);
            live.retain(|&other| other != group);
            signal_group(group);
        }
        let _ = self.child.kill();
        self.child.wait()
    }
}

impl Drop for ChildGroup {
    /// A watcher that ends without [`ChildGroup::kill_and_reap`] (a panic) still leaves nothing running.
    fn drop(&mut self) {
        if self.group.is_some() {
            let _ = self.kill_and_reap();
        }
    }
}

/// Kills the process group of every check still running: for an exit that skips the watchers (the run's
/// second signal, `process::exit`).
pub fn kill_live_groups() {
    for &group in LIVE_GROUPS
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .iter()
    {
        signal_group(group);
    }
}

fn signal_group(group: libc::pid_t) {
    // SAFETY: `kill` only sends a signal; `group` is an unreaped child's pid (it is in LIVE_GROUPS or being taken
    // out under its lock), so no other process can have been given that id.
    unsafe {
        libc::kill(-group, libc::SIGKILL);
    }
}
