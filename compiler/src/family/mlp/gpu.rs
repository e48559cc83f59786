//! The `mlp` step as the CUDA backend launches it (`runtime/src/model/mlp/mod.rs`), for the GPU time model
//! ([`crate::cost::gpu`]): GEMM shapes and the bytes of the bandwidth-bound kernels, per phase. Notation of
//! [`super::cost`]: `T` tokens, `din`, `H`, `I`, `L` blocks, `heads`, `V`, `P`; `e` the bytes of a GEMM
//! operand (4: no kernel of this family writes a 16-bit copy yet). Every head's `lm_head`
//! products run over all `T` rows (the mlp's labels are the next tokens: every row but a sequence's last has
//! one). The bytes count each kernel's f32 inputs and its outputs once, as in [`crate::family::dflash::gpu`].

use crate::cost::gpu::{Kernel, Phase, Work};
use crate::family::mlp::MlpSpec;
use crate::plan::derived::BucketPlan;
use crate::plan::stages::{LossSpec, Precision};

/// The step's kernels (module docs).
pub fn step_work(
    spec: &MlpSpec,
    bucket: &BucketPlan,
    loss: &LossSpec,
    _precision: Precision,
) -> Vec<Work> {
    use Phase::{Backward as B, Forward as F, Optimizer as O};
    let f = |x: usize| x as f64;
    let (t, din, h, i, blocks, heads, v) = (
        f(bucket.tokens),
        f(spec.din),
        f(spec.hidden),
        f(spec.intermediate),
        f(spec.blocks),
        f(spec.heads),
        f(spec.vocab),
    );
    let p = f(spec.parameter_count());
    // The mlp family's kernels write no 16-bit copies at any precision: its products read f32 operands
    // (cuBLAS rounds them as it loads at bf16) and its kernels write f32.
    let (e, copy) = (4.0, 0.0);
    let gemm = |m: f64, n: f64, k: f64, accumulate: bool| Kernel::Gemm {
        m,
        n,
        k,
        accumulate,
        // The mlp family's kernels write no 16-bit copies.
        f32_operands: true,
    };
    let stream = |bytes: f64| Kernel::Stream { bytes };
    let chunk = f(loss.chunk_tokens.max(1)).min(t.max(1.0));
    let chunks = (t / chunk).ceil().max(1.0);
    let rows = t / chunks;
    let per_block = [
        Work::new("block norm", F, stream(t * h * (4.0 + e))),
        Work::new("gate_up", F, gemm(t, 2.0 * i, h, false)),
        Work::new("SwiGLU", F, stream(t * i * (8.0 + e))),
        Work::new("residual copy", F, stream(8.0 * t * h)),
        Work::new("down", F, gemm(t, h, i, true)),
    ];
    let per_block_backward = [
        Work::new("down dW", B, gemm(h, i, t, false)),
        Work::new("down dX", B, gemm(t, i, h, false)),
        Work::new("SwiGLU backward", B, stream(t * i * (12.0 + 2.0 * e))),
        Work::new("gate_up dW", B, gemm(2.0 * i, h, t, false)),
        Work::new("gate_up dX", B, gemm(t, h, 2.0 * i, false)),
        Work::new("block norm backward", B, stream(t * h * (16.0 + e))).launches(2.0),
    ];
    let per_head = [
        Work::new("head projection", F, gemm(t, h, h, false)),
        Work::new("head residual", F, stream(t * h * (8.0 + e))),
        Work::new("lm_head", F, gemm(rows, v, h, false)).times(chunks),
        Work::new("fused loss", B, stream(rows * v * (4.0 + e))).times(chunks),
        Work::new("lm_head dX", B, gemm(rows, h, v, false)).times(chunks),
        Work::new("lm_head dW", B, gemm(v, h, rows, true)).times(chunks),
        Work::new("head residual backward", B, stream(t * h * (16.0 + e))),
        Work::new("head projection dX", B, gemm(t, h, h, true)),
        Work::new("head projection dW", B, gemm(h, h, t, false)),
    ];
    let repeat = |list: &[Work], n: f64| -> Vec<Work> {
        list.iter()
            .map(|w| {
                let count = w.count * n;
                w.clone().times(count)
            })
            .collect()
    };
    let mut work = vec![Work::new("fc", F, gemm(t, h, din, false))];
    work.extend(repeat(&per_block, blocks));
    work.push(Work::new("norm", F, stream(t * h * (4.0 + e))));
    work.push(
        Work::new(
            "labels, loss scales, dz zero",
            B,
            stream(4.0 * t * (heads + 1.0) + 4.0 * t * h),
        )
        .launches(3.0),
    );
    work.extend(repeat(&per_head, heads));
    work.push(Work::new("loss sum", B, stream(4.0 * t * heads)));
    work.push(Work::new("norm backward", B, stream(t * h * (12.0 + e))).launches(2.0));
    work.extend(repeat(&per_block_backward, blocks));
    work.extend([
        Work::new("fc dW", B, gemm(h, din, t, false)),
        Work::new("gradient norm", O, stream(4.0 * p)).launches(2.0),
        Work::new("AdamW", O, stream(p * (28.0 + copy))).launches(2.0),
    ]);
    work.retain(|w| w.count > 0.0);
    work
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_flops_are_the_family_flops_less_the_loss_and_adamw_arithmetic() {
        let spec = MlpSpec {
            din: 96,
            hidden: 32,
            blocks: 2,
            intermediate: 64,
            heads: 3,
            vocab: 100,
        };
        let bucket = BucketPlan {
            padded_len: 16,
            sequences: 4,
            tokens: 64,
            step_flops: 0,
            step_bytes: 0,
        };
        let loss = LossSpec {
            head_decay: 1.0,
            position_decay: None,
            step_decay: None,
            chunk_tokens: 20,
        };
        let model: f64 = step_work(&spec, &bucket, &loss, Precision::Bf16)
            .iter()
            .map(Work::model_flops)
            .sum();
        let family = super::super::cost::step_flops(&spec, 64).unwrap() as f64;
        let expected = family - 4.0 * 64.0 * 3.0 * 100.0 - 12.0 * spec.parameter_count() as f64;
        assert!(
            (model - expected).abs() <= 1e-12 * expected,
            "{model} vs {expected}"
        );
    }
}
