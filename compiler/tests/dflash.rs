//! The `dflash` drafter in the language: the spec the checker builds from `model = dflash(...)`, the tensor
//! table (z-lab's names, order and shapes), the loss and schedule keys, and the target's frozen weights.

use draftpipe_compiler::compile_source;
use draftpipe_compiler::plan::*;

/// The issue's example, on a synthetic target (which needs no `weights`).
const ISSUE_EXAMPLE: &str = r#"
pipeline "dflash-example"
target t on cpu {
    hidden       = 64
    tap_layers   = [1, 2, 3]
    vocab        = 512
    batch_tokens = 64
    source       = synthetic(seed = 1, lengths = 8..32)
}
queue q from t to d { capacity = 4  buckets = [32] }
drafter d on cpu {
    model     = dflash(layers = 2, heads = 4, kv_heads = 2, head_dim = 16, intermediate = 128, block = 4, anchors = 64, mask_token = 511, rope_theta = 10000)
    loss      = cross_entropy(position_decay = 7.0)
    optimizer = adamw(lr = 1e-3, betas = (0.9, 0.999), eps = 1e-8, weight_decay = 0.0)
    schedule  = cosine(warmup = 0.04)
    steps     = 100
}
"#;

fn example_spec() -> DflashSpec {
    DflashSpec {
        hidden: 64,
        taps: 3,
        tap_layers: vec![1, 2, 3],
        vocab: 512,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        intermediate: 128,
        block: 4,
        anchors: 64,
        mask_token: 511,
        rope_theta: 10000.0,
        rms_norm_eps: 1e-6,
    }
}

#[test]
fn the_issue_example_compiles_to_its_dflash_spec() {
    let plan = compile_source("example.pipe", ISSUE_EXAMPLE).unwrap();
    assert_eq!(plan.model.spec, ModelSpec::Dflash(example_spec()));
    assert_eq!(plan.drafter.loss.position_decay, Some(7.0));
    assert_eq!(
        plan.drafter.optimizer.schedule,
        LrSchedule {
            kind: ScheduleKind::Cosine,
            warmup_steps: 4
        }
    );
    assert_eq!(plan.target.weights, None);
}

#[test]
fn tensor_table_has_zlab_names_in_order_with_out_in_shapes() {
    let spec = example_spec();
    let layout = spec.layout();
    let (h, q, kv, hd, i) = (64, 64, 32, 16, 128);
    let mut expected: Vec<(String, Vec<usize>)> = vec![
        ("fc.weight".into(), vec![h, 3 * h]),
        ("hidden_norm.weight".into(), vec![h]),
    ];
    for l in 0..2 {
        for (name, shape) in [
            ("input_layernorm.weight", vec![h]),
            ("self_attn.q_proj.weight", vec![q, h]),
            ("self_attn.k_proj.weight", vec![kv, h]),
            ("self_attn.v_proj.weight", vec![kv, h]),
            ("self_attn.q_norm.weight", vec![hd]),
            ("self_attn.k_norm.weight", vec![hd]),
            ("self_attn.o_proj.weight", vec![h, q]),
            ("post_attention_layernorm.weight", vec![h]),
            ("mlp.gate_proj.weight", vec![i, h]),
            ("mlp.up_proj.weight", vec![i, h]),
            ("mlp.down_proj.weight", vec![h, i]),
        ] {
            expected.push((format!("layers.{l}.{name}"), shape));
        }
    }
    expected.push(("norm.weight".into(), vec![h]));
    let got: Vec<(String, Vec<usize>)> = layout
        .iter()
        .map(|v| (v.name.clone(), v.shape.clone()))
        .collect();
    assert_eq!(got, expected);
    // Back to back from 0, and the closed form agrees.
    let mut offset = 0;
    for view in &layout {
        assert_eq!(view.offset, offset, "{}", view.name);
        offset += view.len();
    }
    let per_layer = 2 * h + q * h + 2 * kv * h + 2 * hd + h * q + 3 * i * h;
    assert_eq!(offset, h * 3 * h + h + 2 * per_layer + h);
    assert_eq!(spec.parameter_count(), offset);
    let plan = compile_source("example.pipe", ISSUE_EXAMPLE).unwrap();
    assert_eq!(plan.model.parameters, offset);
    assert_eq!(plan.model.layout, layout);
}

#[test]
fn mlp_plans_keep_a_constant_schedule_and_no_position_decay() {
    let source = include_str!("../../pipelines/quickstart.pipe");
    let plan = compile_source("quickstart.pipe", source).unwrap();
    assert!(plan.model.spec.as_mlp().is_some());
    assert_eq!(plan.drafter.optimizer.schedule, LrSchedule::CONSTANT);
    assert_eq!(plan.drafter.loss.position_decay, None);
}

#[test]
fn schedule_factor_follows_hugging_face() {
    let linear = LrSchedule {
        kind: ScheduleKind::Linear,
        warmup_steps: 10,
    };
    assert_eq!(linear.factor(0, 110), 0.0);
    assert_eq!(linear.factor(5, 110), 0.5);
    assert_eq!(linear.factor(10, 110), 1.0);
    assert_eq!(linear.factor(60, 110), 0.5);
    assert_eq!(linear.factor(110, 110), 0.0);
    assert_eq!(LrSchedule::CONSTANT.factor(7, 10), 1.0);
    let cosine = LrSchedule {
        kind: ScheduleKind::Cosine,
        warmup_steps: 0,
    };
    assert!((cosine.factor(50, 100) - 0.5).abs() < 1e-12);
}

/// The issue's example with `schedule` and `steps` replaced.
fn with_schedule(schedule: &str, steps: &str) -> String {
    ISSUE_EXAMPLE
        .replace("    schedule  = cosine(warmup = 0.04)\n", schedule)
        .replace("    steps     = 100\n", steps)
}

fn schedule_of(schedule: &str, steps: &str) -> LrSchedule {
    let source = with_schedule(schedule, steps);
    let plan = compile_source("schedule.pipe", &source).unwrap_or_else(|d| panic!("{d}"));
    plan.drafter.optimizer.schedule
}

#[test]
fn warmup_is_a_fraction_of_steps_or_a_step_count() {
    let lr = |kind, warmup_steps| LrSchedule { kind, warmup_steps };
    let steps = "    steps     = 10\n";
    assert_eq!(
        schedule_of("    schedule  = linear(warmup = 3)\n", steps),
        lr(ScheduleKind::Linear, 3)
    );
    // A fraction rounds down, as `int(warmup_ratio * total_steps)` does.
    assert_eq!(
        schedule_of("    schedule  = cosine(warmup = 0.999)\n", steps),
        lr(ScheduleKind::Cosine, 9)
    );
    assert_eq!(
        schedule_of("    schedule  = cosine(warmup = 10)\n", steps),
        lr(ScheduleKind::Cosine, 10)
    );
    assert_eq!(
        schedule_of("    schedule  = linear\n", steps),
        lr(ScheduleKind::Linear, 0)
    );
    assert_eq!(
        schedule_of("    schedule  = constant(warmup = 0.5)\n", steps),
        lr(ScheduleKind::Constant, 5)
    );
    // Constant needs no step count; the default is constant.
    assert_eq!(
        schedule_of("    schedule  = constant\n", ""),
        LrSchedule::CONSTANT
    );
    assert_eq!(schedule_of("", ""), LrSchedule::CONSTANT);
}

#[test]
fn every_model_takes_a_schedule() {
    let source = include_str!("../../pipelines/quickstart.pipe").replace(
        "    steps     = 300\n",
        "    steps     = 300\n    schedule  = cosine(warmup = 0.1)\n",
    );
    let plan = compile_source("quickstart.pipe", &source).unwrap_or_else(|d| panic!("{d}"));
    assert_eq!(
        plan.drafter.optimizer.schedule,
        LrSchedule {
            kind: ScheduleKind::Cosine,
            warmup_steps: 30
        }
    );
}

#[test]
fn a_recorded_target_with_weights_carries_them_into_the_plan() {
    let source = ISSUE_EXAMPLE.replace(
        "    source       = synthetic(seed = 1, lengths = 8..32)\n",
        "    weights      = safetensors(path = \"models/target\")\n    source       = safetensors(path = \"data/*.safetensors\")\n",
    );
    let plan = compile_source("weights.pipe", &source).unwrap_or_else(|d| panic!("{d}"));
    assert_eq!(
        plan.target.weights,
        Some(WeightsSpec::Safetensors {
            path: "models/target".into()
        })
    );
    // The frozen tables are in the memory plan: embedding and lm_head, f32.
    assert_eq!(plan.memory[0].frozen_weights, 2 * 4 * 512 * 64);
}

/// The error messages of `source`, one per line.
fn errors(source: &str) -> String {
    match compile_source("bad.pipe", source) {
        Ok(_) => panic!("compiled:\n{source}"),
        Err(d) => d
            .iter()
            .map(|d| d.message.clone())
            .collect::<Vec<_>>()
            .join("\n"),
    }
}

#[test]
fn every_dflash_dimension_is_range_checked() {
    let model = "dflash(layers = 2, heads = 4, kv_heads = 2, head_dim = 16, intermediate = 128, block = 4, anchors = 64, mask_token = 511, rope_theta = 10000)";
    for (from, to, expected) in [
        ("layers = 2", "layers = 0", "`layers` must be at least 1"),
        ("heads = 4,", "heads = 0,", "`heads` must be at least 1"),
        (
            "kv_heads = 2",
            "kv_heads = 0",
            "`kv_heads` must be at least 1",
        ),
        (
            "head_dim = 16",
            "head_dim = 0",
            "`head_dim` must be at least 2",
        ),
        (
            "head_dim = 16",
            "head_dim = 256",
            "`head_dim` must be at most 128",
        ),
        (
            "intermediate = 128",
            "intermediate = 0",
            "`intermediate` must be at least 1",
        ),
        ("block = 4", "block = 4096", "`block` must be at most 1024"),
        (
            "anchors = 64",
            "anchors = 2000000",
            "`anchors` must be at most 1048576",
        ),
        (
            "mask_token = 511",
            "mask_token = -1",
            "`mask_token` must be at least 0",
        ),
        (
            "rope_theta = 10000",
            "rope_theta = 0",
            "`rope_theta` must be positive",
        ),
        (
            "rope_theta = 10000",
            "rope_theta = 1e39",
            "`rope_theta` must be positive",
        ),
        ("layers = 2", "layers = 300", "`layers` must be at most 256"),
    ] {
        let source = ISSUE_EXAMPLE.replace(model, &model.replace(from, to));
        assert_ne!(source, ISSUE_EXAMPLE, "{from}");
        let text = errors(&source);
        assert!(text.contains(expected), "{to}: {text}");
    }
    let source = ISSUE_EXAMPLE.replace("position_decay = 7.0", "position_decay = 0");
    assert!(errors(&source).contains("`position_decay` must be positive"));
}

#[test]
fn qwen3_8b_step_flops_and_memory_follow_the_formulas() {
    let plan = compile_source(
        "dflash-5x3.pipe",
        include_str!("../../pipelines/dflash-5x3.pipe"),
    )
    .unwrap();
    let ModelSpec::Dflash(spec) = &plan.model.spec else {
        panic!("dflash-5x3 is a dflash drafter");
    };
    assert_eq!(spec.tap_layers, [2, 10, 18, 26, 34]);
    assert_eq!(plan.model.parameters, 1_048_626_432);
    // The longest bucket: one sequence of 8192, 512 blocks of 16 = 8192 block rows.
    let (t, q, s, b) = (8192u64, 8192u64, 8192u64, 16u64);
    let (h, lt, ly, nh, kv, hd, i, v) = (4096u64, 5, 5, 32, 8, 128, 12288, 151936);
    let p = plan.model.parameters as u64;
    let forward = 2 * t * lt * h * h
        + ly * (2 * t * h * 2 * kv * hd + 2 * q * h * (2 * nh + 2 * kv) * hd + 2 * q * 3 * i * h);
    let unneeded = 2 * t * lt * h * h + 2 * q * h * (nh + 2 * kv) * hd;
    // Each block sees (S − 2)/2 context keys on average and its own 16; 4·hd FLOPs per pair and head forward,
    // 2.5× that backward.
    let pairs = q * ((s - 2) / 2 + b);
    let attention = ly * 4 * hd * nh * pairs * 7 / 2;
    let expected = 3 * forward - unneeded + attention + 2 * 2 * q * h * v + 4 * q * v + 12 * p;
    let bucket = plan.buckets.last().unwrap();
    assert_eq!((bucket.padded_len, bucket.sequences), (8192, 1));
    assert_eq!(bucket.step_flops, expected);
    // About 80 TFLOP per sequence at this scale, as the architecture notes estimate (~75).
    assert!((70e12..90e12).contains(&(bucket.step_flops as f64)));

    // Memory per drafter GPU: the frozen embedding and lm_head in f32, and the model's workspace layout.
    let memory = &plan.memory[0];
    assert_eq!(memory.frozen_weights, 2 * 4 * v * h);
    let layout = plan.workspace_layout(Device::Gpu(5)).unwrap();
    assert_eq!(memory.workspaces, layout.bytes().unwrap());
    assert_eq!(
        memory.total(),
        16 * p + memory.frozen_weights + memory.workspaces
    );
    assert!(memory.total() < 141 << 30);
}

#[test]
fn dflash_plans_round_trip_through_json() {
    for source in [
        include_str!("../../pipelines/dflash-5x3.pipe"),
        include_str!("../../pipelines/dflash-quickstart.pipe"),
    ] {
        let plan = compile_source("dflash.pipe", source).unwrap();
        let json = serde_json::to_string(&plan).unwrap();
        let back: Plan = serde_json::from_str(&json).unwrap();
        assert_eq!(back, plan);
    }
    // A plan written before these fields existed still reads: no weights, no position decay, constant schedule.
    let plan = compile_source(
        "quickstart.pipe",
        include_str!("../../pipelines/quickstart.pipe"),
    )
    .unwrap();
    let mut json: serde_json::Value = serde_json::to_value(&plan).unwrap();
    json["drafter"]["optimizer"]
        .as_object_mut()
        .unwrap()
        .remove("schedule");
    json["memory"][0]
        .as_object_mut()
        .unwrap()
        .remove("frozen_weights");
    let back: Plan = serde_json::from_value(json).unwrap();
    assert_eq!(back, plan);
}

#[test]
fn the_target_depth_is_taken_as_written_and_a_tap_beyond_it_is_a_spanned_error() {
    let with_depth = |layers: &str| {
        ISSUE_EXAMPLE.replace(
            "    hidden       = 64\n",
            &format!("    hidden       = 64\n    layers       = {layers}\n"),
        )
    };
    let plan = compile_source("depth.pipe", &with_depth("4")).unwrap();
    assert_eq!(plan.target.layers, Some(4));
    assert_eq!(
        compile_source("no-depth.pipe", ISSUE_EXAMPLE)
            .unwrap()
            .target
            .layers,
        None
    );

    // Tap 3 is entry 3 of the hidden states: a 3-layer target's last layer output, which a 2-layer one lacks.
    assert_eq!(
        compile_source("deepest.pipe", &with_depth("3"))
            .unwrap()
            .target
            .layers,
        Some(3)
    );
    let source = with_depth("2");
    let diagnostics = compile_source("shallow.pipe", &source).unwrap_err();
    let diagnostic = diagnostics
        .iter()
        .find(|d| d.message.contains("tap 3"))
        .unwrap_or_else(|| panic!("{diagnostics:?}"));
    assert_eq!(diagnostic.message, "tap 3 is beyond the target's 2 layers");
    assert_eq!(&source[diagnostic.span.start..diagnostic.span.end], "3");
    assert!(
        source[..diagnostic.span.start].ends_with("[1, 2, "),
        "the span is the tap"
    );
    let (depth_span, _) = &diagnostic.related[0];
    assert_eq!(&source[depth_span.start..depth_span.end], "2");
    assert!(
        source[..depth_span.start].ends_with("layers       = "),
        "the related span is the `layers` value"
    );
    assert!(errors(&with_depth("0")).contains("`layers` must be at least 1"));
}

/// The issue's example on one GPU with `precision` and the model's heads, head_dim and block replaced.
fn on_gpu(precision: &str, heads: &str, block: &str) -> String {
    ISSUE_EXAMPLE
        .replace(
            "drafter d on cpu {",
            &format!("drafter d on gpu 0 {{\n    precision = {precision}"),
        )
        .replace("heads = 4, kv_heads = 2, head_dim = 16", heads)
        .replace("block = 4", block)
}

#[test]
fn a_cuda_drafter_at_bf16_is_warned_where_attention_falls_back_to_f32() {
    let source = on_gpu(
        "bf16",
        "heads = 4, kv_heads = 2, head_dim = 16",
        "block = 4",
    );
    let (plan, warnings) = draftpipe_compiler::compile_source_with_warnings("gpu.pipe", &source)
        .unwrap_or_else(|d| panic!("{d}"));
    assert_eq!(plan.drafter.precision, Precision::Bf16);
    let text = warnings.to_string();
    assert_eq!(warnings.len(), 1, "{text}");
    let warning = warnings.iter().next().unwrap();
    assert_eq!(
        &source[warning.span.start..warning.span.end],
        "bf16",
        "the warning points at the precision: {text}"
    );
    assert!(
        text.starts_with("warning: drafter `d` runs attention on the f32 CUDA-core kernels")
            && text.contains("head_dim 16 (the flash kernels are built for 64 and 128)")
            && text.ends_with("warning: `gpu.pipe` has 1 warning"),
        "{text}"
    );
    // The grouping and the block size are named when they are what the kernels refuse.
    let grouped = on_gpu(
        "bf16",
        "heads = 16, kv_heads = 1, head_dim = 64",
        "block = 16",
    );
    let (_, warnings) = draftpipe_compiler::compile_source_with_warnings("gpu.pipe", &grouped)
        .unwrap_or_else(|d| panic!("{d}"));
    assert!(
        warnings
            .to_string()
            .contains("16 query heads over 1 kv heads"),
        "{warnings}"
    );
    let block = on_gpu(
        "bf16",
        "heads = 4, kv_heads = 2, head_dim = 64",
        "block = 4",
    );
    let (_, warnings) = draftpipe_compiler::compile_source_with_warnings("gpu.pipe", &block)
        .unwrap_or_else(|d| panic!("{d}"));
    assert!(
        warnings.to_string().contains("blocks of 4 slots"),
        "{warnings}"
    );
    // No warning where the flash kernels run, where f32 attention was asked for, or on the CPU.
    for quiet in [
        on_gpu(
            "bf16",
            "heads = 4, kv_heads = 2, head_dim = 64",
            "block = 16",
        ),
        on_gpu("f32", "heads = 4, kv_heads = 2, head_dim = 16", "block = 4"),
        ISSUE_EXAMPLE.replace(
            "drafter d on cpu {",
            "drafter d on cpu {\n    precision = bf16",
        ),
    ] {
        let (_, warnings) = draftpipe_compiler::compile_source_with_warnings("quiet.pipe", &quiet)
            .unwrap_or_else(|d| panic!("{d}"));
        assert!(warnings.is_empty(), "{warnings}\n{quiet}");
    }
}
