//! f32 → 16-bit float conversion (bfloat16 or IEEE half, round to nearest, ties to even), for the CUDA
//! products that read hidden states in their own 16-bit precision: cuBLAS multiplies bf16 only by bf16 (f16 by
//! f16), so the other operand (the f32 `fc` weight, or the f32 upstream gradient of its weight gradient) gets a
//! 16-bit copy first.
//!
//! ```text
//!  f32 operand ──round_to_half(format)──▶ u16 bits ──▶ cuBLAS gemmEx(16-bit × 16-bit hidden states, f32 out)
//! ```
//!
//! The bodies are integer bit manipulation, so the host build (tests, CPU) and the PTX give identical bits;
//! they follow the `half` crate's software conversions (NaN stays NaN with its payload's top bits and the quiet
//! bit set, overflow rounds to infinity, f16 subnormals round correctly), which a test checks bit for bit.

/// `format` value of [`round_to_half`]: bfloat16 (8 exponent bits, 7 mantissa bits).
pub const FORMAT_BF16: u32 = 0;
/// `format` value of [`round_to_half`]: IEEE binary16 (5 exponent bits, 10 mantissa bits).
pub const FORMAT_F16: u32 = 1;

/// Whether rounding away the bits below `round_bit` rounds up: the first dropped bit is set and either a later
/// dropped bit or the lowest kept bit is (ties to even).
#[inline(always)]
const fn rounds_up(bits: u32, round_bit: u32) -> bool {
    bits & round_bit != 0 && bits & (3 * round_bit - 1) != 0
}

/// `value` as bfloat16 bits, rounded to nearest even.
#[inline(always)]
pub const fn f32_to_bf16_bits(value: f32) -> u16 {
    let x = value.to_bits();
    if x & 0x7FFF_FFFF > 0x7F80_0000 {
        // NaN: keep the payload's top bits, force the quiet bit so truncation cannot make it infinity.
        return ((x >> 16) | 0x0040) as u16;
    }
    // A carry out of the mantissa steps the exponent, and out of the largest finite value gives infinity.
    ((x >> 16) + rounds_up(x, 0x8000) as u32) as u16
}

/// `value` as IEEE binary16 bits, rounded to nearest even (overflow to infinity, subnormals rounded).
#[inline(always)]
pub const fn f32_to_f16_bits(value: f32) -> u16 {
    let x = value.to_bits();
    let sign = (x & 0x8000_0000) >> 16;
    let exponent = x & 0x7F80_0000;
    let mantissa = x & 0x007F_FFFF;
    if exponent == 0x7F80_0000 {
        // Infinity (mantissa 0) or NaN (quiet bit set, payload's top bits kept).
        let quiet = if mantissa == 0 { 0 } else { 0x0200 };
        return (sign | 0x7C00 | quiet | (mantissa >> 13)) as u16;
    }
    let half_exponent = (exponent >> 23) as i32 - 127 + 15;
    if half_exponent >= 0x1F {
        return (sign | 0x7C00) as u16;
    }
    if half_exponent <= 0 {
        // Subnormal in f16 (or zero): shift the mantissa with its implicit bit into place.
        let shift = (14 - half_exponent) as u32;
        if shift > 24 {
            return sign as u16;
        }
        let mantissa = mantissa | 0x0080_0000;
        let rounded = (mantissa >> shift) + rounds_up(mantissa, 1 << (shift - 1)) as u32;
        return (sign | rounded) as u16;
    }
    let bits = sign | ((half_exponent as u32) << 10) | (mantissa >> 13);
    (bits + rounds_up(mantissa, 0x1000) as u32) as u16
}

/// The f32 value of IEEE half bits (exact: every half is an f32).
#[inline(always)]
pub fn f16_bits_to_f32(bits: u16) -> f32 {
    let sign = ((bits as u32) & 0x8000) << 16;
    let exponent = ((bits >> 10) & 0x1f) as u32;
    let mantissa = (bits & 0x3ff) as u32;
    match exponent {
        // Zero and subnormals: mantissa · 2^−24, exact in f32.
        0 => {
            let magnitude = mantissa as f32 * (1.0 / 16_777_216.0);
            f32::from_bits(sign | magnitude.to_bits())
        }
        0x1f => f32::from_bits(sign | 0x7f80_0000 | (mantissa << 13)),
        _ => f32::from_bits(sign | ((exponent + 112) << 23) | (mantissa << 13)),
    }
}

/// `out[e] = 16-bit bits of x[e]` in `format` ([`FORMAT_BF16`], or [`FORMAT_F16`] for any other value) for
/// the elements `chunk · chunk_len ..` up to `min(n, (chunk + 1) · chunk_len)`.
///
/// Launch: element range (the GPU one element per thread, coalesced).
///
/// # Safety
/// `x` and `out` hold `n` elements.
#[inline(always)]
pub unsafe fn round_to_half(
    x: *const f32,
    out: *mut u16,
    n: usize,
    format: u32,
    chunk_len: usize,
    chunk: usize,
) {
    let start = chunk * chunk_len;
    let end = if start + chunk_len < n {
        start + chunk_len
    } else {
        n
    };
    let mut e = start;
    // One branch per chunk, not per element, so each loop vectorises on the host.
    if format == FORMAT_BF16 {
        while e < end {
            // SAFETY: `e < n`, inside both buffers.
            unsafe { *out.add(e) = f32_to_bf16_bits(*x.add(e)) };
            e += 1;
        }
    } else {
        while e < end {
            // SAFETY: as above.
            unsafe { *out.add(e) = f32_to_f16_bits(*x.add(e)) };
            e += 1;
        }
    }
}
