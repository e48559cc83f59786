//! The backends a test runs on, and `test_device!`, which makes one test per backend from one generic body
//! (candle's pattern): `NAME::cpu` always runs, `NAME::cuda` runs on a machine with a CUDA driver and says in
//! one line that it was skipped on one without. `DRAFTPIPE_REQUIRE_GPU=1` (set by `scripts/gpu-check.sh`)
//! turns that skip into a failure, so a GPU check cannot pass by skipping.
#![allow(dead_code)] // each test crate uses a different subset

use draftpipe_compiler::plan::{
    AdamWSpec, BackendKind, BucketPlan, HsDtype, LaunchMode, LossSpec, ModelPlan, Precision,
    WorkspaceLayout,
};
use draftpipe_runtime::backend::Backend;
use draftpipe_runtime::backend::cpu::CpuBackend;
use draftpipe_runtime::backend::cuda::{CudaBackend, CudaError, discover_devices};
use draftpipe_runtime::batch::HsBatch;
use draftpipe_runtime::drafter::Drafter;
use draftpipe_runtime::drafter::cuda::CudaDrafter;
use draftpipe_runtime::params::FlatState;

/// A backend under test.
pub trait TestDevice {
    /// The backend.
    type B: Backend;
    /// `cpu` or `cuda`.
    const NAME: &'static str;
    /// A drafter for `model` on this device, for f32 hidden states.
    fn drafter(
        &self,
        model: &ModelPlan,
        settings: (LossSpec, AdamWSpec, Precision),
        buckets: &[BucketPlan],
    ) -> Drafter<Self::B> {
        self.drafter_for(model, settings, buckets, HsDtype::F32)
    }
    /// A drafter for `model` on this device, for hidden states held in `hs` (the plan's `hs_dtype`).
    fn drafter_for(
        &self,
        model: &ModelPlan,
        settings: (LossSpec, AdamWSpec, Precision),
        buckets: &[BucketPlan],
        hs: HsDtype,
    ) -> Drafter<Self::B>;
    /// A bare backend with `layout`'s own buffers (kernel-level tests).
    fn backend(&self, layout: &WorkspaceLayout) -> Self::B;
}

/// The host.
pub struct Cpu;

impl TestDevice for Cpu {
    type B = CpuBackend;
    const NAME: &'static str = "cpu";

    fn drafter_for(
        &self,
        model: &ModelPlan,
        settings: (LossSpec, AdamWSpec, Precision),
        buckets: &[BucketPlan],
        hs: HsDtype,
    ) -> Drafter<CpuBackend> {
        let (loss, _, precision) = settings;
        let layout =
            WorkspaceLayout::of_model(&model.spec, buckets, &loss, BackendKind::Cpu, precision)
                .and_then(|layout| layout.with_hs_dtype(BackendKind::Cpu, hs))
                .expect("layout");
        Drafter::with_hs_dtype(CpuBackend::new(&layout), model, settings, buckets, hs)
            .expect("cpu drafter")
    }

    fn backend(&self, layout: &WorkspaceLayout) -> CpuBackend {
        CpuBackend::new(layout)
    }
}

/// CUDA device 0, graphs on.
pub struct Cuda;

impl TestDevice for Cuda {
    type B = CudaBackend;
    const NAME: &'static str = "cuda";

    fn drafter_for(
        &self,
        model: &ModelPlan,
        settings: (LossSpec, AdamWSpec, Precision),
        buckets: &[BucketPlan],
        hs: HsDtype,
    ) -> CudaDrafter {
        CudaDrafter::on_device(0, model, settings, (buckets, hs), LaunchMode::Graph, None)
            .expect("cuda drafter")
    }

    fn backend(&self, layout: &WorkspaceLayout) -> CudaBackend {
        CudaBackend::new(0, LaunchMode::Eager, layout).expect("cuda backend")
    }
}

/// Runs `batches` from `init` and returns every step's loss (one per batch, none lost) and the final state.
pub fn train<B: Backend>(
    drafter: &mut Drafter<B>,
    init: &FlatState,
    batches: &[HsBatch],
) -> (Vec<f32>, FlatState) {
    drafter.upload_state(init).expect("upload");
    let mut losses = Vec::new();
    for batch in batches {
        drafter.stage(batch).expect("stage");
        losses.extend(drafter.step().expect("step").map(|o| o.loss));
    }
    losses.extend(drafter.finish().expect("finish").map(|o| o.loss));
    assert_eq!(losses.len(), batches.len(), "one outcome per step");
    let mut state = init.clone();
    drafter.download_state(&mut state).expect("download");
    (losses, state)
}

/// `‖a − b‖₂ / ‖b‖₂` (0 when both are 0).
pub fn relative_l2(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (&x, &y) in a.iter().zip(b) {
        diff += (f64::from(x) - f64::from(y)).powi(2);
        norm += f64::from(y).powi(2);
    }
    if diff == 0.0 {
        0.0
    } else {
        (diff / norm).sqrt()
    }
}

/// Whether `DRAFTPIPE_REQUIRE_GPU=1` asks for every GPU test to run.
pub fn gpu_required() -> bool {
    std::env::var("DRAFTPIPE_REQUIRE_GPU").is_ok_and(|v| v == "1")
}

/// `Some(Cuda)` when a CUDA driver with a device is present. Without a driver it prints one line and returns
/// `None`, or panics under `DRAFTPIPE_REQUIRE_GPU=1`; any other discovery failure panics (a driver that is
/// there but broken is a failure, not a skip).
pub fn cuda_or_skip(test: &str) -> Option<Cuda> {
    let reason = match discover_devices() {
        Ok(devices) if !devices.is_empty() => return Some(Cuda),
        Ok(_) => "the CUDA driver reports no device".to_owned(),
        Err(CudaError::NoDriver) => "no CUDA driver".to_owned(),
        Err(other) => panic!("{test}: CUDA discovery failed with a driver present: {other}"),
    };
    assert!(
        !gpu_required(),
        "{test}: DRAFTPIPE_REQUIRE_GPU=1 but {reason}"
    );
    eprintln!("{test}: CUDA skipped ({reason}); ran on the CPU only");
    None
}

/// One test per backend from a generic body `fn NAME<D: TestDevice>(device: &D)`.
#[macro_export]
macro_rules! test_device {
    ($name:ident) => {
        mod $name {
            #[test]
            fn cpu() {
                super::$name(&$crate::backends::Cpu);
            }

            #[test]
            fn cuda() {
                if let Some(device) =
                    $crate::backends::cuda_or_skip(concat!(stringify!($name), "::cuda"))
                {
                    super::$name(&device);
                }
            }
        }
    };
}
