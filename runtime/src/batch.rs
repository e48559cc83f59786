//! The hidden-state batch: what producers fill, the queue moves (as a handle) and drafters train on.
//!
//! ```text
//!  source ──fills──▶ HsBatch ──Box through the queue──▶ drafter step ──returns buffer──▶ pool
//! ```
//!
//! Every sequence in a batch is padded to the bucket's `padded_len`, so each bucket has one static shape.

/// One queue item: `sequences` sequences padded to `padded_len` tokens, with their hidden states.
#[derive(Debug, Clone, PartialEq)]
pub struct HsBatch {
    /// Padded length of every sequence (the bucket's upper bound).
    pub padded_len: usize,
    /// Number of sequences.
    pub sequences: usize,
    /// Width of one token's hidden state.
    pub din: usize,
    /// Hidden states, row-major `[sequences × padded_len, din]`; padding rows are zero.
    pub hs: Vec<f32>,
    /// Token ids, `[sequences × padded_len]`; padding positions hold 0.
    pub input_ids: Vec<u32>,
    /// Real length of each sequence (`≤ padded_len`); positions past it are padding.
    pub seq_lens: Vec<u32>,
    /// Per position, 1 when the token there may serve as a label, 0 when it must be ignored.
    pub loss_mask: Vec<u8>,
    /// Position of this batch in the source's stream, for exact resume.
    pub source_position: u64,
}

impl HsBatch {
    /// An all-zero batch with the given static shape, ready to be filled (allocated once, then reused).
    pub fn zeroed(padded_len: usize, sequences: usize, din: usize) -> Self {
        let tokens = padded_len * sequences;
        Self {
            padded_len,
            sequences,
            din,
            hs: vec![0.0; tokens * din],
            input_ids: vec![0; tokens],
            seq_lens: vec![0; sequences],
            loss_mask: vec![0; tokens],
            source_position: 0,
        }
    }

    /// Tokens in the padded batch.
    pub fn tokens(&self) -> usize {
        self.padded_len * self.sequences
    }

    /// The longest real sequence: the length the queue routes this batch by.
    pub fn longest_sequence(&self) -> usize {
        self.seq_lens.iter().copied().max().unwrap_or(0) as usize
    }
}
