//! Elementwise activations: the fused SwiGLU of the MLP blocks and the heads' residual `z + silu(a)`.
//!
//! These kernels take an element range: a call handles elements `chunk · chunk_len ..` up to
//! `min(n, (chunk + 1) · chunk_len)`. The GPU launches `chunk_len = 1` (one element per thread, coalesced);
//! the CPU uses long chunks so the inner loop vectorises.
//!
//! The block residual `x + down(...)` needs no kernel: the down projection's GEMM accumulates into `x`.

/// The element range `[start, end)` of one chunk.
#[inline(always)]
fn chunk_range(n: usize, chunk_len: usize, chunk: usize) -> (usize, usize) {
    let start = chunk * chunk_len;
    let end = start + chunk_len;
    (start, if end < n { end } else { n })
}

/// SwiGLU forward: `act[t, i] = silu(gate[t, i]) · up[t, i]`, where each row of `gate_up` is
/// `[gate (inter) | up (inter)]` — the output of one GEMM against the adjacent `gate.weight`/`up.weight`
/// tensors of the flat buffer. Element `e` of `act` is `(t, i) = (e / inter, e % inter)`. When `act16` is not
/// null it also receives `act` rounded to bfloat16 (nearest even) in the same pass: the down projection's
/// 16-bit operand on CUDA at `bf16` precision, while `act` stays f32 for the backward.
///
/// Launch: element range (see the module docs), `n = rows · inter`.
///
/// # Safety
/// `gate_up` holds `2 · n` elements, `act` (and `act16` unless null) `n`; none overlap.
#[inline(always)]
pub unsafe fn swiglu_forward(
    gate_up: *const f32,
    act: *mut f32,
    act16: *mut u16,
    inter: usize,
    n: usize,
    chunk_len: usize,
    chunk: usize,
) {
    // A zero divisor means an empty launch; returning keeps the device path free of the division panic.
    if inter == 0 {
        return;
    }
    let (start, end) = chunk_range(n, chunk_len, chunk);
    let mut e = start;
    while e < end {
        let t = e / inter;
        let i0 = e % inter;
        let row_end = if (t + 1) * inter < end {
            (t + 1) * inter
        } else {
            end
        };
        // SAFETY: `e..row_end` lies in row `t` of `act`; the matching gate/up elements lie in row `t` of `gate_up`.
        unsafe {
            let gate = gate_up.add(2 * t * inter);
            let up = gate.add(inter);
            let out = act.add(t * inter);
            for i in i0..i0 + (row_end - e) {
                let value = crate::math::silu(*gate.add(i)) * *up.add(i);
                *out.add(i) = value;
                if !act16.is_null() {
                    *act16.add(t * inter + i) = crate::convert::f32_to_bf16_bits(value);
                }
            }
        }
        e = row_end;
    }
}

/// SwiGLU backward, both input gradients in one pass: `dgate = dact · up · silu'(gate)`,
/// `dup = dact · silu(gate)`, written into the `[dgate | dup]` row layout of `dgate_up`. When `dgate_up16` is
/// not null it also receives both rounded to bfloat16 (nearest even, same layout) in the same pass: the operand
/// of the `[gate; up]` weight- and input-gradient products at `bf16` precision on CUDA.
///
/// Launch: element range, `n = rows · inter` (same indexing as [`swiglu_forward`]).
///
/// # Safety
/// `gate_up`, `dgate_up` (and `dgate_up16` unless null) hold `2 · n` elements, `dact` `n`; `dgate_up` overlaps
/// neither input; `dgate_up16` overlaps nothing.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn swiglu_backward(
    gate_up: *const f32,
    dact: *const f32,
    dgate_up: *mut f32,
    dgate_up16: *mut u16,
    inter: usize,
    n: usize,
    chunk_len: usize,
    chunk: usize,
) {
    // A zero divisor means an empty launch; returning keeps the device path free of the division panic.
    if inter == 0 {
        return;
    }
    let (start, end) = chunk_range(n, chunk_len, chunk);
    let mut e = start;
    while e < end {
        let t = e / inter;
        let i0 = e % inter;
        let row_end = if (t + 1) * inter < end {
            (t + 1) * inter
        } else {
            end
        };
        // SAFETY: as in `swiglu_forward`, every access stays in row `t` of its buffer.
        unsafe {
            let gate = gate_up.add(2 * t * inter);
            let up = gate.add(inter);
            let d = dact.add(t * inter);
            let dgate = dgate_up.add(2 * t * inter);
            let dup = dgate.add(inter);
            for i in i0..i0 + (row_end - e) {
                let (s, ds) = crate::math::silu_and_grad(*gate.add(i));
                let g = *d.add(i);
                let (dg, du) = (g * *up.add(i) * ds, g * s);
                *dgate.add(i) = dg;
                *dup.add(i) = du;
                if !dgate_up16.is_null() {
                    let row16 = dgate_up16.add(2 * t * inter);
                    *row16.add(i) = crate::convert::f32_to_bf16_bits(dg);
                    *row16.add(inter + i) = crate::convert::f32_to_bf16_bits(du);
                }
            }
        }
        e = row_end;
    }
}

/// Head residual forward: `h = z + silu(a)` elementwise.
///
/// Launch: element range over `n` elements.
///
/// # Safety
/// All three buffers hold `n` elements; `h` overlaps neither input.
#[inline(always)]
pub unsafe fn head_residual_forward(
    z: *const f32,
    a: *const f32,
    h: *mut f32,
    n: usize,
    chunk_len: usize,
    chunk: usize,
) {
    let (start, end) = chunk_range(n, chunk_len, chunk);
    // SAFETY: `start..end` is inside all three buffers.
    unsafe {
        for e in start..end {
            *h.add(e) = *z.add(e) + crate::math::silu(*a.add(e));
        }
    }
}

/// Head residual backward: `da = dh · silu'(a)` and `dz += dh` (the identity path; the path through `a`
/// is added to `dz` by the caller's GEMM `da · W`). `da` may be the same buffer as `dh` (in place).
///
/// Launch: element range over `n` elements.
///
/// # Safety
/// All buffers hold `n` elements; `dz` overlaps none of the others; `da` overlaps `dh` only if equal to it.
#[inline(always)]
pub unsafe fn head_residual_backward(
    a: *const f32,
    dh: *const f32,
    da: *mut f32,
    dz: *mut f32,
    n: usize,
    chunk_len: usize,
    chunk: usize,
) {
    let (start, end) = chunk_range(n, chunk_len, chunk);
    // SAFETY: `start..end` is inside all buffers; each element is read before it is written.
    unsafe {
        for e in start..end {
            let g = *dh.add(e);
            let (_, ds) = crate::math::silu_and_grad(*a.add(e));
            *dz.add(e) += g;
            *da.add(e) = g * ds;
        }
    }
}
