//! Row reductions split over eight independent accumulators.
//!
//! A single running sum is a serial dependency that LLVM may not reorder (no fast-math), so a plain loop never
//! vectorises on the host. Eight lanes, combined at the end, give it an 8-wide vector body; on the GPU the
//! fixed-size lane arrays unroll into registers. The order of additions is fixed, so results are deterministic.

const LANES: usize = 8;

/// The maximum of `p[0..n]` (`-∞` for `n = 0`; NaN elements are skipped here and surface in the later sums).
///
/// # Safety
/// `p` holds `n` elements.
#[inline(always)]
pub(crate) unsafe fn max(p: *const f32, n: usize) -> f32 {
    let body = n - n % LANES;
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut i = 0;
    // SAFETY: every index read is below `n`.
    unsafe {
        while i < body {
            for (k, lane) in lanes.iter_mut().enumerate() {
                let v = *p.add(i + k);
                *lane = if v > *lane { v } else { *lane };
            }
            i += LANES;
        }
        let mut m = f32::NEG_INFINITY;
        for lane in lanes {
            m = if lane > m { lane } else { m };
        }
        while i < n {
            let v = *p.add(i);
            m = if v > m { v } else { m };
            i += 1;
        }
        m
    }
}

/// `Σ p[i]·q[i]` over `0..n`; pass the same pointer twice for squares.
///
/// # Safety
/// `p`, `q` hold `n` elements each.
#[inline(always)]
pub(crate) unsafe fn dot2(p: *const f32, q: *const f32, n: usize) -> f32 {
    let body = n - n % LANES;
    let mut lanes = [0.0f32; LANES];
    let mut i = 0;
    // SAFETY: every index read is below `n`.
    unsafe {
        while i < body {
            for (k, lane) in lanes.iter_mut().enumerate() {
                *lane += *p.add(i + k) * *q.add(i + k);
            }
            i += LANES;
        }
        let mut sum = lanes.iter().sum::<f32>();
        while i < n {
            sum += *p.add(i) * *q.add(i);
            i += 1;
        }
        sum
    }
}

/// `Σ p[i]·q[i]·r[i]` over `0..n`.
///
/// # Safety
/// `p`, `q`, `r` hold `n` elements each.
#[inline(always)]
pub(crate) unsafe fn dot3(p: *const f32, q: *const f32, r: *const f32, n: usize) -> f32 {
    let body = n - n % LANES;
    let mut lanes = [0.0f32; LANES];
    let mut i = 0;
    // SAFETY: every index read is below `n`.
    unsafe {
        while i < body {
            for (k, lane) in lanes.iter_mut().enumerate() {
                *lane += *p.add(i + k) * *q.add(i + k) * *r.add(i + k);
            }
            i += LANES;
        }
        let mut sum = lanes.iter().sum::<f32>();
        while i < n {
            sum += *p.add(i) * *q.add(i) * *r.add(i);
            i += 1;
        }
        sum
    }
}

/// `p[i] ← exp(p[i] − shift)` over `0..n`, returning the sum of the new values.
///
/// # Safety
/// `p` holds `n` elements.
#[inline(always)]
pub(crate) unsafe fn exp_shifted_in_place(p: *mut f32, n: usize, shift: f32) -> f32 {
    let body = n - n % LANES;
    let mut lanes = [0.0f32; LANES];
    let mut i = 0;
    // SAFETY: every index touched is below `n`.
    unsafe {
        while i < body {
            for (k, lane) in lanes.iter_mut().enumerate() {
                let e = crate::math::exp(*p.add(i + k) - shift);
                *p.add(i + k) = e;
                *lane += e;
            }
            i += LANES;
        }
        let mut sum = lanes.iter().sum::<f32>();
        while i < n {
            let e = crate::math::exp(*p.add(i) - shift);
            *p.add(i) = e;
            sum += e;
            i += 1;
        }
        sum
    }
}
