//! The kernel table: every kernel declared once (name, arguments, launch shape, body), and everything that must
//! agree with the declaration generated from it.
//!
//! ```text
//!  kernel_table!(generator) ──▶ gpu-kernels/src/ptx.rs                extern "ptx-kernel" entry points (nvptx64)
//!                          ├──▶ runtime/src/backend/kernel.rs        `Kernel`, one variant per entry: the backends'
//!                          │                                         one entry point, `Backend::launch`
//!                          ├──▶ runtime/src/backend/cpu/kernels.rs   host launchers over slices (lengths checked),
//!                          │                                         and the CPU's `launch`: a match onto them
//!                          ├──▶ runtime/src/backend/cuda/launch.rs   CUDA launcher, one method per kernel, typed
//!                          │                                         pointers, and the CUDA `launch` onto them
//!                          └──▶ KERNELS (below)                      names and argument widths, for the PTX check
//!
//!  flash_kernel_table!(generator) ──▶ gpu-kernels/src/ptx.rs          the flash-attention entry points (blocks of warps)
//!                                ├──▶ runtime/src/backend/kernel.rs  `FlashKernel`: `Backend::launch_flash`
//!                                ├──▶ runtime/src/backend/cpu/flash.rs   the warp model (host lanes)
//!                                ├──▶ runtime/src/backend/cuda/launch.rs `FlashLauncher` (grid, block, shared memory)
//!                                └──▶ FLASH_KERNELS (below)          for the PTX check
//! ```
//!
//! The operations a model calls (`rmsnorm_forward`, the two-pass `sum`, the losses, EAGLE-3's) are written once,
//! as provided methods of the runtime's `Backend` trait that build `Kernel`s; no backend writes a method per
//! kernel. Where a backend runs its own body instead of the table's, [`HOST_BODIES`] declares it.
//!
//! An entry reads:
//!
//! ```text
//!  name {
//!      reads:   [arg: element type = length, ...],   device pointers the kernel only reads
//!      writes:  [arg: element type = length, ...],   device pointers it writes (and may read)
//!      scalars: [arg: type, ...],                    plain values (usize, u32 flags, f32)
//!      launch:  shape(count),
//!      body:    |launch bindings| call of the body in its module,
//!  }
//! ```
//!
//! The argument order of the entry point, of both launchers and of the kernel's ABI is reads, writes,
//! scalars. Lengths and counts are expressions over the scalars. Launch shapes:
//!
//! | shape | GPU | host | body binds |
//! | --- | --- | --- | --- |
//! | `threads(count)` | one thread per index | a loop over the indices | `index` |
//! | `planes(count)` | one warp per index, 8 per block | a [`HostPlane`](crate::plane::HostPlane) per index | `plane, index` |
//! | `plane()` | one warp | one host plane | `plane` |
//! | `elements(n)` | one thread per element (`chunk_len = 1`) | chunks of `HOST_CHUNK` | `chunk_len, chunk` |
//!
//! The table is a `macro_rules!` callback: `kernel_table!(my_generator)` expands to `my_generator! { ... }`
//! with every entry, so each consumer writes only the generator for its side.
//!
//! The flash-attention kernels have a second table, [`flash_kernel_table!`], with the launch shape
//! `blocks(count, warps, shared)`: the PTX entry points and [`FLASH_KERNELS`] come from it, the runtime's
//! launchers do not (no backend launches those kernels yet; the host runs their bodies through the warp model
//! of the tests). For attention, the CPU backend runs its own lanes and the CUDA backend the `attention_*`
//! entries of this table ([`HOST_BODIES`]).

/// `ceil(a / b)`, and 0 for `b = 0` (a count computed on the device must not reach a division panic).
#[inline(always)]
pub const fn div_ceil(a: usize, b: usize) -> usize {
    if b == 0 { 0 } else { a.div_ceil(b) }
}

/// Expands `$generator! { entries }` with the whole kernel table (see the module docs for the entry syntax).
#[macro_export]
macro_rules! kernel_table {
    ($generator:ident) => {
        $generator! {
            /// RMSNorm forward: `y = x / rms(x) ⊙ weight` per row, and `inv_rms = 1 / rms`.
            rmsnorm_forward {
                reads: [x: f32 = rows * cols, weight: f32 = cols],
                writes: [y: f32 = rows * cols, inv_rms: f32 = rows],
                scalars: [cols: usize, eps: f32, rows: usize],
                launch: planes(rows),
                body: |plane, row| $crate::norm::rmsnorm_forward(
                    x, weight, y, ::core::ptr::null_mut(), inv_rms, cols, eps, plane, row
                ),
            }
            /// RMSNorm forward that also writes `y` rounded to bfloat16 (`y16`, the same pass): the 16-bit operand
            /// of the products reading the norm's output at `bf16` precision on CUDA.
            rmsnorm_forward_bf16 {
                reads: [x: f32 = rows * cols, weight: f32 = cols],
                writes: [y: f32 = rows * cols, y16: u16 = rows * cols, inv_rms: f32 = rows],
                scalars: [cols: usize, eps: f32, rows: usize],
                launch: planes(rows),
                body: |plane, row| $crate::norm::rmsnorm_forward(
                    x, weight, y, y16, inv_rms, cols, eps, plane, row
                ),
            }
            /// RMSNorm input gradient per row (`accumulate != 0`: added to `dx`).
            rmsnorm_backward_input {
                reads: [x: f32 = rows * cols, weight: f32 = cols, inv_rms: f32 = rows, dy: f32 = rows * cols],
                writes: [dx: f32 = rows * cols],
                scalars: [cols: usize, accumulate: u32, rows: usize],
                launch: planes(rows),
                body: |plane, row| $crate::norm::rmsnorm_backward_input(
                    x, weight, inv_rms, dy, dx, ::core::ptr::null_mut(), cols, accumulate != 0, plane, row
                ),
            }
            /// RMSNorm input gradient that also writes the final `dx` rounded to bfloat16 (`dx16`, the same pass):
            /// the 16-bit operand of the backward products reading that gradient at `bf16` precision on CUDA.
            rmsnorm_backward_input_bf16 {
                reads: [x: f32 = rows * cols, weight: f32 = cols, inv_rms: f32 = rows, dy: f32 = rows * cols],
                writes: [dx: f32 = rows * cols, dx16: u16 = rows * cols],
                scalars: [cols: usize, accumulate: u32, rows: usize],
                launch: planes(rows),
                body: |plane, row| $crate::norm::rmsnorm_backward_input(
                    x, weight, inv_rms, dy, dx, dx16, cols, accumulate != 0, plane, row
                ),
            }
            /// First pass of the RMSNorm weight gradient: one partial per (chunk of rows, column).
            rmsnorm_weight_grad_partials {
                reads: [x: f32 = rows * cols, inv_rms: f32 = rows, dy: f32 = rows * cols],
                writes: [partials: f32 = $crate::table::div_ceil(rows, rows_per_chunk) * cols],
                scalars: [rows: usize, cols: usize, rows_per_chunk: usize],
                launch: threads($crate::table::div_ceil(rows, rows_per_chunk) * cols),
                body: |index| $crate::norm::rmsnorm_weight_grad_partials(
                    x, inv_rms, dy, partials, rows, cols, rows_per_chunk, index
                ),
            }
            /// Column sums of a `[rows, cols]` matrix, a plane per column (`accumulate != 0`: added to `out`).
            column_sums {
                reads: [values: f32 = rows * cols],
                writes: [out: f32 = cols],
                scalars: [rows: usize, cols: usize, accumulate: u32],
                launch: planes(cols),
                body: |plane, col| $crate::norm::column_sums(values, out, rows, cols, accumulate != 0, plane, col),
            }
            /// SwiGLU forward over `n = rows · inter` outputs from `[gate | up]` rows.
            swiglu_forward {
                reads: [gate_up: f32 = 2 * n],
                writes: [act: f32 = n],
                scalars: [inter: usize, n: usize],
                launch: elements(n),
                body: |chunk_len, chunk| $crate::activation::swiglu_forward(
                    gate_up, act, ::core::ptr::null_mut(), inter, n, chunk_len, chunk
                ),
            }
            /// SwiGLU forward that also writes `act` rounded to bfloat16 (`act16`, the same pass): the down
            /// projection's 16-bit operand on CUDA at `bf16` precision.
            swiglu_forward_bf16 {
                reads: [gate_up: f32 = 2 * n],
                writes: [act: f32 = n, act16: u16 = n],
                scalars: [inter: usize, n: usize],
                launch: elements(n),
                body: |chunk_len, chunk| $crate::activation::swiglu_forward(
                    gate_up, act, act16, inter, n, chunk_len, chunk
                ),
            }
            /// SwiGLU backward into `[dgate | dup]` rows.
            swiglu_backward {
                reads: [gate_up: f32 = 2 * n, dact: f32 = n],
                writes: [dgate_up: f32 = 2 * n],
                scalars: [inter: usize, n: usize],
                launch: elements(n),
                body: |chunk_len, chunk| $crate::activation::swiglu_backward(
                    gate_up, dact, dgate_up, ::core::ptr::null_mut(), inter, n, chunk_len, chunk
                ),
            }
            /// SwiGLU backward that also writes `[dgate | dup]` rounded to bfloat16 (`dgate_up16`, the same pass):
            /// the 16-bit operand of the `[gate; up]` gradient products on CUDA at `bf16` precision.
            swiglu_backward_bf16 {
                reads: [gate_up: f32 = 2 * n, dact: f32 = n],
                writes: [dgate_up: f32 = 2 * n, dgate_up16: u16 = 2 * n],
                scalars: [inter: usize, n: usize],
                launch: elements(n),
                body: |chunk_len, chunk| $crate::activation::swiglu_backward(
                    gate_up, dact, dgate_up, dgate_up16, inter, n, chunk_len, chunk
                ),
            }
            /// Head residual forward `h = z + silu(a)`.
            head_residual_forward {
                reads: [z: f32 = n, a: f32 = n],
                writes: [h: f32 = n],
                scalars: [n: usize],
                launch: elements(n),
                body: |chunk_len, chunk| $crate::activation::head_residual_forward(z, a, h, n, chunk_len, chunk),
            }
            /// Head residual backward: `da = dh · silu'(a)` (on the GPU `da` may be `dh`), `dz += dh`.
            head_residual_backward {
                reads: [a: f32 = n, dh: f32 = n],
                writes: [da: f32 = n, dz: f32 = n],
                scalars: [n: usize],
                launch: elements(n),
                body: |chunk_len, chunk| $crate::activation::head_residual_backward(
                    a, dh, da, dz, n, chunk_len, chunk
                ),
            }
            /// Labels `[heads, tokens]` from the batch's ids, loss mask and sequence lengths.
            build_labels {
                reads: [
                    input_ids: u32 = tokens,
                    loss_mask: u8 = tokens,
                    seq_lens: u32 = $crate::table::div_ceil(tokens, padded_len),
                ],
                writes: [labels: i32 = heads * tokens],
                scalars: [padded_len: usize, tokens: usize, vocab: usize, heads: usize],
                launch: threads(heads * tokens),
                body: |index| $crate::loss::build_labels(
                    input_ids, loss_mask, seq_lens, labels, padded_len, tokens, vocab, index
                ),
            }
            /// Valid-label counts and loss scales per head.
            head_loss_scales {
                reads: [labels: i32 = heads * tokens],
                writes: [counts: u32 = heads, scales: f32 = heads],
                scalars: [tokens: usize, heads: usize, head_decay: f32],
                launch: threads(heads),
                body: |head| $crate::loss::head_loss_scales(labels, tokens, heads, head_decay, counts, scales, head),
            }
            /// Fused cross-entropy of `rows` logits rows, the gradient written over the logits.
            vocab_loss_row {
                reads: [labels: i32 = rows, scale: f32 = 1],
                writes: [logits: f32 = rows * vocab, row_loss: f32 = rows],
                scalars: [vocab: usize, rows: usize],
                launch: planes(rows),
                body: |plane, row| $crate::loss::vocab_loss_row(logits, labels, scale, row_loss, vocab, plane, row),
            }
            /// Partial sums of `n` values, one per chunk of `chunk_len`.
            sum_partials {
                reads: [values: f32 = n],
                writes: [partials: f32 = $crate::table::div_ceil(n, chunk_len)],
                scalars: [n: usize, chunk_len: usize],
                launch: planes($crate::table::div_ceil(n, chunk_len)),
                body: |plane, chunk| $crate::reduce::sum_partials(values, partials, n, chunk_len, plane, chunk),
            }
            /// Partial sums of squares of `n` values, one per chunk of `chunk_len`.
            sum_squares_partials {
                reads: [values: f32 = n],
                writes: [partials: f32 = $crate::table::div_ceil(n, chunk_len)],
                scalars: [n: usize, chunk_len: usize],
                launch: planes($crate::table::div_ceil(n, chunk_len)),
                body: |plane, chunk| $crate::reduce::sum_squares_partials(values, partials, n, chunk_len, plane, chunk),
            }
            /// `out = Σ partials[..count]`.
            finish_sum {
                reads: [partials: f32 = count],
                writes: [out: f32 = 1],
                scalars: [count: usize],
                launch: plane(),
                body: |plane| $crate::reduce::finish_sum(partials, out, count, plane),
            }
            /// Gradient norm and clip scale from the squared partials (`max_norm ≤ 0`: no clipping).
            finish_grad_norm {
                reads: [partials: f32 = count],
                writes: [norm: f32 = 1, clip_scale: f32 = 1],
                scalars: [count: usize, max_norm: f32],
                launch: plane(),
                body: |plane| $crate::reduce::finish_grad_norm(partials, norm, clip_scale, count, max_norm, plane),
            }
            /// One fused AdamW update of `n` parameters; `hyper` is the step's scalars in device memory.
            adamw_update {
                reads: [
                    grads: f32 = n,
                    grad_norm: f32 = 1,
                    clip_scale: f32 = 1,
                    hyper: $crate::adamw::AdamWStep = 1,
                ],
                writes: [params: f32 = n, exp_avg: f32 = n, exp_avg_sq: f32 = n],
                scalars: [n: usize],
                launch: elements(n),
                body: |chunk_len, chunk| $crate::adamw::adamw_update(
                    params, ::core::ptr::null_mut(), grads, exp_avg, exp_avg_sq, grad_norm, clip_scale, *hyper,
                    n, chunk_len, chunk
                ),
            }
            /// [`adamw_update`](crate::adamw::adamw_update) that also writes the updated parameters rounded to
            /// bfloat16 (`params16`, the same pass): the copy the products read at `bf16` precision on CUDA.
            adamw_update_bf16 {
                reads: [
                    grads: f32 = n,
                    grad_norm: f32 = 1,
                    clip_scale: f32 = 1,
                    hyper: $crate::adamw::AdamWStep = 1,
                ],
                writes: [params: f32 = n, params16: u16 = n, exp_avg: f32 = n, exp_avg_sq: f32 = n],
                scalars: [n: usize],
                launch: elements(n),
                body: |chunk_len, chunk| $crate::adamw::adamw_update(
                    params, params16, grads, exp_avg, exp_avg_sq, grad_norm, clip_scale, *hyper, n, chunk_len,
                    chunk
                ),
            }
            /// Advances AdamW's device state `[steps, β1^steps, β2^steps]` for one applied step and writes that
            /// step's scalars, the learning rate from the schedule (`schedule`: 0 constant, 1 linear, 2 cosine,
            /// over `total` steps after `warmup`); a skipped step (non-finite `grad_norm`) advances nothing.
            adamw_advance {
                reads: [grad_norm: f32 = 1],
                writes: [state: f64 = 3, step: $crate::adamw::AdamWStep = 1],
                scalars: [
                    lr: f32, beta1: f32, beta2: f32, eps: f32, weight_decay: f32,
                    schedule: u32, warmup: f32, total: f32,
                ],
                launch: threads(1),
                body: |_index| $crate::adamw::adamw_advance(
                    grad_norm,
                    $crate::adamw::AdamWConstants { lr, beta1, beta2, eps, weight_decay },
                    $crate::adamw::Schedule { kind: schedule, warmup, total },
                    state,
                    step,
                ),
            }
            /// Rows of a frozen embedding table gathered by token id (`out[r] = table[ids[r]]`).
            embedding_gather {
                reads: [table: f32 = vocab * hidden, ids: u32 = $crate::table::div_ceil(n, hidden)],
                writes: [out: f32 = n],
                scalars: [vocab: usize, hidden: usize, n: usize],
                launch: elements(n),
                body: |chunk_len, chunk| $crate::embedding::embedding_gather(
                    table, ids, out, ::core::ptr::null_mut(), vocab, hidden, n, chunk_len, chunk
                ),
            }
            /// Rows gathered by index into bfloat16 only (`out16[r] = table[ids[r]]` rounded to nearest even): the
            /// head's rows as the 16-bit operand of the `lm_head` product on CUDA at `bf16` precision.
            embedding_gather_bf16 {
                reads: [table: f32 = vocab * hidden, ids: u32 = $crate::table::div_ceil(n, hidden)],
                writes: [out16: u16 = n],
                scalars: [vocab: usize, hidden: usize, n: usize],
                launch: elements(n),
                body: |chunk_len, chunk| $crate::embedding::embedding_gather(
                    table, ids, ::core::ptr::null_mut(), out16, vocab, hidden, n, chunk_len, chunk
                ),
            }
            /// RoPE in place over `[rows, heads, head_dim]` (`inverse != 0`: rotate back, the backward).
            rope {
                reads: [positions: u32 = rows],
                writes: [x: f32 = rows * heads * head_dim],
                scalars: [rows: usize, heads: usize, head_dim: usize, theta: f32, inverse: u32],
                launch: elements(rows * (head_dim / 2)),
                body: |chunk_len, chunk| $crate::rope::rope(
                    x, ::core::ptr::null_mut(), positions, heads, head_dim, theta, inverse != 0,
                    rows * (head_dim / 2), chunk_len, chunk
                ),
            }
            /// RoPE in place that also writes the rotated `x` rounded to bfloat16 (`x16`, the same pass): the
            /// flash attention kernels' q and k operands on CUDA at `bf16` precision.
            rope_bf16 {
                reads: [positions: u32 = rows],
                writes: [x: f32 = rows * heads * head_dim, x16: u16 = rows * heads * head_dim],
                scalars: [rows: usize, heads: usize, head_dim: usize, theta: f32, inverse: u32],
                launch: elements(rows * (head_dim / 2)),
                body: |chunk_len, chunk| $crate::rope::rope(
                    x, x16, positions, heads, head_dim, theta, inverse != 0, rows * (head_dim / 2), chunk_len, chunk
                ),
            }
            /// Weighted fused cross-entropy of `rows` logits rows (DFlash's decayed loss), gradient in place,
            /// with the argmax hit per row.
            weighted_vocab_loss_row {
                reads: [labels: i32 = rows, weights: f32 = rows, norm: f32 = 1],
                writes: [logits: f32 = rows * vocab, row_loss: f32 = rows, correct: f32 = rows],
                scalars: [vocab: usize, rows: usize],
                launch: planes(rows),
                body: |plane, row| $crate::loss::weighted_vocab_loss_row(
                    logits, ::core::ptr::null_mut(), labels, weights, norm, row_loss, correct, vocab, plane, row
                ),
            }
            /// The weighted fused cross-entropy that also writes the logits gradient rounded to bfloat16
            /// (`logits16`, the same pass): the 16-bit operand of the `lm_head` input-gradient product on CUDA at
            /// `bf16` precision.
            weighted_vocab_loss_row_bf16 {
                reads: [labels: i32 = rows, weights: f32 = rows, norm: f32 = 1],
                writes: [
                    logits: f32 = rows * vocab, logits16: u16 = rows * vocab, row_loss: f32 = rows,
                    correct: f32 = rows,
                ],
                scalars: [vocab: usize, rows: usize],
                launch: planes(rows),
                body: |plane, row| $crate::loss::weighted_vocab_loss_row(
                    logits, logits16, labels, weights, norm, row_loss, correct, vocab, plane, row
                ),
            }
            /// Attention forward over a context key set and a block key set, output and log-sum-exp.
            attention_forward {
                reads: [
                    q: f32 = queries * heads * head_dim,
                    k_ctx: f32 = context * kv_heads * head_dim,
                    v_ctx: f32 = context * kv_heads * head_dim,
                    k_blk: f32 = queries * kv_heads * head_dim,
                    v_blk: f32 = queries * kv_heads * head_dim,
                    query_ranges: u32 = 4 * queries,
                ],
                writes: [out: f32 = queries * heads * head_dim, lse: f32 = queries * heads],
                scalars: [
                    queries: usize, context: usize, heads: usize, kv_heads: usize, head_dim: usize, scale: f32,
                ],
                launch: planes($crate::table::div_ceil(queries, $crate::attention::QUERY_TILE) * heads),
                body: |plane, index| $crate::attention::attention_forward(
                    q, k_ctx, v_ctx, k_blk, v_blk, query_ranges, out, lse,
                    queries, context, heads, kv_heads, head_dim, scale, plane, index
                ),
            }
            /// `delta = rowsum(dout ∘ out)` per (query, head), for the attention backward.
            attention_delta {
                reads: [out: f32 = rows * head_dim, dout: f32 = rows * head_dim],
                writes: [delta: f32 = rows],
                scalars: [head_dim: usize, rows: usize],
                launch: planes(rows),
                body: |plane, index| $crate::attention::attention_delta(out, dout, delta, head_dim, plane, index),
            }
            /// Attention query gradient (query-major, probabilities recomputed from the saved log-sum-exp).
            attention_backward_q {
                reads: [
                    q: f32 = queries * heads * head_dim,
                    k_ctx: f32 = context * kv_heads * head_dim,
                    v_ctx: f32 = context * kv_heads * head_dim,
                    k_blk: f32 = queries * kv_heads * head_dim,
                    v_blk: f32 = queries * kv_heads * head_dim,
                    query_ranges: u32 = 4 * queries,
                    dout: f32 = queries * heads * head_dim,
                    lse: f32 = queries * heads,
                    delta: f32 = queries * heads,
                ],
                writes: [dq: f32 = queries * heads * head_dim],
                scalars: [
                    queries: usize, context: usize, heads: usize, kv_heads: usize, head_dim: usize, scale: f32,
                ],
                launch: planes($crate::table::div_ceil(queries, $crate::attention::QUERY_TILE) * heads),
                body: |plane, index| $crate::attention::attention_backward_q(
                    q, k_ctx, v_ctx, k_blk, v_blk, query_ranges, dout, lse, delta, dq,
                    queries, context, heads, kv_heads, head_dim, scale, plane, index
                ),
            }
            /// Attention key and value gradients of one key set (key-major over the queries that see each key).
            attention_backward_kv {
                reads: [
                    q: f32 = queries * heads * head_dim,
                    dout: f32 = queries * heads * head_dim,
                    lse: f32 = queries * heads,
                    delta: f32 = queries * heads,
                    k: f32 = keys * kv_heads * head_dim,
                    v: f32 = keys * kv_heads * head_dim,
                    key_ranges: u32 = 2 * keys,
                ],
                writes: [dk: f32 = keys * kv_heads * head_dim, dv: f32 = keys * kv_heads * head_dim],
                scalars: [
                    keys: usize, queries: usize, heads: usize, kv_heads: usize, head_dim: usize, scale: f32,
                ],
                launch: planes($crate::table::div_ceil(keys, $crate::attention::KEY_TILE) * kv_heads),
                body: |plane, index| $crate::attention::attention_backward_kv(
                    q, dout, lse, delta, k, v, key_ranges, dk, dv,
                    keys, queries, heads, kv_heads, head_dim, scale, plane, index
                ),
            }
            /// `out = x` as bfloat16 (`format` 0) or IEEE half (1) bits, rounded to nearest even: the 16-bit copy
            /// of a product's f32 operand when the other operand holds 16-bit hidden states.
            round_to_half {
                reads: [x: f32 = n],
                writes: [out: u16 = n],
                scalars: [n: usize, format: u32],
                launch: elements(n),
                body: |chunk_len, chunk| $crate::convert::round_to_half(x, out, n, format, chunk_len, chunk),
            }
            /// EAGLE-3's unroll attention forward of TTT step `step`: causal over step 0's keys, one diagonal key
            /// per cached step (`k_all`, `v_all` stacked `[steps, rows, kv_heads, head_dim]`).
            eagle3_attention_forward {
                reads: [
                    q: f32 = rows * heads * head_dim,
                    k_all: f32 = (step + 1) * rows * kv_heads * head_dim,
                    v_all: f32 = (step + 1) * rows * kv_heads * head_dim,
                ],
                writes: [out: f32 = rows * heads * head_dim, lse: f32 = rows * heads],
                scalars: [
                    rows: usize, padded_len: usize, step: usize, heads: usize, kv_heads: usize, head_dim: usize,
                    scale: f32,
                ],
                launch: planes(rows * heads),
                body: |plane, index| $crate::eagle3::eagle3_attention_forward(
                    q, k_all, v_all, out, lse, rows, padded_len, step, heads, kv_heads, head_dim, scale, plane, index
                ),
            }
            /// EAGLE-3's unroll attention query gradient of TTT step `step`.
            eagle3_attention_backward_q {
                reads: [
                    q: f32 = rows * heads * head_dim,
                    k_all: f32 = (step + 1) * rows * kv_heads * head_dim,
                    v_all: f32 = (step + 1) * rows * kv_heads * head_dim,
                    dout: f32 = rows * heads * head_dim,
                    lse: f32 = rows * heads,
                    delta: f32 = rows * heads,
                ],
                writes: [dq: f32 = rows * heads * head_dim],
                scalars: [
                    rows: usize, padded_len: usize, step: usize, heads: usize, kv_heads: usize, head_dim: usize,
                    scale: f32,
                ],
                launch: planes(rows * heads),
                body: |plane, index| $crate::eagle3::eagle3_attention_backward_q(
                    q, k_all, v_all, dout, lse, delta, dq,
                    rows, padded_len, step, heads, kv_heads, head_dim, scale, plane, index
                ),
            }
            /// EAGLE-3's unroll attention key and value gradients from TTT step `step`'s queries, added into the
            /// stacked gradients of every step's keys (a plane per (row, kv head) owns that row's keys).
            eagle3_attention_backward_kv {
                reads: [
                    q: f32 = rows * heads * head_dim,
                    dout: f32 = rows * heads * head_dim,
                    lse: f32 = rows * heads,
                    delta: f32 = rows * heads,
                    k_all: f32 = (step + 1) * rows * kv_heads * head_dim,
                    v_all: f32 = (step + 1) * rows * kv_heads * head_dim,
                ],
                writes: [
                    dk_all: f32 = (step + 1) * rows * kv_heads * head_dim,
                    dv_all: f32 = (step + 1) * rows * kv_heads * head_dim,
                ],
                scalars: [
                    rows: usize, padded_len: usize, step: usize, heads: usize, kv_heads: usize, head_dim: usize,
                    scale: f32,
                ],
                launch: planes(rows * kv_heads),
                body: |plane, index| $crate::eagle3::eagle3_attention_backward_kv(
                    q, dout, lse, delta, k_all, v_all, dk_all, dv_all,
                    rows, padded_len, step, heads, kv_heads, head_dim, scale, plane, index
                ),
            }
            /// Soft-label cross entropy of `rows` draft logits rows against teacher logits rows, gradient in
            /// place of the draft logits, loss and argmax agreement per row.
            soft_label_loss_row {
                reads: [teacher: f32 = rows * vocab, weights: f32 = rows],
                writes: [draft: f32 = rows * vocab, row_loss: f32 = rows, correct: f32 = rows],
                scalars: [scale: f32, vocab: usize, rows: usize],
                launch: planes(rows),
                body: |plane, row| $crate::eagle3::soft_label_loss_row(
                    draft, teacher, weights, row_loss, correct, scale, vocab, plane, row
                ),
            }
            /// Whether each row's full-vocabulary argmax is in the draft vocabulary (and its loss mask set).
            argmax_in_draft_row {
                reads: [logits: f32 = rows * vocab, t2d: u8 = vocab, loss_mask: u8 = rows],
                writes: [valid: f32 = rows],
                scalars: [vocab: usize, rows: usize],
                launch: planes(rows),
                body: |plane, row| $crate::eagle3::argmax_in_draft_row(logits, t2d, loss_mask, valid, vocab, plane, row),
            }
            /// Rows shifted up by `shift` inside each sequence, zeros past its end.
            shift_rows {
                reads: [src: f32 = n],
                writes: [dst: f32 = n],
                scalars: [width: usize, padded_len: usize, shift: usize, n: usize],
                launch: elements(n),
                body: |chunk_len, chunk| $crate::eagle3::shift_rows(
                    src, dst, width, padded_len, shift, n, chunk_len, chunk
                ),
            }
            /// [`shift_rows`](crate::eagle3::shift_rows) of 16-bit hidden states, widened to f32.
            shift_rows_half {
                reads: [src: u16 = n],
                writes: [dst: f32 = n],
                scalars: [width: usize, padded_len: usize, shift: usize, format: u32, n: usize],
                launch: elements(n),
                body: |chunk_len, chunk| $crate::eagle3::shift_rows_half(
                    src, dst, width, padded_len, shift, format, n, chunk_len, chunk
                ),
            }
            /// Token ids shifted up by `shift` inside each sequence, 0 past its end.
            shift_ids {
                reads: [src: u32 = rows],
                writes: [dst: u32 = rows],
                scalars: [padded_len: usize, shift: usize, rows: usize],
                launch: threads(rows),
                body: |row| $crate::eagle3::shift_ids(src, dst, padded_len, shift, row),
            }
            /// RoPE positions `r % padded_len + offset`.
            step_positions {
                reads: [],
                writes: [positions: u32 = rows],
                scalars: [padded_len: usize, offset: usize, rows: usize],
                launch: threads(rows),
                body: |row| $crate::eagle3::step_positions(positions, padded_len, offset, row),
            }
            /// `out[r] = [a[r] | b[r]]`.
            concat_columns {
                reads: [a: f32 = $crate::table::div_ceil(n, wa + wb) * wa, b: f32 = $crate::table::div_ceil(n, wa + wb) * wb],
                writes: [out: f32 = n],
                scalars: [wa: usize, wb: usize, n: usize],
                launch: elements(n),
                body: |chunk_len, chunk| $crate::eagle3::concat_columns(a, b, out, wa, wb, n, chunk_len, chunk),
            }
            /// `a[r] = x[r, ..wa]`, `b[r] = x[r, wa..]`.
            split_columns {
                reads: [x: f32 = n],
                writes: [a: f32 = $crate::table::div_ceil(n, wa + wb) * wa, b: f32 = $crate::table::div_ceil(n, wa + wb) * wb],
                scalars: [wa: usize, wb: usize, n: usize],
                launch: elements(n),
                body: |chunk_len, chunk| $crate::eagle3::split_columns(x, a, b, wa, wb, n, chunk_len, chunk),
            }
            /// The accepted prefixes of `blocks` blocks of `slots` drafted slots summed (the first slot whose
            /// `correct` is 0 ends a block's), the exact acceptance length's numerator.
            accepted_prefix_sum {
                reads: [correct: f32 = $crate::acceptance::strided_len(blocks, slots, block_stride, slot_stride)],
                writes: [accepted: f32 = 1],
                scalars: [blocks: usize, slots: usize, block_stride: usize, slot_stride: usize],
                launch: plane(),
                body: |plane| $crate::acceptance::accepted_prefix_sum(
                    correct, accepted, blocks, slots, block_stride, slot_stride, plane
                ),
            }
            /// Rows each TTT step's accuracy is over: the loss mask shifted by the step, counted.
            step_mask_counts {
                reads: [loss_mask: u8 = rows],
                writes: [counts: f32 = steps],
                scalars: [rows: usize, padded_len: usize, steps: usize],
                launch: plane(),
                body: |plane| $crate::eagle3::step_mask_counts(loss_mask, counts, rows, padded_len, steps, plane),
            }
        }
    };
}

/// An operation of the runtime's `Backend` trait that the CPU backend runs with its own host body instead of the
/// table's kernels, which every other backend (CUDA) launches: the table's bodies are shaped for a warp, and
/// for these the host has a faster layout of the same mathematics (docs/kernels.md, "Attention and RoPE on the
/// host").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostBody {
    /// The `Backend` method the CPU backend overrides.
    pub operation: &'static str,
    /// Where its host body lives, from the workspace root.
    pub body: &'static str,
    /// The table's kernels the other backends launch for it, in order.
    pub kernels: &'static [&'static str],
}

/// Which body runs where: every `Backend` operation over the table's kernels runs them on every backend, except
/// these, which the CPU backend runs with its own body. The operations that are no table kernel at all are
/// backend methods of their own on every backend: the products (`gemm`, `gemm_hs`), `fill`, `copy`, staging and
/// the gradient all-reduce. docs/kernels.md's table of it is checked against this list by a test.
pub const HOST_BODIES: &[HostBody] = &[
    HostBody {
        operation: "rope",
        body: "runtime/src/backend/cpu/rope.rs",
        kernels: &["rope"],
    },
    HostBody {
        operation: "attention_forward",
        body: "runtime/src/backend/cpu/attention/lanes.rs",
        kernels: &["attention_forward"],
    },
    HostBody {
        operation: "attention_backward",
        body: "runtime/src/backend/cpu/attention/lanes.rs",
        kernels: &[
            "attention_delta",
            "attention_backward_q",
            "attention_backward_kv",
        ],
    },
];

/// One kernel's entry in [`KERNELS`]: its name and the byte width of each argument of its entry point, in
/// order (pointers are 8 bytes on nvptx64).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelSignature {
    /// The exported name.
    pub name: &'static str,
    /// Byte width of each argument.
    pub argument_widths: &'static [usize],
}

/// Bytes of a device pointer to `T` on nvptx64, whatever the host's pointer width.
#[allow(clippy::extra_unused_type_parameters)] // the table's repetition names the element type
const fn device_pointer_width<T>() -> usize {
    8
}

macro_rules! signatures {
    ($(
        $(#[$doc:meta])*
        $name:ident {
            reads: [$($read:ident: $read_ty:ty = $read_len:expr),* $(,)?],
            writes: [$($write:ident: $write_ty:ty = $write_len:expr),* $(,)?],
            scalars: [$($scalar:ident: $scalar_ty:ty),* $(,)?],
            launch: $shape:ident($($count:expr)?),
            body: |$($bind:ident),*| $body:expr,
        }
    )*) => {
        /// Every kernel of the table, in table order, with the argument widths of its entry point.
        pub const KERNELS: &[KernelSignature] = &[$(
            KernelSignature {
                name: stringify!($name),
                argument_widths: &[
                    $(device_pointer_width::<$read_ty>(),)*
                    $(device_pointer_width::<$write_ty>(),)*
                    $(size_of::<$scalar_ty>(),)*
                ],
            },
        )*];
    };
}

kernel_table!(signatures);

/// Expands `$generator! { entries }` with the flash-attention kernels ([`crate::flash`]): entries as in
/// [`kernel_table!`], with the launch shape `blocks(count, warps, shared)` (a thread block of `32 · warps` threads
/// per index, `shared` bytes of static shared memory) and a body binding `(warp, smem, index)`. They have their
/// own table because their launch shape is a thread block of cooperating warps: the device entry points,
/// [`FLASH_KERNELS`], the runtime's `FlashKernel` and both backends' `Backend::launch_flash` are generated from
/// it. A body's lane count is inferred from its warp (`DeviceWarp`: one lane per thread on the GPU;
/// `ModelWarp`: the whole warp in one host thread), so the CUDA backend runs them on the device and the CPU
/// backend through the warp model (docs/kernels.md, "Flash attention").
#[macro_export]
macro_rules! flash_kernel_table {
    ($generator:ident) => {
        $crate::flash_kernel_table!(@dims $generator
            [flash_forward_d64, flash_backward_q_d64, flash_backward_kv_d64, 64, 8, 4]
            [flash_forward_d128, flash_backward_q_d128, flash_backward_kv_d128, 128, 16, 8]
        );
    };
    (@dims $generator:ident $([$forward:ident, $backward_q:ident, $backward_kv:ident, $d:literal, $d8:literal, $d16:literal])*) => {
        $generator! {$(
            /// Flash forward (bf16 Q/K/V, f32 out and log-sum-exp, and the out's bf16 copy for the `o_proj`
            /// product), one block per (DFlash block, kv head).
            $forward {
                reads: [
                    q: u16 = queries * heads * $d,
                    k_ctx: u16 = context * kv_heads * $d,
                    v_ctx: u16 = context * kv_heads * $d,
                    k_blk: u16 = queries * kv_heads * $d,
                    v_blk: u16 = queries * kv_heads * $d,
                    query_ranges: u32 = 4 * queries,
                ],
                writes: [
                    out: f32 = queries * heads * $d,
                    out_bf16: u16 = queries * heads * $d,
                    lse: f32 = queries * heads,
                ],
                scalars: [queries: usize, context: usize, heads: usize, kv_heads: usize, scale: f32],
                launch: blocks(
                    queries / $crate::flash::BLOCK * kv_heads,
                    heads / kv_heads,
                    $crate::flash::query_major_smem_bytes($d)
                ),
                body: |warp, smem, index| $crate::flash::forward::flash_forward::<_, $d, $d8, $d16, _>(
                    $crate::flash::forward::FlashInputs {
                        q, k_ctx, v_ctx, k_blk, v_blk, query_ranges, queries, context, heads, kv_heads, scale,
                    },
                    (out, out_bf16), lse, smem, warp, index
                ),
            }
            /// Flash backward, query-major: `delta = rowsum(dout ∘ out)`, dq, and dout's bf16 copy.
            $backward_q {
                reads: [
                    q: u16 = queries * heads * $d,
                    k_ctx: u16 = context * kv_heads * $d,
                    v_ctx: u16 = context * kv_heads * $d,
                    k_blk: u16 = queries * kv_heads * $d,
                    v_blk: u16 = queries * kv_heads * $d,
                    query_ranges: u32 = 4 * queries,
                    out: f32 = queries * heads * $d,
                    dout: f32 = queries * heads * $d,
                    lse: f32 = queries * heads,
                ],
                writes: [
                    delta: f32 = queries * heads,
                    dq: f32 = queries * heads * $d,
                    dout_bf16: u16 = queries * heads * $d,
                ],
                scalars: [queries: usize, context: usize, heads: usize, kv_heads: usize, scale: f32],
                launch: blocks(
                    queries / $crate::flash::BLOCK * kv_heads,
                    heads / kv_heads,
                    $crate::flash::query_major_smem_bytes($d)
                ),
                body: |warp, smem, index| $crate::flash::backward::flash_backward_q::<_, $d, $d8, $d16, _>(
                    $crate::flash::forward::FlashInputs {
                        q, k_ctx, v_ctx, k_blk, v_blk, query_ranges, queries, context, heads, kv_heads, scale,
                    },
                    out, dout, lse, delta, dq, dout_bf16, smem, warp, index
                ),
            }
            /// Flash backward, key-major over one key set: dk and dv.
            $backward_kv {
                reads: [
                    q: u16 = queries * heads * $d,
                    dout: u16 = queries * heads * $d,
                    lse: f32 = queries * heads,
                    delta: f32 = queries * heads,
                    k: u16 = keys * kv_heads * $d,
                    v: u16 = keys * kv_heads * $d,
                    key_ranges: u32 = 2 * keys,
                ],
                writes: [dk: f32 = keys * kv_heads * $d, dv: f32 = keys * kv_heads * $d],
                scalars: [keys: usize, queries: usize, heads: usize, kv_heads: usize, scale: f32],
                launch: blocks(
                    $crate::table::div_ceil(keys, $crate::flash::KV_TILE) * kv_heads,
                    $crate::flash::KV_WARPS,
                    $crate::flash::key_major_smem_bytes($d)
                ),
                body: |warp, smem, index| $crate::flash::backward::flash_backward_kv::<_, $d, $d8, $d16, _>(
                    $crate::flash::backward::KeyMajorInputs {
                        q, dout, lse, delta, k, v, key_ranges, keys, queries, heads, kv_heads, scale,
                    },
                    dk, dv, smem, warp, index
                ),
            }
        )*}
    };
}

macro_rules! flash_signatures {
    ($(
        $(#[$doc:meta])*
        $name:ident {
            reads: [$($read:ident: $read_ty:ty = $read_len:expr),* $(,)?],
            writes: [$($write:ident: $write_ty:ty = $write_len:expr),* $(,)?],
            scalars: [$($scalar:ident: $scalar_ty:ty),* $(,)?],
            launch: blocks($count:expr, $warps:expr, $shared:expr),
            body: |$($bind:ident),*| $body:expr,
        }
    )*) => {
        /// The flash-attention kernels ([`flash_kernel_table!`]), with the argument widths of their entry points.
        pub const FLASH_KERNELS: &[KernelSignature] = &[$(
            KernelSignature {
                name: stringify!($name),
                argument_widths: &[
                    $(device_pointer_width::<$read_ty>(),)*
                    $(device_pointer_width::<$write_ty>(),)*
                    $(size_of::<$scalar_ty>(),)*
                ],
            },
        )*];
    };
}

flash_kernel_table!(flash_signatures);
