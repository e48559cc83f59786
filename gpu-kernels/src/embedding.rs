//! Token embedding from a frozen table (the target's `embed_tokens`): a gather, with no gradient.
//!
//! ```text
//!  block token ids [rows] ──embedding_gather(table [vocab, hidden])──▶ rows [rows, hidden] (f32 and/or bf16)
//! ```
//!
//! The same gather moves whole rows by index elsewhere (DFlash's head rows in and out of the labelled-row
//! head, `runtime/src/backend/head.rs`); its bf16 output is the head's 16-bit product operand.

/// `out[r, c] = table[ids[r], c]` for the elements `chunk · chunk_len ..` up to `min(n, (chunk + 1) · chunk_len)`
/// of `out` (`n = rows · hidden`), and the same element rounded to bf16 (nearest even) into `out16`; either
/// output may be null (not written). An id outside the vocabulary gives a zero row (the host launcher rejects
/// it first; the device must not read outside the table).
///
/// Launch: element range (the GPU one element per thread, so a warp reads 32 adjacent columns of a row).
///
/// # Safety
/// `table` holds `vocab · hidden` elements, `ids` `ceil(n / hidden)`, `out` and `out16` null or `n`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn embedding_gather(
    table: *const f32,
    ids: *const u32,
    out: *mut f32,
    out16: *mut u16,
    vocab: usize,
    hidden: usize,
    n: usize,
    chunk_len: usize,
    chunk: usize,
) {
    // A zero divisor means an empty launch; returning keeps the device path free of the division panic.
    if hidden == 0 {
        return;
    }
    let start = chunk * chunk_len;
    let end = if start + chunk_len < n {
        start + chunk_len
    } else {
        n
    };
    if start >= end {
        return;
    }
    // One division per chunk: the row and column advance with the index.
    let (mut row, mut col) = (start / hidden, start % hidden);
    // SAFETY: `row < ceil(n / hidden)` indexes `ids`; a valid id's row lies inside `table`; `i < n` indexes a
    // non-null output.
    unsafe {
        let mut id = *ids.add(row) as usize;
        for i in start..end {
            let value = if id < vocab {
                *table.add(id * hidden + col)
            } else {
                0.0
            };
            if !out.is_null() {
                *out.add(i) = value;
            }
            if !out16.is_null() {
                *out16.add(i) = crate::convert::f32_to_bf16_bits(value);
            }
            col += 1;
            if col == hidden && i + 1 < end {
                col = 0;
                row += 1;
                id = *ids.add(row) as usize;
            }
        }
    }
}
