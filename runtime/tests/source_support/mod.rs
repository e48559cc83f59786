//! Plans and files shared by the source and checkpoint tests.
#![allow(dead_code)] // each test target uses a different subset

use std::path::Path;

use draftpipe_compiler::plan::*;
use safetensors::Dtype;
use safetensors::tensor::TensorView;

/// A plan whose target stage has the given shape; only the fields sources read are meaningful.
pub fn plan(
    source: SourceSpec,
    vocab: usize,
    hidden: usize,
    taps: usize,
    buckets: &[usize],
    batch_tokens: usize,
    producers: usize,
) -> Plan {
    let spec = MlpSpec {
        din: hidden * taps,
        hidden: 16,
        blocks: 1,
        intermediate: 32,
        heads: 2,
        vocab,
    };
    let mut plan = Plan {
        name: "test".into(),
        devices: vec![],
        target: TargetStage {
            name: "target".into(),
            placement: Placement {
                workers: vec![Device::Cpu; producers],
            },
            hidden,
            layers: None,
            tap_layers: (0..taps as u32).collect(),
            vocab,
            batch_tokens,
            source,
            max_rate: None,
            weights: None,
            hs_dtype: None,
            masks: Default::default(),
        },
        queue: QueueSpec {
            name: "hs".into(),
            from: "target".into(),
            to: "drafter".into(),
            capacity: 4,
            min_ready: 1,
            buckets: buckets.to_vec(),
            pull: PullPolicy::Fifo,
        },
        drafter: DrafterStage {
            name: "drafter".into(),
            placement: Placement {
                workers: vec![Device::Cpu],
            },
            loss: LossSpec {
                head_decay: 0.8,
                position_decay: None,
                step_decay: None,
                chunk_tokens: 64,
            },
            optimizer: AdamWSpec {
                lr: 1e-3,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.0,
                clip_grad_norm: None,
                schedule: draftpipe_compiler::plan::LrSchedule::CONSTANT,
            },
            sync: SyncMode::AllReduce,
            launch: LaunchMode::Eager,
            precision: Precision::F32,
            steps: None,
            vocab_map: None,
        },
        model: ModelPlan::new(spec),
        buckets: buckets
            .iter()
            .map(|&padded_len| BucketPlan {
                padded_len,
                sequences: batch_tokens / padded_len,
                tokens: batch_tokens / padded_len * padded_len,
                step_flops: 0,
                step_bytes: 0,
            })
            .collect(),
        memory: vec![],
        host_memory: HostMemory::default(),
        schedule: vec![],
        telemetry: TelemetrySpec {
            every_ms: 1000,
            trace: None,
            tensorboard: None,
        },
        acceptance: None,
    };
    plan.host_memory = draftpipe_compiler::cost::host_memory(
        (
            plan.queue.capacity,
            producers,
            plan.drafter.placement.workers.len(),
        ),
        &plan.buckets,
        (plan.target.hs_width(), plan.target.hs_dtype_or_widest()),
        draftpipe_compiler::cost::stream_receive_bytes(&plan.target),
    )
    .expect("a small plan's host memory");
    plan
}

/// A small drafter model plan.
pub fn small_model(din: usize, hidden: usize, vocab: usize) -> ModelPlan {
    let spec = MlpSpec {
        din,
        hidden,
        blocks: 2,
        intermediate: 2 * hidden,
        heads: 3,
        vocab,
    };
    ModelPlan::new(spec)
}

/// Little-endian bytes of a tensor in `dtype` from f64 values (floats rounded, integers truncated).
pub fn encode(dtype: Dtype, values: &[f64]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&v| match dtype {
            Dtype::F32 => (v as f32).to_le_bytes().to_vec(),
            Dtype::F64 => v.to_le_bytes().to_vec(),
            Dtype::F16 => half::f16::from_f64(v).to_le_bytes().to_vec(),
            Dtype::BF16 => half::bf16::from_f64(v).to_le_bytes().to_vec(),
            Dtype::I32 => (v as i32).to_le_bytes().to_vec(),
            Dtype::I64 => (v as i64).to_le_bytes().to_vec(),
            Dtype::U8 | Dtype::BOOL => vec![v as u8],
            Dtype::I16 => (v as i16).to_le_bytes().to_vec(),
            other => panic!("test encoder lacks {other:?}"),
        })
        .collect()
}

/// Writes a safetensors file with the reference writer: `(name, dtype, shape, values)`.
pub fn write_file(path: &Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<f64>)]) {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, dtype, _, v)| encode(*dtype, v))
        .collect();
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, dtype, shape, _), b)| {
            (
                name.to_string(),
                TensorView::new(*dtype, shape.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// A fresh empty directory under the system temp dir, unique per test name and process, removed on drop.
pub struct TempDir(std::path::PathBuf);

impl std::ops::Deref for TempDir {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Creates a [`TempDir`] named after the test.
pub fn temp_dir(name: &str) -> TempDir {
    let dir = std::env::temp_dir().join(format!("draftpipe-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    TempDir(dir)
}
