//! The flash backward ([`super`]): the query-major pass (`D`, then dQ) and the key-major pass (dK, dV).

use super::forward::{FlashInputs, S_TILES, for_each_key_tile, scores, tile_products};
use super::warp::{Accum, Lanes, MatrixWarp, accum_zero, opaque, pack_bf16};
use super::{
    BLOCK, KV_TILE, ROW_PAD, accum_to_a, copy_rows, group_and_thread, load_a, load_a_global,
    load_b, load_b_transposed, quad_sum, range_at,
};

/// Writes a warp's 16×D accumulators `acc · factor` to f32 rows `row(r)` (`r` = tile row), skipping rows
/// for which `row` gives `None`.
///
/// # Safety
/// Every `Some` row holds `D` writable f32.
#[inline(always)]
unsafe fn store_rows<const N: usize, const D8: usize, W: MatrixWarp<N>>(
    warp: W,
    acc: &[Accum<N>; D8],
    factor: f32,
    row: impl Fn(usize) -> Option<*mut f32>,
) {
    let lanes = group_and_thread(warp.lane());
    unroll!(n < D8; 16 => {
        unroll!(reg < 4; 4 => {
            let value = acc[n][reg];
            for i in 0..N {
                let (g, t) = lanes.0[i];
                if let Some(dst) = row(g + 8 * (reg / 2)) {
                    // SAFETY: the caller's contract; `8n + 2t + 1 < D`.
                    unsafe { *dst.add(8 * n + 2 * t + reg % 2) = value.0[i] * factor };
                }
            }
        });
    });
}

/// Query-major backward of block `index / kv_heads`, kv head `index % kv_heads`, warp = query head as in
/// [`super::forward::flash_forward`]: writes `delta = rowsum(dout ∘ out)` (read by [`flash_backward_kv`])
/// and `dq = scale · Σ_k p (dout·v_k − delta) k_k` for the block's rows, and `dout` rounded to bf16
/// (`dout_bf16`, the key-major pass's copy).
///
/// Launch: as the forward.
///
/// # Safety
/// As the forward; `out`, `dout`, `dq` hold `Q · heads · D` f32, `dout_bf16` as many u16, `lse`, `delta`
/// `Q · heads`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn flash_backward_q<
    const N: usize,
    const D: usize,
    const D8: usize,
    const D16: usize,
    W: MatrixWarp<N>,
>(
    inputs: FlashInputs,
    out: *const f32,
    dout: *const f32,
    lse: *const f32,
    delta: *mut f32,
    dq: *mut f32,
    dout_bf16: *mut u16,
    smem: *mut u8,
    warp: W,
    index: usize,
) {
    const { assert!(D == 8 * D8 && D == 16 * D16) };
    let (block, group) = (index / inputs.kv_heads, index % inputs.kv_heads);
    let heads = inputs.heads;
    let head = group * (heads / inputs.kv_heads) + warp.warp();
    let row0 = BLOCK * block;
    let at = move |r: usize| ((row0 + r) * heads + head) * D;
    let lanes = group_and_thread(warp.lane());
    // SAFETY: rows `row0 .. row0 + 16` lie inside every query-row buffer.
    unsafe {
        // D and lse for rows g, g + 8 of each lane: its own columns, then the row group.
        let mut row_delta = [Lanes::splat(0.0f32); 2];
        let mut row_lse = [Lanes::splat(0.0f32); 2];
        unroll!(half < 2; 2 => {
            let partial = lanes.map(|(g, t)| {
                let base = at(g + 8 * half);
                let mut sum = 0.0f32;
                for n in 0..D8 {
                    let c = base + 8 * n + 2 * t;
                    sum += *dout.add(c) * *out.add(c) + *dout.add(c + 1) * *out.add(c + 1);
                }
                sum
            });
            row_delta[half] = quad_sum(warp, partial);
            row_lse[half] = lanes.map(|(g, _)| *lse.add((row0 + g + 8 * half) * heads + head));
            for i in 0..N {
                let (g, t) = lanes.0[i];
                if t == 0 {
                    *delta.add((row0 + g + 8 * half) * heads + head) = row_delta[half].0[i];
                }
            }
        });
        let q = load_a_global::<N, D16, W>(warp, |r, c| *(inputs.q.add(at(r) + c) as *const u32));
        let g_out = load_a_global::<N, D16, W>(warp, |r, c| {
            let pair = pack_bf16(*dout.add(at(r) + c), *dout.add(at(r) + c + 1));
            // The fragments cover the tile once: its bf16 copy for the key-major pass.
            *(dout_bf16.add(at(r) + c) as *mut u32) = pair;
            pair
        });
        let mut acc = [accum_zero::<N>(); D8];
        for_each_key_tile::<N, D, W>(
            warp,
            &inputs,
            block,
            group,
            smem,
            |k_tile, v_tile, valid| {
                let s = scores::<N, D, D16, W>(warp, &q, k_tile, inputs.scale, valid);
                let dp = tile_products::<N, D, D16, W>(warp, &g_out, v_tile);
                let mut ds = [accum_zero::<N>(); S_TILES];
                unroll!(j < S_TILES; 8 => {
                    unroll!(reg < 4; 4 => {
                        let half = reg / 2;
                        let p = s[j][reg].zip(row_lse[half], |x, l| {
                            if x == f32::NEG_INFINITY {
                                0.0
                            } else {
                                crate::math::exp(x - l)
                            }
                        });
                        ds[j][reg] = p * (dp[j][reg] - row_delta[half]);
                    });
                });
                unroll!(kk < S_TILES / 2; 4 => {
                    let a = accum_to_a(&ds[2 * kk], &ds[2 * kk + 1]);
                    unroll!(pair < D8 / 2; 8 => {
                        let [b0, b1] = load_b(warp, k_tile, D + ROW_PAD, 16 * kk, 16 * pair);
                        acc[2 * pair] = warp.mma(&a, &b0, acc[2 * pair]);
                        acc[2 * pair + 1] = warp.mma(&a, &b1, acc[2 * pair + 1]);
                    });
                });
            },
        );
        store_rows::<N, D8, W>(warp, &acc, inputs.scale, |r| Some(dq.add(at(r))));
    }
}

/// The pointers and sizes of the key-major pass over one key set (the context keys or the block keys).
#[derive(Clone, Copy)]
pub struct KeyMajorInputs {
    /// `[Q, heads, D]` bf16.
    pub q: *const u16,
    /// `[Q, heads, D]` bf16: the copy [`flash_backward_q`] writes.
    pub dout: *const u16,
    /// `[Q, heads]`.
    pub lse: *const f32,
    /// `[Q, heads]`, from [`flash_backward_q`].
    pub delta: *const f32,
    /// `[keys, kv_heads, D]` bf16.
    pub k: *const u16,
    /// `[keys, kv_heads, D]` bf16.
    pub v: *const u16,
    /// `[keys, 2]`: the query rows that see each key.
    pub key_ranges: *const u32,
    /// Keys of this key set.
    pub keys: usize,
    /// Query rows `Q`.
    pub queries: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// The score scale.
    pub scale: f32,
}

/// Key-major backward of key tile `index / kv_heads` ([`KV_TILE`] keys) and kv head `index % kv_heads`; warp
/// `w` owns keys `16w .. 16w + 16` of the tile. For every 16-row query tile of every head of the group that
/// some key of the tile sees: `dv = Σ p dout`, `dk = scale · Σ p (dout·v − delta) q` (overwritten).
///
/// Launch: `ceil(keys / KV_TILE) · kv_heads` blocks of `32 · KV_WARPS` threads,
/// [`super::key_major_smem_bytes`]`(D)` shared.
///
/// # Safety
/// The inputs hold their layouts; `dk`, `dv` hold `keys · kv_heads · D` f32; `smem` as the forward's, with
/// [`super::key_major_smem_bytes`]`(D)` bytes.
#[inline(always)]
pub unsafe fn flash_backward_kv<
    const N: usize,
    const D: usize,
    const D8: usize,
    const D16: usize,
    W: MatrixWarp<N>,
>(
    inputs: KeyMajorInputs,
    dk: *mut f32,
    dv: *mut f32,
    smem: *mut u8,
    warp: W,
    index: usize,
) {
    const { assert!(D == 8 * D8 && D == 16 * D16) };
    let KeyMajorInputs {
        heads,
        kv_heads,
        keys,
        queries,
        ..
    } = inputs;
    let (tile, group) = (index / kv_heads, index % kv_heads);
    let per_group = heads / kv_heads;
    let j0 = tile * KV_TILE;
    let valid = keys.saturating_sub(j0).min(KV_TILE);
    let own = j0 + 16 * warp.warp();
    let stride = D + ROW_PAD;
    let lanes = group_and_thread(warp.lane());
    // SAFETY: keys below `keys` and rows below `queries` lie inside their buffers; the shared tiles are the
    // consecutive parts of `smem`.
    unsafe {
        let k_tile = smem as *mut u16;
        let v_tile = k_tile.add(KV_TILE * stride);
        let q_tile = v_tile.add(KV_TILE * stride);
        let o_tile = q_tile.add(BLOCK * stride);
        let key_row = |base: *const u16| {
            move |r: usize| (r < valid).then(|| base.add(((j0 + r) * kv_heads + group) * D))
        };
        copy_rows::<N, D, W>(
            warp,
            32 * super::KV_WARPS,
            k_tile,
            KV_TILE,
            key_row(inputs.k),
        );
        copy_rows::<N, D, W>(
            warp,
            32 * super::KV_WARPS,
            v_tile,
            KV_TILE,
            key_row(inputs.v),
        );
        let key_range = |j: usize| {
            if j < keys {
                range_at(inputs.key_ranges.add(2 * j), queries)
            } else {
                (0, 0)
            }
        };
        // The query rows the tile's keys see, and those this warp's keys see (block-uniform, warp-uniform).
        let (mut lo, mut hi, mut own_lo, mut own_hi) = (usize::MAX, 0, usize::MAX, 0);
        for j in j0..j0 + valid {
            let (start, end) = key_range(j);
            if start < end {
                (lo, hi) = (lo.min(start), hi.max(end));
                if (own..own + 16).contains(&j) {
                    (own_lo, own_hi) = (own_lo.min(start), own_hi.max(end));
                }
            }
        }
        let key_out = |base: *mut f32| {
            move |r: usize| {
                let j = own + r;
                (j < j0 + valid).then(|| base.add((j * kv_heads + group) * D))
            }
        };
        let (mut dk_acc, mut dv_acc) = ([accum_zero::<N>(); D8], [accum_zero::<N>(); D8]);
        let mut qb = if lo < hi { lo - lo % BLOCK } else { hi };
        while qb < hi {
            for head in group * per_group..(group + 1) * per_group {
                let at = move |r: usize| ((qb + r) * heads + head) * D;
                warp.sync_block();
                copy_rows::<N, D, W>(warp, 32 * super::KV_WARPS, q_tile, BLOCK, |r| {
                    Some(inputs.q.add(at(r)))
                });
                copy_rows::<N, D, W>(warp, 32 * super::KV_WARPS, o_tile, BLOCK, |r| {
                    Some(inputs.dout.add(at(r)))
                });
                warp.sync_block();
                if own_lo >= qb + BLOCK || own_hi <= qb {
                    continue;
                }
                let (k_tile, v_tile, q_tile, o_tile) = (
                    opaque(k_tile),
                    opaque(v_tile),
                    opaque(q_tile),
                    opaque(o_tile),
                );
                // Sᵀ, then Pᵀ and dV, then dPᵀ, dSᵀ and dK: the fewest temporaries live beside the accumulators.
                let mut s = [accum_zero::<N>(); 2];
                unroll!(kk < D16; 8 => {
                    let a = load_a(warp, k_tile, stride, 16 * warp.warp(), 16 * kk);
                    let [b0, b1] = load_b_transposed(warp, q_tile, stride, 0, 16 * kk);
                    s[0] = warp.mma(&a, &b0, s[0]);
                    s[1] = warp.mma(&a, &b1, s[1]);
                });
                // Pᵀ: row = key (g, g + 8), col = query row qb + 8n + 2t + (reg % 2); 0 outside the key's rows.
                let mut p = [accum_zero::<N>(); 2];
                unroll!(n < 2; 2 => {
                    unroll!(reg < 4; 4 => {
                        let col = lanes.map(|(_, t)| qb + 8 * n + 2 * t + reg % 2);
                        for i in 0..N {
                            // The key's query rows, read again per tile rather than held: at D = 128 the four
                            // registers they took pushed the dK/dV accumulators into local memory.
                            let (start, end) = key_range(own + lanes.0[i].0 + 8 * (reg / 2));
                            let r = col.0[i];
                            if start <= r && r < end {
                                let lse = *inputs.lse.add(r * heads + head);
                                p[n][reg].0[i] = crate::math::exp(s[n][reg].0[i] * inputs.scale - lse);
                            }
                        }
                    });
                });
                {
                    let pa = accum_to_a(&p[0], &p[1]);
                    unroll!(pair < D8 / 2; 8 => {
                        let [b0, b1] = load_b(warp, o_tile, stride, 0, 16 * pair);
                        dv_acc[2 * pair] = warp.mma(&pa, &b0, dv_acc[2 * pair]);
                        dv_acc[2 * pair + 1] = warp.mma(&pa, &b1, dv_acc[2 * pair + 1]);
                    });
                }
                {
                    let mut dp = [accum_zero::<N>(); 2];
                    unroll!(kk < D16; 8 => {
                        let a = load_a(warp, v_tile, stride, 16 * warp.warp(), 16 * kk);
                        let [b0, b1] = load_b_transposed(warp, o_tile, stride, 0, 16 * kk);
                        dp[0] = warp.mma(&a, &b0, dp[0]);
                        dp[1] = warp.mma(&a, &b1, dp[1]);
                    });
                    unroll!(n < 2; 2 => {
                        unroll!(reg < 4; 4 => {
                            let col = lanes.map(|(_, t)| qb + 8 * n + 2 * t + reg % 2);
                            let row_delta = col.map(|r| *inputs.delta.add(r * heads + head));
                            p[n][reg] = p[n][reg] * (dp[n][reg] - row_delta);
                        });
                    });
                    let dsa = accum_to_a(&p[0], &p[1]);
                    unroll!(pair < D8 / 2; 8 => {
                        let [b0, b1] = load_b(warp, q_tile, stride, 0, 16 * pair);
                        dk_acc[2 * pair] = warp.mma(&dsa, &b0, dk_acc[2 * pair]);
                        dk_acc[2 * pair + 1] = warp.mma(&dsa, &b1, dk_acc[2 * pair + 1]);
                    });
                }
            }
            qb += BLOCK;
        }
        store_rows::<N, D8, W>(warp, &dk_acc, inputs.scale, key_out(dk));
        store_rows::<N, D8, W>(warp, &dv_acc, 1.0, key_out(dv));
    }
}
