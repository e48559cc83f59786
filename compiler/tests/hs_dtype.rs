//! The target's `hs_dtype`: the precision hidden states are held in from the source to the step, its defaults
//! per source, its checks, and the pool memory `compile` reports in it.

use draftpipe_compiler::compile_source;
use draftpipe_compiler::plan::{Device, HsDtype};
use draftpipe_compiler::summary::Summary;

const DFLASH: &str = include_str!("../../pipelines/dflash-5x3.pipe");

fn plan_with(source: &str, hs_dtype: &str) -> String {
    format!(
        r#"pipeline "p"
target t on cpu {{
    hidden = 8
    tap_layers = [0]
    vocab = 16
    batch_tokens = 64
    source = {source}
    {hs_dtype}
}}
queue q from t to d {{ capacity = 2 buckets = [8] }}
drafter d on cpu {{ model = mlp(hidden = 4, blocks = 1, intermediate = 4, heads = 1) }}
"#
    )
}

const SYNTHETIC: &str = "synthetic(seed = 1, lengths = 1..8)";
const FILES: &str = "safetensors(path = \"data/*.safetensors\")";
const STREAM: &str = "stream(listen = \"127.0.0.1:7070\")";

#[test]
fn each_source_has_its_default_and_a_written_hs_dtype_wins() {
    let dtype = |source: &str, line: &str| {
        compile_source("p.pipe", &plan_with(source, line))
            .unwrap()
            .target
            .hs_dtype
    };
    assert_eq!(dtype(SYNTHETIC, ""), Some(HsDtype::F32));
    assert_eq!(dtype(STREAM, ""), Some(HsDtype::Bf16));
    assert_eq!(
        dtype(FILES, ""),
        None,
        "the files decide when they are opened"
    );
    for (text, want) in [
        ("bf16", HsDtype::Bf16),
        ("f16", HsDtype::F16),
        ("f32", HsDtype::F32),
    ] {
        for source in [SYNTHETIC, STREAM, FILES] {
            assert_eq!(dtype(source, &format!("hs_dtype = {text}")), Some(want));
        }
    }
}

#[test]
fn an_unknown_hs_dtype_is_refused_where_it_is_written() {
    let error = compile_source("p.pipe", &plan_with(SYNTHETIC, "hs_dtype = bf8"))
        .unwrap_err()
        .to_string();
    assert!(error.contains("unknown `hs_dtype` value `bf8`"), "{error}");
    assert!(error.contains("p.pipe:8:16"), "{error}");
    assert!(error.contains("bf16"), "{error}");
    let error = compile_source("p.pipe", &plan_with(SYNTHETIC, "hs_dtype = \"bf16\""))
        .unwrap_err()
        .to_string();
    assert!(error.contains("hs_dtype"), "{error}");
}

#[test]
fn the_dflash_pool_halves_its_hidden_states_in_bf16() {
    let bf16_plan = compile_source("dflash.pipe", DFLASH).unwrap();
    assert_eq!(bf16_plan.target.hs_dtype, Some(HsDtype::Bf16));
    let f32_text = DFLASH.replace("hs_dtype     = bf16", "hs_dtype     = f32");
    let f32_plan = compile_source("dflash.pipe", &f32_text).unwrap();
    let pool = |plan: &draftpipe_compiler::plan::Plan| plan.host_memory.hs_pool();
    // 71 buffers (the queue's 60, 2 for each of the 3 drafters, 1 for each of the 5 producers) of 8192 tokens ×
    // (e·20480 + 4 + 1) bytes (5 taps of 4096), plus 4 bytes per sequence of the largest count (8192 / 2048 = 4).
    let buffer = |e: u64| 8192 * (e * 20480 + 5) + 4 * 4;
    assert_eq!(bf16_plan.host_memory.hs_pool_buffers, 71);
    assert_eq!(pool(&f32_plan), 71 * buffer(4));
    assert_eq!(pool(&bf16_plan), 71 * buffer(2));
    // The hidden states' share halves exactly; ids, masks and lengths stay as they were.
    assert_eq!(pool(&f32_plan) - pool(&bf16_plan), 71 * 8192 * 20480 * 2);
    // One host allocation: no drafter GPU is charged for it.
    for memory in &bf16_plan.memory {
        assert_ne!(memory.device, Device::Cpu);
        assert_eq!(
            memory.total(),
            memory.parameters
                + memory.gradients
                + memory.optimizer_state
                + memory.frozen_weights
                + memory.workspaces
        );
    }
    let summary = Summary(&bf16_plan).to_string();
    assert!(summary.contains("hidden states in bf16"), "{summary}");
}

#[test]
fn cuda_input_slots_hold_bf16_at_bf16_precision_beside_one_16_bit_operand_copy() {
    use draftpipe_compiler::plan::Precision;
    use draftpipe_compiler::workspace::Dtype;

    let bf16_plan = compile_source("dflash.pipe", DFLASH).unwrap();
    assert_eq!(
        bf16_plan.drafter.precision,
        Precision::Bf16,
        "the GPU default"
    );
    let f32_text = DFLASH.replace("hs_dtype     = bf16", "hs_dtype     = f32");
    let f32_plan = compile_source("dflash.pipe", &f32_text).unwrap();
    let buffer = |layout: &draftpipe_compiler::plan::WorkspaceLayout, name: &str| {
        layout
            .buffers
            .iter()
            .find(|b| b.name == name)
            .map(|b| (b.dtype, b.elements))
    };
    let gpu = Device::Gpu(5);
    let bf16 = bf16_plan.workspace_layout(gpu).unwrap();
    let f32 = f32_plan.workspace_layout(gpu).unwrap();
    // 8192 tokens of 5 taps × 4096; the copy holds the larger of fc [4096, 20480] and its gradient's upstream
    // [8192, 4096].
    let (tokens, width, hidden) = (8192, 5 * 4096, 4096);
    for slot in 0..2 {
        let name = format!("input{slot}.hs");
        assert_eq!(buffer(&bf16, &name), Some((Dtype::Bf16, tokens * width)));
        assert_eq!(buffer(&f32, &name), Some((Dtype::F32, tokens * width)));
    }
    let operand = hidden * width;
    assert_eq!(
        buffer(&bf16, "gemm_hs_operand"),
        Some((Dtype::Bf16, operand))
    );
    assert_eq!(buffer(&f32, "gemm_hs_operand"), None);
    let saved = (2 * tokens * width * 2 - operand * 2) as u64;
    assert_eq!(f32.bytes().unwrap() - bf16.bytes().unwrap(), saved);
    // `compile`'s memory figure is this layout, once per worker (one per GPU).
    let workspaces = |plan: &draftpipe_compiler::plan::Plan| {
        plan.memory
            .iter()
            .find(|m| m.device == gpu)
            .unwrap()
            .workspaces
    };
    assert_eq!(workspaces(&f32_plan) - workspaces(&bf16_plan), saved);

    // f32 and TF32 products must not round the f32 operand: their slots stay f32 and the host widens.
    for precision in [Precision::F32, Precision::Tf32] {
        let mut plan = bf16_plan.clone();
        plan.drafter.precision = precision;
        let layout = plan.workspace_layout(gpu).unwrap();
        assert_eq!(
            buffer(&layout, "input0.hs"),
            Some((Dtype::F32, tokens * width))
        );
        assert_eq!(buffer(&layout, "gemm_hs_operand"), None, "{precision:?}");
    }
    // The CPU's layout converts tiles of rows and needs no operand copy.
    let cpu = bf16_plan.workspace_layout(Device::Cpu).unwrap();
    assert_eq!(buffer(&cpu, "gemm_hs_operand"), None);
    assert_eq!(
        buffer(&cpu, "input0.hs"),
        Some((Dtype::Bf16, tokens * width))
    );
}

/// f16 hidden states on CUDA at bf16 precision are held in bf16 slots beside a bf16 operand copy: an f16 copy
/// of the `fc` weight gradient's upstream gradient (1e-8 to 1e-5) would underflow (issue 19, "16-bit
/// gradients"). The CPU keeps f16 slots (its tiles round to bf16 as it multiplies), and EAGLE-3's `last_hs`,
/// which no 16-bit product reads, stays f16 on both.
#[test]
fn f16_hidden_states_reach_cuda_products_as_bf16() {
    use draftpipe_compiler::plan::{BackendKind, Precision, WorkspaceLayout};
    use draftpipe_compiler::workspace::{Dtype, WorkspaceBuffer};

    let f16_text = DFLASH.replace("hs_dtype     = bf16", "hs_dtype     = f16");
    assert_ne!(f16_text, DFLASH, "the pipeline names its hs_dtype");
    let plan = compile_source("dflash.pipe", &f16_text).unwrap();
    assert_eq!(plan.drafter.precision, Precision::Bf16);
    let dtype = |layout: &WorkspaceLayout, name: &str| {
        layout
            .buffers
            .iter()
            .find(|b| b.name == name)
            .map(|b| b.dtype)
    };
    let gpu = plan.workspace_layout(Device::Gpu(5)).unwrap();
    assert_eq!(dtype(&gpu, "input0.hs"), Some(Dtype::Bf16));
    assert_eq!(dtype(&gpu, "input1.hs"), Some(Dtype::Bf16));
    assert_eq!(dtype(&gpu, "gemm_hs_operand"), Some(Dtype::Bf16));
    let cpu = plan.workspace_layout(Device::Cpu).unwrap();
    assert_eq!(dtype(&cpu, "input0.hs"), Some(Dtype::F16));

    let with_last_hs = |backend| {
        let layout = WorkspaceLayout {
            tokens: 4,
            sequences: 1,
            chunk_rows: 4,
            input_slots: 1,
            hs_operand_elements: 16,
            buffers: ["input0.hs", "input0.last_hs"]
                .map(|name| WorkspaceBuffer {
                    name: name.to_owned(),
                    dtype: Dtype::F32,
                    elements: 16,
                })
                .to_vec(),
        };
        layout.with_hs_dtype(backend, HsDtype::F16).unwrap()
    };
    let cuda = with_last_hs(BackendKind::Cuda);
    assert_eq!(dtype(&cuda, "input0.hs"), Some(Dtype::Bf16));
    assert_eq!(dtype(&cuda, "input0.last_hs"), Some(Dtype::F16));
    assert_eq!(
        dtype(&with_last_hs(BackendKind::Cpu), "input0.last_hs"),
        Some(Dtype::F16)
    );
}
