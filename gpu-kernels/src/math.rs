//! Scalar maths shared by every kernel: `exp`, `ln`, `rsqrt`, `sigmoid`, `silu` and its derivative, `sin_cos`.
//!
//! `core` has no `exp`/`sqrt`/`ln` for `f32` on stable, and `llvm.exp.f32` has no NVPTX lowering, so each helper
//! has two bodies:
//! - host: branch-free Rust (range reduction + polynomial, bit tricks + Newton steps) that LLVM vectorises when
//!   a kernel's inner loop calls it. Measured against f64 in `tests`: `exp` ≤ 2 ulp (relative error < 2.5e-7)
//!   on [-87, 88], `ln` relative error < 3e-7 on [1e-30, 1e30], `rsqrt` relative error < 3e-7.
//! - `nvptx64`: the PTX approximate instructions `ex2.approx.ftz.f32` (max relative error 2^-22 after the
//!   `x·log2 e` scaling, so a few ulp for |x| < 20), `lg2.approx.ftz.f32` and `rsqrt.approx.ftz.f32`.

/// `log2(e)`, the scale that turns `exp` into `exp2`.
pub const LOG2_E: f32 = core::f32::consts::LOG2_E;

/// `e^x`. Inputs below −87.33 give about 1.2e-38 (not 0), inputs above 88.72 give about 3.4e38 (not ∞); NaN
/// stays NaN. Callers use it on `x - max` (≤ 0) and on activations, where these limits are invisible.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    #[cfg(target_arch = "nvptx64")]
    {
        device::ex2(x * LOG2_E)
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        host_exp(x)
    }
}

/// Natural logarithm for positive finite `x` (callers pass a sum of exponentials, which is ≥ 1).
#[inline(always)]
pub fn ln(x: f32) -> f32 {
    #[cfg(target_arch = "nvptx64")]
    {
        device::lg2(x) * core::f32::consts::LN_2
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        host_ln(x)
    }
}

/// `1 / sqrt(x)` for positive `x`.
#[inline(always)]
pub fn rsqrt(x: f32) -> f32 {
    #[cfg(target_arch = "nvptx64")]
    {
        device::rsqrt(x)
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        host_rsqrt(x)
    }
}

/// `sqrt(x)` for `x ≥ 0`, with `sqrt(0) = 0`, `sqrt(∞) = ∞` and NaN for NaN or negative input.
///
/// Subnormal `x` is scaled by 2^24 first (and the root by 2^-12 after): the device's `rsqrt.approx.ftz`
/// flushes a subnormal input to zero, and `x · rsqrt(0)` would be `x · ∞ = ∞` (a tiny second moment in AdamW
/// would then freeze its parameter).
#[inline(always)]
pub fn sqrt(x: f32) -> f32 {
    const SCALE_UP: f32 = 16_777_216.0; // 2^24
    const SCALE_DOWN: f32 = 1.0 / 4096.0; // 2^-12
    if x == 0.0 || x == f32::INFINITY {
        x
    } else if x >= f32::MIN_POSITIVE {
        x * rsqrt(x)
    } else if x > 0.0 {
        let scaled = x * SCALE_UP;
        scaled * rsqrt(scaled) * SCALE_DOWN
    } else {
        f32::NAN
    }
}

/// The logistic function `1 / (1 + e^-x)`.
#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// `silu(x) = x · sigmoid(x)`.
#[inline(always)]
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `silu(x)` and its derivative `s · (1 + x · (1 − s))` with `s = sigmoid(x)`, sharing one `exp`.
#[inline(always)]
pub fn silu_and_grad(x: f32) -> (f32, f32) {
    let s = sigmoid(x);
    (x * s, s * (1.0 + x * (1.0 - s)))
}

/// `(sin x, cos x)` with one body on both sides (plain f32 arithmetic, no approximate instruction, so the host
/// and the device give the same bits): Cephes `sinf`/`cosf`: reduce by multiples of π/2 with a three-part
/// π/4, then degree-7 (sin) and degree-8 (cos) polynomials on [−π/4, π/4], the quadrant picked by selects.
/// Within 2 ulp of f64 plus the reduction's error for |x| ≤ 8192 (the three-part constant is exact while the
/// multiple of π/4 stays below 2^16, so it degrades slowly up to |x| ≈ 5·10^4); RoPE angles are positions
/// times frequencies ≤ 1, and the learning-rate schedule's are in [0, π].
#[inline(always)]
pub fn sin_cos(x: f32) -> (f32, f32) {
    const FOUR_OVER_PI: f32 = 1.273_239_5;
    const DP1: f32 = 0.785_156_25;
    const DP2: f32 = 2.418_756_5e-4;
    const DP3: f32 = 3.774_895e-8;
    let negative = x < 0.0;
    let a = if negative { -x } else { x };
    // The nearest even multiple of π/4, i.e. the nearest multiple of π/2 (`as` saturates, so no UB; `i32`
    // rather than `u32` because x86's vector conversion is signed: a `u32` one kept the host's RoPE loop scalar).
    let mut j = (a * FOUR_OVER_PI) as i32;
    j = j.wrapping_add(j & 1);
    let y = j as f32;
    let r = ((a - y * DP1) - y * DP2) - y * DP3;
    let z = r * r;
    let sin_r = ((-1.951_529_6e-4 * z + 8.332_161e-3) * z - 1.666_665_5e-1) * z * r + r;
    let cos_r =
        ((2.443_315_7e-5 * z - 1.388_731_6e-3) * z + 4.166_664_6e-2) * z * z - 0.5 * z + 1.0;
    // Quadrant q of the angle: (sin, cos) = (s, c), (c, −s), (−s, −c), (−c, s) for q = 0..4, written as selects
    // (no branch to mispredict when consecutive angles fall in different quadrants).
    let quadrant = (j >> 1) & 3;
    let swap = quadrant & 1 != 0;
    let (sin_a, cos_a) = (
        if swap { cos_r } else { sin_r },
        if swap { sin_r } else { cos_r },
    );
    let sin_negative = (quadrant >= 2) != negative;
    let cos_negative = quadrant == 1 || quadrant == 2;
    (
        if sin_negative { -sin_a } else { sin_a },
        if cos_negative { -cos_a } else { cos_a },
    )
}

/// Host `e^x`: Cephes `expf` (round `x·log2 e` to `n`, reduce by a two-part `ln 2`, degree-6 polynomial, scale
/// by `2^n` through the exponent bits). No branches, so loops over it vectorise.
#[cfg(not(target_arch = "nvptx64"))]
#[inline(always)]
fn host_exp(x: f32) -> f32 {
    const HI: f32 = 88.72283;
    const LO: f32 = -87.33654;
    // Adding 1.5·2^23 rounds to the nearest integer and leaves it in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // `<`/`>` keep NaN as NaN (f32::clamp would too, but these compile to blend-free min/max on x86).
    let x = if x > HI { HI } else { x };
    let x = if x < LO { LO } else { x };
    let shifted = x * LOG2_E + ROUND;
    let n = shifted - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let r2 = r * r;
    let p = 1.987_569_1e-4_f32;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 1.666_666_5e-1;
    let p = p * r + 0.5;
    let e_r = p * r2 + r + 1.0;
    // Low bits of `shifted` hold n (two's complement); the mantissa's top bit shifts out.
    let scale = f32::from_bits(shifted.to_bits().wrapping_add(127) << 23);
    e_r * scale
}

/// Host `ln(x)`: split `x = m · 2^e` with `m ∈ [√½, √2)`, then `ln m = 2·atanh((m−1)/(m+1))` by its odd series.
#[cfg(not(target_arch = "nvptx64"))]
#[inline(always)]
fn host_ln(x: f32) -> f32 {
    let bits = x.to_bits();
    // Re-bias so the mantissa lands in [√½, √2): subtract the bits of √½ before splitting.
    const SQRT_HALF_BITS: u32 = 0x3F35_04F3;
    let shifted = bits.wrapping_sub(SQRT_HALF_BITS);
    let e = (shifted as i32) >> 23;
    let m = f32::from_bits(bits.wrapping_sub((e as u32) << 23));
    let u = (m - 1.0) / (m + 1.0);
    let u2 = u * u;
    let series = 1.0 + u2 * (1.0 / 3.0 + u2 * (1.0 / 5.0 + u2 * (1.0 / 7.0 + u2 * (1.0 / 9.0))));
    2.0 * u * series + e as f32 * core::f32::consts::LN_2
}

/// Host `1/sqrt(x)`: the exponent-halving bit trick, then three Newton steps (error 3.4e-3 → 1.7e-5 → 5e-10,
/// then f32 rounding).
#[cfg(not(target_arch = "nvptx64"))]
#[inline(always)]
fn host_rsqrt(x: f32) -> f32 {
    let mut y = f32::from_bits(0x5F37_59DF_u32.wrapping_sub(x.to_bits() >> 1));
    let half = 0.5 * x;
    y *= 1.5 - half * y * y;
    y *= 1.5 - half * y * y;
    y *= 1.5 - half * y * y;
    y
}

#[cfg(target_arch = "nvptx64")]
mod device {
    //! The PTX approximate instructions behind the helpers above, through LLVM's NVVM intrinsics: LLVM knows
    //! they read no memory and have no side effects, so it may hoist, share and schedule them (an `asm!` block
    //! without `pure` options is a fixed point it must leave in place).

    unsafe extern "unadjusted" {
        #[link_name = "llvm.nvvm.ex2.approx.ftz.f"]
        fn nvvm_ex2_approx_ftz_f(x: f32) -> f32;
        #[link_name = "llvm.nvvm.lg2.approx.ftz.f"]
        fn nvvm_lg2_approx_ftz_f(x: f32) -> f32;
        #[link_name = "llvm.nvvm.rsqrt.approx.ftz.f"]
        fn nvvm_rsqrt_approx_ftz_f(x: f32) -> f32;
    }

    /// `ex2.approx.ftz.f32`: `2^x`.
    #[inline(always)]
    pub fn ex2(x: f32) -> f32 {
        // SAFETY: a pure register-to-register instruction.
        unsafe { nvvm_ex2_approx_ftz_f(x) }
    }

    /// `lg2.approx.ftz.f32`: `log2 x`.
    #[inline(always)]
    pub fn lg2(x: f32) -> f32 {
        // SAFETY: a pure register-to-register instruction.
        unsafe { nvvm_lg2_approx_ftz_f(x) }
    }

    /// `rsqrt.approx.ftz.f32`: `1 / sqrt(x)`.
    #[inline(always)]
    pub fn rsqrt(x: f32) -> f32 {
        // SAFETY: a pure register-to-register instruction.
        unsafe { nvvm_rsqrt_approx_ftz_f(x) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rel(a: f32, b: f64) -> f64 {
        ((a as f64 - b) / b).abs()
    }

    #[test]
    fn exp_is_within_two_ulp_of_f64() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            worst = worst.max(rel(exp(x), (x as f64).exp()));
            x += 0.001_37;
        }
        assert!(worst < 2.5e-7, "worst relative error {worst}");
        assert!(exp(f32::NAN).is_nan());
        assert!(exp(-1.0e4) < 1.0e-37);
    }

    #[test]
    fn ln_matches_f64() {
        let mut worst = 0.0f64;
        let mut x = 1.0e-30f32;
        while x < 1.0e30 {
            let reference = (x as f64).ln();
            // Relative error is meaningless near ln = 0; use absolute error there.
            let err = if reference.abs() < 1.0 {
                (ln(x) as f64 - reference).abs()
            } else {
                rel(ln(x), reference)
            };
            worst = worst.max(err);
            x *= 1.000_93;
        }
        assert!(worst < 3e-7, "worst error {worst}");
    }

    #[test]
    fn rsqrt_and_sqrt_match_f64() {
        let mut worst = 0.0f64;
        let mut x = 1.0e-30f32;
        while x < 1.0e30 {
            worst = worst.max(rel(rsqrt(x), 1.0 / (x as f64).sqrt()));
            worst = worst.max(rel(sqrt(x), (x as f64).sqrt()));
            x *= 1.001_7;
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        // Every subnormal scale, from the smallest (bit pattern 1) up to the smallest normal.
        let mut bits = 1u32;
        while bits < f32::MIN_POSITIVE.to_bits() {
            let x = f32::from_bits(bits);
            let err = rel(sqrt(x), (x as f64).sqrt());
            assert!(err < 3e-7, "sqrt({x:e}) = {} (error {err})", sqrt(x));
            bits += bits / 16 + 1;
        }
        assert_eq!(sqrt(0.0), 0.0);
        assert_eq!(sqrt(f32::INFINITY), f32::INFINITY);
        assert!(sqrt(f32::NAN).is_nan());
        assert!(sqrt(-1.0).is_nan());
    }

    #[test]
    fn sin_cos_matches_f64() {
        let mut worst = 0.0f64;
        let mut x = -8192.0f32;
        while x < 8192.0 {
            let (s, c) = sin_cos(x);
            let (rs, rc) = (x as f64).sin_cos();
            worst = worst.max((s as f64 - rs).abs()).max((c as f64 - rc).abs());
            x += 0.013_7;
        }
        assert!(worst < 2.5e-7, "worst absolute error {worst}");
        for x in [
            0.0f32,
            -0.0,
            1e-30,
            core::f32::consts::PI,
            -core::f32::consts::FRAC_PI_2,
        ] {
            let (s, c) = sin_cos(x);
            assert!((s as f64 - (x as f64).sin()).abs() < 1.2e-7, "sin {x}");
            assert!((c as f64 - (x as f64).cos()).abs() < 1.2e-7, "cos {x}");
        }
        assert!(sin_cos(f32::NAN).0.is_nan() && sin_cos(f32::NAN).1.is_nan());
    }

    #[test]
    fn silu_grad_matches_finite_difference() {
        for i in -400..400 {
            let x = i as f64 * 0.025;
            let f = |v: f64| v / (1.0 + (-v).exp());
            let h = 1e-5;
            let fd = (f(x + h) - f(x - h)) / (2.0 * h);
            let (value, grad) = silu_and_grad(x as f32);
            assert!((value as f64 - f(x)).abs() < 1e-6 * (1.0 + f(x).abs()));
            assert!((grad as f64 - fd).abs() < 1e-6, "x={x}: {grad} vs {fd}");
        }
    }
}
