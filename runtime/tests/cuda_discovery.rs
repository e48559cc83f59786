//! Runs everywhere: without a driver the CUDA backend answers with typed errors instead of panicking, and the
//! embedded-PTX accessors agree with each other.

use draftpipe_compiler::plan::{
    AdamWSpec, BucketPlan, HsDtype, LaunchMode, LossSpec, LrSchedule, MlpSpec, ModelPlan, Precision,
};
use draftpipe_runtime::backend::cuda::{CudaError, EMBEDDED_PTX, discover_devices, embedded_ptx};
use draftpipe_runtime::drafter::DrafterError;
use draftpipe_runtime::drafter::cuda::CudaDrafter;

#[test]
fn no_driver_is_an_error_not_a_panic() {
    let spec = MlpSpec {
        din: 8,
        hidden: 4,
        blocks: 1,
        intermediate: 6,
        heads: 2,
        vocab: 10,
    };
    let model = ModelPlan::new(spec);
    let loss = LossSpec {
        head_decay: 0.8,
        position_decay: None,
        step_decay: None,
        chunk_tokens: 4,
    };
    let adamw = AdamWSpec {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.0,
        clip_grad_norm: None,
        schedule: LrSchedule::CONSTANT,
    };
    let buckets = [BucketPlan {
        padded_len: 4,
        sequences: 2,
        tokens: 8,
        step_flops: 0,
        step_bytes: 0,
    }];
    match discover_devices() {
        Err(CudaError::NoDriver) => {
            let made = CudaDrafter::on_device(
                0,
                &model,
                (loss, adamw, Precision::F32),
                (&buckets, HsDtype::F32),
                LaunchMode::Graph,
                None,
            );
            assert!(
                matches!(
                    &made,
                    Err(DrafterError::Backend(e))
                        if matches!(e.device_error::<CudaError>(), Some(CudaError::NoDriver))
                ),
                "expected NoDriver, got {:?}",
                made.err()
            );
        }
        Err(other) => panic!("discovery failed with a driver present: {other}"),
        Ok(devices) => {
            let made = CudaDrafter::on_device(
                devices.len(),
                &model,
                (loss, adamw, Precision::F32),
                (&buckets, HsDtype::F32),
                LaunchMode::Eager,
                None,
            );
            assert!(
                matches!(
                    &made,
                    Err(DrafterError::Backend(e))
                        if matches!(e.device_error::<CudaError>(), Some(CudaError::NoSuchDevice { .. }))
                ),
                "ordinal past the last device must fail"
            );
        }
    }
}

#[test]
fn embedded_ptx_accessor_reports_the_build_reason() {
    match (EMBEDDED_PTX, embedded_ptx()) {
        (Ok(ptx), Ok(same)) => assert!(ptx == same && ptx.contains(".target sm_90")),
        (Err(reason), Err(e)) => assert_eq!(
            e.to_string(),
            format!("built without GPU kernels: {reason}")
        ),
        (a, b) => panic!("accessors disagree: {:?} vs {:?}", a.is_ok(), b.is_ok()),
    }
}

#[test]
fn drafters_can_move_to_their_own_threads() {
    fn assert_send<T: Send>() {}
    assert_send::<CudaDrafter>();
    assert_send::<draftpipe_runtime::backend::cuda::GradientAllReduce>();
}

/// With a device: opens cuBLAS (a handle) and NCCL, then prints the CUDA library files this process mapped, so
/// `scripts/gpu-check.sh` shows which files were loaded. Without a driver it skips with one line, unless
/// `DRAFTPIPE_REQUIRE_GPU=1`, where a missing driver, device, cuBLAS or NCCL fails.
#[test]
fn gpu_libraries_load_and_are_named() {
    use draftpipe_runtime::backend::cuda::{Gemm, GradientAllReduce, open_device};

    let require = std::env::var("DRAFTPIPE_REQUIRE_GPU").is_ok_and(|v| v == "1");
    let devices = match discover_devices() {
        Ok(devices) if !devices.is_empty() => devices,
        other => {
            let reason = other.map_or_else(|e| e.to_string(), |_| "no CUDA device".into());
            assert!(!require, "DRAFTPIPE_REQUIRE_GPU=1 but {reason}");
            eprintln!("gpu_libraries_load_and_are_named skipped: {reason}");
            return;
        }
    };
    let ctx = open_device(0).expect("open device 0");
    let gemm = Gemm::new(ctx.default_stream()).expect("cuBLAS loads and makes a handle");
    drop(gemm);
    match GradientAllReduce::library() {
        Ok(file) => eprintln!("NCCL opened as {file}"),
        Err(e) => assert!(!require, "DRAFTPIPE_REQUIRE_GPU=1 but {e}"),
    }
    if GradientAllReduce::library().is_ok() {
        let ordinals: Vec<usize> = (0..devices.len()).collect();
        let comms = GradientAllReduce::for_devices(&ordinals).expect("NCCL communicators");
        assert_eq!(comms.len(), devices.len());
        comms[0].abort_group().expect("abort every communicator");
        assert!(comms.iter().all(GradientAllReduce::is_aborted));
    }
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let mut files: Vec<&str> = maps
        .lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .filter(|path| {
            ["libcuda.so", "libcublas", "libnccl"]
                .iter()
                .any(|l| path.contains(l))
        })
        .collect();
    files.dedup();
    for file in &files {
        eprintln!("loaded: {file}");
    }
    assert!(files.iter().any(|f| f.contains("libcublas")), "{files:?}");
}
