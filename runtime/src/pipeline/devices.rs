//! Where the drafter workers run: the CPU, or one GPU each (checked, with NCCL communicators, before any thread
//! starts), and the drafter each worker thread opens there.
//!
//! ```text
//!  plan.drafter.placement ──ordinals──▶ None (CPU) │ Some(gpus) ──prepare──▶ devices open? kernels built? NCCL
//!  worker thread ──open_cpu / open_gpu──▶ Drafter<CpuBackend> │ Drafter<CudaBackend> ──▶ worker::run
//! ```

use std::sync::Arc;

use draftpipe_compiler::plan::{Device, Plan, SyncMode};

use crate::allreduce::AllReduce;
use crate::backend::Backend;
use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::{GradientAllReduce, embedded_ptx, open_device};
use crate::drafter::cuda::CudaDrafter;
use crate::drafter::{Drafter, DrafterError};
use crate::model::eagle3::vocab::VocabMap;
use crate::params::FlatState;
use crate::target_weights::TargetWeights;

use super::error::RunError;

/// The drafter workers' GPU ordinals, or `None` when the drafter stage runs on the CPU.
pub(super) fn ordinals(plan: &Plan) -> Result<Option<Vec<usize>>, RunError> {
    let workers = &plan.drafter.placement.workers;
    let gpus: Vec<usize> = workers
        .iter()
        .filter_map(|device| match device {
            Device::Gpu(ordinal) => Some(*ordinal as usize),
            Device::Cpu => None,
        })
        .collect();
    if gpus.is_empty() {
        Ok(None)
    } else if gpus.len() == workers.len() {
        Ok(Some(gpus))
    } else {
        Err(RunError::Unsupported(format!(
            "drafter stage `{}` mixes cpu and gpu workers; place it on cpus or on gpus only",
            plan.drafter.name
        )))
    }
}

/// Checks, before any thread starts, that every device opens and the kernels are built in, then creates one
/// NCCL communicator per worker when they average gradients (none otherwise).
pub(super) fn prepare(plan: &Plan, ordinals: &[usize]) -> Result<Vec<GradientAllReduce>, RunError> {
    let unavailable = |source| RunError::Gpu {
        stage: plan.drafter.name.clone(),
        devices: ordinals
            .iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join(", "),
        source,
    };
    for &ordinal in ordinals {
        open_device(ordinal).map_err(unavailable)?;
    }
    embedded_ptx().map_err(unavailable)?;
    if plan.drafter.sync == SyncMode::AllReduce && ordinals.len() > 1 {
        GradientAllReduce::for_devices(ordinals).map_err(unavailable)
    } else {
        Ok(Vec::new())
    }
}

/// A CPU drafter for `plan` on the starting `state`, averaging its gradients over `group` when synced.
pub(crate) fn open_cpu(
    plan: &Plan,
    group: Option<Arc<AllReduce>>,
    (state, frozen): (&FlatState, Frozen<'_>),
) -> Result<Drafter<CpuBackend>, DrafterError> {
    let stage = &plan.drafter;
    let layout = plan
        .workspace_layout(Device::Cpu)
        .ok_or(DrafterError::WorkspaceTooLarge)?;
    let mut backend = CpuBackend::new(&layout);
    if let Some(group) = group {
        backend = backend.with_group(group);
    }
    let mut drafter = Drafter::with_hs_dtype(
        backend,
        &plan.model,
        (stage.loss, stage.optimizer, stage.precision),
        &plan.buckets,
        plan.target.hs_dtype_or_widest(),
    )?;
    upload(&mut drafter, state, frozen)?;
    Ok(drafter)
}

/// What a drafter reads besides its replica, loaded once for every worker: the target's frozen embedding and
/// `lm_head` (`dflash`, `eagle3`) and the draft vocabulary (`eagle3`).
pub(crate) type Frozen<'a> = (Option<&'a TargetWeights>, Option<&'a VocabMap>);

/// Loads the starting replica, the frozen target tensors and the draft vocabulary (when the family reads them)
/// into `drafter`.
fn upload<B: Backend>(
    drafter: &mut Drafter<B>,
    state: &FlatState,
    (weights, vocab): Frozen<'_>,
) -> Result<(), DrafterError> {
    drafter.upload_state(state)?;
    if let Some(weights) = weights {
        drafter.upload_frozen(weights.embedding(), weights.lm_head())?;
    }
    if let Some(map) = vocab {
        drafter.upload_vocab_map(&map.d2t, &map.t2d)?;
    }
    Ok(())
}

/// A CUDA drafter for `plan` on GPU `ordinal` with its communicator, on the starting `state`.
pub(super) fn open_gpu(
    plan: &Plan,
    ordinal: usize,
    all_reduce: Option<GradientAllReduce>,
    (state, frozen): (&FlatState, Frozen<'_>),
) -> Result<CudaDrafter, DrafterError> {
    let stage = &plan.drafter;
    let mut drafter = CudaDrafter::on_device(
        ordinal,
        &plan.model,
        (stage.loss, stage.optimizer, stage.precision),
        (&plan.buckets, plan.target.hs_dtype_or_widest()),
        stage.launch,
        all_reduce,
    )?;
    upload(&mut drafter, state, frozen)?;
    Ok(drafter)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use draftpipe_compiler::compile_file;

    use super::*;

    fn plan(file: &str) -> Plan {
        compile_file(
            &Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../pipelines")
                .join(file),
        )
        .unwrap()
    }

    #[test]
    fn placements_choose_the_backend() {
        assert_eq!(ordinals(&plan("quickstart.pipe")).unwrap(), None);
        let mut dflash = plan("dflash-5x3.pipe");
        assert_eq!(ordinals(&dflash).unwrap(), Some(vec![5, 6, 7]));
        dflash.drafter.placement.workers[1] = Device::Cpu;
        let error = ordinals(&dflash).unwrap_err().to_string();
        assert!(error.contains("mixes cpu and gpu"), "{error}");
    }
}
