//! The NaN/infinity check every received hidden state passes before anything of its message is queued (a NaN
//! would otherwise surface later as a non-finite loss, blamed on the run).
//!
//! It runs over every byte a producer sends, right after the socket copy, so it must cost a small fraction of
//! that copy. A block of elements is read as integer lanes and reduced to the largest magnitude (sign bit
//! cleared): a maximum without an early exit, which the compiler vectorises with the baseline instruction set,
//! and which reaches the all-ones exponent exactly when the block holds a NaN or an infinity. Only such a
//! block is searched element by element, for the first one.

use half::{bf16, f16};
use safetensors::Dtype;

use crate::batch::HsDtype;

/// Elements per block.
const BLOCK: usize = 4096;

/// The first NaN or infinity among little-endian floats of `dtype` (F32, BF16 or F16; a NaN code of F8_E4M3),
/// with its index.
pub(super) fn first_non_finite(dtype: Dtype, bytes: &[u8]) -> Option<(usize, f32)> {
    match dtype {
        Dtype::BF16 => halves(bytes, 0x7F80, |b| bf16::from_bits(b).to_f32()),
        Dtype::F16 => halves(bytes, 0x7C00, |b| f16::from_bits(b).to_f32()),
        // E4M3 has no infinity; its NaN is every bit but the sign set, the largest magnitude a code can have.
        Dtype::F8_E4M3 => {
            let nan = |code: u8| code & 0x7F == crate::fp8::E4M3_NAN;
            first_in_blocks(
                bytes,
                |block| nan(block.iter().fold(0, |m, &code| (code & 0x7F).max(m))),
                |&code| nan(code).then_some(f32::NAN),
            )
        }
        _ => singles(bytes),
    }
}

/// Half-width floats from magnitude bits `exponent` on (the exponent field all ones: non-finite).
fn halves(bytes: &[u8], exponent: u16, to_f32: fn(u16) -> f32) -> Option<(usize, f32)> {
    let magnitude = |bits: u16| (u16::from_le(bits) & 0x7FFF) as i16;
    lanes::<u16>(bytes, |lanes| {
        first_in_blocks(
            lanes,
            |block| block.iter().fold(0, |m, &x| magnitude(x).max(m)) >= exponent as i16,
            |&x| (magnitude(x) >= exponent as i16).then(|| to_f32(u16::from_le(x))),
        )
    })
}

/// f32 values, non-finite from the all-ones exponent on.
fn singles(bytes: &[u8]) -> Option<(usize, f32)> {
    singles_from(bytes, 0x7F80_0000)
}

/// The first f32 whose magnitude bits are `threshold` or more.
fn singles_from(bytes: &[u8], threshold: i32) -> Option<(usize, f32)> {
    let magnitude = |bits: u32| (u32::from_le(bits) & 0x7FFF_FFFF) as i32;
    lanes::<u32>(bytes, |lanes| {
        first_in_blocks(
            lanes,
            |block| block.iter().fold(0, |m, &x| magnitude(x).max(m)) >= threshold,
            |&x| (magnitude(x) >= threshold).then(|| f32::from_bits(u32::from_le(x))),
        )
    })
}

/// The first finite value of `wire` (already checked finite) that converting into `held` rounds to an
/// infinity: an f32 above bf16's or f16's largest value, a bf16 above f16's. `None` for widening conversions.
/// The thresholds are the magnitudes that round to nearest, ties to even, onto the all-ones exponent.
pub(super) fn first_overflow(wire: Dtype, held: HsDtype, bytes: &[u8]) -> Option<(usize, f32)> {
    match (wire, held) {
        // bf16's largest finite value is 0x7F7F; f32 values from halfway to the next step round to infinity.
        (Dtype::F32, HsDtype::Bf16) => singles_from(bytes, 0x7F7F_8000),
        // f16's largest finite value is 65504; from 65520 on, values round to infinity.
        (Dtype::F32, HsDtype::F16) => singles_from(bytes, 65520f32.to_bits() as i32),
        // The bf16 values at or above 65520 start at 65536 (0x4780).
        (Dtype::BF16, HsDtype::F16) => halves(bytes, 0x4780, |b| bf16::from_bits(b).to_f32()),
        _ => None,
    }
}

/// Runs `scan` over `bytes` read as lanes of `T`: in place when they are aligned for `T` (a batch buffer
/// always is), else a block at a time through an aligned copy (a message whose data starts at an odd offset).
fn lanes<T: bytemuck::Pod>(
    bytes: &[u8],
    scan: impl Fn(&[T]) -> Option<(usize, f32)>,
) -> Option<(usize, f32)> {
    if let Ok(lanes) = bytemuck::try_cast_slice::<u8, T>(bytes) {
        return scan(lanes);
    }
    let width = size_of::<T>();
    let mut aligned = [T::zeroed(); BLOCK];
    bytes
        .chunks(BLOCK * width)
        .enumerate()
        .find_map(|(index, block)| {
            let n = block.len() / width;
            bytemuck::cast_slice_mut::<T, u8>(&mut aligned[..n])
                .copy_from_slice(&block[..n * width]);
            scan(&aligned[..n]).map(|(i, v)| (index * BLOCK + i, v))
        })
}

/// Runs `bad` over blocks of [`BLOCK`] elements and `value` (the element's value when it is not finite) only
/// in the blocks it flags; the first hit with its index.
fn first_in_blocks<T>(
    elements: &[T],
    bad: impl Fn(&[T]) -> bool,
    value: impl Fn(&T) -> Option<f32>,
) -> Option<(usize, f32)> {
    elements
        .chunks(BLOCK)
        .enumerate()
        .filter(|(_, block)| bad(block))
        .find_map(|(index, block)| {
            block
                .iter()
                .enumerate()
                .find_map(|(i, x)| value(x).map(|v| (index * BLOCK + i, v)))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_fp8_nan_code_of_either_sign_is_found_at_its_index() {
        let mut codes = vec![0x7Eu8; 3 * BLOCK];
        assert_eq!(first_non_finite(Dtype::F8_E4M3, &codes), None);
        codes[BLOCK + 5] = 0xFF;
        codes[2 * BLOCK] = 0x7F;
        let (at, value) = first_non_finite(Dtype::F8_E4M3, &codes).unwrap();
        assert_eq!(at, BLOCK + 5);
        assert!(value.is_nan());
    }

    #[test]
    fn overflow_thresholds_are_where_rounding_reaches_infinity() {
        let f32_bytes =
            |values: &[f32]| -> Vec<u8> { values.iter().flat_map(|v| v.to_le_bytes()).collect() };
        let below_bf16 = f32::from_bits(0x7F7F_7FFF);
        let at_bf16 = f32::from_bits(0x7F7F_8000);
        assert!(bf16::from_f32(below_bf16).is_finite() && bf16::from_f32(at_bf16).is_infinite());
        let bytes = f32_bytes(&[1.0, -below_bf16, 3.0, -at_bf16]);
        assert_eq!(
            first_overflow(Dtype::F32, HsDtype::Bf16, &bytes),
            Some((3, -at_bf16))
        );
        assert_eq!(first_overflow(Dtype::F32, HsDtype::F32, &bytes), None);
        assert!(f16::from_f32(65519.0).is_finite() && f16::from_f32(65520.0).is_infinite());
        let bytes = f32_bytes(&[65519.0, 65520.0]);
        assert_eq!(
            first_overflow(Dtype::F32, HsDtype::F16, &bytes),
            Some((1, 65520.0))
        );
        let halves: Vec<u8> = [bf16::from_f32(65280.0), bf16::from_f32(-65536.0)]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert!(f16::from_f32(65280.0).is_finite());
        assert_eq!(
            first_overflow(Dtype::BF16, HsDtype::F16, &halves),
            Some((1, -65536.0))
        );
        assert_eq!(first_overflow(Dtype::BF16, HsDtype::Bf16, &halves), None);
    }

    /// The reference: decode each element and ask the float type.
    fn naive(dtype: Dtype, bytes: &[u8]) -> Option<(usize, f32)> {
        let width = dtype.bitsize() / 8;
        bytes.chunks_exact(width).enumerate().find_map(|(i, b)| {
            let v = match dtype {
                Dtype::BF16 => bf16::from_le_bytes([b[0], b[1]]).to_f32(),
                Dtype::F16 => f16::from_le_bytes([b[0], b[1]]).to_f32(),
                _ => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            };
            (!v.is_finite()).then_some((i, v))
        })
    }

    #[test]
    fn finds_the_first_nan_or_infinity_like_the_float_types_do() {
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for dtype in [Dtype::BF16, Dtype::F16, Dtype::F32] {
            let width = dtype.bitsize() / 8;
            for case in 0..200 {
                let len = (next() % (3 * BLOCK as u64)) as usize + 1;
                // Random bits are full of NaNs; finite values near the largest ones test the threshold.
                let mut bytes: Vec<u8> = (0..len * width + 1).map(|_| next() as u8).collect();
                if case % 2 == 0 {
                    for element in bytes[..len * width].chunks_exact_mut(width) {
                        let top = element.len() - 1;
                        element[top] &= if dtype == Dtype::F16 { 0xFB } else { 0xBF };
                    }
                    for _ in 0..(next() % 3) {
                        let at = (next() as usize % len) * width;
                        let top = at + width - 1;
                        element_set_non_finite(&mut bytes[at..=top], dtype, next() % 2 == 0);
                    }
                }
                for offset in [0, 1] {
                    let slice = &bytes[offset..offset + len * width];
                    let (want, got) = (naive(dtype, slice), first_non_finite(dtype, slice));
                    assert_eq!(
                        want.map(|(i, v)| (i, v.to_bits())),
                        got.map(|(i, v)| (i, v.to_bits())),
                        "{dtype:?} case {case} offset {offset}"
                    );
                }
            }
        }
    }

    /// Sets the exponent of one little-endian element to all ones (an infinity or a NaN by its mantissa).
    fn element_set_non_finite(element: &mut [u8], dtype: Dtype, infinity: bool) {
        let top = element.len() - 1;
        match dtype {
            Dtype::F16 => {
                element[top] |= 0x7C;
                if infinity {
                    element[top] &= 0xFC;
                    element[0] = 0;
                }
            }
            Dtype::BF16 => {
                element[top] |= 0x7F;
                element[0] |= 0x80;
                if infinity {
                    element[0] = 0x80;
                }
            }
            _ => {
                element[top] |= 0x7F;
                element[top - 1] |= 0x80;
                if infinity {
                    element[top - 1] = 0x80;
                    element[0] = 0;
                    element[1] = 0;
                }
            }
        }
    }
}
