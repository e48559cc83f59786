//! Token embedding from a frozen table (the target's `embed_tokens`): a gather, with no gradient.
//!
//! ```text
//!  block token ids [rows] ──embedding_gather(table [vocab, hidden])──▶ rows [rows, hidden]
//! ```

/// `out[r, c] = table[ids[r], c]` for the elements `chunk · chunk_len ..` up to `min(n, (chunk + 1) · chunk_len)`
/// of `out` (`n = rows · hidden`); an id outside the vocabulary gives a zero row (the host launcher rejects it
/// first; the device must not read outside the table).
///
/// Launch: element range (the GPU one element per thread, so a warp reads 32 adjacent columns of a row).
///
/// # Safety
/// `table` holds `vocab · hidden` elements, `ids` `ceil(n / hidden)`, `out` `n`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn embedding_gather(
    table: *const f32,
    ids: *const u32,
    out: *mut f32,
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
    // SAFETY: `row < ceil(n / hidden)` indexes `ids`; a valid id's row lies inside `table`; `i < n`.
    unsafe {
        let mut id = *ids.add(row) as usize;
        for i in start..end {
            *out.add(i) = if id < vocab {
                *table.add(id * hidden + col)
            } else {
                0.0
            };
            col += 1;
            if col == hidden && i + 1 < end {
                col = 0;
                row += 1;
                id = *ids.add(row) as usize;
            }
        }
    }
}
