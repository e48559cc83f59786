//! What a user feeding a run from a real model meets, through the real binary: the target's depth read from the
//! `config.json` beside its weights admits every entry of transformers' `hidden_states` as a tap (the last one
//! included), and a drafter's config left there is named as such instead of being taken for the target's.

use std::path::{Path, PathBuf};

mod binary_support;

use binary_support::{SYNTHETIC, draftpipe, rewrite, text};

/// The tiny pipeline (taps 0 and 1) whose target's `weights` is the directory `model`, holding `config`.
fn pipe_with_target_config(name: &str, config: &str) -> (PathBuf, PathBuf) {
    let dir = binary_support::scratch("reliability-stream", name);
    let pipe = binary_support::tiny_pipe(&dir, (1, 1), "fifo", SYNTHETIC, Some(2));
    rewrite(
        &pipe,
        "    vocab        = 256\n",
        "    vocab        = 256\n    weights      = safetensors(path = \"model\")\n",
        &pipe,
    );
    std::fs::create_dir_all(dir.join("model")).unwrap();
    std::fs::write(dir.join("model/config.json"), config).unwrap();
    (dir, pipe)
}

fn run(dir: &Path, pipe: &Path) -> std::process::Output {
    draftpipe(&["run", pipe.to_str().unwrap(), "--steps", "2"], dir)
}

#[test]
fn a_tap_of_the_targets_depth_is_its_last_hidden_state_and_trains() {
    // One layer: hidden_states has 2 entries, the embeddings (tap 0) and the layer's output (tap 1).
    let (dir, pipe) = pipe_with_target_config("deepest-tap", r#"{"num_hidden_layers": 1}"#);
    let out = run(&dir, &pipe);
    assert!(
        out.status.success(),
        "a tap at the target's depth was refused:\n{}",
        text(&out.stderr)
    );

    // A tap past the last entry is still an error that counts the entries.
    rewrite(
        &pipe,
        "tap_layers   = [0, 1]",
        "tap_layers   = [0, 2]",
        &pipe,
    );
    let out = run(&dir, &pipe);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(
        err.contains("tap 2 is beyond the target's 1 layers")
            && err.contains("model/config.json")
            && err.contains("which has 2 entries (0: the embeddings, 1: the last layer's output)"),
        "{err}"
    );
}

#[test]
fn a_drafters_config_beside_the_target_weights_is_named_not_read_as_the_targets() {
    for (architecture, kind) in [
        ("DFlashDraftModel", "a DFlash export"),
        ("LlamaForCausalLMEagle3", "an EAGLE export"),
    ] {
        // The drafter's depth (5) would pass the tap check: only its architectures tell.
        let config = format!(r#"{{"architectures": ["{architecture}"], "num_hidden_layers": 5}}"#);
        let (dir, pipe) = pipe_with_target_config(architecture, &config);
        let out = run(&dir, &pipe);
        assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
        let err = text(&out.stderr);
        assert!(
            err.contains("model/config.json")
                && err.contains(&format!(
                    "`architectures` is [\"{architecture}\"], a draft model's config ({kind}), not the target's"
                ))
                && err.contains("Point the target's `weights` at the target model's directory"),
            "{err}"
        );
    }
}
