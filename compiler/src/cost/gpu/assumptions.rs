//! The GPU time model's assumptions: the card's peaks and, per kernel kind, the share of them the kernels the
//! CUDA backend launches are assumed to reach, each with the published measurement it comes from. Read by
//! [`super::time`] (the arithmetic) and printed by `compile` (the short form) and `docs/gpu.md` (the table).
//!
//! No GPU has run draftpipe's step, so none of these figures is draftpipe's own: they are other codebases'
//! measurements of the same kind of kernel on an H100 SXM (same SM count and clocks as the H200, whose only
//! relevant difference is 4.8 TB/s of HBM against 3.35), and `scripts/gpu-check.sh` replaces them.

use serde::Serialize;

/// The card the model times the step on. The `.pipe` language names no GPU kind, so every plan gets
/// [`H200`], and the summary says so.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct GpuSpec {
    /// The card's name as printed.
    pub name: &'static str,
    /// Dense bf16 tensor-core peak, FLOP/s: the MFU's denominator.
    pub bf16_flops: f64,
    /// Dense TF32 tensor-core peak, FLOP/s.
    pub tf32_flops: f64,
    /// f32 CUDA-core (FMA) peak, FLOP/s.
    pub f32_flops: f64,
    /// HBM bandwidth, bytes/s.
    pub hbm_bytes_per_s: f64,
}

/// NVIDIA H200 SXM: 989 TFLOP/s dense bf16 (494.7 TF32, 66.9 f32 on CUDA cores), 4.8 TB/s HBM3e (NVIDIA's
/// H200 datasheet; the compute figures are the H100 SXM's, the same chip at the same clocks).
pub const H200: GpuSpec = GpuSpec {
    name: "H200",
    bf16_flops: 989e12,
    tf32_flops: 494.7e12,
    f32_flops: 66.9e12,
    hbm_bytes_per_s: 4.8e12,
};

/// A GEMM's shape class, by its smallest dimension: cuBLAS's tiles (128 or 256 wide) and the 132 SMs'
/// waves are full only when every dimension spans many tiles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum GemmShape {
    /// Every dimension ≥ 1024.
    Large,
    /// Smallest dimension 256..1024.
    Medium,
    /// Smallest dimension < 256.
    Skinny,
}

impl GemmShape {
    /// The class of `m × n × k`.
    pub fn of(m: f64, n: f64, k: f64) -> Self {
        let smallest = m.min(n).min(k);
        if smallest >= 1024.0 {
            Self::Large
        } else if smallest >= 256.0 {
            Self::Medium
        } else {
            Self::Skinny
        }
    }
}

/// Share of the precision's tensor-core (or, at f32, CUDA-core) peak a cuBLAS GEMM of `shape` reaches.
pub fn gemm_efficiency(shape: GemmShape) -> f64 {
    match shape {
        GemmShape::Large => 0.75,
        GemmShape::Medium => 0.60,
        GemmShape::Skinny => 0.35,
    }
}

/// Share of HBM bandwidth the bandwidth-bound kernels (norms, RoPE, SwiGLU, the loss statistics, AdamW,
/// conversions, copies) reach, and the floor under a GEMM's time (its operands must cross HBM once).
pub const STREAM_EFFICIENCY: f64 = 0.80;

/// Seconds each kernel node of a replayed CUDA graph adds beyond its own run (the launch and the gap
/// between dependent kernels); an eager step pays more, which the model does not price (`launch = graph`
/// is the GPU default).
pub const LAUNCH_S: f64 = 1.0e-6;

/// NCCL all-reduce bus bandwidth over NVLink 4 between H100/H200 SXM GPUs of one NVSwitch board, ring
/// algorithm, bytes/s; the time of an all-reduce of `b` bytes over `n` ranks is `2(n−1)/n · b / bus`.
pub const NCCL_BUS_BYTES_PER_S: f64 = 370e9;

/// FLOP/s of today's f32 CUDA-core DFlash attention kernels (a warp per tile of 8 queries, no shared-memory
/// tiles), which a plan at `precision = f32`/`tf32` or an unsupported `head_dim` runs: the middle of issue
/// 18's 5–8 TFLOP/s estimate.
pub const CUDA_CORE_ATTENTION_FLOPS: f64 = 6.5e12;

/// Issue 18's range for the same kernels, printed beside the flash model for the largest bucket.
pub const CUDA_CORE_ATTENTION_RANGE: (f64, f64) = (5e12, 8e12);

/// FlashAttention-2 on an H100 80GB SXM5, bf16, 16k tokens per batch, hidden 2048, no mask: TFLOP/s by
/// sequence length 512, 1k, 2k, 4k, 8k, 16k (FlashAttention-3 paper, Shah et al. 2024, arXiv:2407.08608,
/// Figs. 5–6; FLOPs counted as FlashAttention's benchmarks do: forward `4·hd` per pair and head, backward 2.5×
/// the forward).
const SEQUENCE_LENGTHS: [f64; 6] = [512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0];
const FA2_FORWARD_D64: [f64; 6] = [282.0, 306.0, 318.0, 321.0, 322.0, 324.0];
const FA2_FORWARD_D128: [f64; 6] = [309.0, 350.0, 362.0, 368.0, 370.0, 370.0];
const FA2_BACKWARD_D64: [f64; 6] = [198.0, 238.0, 264.0, 279.0, 287.0, 291.0];
const FA2_BACKWARD_D128: [f64; 6] = [214.0, 260.0, 291.0, 310.0, 318.0, 322.0];
/// The same paper's forward with a causal mask, head_dim 128: each query sees a prefix whose length is spread
/// uniformly over the sequence, as a DFlash block's context is over the anchors.
const FA2_FORWARD_CAUSAL_D128: [f64; 6] = [191.0, 260.0, 298.0, 319.0, 333.0, 335.0];

/// The table's value at `x`, linear in `log2(x)` between its points and clamped at its ends.
fn interpolate(table: &[f64; 6], x: f64) -> f64 {
    let x = x.max(1.0).log2();
    let points: Vec<f64> = SEQUENCE_LENGTHS.iter().map(|l| l.log2()).collect();
    if x <= points[0] {
        return table[0];
    }
    for i in 1..points.len() {
        if x <= points[i] {
            let t = (x - points[i - 1]) / (points[i] - points[i - 1]);
            return table[i - 1] + t * (table[i] - table[i - 1]);
        }
    }
    table[table.len() - 1]
}

/// FLOP/s of the flash kernels (FlashAttention's FLOP convention) at `head_dim` 64 or 128 (`None` for other
/// widths, which have no flash entry), for queries that see `mean_keys` keys on average with prefixes spread
/// over a padded length of `span`: FlashAttention-2's unmasked figure at `mean_keys` (a query tile then does
/// the same work per key tile), times the cost of the spread, measured as the causal forward at `span` over
/// the unmasked forward at `span / 2` (the same mean key count). The backward pays the spread's share as the
/// forward does (the paper has no causal backward at these shapes).
pub fn flash_flops(head_dim: usize, backward: bool, mean_keys: f64, span: f64) -> Option<f64> {
    let table = match (head_dim, backward) {
        (64, false) => &FA2_FORWARD_D64,
        (64, true) => &FA2_BACKWARD_D64,
        (128, false) => &FA2_FORWARD_D128,
        (128, true) => &FA2_BACKWARD_D128,
        _ => return None,
    };
    let spread = interpolate(&FA2_FORWARD_CAUSAL_D128, span)
        / interpolate(&FA2_FORWARD_D128, (span / 2.0).max(1.0));
    Some(interpolate(table, mean_keys) * spread.min(1.0) * 1e12)
}

/// One assumption as `compile` prints it: what, the figure, and where it comes from.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Assumption {
    /// The kernel kind or figure.
    pub what: &'static str,
    /// The assumed figure, written out.
    pub value: String,
    /// The published measurement behind it, short.
    pub source: &'static str,
}

/// Every assumption of the model, in the order `compile` prints them (docs/gpu.md has the long form).
pub fn assumptions(gpu: &GpuSpec) -> Vec<Assumption> {
    vec![
        Assumption {
            what: "card",
            value: format!(
                "{} (the .pipe names no GPU kind): {:.0} TFLOP/s dense bf16, {:.1} TB/s HBM",
                gpu.name,
                gpu.bf16_flops / 1e12,
                gpu.hbm_bytes_per_s / 1e12
            ),
            source: "NVIDIA H200 datasheet",
        },
        Assumption {
            what: "cuBLAS GEMM, every dim >= 1024",
            value: format!("{:.0}% of peak", 100.0 * gemm_efficiency(GemmShape::Large)),
            source: "780 TFLOP/s = 79% measured for bf16 4224x8192x2048 on H100 SXM (H. He, 'H100 peak matmul \
                     FLOPS' gist, autotuned); less for cuBLAS's untuned heuristic",
        },
        Assumption {
            what: "cuBLAS GEMM, smallest dim 256..1024 / < 256",
            value: format!(
                "{:.0}% / {:.0}% of peak, never faster than its operands' HBM traffic",
                100.0 * gemm_efficiency(GemmShape::Medium),
                100.0 * gemm_efficiency(GemmShape::Skinny)
            ),
            source: "tile and wave quantization (NVIDIA Matrix Multiplication Background guide); a judgement, \
                     not a measurement at these shapes",
        },
        Assumption {
            what: "flash attention, bf16, head_dim 64/128",
            value: "FlashAttention-2's TFLOP/s at the mean keys per query, times the causal/unmasked ratio \
                    at the bucket's length"
                .to_owned(),
            source: "FlashAttention-3 paper (arXiv:2407.08608) Figs. 5-6, FA2 on H100 SXM5: fwd 309-370, \
                     bwd 214-322 TFLOP/s (hd 128), causal fwd 191-335",
        },
        Assumption {
            what: "f32 CUDA-core attention (f32/tf32, other head_dim)",
            value: format!(
                "{:.1} TFLOP/s",
                CUDA_CORE_ATTENTION_FLOPS / 1e12
            ),
            source: "issue 18's estimate of today's kernels (5-8 TFLOP/s, a reading of the code; not measured)",
        },
        Assumption {
            what: "bandwidth-bound kernels",
            value: format!("{:.0}% of HBM bandwidth", 100.0 * STREAM_EFFICIENCY),
            source: "STREAM triad / device copy on H100 SXM measure 3.0-3.1 of 3.35 TB/s (90-92%); less for \
                     kernels with a row reduction",
        },
        Assumption {
            what: "kernel launch inside a CUDA graph",
            value: format!("{:.1} us per kernel", LAUNCH_S * 1e6),
            source: "NVIDIA, 'Getting Started with CUDA Graphs' (graph replay leaves about a microsecond per \
                     kernel node)",
        },
        Assumption {
            what: "NCCL all-reduce (sync = allreduce)",
            value: format!(
                "{:.0} GB/s bus bandwidth (ring), f32 gradients, not overlapped: between the two graphs",
                NCCL_BUS_BYTES_PER_S / 1e9
            ),
            source: "NCCL's maintainer on NVLink 4: 370 GB/s effective with NCCL_ALGO=RING \
                     (github.com/NVIDIA/nccl-tests/issues/212)",
        },
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flash_figure_is_the_table_at_the_mean_keys_times_the_spread() {
        // 2048 mean keys over a span of 4096: FA2 hd128 fwd at 2k is 362, the spread 319 / 362.
        let flops = flash_flops(128, false, 2048.0, 4096.0).unwrap();
        assert!((flops - 319e12).abs() < 1e6, "{flops}");
        // Halfway (in log2) between 2k and 4k keys, backward hd 64: (264 + 279) / 2, spread at 8192: 333/368.
        let flops = flash_flops(64, true, 2048.0 * 2f64.sqrt(), 8192.0).unwrap();
        let expected = 271.5e12 * 333.0 / 368.0;
        assert!((flops - expected).abs() < 1e6, "{flops} vs {expected}");
        assert_eq!(flash_flops(96, false, 2048.0, 4096.0), None);
    }

    #[test]
    fn gemm_classes_follow_the_smallest_dimension() {
        assert_eq!(GemmShape::of(8192.0, 1024.0, 4096.0), GemmShape::Large);
        assert_eq!(GemmShape::of(8192.0, 512.0, 4096.0), GemmShape::Medium);
        assert_eq!(GemmShape::of(16.0, 1.0, 512.0), GemmShape::Skinny);
    }
}
