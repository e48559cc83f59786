//! A process killed at an arbitrary moment while saving leaves a loadable, self-consistent checkpoint.
//!
//! The test re-runs its own binary as a child that saves checkpoints in a loop and prints the step of each save
//! it starts. Each round waits until the child is seen in the middle of a save of its own (its staging
//! directory `ckpt.tmp` holds a given share of a save's bytes, or the fallback `ckpt.prev` exists), freezes it
//! (SIGSTOP, waited for) and checks that the save is still in progress, then kills it and loads what is on
//! disk: the weights must be exactly those of the step `state.json` names. The kills land where the rounds
//! aim whatever the scheduler does, so the test asserts that every one of them interrupted a save.

mod source_support;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use draftpipe_runtime::checkpoint::{TrainingState, load_checkpoint, save_checkpoint};
use source_support::{small_model, temp_dir};

const CHILD_ENV: &str = "DRAFTPIPE_CHECKPOINT_KILL_CHILD";

/// How long a child saves before it gives up on its parent, and how long a round waits to see it mid-save.
const CHILD_LIFETIME: Duration = Duration::from_secs(60);
const ROUND_DEADLINE: Duration = Duration::from_secs(45);

/// Where in a save each round kills: the share of a complete save's bytes already in `ckpt.tmp`, from a
/// freshly created staging directory to the last file being written.
const STAGED_SHARES: [f64; 6] = [0.0, 0.2, 0.4, 0.6, 0.8, 0.99];

fn model() -> draftpipe_compiler::plan::ModelPlan {
    // About 0.6 M parameters: each save writes ~7 MB, so a save lasts long enough to be caught at each share.
    small_model(256, 128, 3000)
}

/// Parameters and moments that are a function of the step, so a loaded checkpoint shows which step wrote it.
fn buffers_for(step: u64, n: usize) -> [Vec<f32>; 3] {
    [1.0, 2.0, 3.0].map(|k| {
        (0..n)
            .map(|i| (step as f32) * k + (i % 1000) as f32 * 1e-3)
            .collect()
    })
}

fn save_step(dir: &Path, step: u64) {
    let model = model();
    let [p, m, v] = buffers_for(step, model.parameters);
    let state = TrainingState {
        step,
        optimizer_step: step,
        plan_name: "kill".into(),
        rng_state: vec![step],
        data_positions: vec![step],
        stream_producers: Vec::new(),
    };
    save_checkpoint(dir, &model, &p, &m, &v, &state).unwrap();
}

/// The bytes of every file under `dir`, or `None` when it does not exist (or vanished while being read: the
/// child renamed it into place).
fn bytes_under(dir: &Path) -> Option<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(dir).ok()? {
        let entry = entry.ok()?;
        let kind = entry.file_type().ok()?;
        total += if kind.is_dir() {
            bytes_under(&entry.path())?
        } else {
            entry.metadata().ok()?.len()
        };
    }
    Some(total)
}

/// The saving child, killed if the test fails before it is killed on purpose (a frozen child is killed too).
struct SavingChild {
    child: Child,
    /// Saves the child has started in this round (it prints a line as each begins).
    started_saves: Arc<AtomicU64>,
}

impl SavingChild {
    fn spawn(dir: &Path) -> SavingChild {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "killed_mid_save_leaves_a_loadable_checkpoint",
                "--exact",
                "--test-threads=1",
                "--nocapture",
            ])
            .env(CHILD_ENV, dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let started_saves = Arc::new(AtomicU64::new(0));
        let counter = Arc::clone(&started_saves);
        let stdout = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                // libtest may print its own `test … ... ` in front of the first line.
                if line.contains("saving step ") {
                    counter.fetch_add(1, Ordering::Release);
                }
            }
        });
        SavingChild {
            child,
            started_saves,
        }
    }

    fn signal(&self, signal: libc::c_int) {
        let pid = self.child.id() as libc::pid_t;
        // SAFETY: `kill` only sends a signal to our own child, which has not been reaped yet.
        assert_eq!(unsafe { libc::kill(pid, signal) }, 0, "signal {signal}");
    }

    /// Stops the child and returns once it is stopped, so nothing on disk changes until it is continued.
    fn freeze(&self) {
        self.signal(libc::SIGSTOP);
        let pid = self.child.id() as libc::pid_t;
        let mut status = 0;
        // SAFETY: waits for a state change of our own child; `WUNTRACED` reports the stop without reaping it.
        let waited = unsafe { libc::waitpid(pid, &mut status, libc::WUNTRACED) };
        assert_eq!(waited, pid, "waitpid for the frozen child");
        assert!(
            libc::WIFSTOPPED(status),
            "the child stopped: status {status}"
        );
    }

    fn thaw(&self) {
        self.signal(libc::SIGCONT);
    }
}

impl Drop for SavingChild {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A save of the child's own is in progress: the first save it started has finished (it cleared what the last
/// round's kill left) and `ckpt.tmp` holds at least `staged` bytes, or `ckpt.prev` exists between the renames.
fn mid_save(child: &SavingChild, staging: &Path, previous: &Path, staged: u64) -> bool {
    child.started_saves.load(Ordering::Acquire) >= 2
        && (bytes_under(staging).is_some_and(|bytes| bytes >= staged) || previous.exists())
}

/// Freezes the child inside a save with at least `staged` bytes written, then kills it; returns whether the
/// save's leftovers showed it was between its two renames (`ckpt.prev`) rather than writing (`ckpt.tmp`).
fn kill_mid_save(dir: &Path, staged: u64) -> bool {
    let staging = dir.with_file_name("ckpt.tmp");
    let previous = dir.with_file_name("ckpt.prev");
    let mut child = SavingChild::spawn(dir);
    let started = Instant::now();
    loop {
        if let Some(status) = child.child.try_wait().unwrap() {
            panic!("the saving child exited ({status}) before it was caught mid-save");
        }
        assert!(
            started.elapsed() < ROUND_DEADLINE,
            "the child was never seen with {staged} bytes in {} within {ROUND_DEADLINE:?}",
            staging.display()
        );
        if !mid_save(&child, &staging, &previous, staged) {
            // Polled as often as the scheduler allows: the last share of a save lasts well under a millisecond.
            std::thread::yield_now();
            continue;
        }
        child.freeze();
        // Frozen, the child cannot finish the save: what is on disk now is what the kill leaves.
        if mid_save(&child, &staging, &previous, staged) {
            let between_renames = previous.exists();
            child.child.kill().unwrap();
            child.child.wait().unwrap();
            return between_renames;
        }
        // The save was committed between the look and the stop: let the child start another one.
        child.thaw();
    }
}

#[test]
fn killed_mid_save_leaves_a_loadable_checkpoint() {
    if let Ok(dir) = std::env::var(CHILD_ENV) {
        // Child: save until killed, but never outlive an abandoned parent by more than a minute.
        let started = Instant::now();
        let mut step = 1;
        while started.elapsed() < CHILD_LIFETIME {
            println!("saving step {step}");
            save_step(dir.as_ref(), step);
            step += 1;
        }
        std::process::exit(0);
    }
    let root = temp_dir("ckpt-kill");
    let dir = root.join("ckpt");
    save_step(&dir, 0);
    let complete = bytes_under(&dir).unwrap();
    let model = model();
    let mut between_renames = 0;
    for (round, share) in STAGED_SHARES.into_iter().enumerate() {
        between_renames += usize::from(kill_mid_save(&dir, (complete as f64 * share) as u64));
        let loaded = load_checkpoint(&dir, &model).unwrap_or_else(|e| panic!("round {round}: {e}"));
        let step = loaded.state.step;
        assert!(step > 0, "round {round}: the child's first save is on disk");
        let [p, m, v] = buffers_for(step, model.parameters);
        assert!(
            loaded.params == p && loaded.exp_avg == m && loaded.exp_avg_sq == v,
            "round {round}: step {step}"
        );
        assert_eq!(loaded.state.data_positions, [step]);
    }
    eprintln!(
        "{} kills interrupted a save ({between_renames} between its renames)",
        STAGED_SHARES.len()
    );
}
