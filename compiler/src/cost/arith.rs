//! The cost model's arithmetic: every formula runs in `u128` and a figure that does not fit in `u64` makes the
//! plan impossible. Shared by the per-family cost modules and the per-device totals.

/// Bytes of an f32.
pub(crate) const F32: u128 = 4;

/// The figure `x` in `u64`, `None` when it does not fit.
pub(crate) fn fit(x: u128) -> Option<u64> {
    u64::try_from(x).ok()
}

/// `x` widened for the formulas.
pub(crate) fn wide(x: usize) -> u128 {
    x as u128
}
