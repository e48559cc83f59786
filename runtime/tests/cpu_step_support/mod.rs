//! Shared by the `cpu_step*` tests: small model plans, random batches and an independent f64 reference of the
//! whole drafter loss (written from the model's definition, sharing no code with the kernels).
#![allow(dead_code)]

use draftpipe_compiler::plan::{AdamWSpec, BucketPlan, LossSpec, LrSchedule, MlpSpec, ModelPlan};
use draftpipe_runtime::batch::HsBatch;
use rand::RngExt;
use rand::rngs::Xoshiro256PlusPlus;

/// A model plan with the canonical layout.
pub fn model(spec: MlpSpec) -> ModelPlan {
    ModelPlan::new(spec)
}

/// A bucket plan for `sequences × padded_len` (costs are not used by the step).
pub fn bucket(padded_len: usize, sequences: usize) -> BucketPlan {
    BucketPlan {
        padded_len,
        sequences,
        tokens: padded_len * sequences,
        step_flops: 0,
        step_bytes: 0,
    }
}

/// AdamW without weight decay or clipping.
pub fn adamw(lr: f32) -> AdamWSpec {
    AdamWSpec {
        lr,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
        clip_grad_norm: None,
        schedule: LrSchedule::CONSTANT,
    }
}

/// The loss configuration.
pub fn loss(head_decay: f32, chunk_tokens: usize) -> LossSpec {
    LossSpec {
        head_decay,
        position_decay: None,
        step_decay: None,
        chunk_tokens,
    }
}

/// A random batch: sequence lengths in `1..=padded_len` (one shorter sequence forced), random ids, a loss
/// mask with about 10% zeros, Gaussian-ish hidden states, zeros past each sequence's end.
pub fn random_batch(
    rng: &mut Xoshiro256PlusPlus,
    padded_len: usize,
    sequences: usize,
    din: usize,
    vocab: usize,
) -> HsBatch {
    let mut batch = HsBatch::zeroed(padded_len, sequences, din);
    for s in 0..sequences {
        let len = if s == 0 {
            padded_len.saturating_sub(2).max(1)
        } else {
            rng.random_range(1..=padded_len)
        };
        batch.seq_lens[s] = len as u32;
        for p in 0..len {
            let t = s * padded_len + p;
            batch.input_ids[t] = rng.random_range(0..vocab as u32);
            batch.loss_mask[t] = u8::from(rng.random_range(0..10) != 0);
            for d in 0..din {
                let value = rng.random_range(-1.0f32..1.0) + rng.random_range(-1.0f32..1.0);
                batch.hs.store_f32(t * din + d, &[value]);
            }
        }
    }
    batch
}

/// The label of head `j` at token `t`, from the model's definition.
pub fn reference_label(batch: &HsBatch, j: usize, t: usize) -> Option<usize> {
    let s = t / batch.padded_len;
    let p = t % batch.padded_len;
    let q = p + j + 1;
    let len = batch.seq_lens[s] as usize;
    let position = s * batch.padded_len + q;
    (q < len && batch.loss_mask[position] != 0).then(|| batch.input_ids[position] as usize)
}

fn matvec_t(w: &[f64], x: &[f64], out_dim: usize) -> Vec<f64> {
    let in_dim = x.len();
    (0..out_dim)
        .map(|o| (0..in_dim).map(|i| w[o * in_dim + i] * x[i]).sum())
        .collect()
}

fn rmsnorm(x: &[f64], w: &[f64]) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let r = 1.0 / (ms + 1e-6).sqrt();
    x.iter().zip(w).map(|(v, w)| v * r * w).collect()
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// The drafter loss in f64, token by token, straight from the model's definition; `params` in the flat layout.
pub fn reference_loss(spec: &MlpSpec, params: &[f64], batch: &HsBatch, head_decay: f64) -> f64 {
    let layout = spec.layout();
    let p = |name: &str| {
        let v = layout
            .iter()
            .find(|v| v.name == name)
            .expect("tensor in layout");
        &params[v.range()]
    };
    let MlpSpec {
        din,
        hidden: h,
        intermediate: i,
        blocks,
        heads,
        vocab,
        ..
    } = *spec;
    let mut sums = vec![0.0f64; heads];
    let mut counts = vec![0usize; heads];
    for t in 0..batch.tokens() {
        let hs: Vec<f64> = batch
            .hs
            .to_f32_vec(t * din..(t + 1) * din)
            .iter()
            .map(|&v| v as f64)
            .collect();
        let mut x = matvec_t(p("fc.weight"), &hs, h);
        for b in 0..blocks {
            let u = rmsnorm(&x, p(&format!("blocks.{b}.norm.weight")));
            let g = matvec_t(p(&format!("blocks.{b}.gate.weight")), &u, i);
            let up = matvec_t(p(&format!("blocks.{b}.up.weight")), &u, i);
            let act: Vec<f64> = g.iter().zip(&up).map(|(g, u)| silu(*g) * u).collect();
            let down = matvec_t(p(&format!("blocks.{b}.down.weight")), &act, h);
            x.iter_mut().zip(down).for_each(|(x, d)| *x += d);
        }
        let z = rmsnorm(&x, p("norm.weight"));
        for j in 0..heads {
            let Some(label) = reference_label(batch, j, t) else {
                continue;
            };
            let a = matvec_t(p(&format!("heads.{j}.weight")), &z, h);
            let hj: Vec<f64> = z.iter().zip(&a).map(|(z, a)| z + silu(*a)).collect();
            let logits = matvec_t(p("lm_head.weight"), &hj, vocab);
            let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = max + logits.iter().map(|l| (l - max).exp()).sum::<f64>().ln();
            sums[j] += lse - logits[label];
            counts[j] += 1;
        }
    }
    let weights: Vec<f64> = (0..heads).map(|j| head_decay.powi(j as i32)).collect();
    let total: f64 = weights.iter().sum();
    (0..heads)
        .filter(|&j| counts[j] > 0)
        .map(|j| weights[j] * sums[j] / counts[j] as f64)
        .sum::<f64>()
        / total
}
