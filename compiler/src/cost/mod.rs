//! The cost model: per-bucket shapes, FLOPs and bytes of one training step, and memory per device. The
//! figures of one family's step (FLOPs, bytes, frozen tensors, workspace) are the family's
//! ([`Family`](crate::family::Family): [`crate::family::mlp::cost`], [`crate::family::dflash::cost`]); this
//! module puts them together per bucket and per device, and adds the host's.
//!
//! **Memory per drafter device** (one entry per device; a CPU running `xN` workers holds `N` replicas), `P` the
//! family's parameter count:
//! - parameters, gradients: `4·P` bytes each per worker; optimizer state (AdamW `m` and `v`): `8·P`;
//! - frozen target tensors ([`Family::frozen_bytes`](crate::family::Family::frozen_bytes)) per worker: the
//!   embedding and `lm_head` a `dflash` drafter reads (f32 today), 0 for `mlp`;
//! - workspaces: [`WorkspaceLayout::bytes`] of the device's backend, per worker: the one list of buffers the
//!   CPU and CUDA allocators allocate (activations, the fused-loss chunk, backward scratch, reduction partials,
//!   input slots, and per backend cuBLAS's workspace or the CPU's rounding buffers). One workspace, sized for
//!   the largest bucket, is shared by every bucket: a worker runs one step at a time;
//!
//! **Host memory** ([`host_memory`]) outside the drafters' replicas: the hidden-state pool, one allocation on the
//! host whatever the drafters' devices, of `capacity + 2·drafters + producers` buffers (the queue, each
//! drafter's batch in its step and the one staged next, each producer's batch being filled), each of
//! `Tmax·(e·din + s + 4 + 1) + 4·Smax` bytes, `Tmax` and `Smax` the most tokens and sequences of any bucket
//! (hidden states of `e` bytes each, 4 in f32, 2 in bf16/f16 and 1 in fp8_e4m3 as `hs_dtype` says, `s` the
//! bytes of a token's scale, 4 in fp8_e4m3 and 0 otherwise, token ids, loss mask, sequence lengths, as in the
//! runtime's `HsBatch`, which allocates every pooled buffer for any bucket).
//!
//! Target devices are not in the memory plan: the frozen target's memory is outside draftpipe's control.

use crate::family::ModelSpec;
use crate::plan::derived::{BucketPlan, DeviceMemory, HostMemory};
use crate::plan::stages::{
    Device, HsDtype, LossSpec, Placement, Precision, QueueSpec, TargetStage,
};
use crate::workspace::{BackendKind, WorkspaceLayout};

pub(crate) mod arith;
pub mod gpu;

use arith::{F32, fit, wide};

/// One [`BucketPlan`] per queue bucket: `batch_tokens / padded_len` sequences of the bucket's length.
pub fn bucket_plans(
    target: &TargetStage,
    queue: &QueueSpec,
    spec: &ModelSpec,
    loss: &LossSpec,
) -> Option<Vec<BucketPlan>> {
    queue
        .buckets
        .iter()
        .map(|&padded_len| {
            let sequences = target.batch_tokens / padded_len;
            let tokens = sequences * padded_len;
            let shape = BucketPlan {
                padded_len,
                sequences,
                tokens,
                step_flops: 0,
                step_bytes: 0,
            };
            let (step_flops, step_bytes) = spec.family().step_cost(&shape, loss)?;
            Some(BucketPlan {
                padded_len,
                sequences,
                tokens,
                step_flops,
                step_bytes,
            })
        })
        .collect()
}

/// Bytes of one worker's workspace on `backend`: the model's [`WorkspaceLayout`], the list the runtime
/// allocates.
fn workspace_bytes(
    spec: &ModelSpec,
    buckets: &[BucketPlan],
    loss: &LossSpec,
    (backend, precision): (BackendKind, Precision),
    hs: HsDtype,
) -> Option<u64> {
    WorkspaceLayout::of_model(spec, buckets, loss, backend, precision)?
        .with_hs_dtype(backend, hs)?
        .bytes()
}

/// Host memory a `stream` source may hold for messages being received: one buffer per producer slot, which
/// grows as a message's bytes arrive up to `max_message_bytes`. 0 for the other sources.
pub fn stream_receive_bytes(target: &TargetStage) -> u64 {
    match target.source {
        crate::plan::stages::SourceSpec::Stream {
            max_message_bytes, ..
        } => max_message_bytes.saturating_mul(target.placement.workers.len() as u64),
        _ => 0,
    }
}

/// Memory on each drafter device, in device order; `None` when a figure (or a device's total) overflows `u64`.
pub fn device_memory(
    drafters: &Placement,
    spec: &ModelSpec,
    buckets: &[BucketPlan],
    loss: &LossSpec,
    (precision, hs): (Precision, HsDtype),
) -> Option<Vec<DeviceMemory>> {
    let params = F32 * wide(spec.family().parameter_count());
    let frozen = spec.family().frozen_bytes()?;
    let mut devices: Vec<Device> = drafters.workers.clone();
    devices.sort_unstable();
    devices.dedup();
    devices
        .into_iter()
        .map(|device| {
            let replicas = drafters.workers.iter().filter(|d| **d == device).count() as u128;
            let workspace = u128::from(workspace_bytes(
                spec,
                buckets,
                loss,
                (BackendKind::of(device), precision),
                hs,
            )?);
            let memory = DeviceMemory {
                device,
                parameters: fit(replicas * params)?,
                gradients: fit(replicas * params)?,
                optimizer_state: fit(replicas * 2 * params)?,
                frozen_weights: fit(replicas * u128::from(frozen))?,
                workspaces: fit(replicas * workspace)?,
            };
            // `DeviceMemory::total` adds in u64: make sure it cannot overflow.
            let parts = [
                memory.parameters,
                memory.gradients,
                memory.optimizer_state,
                memory.frozen_weights,
                memory.workspaces,
            ];
            fit(parts.iter().map(|&x| u128::from(x)).sum()).map(|_| memory)
        })
        .collect()
}

/// The host memory outside the drafters' replicas (formula in the module docs): the hidden-state pool of
/// `capacity` queued items for `producers` producers and `drafters` drafters, each buffer hidden states of
/// `din` values in `hs` with room for any of `buckets`, and `stream_receive` bytes of a stream's receive
/// buffers ([`stream_receive_bytes`]). `None` when a figure overflows `u64`.
pub fn host_memory(
    (capacity, producers, drafters): (usize, usize, usize),
    buckets: &[BucketPlan],
    (din, hs): (usize, HsDtype),
    stream_receive: u64,
) -> Option<HostMemory> {
    let most_tokens = buckets.iter().map(|b| wide(b.tokens)).max().unwrap_or(0);
    let most_sequences = buckets.iter().map(|b| wide(b.sequences)).max().unwrap_or(0);
    let row = wide(hs.bytes()) * wide(din) + wide(hs.scale_bytes_per_row());
    let buffer = most_tokens * (row + 4 + 1) + 4 * most_sequences;
    let buffers = wide(capacity) + 2 * wide(drafters) + wide(producers);
    let memory = HostMemory {
        hs_pool_buffers: fit(buffers)?,
        hs_buffer_bytes: fit(buffer)?,
        stream_receive,
    };
    // `HostMemory::hs_pool` multiplies in u64 and `total` adds: make sure neither can overflow.
    fit(buffers * buffer + u128::from(stream_receive)).map(|_| memory)
}

/// `1.50 GiB`, `12.0 MiB`, `512 B`: binary units, three significant figures.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    match unit {
        0 => format!("{bytes} B"),
        _ if value >= 100.0 => format!("{value:.0} {}", UNITS[unit]),
        _ if value >= 10.0 => format!("{value:.1} {}", UNITS[unit]),
        _ => format!("{value:.2} {}", UNITS[unit]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::family::mlp::{MlpSpec, cost::activation_floats_per_token};

    #[test]
    fn bytes_print_in_binary_units_with_three_figures() {
        assert_eq!(format_bytes(512), "512 B");
        assert_eq!(format_bytes(1536), "1.50 KiB");
        assert_eq!(format_bytes(19 << 20), "19.0 MiB");
        assert_eq!(format_bytes(141 << 30), "141 GiB");
        assert_eq!(format_bytes(u64::MAX), "16777216 TiB");
    }

    #[test]
    fn overflowing_figures_are_none_not_wrapped() {
        let spec = MlpSpec {
            din: 1 << 32,
            hidden: 1 << 32,
            blocks: 1,
            intermediate: 1,
            heads: 1,
            vocab: 2,
        };
        let huge = BucketPlan {
            padded_len: 1 << 20,
            sequences: 1 << 10,
            tokens: 1 << 30,
            step_flops: 0,
            step_bytes: 0,
        };
        assert_eq!(
            host_memory((1 << 20, 1, 1), &[huge], (1 << 40, HsDtype::F32), 0),
            None
        );
        assert!(activation_floats_per_token(&spec).is_some());
        let bucket = BucketPlan {
            padded_len: 1 << 32,
            sequences: 1,
            tokens: 1 << 32,
            step_flops: 0,
            step_bytes: 0,
        };
        let loss = LossSpec {
            head_decay: 1.0,
            position_decay: None,
            step_decay: None,
            chunk_tokens: 1,
        };
        let layout =
            WorkspaceLayout::mlp(&spec, &[bucket], &loss, BackendKind::Cpu, Precision::F32);
        assert_eq!(layout.and_then(|l| l.bytes()), None);
    }
}
