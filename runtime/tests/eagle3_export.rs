//! The `eagle3` export as SGLang's `LlamaForCausalLMEagle3` and vLLM's `Eagle3LlamaForCausalLM` see it: the
//! config's keys, the tensors' names, dtypes and values, `export-check` loading it, and broken exports, each
//! refused for its reason.

mod source_support;

use std::path::Path;

use draftpipe_compiler::plan::Eagle3Spec;
use draftpipe_runtime::checkpoint::{CONFIG_FILE, WeightsDtype};
use draftpipe_runtime::export_check::{
    CheckOptions, Engine, ExportReport, Severity, Verdict, check_export,
};
use draftpipe_runtime::model::eagle3::export::{
    EAGLE3_ARCHITECTURE, Eagle3ExportError, WEIGHTS_FILE, write_eagle3_export,
};
use draftpipe_runtime::model::eagle3::vocab::{TokenCounts, VocabMap};
use draftpipe_runtime::tensor_file::F32Tensor;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use serde_json::{Value, json};
use source_support::temp_dir;

fn spec() -> Eagle3Spec {
    Eagle3Spec {
        hidden: 8,
        taps: 3,
        tap_layers: vec![2, 4, 6],
        vocab: 40,
        draft_vocab: 12,
        heads: 2,
        kv_heads: 1,
        head_dim: 4,
        intermediate: 16,
        ttt: 3,
        rope_theta: 1_000_000.0,
        rms_norm_eps: 1e-6,
    }
}

/// A map whose draft vocabulary is ids 3, 6, 9, … (every third id counted twice, the rest once).
fn map() -> VocabMap {
    let mut counts = TokenCounts::new(40);
    let ids: Vec<i64> = (0..40).chain((0..40).step_by(3)).collect();
    counts.add_sequence(&ids, &vec![1; ids.len()]).unwrap();
    VocabMap::from_counts(&counts, 12).unwrap()
}

/// The layout's tensors, each filled with a distinct ramp.
fn weights(spec: &Eagle3Spec) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    spec.layout()
        .into_iter()
        .enumerate()
        .map(|(t, view)| {
            let data = (0..view.len())
                .map(|i| (t * 1000 + i) as f32 * 0.001)
                .collect();
            (view.name, view.shape, data)
        })
        .collect()
}

fn export(dir: &Path, dtype: WeightsDtype) -> Result<(), Eagle3ExportError> {
    std::fs::create_dir_all(dir).unwrap();
    let spec = spec();
    let weights = weights(&spec);
    let tensors: Vec<F32Tensor<'_>> = weights
        .iter()
        .map(|(name, shape, data)| F32Tensor { name, shape, data })
        .collect();
    write_eagle3_export(dir, &spec, &tensors, &map(), dtype)
}

fn config(dir: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(dir.join(CONFIG_FILE)).unwrap()).unwrap()
}

#[test]
fn the_config_is_sglangs_llama_eagle3_with_each_engines_aux_layer_ids() {
    let dir = temp_dir("eagle3-export-config");
    export(&dir, WeightsDtype::Bf16).unwrap();
    let config = config(&dir);
    let expected = json!({
        "architectures": [EAGLE3_ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": 8,
        "target_hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 4,
        "hidden_act": "silu",
        "rope_theta": 1_000_000.0,
        "rms_norm_eps": 1e-6,
        "vocab_size": 40,
        "draft_vocab_size": 12,
        "tie_word_embeddings": false,
        // SGLang: the layer whose output each tap is; vLLM: the layer the tap enters (the hidden-states index).
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5], "use_aux_hidden_state": true},
        "eagle_aux_hidden_state_layer_ids": [2, 4, 6],
        "torch_dtype": "bfloat16",
        "draftpipe": {"tap_layers": [2, 4, 6], "ttt": 3},
    });
    for (key, value) in expected.as_object().unwrap() {
        assert_eq!(&config[key], value, "config key `{key}`");
    }
}

#[test]
fn the_weights_are_the_layout_then_int64_d2t_and_bool_t2d_without_the_embedding() {
    let dir = temp_dir("eagle3-export-tensors");
    export(&dir, WeightsDtype::F32).unwrap();
    let bytes = std::fs::read(dir.join(WEIGHTS_FILE)).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<String> = file.names().into_iter().map(str::to_owned).collect();
    names.sort();
    let mut expected: Vec<String> = spec().layout().into_iter().map(|v| v.name).collect();
    expected.extend(["d2t".into(), "t2d".into()]);
    expected.sort();
    assert_eq!(names, expected);
    assert!(!names.iter().any(|n| n.contains("embed")));
    for (name, shape, data) in weights(&spec()) {
        let view = file.tensor(&name).unwrap();
        assert_eq!(
            (view.dtype(), view.shape()),
            (Dtype::F32, shape.as_slice()),
            "{name}"
        );
        let stored: Vec<f32> = view
            .data()
            .chunks(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(stored, data, "{name}");
    }
    let d2t = file.tensor("d2t").unwrap();
    assert_eq!((d2t.dtype(), d2t.shape()), (Dtype::I64, &[12][..]));
    let d2t: Vec<i64> = d2t
        .data()
        .chunks(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(d2t, map().d2t);
    // Draft id i is target id 3i: the offsets SGLang adds `arange` to.
    assert_eq!(
        d2t.iter()
            .enumerate()
            .map(|(i, d)| i as i64 + d)
            .collect::<Vec<_>>(),
        (0..12).map(|i| 3 * i).collect::<Vec<i64>>()
    );
    let t2d = file.tensor("t2d").unwrap();
    assert_eq!((t2d.dtype(), t2d.shape()), (Dtype::BOOL, &[40][..]));
    assert_eq!(
        t2d.data(),
        map().t2d.iter().map(|&b| u8::from(b)).collect::<Vec<_>>()
    );
    // The map reads back from the export itself.
    assert_eq!(
        VocabMap::read(&dir.join(WEIGHTS_FILE), Some((12, 40))).unwrap(),
        map()
    );
}

#[test]
fn the_writer_refuses_tensors_that_are_not_the_layout_and_a_map_of_other_sizes() {
    let dir = temp_dir("eagle3-export-refused");
    let spec = spec();
    let weights = weights(&spec);
    let mut tensors: Vec<F32Tensor<'_>> = weights
        .iter()
        .map(|(name, shape, data)| F32Tensor { name, shape, data })
        .collect();
    tensors.swap(1, 2);
    let err = write_eagle3_export(&dir, &spec, &tensors, &map(), WeightsDtype::F32).unwrap_err();
    assert!(
        matches!(&err, Eagle3ExportError::Layout { index: 1, .. }),
        "{err}"
    );
    tensors.swap(1, 2);
    tensors.pop();
    let err = write_eagle3_export(&dir, &spec, &tensors, &map(), WeightsDtype::F32).unwrap_err();
    assert!(err.to_string().contains("`lm_head.weight`"), "{err}");
    let tensors: Vec<F32Tensor<'_>> = weights
        .iter()
        .map(|(name, shape, data)| F32Tensor { name, shape, data })
        .collect();
    let err = write_eagle3_export(
        &dir,
        &spec,
        &tensors,
        &VocabMap::identity(40),
        WeightsDtype::F32,
    )
    .unwrap_err();
    assert!(
        matches!(err, Eagle3ExportError::MapSizes { draft: 40, .. }),
        "{err}"
    );
}

fn check(dir: &Path) -> ExportReport {
    check_export(dir, &CheckOptions::default()).unwrap()
}

/// The fatal messages `report` has for `engine`.
fn fatal(report: &ExportReport, engine: Engine) -> Vec<String> {
    report
        .findings_for(engine)
        .filter(|f| f.severity == Severity::Fatal)
        .map(|f| f.message.clone())
        .collect()
}

fn edit_config(dir: &Path, edit: impl FnOnce(&mut Value)) {
    let mut value = config(dir);
    edit(&mut value);
    std::fs::write(
        dir.join(CONFIG_FILE),
        serde_json::to_vec_pretty(&value).unwrap(),
    )
    .unwrap();
}

/// Rewrites `model.safetensors` through `edit` over `(name, dtype, shape, bytes)`.
fn edit_weights(dir: &Path, edit: impl FnOnce(&mut Vec<(String, Dtype, Vec<usize>, Vec<u8>)>)) {
    let path = dir.join(WEIGHTS_FILE);
    let bytes = std::fs::read(&path).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<_> = file
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            (
                name,
                view.dtype(),
                view.shape().to_vec(),
                view.data().to_vec(),
            )
        })
        .collect();
    edit(&mut tensors);
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(name, dtype, shape, data)| {
            (
                name.clone(),
                TensorView::new(*dtype, shape.clone(), data).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &path).unwrap();
}

/// A fresh export in a directory of its own, edited by `broken`, and its report.
fn broken(name: &str, broken: impl FnOnce(&Path)) -> ExportReport {
    let dir = temp_dir(&format!("eagle3-export-{name}"));
    export(&dir, WeightsDtype::Bf16).unwrap();
    broken(&dir);
    check(&dir)
}

fn any(messages: &[String], needle: &str) -> bool {
    messages.iter().any(|m| m.contains(needle))
}

#[test]
fn both_engines_load_the_export_as_written() {
    let report = broken("good", |_| {});
    for engine in Engine::ALL {
        assert_eq!(report.verdict(engine), Verdict::Loads, "{report}");
    }
    // Asking for more drafts than the unroll trained is worth a warning.
    let dir = temp_dir("eagle3-export-tokens");
    export(&dir, WeightsDtype::F32).unwrap();
    let options = CheckOptions {
        tokenizer: None,
        speculative_tokens: Some(5),
    };
    let report = check_export(&dir, &options).unwrap();
    assert_eq!(
        report.verdict(Engine::Vllm),
        Verdict::LoadsWithWarnings,
        "{report}"
    );
    assert!(report.to_string().contains("past the 3"), "{report}");
}

#[test]
fn a_broken_d2t_is_refused_with_its_reason() {
    let report = broken("no-d2t", |dir| {
        edit_weights(dir, |t| t.retain(|(n, ..)| n != "d2t"))
    });
    for engine in Engine::ALL {
        assert!(
            any(&fatal(&report, engine), "maps draft id i to target id i"),
            "{report}"
        );
    }
    let report = broken("float-d2t", |dir| {
        edit_weights(dir, |t| {
            let d2t = t.iter_mut().find(|(n, ..)| n == "d2t").unwrap();
            let values: Vec<u8> = map()
                .d2t
                .iter()
                .flat_map(|&d| (d as f32).to_le_bytes())
                .collect();
            (d2t.1, d2t.3) = (Dtype::F32, values);
        })
    });
    assert!(
        any(&fatal(&report, Engine::Sglang), "expected int64"),
        "{report}"
    );
    assert_eq!(
        report.verdict(Engine::Vllm),
        Verdict::LoadsWithWarnings,
        "{report}"
    );
    let report = broken("range-d2t", |dir| {
        edit_weights(dir, |t| {
            let d2t = t.iter_mut().find(|(n, ..)| n == "d2t").unwrap();
            d2t.3[88..96].copy_from_slice(&40i64.to_le_bytes());
        })
    });
    for engine in Engine::ALL {
        assert!(
            any(
                &fatal(&report, engine),
                "`d2t[11]` = 40 maps draft id 11 to target id 51"
            ),
            "{report}"
        );
    }
}

#[test]
fn a_broken_config_is_refused_with_its_reason() {
    let report = broken("no-nested-ids", |dir| {
        edit_config(dir, |c| {
            c.as_object_mut()
                .unwrap()
                .remove("eagle_config")
                .map(drop)
                .unwrap()
        })
    });
    assert!(
        any(
            &fatal(&report, Engine::Sglang),
            "no `eagle_config.eagle_aux_hidden_state_layer_ids`"
        ),
        "{report}"
    );
    assert_eq!(report.verdict(Engine::Vllm), Verdict::Loads, "{report}");

    let report = broken("shifted-ids", |dir| {
        edit_config(dir, |c| {
            c["eagle_aux_hidden_state_layer_ids"] = json!([1, 3, 5])
        })
    });
    assert!(
        any(
            &fatal(&report, Engine::Vllm),
            "would feed hidden states [1, 3, 5]"
        ),
        "{report}"
    );
    assert_eq!(report.verdict(Engine::Sglang), Verdict::Loads, "{report}");

    let report = broken("two-layers", |dir| {
        edit_config(dir, |c| c["num_hidden_layers"] = json!(2))
    });
    for engine in Engine::ALL {
        assert!(
            any(&fatal(&report, engine), "`num_hidden_layers` is 2"),
            "{report}"
        );
    }
    let report = broken("no-draft-vocab", |dir| {
        edit_config(dir, |c| {
            c.as_object_mut()
                .unwrap()
                .remove("draft_vocab_size")
                .map(drop)
                .unwrap()
        })
    });
    assert!(
        any(
            &fatal(&report, Engine::Sglang),
            "loads the target's `lm_head`"
        ),
        "{report}"
    );
    // Both then expect a head over the whole vocabulary.
    assert!(
        any(
            &fatal(&report, Engine::Vllm),
            "`lm_head.weight` has shape [12, 8], the config's model expects [40, 8]"
        ),
        "{report}"
    );

    let report = broken("tied", |dir| {
        edit_config(dir, |c| c["tie_word_embeddings"] = json!(true))
    });
    assert!(
        any(&fatal(&report, Engine::Sglang), "embedding as its head"),
        "{report}"
    );
    assert_eq!(report.verdict(Engine::Vllm), Verdict::Loads, "{report}");

    let report = broken("qwen3", |dir| {
        edit_config(dir, |c| c["model_type"] = json!("qwen3"))
    });
    assert_eq!(
        report.verdict(Engine::Sglang),
        Verdict::DoesNotLoad,
        "{report}"
    );
}

#[test]
fn names_the_loaders_do_not_map_are_refused_or_skipped_as_each_engine_does() {
    // A `model.` prefix: SGLang tries `model.model.lm_head.weight`, skips it and keeps an uninitialised head;
    // vLLM has no such parameter and raises.
    let report = broken("prefixed-head", |dir| {
        edit_weights(dir, |t| {
            t.iter_mut()
                .find(|(n, ..)| n == "lm_head.weight")
                .unwrap()
                .0 = "model.lm_head.weight".into()
        })
    });
    assert!(
        any(
            &fatal(&report, Engine::Sglang),
            "no tensor for parameter `lm_head.weight`"
        ),
        "{report}"
    );
    assert!(
        any(&fatal(&report, Engine::Vllm), "model.lm_head.weight"),
        "{report}"
    );

    // An unknown tensor: SGLang skips it (a warning), vLLM's loader raises.
    let report = broken("extra", |dir| {
        edit_weights(dir, |t| {
            t.push(("extra.weight".into(), Dtype::F32, vec![1], vec![0; 4]))
        })
    });
    assert_eq!(
        report.verdict(Engine::Sglang),
        Verdict::LoadsWithWarnings,
        "{report}"
    );
    assert!(
        any(&fatal(&report, Engine::Vllm), "`model.extra.weight`"),
        "{report}"
    );

    // A wrongly shaped projection: both loaders assert the shard's size.
    let report = broken("narrow-q", |dir| {
        edit_weights(dir, |t| {
            let q = t
                .iter_mut()
                .find(|(n, ..)| n == "midlayer.self_attn.q_proj.weight")
                .unwrap();
            (q.2, q.3) = (vec![8, 8], vec![0; 128]);
        })
    });
    for engine in Engine::ALL {
        assert!(
            any(
                &fatal(&report, engine),
                "has shape [8, 8], the config's model expects [8, 16]"
            ),
            "{report}"
        );
    }
}
