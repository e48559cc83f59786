//! The f32 → bf16/f16 conversion kernel (`round_to_half`, the 16-bit copy of a CUDA product's f32 operand when
//! the other holds 16-bit hidden states) against the `half` crate bit for bit: signed zeros, infinities, NaNs
//! with every payload shape, the largest finite values and the overflow boundary, f16 subnormals and the full
//! underflow, ties to even at every rounding position, and a sweep of every exponent with random mantissas.
//! Run through the host launcher (long chunks) and through the GPU's launch shape (one element per index), with
//! the output poisoned before each run.

use draftpipe_gpu_kernels::convert::{FORMAT_BF16, FORMAT_F16, round_to_half};
use draftpipe_runtime::backend::cpu::kernels::launch;
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

/// Hand-picked edge cases (as bits, so NaN payloads and signs survive).
fn edge_cases() -> Vec<u32> {
    let mut bits = vec![
        0x0000_0000, // +0
        0x8000_0000, // -0
        0x7F80_0000, // +inf
        0xFF80_0000, // -inf
        0x7FC0_0000, // quiet NaN
        0xFFC0_0000, // negative quiet NaN
        0x7F80_0001, // signalling NaN, payload only in the lowest bit (truncation alone would give inf)
        0x7F80_2000, // payload in the top bit dropped by f16
        0x7F81_0000, // payload in the lowest bit bf16 keeps
        0x7FBF_FFFF, // signalling NaN, full payload
        0xFFFF_FFFF, // negative NaN, all bits
        0x0000_0001, // smallest f32 subnormal
        0x007F_FFFF, // largest f32 subnormal
        0x0080_0000, // smallest normal
        0x7F7F_FFFF, // largest finite (bf16 rounds it to inf)
        0x7F7F_7FFF, // just below bf16's overflow tie
        0x7F7F_8000, // bf16's overflow tie
    ];
    let floats = [
        1.0f32,
        -1.0,
        65504.0,            // f16 max
        65519.996,          // rounds down to f16 max
        65520.0,            // tie at f16's overflow: rounds to inf
        1e5,                // f16 overflow
        6.103_515_6e-5,     // f16 smallest normal (2^-14)
        5.960_464_5e-8,     // f16 smallest subnormal (2^-24)
        2.980_232_2e-8,     // 2^-25: tie between 0 and the smallest subnormal, to even (0)
        4.470_348_4e-8,     // 1.5 · 2^-25: rounds up to the smallest subnormal
        1.0e-10,            // full f16 underflow
        -3.0e-6,            // f16 subnormal
        1.0 + 1.0 / 256.0,  // bf16 tie, rounds to even (down)
        1.0 + 3.0 / 256.0,  // bf16 tie, rounds to even (up)
        1.0 + 1.0 / 2048.0, // f16 tie, down
        1.0 + 3.0 / 2048.0, // f16 tie, up
        std::f32::consts::PI,
        -std::f32::consts::E,
    ];
    bits.extend(floats.iter().map(|f| f.to_bits()));
    bits
}

/// Every exponent with both signs: mantissas at each format's rounding positions (just below, at and above
/// the half-way point, with an even and an odd kept bit) and random ones.
fn sweep(rng: &mut Xoshiro256PlusPlus) -> Vec<u32> {
    let mut bits = Vec::new();
    let around = |round_bit: u32| {
        [round_bit - 1, round_bit, round_bit + 1]
            .into_iter()
            .flat_map(move |low| [low, low | (round_bit << 1), low | (round_bit << 2)])
    };
    for sign in [0u32, 1] {
        for exponent in 0u32..=255 {
            let head = (sign << 31) | (exponent << 23);
            // bf16 drops 16 bits; f16 normals drop 13; f16 subnormals drop 14..24 (exponents 102..=112).
            let mut positions = vec![1 << 15, 1 << 12];
            positions.extend((13..24).map(|b| 1u32 << b));
            for &round_bit in &positions {
                for low in around(round_bit) {
                    bits.push(head | (low & 0x007F_FFFF));
                }
            }
            for _ in 0..512 {
                bits.push(head | rng.random_range(0..0x0080_0000u32));
            }
        }
    }
    bits
}

fn expected(bits: &[u32], format: u32) -> Vec<u16> {
    bits.iter()
        .map(|&b| {
            let x = f32::from_bits(b);
            if format == FORMAT_BF16 {
                half::bf16::from_f32(x).to_bits()
            } else {
                half::f16::from_f32(x).to_bits()
            }
        })
        .collect()
}

fn first_difference(bits: &[u32], got: &[u16], want: &[u16]) -> Option<String> {
    let i = got.iter().zip(want).position(|(g, w)| g != w)?;
    Some(format!(
        "element {i}: f32 bits {:#010x} gave {:#06x}, half gives {:#06x}",
        bits[i], got[i], want[i]
    ))
}

#[test]
fn f32_to_bf16_and_f16_match_half_bit_for_bit() {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(rand::random());
    let mut bits = edge_cases();
    bits.extend(sweep(&mut rng));
    let x: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
    let n = x.len();
    for (format, name) in [(FORMAT_BF16, "bf16"), (FORMAT_F16, "f16")] {
        let want = expected(&bits, format);

        let mut host = vec![0xDEADu16; n];
        launch::round_to_half(&x, &mut host, n, format);
        if let Some(diff) = first_difference(&bits, &host, &want) {
            panic!("{name}, host launcher: {diff}");
        }

        // The GPU's launch shape: one element per index.
        let mut per_index = vec![0xBEEFu16; n];
        for index in 0..n {
            // SAFETY: both buffers hold `n` elements; each call writes element `index` only.
            unsafe { round_to_half(x.as_ptr(), per_index.as_mut_ptr(), n, format, 1, index) };
        }
        if let Some(diff) = first_difference(&bits, &per_index, &want) {
            panic!("{name}, one element per index: {diff}");
        }
    }
}

#[test]
fn a_short_output_is_refused_before_any_element_is_written() {
    let x = [1.0f32; 8];
    let mut out = [0u16; 7];
    let refused = std::panic::catch_unwind(move || {
        launch::round_to_half(&x, &mut out, 8, FORMAT_BF16);
        out
    });
    let message = *refused
        .expect_err("a 7-element output for 8 elements must be refused")
        .downcast::<String>()
        .expect("a formatted message");
    assert!(
        message.contains("round_to_half: out holds 7 elements, needs 8"),
        "{message}"
    );
}
