//! What a user feeding a run from a real model meets, through the real binary: the target's depth read from the
//! `config.json` beside its weights admits every entry of transformers' `hidden_states` as a tap (the last one
//! included), and a drafter's config left there is named as such instead of being taken for the target's.

use std::path::{Path, PathBuf};

mod binary_support;

use binary_support::{draftpipe, text};

/// A DFlash pipeline (taps 1, 2 and 4) whose target's `weights` is the directory `model`, holding `config` and
/// no tensors: a run gets past the depth check to the weights, or stops at the check.
fn pipe_with_target_config(name: &str, config: &str) -> (PathBuf, PathBuf) {
    let dir = binary_support::scratch("reliability-stream", name);
    let pipe = dir.join("depth.pipe");
    std::fs::write(
        &pipe,
        r#"pipeline "depth"
target t on cpu {
    hidden       = 16
    tap_layers   = [1, 2, 4]
    vocab        = 96
    batch_tokens = 64
    source       = synthetic(seed = 1, lengths = 8..32)
    weights      = safetensors(path = "model")
}
queue q from t to d { capacity = 4  buckets = [32] }
drafter d on cpu {
    model = dflash(layers = 2, heads = 4, kv_heads = 2, head_dim = 8, intermediate = 24, block = 4, anchors = 8, mask_token = 95, rope_theta = 10000)
    steps = 1
}
"#,
    )
    .unwrap();
    std::fs::create_dir_all(dir.join("model")).unwrap();
    std::fs::write(dir.join("model/config.json"), config).unwrap();
    (dir, pipe)
}

fn run(dir: &Path, pipe: &Path) -> std::process::Output {
    draftpipe(&["run", pipe.to_str().unwrap()], dir)
}

#[test]
fn a_tap_of_the_targets_depth_is_its_last_hidden_state_and_passes_the_check() {
    // Four layers: hidden_states has 5 entries, the last (tap 4) the last layer's output.
    let (dir, pipe) = pipe_with_target_config("deepest-tap", r#"{"num_hidden_layers": 4}"#);
    let out = run(&dir, &pipe);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        !err.contains("beyond") && err.contains("target weights"),
        "a tap at the target's depth was refused (or the run failed elsewhere than at the empty weights):\n{err}"
    );

    // A tap past the last entry is still an error that counts the entries.
    std::fs::write(dir.join("model/config.json"), r#"{"num_hidden_layers": 3}"#).unwrap();
    let out = run(&dir, &pipe);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("tap 4 is beyond the target's 3 layers")
            && err.contains("model/config.json")
            && err.contains("which has 4 entries (0: the embeddings, 3: the last layer's output)"),
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
