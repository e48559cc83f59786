//! The flash forward ([`super`]): one block per (DFlash block, kv head), one warp per query head of the group.

use super::warp::{Accum, FragA, Lanes, MatrixWarp, accum_zero, opaque};
use super::{
    BLOCK, KEY_TILE, ROW_PAD, accum_to_a, copy_rows, group_and_thread, load_a_global, load_b,
    load_b_transposed, quad_max, quad_sum, range_at,
};

/// S n-tiles of a key tile.
pub(super) const S_TILES: usize = KEY_TILE / 8;

/// One warp's online-softmax state over its 16 rows: per lane, rows `g` (index 0) and `g + 8` (index 1).
pub(super) struct RowState<const N: usize, const D8: usize> {
    pub(super) max: [Lanes<f32, N>; 2],
    /// This lane's share of `Σ p` (its columns only; summed over the row group at the end).
    pub(super) sum: [Lanes<f32, N>; 2],
    pub(super) out: [Accum<N>; D8],
}

/// `A Mᵀ` for 16 rows of `a` (`D` columns) and the `KEY_TILE` shared rows of `m` (`D + ROW_PAD` each):
/// `Q Kᵀ` in the forward, `dO Vᵀ` in the backward.
///
/// # Safety
/// `m` holds `KEY_TILE` shared rows of `D + ROW_PAD`.
#[inline(always)]
pub(super) unsafe fn tile_products<
    const N: usize,
    const D: usize,
    const D16: usize,
    W: MatrixWarp<N>,
>(
    warp: W,
    a: &[FragA<N>; D16],
    m: *const u16,
) -> [Accum<N>; S_TILES] {
    let mut s = [accum_zero::<N>(); S_TILES];
    unroll!(kk < D16; 8 => {
        unroll!(pair < S_TILES / 2; 4 => {
            // SAFETY: rows `16 · pair .. + 16`, cols `16 · kk .. + 16` lie in the tile.
            let [b0, b1] = unsafe { load_b_transposed(warp, m, D + ROW_PAD, 16 * pair, 16 * kk) };
            s[2 * pair] = warp.mma(&a[kk], &b0, s[2 * pair]);
            s[2 * pair + 1] = warp.mma(&a[kk], &b1, s[2 * pair + 1]);
        });
    });
    s
}

/// `S = scale · Q Kᵀ` over one shared K tile, cols at or past `valid` set to `−∞` (only the partial tile at
/// the anchor, or a short block, has such columns).
///
/// # Safety
/// As [`tile_products`].
#[inline(always)]
pub(super) unsafe fn scores<const N: usize, const D: usize, const D16: usize, W: MatrixWarp<N>>(
    warp: W,
    q: &[FragA<N>; D16],
    k_tile: *const u16,
    scale: f32,
    valid: usize,
) -> [Accum<N>; S_TILES] {
    // SAFETY: the caller's contract.
    let mut s = unsafe { tile_products::<N, D, D16, W>(warp, q, k_tile) };
    let cols = group_and_thread(warp.lane());
    unroll!(j < S_TILES; 8 => {
        unroll!(reg < 4; 4 => {
            s[j][reg] = s[j][reg].zip(cols, |x, (_, t)| {
                if 8 * j + 2 * t + reg % 2 < valid { x * scale } else { f32::NEG_INFINITY }
            });
        });
    });
    s
}

/// Folds one key tile into the warp's rows: the new row maxima, `p = e^(s − m)`, the rescale of `l` and `O`
/// by `e^(m_old − m_new)`, then `O += P V` with P rounded to bf16 in S's registers.
///
/// # Safety
/// `v_tile` holds `KEY_TILE` shared rows of `D + ROW_PAD`.
#[inline(always)]
unsafe fn fold_tile<const N: usize, const D: usize, const D8: usize, W: MatrixWarp<N>>(
    warp: W,
    state: &mut RowState<N, D8>,
    mut s: [Accum<N>; S_TILES],
    v_tile: *const u16,
) {
    unroll!(half < 2; 2 => {
        let mut tile_max = Lanes::splat(f32::NEG_INFINITY);
        unroll!(j < S_TILES; 8 => {
            tile_max = tile_max.max(s[j][2 * half]).max(s[j][2 * half + 1]);
        });
        let new_max = state.max[half].max(quad_max(warp, tile_max));
        // Every tile has a column below `valid`, so `new_max` is finite unless the scores are NaN.
        let alpha = (state.max[half] - new_max).exp();
        state.max[half] = new_max;
        let mut sum = state.sum[half] * alpha;
        unroll!(j < S_TILES; 8 => {
            unroll!(i < 2; 2 => {
                let reg = 2 * half + i;
                let p = s[j][reg].zip(new_max, |x, m| {
                    if x == f32::NEG_INFINITY { 0.0 } else { crate::math::exp(x - m) }
                });
                sum = sum + p;
                s[j][reg] = p;
            });
        });
        state.sum[half] = sum;
        unroll!(n < D8; 16 => {
            state.out[n][2 * half] = state.out[n][2 * half] * alpha;
            state.out[n][2 * half + 1] = state.out[n][2 * half + 1] * alpha;
        });
    });
    unroll!(kk < S_TILES / 2; 4 => {
        let p = accum_to_a(&s[2 * kk], &s[2 * kk + 1]);
        unroll!(pair < D8 / 2; 8 => {
            // SAFETY: rows `16 · kk .. + 16`, cols `16 · pair .. + 16` lie in the tile.
            let [b0, b1] = unsafe { load_b(warp, v_tile, D + ROW_PAD, 16 * kk, 16 * pair) };
            state.out[2 * pair] = warp.mma(&p, &b0, state.out[2 * pair]);
            state.out[2 * pair + 1] = warp.mma(&p, &b1, state.out[2 * pair + 1]);
        });
    });
}

/// The pointers and sizes of one attention call (the module layouts of [`super`]).
#[derive(Clone, Copy)]
pub struct FlashInputs {
    /// `[Q, heads, D]` bf16.
    pub q: *const u16,
    /// `[T, kv_heads, D]` bf16.
    pub k_ctx: *const u16,
    /// `[T, kv_heads, D]` bf16.
    pub v_ctx: *const u16,
    /// `[Q, kv_heads, D]` bf16.
    pub k_blk: *const u16,
    /// `[Q, kv_heads, D]` bf16.
    pub v_blk: *const u16,
    /// `[Q, 4]`: context and block key ranges per query row (read at each block's first row).
    pub query_ranges: *const u32,
    /// Query rows `Q` (whole blocks).
    pub queries: usize,
    /// Context rows `T`.
    pub context: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// The score scale (`1 / sqrt(D)`).
    pub scale: f32,
}

/// Runs `tile(keys, values, start, valid)` for every key tile of block `block`'s two key sets, K and V of
/// kv head `group` copied into `smem` first (the block barrier before and after, so every warp passes the
/// same barriers); tiles past the anchor are never loaded.
///
/// # Safety
/// `smem` holds [`super::query_major_smem_bytes`]`(D)`, 16-byte aligned; the inputs hold their layouts.
#[inline(always)]
pub(super) unsafe fn for_each_key_tile<const N: usize, const D: usize, W: MatrixWarp<N>>(
    warp: W,
    inputs: &FlashInputs,
    block: usize,
    group: usize,
    smem: *mut u8,
    mut tile: impl FnMut(*const u16, *const u16, usize),
) {
    let k_tile = smem as *mut u16;
    // SAFETY: the two tiles are the two halves of `smem`; ranges are clamped to the key sets' lengths.
    unsafe {
        let v_tile = k_tile.add(KEY_TILE * (D + ROW_PAD));
        let first = inputs.query_ranges.add(4 * BLOCK * block);
        // Both key sets through one loop (one call site of `tile`, so it is inlined), the set's values chosen by
        // selects: an array of the two sets would be indexed dynamically and live in local memory.
        for set in 0..2 {
            let context = set == 0;
            let range = if context {
                range_at(first, inputs.context)
            } else {
                range_at(first.add(2), inputs.queries)
            };
            let sources = if context {
                [inputs.k_ctx, inputs.v_ctx]
            } else {
                [inputs.k_blk, inputs.v_blk]
            };
            key_set_tiles::<N, D, W>(
                warp,
                inputs,
                group,
                [k_tile, v_tile],
                range,
                sources,
                &mut tile,
            );
        }
    }
}

/// The key tiles of one key set `start..end` (see [`for_each_key_tile`]).
///
/// # Safety
/// As [`for_each_key_tile`]; `sources` hold the key set's K and V rows.
#[inline(always)]
unsafe fn key_set_tiles<const N: usize, const D: usize, W: MatrixWarp<N>>(
    warp: W,
    inputs: &FlashInputs,
    group: usize,
    [k_tile, v_tile]: [*mut u16; 2],
    (start, end): (usize, usize),
    [keys, values]: [*const u16; 2],
    tile: &mut impl FnMut(*const u16, *const u16, usize),
) {
    let threads = 32 * (inputs.heads / inputs.kv_heads);
    let mut j0 = start;
    while j0 < end {
        let valid = (end - j0).min(KEY_TILE);
        let row = |base: *const u16| {
            // SAFETY: rows below `end` lie inside the key set (the caller's contract).
            move |r: usize| {
                (r < valid).then(|| unsafe { base.add(((j0 + r) * inputs.kv_heads + group) * D) })
            }
        };
        warp.sync_block();
        // SAFETY: the tiles hold `KEY_TILE` shared rows each.
        unsafe {
            copy_rows::<N, D, W>(warp, threads, k_tile, KEY_TILE, row(keys));
            copy_rows::<N, D, W>(warp, threads, v_tile, KEY_TILE, row(values));
        }
        warp.sync_block();
        tile(opaque(k_tile), opaque(v_tile), valid);
        j0 += KEY_TILE;
    }
}

/// Flash forward of block `index / kv_heads` and kv head `index % kv_heads`, this thread's warp taking query
/// head `kv · G + warp`: `out [Q, heads, D]` (f32) and `lse [Q, heads]` for the block's 16 rows, and unless
/// `out16` is null the output rounded to bf16 beside it (nearest even): the `o_proj` product's operand on
/// CUDA at `bf16`, written here rather than in a pass of its own.
///
/// Launch: `(Q / 16) · kv_heads` blocks of `32 · G` threads, [`super::query_major_smem_bytes`]`(D)` shared.
///
/// # Safety
/// The inputs hold the layouts of [`super`] for a shape [`super::check_head_dim`] accepts with this `D`
/// (`D8 = D / 8`, `D16 = D / 16`); `out`, `lse` hold `Q · heads · D`, `Q · heads` f32, `out16` (unless null)
/// `Q · heads · D` u16; `smem` as
/// [`for_each_key_tile`].
#[inline(always)]
pub unsafe fn flash_forward<
    const N: usize,
    const D: usize,
    const D8: usize,
    const D16: usize,
    W: MatrixWarp<N>,
>(
    inputs: FlashInputs,
    (out, out16): (*mut f32, *mut u16),
    lse: *mut f32,
    smem: *mut u8,
    warp: W,
    index: usize,
) {
    const { assert!(D == 8 * D8 && D == 16 * D16) };
    let (block, group) = (index / inputs.kv_heads, index % inputs.kv_heads);
    let head = group * (inputs.heads / inputs.kv_heads) + warp.warp();
    let row0 = BLOCK * block;
    let heads = inputs.heads;
    // SAFETY: rows `row0 .. row0 + 16` lie inside every query-row buffer (`Q` is whole blocks).
    unsafe {
        let q = load_a_global::<N, D16, W>(warp, |r, c| {
            *(inputs.q.add(((row0 + r) * heads + head) * D + c) as *const u32)
        });
        let mut state = RowState::<N, D8> {
            max: [Lanes::splat(f32::NEG_INFINITY); 2],
            sum: [Lanes::splat(0.0); 2],
            out: [accum_zero(); D8],
        };
        for_each_key_tile::<N, D, W>(
            warp,
            &inputs,
            block,
            group,
            smem,
            |k_tile, v_tile, valid| {
                let s = scores::<N, D, D16, W>(warp, &q, k_tile, inputs.scale, valid);
                fold_tile::<N, D, D8, W>(warp, &mut state, s, v_tile);
            },
        );
        let lanes = group_and_thread(warp.lane());
        unroll!(half < 2; 2 => {
            let sum = quad_sum(warp, state.sum[half]);
            let inv = sum.map(|l| if l > 0.0 { 1.0 / l } else { 0.0 });
            unroll!(n < D8; 16 => {
                unroll!(reg < 4; 4 => {
                    if reg / 2 == half {
                        let value = state.out[n][reg] * inv;
                        for i in 0..N {
                            let (g, t) = lanes.0[i];
                            let row = row0 + g + 8 * half;
                            let at = (row * heads + head) * D + 8 * n + 2 * t + reg % 2;
                            *out.add(at) = value.0[i];
                            if !out16.is_null() {
                                *out16.add(at) = crate::convert::f32_to_bf16_bits(value.0[i]);
                            }
                        }
                    }
                });
            });
            for i in 0..N {
                let (g, t) = lanes.0[i];
                if t == 0 {
                    let (m, l) = (state.max[half].0[i], sum.0[i]);
                    let row = row0 + g + 8 * half;
                    *lse.add(row * heads + head) =
                        if l > 0.0 { m + crate::math::ln(l) } else { f32::NEG_INFINITY };
                }
            }
        });
    }
}
