//! A frozen, seeded synthetic target: a token stream with learnable structure and hidden states that carry
//! information about the next tokens, so a drafter trained on it really learns.
//!
//! ```text
//!  seed ──▶ SyntheticTarget (frozen: Markov chain, embeddings, per-layer mixing) ──shared──▶ SyntheticSource × W
//!  SyntheticSource: position p ──seeded RNG──▶ bucket, lengths, tokens, hidden states ──▶ HsBatch
//! ```
//!
//! **Tokens.** A sparse Markov chain over `vocab` tokens: each token has [`SUCCESSORS`] fixed successors, taken
//! with probabilities 0.70, 0.15, 0.08, 0.04; the remaining 0.03 goes to a uniformly random token. A sequence
//! starts at a uniformly random token.
//!
//! **Hidden states.** For token `x_t` the target combines four embeddings: of `x_t`, of its most likely
//! successor `s(x_t)`, of `s(s(x_t))`, and of the previous token `x_{t-1}`. Tap layer `l` of `L` weighs them
//! like a language model's depth does: early layers mostly the current token, late layers mostly the predicted
//! next tokens. Each layer then permutes and sign-flips the features (its fixed random mixing) and adds uniform
//! noise of standard deviation [`NOISE_STD`]. Embeddings come from a seeded table of at most
//! [`MAX_BASIS_ELEMENTS`] floats: one row per token when it fits, else the normalised sum of two rows picked by
//! hashing the token, so huge vocabularies cost bounded memory.
//!
//! **Frozen embedding and `lm_head`** (what a `dflash` drafter reads from a target): the embedding of token `x`
//! is the same `embedding(x)` the hidden states are built from, and the `lm_head` row of `x` is
//! `embedding(x) / √hidden`. So the target's hidden states carry, in its own embedding space, the next tokens'
//! embeddings, and a drafter that recovers `embedding(next)` from them scores `next` highest through the
//! `lm_head`: the scale makes the logits of an unaligned, RMS-normalised vector about unit variance, as a
//! trained head's are, and those of an aligned one about `√hidden` above the rest.
//!
//! **Final hidden state** (`last_hidden_states`, what an `eagle3` drafter's teacher reads: the final-norm
//! output the target's `lm_head` consumes). For token `x_t` it is `Σ_k c_k · embedding(s_k(x_t))` over the
//! chain's successors, with `c_k = ln(p_k / p_rest) / √hidden` (`p_k` the successor's probability, `p_rest` that
//! of any one other token). Through the `lm_head` above, successor `k` then scores about `ln(p_k / p_rest)` above
//! an unrelated token, so the softmax of the target's own logits approximates the chain's next-token
//! distribution. Cross terms of the random embeddings blur it: at the quickstart's size (hidden 64, vocabulary
//! 512) the argmax is one of the four successors for at least 95% of tokens and the likeliest one for about
//! 60% (`runtime/tests/source_last_hidden.rs`). The teacher is a fixed function of the token, which a drafter
//! learns. It uses no randomness, so the token and hidden-state streams are the same with or without it, and it
//! is computed only when the plan's drafter reads it.
//!
//! **Batches.** The batch at global position `p` is a pure function of `(seed, p)`: its RNG is seeded from both.
//! Its bucket is drawn with probability proportional to `P(length in bucket) / sequences per item`, the rate at
//! which a stream of uniformly distributed lengths routed to buckets would complete items; its sequence
//! lengths are then uniform over the bucket's share of `min_len..max_len`, so every sequence's length is
//! uniform over `min_len..max_len`, as the plan says.

use std::ops::Range;
use std::sync::Arc;

use super::{BucketShapes, HsSource, SourceError, check_owned};
use crate::batch::HsBatch;

/// Successors per token in the Markov chain.
pub const SUCCESSORS: usize = 4;

/// Cumulative probabilities of the successors; the rest is a uniformly random token.
const SUCCESSOR_CDF: [f64; SUCCESSORS] = [0.70, 0.85, 0.93, 0.97];

/// Standard deviation of the noise added to every hidden-state element.
pub const NOISE_STD: f32 = 0.05;

/// Most floats the embedding table may hold (16 MiB).
pub const MAX_BASIS_ELEMENTS: usize = 1 << 22;

/// Salts that keep the target's tables and the batch streams on unrelated RNG streams.
const TABLE_SALT: u64 = 0x7A3B_E1D4_0000_0001;
const BATCH_SALT: u64 = 0x5EED_BA7C_0000_0002;
const HASH_SALT: u64 = 0x0C0F_FEE0_0000_0003;

/// The splitmix64 finaliser: a bijective hash with full avalanche.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Hash of two words (order matters).
fn hash2(a: u64, b: u64) -> u64 {
    mix64(mix64(a).wrapping_add(b).wrapping_add(0x9E37_79B9_7F4A_7C15))
}

/// SplitMix64: tiny, fast and fully specified here, so streams stay identical across dependency upgrades (a
/// resumed run must regenerate exactly the batches it would have seen).
#[derive(Debug, Clone)]
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix64(self.0)
    }

    /// Uniform in `[0, 1)` with 53 bits.
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `0..n` (`n > 0`) by the multiply-high method; its bias is at most `n / 2⁶⁴`.
    fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }

    /// Uniform with zero mean and standard deviation `std`.
    fn centered(&mut self, std: f32) -> f32 {
        ((self.unit() * 2.0 - 1.0) as f32) * std * 3f32.sqrt()
    }
}

/// The frozen target: chain, embeddings and per-layer mixing. Built once per run and shared by all producers.
#[derive(Debug)]
pub struct SyntheticTarget {
    seed: u64,
    vocab: usize,
    hidden: usize,
    taps: usize,
    successors: Vec<u32>,
    basis: Vec<f32>,
    basis_rows: usize,
    /// Per layer: weights of (current, next, next-but-one, previous) embeddings.
    layer_weights: Vec<[f32; 4]>,
    /// Per layer, `hidden` source indices.
    layer_perm: Vec<u32>,
    /// Per layer, `hidden` signs.
    layer_sign: Vec<f32>,
    /// Weight of each successor's embedding in the final hidden state (module docs).
    last_weights: [f32; SUCCESSORS],
}

impl SyntheticTarget {
    /// Builds the target for `vocab` tokens, hidden size `hidden` and `taps` tapped layers from `seed`.
    pub fn new(seed: u64, vocab: usize, hidden: usize, taps: usize) -> Result<Self, SourceError> {
        if vocab < 2 || vocab > u32::MAX as usize || hidden == 0 || taps == 0 {
            return Err(SourceError::Config(format!(
                "synthetic target needs 2 ≤ vocab < 2³², hidden ≥ 1, ≥ 1 tap layer (got vocab {vocab}, hidden \
                 {hidden}, {taps} taps)"
            )));
        }
        let mut rng = SplitMix64(hash2(seed, TABLE_SALT));
        let successors = (0..vocab * SUCCESSORS)
            .map(|_| rng.below(vocab) as u32)
            .collect();
        let basis_rows = if vocab * hidden <= MAX_BASIS_ELEMENTS {
            vocab
        } else {
            (MAX_BASIS_ELEMENTS / hidden).max(2)
        };
        let basis = (0..basis_rows * hidden)
            .map(|_| rng.centered(1.0))
            .collect();
        let layer_weights = (0..taps)
            .map(|l| {
                let depth = (l + 1) as f32 / taps as f32;
                [
                    1.0 - 0.5 * depth,
                    1.5 * depth,
                    0.75 * depth,
                    0.1 + 0.4 * (1.0 - depth),
                ]
            })
            .collect();
        let mut layer_perm = Vec::with_capacity(taps * hidden);
        let mut layer_sign = Vec::with_capacity(taps * hidden);
        for _ in 0..taps {
            let mut perm: Vec<u32> = (0..hidden as u32).collect();
            for i in (1..hidden).rev() {
                perm.swap(i, rng.below(i + 1));
            }
            layer_perm.extend(perm);
            layer_sign
                .extend((0..hidden).map(|_| if rng.next_u64() & 1 == 0 { 1.0 } else { -1.0 }));
        }
        let rest = (1.0 - SUCCESSOR_CDF[SUCCESSORS - 1]) / vocab as f64;
        let mut last_weights = [0.0; SUCCESSORS];
        let mut previous = 0.0;
        for (weight, &cumulative) in last_weights.iter_mut().zip(&SUCCESSOR_CDF) {
            *weight = ((cumulative - previous) / rest).ln() as f32 / (hidden as f32).sqrt();
            previous = cumulative;
        }
        Ok(Self {
            seed,
            vocab,
            hidden,
            taps,
            successors,
            basis,
            basis_rows,
            layer_weights,
            layer_perm,
            layer_sign,
            last_weights,
        })
    }

    /// Vocabulary size.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Width of one token's hidden state: `hidden × taps`.
    pub fn din(&self) -> usize {
        self.hidden * self.taps
    }

    /// Hidden size of one tapped layer.
    pub fn hidden(&self) -> usize {
        self.hidden
    }

    /// The frozen embedding table, `[vocab, hidden]` row-major: row `x` is `embedding(x)` (module docs).
    pub fn embedding_table(&self) -> Vec<f32> {
        let mut table = vec![0.0; self.vocab * self.hidden];
        for (token, row) in table.chunks_exact_mut(self.hidden).enumerate() {
            self.add_embedding(token as u32, 1.0, row);
        }
        table
    }

    /// The frozen `lm_head`, `[vocab, hidden]` row-major: row `x` is `embedding(x) / √hidden` (module docs).
    pub fn lm_head_table(&self) -> Vec<f32> {
        let mut table = vec![0.0; self.vocab * self.hidden];
        let scale = 1.0 / (self.hidden as f32).sqrt();
        for (token, row) in table.chunks_exact_mut(self.hidden).enumerate() {
            self.add_embedding(token as u32, scale, row);
        }
        table
    }

    /// Writes the final hidden state after `current` (`hidden` floats, module docs) into `out`.
    pub fn last_hidden_state(&self, current: u32, out: &mut [f32]) {
        out.fill(0.0);
        for (k, &weight) in self.last_weights.iter().enumerate() {
            self.add_embedding(self.successor(current, k), weight, out);
        }
    }

    /// The chain's `k`-th successor of `token` (`k < SUCCESSORS`; `k = 0` is the most likely).
    pub fn successor(&self, token: u32, k: usize) -> u32 {
        self.successors[token as usize * SUCCESSORS + k]
    }

    /// Probability that the chain moves from `from` to `to`.
    pub fn transition_probability(&self, from: u32, to: u32) -> f64 {
        let mut p = (1.0 - SUCCESSOR_CDF[SUCCESSORS - 1]) / self.vocab as f64;
        let mut previous = 0.0;
        for (k, &cumulative) in SUCCESSOR_CDF.iter().enumerate() {
            if self.successor(from, k) == to {
                p += cumulative - previous;
            }
            previous = cumulative;
        }
        p
    }

    fn sample_next(&self, token: u32, rng: &mut SplitMix64) -> u32 {
        let u = rng.unit();
        match SUCCESSOR_CDF.iter().position(|&c| u < c) {
            Some(k) => self.successor(token, k),
            None => rng.below(self.vocab) as u32,
        }
    }

    /// Adds `weight × embedding(token)` to `out` (`hidden` floats).
    fn add_embedding(&self, token: u32, weight: f32, out: &mut [f32]) {
        let h = self.hidden;
        if self.basis_rows == self.vocab {
            let row = &self.basis[token as usize * h..][..h];
            out.iter_mut().zip(row).for_each(|(o, b)| *o += weight * b);
        } else {
            let hashed = hash2(self.seed ^ HASH_SALT, u64::from(token));
            let first = &self.basis[(token as usize % self.basis_rows) * h..][..h];
            let second = &self.basis[(hashed as usize % self.basis_rows) * h..][..h];
            let w1 = weight * std::f32::consts::FRAC_1_SQRT_2;
            let w2 = if hashed >> 63 == 0 { w1 } else { -w1 };
            for ((o, a), b) in out.iter_mut().zip(first).zip(second) {
                *o += w1 * a + w2 * b;
            }
        }
    }

    /// Writes the hidden state (`din` floats) of `current` preceded by `previous` into `out`, using
    /// `components` (`4 × hidden` floats) as scratch and `rng` for the noise.
    fn hidden_state(
        &self,
        previous: Option<u32>,
        current: u32,
        components: &mut [f32],
        out: &mut [f32],
        rng: &mut SplitMix64,
    ) {
        let h = self.hidden;
        components.fill(0.0);
        let next = self.successor(current, 0);
        let (cur, rest) = components.split_at_mut(h);
        let (nxt, rest) = rest.split_at_mut(h);
        let (nxt2, prev) = rest.split_at_mut(h);
        self.add_embedding(current, 1.0, cur);
        self.add_embedding(next, 1.0, nxt);
        self.add_embedding(self.successor(next, 0), 1.0, nxt2);
        if let Some(p) = previous {
            self.add_embedding(p, 1.0, prev);
        }
        for (l, layer_out) in out.chunks_exact_mut(h).enumerate() {
            let [wc, wn, wn2, wp] = self.layer_weights[l];
            let perm = &self.layer_perm[l * h..][..h];
            let sign = &self.layer_sign[l * h..][..h];
            for ((o, &j), &s) in layer_out.iter_mut().zip(perm).zip(sign) {
                let j = j as usize;
                let mixed = wc * cur[j] + wn * nxt[j] + wn2 * nxt2[j] + wp * prev[j];
                *o = s * mixed + rng.centered(NOISE_STD);
            }
        }
    }
}

/// One producer's stream of synthetic batches.
#[derive(Debug)]
pub struct SyntheticSource {
    target: Arc<SyntheticTarget>,
    shapes: BucketShapes,
    /// Cumulative probability of each bucket per batch.
    bucket_cdf: Vec<f64>,
    /// The lengths each bucket receives.
    bucket_lengths: Vec<Range<usize>>,
    /// The last bucket that receives lengths.
    last_bucket: usize,
    producer: usize,
    producers: usize,
    next: u64,
    components: Vec<f32>,
    /// One token's hidden state in f32, before it is stored in the batch's precision.
    row: Vec<f32>,
    /// One token's final hidden state in f32, when the batches carry them.
    last_row: Vec<f32>,
}

impl SyntheticSource {
    /// Producer `producer` of `producers`, sequence lengths uniform in `lengths` (half-open), starting at the
    /// producer's first position (`producer`).
    pub fn new(
        target: Arc<SyntheticTarget>,
        shapes: &BucketShapes,
        lengths: Range<usize>,
        producer: usize,
        producers: usize,
    ) -> Result<Self, SourceError> {
        let config = |m: String| Err(SourceError::Config(m));
        if producer >= producers {
            return config(format!(
                "producer index {producer} not below the producer count {producers}"
            ));
        }
        if lengths.start == 0 || lengths.is_empty() {
            return config(format!(
                "sequence lengths {lengths:?} must be a non-empty range of positive lengths"
            ));
        }
        if shapes.din != target.din() {
            return config(format!(
                "plan hidden-state width {} ≠ target width {}",
                shapes.din,
                target.din()
            ));
        }
        let longest = lengths.end - 1;
        if shapes.bucket_for_len(longest).is_none() {
            return config(format!(
                "sequence length {longest} exceeds the largest bucket"
            ));
        }
        let mut bucket_lengths = Vec::with_capacity(shapes.buckets.len());
        let mut rates = Vec::with_capacity(shapes.buckets.len());
        let mut lower = 0;
        for &(padded_len, sequences) in &shapes.buckets {
            let share = lengths.start.max(lower + 1)..lengths.end.min(padded_len + 1);
            let count = share.len();
            if count > 0 && sequences == 0 {
                return config(format!(
                    "bucket {padded_len} receives sequences but holds none per item"
                ));
            }
            rates.push(if count == 0 {
                0.0
            } else {
                count as f64 / sequences as f64
            });
            bucket_lengths.push(share);
            lower = padded_len;
        }
        let total: f64 = rates.iter().sum();
        let mut cumulative = 0.0;
        let bucket_cdf = rates
            .iter()
            .map(|r| {
                cumulative += r / total;
                cumulative
            })
            .collect();
        let last_bucket = bucket_lengths
            .iter()
            .rposition(|share| !share.is_empty())
            .expect("the longest length fits");
        let components = vec![0.0; 4 * target.hidden];
        if shapes
            .last_hidden
            .is_some_and(|hidden| hidden != target.hidden)
        {
            return config(format!(
                "plan last_hidden_states width {:?} ≠ target hidden {}",
                shapes.last_hidden, target.hidden
            ));
        }
        Ok(Self {
            row: vec![0.0; target.din()],
            last_row: vec![0.0; shapes.last_hidden.unwrap_or(0)],
            target,
            shapes: shapes.clone(),
            bucket_cdf,
            bucket_lengths,
            last_bucket,
            producer,
            producers,
            next: producer as u64,
            components,
        })
    }

    /// The RNG of the batch at `position` and the bucket it draws first.
    fn batch_rng(&self, position: u64) -> (SplitMix64, usize) {
        let mut rng = SplitMix64(hash2(self.target.seed ^ BATCH_SALT, position));
        let u = rng.unit();
        // A bucket without lengths repeats its predecessor's cumulative value, so `u < c` never selects it;
        // rounding can leave the last value a hair under 1, hence the fallback to the last bucket with lengths.
        let bucket = self
            .bucket_cdf
            .iter()
            .position(|&c| u < c)
            .unwrap_or(self.last_bucket);
        (rng, bucket)
    }
}

impl HsSource for SyntheticSource {
    fn next_bucket(&mut self) -> Result<Option<usize>, SourceError> {
        Ok(Some(self.batch_rng(self.next).1))
    }

    fn fill_next(&mut self, out: &mut HsBatch) -> Result<(), SourceError> {
        let (mut rng, bucket) = self.batch_rng(self.next);
        if !self.shapes.matches(out, bucket) {
            return Err(SourceError::Buffer(format!(
                "position {} needs bucket {bucket} {:?}, got a {}×{} buffer",
                self.next, self.shapes.buckets[bucket], out.sequences, out.padded_len
            )));
        }
        let (padded, din) = (out.padded_len, out.din);
        let share = self.bucket_lengths[bucket].clone();
        for s in 0..out.sequences {
            let len = share.start + rng.below(share.len());
            out.seq_lens[s] = len as u32;
            let base = s * padded;
            let mut previous = None;
            let mut token = rng.below(self.target.vocab) as u32;
            for t in 0..len {
                if t > 0 {
                    previous = Some(token);
                    token = self.target.sample_next(token, &mut rng);
                }
                out.input_ids[base + t] = token;
                out.loss_mask[base + t] = 1;
                self.target.hidden_state(
                    previous,
                    token,
                    &mut self.components,
                    &mut self.row,
                    &mut rng,
                );
                out.hs.store_f32((base + t) * din, &self.row);
                if let Some(last) = out.last_hidden_states.as_mut() {
                    self.target.last_hidden_state(token, &mut self.last_row);
                    last.store_f32((base + t) * self.last_row.len(), &self.last_row);
                }
            }
            out.input_ids[base + len..base + padded].fill(0);
            out.loss_mask[base + len..base + padded].fill(0);
            out.hs.zero((base + len) * din..(base + padded) * din);
            if let Some(last) = out.last_hidden_states.as_mut() {
                let hidden = self.last_row.len();
                last.zero((base + len) * hidden..(base + padded) * hidden);
            }
        }
        out.source_position = self.next;
        self.next += self.producers as u64;
        Ok(())
    }

    fn position(&self) -> u64 {
        self.next
    }

    fn seek(&mut self, position: u64) -> Result<(), SourceError> {
        check_owned(position, self.producer, self.producers)?;
        self.next = position;
        Ok(())
    }
}
