//! Shared by the `dflash_*` tests: an independent f64 host reference of the whole DFlash loss, written from
//! SpecForge's definition (`modeling/draft/dflash.py`, `dflash_family_model.py`) with a dense mask and plain
//! loops, sharing no code with the kernels or the model; random batches; and central finite differences of it.
//!
//! Clarity over speed: every row, head and key is its own loop, the mask is the rule itself (a query of the
//! block at anchor `a` sees context positions `< a` of its sequence and every slot of its block), and only
//! present blocks exist (absent block slots of the step cannot change anything, which the comparison checks).
#![allow(dead_code)]

use std::collections::HashMap;

use draftpipe_runtime::batch::HsBatch;
use rand::RngExt;
use rand::rngs::Xoshiro256PlusPlus;

/// RMSNorm epsilon (Qwen3's `rms_norm_eps`).
pub const EPS: f64 = 1e-6;

/// The dimensions the reference needs.
#[derive(Debug, Clone, Copy)]
pub struct Dims {
    /// Drafter width `H` (the target's hidden).
    pub hidden: usize,
    /// Tapped layers `L` (fc input `L·H`).
    pub taps: usize,
    /// Vocabulary.
    pub vocab: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Head width.
    pub head_dim: usize,
    /// SwiGLU width.
    pub intermediate: usize,
    /// Slots per block.
    pub block: usize,
    /// Mask token id.
    pub mask_token: u32,
    /// RoPE base.
    pub rope_theta: f64,
    /// `γ` of the slot weights (not positive: all 1).
    pub position_decay: f64,
}

/// Named f64 tensors (the trained ones from the flat layout, plus the frozen `embed` and `lm_head`).
pub struct Weights<'a> {
    tensors: HashMap<String, &'a [f64]>,
}

impl<'a> Weights<'a> {
    /// Views of `flat` by the layout's `(name, offset, len)`, plus the frozen tensors.
    pub fn new(
        layout: impl IntoIterator<Item = (String, usize, usize)>,
        flat: &'a [f64],
        embed: &'a [f64],
        lm_head: &'a [f64],
    ) -> Self {
        let mut tensors: HashMap<String, &'a [f64]> = layout
            .into_iter()
            .map(|(name, offset, len)| (name, &flat[offset..offset + len]))
            .collect();
        tensors.insert("embed".into(), embed);
        tensors.insert("lm_head".into(), lm_head);
        Self { tensors }
    }

    fn get(&self, name: &str) -> &'a [f64] {
        self.tensors
            .get(name)
            .unwrap_or_else(|| panic!("reference: no tensor {name}"))
    }

    fn layer(&self, i: usize, name: &str) -> &'a [f64] {
        self.get(&format!("layers.{i}.{name}.weight"))
    }
}

/// What the reference computes for one batch.
#[derive(Debug, Clone)]
pub struct Reference {
    /// `Σ w·CE / Σ w`.
    pub loss: f64,
    /// Labelled rows per slot.
    pub slot_labels: Vec<u32>,
    /// Rows per slot whose argmax (lowest index on ties) is the label.
    pub slot_correct: Vec<u32>,
}

/// `y[r] = W x` for `W [out, in]` row-major.
fn linear(w: &[f64], x: &[f64], out: usize) -> Vec<f64> {
    let inn = x.len();
    assert_eq!(w.len(), out * inn);
    (0..out)
        .map(|o| (0..inn).map(|i| w[o * inn + i] * x[i]).sum())
        .collect()
}

fn rmsnorm(x: &[f64], w: &[f64]) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (ms + EPS).sqrt();
    x.iter().zip(w).map(|(v, g)| v * inv * g).collect()
}

/// HF `rotate_half` RoPE of one head at `position`.
fn rope(x: &mut [f64], position: usize, theta: f64) {
    let half = x.len() / 2;
    for j in 0..half {
        let inv_freq = theta.powf(-2.0 * j as f64 / x.len() as f64);
        let (sin, cos) = (position as f64 * inv_freq).sin_cos();
        let (a, b) = (x[j], x[j + half]);
        x[j] = a * cos - b * sin;
        x[j + half] = b * cos + a * sin;
    }
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// Per-head q/k: projection, per-head RMSNorm with `norm`, RoPE at `position`.
fn heads_of(
    w: &[f64],
    norm: &[f64],
    x: &[f64],
    heads: usize,
    hd: usize,
    position: usize,
    theta: f64,
) -> Vec<Vec<f64>> {
    let flat = linear(w, x, heads * hd);
    flat.chunks(hd)
        .map(|head| {
            let mut head = rmsnorm(head, norm);
            rope(&mut head, position, theta);
            head
        })
        .collect()
}

/// One block of the reference: its sequence, anchor and rows.
struct Block {
    sequence: usize,
    anchor: usize,
}

/// The whole DFlash loss of `batch` with the given present anchors per sequence (sorted), in f64.
pub fn reference(
    dims: &Dims,
    w: &Weights<'_>,
    batch: &HsBatch,
    anchors: &[Vec<usize>],
) -> Reference {
    let Dims {
        hidden: h,
        taps,
        vocab: v,
        layers,
        heads,
        kv_heads,
        head_dim: hd,
        intermediate: inter,
        block: b,
        ..
    } = *dims;
    let s = batch.padded_len;
    let theta = dims.rope_theta;
    // Context: RMSNorm(fc(hs)) per token.
    let context: Vec<Vec<f64>> = (0..batch.sequences * s)
        .map(|row| {
            let hs: Vec<f64> = batch.hs.as_f32().expect("an f32 batch")
                [row * taps * h..(row + 1) * taps * h]
                .iter()
                .map(|&x| f64::from(x))
                .collect();
            rmsnorm(
                &linear(w.get("fc.weight"), &hs, h),
                w.get("hidden_norm.weight"),
            )
        })
        .collect();
    let blocks: Vec<Block> = anchors
        .iter()
        .enumerate()
        .flat_map(|(sequence, list)| list.iter().map(move |&anchor| Block { sequence, anchor }))
        .collect();
    let embed = w.get("embed");
    // Block rows: slot 0 the anchor token, the rest the mask token, embedded.
    let mut x: Vec<Vec<f64>> = blocks
        .iter()
        .flat_map(|blk| {
            (0..b).map(move |k| {
                let id = if k == 0 {
                    batch.input_ids[blk.sequence * s + blk.anchor]
                } else {
                    dims.mask_token
                } as usize;
                embed[id * h..(id + 1) * h].to_vec()
            })
        })
        .collect();
    let group = heads / kv_heads;
    let scale = 1.0 / (hd as f64).sqrt();
    for layer in 0..layers {
        let (wq, wk, wv, wo) = (
            w.layer(layer, "self_attn.q_proj"),
            w.layer(layer, "self_attn.k_proj"),
            w.layer(layer, "self_attn.v_proj"),
            w.layer(layer, "self_attn.o_proj"),
        );
        let (q_norm, k_norm) = (
            w.layer(layer, "self_attn.q_norm"),
            w.layer(layer, "self_attn.k_norm"),
        );
        let normed: Vec<Vec<f64>> = x
            .iter()
            .map(|row| rmsnorm(row, w.layer(layer, "input_layernorm")))
            .collect();
        // Context K/V: this layer's projections of the context rows, not re-normalised by input_layernorm.
        let ctx_k: Vec<Vec<Vec<f64>>> = context
            .iter()
            .enumerate()
            .map(|(row, c)| heads_of(wk, k_norm, c, kv_heads, hd, row % s, theta))
            .collect();
        let ctx_v: Vec<Vec<f64>> = context
            .iter()
            .map(|c| linear(wv, c, kv_heads * hd))
            .collect();
        let position = |row: usize| blocks[row / b].anchor + row % b;
        let blk_q: Vec<Vec<Vec<f64>>> = normed
            .iter()
            .enumerate()
            .map(|(row, n)| heads_of(wq, q_norm, n, heads, hd, position(row), theta))
            .collect();
        let blk_k: Vec<Vec<Vec<f64>>> = normed
            .iter()
            .enumerate()
            .map(|(row, n)| heads_of(wk, k_norm, n, kv_heads, hd, position(row), theta))
            .collect();
        let blk_v: Vec<Vec<f64>> = normed
            .iter()
            .map(|n| linear(wv, n, kv_heads * hd))
            .collect();
        for row in 0..x.len() {
            let blk = &blocks[row / b];
            let mut attn = vec![0.0; heads * hd];
            for head in 0..heads {
                let kvh = head / group;
                let q = &blk_q[row][head];
                // Keys: the sequence's context before the anchor, then the block's own rows.
                let mut keys: Vec<(&[f64], &[f64])> = (0..blk.anchor)
                    .map(|p| {
                        let c = blk.sequence * s + p;
                        (&ctx_k[c][kvh][..], &ctx_v[c][kvh * hd..(kvh + 1) * hd])
                    })
                    .collect();
                let first = row - row % b;
                keys.extend(
                    (first..first + b)
                        .map(|r| (&blk_k[r][kvh][..], &blk_v[r][kvh * hd..(kvh + 1) * hd])),
                );
                let scores: Vec<f64> = keys
                    .iter()
                    .map(|(k, _)| q.iter().zip(*k).map(|(a, c)| a * c).sum::<f64>() * scale)
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let total: f64 = scores.iter().map(|sc| (sc - max).exp()).sum();
                for ((_, val), sc) in keys.iter().zip(&scores) {
                    let p = (sc - max).exp() / total;
                    for d in 0..hd {
                        attn[head * hd + d] += p * val[d];
                    }
                }
            }
            let o = linear(wo, &attn, h);
            for (xi, oi) in x[row].iter_mut().zip(o) {
                *xi += oi;
            }
            let n2 = rmsnorm(&x[row], w.layer(layer, "post_attention_layernorm"));
            let gate = linear(w.layer(layer, "mlp.gate_proj"), &n2, inter);
            let up = linear(w.layer(layer, "mlp.up_proj"), &n2, inter);
            let act: Vec<f64> = gate.iter().zip(&up).map(|(g, u)| silu(*g) * u).collect();
            let down = linear(w.layer(layer, "mlp.down_proj"), &act, h);
            for (xi, di) in x[row].iter_mut().zip(down) {
                *xi += di;
            }
        }
    }
    // Final norm, frozen lm_head, weighted CE over slots k ≥ 1 with a supervised label inside the length.
    let lm = w.get("lm_head");
    let (mut num, mut den) = (0.0, 0.0);
    let mut slot_labels = vec![0u32; b];
    let mut slot_correct = vec![0u32; b];
    for (row, xr) in x.iter().enumerate() {
        let blk = &blocks[row / b];
        let k = row % b;
        let target = blk.anchor + k;
        let len = batch.seq_lens[blk.sequence] as usize;
        let flat = blk.sequence * s + target;
        if k == 0 || target >= len || batch.loss_mask[flat] == 0 {
            continue;
        }
        let label = batch.input_ids[flat] as usize;
        let z = rmsnorm(xr, w.get("norm.weight"));
        let logits: Vec<f64> = (0..v)
            .map(|t| (0..h).map(|i| lm[t * h + i] * z[i]).sum())
            .collect();
        let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = max + logits.iter().map(|l| (l - max).exp()).sum::<f64>().ln();
        let weight = if dims.position_decay > 0.0 {
            (-((k - 1) as f64) / dims.position_decay).exp()
        } else {
            1.0
        };
        num += weight * (lse - logits[label]);
        den += weight;
        slot_labels[k] += 1;
        let argmax = (0..v).fold(0, |best, t| if logits[t] > logits[best] { t } else { best });
        slot_correct[k] += u32::from(argmax == label);
    }
    Reference {
        loss: if den > 0.0 { num / den } else { 0.0 },
        slot_labels,
        slot_correct,
    }
}

/// Central finite differences `(L(p + h) − L(p − h)) / 2h` of `loss` at `params` for each index in `at`.
pub fn finite_differences(
    params: &[f64],
    at: &[usize],
    step: f64,
    mut loss: impl FnMut(&[f64]) -> f64,
) -> Vec<f64> {
    let mut p = params.to_vec();
    at.iter()
        .map(|&i| {
            let orig = p[i];
            p[i] = orig + step;
            let plus = loss(&p);
            p[i] = orig - step;
            let minus = loss(&p);
            p[i] = orig;
            (plus - minus) / (2.0 * step)
        })
        .collect()
}

/// A random DFlash batch: lengths in `padded_len/2..=padded_len`, random ids below `vocab − 1` (the last id
/// is the mask token), a loss mask with a masked prompt of 1–3 tokens and about 10% holes after it, hidden
/// states uniform in ±1, zeros past each sequence's end.
pub fn random_batch(
    rng: &mut Xoshiro256PlusPlus,
    padded_len: usize,
    sequences: usize,
    din: usize,
    vocab: usize,
) -> HsBatch {
    let mut batch = HsBatch::zeroed(padded_len, sequences, din);
    for seq in 0..sequences {
        let len = rng.random_range(padded_len / 2..=padded_len);
        batch.seq_lens[seq] = len as u32;
        let prompt = rng.random_range(1..=3);
        for p in 0..len {
            let row = seq * padded_len + p;
            batch.input_ids[row] = rng.random_range(0..vocab as u32 - 1);
            batch.loss_mask[row] = u8::from(p >= prompt && rng.random_bool(0.9));
            for x in &mut batch.hs.as_f32_mut().expect("an f32 batch")[row * din..(row + 1) * din] {
                *x = rng.random_range(-1.0..1.0);
            }
        }
    }
    batch
}

/// Uniform values in `±scale`.
pub fn uniform(rng: &mut Xoshiro256PlusPlus, len: usize, scale: f64) -> Vec<f64> {
    (0..len).map(|_| rng.random_range(-scale..scale)).collect()
}
