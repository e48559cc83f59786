//! FP8 E4M3 hidden states (`hs_dtype = fp8_e4m3`): the codec and the per-token-scaled buffer that the sources
//! fill, the pool and the queue hold, and staging dequantises into the drafter's f32 input slot.
//!
//! ```text
//!  f32 / bf16 row ──quantise (scale = amax / 448, RNE, saturating)──▶ Fp8Rows {codes: u8, scales: f32 per row}
//!  Fp8Rows ──(queue)──▶ stage: decode(code) · scale ──▶ f32 slot
//! ```
//!
//! The format is OCP FP8 E4M3 ("e4m3fn"): 1 sign, 4 exponent (bias 7), 3 mantissa bits, largest finite 448, no
//! infinities, NaN at 0x7F and 0xFF. Each token's row carries one f32 scale, `amax / 448`, so its largest value
//! lands on 448 and the row's relative precision is E4M3's 2⁻⁴; an all-zero row gets scale 1 (never 0, so
//! nothing divides by it). The scale is per row, so every write here is by whole rows except [`Fp8Rows::store_f32`]
//! of part of one, which requantises that row.

use std::ops::Range;
use std::path::Path;

use safetensors::Dtype;
use thiserror::Error;

use crate::batch::HsData;
use crate::tensor_file::{TensorFileError, TensorProblem, decode_floats};

/// The tensor beside an `F8_E4M3` `hidden_states` that holds each token's scale, `[N, S]` F32 (files and
/// stream messages alike).
pub const HIDDEN_STATES_SCALE: &str = "hidden_states_scale";

/// The largest finite E4M3 value.
pub const E4M3_MAX: f32 = 448.0;
/// The code E4M3 stores NaN as (with the sign bit clear; 0xFF is the other).
pub const E4M3_NAN: u8 = 0x7F;

/// Every code's value (NaN at 0x7F and 0xFF): the decode is one load.
static DECODE: [f32; 256] = decode_table();

const fn decode_table() -> [f32; 256] {
    let mut table = [0.0f32; 256];
    let mut code = 0;
    while code < 256 {
        let (exponent, mantissa) = ((code >> 3) & 0xF, code & 0x7);
        let magnitude = if exponent == 0xF && mantissa == 0x7 {
            f32::NAN
        } else if exponent == 0 {
            // Subnormal: mantissa · 2⁻⁹.
            mantissa as f32 / 512.0
        } else {
            // (1 + mantissa/8) · 2^(exponent − 7), built from its f32 bits (exact).
            f32::from_bits((((exponent + 120) as u32) << 23) | ((mantissa as u32) << 20))
        };
        table[code] = if code & 0x80 != 0 {
            -magnitude
        } else {
            magnitude
        };
        code += 1;
    }
    table
}

/// The value of E4M3 `code`.
pub fn decode(code: u8) -> f32 {
    DECODE[code as usize]
}

/// `x` rounded to the nearest E4M3 value (ties to even), finite values saturating at ±448. NaN and the
/// infinities (which E4M3 does not have) become [`E4M3_NAN`] with `x`'s sign, so the sources' non-finite checks
/// still find them after quantisation.
pub fn encode(x: f32) -> u8 {
    let sign = ((x.to_bits() >> 24) & 0x80) as u8;
    let magnitude = x.abs();
    if !magnitude.is_finite() {
        return sign | E4M3_NAN;
    }
    if magnitude >= E4M3_MAX {
        return sign | 0x7E;
    }
    let code = if magnitude < 1.0 / 64.0 {
        // Subnormals (and 0): steps of 2⁻⁹; 8 steps is the smallest normal, code 0x08.
        (magnitude * 512.0).round_ties_even() as u8
    } else {
        // Rebias the exponent (127 → 7) and round the 23 mantissa bits to 3, ties to even: a carry out of the
        // mantissa bumps the exponent, as it should.
        let bits = magnitude.to_bits() - (120 << 23);
        let odd = (bits >> 20) & 1;
        ((bits + 0x7_FFFF + odd) >> 20).min(0x7E) as u8
    };
    sign | code
}

/// The scale of a row whose largest magnitude is `amax`: `amax / 448`, or 1 for a row that is all zeros (or
/// whose largest magnitude is not finite: its non-finite elements are the source's checks to refuse).
pub fn row_scale(amax: f32) -> f32 {
    if amax > 0.0 && amax.is_finite() {
        amax / E4M3_MAX
    } else {
        1.0
    }
}

/// Quantises one row: writes its codes and returns its scale.
pub fn quantise_row(row: &[f32], codes: &mut [u8]) -> f32 {
    let amax = row
        .iter()
        .filter(|x| x.is_finite())
        .fold(0.0f32, |a, x| a.max(x.abs()));
    let scale = row_scale(amax);
    codes
        .iter_mut()
        .zip(row)
        .for_each(|(c, &x)| *c = encode(x / scale));
    scale
}

/// Why FP8 rows read from a file or a message could not be stored.
#[derive(Debug, Clone, Copy, PartialEq, Error)]
pub enum ScaledRowsError {
    /// The codes, the scales and the destination do not agree (a file that changed after it was checked).
    #[error(
        "{codes} codes and {scales} scale bytes are not rows of {width} inside the destination"
    )]
    Shape {
        /// Codes given.
        codes: usize,
        /// Bytes of scale given.
        scales: usize,
        /// Elements per row.
        width: usize,
    },
    /// A row's scale is NaN or infinite: every element of the row would be.
    #[error("scale {value} of row {row} is not finite")]
    NonFiniteScale {
        /// The row, from the first given.
        row: usize,
        /// Its scale.
        value: f32,
    },
}

/// Writes E4M3 rows read from a file or a message into `out` from element `start` on (a row boundary):
/// `codes` holds rows of `width` codes, `scales` one little-endian f32 per row. Into FP8 they are copied as
/// they are; into a float dtype they are dequantised (`code · scale`, then rounded to bf16/f16 when that is
/// the dtype). A NaN code is stored as it is, for the source's non-finite check to refuse with its index.
pub fn store_scaled_rows(
    codes: &[u8],
    scales: &[u8],
    width: usize,
    out: &mut HsData,
    start: usize,
) -> Result<(), ScaledRowsError> {
    let rows = scales.len() / 4;
    let shape = ScaledRowsError::Shape {
        codes: codes.len(),
        scales: scales.len(),
        width,
    };
    let fits = width > 0
        && scales.len().is_multiple_of(4)
        && codes.len() == rows * width
        && start.is_multiple_of(width)
        && start + codes.len() <= out.len();
    if !fits {
        return Err(shape);
    }
    let scale_of = |row: usize| {
        let bytes = &scales[4 * row..4 * row + 4];
        f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])
    };
    if let Some(row) = (0..rows).find(|&row| !scale_of(row).is_finite()) {
        return Err(ScaledRowsError::NonFiniteScale {
            row,
            value: scale_of(row),
        });
    }
    match out {
        HsData::Fp8E4m3(held) => {
            if held.width != width {
                return Err(shape);
            }
            let first_row = start / width;
            held.codes[start..start + codes.len()].copy_from_slice(codes);
            for (row, scale) in held.scales[first_row..first_row + rows]
                .iter_mut()
                .enumerate()
            {
                *scale = scale_of(row);
            }
        }
        out => {
            let mut row_values = vec![0.0f32; width];
            for (row, row_codes) in codes.chunks_exact(width).enumerate() {
                let scale = scale_of(row);
                row_values
                    .iter_mut()
                    .zip(row_codes)
                    .for_each(|(v, &c)| *v = DECODE[c as usize] * scale);
                out.store_f32(start + row * width, &row_values);
            }
        }
    }
    Ok(())
}

/// [`store_scaled_rows`] for a source: FP8 rows of a file or a message (`codes` of `width` per token, from token
/// `first` of its tensors, with their `scales`) into `data` from element `start` on; a non-finite scale is
/// refused naming `origin`, the scale tensor and the token.
pub(crate) fn store_fp8_rows(
    codes: &[u8],
    scales: &[u8],
    (width, first): (usize, usize),
    data: &mut HsData,
    start: usize,
    origin: &Path,
) -> Result<(), TensorFileError> {
    store_scaled_rows(codes, scales, width, data, start).map_err(|error| {
        let (tensor, problem) = match error {
            ScaledRowsError::NonFiniteScale { row, value } => (
                HIDDEN_STATES_SCALE,
                TensorProblem::NonFinite {
                    value,
                    at: first + row,
                },
            ),
            ScaledRowsError::Shape { .. } => (
                crate::source::safetensors::HIDDEN_STATES,
                TensorProblem::BadHeader("data changed after it was checked".into()),
            ),
        };
        TensorFileError::tensor(origin, tensor, problem)
    })
}

/// Rows of E4M3 codes, each with its f32 scale: the pool's buffer of an `fp8_e4m3` plan.
#[derive(Debug, Clone, PartialEq)]
pub struct Fp8Rows {
    /// Elements per row (a token's hidden-state width).
    width: usize,
    /// Codes, row-major.
    codes: Vec<u8>,
    /// One scale per (possibly partial, while resizing) row.
    scales: Vec<f32>,
}

impl Fp8Rows {
    /// An empty buffer of rows `width` wide with room for `capacity` elements.
    pub fn with_capacity(width: usize, capacity: usize) -> Self {
        Self {
            width: width.max(1),
            codes: Vec::with_capacity(capacity),
            scales: Vec::with_capacity(capacity.div_ceil(width.max(1))),
        }
    }

    /// `len` zeros in rows `width` wide.
    pub fn zeroed(width: usize, len: usize) -> Self {
        let mut rows = Self::with_capacity(width, len);
        rows.resize(len);
        rows
    }

    /// Elements per row.
    pub fn width(&self) -> usize {
        self.width
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.codes.len()
    }

    /// True when there is no element.
    pub fn is_empty(&self) -> bool {
        self.codes.is_empty()
    }

    /// Elements the buffer holds room for.
    pub fn capacity(&self) -> usize {
        self.codes.capacity()
    }

    /// Bytes the buffer holds room for: a byte per element and four per row's scale.
    pub fn allocated_bytes(&self) -> usize {
        self.codes.capacity() + self.scales.capacity() * size_of::<f32>()
    }

    /// Address of the first code.
    pub fn as_ptr(&self) -> *const u8 {
        self.codes.as_ptr()
    }

    /// Grows (with zero rows of scale 1) or shrinks to `len` elements; no allocation within the capacity.
    pub fn resize(&mut self, len: usize) {
        self.codes.resize(len, 0);
        self.scales.resize(len.div_ceil(self.width), 1.0);
    }

    /// Zeroes elements `range`; a row it covers whole gets scale 1.
    pub fn zero(&mut self, range: Range<usize>) {
        let whole = range.start.div_ceil(self.width)..range.end / self.width;
        self.codes[range].fill(0);
        if whole.start < whole.end {
            self.scales[whole].fill(1.0);
        }
    }

    /// Sets every element to `value` (quantised: each row's scale is `|value| / 448`).
    pub fn fill(&mut self, value: f32) {
        let scale = row_scale(value.abs());
        self.codes.fill(encode(value / scale));
        self.scales.fill(scale);
    }

    /// Element `index`, dequantised.
    ///
    /// # Panics
    /// When `index` is out of range.
    pub fn get(&self, index: usize) -> f32 {
        decode(self.codes[index]) * self.scales[index / self.width]
    }

    /// Writes `values` from element `start` on, quantising each row they touch with its own scale; a row they
    /// cover only in part is dequantised, overwritten and quantised again.
    ///
    /// # Panics
    /// When the range is out of bounds.
    pub fn store_f32(&mut self, start: usize, values: &[f32]) {
        let end = start + values.len();
        assert!(end <= self.len(), "store_f32: {end} past {}", self.len());
        let width = self.width;
        let mut row_values = Vec::new();
        for row in start / width..end.div_ceil(width) {
            let span = row * width..((row + 1) * width).min(self.len());
            let (from, to) = (span.start.max(start), span.end.min(end));
            let codes = &mut self.codes[span.clone()];
            if (from, to) == (span.start, span.end) {
                self.scales[row] = quantise_row(&values[from - start..to - start], codes);
            } else {
                let scale = self.scales[row];
                row_values.clear();
                row_values.extend(codes.iter().map(|&c| decode(c) * scale));
                row_values[from - span.start..to - span.start]
                    .copy_from_slice(&values[from - start..to - start]);
                self.scales[row] = quantise_row(&row_values, codes);
            }
        }
    }

    /// Quantises little-endian floats of `dtype` (F32, BF16 or F16) into elements from `start` on, each row they
    /// touch with its own scale (the path of a float file or message into an fp8 plan). False for another dtype
    /// or a length that does not fit.
    pub fn store_floats(&mut self, dtype: Dtype, bytes: &[u8], start: usize) -> bool {
        let width = dtype.bitsize() / 8;
        if width == 0 || !bytes.len().is_multiple_of(width) {
            return false;
        }
        let len = bytes.len() / width;
        if start.checked_add(len).is_none_or(|end| end > self.len()) {
            return false;
        }
        // Whole rows are quantised from their f32 values at once: the scale needs the row's largest magnitude.
        let mut wide = vec![0.0f32; len];
        if !decode_floats(dtype, bytes, &mut wide) {
            return false;
        }
        self.store_f32(start, &wide);
        true
    }

    /// Sets the scales of rows `first_row..` from little-endian f32 `bytes` (a message's, its codes already in
    /// place), refusing a non-finite one.
    pub fn set_scales(&mut self, first_row: usize, bytes: &[u8]) -> Result<(), ScaledRowsError> {
        let rows = bytes.len() / 4;
        let Some(dst) = self.scales.get_mut(first_row..first_row + rows) else {
            return Err(ScaledRowsError::Shape {
                codes: 0,
                scales: bytes.len(),
                width: self.width,
            });
        };
        for (row, (dst, src)) in dst.iter_mut().zip(bytes.chunks_exact(4)).enumerate() {
            let value = f32::from_le_bytes([src[0], src[1], src[2], src[3]]);
            if !value.is_finite() {
                return Err(ScaledRowsError::NonFiniteScale { row, value });
            }
            *dst = value;
        }
        Ok(())
    }

    /// The codes and scales to fill in place (a source writing whole rows it quantised or read as FP8).
    pub fn parts_mut(&mut self) -> (&mut [u8], &mut [f32]) {
        (&mut self.codes, &mut self.scales)
    }

    /// Every element.
    pub fn as_slice(&self) -> Fp8Slice<'_> {
        Fp8Slice {
            codes: &self.codes,
            scales: &self.scales,
            width: self.width,
            first: 0,
        }
    }
}

/// A borrowed run of FP8 elements with the scales of the rows they lie in.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fp8Slice<'a> {
    /// The run's codes.
    pub codes: &'a [u8],
    /// The scale of every row of the buffer the run was taken from.
    pub scales: &'a [f32],
    /// Elements per row.
    pub width: usize,
    /// Index of `codes[0]` in that buffer (so element `i`'s row is `(first + i) / width`).
    pub first: usize,
}

impl<'a> Fp8Slice<'a> {
    /// Elements.
    pub fn len(&self) -> usize {
        self.codes.len()
    }

    /// True when there is no element.
    pub fn is_empty(&self) -> bool {
        self.codes.is_empty()
    }

    /// Elements `range`.
    pub fn slice(self, range: Range<usize>) -> Self {
        Self {
            first: self.first + range.start,
            codes: &self.codes[range],
            ..self
        }
    }

    /// Dequantises every element into `out` (same length): `decode(code) · scale`, a row at a time.
    pub fn dequantise_into(self, out: &mut [f32]) {
        let mut at = 0;
        while at < self.codes.len() {
            let row = (self.first + at) / self.width;
            let end = ((row + 1) * self.width - self.first).min(self.codes.len());
            let scale = self.scales[row];
            out[at..end]
                .iter_mut()
                .zip(&self.codes[at..end])
                .for_each(|(o, &c)| *o = DECODE[c as usize] * scale);
            at = end;
        }
    }

    /// The first element that dequantises to NaN or infinity (a NaN code or a non-finite scale), with its index.
    pub fn first_non_finite(self) -> Option<(usize, f32)> {
        (0..self.codes.len()).find_map(|i| {
            let value = decode(self.codes[i]) * self.scales[(self.first + i) / self.width];
            (!value.is_finite()).then_some((i, value))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_decodes_to_its_ocp_value_and_encodes_back() {
        // Spot values of the OCP table: the extremes, 1, the smallest normal and subnormal, and the NaNs.
        assert_eq!(decode(0x7E), 448.0);
        assert_eq!(decode(0xFE), -448.0);
        assert_eq!(decode(0x38), 1.0);
        assert_eq!(decode(0x08), 2f32.powi(-6));
        assert_eq!(decode(0x01), 2f32.powi(-9));
        assert_eq!(decode(0x80).to_bits(), (-0.0f32).to_bits());
        assert!(decode(0x7F).is_nan() && decode(0xFF).is_nan());
        for code in 0..=255u8 {
            let value = decode(code);
            if value.is_nan() {
                assert_eq!(encode(value) & 0x7F, E4M3_NAN);
            } else {
                assert_eq!(encode(value), code, "code {code:#04x} = {value}");
            }
        }
        // Codes ascend with value on each side of 0: the table is monotonic.
        for code in 1..0x7Eu8 {
            assert!(decode(code + 1) > decode(code));
        }
    }

    #[test]
    fn encode_rounds_ties_to_even_and_saturates() {
        // 1.0 (0x38) and 1.125 (0x39): their midpoint goes to the even code, 1.0; the next midpoint to 1.25.
        assert_eq!(encode(1.0625), 0x38);
        assert_eq!(encode(1.1875), 0x3A);
        assert_eq!(encode(1.0626), 0x39);
        // Subnormal ties: 0.5 · 2⁻⁹ to 0, 1.5 · 2⁻⁹ to 2 · 2⁻⁹.
        assert_eq!(encode(0.5 / 512.0), 0x00);
        assert_eq!(encode(1.5 / 512.0), 0x02);
        // The carry out of the mantissa: just under 2 rounds to 2 (0x40).
        assert_eq!(encode(1.99), 0x40);
        for big in [448.0, 449.0, 464.0, 1e9, f32::MAX] {
            assert_eq!(encode(big), 0x7E, "{big}");
            assert_eq!(encode(-big), 0xFE, "{big}");
        }
        for not_finite in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            assert_eq!(encode(not_finite) & 0x7F, E4M3_NAN, "{not_finite}");
        }
    }

    /// `a` equals `b` to f32 rounding (a dequantised value is a product rounded once).
    fn close(a: f32, b: f32) -> bool {
        (a - b).abs() <= 1e-6 * b.abs()
    }

    #[test]
    fn each_row_has_its_own_scale_and_a_zero_row_gets_one() {
        let mut rows = Fp8Rows::zeroed(3, 9);
        rows.store_f32(0, &[1.0, -2.0, 4.0, 0.0, 0.0, 0.0, 0.001, 0.002, -0.003]);
        let (_, scales) = rows.parts_mut();
        assert_eq!(scales, &[4.0 / 448.0, 1.0, 0.003 / 448.0]);
        // The row's largest magnitude comes back to f32 rounding; the others within E4M3's half step (2⁻⁴).
        assert!(close(rows.get(2), 4.0) && close(rows.get(8), -0.003));
        assert!(close(rows.get(0), 1.0) && close(rows.get(1), -2.0));
        assert_eq!(rows.get(4), 0.0);
        let mut out = vec![f32::NAN; 5];
        rows.as_slice().slice(2..7).dequantise_into(&mut out);
        assert!(close(out[0], 4.0));
        assert_eq!(&out[1..4], &[0.0, 0.0, 0.0]);
        assert!((out[4] - 0.001).abs() <= 0.001 / 16.0);
        assert_eq!(rows.as_slice().first_non_finite(), None);
        rows.parts_mut().0[7] = E4M3_NAN;
        assert!(
            rows.as_slice()
                .slice(2..9)
                .first_non_finite()
                .is_some_and(|(i, _)| i == 5)
        );
    }

    #[test]
    fn a_partial_row_write_requantises_that_row_alone() {
        let mut rows = Fp8Rows::zeroed(2, 4);
        rows.store_f32(0, &[1.0, 1.0, 3.0, 3.0]);
        rows.store_f32(1, &[8.0, 0.375]);
        let values: Vec<f32> = (0..4).map(|i| rows.get(i)).collect();
        for (got, want) in values.iter().zip([1.0, 8.0, 0.375, 3.0]) {
            assert!(close(*got, want), "{values:?}");
        }
        rows.zero(1..4);
        assert!(close(rows.get(0), 1.0));
        assert_eq!(rows.parts_mut().1, &[8.0 / 448.0, 1.0]);
    }
}
