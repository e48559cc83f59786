//! Plan tests: the figures the runtime relies on (parameter count, flat layout, bucket shapes, memory per
//! device, FLOPs), the documented defaults, and the checks that need a whole plan (memory limits).

use draftpipe_compiler::compile_source;
use draftpipe_compiler::family::mlp::cost;
use draftpipe_compiler::plan::*;

const QUICKSTART: &str = include_str!("../../pipelines/quickstart.pipe");
/// The five-target, three-drafter topology with the mlp drafter at Qwen3-8B's target shapes.
const MLP_5X3: &str = include_str!("../../pipelines/mlp-5x3.pipe");

#[test]
fn mlp_5x3_parameter_count_matches_the_closed_formula() {
    let plan = compile_source("mlp-5x3.pipe", MLP_5X3).unwrap();
    // din = 4096 × 3 taps; H = 1024, I = 2816, 2 blocks, 4 heads, V = 151936.
    let (din, h, i, blocks, heads, v) = (
        12288usize,
        1024usize,
        2816usize,
        2usize,
        4usize,
        151936usize,
    );
    let expected = h * din + blocks * (h + 3 * i * h) + h + heads * h * h + v * h;
    assert_eq!(expected, 189_664_256);
    assert_eq!(plan.model.parameters, expected);
    assert_eq!(
        plan.model.spec,
        ModelSpec::Mlp(MlpSpec {
            din,
            hidden: h,
            blocks,
            intermediate: i,
            heads,
            vocab: v
        })
    );
}

#[test]
fn layout_is_contiguous_with_pytorch_names_and_out_in_shapes() {
    let plan = compile_source("mlp-5x3.pipe", MLP_5X3).unwrap();
    let layout = &plan.model.layout;
    let names: Vec<&str> = layout.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "fc.weight",
            "blocks.0.norm.weight",
            "blocks.0.gate.weight",
            "blocks.0.up.weight",
            "blocks.0.down.weight",
            "blocks.1.norm.weight",
            "blocks.1.gate.weight",
            "blocks.1.up.weight",
            "blocks.1.down.weight",
            "norm.weight",
            "heads.0.weight",
            "heads.1.weight",
            "heads.2.weight",
            "heads.3.weight",
            "lm_head.weight",
        ]
    );
    assert_eq!(layout[0].shape, [1024, 12288]);
    assert_eq!(layout[2].shape, [2816, 1024]);
    assert_eq!(layout[4].shape, [1024, 2816]);
    assert_eq!(layout[14].shape, [151936, 1024]);
    let mut offset = 0;
    for view in layout {
        assert_eq!(view.offset, offset, "{} is not contiguous", view.name);
        offset += view.len();
    }
    assert_eq!(offset, plan.model.parameters);
}

#[test]
fn buckets_get_static_shapes() {
    let plan = compile_source("q.pipe", QUICKSTART).unwrap();
    let shapes: Vec<(usize, usize, usize)> = plan
        .buckets
        .iter()
        .map(|b| (b.padded_len, b.sequences, b.tokens))
        .collect();
    assert_eq!(shapes, [(128, 16, 2048), (256, 8, 2048), (512, 4, 2048)]);
    // A bucket that does not divide batch_tokens keeps whole sequences only.
    let odd = QUICKSTART.replace("[128, 256, 512]", "[100, 512]");
    let plan = compile_source("odd.pipe", &odd).unwrap();
    assert_eq!(
        (plan.buckets[0].sequences, plan.buckets[0].tokens),
        (20, 2000)
    );
}

#[test]
fn quickstart_memory_matches_the_documented_formula() {
    let plan = compile_source("q.pipe", QUICKSTART).unwrap();
    let p = 2_491_136u64;
    assert_eq!(plan.model.parameters as u64, p);
    // Two CPU workers hold two replicas, each with the workspace layout of docs/language.md (T 2048, S 16,
    // C 1024): per token (L+1)H + LH residual and normed streams, L+1 norms, 3LI gate/up/act, the final norm H,
    // 4H for the head in hand, 2J labels and row losses, 3H + 3I backward scratch; then the logits chunk,
    // per-head scalars, partials and AdamW's state; one input slot.
    let (t, h, i, l, j, din, v) = (2048u64, 256u64, 704u64, 2u64, 4u64, 384u64, 4096u64);
    let per_token = (l + 1) * h + l * h + (l + 1) + 3 * l * i + h + 4 * h + 2 * j + 3 * h + 3 * i;
    let partials = (j * t).div_ceil(1024) + t.div_ceil(64) * h + p.div_ceil(1024);
    let workspace = 4 * (t * per_token + 1024 * v + 2 * j + partials + 3 + 7)
        + 8 * 3
        + (t * (4 * din + 4 + 1) + 4 * 16);
    assert_eq!(workspace, 99_233_476);
    // A pooled buffer holds any bucket: 2048 tokens and the 16 sequences of bucket 128 (hidden states, ids, mask,
    // lengths); the queue's 16, 2 for each of the 2 drafters and 1 for the producer.
    let buffer = 2048 * (4 * 384 + 4 + 1) + 4 * 16;
    assert_eq!(
        plan.host_memory,
        HostMemory {
            hs_pool_buffers: 21,
            hs_buffer_bytes: buffer,
            stream_receive: 0,
        }
    );
    assert_eq!(
        plan.memory,
        [DeviceMemory {
            device: Device::Cpu,
            parameters: 2 * 4 * p,
            gradients: 2 * 4 * p,
            optimizer_state: 2 * 8 * p,
            frozen_weights: 0,
            workspaces: 2 * workspace,
        }]
    );
}

#[test]
fn mlp_5x3_memory_is_per_drafter_gpu() {
    let plan = compile_source("mlp-5x3.pipe", MLP_5X3).unwrap();
    let devices: Vec<Device> = plan.memory.iter().map(|m| m.device).collect();
    assert_eq!(devices, [Device::Gpu(5), Device::Gpu(6), Device::Gpu(7)]);
    let m = &plan.memory[0];
    let p = 189_664_256u64;
    assert_eq!(
        (m.parameters, m.gradients, m.optimizer_state),
        (4 * p, 4 * p, 8 * p)
    );
    // The CUDA layout: as the quickstart's (see above), with two input slots and cuBLAS's 32 MiB workspace. The
    // slots hold the bf16 hidden states (`hs_dtype = bf16`, bf16 precision), beside the bf16 copy of the larger
    // f32 operand their products take (`fc` [H, din] or the upstream gradient [T, H]).
    let (t, h, i, l, j, din, v) = (16384u64, 1024u64, 2816u64, 2u64, 4u64, 12288u64, 151936u64);
    let per_token = (l + 1) * h + l * h + (l + 1) + 3 * l * i + h + 4 * h + 2 * j + 3 * h + 3 * i;
    let partials = (j * t).div_ceil(1024) + t.div_ceil(64) * h + p.div_ceil(1024);
    let slot = t * (2 * din + 4 + 1) + 4 * 16;
    let operand_copy = 2 * (h * din).max(t * h);
    let workspace = 4 * (t * per_token + 4096 * v + 2 * j + partials + 3 + 7)
        + 8 * 3
        + 2 * slot
        + operand_copy
        + (32 << 20);
    assert_eq!(m.workspaces, workspace);
    // Hidden states held in bf16 (`hs_dtype = bf16`): 2 bytes each, in one host pool of 60 + 2·3 + 5 buffers.
    assert_eq!(
        plan.host_memory.hs_pool(),
        71 * (16384 * (2 * 12288 + 5) + 4 * 16)
    );
    assert!(m.total() < 141 << 30);
}

#[test]
fn step_flops_follow_the_formula() {
    let plan = compile_source("mlp-5x3.pipe", MLP_5X3).unwrap();
    let (t, din, h, i, l, heads, v) = (16384u64, 12288u64, 1024u64, 2816u64, 2u64, 4u64, 151936u64);
    let p = plan.model.parameters as u64;
    let forward_gemm = 2 * t * (h * din + l * 3 * i * h + heads * h * h + heads * h * v);
    let backward_gemm = 2 * forward_gemm - 2 * t * h * din;
    let expected = forward_gemm + backward_gemm + 4 * t * heads * v + 12 * p;
    assert!(plan.buckets.iter().all(|b| b.step_flops == expected));
    assert_eq!(
        cost::step_flops(plan.model.spec.as_mlp().unwrap(), 16384),
        Some(expected)
    );
}

#[test]
fn defaults_are_documented_values() {
    let plan = compile_source("q.pipe", QUICKSTART).unwrap();
    let o = plan.drafter.optimizer;
    assert_eq!(
        (
            o.lr,
            o.beta1,
            o.beta2,
            o.eps,
            o.weight_decay,
            o.clip_grad_norm
        ),
        (1e-3, 0.9, 0.999, 1e-8, 0.01, None)
    );
    assert_eq!(
        plan.drafter.loss,
        LossSpec {
            head_decay: 0.8,
            position_decay: None,
            step_decay: None,
            chunk_tokens: 1024
        }
    );
    assert_eq!(
        (plan.drafter.sync, plan.drafter.launch),
        (SyncMode::AllReduce, LaunchMode::Graph)
    );
    assert_eq!(
        plan.telemetry,
        TelemetrySpec {
            every_ms: 1000,
            trace: None,
            tensorboard: None,
        }
    );
    assert_eq!(
        plan.schedule,
        [
            StepPhase::Copy,
            StepPhase::Forward,
            StepPhase::Loss,
            StepPhase::Backward,
            StepPhase::AllReduce,
            StepPhase::Optimizer
        ]
    );
    let single = QUICKSTART
        .replace("on cpu x2", "on cpu")
        .replace("    loss      = cross_entropy(head_decay = 0.8)\n", "");
    let plan = compile_source("single.pipe", &single).unwrap();
    assert_eq!(
        plan.drafter.loss,
        LossSpec {
            head_decay: 1.0,
            position_decay: None,
            step_decay: None,
            chunk_tokens: 1024
        }
    );
    assert!(
        !plan.schedule.contains(&StepPhase::AllReduce),
        "one worker has nothing to all-reduce"
    );
}

#[test]
fn mlp_5x3_plan_reads_every_setting() {
    let plan = compile_source("mlp-5x3.pipe", MLP_5X3).unwrap();
    assert_eq!(plan.name, "mlp-qwen3-8b");
    assert_eq!(plan.devices.len(), 8);
    assert_eq!(
        plan.devices[3],
        DeclaredDevice {
            device: Device::Gpu(3),
            memory_bytes: 141 << 30
        }
    );
    assert_eq!(
        plan.target.placement.workers,
        (0..5).map(Device::Gpu).collect::<Vec<_>>()
    );
    assert_eq!(
        plan.target.source,
        SourceSpec::Synthetic {
            seed: 7,
            min_len: 256,
            max_len: 16384
        }
    );
    assert_eq!(plan.queue.buckets, [1024, 2048, 4096, 8192, 16384]);
    assert_eq!(
        (plan.queue.capacity, plan.queue.min_ready, plan.queue.pull),
        (60, 10, PullPolicy::RandomInBucket)
    );
    let o = plan.drafter.optimizer;
    assert_eq!(
        (o.lr, o.beta1, o.beta2, o.clip_grad_norm),
        (3e-4, 0.9, 0.95, Some(1.0))
    );
    assert_eq!(plan.drafter.loss.chunk_tokens, 4096);
    assert_eq!(
        plan.telemetry.trace.as_deref(),
        Some("runs/mlp-5x3/trace.json")
    );
}

#[test]
fn safetensors_sources_skip_the_length_checks() {
    let source = QUICKSTART.replace(
        "synthetic(seed = 1, lengths = 64..512)",
        "safetensors(path = \"hs/*.safetensors\")",
    );
    let plan = compile_source("st.pipe", &source).unwrap();
    assert_eq!(
        plan.target.source,
        SourceSpec::Safetensors {
            pattern: "hs/*.safetensors".into(),
            epochs: 1,
            shuffle_seed: None,
        }
    );
}

#[test]
fn memory_limit_is_exact() {
    let plan = compile_source("q.pipe", QUICKSTART).unwrap();
    // The host holds the CPU drafters' replicas and the hidden-state pool.
    let total = plan.memory[0].total() + plan.host_memory.total();
    let with_cpu = |bytes: u64| {
        QUICKSTART.replace(
            "target tiny",
            &format!("devices {{ cpu {{ memory = {bytes}B }} }}\n\ntarget tiny"),
        )
    };
    let fits = compile_source("fits.pipe", &with_cpu(total)).unwrap();
    assert_eq!(
        fits.devices,
        [DeclaredDevice {
            device: Device::Cpu,
            memory_bytes: total
        }]
    );
    let over = compile_source("over.pipe", &with_cpu(total - 1)).unwrap_err();
    assert_eq!(over.len(), 1);
    let text = over.to_string();
    assert!(text.contains("(over by 1 B)"), "{text}");
    assert!(
        text.contains("parameters 19.0 MiB + gradients 19.0 MiB + optimizer state 38.0 MiB"),
        "{text}"
    );
}

#[test]
fn compile_file_reports_io_errors_with_the_path() {
    let err =
        draftpipe_compiler::compile_file(std::path::Path::new("/no/such/dir/x.pipe")).unwrap_err();
    assert!(matches!(err, draftpipe_compiler::CompileError::Io { .. }));
    assert!(err.to_string().contains("/no/such/dir/x.pipe"));
}

#[test]
fn safetensors_sources_take_epochs_and_a_shuffle_seed() {
    let source = QUICKSTART.replace(
        "synthetic(seed = 1, lengths = 64..512)",
        "safetensors(path = \"hs/*.safetensors\", epochs = 6, shuffle = true, seed = 3)",
    );
    let plan = compile_source("st.pipe", &source).unwrap();
    assert_eq!(
        plan.target.source,
        SourceSpec::Safetensors {
            pattern: "hs/*.safetensors".into(),
            epochs: 6,
            shuffle_seed: Some(3),
        }
    );
    let bad = QUICKSTART.replace(
        "synthetic(seed = 1, lengths = 64..512)",
        "safetensors(path = \"hs\", epochs = 0, shuffle = yes)",
    );
    let errors = compile_source("st.pipe", &bad).unwrap_err().to_string();
    assert!(errors.contains("`epochs` must be"), "{errors}");
    assert!(errors.contains("unknown `shuffle` value `yes`"), "{errors}");
}

#[test]
fn telemetry_tensorboard_names_a_directory_as_written() {
    let source = QUICKSTART.replace(
        "telemetry { every = 1s }",
        "telemetry {\n    every = 1s\n    tensorboard = \"runs/tb\"\n}",
    );
    let plan = compile_source("tb.pipe", &source).unwrap();
    assert_eq!(plan.telemetry.tensorboard.as_deref(), Some("runs/tb"));
    assert_eq!(
        compile_source("q.pipe", QUICKSTART)
            .unwrap()
            .telemetry
            .tensorboard,
        None
    );

    let empty = QUICKSTART.replace(
        "telemetry { every = 1s }",
        "telemetry {\n    every = 1s\n    tensorboard = \"\"\n}",
    );
    let error = compile_source("tb.pipe", &empty).unwrap_err().to_string();
    let line = source
        .lines()
        .position(|l| l.contains("tensorboard"))
        .unwrap()
        + 1;
    assert!(error.contains("tensorboard"), "{error}");
    assert!(error.contains(&format!("tb.pipe:{line}:")), "{error}");
    let number = compile_source(
        "tb.pipe",
        &QUICKSTART.replace("telemetry { every = 1s }", "telemetry { tensorboard = 3 }"),
    )
    .unwrap_err()
    .to_string();
    assert!(number.contains("tensorboard"), "{number}");
}
