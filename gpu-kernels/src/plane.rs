//! Cooperative lanes: a *plane* of [`WIDTH`] lanes works on one row together (cubecl's plane operations are
//! the model). Kernels that reduce along a row (the vocabulary loss, RMSNorm, the reduction passes) are written
//! once over [`Plane`]:
//!
//! ```text
//!  GPU   one warp per row: lane l takes elements l, l + 32, l + 64, … (adjacent lanes read adjacent addresses,
//!        so every load is coalesced), folds them into a lane state, and `shfl.sync.bfly` combines the 32 states
//!  host  the same body with its lanes as a loop: 32 lane states in an array, filled in the same order, combined
//!        by the same butterfly tree, so a host run gives lane 0's bits (and the 32-wide loop vectorises)
//! ```
//!
//! Register rows ([`Plane::Row`]) keep a row of up to [`MAX_ROW`] elements across a loop (the attention's query,
//! accumulator and key rows): a [`LaneRow`] of 4 per lane on a warp, the whole row on the host, which handles it
//! 8 elements at a time.
//!
//! A butterfly gives every lane the same result when `combine` is commutative (floating-point `+`, `max` and
//! the online log-sum-exp pair are), so a body may use the reduced value on every lane without broadcasting it.
//! The order of additions is fixed by the lane split and the tree, so results are deterministic on both sides.

/// Lanes of a plane: the warp size of every NVIDIA GPU.
pub const WIDTH: usize = 32;

/// Elements of a register row ([`Plane::Row`]) each lane holds.
pub const ROW_SLOTS: usize = 4;

/// The longest row a plane keeps in registers: the attention's largest head dimension.
pub const MAX_ROW: usize = WIDTH * ROW_SLOTS;

/// One lane's share of a register row: element `lane + WIDTH · slot` in `slot` (the split of
/// [`Plane::for_each`]), so a lane's loads of a row are coalesced with its neighbours'.
pub type LaneRow = [f32; ROW_SLOTS];

/// A value lanes exchange in a reduction: `f32`, `f64`, or pairs of them.
pub trait LaneValue: Copy {
    /// The value of lane `lane ^ mask` (every lane of the warp calls it together).
    #[cfg(target_arch = "nvptx64")]
    fn shuffle_xor(self, mask: u32) -> Self;
}

impl LaneValue for f32 {
    #[cfg(target_arch = "nvptx64")]
    #[inline(always)]
    fn shuffle_xor(self, mask: u32) -> Self {
        f32::from_bits(device::shuffle_xor_b32(self.to_bits(), mask))
    }
}

impl LaneValue for u32 {
    #[cfg(target_arch = "nvptx64")]
    #[inline(always)]
    fn shuffle_xor(self, mask: u32) -> Self {
        device::shuffle_xor_b32(self, mask)
    }
}

impl LaneValue for f64 {
    #[cfg(target_arch = "nvptx64")]
    #[inline(always)]
    fn shuffle_xor(self, mask: u32) -> Self {
        let bits = self.to_bits();
        let lo = device::shuffle_xor_b32(bits as u32, mask) as u64;
        let hi = device::shuffle_xor_b32((bits >> 32) as u32, mask) as u64;
        f64::from_bits(hi << 32 | lo)
    }
}

impl<A: LaneValue, B: LaneValue> LaneValue for (A, B) {
    #[cfg(target_arch = "nvptx64")]
    #[inline(always)]
    fn shuffle_xor(self, mask: u32) -> Self {
        (self.0.shuffle_xor(mask), self.1.shuffle_xor(mask))
    }
}

/// The lanes working on one row.
pub trait Plane: Copy {
    /// Whether this is lane 0, the one that writes a row's single results (on the host: always).
    fn is_leader(self) -> bool;

    /// Folds `step` over `0..n`, each lane over its share (`i ≡ lane mod WIDTH`, ascending) starting from `init`;
    /// maps every lane's state with `lift` and combines the lanes with `combine` by a butterfly. Every lane
    /// returns the result (for a commutative `combine`, the same bits).
    fn reduce<S: Copy, T: LaneValue>(
        self,
        n: usize,
        init: S,
        step: impl FnMut(S, usize) -> S,
        lift: impl Fn(S) -> T,
        combine: impl Fn(T, T) -> T,
    ) -> T;

    /// Runs `body(i)` for every `i` in `0..n`, once, split over the lanes; bodies of different `i` must be
    /// independent (no lane reads what another writes).
    fn for_each(self, n: usize, body: impl FnMut(usize));

    /// `Σ f(i)` over `0..n` in f32.
    #[inline(always)]
    fn sum(self, n: usize, mut f: impl FnMut(usize) -> f32) -> f32 {
        self.reduce(n, 0.0f32, |acc, i| acc + f(i), |acc| acc, |a, b| a + b)
    }

    /// The first index of the largest `f(i)` over `0..n` (ties: the lowest index, as `torch.argmax`; NaN is
    /// never larger, so it is skipped), or 0 when `n = 0`.
    #[inline(always)]
    fn argmax(self, n: usize, mut f: impl FnMut(usize) -> f32) -> usize {
        let (_, index) = self.reduce(
            n,
            (f32::NEG_INFINITY, NO_INDEX),
            |state, i| fold_first_max(state, f(i), i),
            |pair| pair,
            first_max,
        );
        if index == NO_INDEX { 0 } else { index as usize }
    }

    /// A row of up to [`MAX_ROW`] elements in registers, split over the lanes as [`Plane::for_each`] splits
    /// indices (on the GPU a [`LaneRow`] per lane; on the host the whole row).
    type Row: Copy;

    /// A row of zeros.
    fn row_zero(self) -> Self::Row;

    /// The row `f(i)` for `i < n` (`n ≤ MAX_ROW`), zero beyond.
    fn row_load(self, n: usize, f: impl FnMut(usize) -> f32) -> Self::Row;

    /// Overwrites `row[i]` with `f(i)` for `i < n`, leaving the rest (a row reused across a loop keeps its zeros
    /// past `n` without re-zeroing or moving a whole row per iteration).
    fn row_load_into(self, row: &mut Self::Row, n: usize, f: impl FnMut(usize) -> f32);

    /// `Σ a[i] · b[i]` over `i < n`, summed in [`Plane::reduce`]'s order (each lane's share ascending, then
    /// the butterfly), so every plane gives the same bits; every lane returns it.
    fn row_dot(self, a: &Self::Row, b: &Self::Row, n: usize) -> f32;

    /// `acc[i] ← alpha · acc[i] + p · x[i]` for `i < n`.
    fn row_scale_add(self, acc: &mut Self::Row, alpha: f32, p: f32, x: &Self::Row, n: usize);

    /// `f(i, row[i])` for every `i < n`, each on the lane that holds it (to store a row).
    fn row_store(self, row: &Self::Row, n: usize, f: impl FnMut(usize, f32));

    /// The cross-entropy gradient of one row in place, in two passes: first the row's statistics in one online
    /// pass ([`RowStats`]: the maximum, `Σ e^(x − max)` and the first index of the maximum, each lane folding its
    /// share with [`fold_row_stats`] and the lanes combined by [`combine_row_stats`]), then
    /// `x[i] ← scale·softmax(x)[i] − scale·[i = label]` over the row, written over the logits and, where `x16` is
    /// not null, rounded to bf16 into `x16` in the same pass (the 16-bit operand of the product after it). A
    /// warp reads each logit once per pass, one `exp` each time; the host overrides it with the classic three
    /// passes (the maximum and its index, `exp` in place while summing, scale), one `exp` per element in loops
    /// it vectorises.
    ///
    /// # Safety
    /// `x` holds `n` elements, `x16` is null or holds `n`; `label < n`.
    #[inline(always)]
    unsafe fn softmax_gradient_in_place(
        self,
        x: *mut f32,
        x16: *mut u16,
        n: usize,
        label: usize,
        scale: f32,
    ) -> RowStats {
        // SAFETY: the caller's contract; each lane writes only the elements it read.
        unsafe {
            let ((max, sum), at) = self.reduce(
                n,
                ((f32::NEG_INFINITY, 0.0f32), NO_INDEX),
                |state, i| fold_row_stats(state, *x.add(i), i),
                |state| state,
                combine_row_stats,
            );
            let factor = scale / sum;
            self.for_each(n, |i| {
                let p = crate::math::exp(*x.add(i) - max) * factor;
                let g = if i == label { p - scale } else { p };
                *x.add(i) = g;
                if !x16.is_null() {
                    *x16.add(i) = crate::convert::f32_to_bf16_bits(g);
                }
            });
            RowStats::new(max, sum, at)
        }
    }
}

/// What the statistics pass of [`Plane::softmax_gradient_in_place`] finds in a row: enough for the loss
/// (`max + ln(sum)` is the log-sum-exp) and for the argmax hit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowStats {
    /// The largest element (NaN is never larger; −∞ for a row of −∞ and NaN only).
    pub max: f32,
    /// `Σ e^(x − max)`: NaN when the row holds a NaN (it surfaces here, not in the maximum).
    pub sum: f32,
    /// The first index of the largest element (`torch.argmax`'s tie rule; NaN skipped), 0 when every element
    /// is NaN.
    pub argmax: usize,
}

impl RowStats {
    #[inline(always)]
    fn new(max: f32, sum: f32, at: u32) -> Self {
        Self {
            max,
            sum,
            argmax: if at == NO_INDEX { 0 } else { at as usize },
        }
    }
}

/// The index of a lane state that has seen no element other than NaN.
const NO_INDEX: u32 = u32::MAX;

/// A lane's running `((max, Σ e^(x − max)), first index of max)`.
type LaneStats = ((f32, f32), u32);

/// One element `v` at index `i` into a lane's running `(max, first index of max)`: a lane visits its indices in
/// ascending order, so `>` keeps the first of equal maxima; NaN never grows the maximum; the first −∞ of a lane
/// is its first maximum (it is not larger than the initial −∞, and an all-−∞ row's argmax is its first index).
#[inline(always)]
pub fn fold_first_max((max, at): (f32, u32), v: f32, i: usize) -> (f32, u32) {
    if v > max || (at == NO_INDEX && v == max) {
        (v, i as u32)
    } else {
        (max, at)
    }
}

/// Two lanes' `(max, first index of max)` into one: the larger maximum, equal maxima the smaller index, a lane
/// without an index (it saw only NaN, or nothing) loses. Commutative, so every lane of a butterfly agrees.
#[inline(always)]
pub fn first_max(a: (f32, u32), b: (f32, u32)) -> (f32, u32) {
    let a_wins = b.1 == NO_INDEX || (a.1 != NO_INDEX && (a.0 > b.0 || (a.0 == b.0 && a.1 < b.1)));
    if a_wins { a } else { b }
}

/// One element `x` at index `i` into a lane's running statistics: the maximum and its index as
/// [`fold_first_max`], and one `exp`, of the smaller minus the larger, into the sum (NaN's makes it NaN). An
/// element equal to the maximum adds exactly 1, so −∞ after −∞ adds 1 instead of `e^(−∞ + ∞)` (a later finite
/// maximum rescales it to 0).
#[inline(always)]
pub fn fold_row_stats(((max, sum), at): LaneStats, x: f32, i: usize) -> LaneStats {
    let grows = x > max;
    let (hi, lo) = if grows { (x, max) } else { (max, x) };
    let e = if lo == hi {
        1.0
    } else {
        crate::math::exp(lo - hi)
    };
    let sum = if grows { sum * e + 1.0 } else { sum + e };
    let (_, at) = fold_first_max((max, at), x, i);
    ((hi, sum), at)
}

/// Two lanes' statistics into one: commutative (every lane of a butterfly gets the same bits); a lane that saw
/// no element (`(−∞, 0)`, no index) contributes nothing; the index as [`first_max`].
#[inline(always)]
pub fn combine_row_stats(a: LaneStats, b: LaneStats) -> LaneStats {
    let (((am, asum), ai), ((bm, bsum), bi)) = (a, b);
    let hi = if am > bm { am } else { bm };
    let scaled = |m: f32, s: f32| {
        if m == hi {
            s
        } else {
            s * crate::math::exp(m - hi)
        }
    };
    let (_, at) = first_max((am, ai), (bm, bi));
    ((hi, scaled(am, asum) + scaled(bm, bsum)), at)
}

/// Vector lanes of the host plane's register-row operations: rows are zero past their length, so whole groups
/// of 8 run (one AVX register), and the dot product keeps 8 partial sums.
const HOST_ROW_LANES: usize = 8;

/// The host plane: the lanes run as a loop on the calling thread. Its register rows ([`Plane::Row`]) are whole
/// rows handled 8 elements at a time: a dot product sums in another order than a warp's lanes (the one place,
/// with [`Plane::softmax_gradient_in_place`]'s sum of exponentials, where the host does not reproduce lane 0's
/// bits; results agree to rounding; its maximum and argmax are a warp's).
#[derive(Debug, Clone, Copy, Default)]
pub struct HostPlane;

impl Plane for HostPlane {
    type Row = [f32; MAX_ROW];

    #[inline(always)]
    fn is_leader(self) -> bool {
        true
    }

    #[inline(always)]
    fn row_zero(self) -> Self::Row {
        [0.0; MAX_ROW]
    }

    #[inline(always)]
    fn row_load(self, n: usize, mut f: impl FnMut(usize) -> f32) -> Self::Row {
        let mut row = [0.0; MAX_ROW];
        for (i, value) in row.iter_mut().enumerate().take(n) {
            *value = f(i);
        }
        row
    }

    #[inline(always)]
    fn row_load_into(self, row: &mut Self::Row, n: usize, mut f: impl FnMut(usize) -> f32) {
        for (i, value) in row.iter_mut().enumerate().take(n) {
            *value = f(i);
        }
    }

    #[inline(always)]
    fn row_dot(self, a: &Self::Row, b: &Self::Row, n: usize) -> f32 {
        let mut acc = [0.0f32; HOST_ROW_LANES];
        for (x, y) in a
            .chunks_exact(HOST_ROW_LANES)
            .zip(b.chunks_exact(HOST_ROW_LANES))
            .take(n.div_ceil(HOST_ROW_LANES))
        {
            for k in 0..HOST_ROW_LANES {
                acc[k] += x[k] * y[k];
            }
        }
        ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
    }

    #[inline(always)]
    fn row_scale_add(self, acc: &mut Self::Row, alpha: f32, p: f32, x: &Self::Row, n: usize) {
        for (a, v) in acc
            .chunks_exact_mut(HOST_ROW_LANES)
            .zip(x.chunks_exact(HOST_ROW_LANES))
            .take(n.div_ceil(HOST_ROW_LANES))
        {
            for k in 0..HOST_ROW_LANES {
                a[k] = alpha * a[k] + p * v[k];
            }
        }
    }

    #[inline(always)]
    fn row_store(self, row: &Self::Row, n: usize, mut f: impl FnMut(usize, f32)) {
        for (i, &value) in row.iter().enumerate().take(n) {
            f(i, value);
        }
    }

    #[inline(always)]
    fn reduce<S: Copy, T: LaneValue>(
        self,
        n: usize,
        init: S,
        mut step: impl FnMut(S, usize) -> S,
        lift: impl Fn(S) -> T,
        combine: impl Fn(T, T) -> T,
    ) -> T {
        let mut lanes = [init; WIDTH];
        let full = n - n % WIDTH;
        let mut base = 0;
        while base < full {
            for (lane, state) in lanes.iter_mut().enumerate() {
                *state = step(*state, base + lane);
            }
            base += WIDTH;
        }
        for (lane, state) in lanes.iter_mut().take(n - full).enumerate() {
            *state = step(*state, full + lane);
        }
        let mut values = [lift(init); WIDTH];
        for (value, state) in values.iter_mut().zip(lanes) {
            *value = lift(state);
        }
        // Lane 0's view of the butterfly: at distance d it combines its value with lane d's.
        let mut distance = WIDTH / 2;
        while distance > 0 {
            for lane in 0..distance {
                values[lane] = combine(values[lane], values[lane + distance]);
            }
            distance /= 2;
        }
        values[0]
    }

    #[inline(always)]
    fn for_each(self, n: usize, mut body: impl FnMut(usize)) {
        for i in 0..n {
            body(i);
        }
    }

    #[inline(always)]
    unsafe fn softmax_gradient_in_place(
        self,
        x: *mut f32,
        x16: *mut u16,
        n: usize,
        label: usize,
        scale: f32,
    ) -> RowStats {
        // SAFETY: the caller's contract; one thread, so the label's element is written after the scale pass.
        unsafe {
            // The maximum and its first index over the warp's lane split and tree (so the index is a warp's);
            // NaN is skipped here and surfaces in the sum, as in the online pass.
            let (max, at) = self.reduce(
                n,
                (f32::NEG_INFINITY, NO_INDEX),
                |state, i| fold_first_max(state, *x.add(i), i),
                |state| state,
                first_max,
            );
            let sum = self.sum(n, |i| {
                let e = crate::math::exp(*x.add(i) - max);
                *x.add(i) = e;
                e
            });
            let factor = scale / sum;
            for i in 0..n {
                *x.add(i) *= factor;
            }
            *x.add(label) -= scale;
            if !x16.is_null() {
                for i in 0..n {
                    *x16.add(i) = crate::convert::f32_to_bf16_bits(*x.add(i));
                }
            }
            RowStats::new(max, sum, at)
        }
    }
}

/// One warp of a GPU launch working on one row.
#[cfg(target_arch = "nvptx64")]
#[derive(Debug, Clone, Copy)]
pub struct Warp {
    lane: usize,
}

#[cfg(target_arch = "nvptx64")]
impl Warp {
    /// The warp of the calling thread, which is lane `lane` of it.
    ///
    /// # Safety
    /// Every lane of the warp runs the same body with this plane (the shuffles name all 32 lanes).
    #[inline(always)]
    pub unsafe fn new(lane: usize) -> Self {
        Self { lane }
    }
}

#[cfg(target_arch = "nvptx64")]
impl Plane for Warp {
    type Row = LaneRow;

    #[inline(always)]
    fn is_leader(self) -> bool {
        self.lane == 0
    }

    #[inline(always)]
    fn row_zero(self) -> Self::Row {
        [0.0; ROW_SLOTS]
    }

    #[inline(always)]
    fn row_load(self, n: usize, f: impl FnMut(usize) -> f32) -> Self::Row {
        lane_rows::load(self.lane, n, f)
    }

    #[inline(always)]
    fn row_load_into(self, row: &mut Self::Row, n: usize, f: impl FnMut(usize) -> f32) {
        lane_rows::load_into(self.lane, row, n, f)
    }

    #[inline(always)]
    fn row_dot(self, a: &Self::Row, b: &Self::Row, n: usize) -> f32 {
        let mut value = lane_rows::dot_partial(self.lane, a, b, n);
        let mut distance = WIDTH as u32 / 2;
        while distance > 0 {
            value += value.shuffle_xor(distance);
            distance /= 2;
        }
        value
    }

    #[inline(always)]
    fn row_scale_add(self, acc: &mut Self::Row, alpha: f32, p: f32, x: &Self::Row, n: usize) {
        lane_rows::scale_add(acc, alpha, p, x, n)
    }

    #[inline(always)]
    fn row_store(self, row: &Self::Row, n: usize, f: impl FnMut(usize, f32)) {
        lane_rows::store(self.lane, row, n, f)
    }

    #[inline(always)]
    fn reduce<S: Copy, T: LaneValue>(
        self,
        n: usize,
        init: S,
        mut step: impl FnMut(S, usize) -> S,
        lift: impl Fn(S) -> T,
        combine: impl Fn(T, T) -> T,
    ) -> T {
        let mut state = init;
        let mut i = self.lane;
        while i < n {
            state = step(state, i);
            i += WIDTH;
        }
        let mut value = lift(state);
        let mut distance = WIDTH as u32 / 2;
        while distance > 0 {
            value = combine(value, value.shuffle_xor(distance));
            distance /= 2;
        }
        value
    }

    #[inline(always)]
    fn for_each(self, n: usize, mut body: impl FnMut(usize)) {
        let mut i = self.lane;
        while i < n {
            body(i);
            i += WIDTH;
        }
    }
}

pub mod lane_rows {
    //! A lane's share of a register row ([`LaneRow`]), for planes whose lanes run one per thread (the warp,
    //! and the tests' simulated warps): loops over the constant [`ROW_SLOTS`], so the row stays in registers.
    use super::{LaneRow, ROW_SLOTS, WIDTH};

    /// Lane `lane`'s elements of the row `f(i)`, `i < n`, zero beyond.
    #[inline(always)]
    pub fn load(lane: usize, n: usize, f: impl FnMut(usize) -> f32) -> LaneRow {
        let mut row = [0.0; ROW_SLOTS];
        load_into(lane, &mut row, n, f);
        row
    }

    /// Overwrites lane `lane`'s elements below `n` with `f(i)`.
    #[inline(always)]
    pub fn load_into(lane: usize, row: &mut LaneRow, n: usize, mut f: impl FnMut(usize) -> f32) {
        for (slot, value) in row.iter_mut().enumerate() {
            let i = lane + WIDTH * slot;
            if i < n {
                *value = f(i);
            }
        }
    }

    /// Lane `lane`'s part of `Σ a[i] · b[i]`, its elements in ascending order from 0 (as `Plane::reduce`).
    #[inline(always)]
    pub fn dot_partial(lane: usize, a: &LaneRow, b: &LaneRow, n: usize) -> f32 {
        let mut sum = 0.0f32;
        for slot in 0..ROW_SLOTS {
            if lane + WIDTH * slot < n {
                sum += a[slot] * b[slot];
            }
        }
        sum
    }

    /// `acc ← alpha · acc + p · x` on the lane's elements below `n`.
    #[inline(always)]
    pub fn scale_add(acc: &mut LaneRow, alpha: f32, p: f32, x: &LaneRow, n: usize) {
        // Elements at or past `n` are zero in every row and stay zero; skipping them would only add branches.
        let _ = n;
        for slot in 0..ROW_SLOTS {
            acc[slot] = alpha * acc[slot] + p * x[slot];
        }
    }

    /// `f(i, row[slot])` for the lane's elements below `n`.
    #[inline(always)]
    pub fn store(lane: usize, row: &LaneRow, n: usize, mut f: impl FnMut(usize, f32)) {
        for (slot, &value) in row.iter().enumerate() {
            let i = lane + WIDTH * slot;
            if i < n {
                f(i, value);
            }
        }
    }
}

#[cfg(target_arch = "nvptx64")]
mod device {
    //! The warp shuffle, through LLVM's own NVVM intrinsic (`core::arch::nvptx` has none). LLVM declares the
    //! intrinsic `convergent`, so no pass moves or duplicates it into lane-divergent control flow; an inline
    //! `asm!` block carries no such attribute, and a pass that did would leave lanes out of the exchange.

    unsafe extern "unadjusted" {
        #[link_name = "llvm.nvvm.shfl.sync.bfly.i32"]
        fn nvvm_shfl_sync_bfly_i32(member_mask: u32, value: u32, lane_mask: u32, clamp: u32)
        -> u32;
    }

    /// `shfl.sync.bfly.b32` over the full warp: lane `l` gets lane `l ^ mask`'s `value`. The clamp operand is
    /// `0x1f` (the last lane of a 32-lane segment), not 32.
    #[inline(always)]
    pub fn shuffle_xor_b32(value: u32, mask: u32) -> u32 {
        // SAFETY: every lane of the warp executes the shuffle together (the `Warp::new` contract).
        unsafe { nvvm_shfl_sync_bfly_i32(u32::MAX, value, mask, 0x1f) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_plane_sums_lane_shares_then_the_tree() {
        for n in [0usize, 1, 31, 32, 33, 100, 1000] {
            let values: [f32; 1000] = core::array::from_fn(|i| (i as f32 * 0.37).sin());
            let got = HostPlane.sum(n, |i| values[i]);
            // The same order written out: lane sums ascending, then the halving tree.
            let mut lanes = [0.0f32; WIDTH];
            for i in 0..n {
                lanes[i % WIDTH] += values[i];
            }
            let mut d = WIDTH / 2;
            while d > 0 {
                for l in 0..d {
                    lanes[l] += lanes[l + d];
                }
                d /= 2;
            }
            assert_eq!(got.to_bits(), lanes[0].to_bits(), "n = {n}");
            let exact: f64 = values[..n].iter().map(|&v| v as f64).sum();
            assert!((got as f64 - exact).abs() < 1e-4, "n = {n}");
        }
    }

    #[test]
    fn for_each_visits_every_index_once() {
        let mut seen = [0u8; 77];
        HostPlane.for_each(77, |i| seen[i] += 1);
        assert!(seen.iter().all(|&s| s == 1));
    }
}
