//! DFlash attention on tensor cores in FlashAttention-2's form: bf16 Q/K/V, `mma.m16n8k16` for every product,
//! K/V tiles through shared memory and `ldmatrix`, an online softmax in f32 and the log-sum-exp saved.
//!
//! ```text
//!  forward     flash_forward     block per (DFlash block of 16 query rows, kv head); warp w = query head
//!                                kv·G + w (G = heads / kv_heads): its 16 rows are one m16 tile, Q in registers;
//!                                context key tiles [ctx_start, anchor) of KEY_TILE keys (the last one partial,
//!                                masked), then the block's own ≤ 16 keys: S = QKᵀ, online softmax, O += PV;
//!                                out = O / l, lse = m + ln l
//!  backward    flash_backward_q  same blocks: D = rowsum(dO ∘ O) (saved), P recomputed from lse, dP = dO Vᵀ,
//!                                dS = P ∘ (dP − D), dQ = scale · dS K
//!              flash_backward_kv block per (tile of KV_TILE keys, kv head), 4 warps of 16 keys each, over the
//!                                query rows that see the tile (16 at a time, every head of the group):
//!                                Pᵀ = exp(scale · K Qᵀ − lse), dV = Pᵀ dO, dPᵀ = V dOᵀ, dSᵀ = Pᵀ ∘ (dPᵀ − D),
//!                                dK = scale · dSᵀ Q; launched once for the context keys, once for the block keys
//! ```
//!
//! Layouts: `q [Q, heads, D]`, `k_ctx`/`v_ctx [T, kv_heads, D]`, `k_blk`/`v_blk [Q, kv_heads, D]` as bf16 bits;
//! `out`, `dout`, `dq`, `dk`, `dv` f32 in the same shapes; `lse`, `delta` `[Q, heads]` f32. `Q` is a multiple
//! of [`BLOCK`]; the 16 rows of block `b` are rows `16b..16b + 16` and share their ranges: the kernels read
//! `query_ranges [Q, 4]` (context keys `[0]..[1]`, block keys `[2]..[3]`) at each block's first row, as the
//! DFlash block plan writes them; a block whose ranges are both empty (an absent anchor) only writes zeros and
//! `lse = −∞`. The key-major pass reads `key_ranges [keys, 2]` (the query rows that see each key).
//!
//! Context keys' dK/dV: a key-major pass (no atomics). A context key tile is seen by a contiguous run of blocks
//! (those of its sequence with a later anchor), so a block per key tile walks exactly those blocks and owns its
//! dK/dV in registers: deterministic, each dK/dV written once, at the price of recomputing `QKᵀ` and `dO Vᵀ`
//! (the query-major pass computes them for dQ too): 7 tile products per (query tile, key tile) instead of
//! FlashAttention-2's 5, i.e. 1.4× the backward's tensor FLOPs. The alternative, f32 atomics from the
//! query-major pass, does 5 products but `2 · D` atomic adds per (block row tile, key) into dK/dV, contended by
//! every block of a sequence (up to 512 anchors see the first context keys): on an H200 the red.global.add.f32
//! throughput for 512-way contention on one line is far below the tensor rate, and the sums become order
//! dependent. The recompute is the cheaper and the deterministic choice.
//!
//! Only `head_dim` 64 and 128 are built ([`check_head_dim`] refuses others); `precision = f32` has no flash
//! path: the f32 CUDA-core kernels of [`crate::attention`] remain its path.

/// Runs `$body` for `$i` = 0, 1, … below `$bound` (a constant at most `$max`, one of 2, 4, 8, 16), written
/// out rather than looped: every register array a body indexes with `$i` is then indexed by constants, which
/// keeps it in registers on the GPU (LLVM does not fully unroll loops this large, and a dynamically indexed
/// array goes to local memory).
macro_rules! unroll {
    ($i:ident < $bound:expr; 2 => $body:block) => { unroll!(@ $i, $bound, 2, $body, [0 1]) };
    ($i:ident < $bound:expr; 4 => $body:block) => { unroll!(@ $i, $bound, 4, $body, [0 1 2 3]) };
    ($i:ident < $bound:expr; 8 => $body:block) => { unroll!(@ $i, $bound, 8, $body, [0 1 2 3 4 5 6 7]) };
    ($i:ident < $bound:expr; 16 => $body:block) => {
        unroll!(@ $i, $bound, 16, $body, [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15])
    };
    (@ $i:ident, $bound:expr, $max:literal, $body:block, [$($k:literal)*]) => {{
        const { assert!($bound <= $max) };
        $(
            #[allow(clippy::reversed_empty_ranges, clippy::absurd_extreme_comparisons)]
            if $k < $bound {
                let $i: usize = $k;
                $body
            }
        )*
    }};
}

pub mod backward;
pub mod forward;
pub mod warp;

use warp::{FragA, FragB, Lanes, MatrixWarp};

/// Query slots of a DFlash block: the rows of one warp's m16 tile.
pub const BLOCK: usize = 16;

/// Keys per shared-memory tile in the query-major kernels.
pub const KEY_TILE: usize = 64;

/// Warps of a key-major block, each owning 16 keys.
pub const KV_WARPS: usize = 4;

/// Keys per key-major block.
pub const KV_TILE: usize = 16 * KV_WARPS;

/// Extra bf16 per shared-memory row: a row stride of `D + 8` puts the 8 rows an `ldmatrix` reads on distinct
/// 16-byte bank groups (an unpadded 128- or 256-byte stride maps them all to the same banks).
pub const ROW_PAD: usize = 8;

/// The head dimensions the flash kernels are built for.
pub const HEAD_DIMS: [usize; 2] = [64, 128];

/// Why a shape cannot run on the flash kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlashShapeError {
    /// `head_dim` is not one of [`HEAD_DIMS`].
    HeadDim(usize),
    /// `heads` is not a positive multiple of `kv_heads`, or the group is larger than 8 warps.
    Heads {
        /// Query heads.
        heads: usize,
        /// Key/value heads.
        kv_heads: usize,
    },
    /// The query rows are not whole blocks of [`BLOCK`].
    Rows(usize),
}

impl core::fmt::Display for FlashShapeError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match *self {
            Self::HeadDim(d) => write!(
                f,
                "flash attention is built for head_dim 64 and 128, not {d} (the f32 attention kernels run other sizes)"
            ),
            Self::Heads { heads, kv_heads } => write!(
                f,
                "flash attention needs heads to be a multiple of kv_heads with at most 8 heads per kv head \
                 (one warp each), got heads = {heads}, kv_heads = {kv_heads}"
            ),
            Self::Rows(rows) => write!(
                f,
                "flash attention needs whole blocks of {BLOCK} query rows, got {rows}"
            ),
        }
    }
}

/// Checks a shape before a launch: `head_dim` ∈ [`HEAD_DIMS`], `heads = G · kv_heads` with `1 ≤ G ≤ 8`,
/// `queries` a multiple of [`BLOCK`].
pub fn check_head_dim(
    queries: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
) -> Result<(), FlashShapeError> {
    if !HEAD_DIMS.contains(&head_dim) {
        return Err(FlashShapeError::HeadDim(head_dim));
    }
    if kv_heads == 0 || heads == 0 || !heads.is_multiple_of(kv_heads) || heads / kv_heads > 8 {
        return Err(FlashShapeError::Heads { heads, kv_heads });
    }
    if !queries.is_multiple_of(BLOCK) {
        return Err(FlashShapeError::Rows(queries));
    }
    Ok(())
}

/// Shared-memory bytes of the query-major kernels for head dimension `d`: a K and a V tile.
pub const fn query_major_smem_bytes(d: usize) -> usize {
    2 * KEY_TILE * (d + ROW_PAD) * 2
}

/// Shared-memory bytes of the key-major kernel for head dimension `d`: a K and a V tile, a Q and a dO tile
/// of [`BLOCK`] rows.
pub const fn key_major_smem_bytes(d: usize) -> usize {
    2 * KV_TILE * (d + ROW_PAD) * 2 + 2 * BLOCK * (d + ROW_PAD) * 2
}

/// `[start, end)` of the range pair at `ranges`, clamped so `start ≤ end ≤ limit`.
///
/// # Safety
/// `ranges` points at two readable `u32`s.
#[inline(always)]
unsafe fn range_at(ranges: *const u32, limit: usize) -> (usize, usize) {
    // SAFETY: the caller's contract.
    let (start, end) = unsafe { (*ranges as usize, *ranges.add(1) as usize) };
    let end = end.min(limit);
    (start.min(end), end)
}

/// A 16-byte chunk, so a copy of 8 bf16 is one vector load and store.
#[derive(Clone, Copy)]
#[repr(C, align(16))]
struct Chunk([u32; 4]);

/// Copies rows `0..rows` of a tile into shared memory (`D + ROW_PAD` bf16 per row), 16 bytes per lane and
/// step over all `threads` of the block; `source(row)` is the row's global address, or `None` for a row past
/// the tile's keys, which is zero-filled (a NaN in a padding row would reach O through `0 · NaN`).
///
/// # Safety
/// `dst` holds `rows` shared rows; every `Some` row holds `D` readable bf16, 16-byte aligned.
#[inline(always)]
unsafe fn copy_rows<const N: usize, const D: usize, W: MatrixWarp<N>>(
    warp: W,
    threads: usize,
    dst: *mut u16,
    rows: usize,
    source: impl Fn(usize) -> Option<*const u16>,
) {
    let chunks_per_row = D / 8;
    let total = rows * chunks_per_row;
    let lanes = warp.lane();
    let mut base = 0;
    while base < total {
        for l in 0..N {
            let index = base + 32 * warp.warp() + lanes.0[l] as usize;
            if index < total {
                let (row, chunk) = (index / chunks_per_row, index % chunks_per_row);
                // SAFETY: the caller's contract; `chunk · 8 < D`.
                unsafe {
                    let to = dst.add(row * (D + ROW_PAD) + 8 * chunk) as *mut Chunk;
                    // Two stores rather than a selected 16-byte value (which would go through local memory).
                    match source(row) {
                        Some(src) => *to = *(src.add(8 * chunk) as *const Chunk),
                        None => *to = Chunk([0; 4]),
                    }
                }
            }
        }
        base += threads;
    }
}

/// The A fragment of the 16×16 bf16 block at (`row0`, `col0`) of a shared row-major matrix (`stride` bf16 per
/// row), by `ldmatrix.x4`: lane `l` gives row `row0 + l % 8 + 8 · (l / 8 % 2)`, col `col0 + 8 · (l / 16)`, so
/// matrices 0..4 are the (rows, cols) quarters (0–7, 0–7), (8–15, 0–7), (0–7, 8–15), (8–15, 8–15) = registers
/// `a0a1`, `a2a3`, `a4a5`, `a6a7`.
///
/// # Safety
/// The block lies inside the shared matrix.
#[inline(always)]
unsafe fn load_a<const N: usize, W: MatrixWarp<N>>(
    warp: W,
    smem: *const u16,
    stride: usize,
    row0: usize,
    col0: usize,
) -> FragA<N> {
    let rows = warp.lane().map(|l| {
        let (l, m) = (l as usize, l as usize / 8);
        // SAFETY: inside the block (the caller's contract).
        unsafe { smem.add((l % 8 + 8 * (m % 2)) * stride + 8 * (m / 2)) }
    });
    // SAFETY: the caller's contract.
    unsafe { warp.ldmatrix_x4(rows, row0 * stride + col0, false) }
}

/// The B fragments of two neighbouring n-tiles (`n0..n0+8`, `n0+8..n0+16`) at k-step `k0..k0+16` of
/// `B = Mᵀ` for a shared row-major `M [n][k]` (keys × head dims for `QKᵀ`): `ldmatrix.x4` without `.trans`,
/// lane `l` giving row `n0 + l % 8 + 8 · (l / 16)`, col `k0 + 8 · (l / 8 % 2)`.
///
/// # Safety
/// The 16×16 block lies inside the shared matrix.
#[inline(always)]
unsafe fn load_b_transposed<const N: usize, W: MatrixWarp<N>>(
    warp: W,
    smem: *const u16,
    stride: usize,
    n0: usize,
    k0: usize,
) -> [FragB<N>; 2] {
    let rows = warp.lane().map(|l| {
        let (l, m) = (l as usize, l as usize / 8);
        // SAFETY: inside the block (the caller's contract).
        unsafe { smem.add((l % 8 + 8 * (m / 2)) * stride + 8 * (m % 2)) }
    });
    // SAFETY: the caller's contract.
    let [r0, r1, r2, r3] = unsafe { warp.ldmatrix_x4(rows, n0 * stride + k0, false) };
    [[r0, r1], [r2, r3]]
}

/// The B fragments of two neighbouring n-tiles at k-step `k0..k0+16` of `B = M` for a shared row-major
/// `M [k][n]` (keys × head dims for `PV`): `ldmatrix.x4.trans`, lane `l` giving row `k0 + l % 8 + 8 · (l / 8
/// % 2)`, col `n0 + 8 · (l / 16)`.
///
/// # Safety
/// As [`load_b_transposed`].
#[inline(always)]
unsafe fn load_b<const N: usize, W: MatrixWarp<N>>(
    warp: W,
    smem: *const u16,
    stride: usize,
    k0: usize,
    n0: usize,
) -> [FragB<N>; 2] {
    let rows = warp.lane().map(|l| {
        let (l, m) = (l as usize, l as usize / 8);
        // SAFETY: inside the block (the caller's contract).
        unsafe { smem.add((l % 8 + 8 * (m % 2)) * stride + 8 * (m / 2)) }
    });
    // SAFETY: the caller's contract.
    let [r0, r1, r2, r3] = unsafe { warp.ldmatrix_x4(rows, k0 * stride + n0, true) };
    [[r0, r1], [r2, r3]]
}

/// The A fragment of k-step `kk` built from accumulators (n-tiles `2kk`, `2kk + 1` of a 16-row C matrix),
/// rounded to bf16: FlashAttention-2's reuse of S's registers as P's (C rows `g`, `g + 8` and cols `2t, 2t+1`
/// are A's rows and, per n-tile, its column halves).
#[inline(always)]
fn accum_to_a<const N: usize>(lo: &warp::Accum<N>, hi: &warp::Accum<N>) -> FragA<N> {
    [
        lo[0].zip(lo[1], warp::pack_bf16),
        lo[2].zip(lo[3], warp::pack_bf16),
        hi[0].zip(hi[1], warp::pack_bf16),
        hi[2].zip(hi[3], warp::pack_bf16),
    ]
}

/// The A fragments of a 16-row tile read straight from global memory: `pair(row, col)` gives the two bf16 at
/// cols `col, col + 1` of tile row `row` (rows `g`, `g + 8`, cols `16kk + 2t (+8)` per lane).
#[inline(always)]
fn load_a_global<const N: usize, const D16: usize, W: MatrixWarp<N>>(
    warp: W,
    pair: impl Fn(usize, usize) -> u32,
) -> [FragA<N>; D16] {
    let lanes = group_and_thread(warp.lane());
    let mut frags = [[Lanes::splat(0u32); 4]; D16];
    unroll!(kk < D16; 8 => {
        unroll!(reg < 4; 4 => {
            frags[kk][reg] = lanes.map(|(g, t)| pair(g + 8 * (reg % 2), 16 * kk + 2 * t + 8 * (reg / 2)));
        });
    });
    frags
}

/// The sum over the 4 lanes of a row group (`t = 0..4`): butterflies at distances 1 and 2.
#[inline(always)]
fn quad_sum<const N: usize, W: MatrixWarp<N>>(warp: W, x: Lanes<f32, N>) -> Lanes<f32, N> {
    let x = x + warp.shuffle_xor(x, 1);
    x + warp.shuffle_xor(x, 2)
}

/// The maximum over the 4 lanes of a row group.
#[inline(always)]
fn quad_max<const N: usize, W: MatrixWarp<N>>(warp: W, x: Lanes<f32, N>) -> Lanes<f32, N> {
    let x = x.max(warp.shuffle_xor(x, 1));
    x.max(warp.shuffle_xor(x, 2))
}

/// `(g, t)` of each lane.
#[inline(always)]
fn group_and_thread<const N: usize>(lanes: Lanes<u32, N>) -> Lanes<(usize, usize), N> {
    lanes.map(|l| (l as usize / 4, l as usize % 4))
}
