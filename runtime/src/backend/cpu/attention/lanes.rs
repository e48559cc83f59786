//! The attention kernels as the host runs them in the step: the same mathematics as the kernel table's bodies
//! (`draftpipe_gpu_kernels::attention`, which the GPU runs and `tests/kernels_attention.rs` checks on the host
//! too), laid out for a CPU's vector unit instead of a warp.
//!
//! ```text
//!  forward, dq   a tile of LANES query rows is the vector: the query rows sit transposed ([d][lane]), so a
//!                key's scores for the whole tile are head_dim multiply-adds of a broadcast key element, the
//!                softmax's exp runs on LANES scores at once, and the accumulator is updated the same way
//!  dk, dv        a tile of LANES keys is the vector, the query rows that see them one at a time
//! ```
//!
//! A warp spreads one row over its lanes and reduces across them; on a CPU that reduction (a horizontal sum per
//! query per key) and a scalar `exp` per score cost more than the arithmetic, which this layout never needs.
//! Rows are taken [`CHUNK`] at a time: the online softmax rescales once per chunk, and the accumulators are
//! loaded and stored once per chunk. Tiles are independent
//! (each writes its own rows), so they split over the drafter's threads like any launch.
//!
//! Masked scores are never exponentiated into a tiny non-zero: their probability is selected as exactly 0.

use draftpipe_gpu_kernels::math::{exp, ln};

use crate::backend::attention::AttentionShape;
use crate::backend::cpu::kernels::{SharedPtr, for_each_part};

/// Rows (queries or keys) per tile: the vector width of AVX2 in f32.
pub const LANES: usize = 8;

/// Rows (keys in the forward and `dq`, queries in `dk`/`dv`) taken at once: one online-softmax rescale per
/// chunk, and each accumulator row loaded and stored once per chunk.
const CHUNK: usize = 16;

/// The largest head dimension (the kernels' `MAX_ROW`).
const MAX_HEAD_DIM: usize = draftpipe_gpu_kernels::plane::MAX_ROW;

type Lanes = [f32; LANES];

/// The attention inputs as raw pointers shared by the tiles (lengths checked by the caller).
#[derive(Clone, Copy)]
pub(super) struct Inputs {
    pub(super) q: *const f32,
    pub(super) k: [*const f32; 2],
    pub(super) v: [*const f32; 2],
    pub(super) query_ranges: *const u32,
    /// Rows of each key set: context, block.
    pub(super) keys: [usize; 2],
    pub(super) queries: usize,
    pub(super) shape: AttentionShape,
}

// SAFETY: the pointers are only read, and the callers of `forward`/`backward` keep the buffers alive and
// unwritten for the call.
unsafe impl Sync for Inputs {}
// SAFETY: as above.
unsafe impl Sync for Saved {}

impl Inputs {
    /// Key set `set`'s range `[start, end)` for query `r`, clamped to the set.
    ///
    /// # Safety
    /// `r < queries`.
    #[inline(always)]
    unsafe fn range(&self, r: usize, set: usize) -> (u32, u32) {
        // SAFETY: the caller's contract; `query_ranges` holds `4 · queries` elements.
        let (start, end) = unsafe {
            (
                *self.query_ranges.add(4 * r + 2 * set),
                *self.query_ranges.add(4 * r + 2 * set + 1),
            )
        };
        let end = end.min(self.keys[set] as u32);
        (start.min(end), end)
    }

    /// A tile's query rows: per key set, the lanes' ranges (empty for lanes past the last row).
    ///
    /// # Safety
    /// `first < queries`.
    #[inline(always)]
    unsafe fn tile_ranges(&self, first: usize) -> [LaneRanges; 2] {
        std::array::from_fn(|set| {
            let mut ranges = LaneRanges::EMPTY;
            for t in 0..LANES.min(self.queries - first) {
                // SAFETY: `first + t < queries`.
                let (start, end) = unsafe { self.range(first + t, set) };
                ranges.set(t, start, end);
            }
            ranges
        })
    }

    /// Loads rows `first..first + LANES` (those below `queries`) of head `head` of `[queries, heads, head_dim]`
    /// transposed into `rows[d][lane]`, times `factor`; lanes past the end stay 0.
    ///
    /// # Safety
    /// `src` holds `[queries, heads, head_dim]`.
    #[inline(always)]
    unsafe fn load_tile(
        &self,
        src: *const f32,
        first: usize,
        head: usize,
        factor: f32,
        rows: &mut [Lanes],
    ) {
        let (heads, head_dim) = (self.shape.heads, self.shape.head_dim);
        for t in 0..LANES.min(self.queries - first) {
            // SAFETY: row `first + t < queries`, head `head < heads`.
            let row = unsafe { src.add(((first + t) * heads + head) * head_dim) };
            for (d, lanes) in rows.iter_mut().enumerate().take(head_dim) {
                // SAFETY: `d < head_dim`.
                lanes[t] = unsafe { *row.add(d) } * factor;
            }
        }
    }
}

/// Each lane's range `[start, end)` (of the keys a query sees, or of the queries that see a key), and their
/// union `lo..hi` (empty when every range is).
#[derive(Clone, Copy)]
struct LaneRanges {
    starts: [u32; LANES],
    ends: [u32; LANES],
    lo: usize,
    hi: usize,
}

impl LaneRanges {
    const EMPTY: Self = Self {
        starts: [0; LANES],
        ends: [0; LANES],
        lo: usize::MAX,
        hi: 0,
    };

    #[inline(always)]
    fn set(&mut self, lane: usize, start: u32, end: u32) {
        (self.starts[lane], self.ends[lane]) = (start, end);
        if start < end {
            self.lo = self.lo.min(start as usize);
            self.hi = self.hi.max(end as usize);
        }
    }

    /// Whether each lane's range holds `j`.
    #[inline(always)]
    fn holds(&self, j: usize) -> [bool; LANES] {
        let j = j as u32;
        std::array::from_fn(|t| self.starts[t] <= j && j < self.ends[t])
    }
}

/// `head_dim` zeroed rows of lanes in `storage` (only those are written: zeroing all [`MAX_HEAD_DIM`] rows of
/// every tile's four arrays was 2% of a DFlash step).
#[inline(always)]
fn zeroed(
    storage: &mut [std::mem::MaybeUninit<Lanes>; MAX_HEAD_DIM],
    head_dim: usize,
) -> &mut [Lanes] {
    let rows = &mut storage[..head_dim];
    for row in rows.iter_mut() {
        row.write([0.0; LANES]);
    }
    // SAFETY: the first `head_dim` rows were just written.
    unsafe { &mut *(rows as *mut [std::mem::MaybeUninit<Lanes>] as *mut [Lanes]) }
}

/// Uninitialised storage for [`zeroed`].
#[inline(always)]
fn rows_storage() -> [std::mem::MaybeUninit<Lanes>; MAX_HEAD_DIM] {
    [const { std::mem::MaybeUninit::uninit() }; MAX_HEAD_DIM]
}

/// `a · b + c`: fused where the CPU has FMA (one rounding, one instruction), two operations otherwise. Each
/// kernel is compiled once per choice, so results are deterministic on a given CPU.
pub(super) trait MulAdd {
    /// `a · b + c`.
    fn mul_add(a: f32, b: f32, c: f32) -> f32;
}

/// Fused multiply-add (only called from code compiled with the `fma` feature).
pub(super) struct Fused;

impl MulAdd for Fused {
    #[inline(always)]
    fn mul_add(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
}

/// A multiply, then an add.
pub(super) struct Separate;

impl MulAdd for Separate {
    #[inline(always)]
    fn mul_add(a: f32, b: f32, c: f32) -> f32 {
        a * b + c
    }
}

/// Rows whose dot products [`chunk_dots`] computes in one pass over `d`: their sums are independent, so one
/// row's multiply-adds do not wait on each other. Taken one row at a time, each dot was one chain of `head_dim`
/// dependent multiply-adds (4 cycles each), which left the FMA units idle most of the time.
const DOT_GROUP: usize = 4;

/// `Σ_d rows[d][lane] · at[n][d]` for every lane and each of the `N` rows `at[n]` (the sums stay in registers
/// across `d`, each in the order of `d`).
///
/// # Safety
/// Every `at[n]` holds `head_dim` elements.
#[inline(always)]
unsafe fn group_dots<F: MulAdd, const N: usize>(
    rows: &[Lanes],
    at: [*const f32; N],
    head_dim: usize,
) -> [Lanes; N] {
    let mut dots = [[0.0; LANES]; N];
    for (d, lanes) in rows.iter().enumerate().take(head_dim) {
        for (dot, row) in dots.iter_mut().zip(&at) {
            // SAFETY: `d < head_dim`.
            let x = unsafe { *row.add(d) };
            for t in 0..LANES {
                dot[t] = F::mul_add(lanes[t], x, dot[t]);
            }
        }
    }
    dots
}

/// `Σ_d rows[d][lane] · at(c)[d]` for every lane and each row `c < count` of a chunk, [`DOT_GROUP`] rows per
/// pass (rows from `count` on stay 0).
///
/// # Safety
/// Every `at(c)` for `c < count` holds `head_dim` elements; `count ≤ CHUNK`.
#[inline(always)]
unsafe fn chunk_dots<F: MulAdd>(
    rows: &[Lanes],
    count: usize,
    at: impl Fn(usize) -> *const f32,
    head_dim: usize,
) -> [Lanes; CHUNK] {
    let mut dots = [[0.0; LANES]; CHUNK];
    let mut c = 0;
    while c + DOT_GROUP <= count {
        // SAFETY: the caller's contract, rows `c..c + DOT_GROUP` below `count`.
        let group = unsafe {
            group_dots::<F, DOT_GROUP>(rows, std::array::from_fn(|g| at(c + g)), head_dim)
        };
        dots[c..c + DOT_GROUP].copy_from_slice(&group);
        c += DOT_GROUP;
    }
    for (c, dot) in dots.iter_mut().enumerate().take(count).skip(c) {
        // SAFETY: as above, row `c < count`.
        *dot = unsafe { group_dots::<F, 1>(rows, [at(c)], head_dim) }[0];
    }
    dots
}

/// Elements `d` of the accumulator rows that [`lane_axpys`] updates in one pass over a chunk's rows: their sums
/// are independent. One `d` at a time was one chain of `count` dependent multiply-adds per element.
const AXPY_GROUP: usize = 8;

/// `rows[n][lane] += Σ_c weights[c][lane] · sources[c][d0 + n]` for the `N` rows `rows` (elements `d0..d0 + N`
/// of the accumulator), each sum in the order of `c`.
///
/// # Safety
/// Every `sources[c]` for `c < count` holds `d0 + N` elements.
#[inline(always)]
unsafe fn group_axpys<F: MulAdd, const N: usize>(
    rows: &mut [Lanes],
    weights: &[Lanes],
    sources: &[*const f32],
    count: usize,
    d0: usize,
) {
    let mut acc: [Lanes; N] = std::array::from_fn(|n| rows[n]);
    for (weights, source) in weights.iter().zip(sources).take(count) {
        for (n, acc) in acc.iter_mut().enumerate() {
            // SAFETY: `d0 + n < d0 + N` inside row `c < count`.
            let x = unsafe { *source.add(d0 + n) };
            for t in 0..LANES {
                acc[t] = F::mul_add(weights[t], x, acc[t]);
            }
        }
    }
    rows[..N].copy_from_slice(&acc);
}

/// `rows[d][lane] += Σ_c weights[c][lane] · row_c[d]` over the `count` rows `row_c = at(c)`: each `rows[d]` is
/// loaded and stored once per chunk, not once per row, [`AXPY_GROUP`] of them per pass.
///
/// # Safety
/// Every `at(c)` for `c < count` holds `head_dim` elements; `count ≤ weights.len()`.
#[inline(always)]
unsafe fn lane_axpys<F: MulAdd>(
    rows: &mut [Lanes],
    weights: &[Lanes],
    count: usize,
    at: impl Fn(usize) -> *const f32,
    head_dim: usize,
) {
    let mut sources = [std::ptr::null::<f32>(); CHUNK];
    for (c, source) in sources.iter_mut().enumerate().take(count) {
        *source = at(c);
    }
    let rows = &mut rows[..head_dim];
    let grouped = head_dim - head_dim % AXPY_GROUP;
    for d0 in (0..grouped).step_by(AXPY_GROUP) {
        // SAFETY: the caller's contract, elements `d0..d0 + AXPY_GROUP ≤ head_dim`.
        unsafe {
            group_axpys::<F, AXPY_GROUP>(&mut rows[d0..], weights, &sources, count, d0);
        }
    }
    for d in grouped..head_dim {
        // SAFETY: as above, element `d < head_dim`.
        unsafe { group_axpys::<F, 1>(&mut rows[d..], weights, &sources, count, d) };
    }
}

/// Stores `rows[d][lane] · factor[lane]` into rows `first..` of head `head` of `[n, heads, head_dim]`.
///
/// # Safety
/// `dst` holds `[n, heads, head_dim]` and `first < n`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn store_tile(
    dst: *mut f32,
    rows: &[Lanes],
    factor: &Lanes,
    (first, n): (usize, usize),
    head: usize,
    heads: usize,
    head_dim: usize,
) {
    for t in 0..LANES.min(n - first) {
        // SAFETY: row `first + t < n`.
        let row = unsafe { dst.add(((first + t) * heads + head) * head_dim) };
        for (d, lanes) in rows.iter().enumerate().take(head_dim) {
            // SAFETY: `d < head_dim`.
            unsafe { *row.add(d) = lanes[t] * factor[t] };
        }
    }
}

/// Forward of query tile `tile`, head `head`: `out` rows and `lse`.
///
/// # Safety
/// The buffers hold the module's layouts; `tile · LANES < queries`.
#[inline(always)]
unsafe fn forward_tile<F: MulAdd>(
    inputs: &Inputs,
    out: *mut f32,
    lse: *mut f32,
    tile: usize,
    head: usize,
) {
    let AttentionShape {
        heads,
        kv_heads,
        head_dim,
        scale,
    } = inputs.shape;
    let group = head / (heads / kv_heads);
    let first = tile * LANES;
    let (mut q, mut acc) = (rows_storage(), rows_storage());
    let (q, acc) = (zeroed(&mut q, head_dim), zeroed(&mut acc, head_dim));
    let (mut max, mut sum) = ([f32::NEG_INFINITY; LANES], [0.0f32; LANES]);
    // SAFETY (whole body): rows and keys stay below the sizes the caller checked.
    unsafe {
        inputs.load_tile(inputs.q, first, head, scale, q);
        for (set, ranges) in inputs.tile_ranges(first).into_iter().enumerate() {
            let (keys, values) = (inputs.k[set], inputs.v[set]);
            let row = |j: usize| (j * kv_heads + group) * head_dim;
            let mut j = ranges.lo;
            while j < ranges.hi {
                let chunk = CHUNK.min(ranges.hi - j);
                let mut scores = [[f32::NEG_INFINITY; LANES]; CHUNK];
                let mut chunk_max = max;
                let dots = chunk_dots::<F>(q, chunk, |c| keys.add(row(j + c)), head_dim);
                for (c, (scores, dots)) in scores.iter_mut().zip(&dots).enumerate().take(chunk) {
                    let seen = ranges.holds(j + c);
                    for t in 0..LANES {
                        if seen[t] {
                            scores[t] = dots[t];
                            // A NaN score is taken too, and then poisons the row as on the GPU.
                            if dots[t] > chunk_max[t] || dots[t].is_nan() {
                                chunk_max[t] = dots[t];
                            }
                        }
                    }
                }
                let mut alpha = [1.0; LANES];
                for t in 0..LANES {
                    let shift = if chunk_max[t] == max[t] {
                        0.0
                    } else {
                        max[t] - chunk_max[t]
                    };
                    alpha[t] = exp(shift);
                    sum[t] *= alpha[t];
                }
                for lanes in acc.iter_mut() {
                    for t in 0..LANES {
                        lanes[t] *= alpha[t];
                    }
                }
                // Unseen keys hold −∞, seen ones a finite maximum: the select keeps masked probabilities at 0.
                let mut probabilities = [[0.0; LANES]; CHUNK];
                for (p, scores) in probabilities.iter_mut().zip(&scores).take(chunk) {
                    for t in 0..LANES {
                        let e = exp(scores[t] - chunk_max[t]);
                        p[t] = if scores[t] == f32::NEG_INFINITY {
                            0.0
                        } else {
                            e
                        };
                        sum[t] += p[t];
                    }
                }
                lane_axpys::<F>(
                    acc,
                    &probabilities,
                    chunk,
                    |c| values.add(row(j + c)),
                    head_dim,
                );
                max = chunk_max;
                j += chunk;
            }
        }
        let inv: Lanes = std::array::from_fn(|t| if sum[t] > 0.0 { 1.0 / sum[t] } else { 0.0 });
        store_tile(
            out,
            acc,
            &inv,
            (first, inputs.queries),
            head,
            heads,
            head_dim,
        );
        for t in 0..LANES.min(inputs.queries - first) {
            *lse.add((first + t) * heads + head) = if sum[t] > 0.0 {
                max[t] + ln(sum[t])
            } else {
                f32::NEG_INFINITY
            };
        }
    }
}

/// What the backward reads besides the forward's inputs.
#[derive(Clone, Copy)]
pub(super) struct Saved {
    pub(super) dout: *const f32,
    pub(super) lse: *const f32,
    pub(super) delta: *const f32,
    /// `[keys, 2]` query ranges per key, per set.
    pub(super) key_ranges: [*const u32; 2],
}

/// `dq` of query tile `tile`, head `head`: `scale · Σ_k p (dout·v − delta) k`.
///
/// # Safety
/// As [`forward_tile`]; `saved` holds the backward's layouts.
#[inline(always)]
unsafe fn query_grad_tile<F: MulAdd>(
    inputs: &Inputs,
    saved: &Saved,
    dq: *mut f32,
    tile: usize,
    head: usize,
) {
    let AttentionShape {
        heads,
        kv_heads,
        head_dim,
        scale,
    } = inputs.shape;
    let group = head / (heads / kv_heads);
    let first = tile * LANES;
    let (mut q, mut dout, mut grad) = (rows_storage(), rows_storage(), rows_storage());
    let (q, dout) = (zeroed(&mut q, head_dim), zeroed(&mut dout, head_dim));
    let grad = zeroed(&mut grad, head_dim);
    let (mut lse, mut delta) = ([0.0f32; LANES], [0.0f32; LANES]);
    // SAFETY (whole body): rows and keys stay below the sizes the caller checked.
    unsafe {
        inputs.load_tile(inputs.q, first, head, scale, q);
        inputs.load_tile(saved.dout, first, head, 1.0, dout);
        for t in 0..LANES.min(inputs.queries - first) {
            lse[t] = *saved.lse.add((first + t) * heads + head);
            delta[t] = *saved.delta.add((first + t) * heads + head);
        }
        for (set, ranges) in inputs.tile_ranges(first).into_iter().enumerate() {
            let (keys, values) = (inputs.k[set], inputs.v[set]);
            let row = |j: usize| (j * kv_heads + group) * head_dim;
            let mut j = ranges.lo;
            while j < ranges.hi {
                let chunk = CHUNK.min(ranges.hi - j);
                let mut ds = [[0.0; LANES]; CHUNK];
                let scores = chunk_dots::<F>(q, chunk, |c| keys.add(row(j + c)), head_dim);
                let dp = chunk_dots::<F>(dout, chunk, |c| values.add(row(j + c)), head_dim);
                for (c, ds) in ds.iter_mut().enumerate().take(chunk) {
                    let (scores, dp) = (&scores[c], &dp[c]);
                    let seen = ranges.holds(j + c);
                    for t in 0..LANES {
                        let p = exp(scores[t] - lse[t]);
                        ds[t] = if seen[t] { p * (dp[t] - delta[t]) } else { 0.0 };
                    }
                }
                lane_axpys::<F>(grad, &ds, chunk, |c| keys.add(row(j + c)), head_dim);
                j += chunk;
            }
        }
        store_tile(
            dq,
            grad,
            &[scale; LANES],
            (first, inputs.queries),
            head,
            heads,
            head_dim,
        );
    }
}

/// `dk`, `dv` of key tile `tile` of key set `set`, kv head `group`: `dv = Σ_q p dout`,
/// `dk = scale · Σ_q p (dout·v − delta) q`, over the query heads of the group.
///
/// # Safety
/// As [`query_grad_tile`]; `dk`, `dv` hold `[keys of set, kv_heads, head_dim]`.
#[inline(always)]
unsafe fn key_grad_tile<F: MulAdd>(
    inputs: &Inputs,
    saved: &Saved,
    (dk, dv): (*mut f32, *mut f32),
    set: usize,
    tile: usize,
    group: usize,
) {
    let AttentionShape {
        heads,
        kv_heads,
        head_dim,
        scale,
    } = inputs.shape;
    let (keys, first) = (inputs.keys[set], tile * LANES);
    let per_group = heads / kv_heads;
    let (mut k, mut v) = (rows_storage(), rows_storage());
    let (mut dk_rows, mut dv_rows) = (rows_storage(), rows_storage());
    let (k, v) = (zeroed(&mut k, head_dim), zeroed(&mut v, head_dim));
    let (dk_rows, dv_rows) = (
        zeroed(&mut dk_rows, head_dim),
        zeroed(&mut dv_rows, head_dim),
    );
    let mut ranges = LaneRanges::EMPTY;
    // SAFETY (whole body): keys below `keys`, query rows clamped to `queries`.
    unsafe {
        let key_inputs = Inputs {
            queries: keys,
            shape: AttentionShape {
                heads: kv_heads,
                ..inputs.shape
            },
            ..*inputs
        };
        // The queries' rows are unscaled here, so the keys carry the scale of the scores.
        key_inputs.load_tile(inputs.k[set], first, group, scale, k);
        key_inputs.load_tile(inputs.v[set], first, group, 1.0, v);
        for t in 0..LANES.min(keys - first) {
            let range = saved.key_ranges[set].add(2 * (first + t));
            let end = (*range.add(1)).min(inputs.queries as u32);
            ranges.set(t, (*range).min(end), end);
        }
        for head in group * per_group..(group + 1) * per_group {
            let row = |r: usize| (r * heads + head) * head_dim;
            let mut r = ranges.lo;
            while r < ranges.hi {
                let chunk = CHUNK.min(ranges.hi - r);
                let mut p = [[0.0; LANES]; CHUNK];
                let mut ds = [[0.0; LANES]; CHUNK];
                let scores = chunk_dots::<F>(k, chunk, |c| inputs.q.add(row(r + c)), head_dim);
                let dp = chunk_dots::<F>(v, chunk, |c| saved.dout.add(row(r + c)), head_dim);
                for c in 0..chunk {
                    let at = r + c;
                    let (scores, dp) = (&scores[c], &dp[c]);
                    let (lse, delta) = (
                        *saved.lse.add(at * heads + head),
                        *saved.delta.add(at * heads + head),
                    );
                    let seen = ranges.holds(at);
                    for t in 0..LANES {
                        let e = exp(scores[t] - lse);
                        p[c][t] = if seen[t] { e } else { 0.0 };
                        ds[c][t] = p[c][t] * (dp[t] - delta);
                    }
                }
                lane_axpys::<F>(dv_rows, &p, chunk, |c| saved.dout.add(row(r + c)), head_dim);
                lane_axpys::<F>(dk_rows, &ds, chunk, |c| inputs.q.add(row(r + c)), head_dim);
                r += chunk;
            }
        }
        let key_ends = (first, keys);
        store_tile(
            dk,
            dk_rows,
            &[scale; LANES],
            key_ends,
            group,
            kv_heads,
            head_dim,
        );
        store_tile(
            dv,
            dv_rows,
            &[1.0; LANES],
            key_ends,
            group,
            kv_heads,
            head_dim,
        );
    }
}

/// Runs `tile::<F>(index)` for every tile over the drafter's threads, compiled with FMA (and AVX2) where the CPU
/// has them.
fn for_each_tile<T: TileKernel + Sync>(count: usize, tile: &T) {
    #[cfg(target_arch = "x86_64")]
    let wide = std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma");
    for_each_part(count, |part| {
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx2,fma")]
            fn run_wide<T: TileKernel>(part: std::ops::Range<usize>, tile: &T) {
                for index in part {
                    tile.run::<Fused>(index);
                }
            }
            if wide {
                // SAFETY: the CPU has AVX2 and FMA (checked above).
                return unsafe { run_wide(part, tile) };
            }
        }
        for index in part {
            tile.run::<Separate>(index);
        }
    });
}

/// One of the three tile kernels with its arguments.
trait TileKernel {
    /// Runs tile `index`.
    fn run<F: MulAdd>(&self, index: usize);
}

/// The forward's tiles: `(query tile, head)`.
struct ForwardTiles {
    inputs: Inputs,
    out: SharedPtr<*mut f32>,
    lse: SharedPtr<*mut f32>,
}

impl TileKernel for ForwardTiles {
    #[inline(always)]
    fn run<F: MulAdd>(&self, index: usize) {
        let heads = self.inputs.shape.heads;
        // SAFETY: `forward`'s contract; tiles write disjoint rows.
        unsafe {
            forward_tile::<F>(
                &self.inputs,
                self.out.get(),
                self.lse.get(),
                index / heads,
                index % heads,
            )
        }
    }
}

/// The query-gradient tiles: `(query tile, head)`.
struct QueryGradTiles {
    inputs: Inputs,
    saved: Saved,
    dq: SharedPtr<*mut f32>,
}

impl TileKernel for QueryGradTiles {
    #[inline(always)]
    fn run<F: MulAdd>(&self, index: usize) {
        let heads = self.inputs.shape.heads;
        // SAFETY: `backward`'s contract; tiles write disjoint rows.
        unsafe {
            query_grad_tile::<F>(
                &self.inputs,
                &self.saved,
                self.dq.get(),
                index / heads,
                index % heads,
            )
        }
    }
}

/// The key-gradient tiles of one key set: `(key tile, kv head)`.
struct KeyGradTiles {
    inputs: Inputs,
    saved: Saved,
    set: usize,
    dk: SharedPtr<*mut f32>,
    dv: SharedPtr<*mut f32>,
}

impl TileKernel for KeyGradTiles {
    #[inline(always)]
    fn run<F: MulAdd>(&self, index: usize) {
        let kv_heads = self.inputs.shape.kv_heads;
        let grads = (self.dk.get(), self.dv.get());
        // SAFETY: `backward`'s contract; tiles write disjoint key rows.
        unsafe {
            key_grad_tile::<F>(
                &self.inputs,
                &self.saved,
                grads,
                self.set,
                index / kv_heads,
                index % kv_heads,
            )
        }
    }
}

/// Attention forward into `out [Q, heads, head_dim]` and `lse [Q, heads]`.
///
/// # Safety
/// `inputs` point at buffers of the module's layouts; `out` and `lse` hold `[Q, heads, head_dim]` and
/// `[Q, heads]` and overlap nothing the inputs point at.
pub(super) unsafe fn forward(inputs: Inputs, out: *mut f32, lse: *mut f32) {
    let tiles = inputs.queries.div_ceil(LANES) * inputs.shape.heads;
    let (out, lse) = (SharedPtr(out), SharedPtr(lse));
    for_each_tile(tiles, &ForwardTiles { inputs, out, lse });
}

/// Attention backward: `dq` and, per key set, `dk` and `dv` (each overwritten); `saved.delta` already holds
/// `rowsum(dout ∘ out)`.
///
/// # Safety
/// As [`forward`], with `saved` and the gradients of the module's layouts, the gradients overlapping nothing.
pub(super) unsafe fn backward(
    inputs: Inputs,
    saved: Saved,
    dq: *mut f32,
    key_grads: [(*mut f32, *mut f32); 2],
) {
    let AttentionShape {
        heads, kv_heads, ..
    } = inputs.shape;
    let tiles = inputs.queries.div_ceil(LANES) * heads;
    let dq = SharedPtr(dq);
    for_each_tile(tiles, &QueryGradTiles { inputs, saved, dq });
    for (set, (dk, dv)) in key_grads.into_iter().enumerate() {
        let (dk, dv) = (SharedPtr(dk), SharedPtr(dv));
        let tiles = inputs.keys[set].div_ceil(LANES) * kv_heads;
        for_each_tile(
            tiles,
            &KeyGradTiles {
                inputs,
                saved,
                set,
                dk,
                dv,
            },
        );
    }
}
