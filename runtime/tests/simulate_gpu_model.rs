//! `simulate`'s step times from the compiler's GPU time model: each bucket's modelled forward + backward +
//! optimizer as its step, the modelled all-reduce after a round's last replica, and a clear error where the
//! plan has no GPU model.

use std::path::Path;

use draftpipe_compiler::compile_file;
use draftpipe_compiler::cost::gpu::gpu_step_model;
use draftpipe_runtime::simulate::{Model, SimulateError, StepTime};

fn pipeline(name: &str) -> draftpipe_compiler::Plan {
    compile_file(
        &Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../pipelines")
            .join(name),
    )
    .unwrap()
}

#[test]
fn gpu_drafters_step_at_the_modelled_time_and_wait_the_modelled_all_reduce() {
    let plan = pipeline("dflash-5x3.pipe");
    let gpu = gpu_step_model(&plan).expect("a dflash drafter on GPUs");
    let model = Model::from_plan(&plan, Some(20.0), StepTime::GpuModel).unwrap();
    assert_eq!(model.buckets.len(), gpu.buckets.len());
    for (bucket, modelled) in model.buckets.iter().zip(&gpu.buckets) {
        assert_eq!(bucket.padded_len, modelled.padded_len);
        assert_eq!(bucket.step_mean_s, modelled.compute_s());
        assert!(bucket.step_mean_s > 0.0);
    }
    // Three replicas of the flat f32 gradient: 2·2/3 of 4·P bytes at 370 GB/s, plus its launch.
    let expected = 4.0 / 3.0 * 4.0 * plan.model.parameters as f64 / 370e9 + 1e-6;
    assert!(
        (model.all_reduce_s - expected).abs() < 1e-12,
        "{}",
        model.all_reduce_s
    );
    assert!(
        model.drafter_origin.contains("GPU time model"),
        "{}",
        model.drafter_origin
    );
}

#[test]
fn a_plan_without_a_gpu_model_is_an_error_not_a_zero_step() {
    let plan = pipeline("quickstart.pipe");
    assert!(matches!(
        Model::from_plan(&plan, Some(20.0), StepTime::GpuModel),
        Err(SimulateError::NoGpuModel { .. })
    ));
}
