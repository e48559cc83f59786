//! A process killed at an arbitrary moment while saving leaves a loadable, self-consistent checkpoint.
//!
//! The test re-runs its own binary as a child that saves checkpoints in a loop, kills it after a varying delay,
//! and loads what is on disk: the weights must be exactly those of the step `state.json` names.

mod source_support;

use std::process::Command;
use std::time::Duration;

use draftpipe_runtime::checkpoint::{TrainingState, load_checkpoint, save_checkpoint};
use source_support::{small_model, temp_dir};

const CHILD_ENV: &str = "DRAFTPIPE_CHECKPOINT_KILL_CHILD";

fn model() -> draftpipe_compiler::plan::ModelPlan {
    // About 0.6 M parameters: each save writes ~7 MB, so kills land inside writes as well as between them.
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

fn save_step(dir: &std::path::Path, step: u64) {
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

#[test]
fn killed_mid_save_leaves_a_loadable_checkpoint() {
    if let Ok(dir) = std::env::var(CHILD_ENV) {
        // Child: save until killed, but never outlive an abandoned parent by more than a few seconds.
        let started = std::time::Instant::now();
        let mut step = 1;
        while started.elapsed() < Duration::from_secs(10) {
            save_step(dir.as_ref(), step);
            step += 1;
        }
        std::process::exit(0);
    }
    let root = temp_dir("ckpt-kill");
    let dir = root.join("ckpt");
    save_step(&dir, 0);
    let model = model();
    let mut last_step = 0;
    let mut interrupted = 0;
    for (round, delay_ms) in [35u64, 80, 150, 220, 310, 405].into_iter().enumerate() {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "killed_mid_save_leaves_a_loadable_checkpoint",
                "--exact",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, &dir)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(delay_ms));
        child.kill().unwrap();
        child.wait().unwrap();
        let staging = dir.with_file_name("ckpt.tmp");
        let previous = dir.with_file_name("ckpt.prev");
        interrupted += usize::from(staging.exists() || previous.exists());
        let loaded = load_checkpoint(&dir, &model).unwrap_or_else(|e| panic!("round {round}: {e}"));
        let step = loaded.state.step;
        let [p, m, v] = buffers_for(step, model.parameters);
        assert!(
            loaded.params == p && loaded.exp_avg == m && loaded.exp_avg_sq == v,
            "round {round}: step {step}"
        );
        assert_eq!(loaded.state.data_positions, [step]);
        last_step = last_step.max(step);
    }
    assert!(last_step > 0, "the child saved at least once before a kill");
    // The child does nothing but save, so kills land inside saves: the leftovers show they did.
    assert!(interrupted > 0, "no kill interrupted a save");
    eprintln!("{interrupted} of 6 kills interrupted a save; last step on disk {last_step}");
}
