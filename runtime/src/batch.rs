//! The hidden-state batch: what producers fill, the queue moves (as a handle) and drafters train on.
//!
//! ```text
//!  source ──fills──▶ HsBatch ──Box through the queue──▶ drafter step ──returns buffer──▶ pool
//! ```
//!
//! Every sequence in a batch is padded to the bucket's `padded_len`, so each bucket has one static shape.
//! Hidden states are held in the plan's `hs_dtype` ([`HsData`]): bf16 from a target stays bf16 (half the bytes
//! of f32) through the pool, the queue and the drafter's input slot, and is widened to f32 only a tile at a time
//! inside the first layer's matrix products. FP8 (`fp8_e4m3`, [`Fp8Rows`]) holds a byte per element and an f32
//! scale per token row, and is dequantised to f32 when a batch is staged into a drafter's input slot.

use std::ops::Range;

pub use draftpipe_compiler::plan::HsDtype;
use half::{bf16, f16};

use crate::fp8::{Fp8Rows, Fp8Slice};

/// Hidden states in the precision they are held in.
#[derive(Debug, Clone, PartialEq)]
pub enum HsData {
    /// 32-bit floats.
    F32(Vec<f32>),
    /// bfloat16.
    Bf16(Vec<bf16>),
    /// IEEE half.
    F16(Vec<f16>),
    /// FP8 E4M3 codes with one scale per token row.
    Fp8E4m3(Fp8Rows),
}

/// A borrowed run of hidden states, in their precision.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum HsSlice<'a> {
    /// 32-bit floats.
    F32(&'a [f32]),
    /// bfloat16.
    Bf16(&'a [bf16]),
    /// IEEE half.
    F16(&'a [f16]),
    /// FP8 E4M3 codes with their rows' scales.
    Fp8E4m3(Fp8Slice<'a>),
}

/// Applies `$body` to the vector (or slice) inside any variant, bound to `$v`.
macro_rules! each_dtype {
    ($value:expr, $ty:ident, $v:ident => $body:expr) => {
        match $value {
            $ty::F32($v) => $body,
            $ty::Bf16($v) => $body,
            $ty::F16($v) => $body,
            $ty::Fp8E4m3($v) => $body,
        }
    };
}

impl HsData {
    /// `len` zeros in `dtype`, in rows of `width` (a token's; the rows FP8 scales).
    pub fn zeroed(dtype: HsDtype, width: usize, len: usize) -> Self {
        match dtype {
            HsDtype::F32 => Self::F32(vec![0.0; len]),
            HsDtype::Bf16 => Self::Bf16(vec![bf16::ZERO; len]),
            HsDtype::F16 => Self::F16(vec![f16::ZERO; len]),
            HsDtype::Fp8E4m3 => Self::Fp8E4m3(Fp8Rows::zeroed(width, len)),
        }
    }

    /// An empty buffer in `dtype`, rows of `width`, with room for `capacity` elements.
    pub fn with_capacity(dtype: HsDtype, width: usize, capacity: usize) -> Self {
        match dtype {
            HsDtype::F32 => Self::F32(Vec::with_capacity(capacity)),
            HsDtype::Bf16 => Self::Bf16(Vec::with_capacity(capacity)),
            HsDtype::F16 => Self::F16(Vec::with_capacity(capacity)),
            HsDtype::Fp8E4m3 => Self::Fp8E4m3(Fp8Rows::with_capacity(width, capacity)),
        }
    }

    /// The element type.
    pub fn dtype(&self) -> HsDtype {
        match self {
            Self::F32(_) => HsDtype::F32,
            Self::Bf16(_) => HsDtype::Bf16,
            Self::F16(_) => HsDtype::F16,
            Self::Fp8E4m3(_) => HsDtype::Fp8E4m3,
        }
    }

    /// Elements.
    pub fn len(&self) -> usize {
        each_dtype!(self, Self, v => v.len())
    }

    /// True when there is no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Elements the buffer can hold without reallocating.
    pub fn capacity(&self) -> usize {
        each_dtype!(self, Self, v => v.capacity())
    }

    /// Bytes the buffer holds room for (an FP8 one's scales included).
    pub fn allocated_bytes(&self) -> usize {
        match self {
            Self::Fp8E4m3(rows) => rows.allocated_bytes(),
            other => other.capacity() * other.dtype().bytes(),
        }
    }

    /// Address of the first element (to tell buffers apart, e.g. that a pool reuses them).
    pub fn as_ptr(&self) -> *const u8 {
        each_dtype!(self, Self, v => v.as_ptr().cast())
    }

    /// Grows (with zeros) or shrinks to `len` elements; no allocation within the capacity.
    pub fn resize(&mut self, len: usize) {
        match self {
            Self::F32(v) => v.resize(len, 0.0),
            Self::Bf16(v) => v.resize(len, bf16::ZERO),
            Self::F16(v) => v.resize(len, f16::ZERO),
            Self::Fp8E4m3(rows) => rows.resize(len),
        }
    }

    /// Zeroes elements `range`.
    pub fn zero(&mut self, range: Range<usize>) {
        match self {
            Self::F32(v) => v[range].fill(0.0),
            Self::Bf16(v) => v[range].fill(bf16::ZERO),
            Self::F16(v) => v[range].fill(f16::ZERO),
            Self::Fp8E4m3(rows) => rows.zero(range),
        }
    }

    /// Sets every element to `value` (rounded to the dtype), e.g. to poison a buffer before it is filled.
    pub fn fill(&mut self, value: f32) {
        match self {
            Self::F32(v) => v.fill(value),
            Self::Bf16(v) => v.fill(bf16::from_f32(value)),
            Self::F16(v) => v.fill(f16::from_f32(value)),
            Self::Fp8E4m3(rows) => rows.fill(value),
        }
    }

    /// Element `index`, widened to f32.
    ///
    /// # Panics
    /// When `index` is out of range.
    pub fn get(&self, index: usize) -> f32 {
        match self {
            Self::F32(v) => v[index],
            Self::Bf16(v) => v[index].to_f32(),
            Self::F16(v) => v[index].to_f32(),
            Self::Fp8E4m3(rows) => rows.get(index),
        }
    }

    /// Writes `values` from element `start` on, rounded to nearest (ties to even) when the dtype is narrower;
    /// quantised with a scale per row they touch in FP8 ([`Fp8Rows::store_f32`]).
    pub fn store_f32(&mut self, start: usize, values: &[f32]) {
        let range = start..start + values.len();
        match self {
            Self::F32(v) => v[range].copy_from_slice(values),
            Self::Bf16(v) => v[range]
                .iter_mut()
                .zip(values)
                .for_each(|(d, &x)| *d = bf16::from_f32(x)),
            Self::F16(v) => v[range]
                .iter_mut()
                .zip(values)
                .for_each(|(d, &x)| *d = f16::from_f32(x)),
            Self::Fp8E4m3(rows) => rows.store_f32(start, values),
        }
    }

    /// The f32 buffer, when that is the dtype.
    pub fn as_f32(&self) -> Option<&[f32]> {
        match self {
            Self::F32(v) => Some(v),
            _ => None,
        }
    }

    /// The f32 buffer to write, when that is the dtype.
    pub fn as_f32_mut(&mut self) -> Option<&mut [f32]> {
        match self {
            Self::F32(v) => Some(v),
            _ => None,
        }
    }

    /// Every element.
    pub fn as_slice(&self) -> HsSlice<'_> {
        match self {
            Self::F32(v) => HsSlice::F32(v),
            Self::Bf16(v) => HsSlice::Bf16(v),
            Self::F16(v) => HsSlice::F16(v),
            Self::Fp8E4m3(rows) => HsSlice::Fp8E4m3(rows.as_slice()),
        }
    }

    /// Elements `range`, widened to f32 (exact: every bf16 and f16 value is an f32; FP8 ones dequantised).
    pub fn to_f32_vec(&self, range: Range<usize>) -> Vec<f32> {
        let mut out = vec![0.0; range.len()];
        self.as_slice().slice(range).widen_into(&mut out);
        out
    }
}

impl<'a> HsSlice<'a> {
    /// The element type.
    pub fn dtype(&self) -> HsDtype {
        match self {
            Self::F32(_) => HsDtype::F32,
            Self::Bf16(_) => HsDtype::Bf16,
            Self::F16(_) => HsDtype::F16,
            Self::Fp8E4m3(_) => HsDtype::Fp8E4m3,
        }
    }

    /// Elements.
    pub fn len(&self) -> usize {
        each_dtype!(self, Self, v => v.len())
    }

    /// True when there is no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Elements `range`.
    pub fn slice(self, range: Range<usize>) -> HsSlice<'a> {
        match self {
            Self::F32(v) => Self::F32(&v[range]),
            Self::Bf16(v) => Self::Bf16(&v[range]),
            Self::F16(v) => Self::F16(&v[range]),
            Self::Fp8E4m3(v) => Self::Fp8E4m3(v.slice(range)),
        }
    }

    /// Widens every element into `out` (same length; exact, except that FP8 is dequantised: `code · scale`).
    ///
    /// # Panics
    /// When the lengths differ.
    pub fn widen_into(self, out: &mut [f32]) {
        assert_eq!(self.len(), out.len(), "widen_into: lengths differ");
        match self {
            Self::F32(v) => out.copy_from_slice(v),
            // bf16 is the top half of an f32: a shift, in a loop simple enough to vectorise.
            Self::Bf16(v) => out
                .iter_mut()
                .zip(v)
                .for_each(|(o, x)| *o = f32::from_bits(u32::from(x.to_bits()) << 16)),
            Self::F16(v) => out.iter_mut().zip(v).for_each(|(o, x)| *o = x.to_f32()),
            Self::Fp8E4m3(v) => v.dequantise_into(out),
        }
    }

    /// The first NaN or infinity, with its index.
    pub fn first_non_finite(self) -> Option<(usize, f32)> {
        match self {
            Self::F32(v) => v.iter().copied().enumerate().find(|(_, x)| !x.is_finite()),
            Self::Bf16(v) => v
                .iter()
                .position(|x| !x.is_finite())
                .map(|i| (i, v[i].to_f32())),
            Self::F16(v) => v
                .iter()
                .position(|x| !x.is_finite())
                .map(|i| (i, v[i].to_f32())),
            Self::Fp8E4m3(v) => v.first_non_finite(),
        }
    }
}

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
    pub hs: HsData,
    /// The target's final-norm output (what its `lm_head` reads), row-major `[sequences × padded_len, hidden]`
    /// in the same dtype as `hs`, padding rows zero: EAGLE-3's teacher. `None` when the plan's drafter does not
    /// read it (mlp, dflash).
    pub last_hidden_states: Option<HsData>,
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
    /// An all-zero batch with f32 hidden states and the given static shape, ready to be filled.
    pub fn zeroed(padded_len: usize, sequences: usize, din: usize) -> Self {
        Self::zeroed_in(HsDtype::F32, padded_len, sequences, din)
    }

    /// An all-zero batch with hidden states in `dtype` (allocated once, then reused).
    pub fn zeroed_in(dtype: HsDtype, padded_len: usize, sequences: usize, din: usize) -> Self {
        let tokens = padded_len * sequences;
        Self {
            padded_len,
            sequences,
            din,
            hs: HsData::zeroed(dtype, din, tokens * din),
            last_hidden_states: None,
            input_ids: vec![0; tokens],
            seq_lens: vec![0; sequences],
            loss_mask: vec![0; tokens],
            source_position: 0,
        }
    }

    /// The batch with a zeroed `last_hidden_states` of `hidden` per token, in the dtype of `hs`.
    pub fn with_last_hidden_states(mut self, hidden: usize) -> Self {
        self.last_hidden_states = Some(HsData::zeroed(
            self.hs.dtype(),
            hidden,
            self.tokens() * hidden,
        ));
        self
    }

    /// Width of one token's `last_hidden_states`, when the batch has them.
    pub fn last_hidden(&self) -> Option<usize> {
        let last = self.last_hidden_states.as_ref()?;
        Some(last.len() / self.tokens().max(1))
    }

    /// Tokens in the padded batch.
    pub fn tokens(&self) -> usize {
        self.padded_len * self.sequences
    }

    /// Bytes this batch's buffers hold room for (their capacities, not their lengths).
    pub fn allocated_bytes(&self) -> u64 {
        let last = self
            .last_hidden_states
            .as_ref()
            .map_or(0, HsData::allocated_bytes);
        let bytes = self.hs.allocated_bytes()
            + last
            + self.input_ids.capacity() * size_of::<u32>()
            + self.seq_lens.capacity() * size_of::<u32>()
            + self.loss_mask.capacity();
        bytes as u64
    }

    /// The longest real sequence: the length the queue routes this batch by.
    pub fn longest_sequence(&self) -> usize {
        self.seq_lens.iter().copied().max().unwrap_or(0) as usize
    }
}
