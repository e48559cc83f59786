//! Stopping a run by signal: SIGINT (Ctrl-C), SIGTERM (what Slurm and Kubernetes send before they kill) and
//! SIGHUP (a closed terminal) all ask the run to finish the step in hand, save, write its summary and exit with
//! 128 + the signal; the same signal again exits at once. SIGXFSZ (a file over `ulimit -f`, which batch systems
//! set) is caught and dropped, so a write past the limit fails with EFBIG, which the checkpoint writer reports
//! with the previous checkpoint kept, instead of the default action killing the run at its first save.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

use anyhow::Context as _;
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM, SIGXFSZ};
use signal_hook::iterator::Signals;

/// The signals that stop a run gracefully.
const STOPPING: [i32; 3] = [SIGINT, SIGTERM, SIGHUP];

/// The stop flag the pipeline watches, and the signal that raised it.
#[derive(Debug, Clone)]
pub struct Interrupts {
    /// Raised by the first stopping signal.
    pub flag: Arc<AtomicBool>,
    signal: Arc<AtomicI32>,
}

impl Interrupts {
    /// The exit code after a signal stopped the run: 128 + its number, as shells report it.
    pub fn exit_code(&self) -> u8 {
        let signal = self.signal.load(Ordering::Acquire);
        u8::try_from(128 + signal).unwrap_or(u8::MAX)
    }
}

fn name(signal: i32) -> &'static str {
    match signal {
        SIGINT => "Ctrl-C",
        SIGTERM => "SIGTERM",
        SIGHUP => "SIGHUP",
        _ => "a signal",
    }
}

/// Installs the handlers and the thread that turns a signal into the stop flag. Call after anything that must
/// run before the process has a second thread.
pub fn install() -> anyhow::Result<Interrupts> {
    let interrupts = Interrupts {
        flag: Arc::new(AtomicBool::new(false)),
        signal: Arc::new(AtomicI32::new(SIGINT)),
    };
    // A handler that only raises a flag nobody reads: the kernel then fails the write with EFBIG instead.
    signal_hook::flag::register(SIGXFSZ, Arc::new(AtomicBool::new(false)))
        .context("cannot install the SIGXFSZ handler")?;
    let mut signals = Signals::new(STOPPING).context("cannot install the signal handlers")?;
    let (flag, signal) = (Arc::clone(&interrupts.flag), Arc::clone(&interrupts.signal));
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            for received in signals.forever() {
                if flag.load(Ordering::Acquire) {
                    // A second signal means the user (or the scheduler) will not wait for the step in hand;
                    // an acceptance check's processes must not outlive the run all the same.
                    draftpipe_runtime::acceptance::kill_live_groups();
                    std::process::exit(128 + received);
                }
                signal.store(received, Ordering::Release);
                flag.store(true, Ordering::Release);
                draftpipe_runtime::log_line!(
                    "\n{} received: finishing the current step, then saving ({} again quits at once)",
                    name(received),
                    name(received)
                );
            }
        })
        .context("cannot start the signal-handling thread")?;
    Ok(interrupts)
}
