//! The `dflash` step as the CUDA backend launches it, for the GPU time model ([`crate::cost::gpu`]): every GEMM
//! with its shape, the attention kernels with their unmasked pairs, and the bytes of each bandwidth-bound
//! kernel, in the order of `runtime/src/model/dflash/mod.rs`'s forward, loss and backward and the optimizer.
//!
//! It describes the step as the CUDA backend launches it: at `precision = bf16` every product reads 16-bit
//! operands (`e = 2` bytes below, 4 at f32/tf32, where no copies are written): the weights' copy AdamW writes,
//! the norm and SwiGLU outputs their kernels write in bf16 (kept per layer, so the weight gradients read them
//! again), the attention output written in bf16 by the flash forward beside its f32 output (rounded in a pass of
//! its own after the f32 attention kernels), the gradients the backward's products read, written in bf16 beside
//! their f32 values by the norms' and the SwiGLU's backward (the attention's dv outputs rounded in a pass of their
//! own), and both `lm_head` products (the frozen `lm_head`'s copy rounded once at upload, the head rows gathered
//! into bf16, the logits gradient's copy the fused loss writes in its gradient pass). The `lm_head`
//! products and the fused loss run over the labelled rows only ([`head_rows`]), gathered before the head and
//! scattered back after it; attention runs the flash kernels (bf16, head_dim 64 or 128), whose q and k
//! operands RoPE writes in bf16 in its pass and whose v operands are rounded in two passes of their own, once
//! in the forward, kept per layer for the backward. The shapes use the notation of [`super::cost`]: `N`
//! sequences, `S` padded length, `T = N·S`
//! context rows, `Q` block rows, `R` labelled rows, `H`, `Lt` taps, `nh`/`kv` heads of `hd`, `I`, `V`, `P`.
//!
//! Bytes of the bandwidth-bound kernels: each reads its f32 inputs and writes its outputs once (f32 where an
//! f32 consumer reads them: the residual stream, norm inputs; `e` where a product or attention reads them).

use crate::cost::gpu::{Kernel, Phase, Work};
use crate::family::dflash::DflashSpec;
use crate::family::dflash::cost::DflashShape;
use crate::plan::derived::BucketPlan;
use crate::plan::stages::{LossSpec, Precision};

/// Rows that go through the `lm_head` products and the fused loss on CUDA: [`DflashSpec::head_rows`], the
/// bucket's bound `N·A·(B − 1) + 1` the captured step is shaped for (slot 0 carries no label; the one extra row
/// never has one). Slots past a sequence's end and positions the loss mask drops carry no label either and are
/// compacted away on the CPU, but a graph keeps the bucket's shapes.
pub fn head_rows(spec: &DflashSpec, padded_len: usize, sequences: usize) -> f64 {
    spec.head_rows(padded_len, sequences)
        .map_or(f64::INFINITY, |rows| rows as f64)
}

/// The step's kernels (module docs).
pub fn step_work(
    spec: &DflashSpec,
    bucket: &BucketPlan,
    loss: &LossSpec,
    precision: Precision,
) -> Vec<Work> {
    use Phase::{Backward as B, Forward as F, Optimizer as O};
    let shape = DflashShape::new(spec, bucket.padded_len, bucket.sequences);
    let f = |x: usize| x as f64;
    let (t, q) = (shape.context_rows as f64, shape.block_rows as f64);
    let r = head_rows(spec, bucket.padded_len, bucket.sequences);
    let (h, lt, layers, v, i) = (
        f(spec.hidden),
        f(spec.taps),
        f(spec.layers),
        f(spec.vocab),
        f(spec.intermediate),
    );
    let (qd, kd) = (
        f(spec.heads * spec.head_dim),
        f(spec.kv_heads * spec.head_dim),
    );
    let p = f(spec.parameter_count());
    // Operand bytes of a GEMM or attention input, and whether 16-bit copies are written at all.
    let (e, copies) = match precision {
        Precision::Bf16 => (2.0, true),
        Precision::Tf32 | Precision::F32 => (4.0, false),
    };
    let conversion = |elements: f64| if copies { elements * (4.0 + e) } else { 0.0 };
    // A bf16 copy a kernel writes beside its f32 output in the same pass.
    let copy_out = |elements: f64| if copies { elements * e } else { 0.0 };
    // The step's products (16-bit operands at bf16).
    let product = |accumulate: bool| {
        move |m: f64, n: f64, k: f64| Kernel::Gemm {
            m,
            n,
            k,
            accumulate,
            f32_operands: false,
        }
    };
    let (gemm, gemm_acc) = (product(false), product(true));
    let stream = |bytes: f64| Kernel::Stream { bytes };
    let attention = |backward: bool| Kernel::Attention {
        backward,
        pairs: shape.attention_pairs as f64,
        heads: f(spec.heads),
        head_dim: spec.head_dim,
        // `(S − 2)/2` context keys on average, and the block's own `B`.
        mean_keys: shape.attention_pairs as f64 / q.max(1.0),
        span: f(bucket.padded_len),
    };
    let chunk = f(loss.chunk_tokens.max(1)).min(r.max(1.0));
    let chunks = (r / chunk).ceil().max(1.0);
    let per_chunk = r / chunks;

    let mut work = vec![
        // Context: c = hidden_norm(hs · fcᵀ), once per sequence.
        Work::new("fc", F, gemm(t, h, lt * h)),
        Work::new("hidden_norm", F, stream(t * h * (4.0 + e) + 4.0 * t)),
        Work::new("embedding gather", F, stream(8.0 * q * h)),
    ];
    let per_layer = [
        Work::new("input_layernorm", F, stream(q * h * (4.0 + e))),
        Work::new("q_proj", F, gemm(q, qd, h)),
        Work::new("q_norm + RoPE", F, stream(q * qd * 12.0 + copy_out(q * qd))).launches(2.0),
        Work::new("k_proj, v_proj (block rows)", F, gemm(q, kd, h)).times(2.0),
        Work::new(
            "k_norm + RoPE (block rows)",
            F,
            stream(q * kd * 12.0 + copy_out(q * kd)),
        )
        .launches(2.0),
        Work::new("k_proj, v_proj (context)", F, gemm(t, kd, h)).times(2.0),
        Work::new(
            "k_norm + RoPE (context)",
            F,
            stream(t * kd * 12.0 + copy_out(t * kd)),
        )
        .launches(2.0),
        Work::new("v bf16 copies", F, stream(conversion((q + t) * kd))).launches(2.0),
        Work::new("attention forward", F, attention(false)),
        // Written by the flash forward beside its f32 output: bytes, no launch of its own.
        Work::new("attention output bf16 copy", F, stream(copy_out(q * qd))).launches(0.0),
        Work::new("residual copy", F, stream(8.0 * q * h)),
        Work::new("o_proj", F, gemm_acc(q, h, qd)),
        Work::new("post_attention_layernorm", F, stream(q * h * (4.0 + e))),
        Work::new("gate_up_proj", F, gemm(q, 2.0 * i, h)),
        Work::new("SwiGLU", F, stream(q * i * (8.0 + e))),
        Work::new("residual copy", F, stream(8.0 * q * h)),
        Work::new("down_proj", F, gemm_acc(q, h, i)),
    ];
    work.extend(per_layer.into_iter().map(|w| {
        let count = w.count * layers;
        w.times(count)
    }));
    work.extend([
        Work::new("norm", F, stream(q * h * (4.0 + e))),
        // The head rows gathered from f32 into the product's operand (bf16 at bf16).
        Work::new("labelled rows gather", F, stream(r * h * (4.0 + e))),
        Work::new("lm_head", F, gemm(per_chunk, v, h)).times(chunks),
        // Per chunk, one kernel of two passes over the f32 logits: the statistics (online max with its argmax,
        // and the sum of exponentials), then the gradient written in place and, at bf16, its 16-bit copy for
        // the product.
        Work::new(
            "fused loss",
            B,
            stream(per_chunk * v * (12.0 + if copies { e } else { 0.0 })),
        )
        .times(chunks),
        Work::new("lm_head dX", B, gemm(per_chunk, h, v)).times(chunks),
        Work::new("dz scatter", B, stream(4.0 * q * h + 8.0 * r * h)).launches(2.0),
        Work::new("loss sum, correct counts", B, stream(8.0 * q)).launches(3.0),
        Work::new("norm backward", B, stream(q * h * 12.0 + copy_out(q * h))).launches(2.0),
    ]);
    // Backward, per layer; layer 0's block-row q/k/v input gradients are not needed (the embedding is frozen).
    let per_layer_backward = [
        Work::new("down_proj dW", B, gemm(h, i, q)),
        Work::new("down_proj dX", B, gemm(q, i, h)),
        Work::new(
            "SwiGLU backward",
            B,
            stream(q * i * 12.0 + copy_out(2.0 * q * i)),
        ),
        Work::new("gate_up_proj dW", B, gemm(2.0 * i, h, q)),
        Work::new("gate_up_proj dX", B, gemm(q, h, 2.0 * i)),
        Work::new(
            "post_attention_layernorm backward",
            B,
            stream(q * h * 16.0 + copy_out(q * h)),
        )
        .launches(2.0),
        Work::new("o_proj dW", B, gemm(h, qd, q)),
        Work::new("o_proj dX", B, gemm(q, qd, h)),
        Work::new("attention dO copy", B, stream(conversion(q * qd))),
        Work::new("attention backward", B, attention(true)),
        Work::new(
            "RoPE + q_norm backward",
            B,
            stream(q * qd * 20.0 + copy_out(q * qd)),
        )
        .launches(3.0),
        Work::new(
            "RoPE + k_norm backward (block rows)",
            B,
            stream(q * kd * 20.0 + copy_out(q * kd)),
        )
        .launches(3.0),
        Work::new(
            "RoPE + k_norm backward (context)",
            B,
            stream(t * kd * 20.0 + copy_out(t * kd)),
        )
        .launches(3.0),
        // The attention kernels write dv in f32: both key sets' copies in a pass each.
        Work::new("dv bf16 copies", B, stream(conversion((q + t) * kd))).launches(2.0),
        Work::new("q_proj dW", B, gemm(qd, h, q)),
        Work::new("k_proj, v_proj dW (block rows)", B, gemm(kd, h, q)).times(2.0),
        Work::new("k_proj, v_proj dW (context)", B, gemm_acc(kd, h, t)).times(2.0),
        Work::new("k_proj, v_proj dX (context)", B, gemm_acc(t, h, kd)).times(2.0),
        Work::new("input_layernorm backward", B, stream(q * h * 16.0)).launches(2.0),
    ];
    work.extend(per_layer_backward.into_iter().map(|w| {
        let count = w.count * layers;
        w.times(count)
    }));
    let above_layer_0 = (layers - 1.0).max(0.0);
    work.extend([
        Work::new("q_proj dX", B, gemm_acc(q, h, qd)).times(above_layer_0),
        Work::new("k_proj, v_proj dX (block rows)", B, gemm_acc(q, h, kd))
            .times(2.0 * above_layer_0),
        // The input norm's copy of dx, read by the next layer down's products (none below layer 0): written in
        // the same pass as its input gradient, so no launch of its own.
        Work::new(
            "input_layernorm backward dx copy",
            B,
            stream(copy_out(q * h)),
        )
        .times(above_layer_0)
        .launches(0.0),
        Work::new(
            "hidden_norm backward",
            B,
            stream(t * h * 8.0 + copy_out(t * h)),
        )
        .launches(2.0),
        Work::new("fc dW", B, gemm(h, lt * h, t)),
        // The gradient norm (partials, a tree to one value) and AdamW (step state, then one pass reading p, g,
        // m, v and writing p, m, v and, at bf16, the 16-bit copy of the weights the products read).
        Work::new("gradient norm", O, stream(4.0 * p)).launches(2.0),
        Work::new(
            "AdamW",
            O,
            stream(p * (28.0 + if copies { e } else { 0.0 })),
        )
        .launches(2.0),
    ]);
    work.retain(|w| w.count > 0.0 && !matches!(w.kernel, Kernel::Stream { bytes } if bytes <= 0.0));
    work
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::family::dflash::cost::tests::spec;

    #[test]
    fn the_head_runs_over_the_labelled_rows_only() {
        // 2 sequences of 10: 8 blocks each of 4 slots, 3 labelled, and the one row that never has a label.
        assert_eq!(head_rows(&spec(), 10, 2), 49.0);
        let bucket = BucketPlan {
            padded_len: 10,
            sequences: 2,
            tokens: 20,
            step_flops: 0,
            step_bytes: 0,
        };
        let loss = LossSpec {
            head_decay: 1.0,
            position_decay: None,
            step_decay: None,
            chunk_tokens: 32,
        };
        let work = step_work(&spec(), &bucket, &loss, Precision::Bf16);
        let head: f64 = work
            .iter()
            .filter(|w| w.name == "lm_head")
            .map(Work::model_flops)
            .sum();
        assert_eq!(head, 2.0 * 49.0 * 512.0 * 64.0);
        // Two chunks of 24.5 rows (the model's mean).
        assert_eq!(
            work.iter().find(|w| w.name == "lm_head").unwrap().count,
            2.0
        );
    }

    #[test]
    fn model_flops_are_the_family_flops_less_the_unlabelled_head_rows_and_the_recompute() {
        // The family's figure counts the head over every block row (Q = 64), attention 3.5× its forward and the
        // fused loss and AdamW's arithmetic; the model counts the head over R = 49 rows and attention 3×.
        let bucket = BucketPlan {
            padded_len: 10,
            sequences: 2,
            tokens: 20,
            step_flops: 0,
            step_bytes: 0,
        };
        let loss = LossSpec {
            head_decay: 1.0,
            position_decay: None,
            step_decay: None,
            chunk_tokens: 4096,
        };
        let s = spec();
        let model: f64 = step_work(&s, &bucket, &loss, Precision::Bf16)
            .iter()
            .map(Work::model_flops)
            .sum();
        let family = super::super::cost::step_flops(&s, 10, 2).unwrap() as f64;
        let (q, r, h, v) = (64.0, 49.0, 64.0, 512.0);
        let attention_forward = 4.0 * 16.0 * 4.0 * (64.0 * 8.0);
        let p = s.parameter_count() as f64;
        let expected =
            family - 4.0 * (q - r) * h * v - 2.0 * 0.5 * attention_forward - 4.0 * q * v - 12.0 * p;
        assert!(
            (model - expected).abs() <= 1e-12 * expected,
            "{model} vs {expected}"
        );
    }
}
