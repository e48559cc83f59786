//! Shared by the `eagle3_*` tests: an independent f64 host reference of the whole EAGLE-3 loss, written from
//! SpecForge's offline path (`modeling/draft/llama3_eagle.py`, `algorithms/eagle3/model.py`, `core/loss.py`)
//! with plain loops over sequences, rows, heads and keys, sharing no code with the kernels or the model; random
//! batches with `last_hidden_states`; and a draft vocabulary.
//!
//! Clarity over speed: the shifts are index arithmetic on each sequence, the attention's keys are listed as the
//! rule says (step 0's keys `t' ≤ t`, then one key per cached step at `t`), and every softmax is its own loop.
#![allow(dead_code)]

use std::collections::HashMap;

use draftpipe_runtime::batch::HsBatch;
use rand::RngExt;
use rand::rngs::Xoshiro256PlusPlus;

/// The dimensions the reference needs.
#[derive(Debug, Clone, Copy)]
pub struct Dims {
    /// Width `H` (the target's hidden).
    pub hidden: usize,
    /// Target vocabulary.
    pub vocab: usize,
    /// Draft vocabulary.
    pub draft_vocab: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Head width.
    pub head_dim: usize,
    /// TTT steps.
    pub ttt: usize,
    /// RoPE base.
    pub rope_theta: f64,
    /// RMSNorm epsilon.
    pub eps: f64,
    /// TTT step weight base.
    pub step_decay: f64,
}

/// Named f64 tensors: the trained ones by layout name, and the frozen `embed`, `target_lm_head`.
pub struct Weights<'a> {
    tensors: HashMap<String, &'a [f64]>,
}

impl<'a> Weights<'a> {
    /// Views of `flat` by the layout's `(name, offset, len)`, plus the frozen tables.
    pub fn new(
        layout: impl IntoIterator<Item = (String, usize, usize)>,
        flat: &'a [f64],
        embed: &'a [f64],
        target_lm_head: &'a [f64],
    ) -> Self {
        let mut tensors: HashMap<String, &'a [f64]> = layout
            .into_iter()
            .map(|(name, offset, len)| (name, &flat[offset..offset + len]))
            .collect();
        tensors.insert("embed".into(), embed);
        tensors.insert("target_lm_head".into(), target_lm_head);
        Self { tensors }
    }

    fn get(&self, name: &str) -> &'a [f64] {
        self.tensors
            .get(name)
            .unwrap_or_else(|| panic!("reference: no tensor {name}"))
    }
}

/// The draft vocabulary: draft token `d` is target token `d + d2t[d]`; `t2d[v]` whether `v` is one.
#[derive(Debug, Clone)]
pub struct VocabMap {
    /// Offsets, `[draft_vocab]`.
    pub d2t: Vec<i64>,
    /// Membership, `[vocab]`.
    pub t2d: Vec<bool>,
}

impl VocabMap {
    /// The draft vocabulary of the target tokens `tokens` (sorted ascending, as SpecForge's map is).
    pub fn of(tokens: &[usize], vocab: usize) -> Self {
        let mut t2d = vec![false; vocab];
        for &t in tokens {
            t2d[t] = true;
        }
        Self {
            d2t: tokens
                .iter()
                .enumerate()
                .map(|(d, &t)| t as i64 - d as i64)
                .collect(),
            t2d,
        }
    }
}

/// What the reference computes for one batch.
#[derive(Debug, Clone)]
pub struct Reference {
    /// `Σ_k decay^k · loss_k`.
    pub loss: f64,
    /// `loss_k = Σ_rows w·CE / (N·S)` of each step (unweighted by the decay).
    pub step_loss: Vec<f64>,
    /// Rows per step where the draft's argmax is the teacher's, among the supervised ones.
    pub correct: Vec<u32>,
    /// Rows per step whose shifted loss mask is set.
    pub supervised: Vec<u32>,
}

/// `y = W x` for `W [out, in]` row-major.
fn linear(w: &[f64], x: &[f64], out: usize) -> Vec<f64> {
    let inn = x.len();
    assert_eq!(w.len(), out * inn, "linear: shapes");
    (0..out)
        .map(|o| (0..inn).map(|i| w[o * inn + i] * x[i]).sum())
        .collect()
}

fn rmsnorm(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (ms + eps).sqrt();
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

/// The first index of the largest value (`torch.argmax`).
fn argmax(x: &[f64]) -> usize {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best
}

fn log_softmax(x: &[f64]) -> Vec<f64> {
    let max = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let lse = max + x.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
    x.iter().map(|v| v - lse).collect()
}

/// Splits `x` into `heads` rows of `hd` and rotates each at `position`.
fn rotated(x: Vec<f64>, hd: usize, position: usize, theta: f64) -> Vec<Vec<f64>> {
    x.chunks(hd)
        .map(|head| {
            let mut head = head.to_vec();
            rope(&mut head, position, theta);
            head
        })
        .collect()
}

/// The whole EAGLE-3 loss of `batch` in f64.
pub fn reference(d: &Dims, w: &Weights<'_>, vocab_map: &VocabMap, batch: &HsBatch) -> Reference {
    let (h, s_len, n_seq) = (d.hidden, batch.padded_len, batch.sequences);
    let (heads, kvh, hd) = (d.heads, d.kv_heads, d.head_dim);
    let group = heads / kvh;
    let hs = batch.hs.to_f32_vec(0..batch.hs.len());
    let last = batch
        .last_hidden_states
        .as_ref()
        .expect("an eagle3 batch has last_hidden_states");
    let last = last.to_f32_vec(0..last.len());
    let (embed, target_head) = (w.get("embed"), w.get("target_lm_head"));
    let draft_head = w.get("lm_head.weight");
    let scale = 1.0 / (hd as f64).sqrt();
    let mut out = Reference {
        loss: 0.0,
        step_loss: vec![0.0; d.ttt],
        correct: vec![0; d.ttt],
        supervised: vec![0; d.ttt],
    };
    for n in 0..n_seq {
        let row = |t: usize| n * s_len + t;
        // Shifted once: the id and the teacher at t are those of t + 1 (zeros past the sequence).
        let ids: Vec<usize> = (0..s_len)
            .map(|t| {
                if t + 1 < s_len {
                    batch.input_ids[row(t + 1)] as usize
                } else {
                    0
                }
            })
            .collect();
        let teacher_hs: Vec<Vec<f64>> = (0..s_len)
            .map(|t| {
                if t + 1 < s_len {
                    last[row(t + 1) * h..(row(t + 1) + 1) * h]
                        .iter()
                        .map(|&x| f64::from(x))
                        .collect()
                } else {
                    vec![0.0; h]
                }
            })
            .collect();
        // The teacher: full-vocabulary logits (argmax in the draft vocabulary?) and the draft-vocabulary ones.
        let valid: Vec<bool> = (0..s_len)
            .map(|t| {
                let full = linear(target_head, &teacher_hs[t], d.vocab);
                batch.loss_mask[row(t)] != 0 && vocab_map.t2d[argmax(&full)]
            })
            .collect();
        let teacher_logits: Vec<Vec<f64>> = teacher_hs
            .iter()
            .map(|x| {
                (0..d.draft_vocab)
                    .map(|dv| {
                        let target = (dv as i64 + vocab_map.d2t[dv]) as usize;
                        (0..h).map(|c| target_head[target * h + c] * x[c]).sum()
                    })
                    .collect()
            })
            .collect();
        let mut hk: Vec<Vec<f64>> = (0..s_len)
            .map(|t| {
                let x: Vec<f64> = hs[row(t) * 3 * h..(row(t) + 1) * 3 * h]
                    .iter()
                    .map(|&v| f64::from(v))
                    .collect();
                linear(w.get("fc.weight"), &x, h)
            })
            .collect();
        // keys[j][t][kv head], values likewise: every step's, RoPE'd at t + j.
        let mut keys: Vec<Vec<Vec<Vec<f64>>>> = Vec::new();
        let mut values: Vec<Vec<Vec<Vec<f64>>>> = Vec::new();
        for k in 0..d.ttt {
            let mut queries = Vec::new();
            let (mut step_keys, mut step_values) = (Vec::new(), Vec::new());
            for t in 0..s_len {
                let id = if t + k < s_len { ids[t + k] } else { 0 };
                let e = &embed[id * h..(id + 1) * h];
                let mut c = rmsnorm(e, w.get("midlayer.input_layernorm.weight"), d.eps);
                c.extend(rmsnorm(&hk[t], w.get("midlayer.hidden_norm.weight"), d.eps));
                let q = linear(w.get("midlayer.self_attn.q_proj.weight"), &c, heads * hd);
                let kk = linear(w.get("midlayer.self_attn.k_proj.weight"), &c, kvh * hd);
                let v = linear(w.get("midlayer.self_attn.v_proj.weight"), &c, kvh * hd);
                queries.push(rotated(q, hd, t + k, d.rope_theta));
                step_keys.push(rotated(kk, hd, t + k, d.rope_theta));
                step_values.push(v.chunks(hd).map(<[f64]>::to_vec).collect::<Vec<_>>());
            }
            keys.push(step_keys);
            values.push(step_values);
            let mut next = Vec::with_capacity(s_len);
            for t in 0..s_len {
                let mut attn = Vec::with_capacity(heads * hd);
                for (head, query) in queries[t].iter().enumerate() {
                    let g = head / group;
                    // Step 0's keys up to t (causal), then one per cached step at t (diagonal).
                    let mut seen: Vec<(&[f64], &[f64])> = (0..=t)
                        .map(|u| (keys[0][u][g].as_slice(), values[0][u][g].as_slice()))
                        .collect();
                    for j in 1..=k {
                        seen.push((keys[j][t][g].as_slice(), values[j][t][g].as_slice()));
                    }
                    let scores: Vec<f64> = seen
                        .iter()
                        .map(|(key, _)| {
                            scale * query.iter().zip(*key).map(|(a, b)| a * b).sum::<f64>()
                        })
                        .collect();
                    let logp = log_softmax(&scores);
                    for c in 0..hd {
                        attn.push(
                            seen.iter()
                                .zip(&logp)
                                .map(|((_, v), lp)| lp.exp() * v[c])
                                .sum(),
                        );
                    }
                }
                let o = linear(w.get("midlayer.self_attn.o_proj.weight"), &attn, h);
                let m: Vec<f64> = hk[t].iter().zip(&o).map(|(a, b)| a + b).collect();
                let n2 = rmsnorm(&m, w.get("midlayer.post_attention_layernorm.weight"), d.eps);
                let inter = w.get("midlayer.mlp.gate_proj.weight").len() / h;
                let gate = linear(w.get("midlayer.mlp.gate_proj.weight"), &n2, inter);
                let up = linear(w.get("midlayer.mlp.up_proj.weight"), &n2, inter);
                let act: Vec<f64> = gate.iter().zip(&up).map(|(g, u)| silu(*g) * u).collect();
                let down = linear(w.get("midlayer.mlp.down_proj.weight"), &act, h);
                let hout: Vec<f64> = m.iter().zip(&down).map(|(a, b)| a + b).collect();
                // The loss of row t at step k: teacher and mask at t + k.
                let z = rmsnorm(&hout, w.get("norm.weight"), d.eps);
                let logits = linear(draft_head, &z, d.draft_vocab);
                if t + k < s_len {
                    out.supervised[k] += u32::from(batch.loss_mask[row(t + k)] != 0);
                    if valid[t + k] {
                        let p = log_softmax(&teacher_logits[t + k]);
                        let logq = log_softmax(&logits);
                        let ce: f64 = -p
                            .iter()
                            .zip(&logq)
                            .map(|(lp, lq)| lp.exp() * lq)
                            .sum::<f64>();
                        out.step_loss[k] += ce;
                        out.correct[k] +=
                            u32::from(argmax(&logits) == argmax(&teacher_logits[t + k]));
                    }
                }
                next.push(hout);
            }
            hk = next;
        }
    }
    let rows = (n_seq * s_len) as f64;
    let mut decay = 1.0;
    for loss in &mut out.step_loss {
        *loss /= rows;
        out.loss += decay * *loss;
        decay *= d.step_decay;
    }
    out
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

/// `len` values uniform in `±scale`.
pub fn uniform(rng: &mut Xoshiro256PlusPlus, len: usize, scale: f64) -> Vec<f64> {
    (0..len).map(|_| rng.random_range(-scale..scale)).collect()
}

/// A random EAGLE-3 batch: lengths in `padded_len/2..=padded_len`, random ids, a loss mask with a masked prompt
/// of 1–2 tokens and about 10% holes after it, hidden states and last hidden states uniform in ±1, zeros past
/// each sequence's end.
pub fn random_batch(
    rng: &mut Xoshiro256PlusPlus,
    (padded_len, sequences): (usize, usize),
    hidden: usize,
    vocab: usize,
) -> HsBatch {
    let mut batch =
        HsBatch::zeroed(padded_len, sequences, 3 * hidden).with_last_hidden_states(hidden);
    for seq in 0..sequences {
        let len = rng.random_range(padded_len / 2..=padded_len);
        batch.seq_lens[seq] = len as u32;
        let prompt = rng.random_range(1..=2);
        for p in 0..len {
            let row = seq * padded_len + p;
            batch.input_ids[row] = rng.random_range(0..vocab as u32);
            batch.loss_mask[row] = u8::from(p >= prompt && rng.random_bool(0.9));
            let hs: Vec<f32> = (0..3 * hidden)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            batch.hs.store_f32(row * 3 * hidden, &hs);
            let last: Vec<f32> = (0..hidden).map(|_| rng.random_range(-1.0..1.0)).collect();
            batch
                .last_hidden_states
                .as_mut()
                .expect("last hidden states")
                .store_f32(row * hidden, &last);
        }
    }
    batch
}
