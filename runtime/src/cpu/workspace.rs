//! Per-bucket activation and loss buffers, sized once from the bucket's static shape and reused every step.
//!
//! Memory per bucket (T tokens, H hidden, I intermediate, B blocks, J heads, C loss chunk, V vocab), in f32:
//! `T·H·(2B + 6 + 3J) + 3·T·I·(B + 1) + T·(B + 1) + 2·T·J + C·V + T·H/64` (+ `T·J/1024`). The loss part is
//! `C·V + 2·T·J`, never `T·V`.

use draftpipe_compiler::plan::MlpSpec;

/// Rows per partial sum of the RMSNorm weight gradient's first pass.
pub(crate) const NORM_GRAD_ROWS_PER_CHUNK: usize = 64;
/// Elements per partial sum of the loss total.
pub(crate) const LOSS_SUM_CHUNK: usize = 1024;

/// Saved forward activations of one SwiGLU block.
pub(crate) struct BlockActivations {
    /// The block's input (residual stream before the block), `[T, H]`.
    pub x: Vec<f32>,
    /// `1/rms` of each row of `x`, `[T]`.
    pub inv_rms: Vec<f32>,
    /// `rmsnorm(x)`, `[T, H]`.
    pub normed: Vec<f32>,
    /// `[gate | up]` projections, `[T, 2I]`.
    pub gate_up: Vec<f32>,
    /// `silu(gate) ⊙ up`, `[T, I]`.
    pub act: Vec<f32>,
}

/// Saved forward activations of one head.
pub(crate) struct HeadActivations {
    /// `z · Wᵀ`, `[T, H]`.
    pub a: Vec<f32>,
    /// `z + silu(a)`, `[T, H]`.
    pub h: Vec<f32>,
    /// Gradient of the loss with respect to `h`, then (in place) with respect to `a`, `[T, H]`.
    pub dh: Vec<f32>,
}

/// Every buffer one step of one bucket touches.
pub(crate) struct Workspace {
    /// Tokens per step.
    pub tokens: usize,
    /// Per block, in order.
    pub blocks: Vec<BlockActivations>,
    /// Residual stream after the last block, `[T, H]`.
    pub x_final: Vec<f32>,
    /// `1/rms` of the final norm, `[T]`.
    pub inv_rms_final: Vec<f32>,
    /// Final norm output `z`, `[T, H]`.
    pub z: Vec<f32>,
    /// Per head.
    pub heads: Vec<HeadActivations>,
    /// Labels, `[J, T]`, `-1` where ignored.
    pub labels: Vec<i32>,
    /// Valid labels per head.
    pub counts: Vec<u32>,
    /// Loss scale per head.
    pub scales: Vec<f32>,
    /// Scaled cross-entropy per (head, token), `[J, T]`.
    pub row_loss: Vec<f32>,
    /// Partial sums of `row_loss`.
    pub loss_partials: Vec<f32>,
    /// The fused loss's only vocabulary-sized buffer, `[C, V]`.
    pub logits: Vec<f32>,
    /// Gradient with respect to `z`, `[T, H]`.
    pub dz: Vec<f32>,
    /// Gradient with respect to one head's `a`, `[T, H]` (heads take turns).
    pub da: Vec<f32>,
    /// Gradient with respect to the residual stream, `[T, H]`.
    pub dx: Vec<f32>,
    /// Gradient with respect to a block's normed input, `[T, H]`.
    pub dnormed: Vec<f32>,
    /// Gradient with respect to a block's SwiGLU output, `[T, I]`.
    pub dact: Vec<f32>,
    /// Gradient with respect to a block's `[gate | up]`, `[T, 2I]`.
    pub dgate_up: Vec<f32>,
    /// First-pass partials of an RMSNorm weight gradient, `[ceil(T / 64), H]`.
    pub norm_partials: Vec<f32>,
}

impl Workspace {
    /// Allocates every buffer for `tokens` tokens and a loss chunk of `chunk_tokens` rows.
    pub(crate) fn new(spec: &MlpSpec, tokens: usize, chunk_tokens: usize) -> Self {
        let MlpSpec {
            hidden: h,
            intermediate: i,
            blocks,
            heads,
            vocab,
            ..
        } = *spec;
        let th = tokens * h;
        let block = || BlockActivations {
            x: vec![0.0; th],
            inv_rms: vec![0.0; tokens],
            normed: vec![0.0; th],
            gate_up: vec![0.0; 2 * tokens * i],
            act: vec![0.0; tokens * i],
        };
        let head = || HeadActivations {
            a: vec![0.0; th],
            h: vec![0.0; th],
            dh: vec![0.0; th],
        };
        let chunk = chunk_tokens.clamp(1, tokens.max(1));
        Self {
            tokens,
            blocks: (0..blocks).map(|_| block()).collect(),
            x_final: vec![0.0; th],
            inv_rms_final: vec![0.0; tokens],
            z: vec![0.0; th],
            heads: (0..heads).map(|_| head()).collect(),
            labels: vec![0; heads * tokens],
            counts: vec![0; heads],
            scales: vec![0.0; heads],
            row_loss: vec![0.0; heads * tokens],
            loss_partials: vec![0.0; (heads * tokens).div_ceil(LOSS_SUM_CHUNK)],
            logits: vec![0.0; chunk * vocab],
            dz: vec![0.0; th],
            da: vec![0.0; th],
            dx: vec![0.0; th],
            dnormed: vec![0.0; th],
            dact: vec![0.0; tokens * i],
            dgate_up: vec![0.0; 2 * tokens * i],
            norm_partials: vec![0.0; tokens.div_ceil(NORM_GRAD_ROWS_PER_CHUNK) * h],
        }
    }

    /// Rows of the loss chunk buffer.
    pub(crate) fn chunk_tokens(&self, vocab: usize) -> usize {
        self.logits.len() / vocab.max(1)
    }
}
