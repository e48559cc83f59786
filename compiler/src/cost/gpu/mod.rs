//! The GPU time model: how long one training step of each bucket takes on the plan's GPU, by phase and by kernel
//! kind, and the model FLOPs utilisation (MFU) over the plan's bucket mix. `compile` prints it, `--emit json`
//! carries it, and `simulate` takes its step times when no run is given.
//!
//! ```text
//!  Family::gpu_step (the kernels the CUDA backend launches for one bucket: GEMM shapes, attention pairs, bytes of
//!        │           the bandwidth-bound kernels, launches, each in its phase)
//!        ▼
//!  time(work) = GEMM:      max(2mnk / (peak(precision) · eff(shape)), bytes / (HBM · 0.8))
//!               attention: kernel FLOPs / FlashAttention-2's TFLOP/s at those keys (or the f32 CUDA-core rate)
//!               stream:    bytes / (HBM · 0.8)
//!               + launches · 1 µs (inside a CUDA graph)
//!        ▼
//!  per bucket: forward, backward, optimizer (+ NCCL all-reduce of the f32 gradients under sync = allreduce,
//!              not overlapped: the runtime enqueues it between its two graphs), MFU = model FLOPs / (step · peak)
//!  over the mix: Σ share·FLOPs / (Σ share·step · peak), shares = the items each bucket is fed ([`bucket_shares`])
//! ```
//!
//! **Model FLOPs** (the MFU's numerator): the FLOPs the step must do, i.e. `2mnk` of every GEMM the step launches
//! (the `lm_head` products over the labelled rows only) plus attention over its unmasked (query, key) pairs,
//! `4·head_dim` per pair and query head forward and twice that backward; the backward's recomputed scores and
//! every element-wise kernel are not counted (PaLM's MFU convention). The kernels' own FLOPs (attention backward
//! 2.5× its forward, FlashAttention's convention) set their time.
//!
//! The assumed efficiencies and their sources are in [`assumptions`] and `docs/gpu.md`.

use serde::Serialize;

use crate::plan::stages::{Precision, SourceSpec, SyncMode};
use crate::plan::{BucketPlan, Device, LaunchMode, Plan};

pub mod assumptions;
mod report;

pub use assumptions::{Assumption, GpuSpec, H200};
use assumptions::{
    CUDA_CORE_ATTENTION_FLOPS, CUDA_CORE_ATTENTION_RANGE, GemmShape, LAUNCH_S,
    NCCL_BUS_BYTES_PER_S, STREAM_EFFICIENCY, flash_flops, gemm_efficiency,
};

/// The phase of the step a kernel runs in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// The forward pass, through the `lm_head` logits.
    Forward,
    /// The loss statistics and everything after them down to the weight gradients.
    Backward,
    /// Gradient norm and AdamW.
    Optimizer,
    /// The gradients' average over the data-parallel replicas.
    AllReduce,
}

/// What one kernel does, for its time.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kernel {
    /// A cuBLAS product `C[m×n] (+)= A[m×k]·B[k×n]`: operands in the precision's width (2 bytes at bf16, 4
    /// otherwise), `C` f32, read too when `accumulate`.
    Gemm {
        /// Rows of `C`.
        m: f64,
        /// Columns of `C`.
        n: f64,
        /// The reduced dimension.
        k: f64,
        /// `C += A·B` (reads `C`).
        accumulate: bool,
        /// The operands are f32 even at `precision = bf16`: no kernel writes them a 16-bit copy yet, so cuBLAS
        /// reads 4 bytes per element and rounds them as it loads (`CUBLAS_COMPUTE_32F_FAST_16BF`), at the
        /// same assumed tensor-core efficiency.
        f32_operands: bool,
    },
    /// The DFlash attention kernels over `pairs` unmasked (query, key) pairs per query head.
    Attention {
        /// The backward (dQ, dK, dV) rather than the forward.
        backward: bool,
        /// Unmasked pairs per query head.
        pairs: f64,
        /// Query heads.
        heads: f64,
        /// Width of a head.
        head_dim: usize,
        /// Keys a query sees on average.
        mean_keys: f64,
        /// The padded length over which the queries' key prefixes are spread.
        span: f64,
    },
    /// A bandwidth-bound kernel moving `bytes` through HBM.
    Stream {
        /// Bytes read plus bytes written.
        bytes: f64,
    },
    /// NCCL's all-reduce of `bytes` over `ranks` replicas.
    AllReduce {
        /// The buffer's bytes.
        bytes: f64,
        /// Replicas.
        ranks: f64,
    },
}

/// The kind a kernel's time is reported under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum KernelKind {
    /// cuBLAS products.
    Gemm,
    /// Attention.
    Attention,
    /// Bandwidth-bound kernels.
    Bandwidth,
    /// Launch overhead inside the graph.
    Launch,
    /// NCCL.
    AllReduce,
}

/// Every kind, in report order.
pub const KINDS: [KernelKind; 5] = [
    KernelKind::Gemm,
    KernelKind::Attention,
    KernelKind::Bandwidth,
    KernelKind::Launch,
    KernelKind::AllReduce,
];

/// Every phase, in step order.
pub const PHASES: [Phase; 4] = [
    Phase::Forward,
    Phase::Backward,
    Phase::Optimizer,
    Phase::AllReduce,
];

impl KernelKind {
    /// The name the summary prints.
    pub fn name(self) -> &'static str {
        match self {
            Self::Gemm => "GEMM",
            Self::Attention => "attention",
            Self::Bandwidth => "bandwidth",
            Self::Launch => "launches",
            Self::AllReduce => "all-reduce",
        }
    }
}

impl Phase {
    /// The name the summary prints.
    pub fn name(self) -> &'static str {
        match self {
            Self::Forward => "forward",
            Self::Backward => "backward",
            Self::Optimizer => "optimizer",
            Self::AllReduce => "all-reduce",
        }
    }
}

/// One entry of a step's kernel list: `count` identical kernels (per layer, per chunk), each `launches` launches.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Work {
    /// What it is (`q_proj dW`, `AdamW`), for the JSON and the tests.
    pub name: &'static str,
    /// Its phase.
    pub phase: Phase,
    /// What one of them does.
    pub kernel: Kernel,
    /// How many run.
    pub count: f64,
    /// Kernel launches each.
    pub launches: f64,
}

impl Work {
    /// One `name` in `phase`, one launch.
    pub fn new(name: &'static str, phase: Phase, kernel: Kernel) -> Self {
        Self {
            name,
            phase,
            kernel,
            count: 1.0,
            launches: 1.0,
        }
    }

    /// The same, `count` times.
    pub fn times(mut self, count: f64) -> Self {
        self.count = count;
        self
    }

    /// The same, `launches` launches each.
    pub fn launches(mut self, launches: f64) -> Self {
        self.launches = launches;
        self
    }

    /// Model FLOPs of all `count` (module docs): GEMMs' `2mnk`, attention `4·hd` per pair and head forward, twice
    /// that backward; 0 for the rest.
    pub fn model_flops(&self) -> f64 {
        self.count
            * match self.kernel {
                Kernel::Gemm { m, n, k, .. } => 2.0 * m * n * k,
                Kernel::Attention {
                    backward,
                    pairs,
                    heads,
                    head_dim,
                    ..
                } => {
                    attention_forward_flops(pairs, heads, head_dim)
                        * if backward { 2.0 } else { 1.0 }
                }
                Kernel::Stream { .. } | Kernel::AllReduce { .. } => 0.0,
            }
    }
}

/// `4·hd` FLOPs per (query, key) pair and query head: the scores and the weighted values.
fn attention_forward_flops(pairs: f64, heads: f64, head_dim: usize) -> f64 {
    4.0 * head_dim as f64 * heads * pairs
}

/// The modelled time of one bucket's step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BucketTime {
    /// The bucket's padded length.
    pub padded_len: usize,
    /// Model FLOPs of the step (module docs).
    pub model_flops: f64,
    /// Seconds per phase, in [`PHASES`] order.
    pub phase_s: [f64; 4],
    /// Seconds per kernel kind, in [`KINDS`] order.
    pub kind_s: [f64; 5],
    /// Kernel launches of the step.
    pub launches: f64,
    /// MFU of the step, all-reduce included.
    pub mfu: f64,
    /// The attention's seconds at today's f32 CUDA-core kernels, at issue 18's 5 and 8 TFLOP/s.
    pub cuda_core_attention_s: (f64, f64),
    /// The entry with the most time: its name, phase and seconds (all its `count`).
    pub largest: (&'static str, Phase, f64),
}

impl BucketTime {
    /// The whole step: the sum of its phases.
    pub fn step_s(&self) -> f64 {
        self.phase_s.iter().sum()
    }

    /// The step without the all-reduce (what one replica computes).
    pub fn compute_s(&self) -> f64 {
        self.step_s() - self.phase_s[3]
    }

    /// Seconds of `kind`.
    pub fn of_kind(&self, kind: KernelKind) -> f64 {
        KINDS
            .iter()
            .position(|k| *k == kind)
            .map_or(0.0, |i| self.kind_s[i])
    }
}

/// The GPU model of a plan: per bucket, and over the mix.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuStepModel {
    /// The card.
    pub gpu: GpuSpec,
    /// The drafters' precision.
    pub precision: Precision,
    /// Whether the step replays CUDA graphs (`launch = graph`); eager launches are not priced.
    pub graph: bool,
    /// Replicas averaging gradients (1 without `sync = allreduce`).
    pub replicas: usize,
    /// Per bucket, in the plan's order.
    pub buckets: Vec<BucketTime>,
    /// Share of the items fed to each bucket ([`bucket_shares`]).
    pub shares: Vec<f64>,
    /// MFU over the mix: `Σ share·FLOPs / (Σ share·step · peak)`.
    pub mfu: f64,
    /// The assumptions, printed with their sources.
    pub assumptions: Vec<Assumption>,
}

/// Seconds of one `work` entry (all its `count`) on `gpu` at `precision`, and its kind.
pub fn time(gpu: &GpuSpec, precision: Precision, work: &Work) -> (KernelKind, f64) {
    let stream = |bytes: f64| bytes / (gpu.hbm_bytes_per_s * STREAM_EFFICIENCY);
    let (kind, each) = match work.kernel {
        Kernel::Gemm {
            m,
            n,
            k,
            accumulate,
            f32_operands,
        } => {
            let (peak, operand) = match precision {
                Precision::Bf16 if f32_operands => (gpu.bf16_flops, 4.0),
                Precision::Bf16 => (gpu.bf16_flops, 2.0),
                Precision::Tf32 => (gpu.tf32_flops, 4.0),
                Precision::F32 => (gpu.f32_flops, 4.0),
            };
            let compute = 2.0 * m * n * k / (peak * gemm_efficiency(GemmShape::of(m, n, k)));
            let outputs = if accumulate { 2.0 } else { 1.0 };
            let bytes = operand * (m * k + k * n) + 4.0 * outputs * m * n;
            (KernelKind::Gemm, compute.max(stream(bytes)))
        }
        Kernel::Attention {
            backward,
            pairs,
            heads,
            head_dim,
            mean_keys,
            span,
        } => {
            let forward = attention_forward_flops(pairs, heads, head_dim);
            let flops = if backward { 2.5 * forward } else { forward };
            let rate = match precision {
                Precision::Bf16 => flash_flops(head_dim, backward, mean_keys, span),
                Precision::Tf32 | Precision::F32 => None,
            }
            .unwrap_or(CUDA_CORE_ATTENTION_FLOPS);
            (KernelKind::Attention, flops / rate)
        }
        Kernel::Stream { bytes } => (KernelKind::Bandwidth, stream(bytes)),
        Kernel::AllReduce { bytes, ranks } => (
            KernelKind::AllReduce,
            2.0 * (ranks - 1.0) / ranks * bytes / NCCL_BUS_BYTES_PER_S,
        ),
    };
    (kind, work.count * each)
}

/// The model of one bucket's `work` (the family's kernel list, the all-reduce appended by the caller).
pub fn bucket_time(
    gpu: &GpuSpec,
    precision: Precision,
    padded_len: usize,
    work: &[Work],
) -> BucketTime {
    let (mut phase_s, mut kind_s) = ([0.0; 4], [0.0; 5]);
    let (mut launches, mut model_flops, mut attention_flops) = (0.0, 0.0, 0.0);
    let mut largest = ("", Phase::Forward, 0.0);
    for w in work {
        let (kind, seconds) = time(gpu, precision, w);
        let n = w.count * w.launches;
        let overhead = n * LAUNCH_S;
        let phase = PHASES.iter().position(|p| *p == w.phase).unwrap_or(0);
        phase_s[phase] += seconds + overhead;
        kind_s[KINDS.iter().position(|k| *k == kind).unwrap_or(0)] += seconds;
        kind_s[3] += overhead;
        launches += n;
        model_flops += w.model_flops();
        if let Kernel::Attention {
            backward,
            pairs,
            heads,
            head_dim,
            ..
        } = w.kernel
        {
            let forward = attention_forward_flops(pairs, heads, head_dim);
            attention_flops += w.count * if backward { 2.5 * forward } else { forward };
        }
        if seconds > largest.2 {
            largest = (w.name, w.phase, seconds);
        }
    }
    let step: f64 = phase_s.iter().sum();
    BucketTime {
        padded_len,
        model_flops,
        phase_s,
        kind_s,
        launches,
        mfu: if step > 0.0 {
            model_flops / (step * gpu.bf16_flops)
        } else {
            0.0
        },
        cuda_core_attention_s: (
            attention_flops / CUDA_CORE_ATTENTION_RANGE.0,
            attention_flops / CUDA_CORE_ATTENTION_RANGE.1,
        ),
        largest,
    }
}

/// The GPU model of `plan`'s drafters, `None` when no drafter is on a GPU or the family has no kernel list
/// ([`crate::family::Family::gpu_step`]).
pub fn gpu_step_model(plan: &Plan) -> Option<GpuStepModel> {
    let drafters = &plan.drafter.placement.workers;
    if !drafters.iter().any(|d| matches!(d, Device::Gpu(_))) {
        return None;
    }
    let (gpu, precision) = (H200, plan.drafter.precision);
    let replicas = match plan.drafter.sync {
        SyncMode::AllReduce => drafters.len(),
        SyncMode::None => 1,
    };
    // The flat f32 gradient buffer, averaged in place (`GradientAllReduce`).
    let gradient_bytes = 4.0 * plan.model.parameters as f64;
    let family = plan.model.spec.family();
    let buckets = plan
        .buckets
        .iter()
        .map(|bucket| {
            let mut work = family.gpu_step(bucket, &plan.drafter.loss, precision)?;
            if replicas > 1 {
                work.push(Work::new(
                    "gradient all-reduce",
                    Phase::AllReduce,
                    Kernel::AllReduce {
                        bytes: gradient_bytes,
                        ranks: replicas as f64,
                    },
                ));
            }
            Some(bucket_time(&gpu, precision, bucket.padded_len, &work))
        })
        .collect::<Option<Vec<_>>>()?;
    let shares = bucket_shares(&plan.target.source, &plan.buckets);
    Some(GpuStepModel {
        gpu,
        precision,
        graph: plan.drafter.launch == LaunchMode::Graph,
        replicas,
        mfu: mix_mfu(&gpu, &buckets, &shares),
        buckets,
        shares,
        assumptions: assumptions::assumptions(&gpu),
    })
}

/// What `compile --emit json` prints: the plan's fields in their order, then the GPU model as `gpu_step_model`
/// when the drafters are on GPUs (a reader of the plan alone ignores the extra field).
#[derive(Debug, Serialize)]
pub struct PlanJson<'a> {
    /// The plan.
    #[serde(flatten)]
    pub plan: &'a Plan,
    /// [`gpu_step_model`] of it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_step_model: Option<GpuStepModel>,
}

impl<'a> PlanJson<'a> {
    /// The plan and its GPU model.
    pub fn of(plan: &'a Plan) -> Self {
        Self {
            plan,
            gpu_step_model: gpu_step_model(plan),
        }
    }
}

/// MFU over the mix: the FLOPs of the items fed, over the time they take at the peak.
pub fn mix_mfu(gpu: &GpuSpec, buckets: &[BucketTime], shares: &[f64]) -> f64 {
    let flops: f64 = buckets
        .iter()
        .zip(shares)
        .map(|(b, s)| s * b.model_flops)
        .sum();
    let seconds: f64 = buckets
        .iter()
        .zip(shares)
        .map(|(b, s)| s * b.step_s())
        .sum();
    if seconds > 0.0 {
        flops / (seconds * gpu.bf16_flops)
    } else {
        0.0
    }
}

/// The share of items per bucket the plan's source produces: for a synthetic source with lengths uniform over
/// `min..max`, the rate at which each bucket completes items (`P(length in bucket) / sequences per item`, the
/// source's own rule); for recorded files or a stream, in proportion to the buckets' count (unknown until
/// measured). `simulate` feeds its buckets by the same shares.
pub fn bucket_shares(source: &SourceSpec, buckets: &[BucketPlan]) -> Vec<f64> {
    let rates: Vec<f64> = match source {
        SourceSpec::Synthetic {
            min_len, max_len, ..
        } => {
            let mut lower = 0;
            buckets
                .iter()
                .map(|b| {
                    let from = (*min_len).max(lower + 1);
                    let to = (*max_len).min(b.padded_len + 1);
                    lower = b.padded_len;
                    let lengths = to.saturating_sub(from) as f64;
                    if b.sequences == 0 {
                        0.0
                    } else {
                        lengths / b.sequences as f64
                    }
                })
                .collect()
        }
        _ => vec![1.0; buckets.len()],
    };
    let total: f64 = rates.iter().sum();
    rates
        .iter()
        .map(|r| if total > 0.0 { r / total } else { 0.0 })
        .collect()
}

#[cfg(test)]
mod tests;
