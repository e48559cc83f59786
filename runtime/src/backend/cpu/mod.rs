//! The CPU backend: buffers are `Vec`s, matrix products go to the `gemm` crate ([`gemm`]), every kernel
//! [`Backend::launch`] gets to its host launcher (`kernels::run`, the generated match; AVX2 + FMA when the CPU
//! has both), and the operations the table declares host bodies for (`HOST_BODIES`: attention and RoPE) to
//! those ([`attention`], [`rope`]), overriding the trait's launches of the table's kernels. Everything runs at
//! once on the calling thread (or the drafter's [`HostThreads`]), so a step's results are ready when the step
//! returns.
//!
//! Reduced precisions are emulated: both operands of a product are rounded (bf16: round to nearest even, 8-bit
//! mantissa; TF32: 10-bit) into two scratch buffers first, then multiplied in f32, which is what tensor cores
//! compute up to the order of the f32 accumulation. So the backend-generic tests cover the GPU's numerics here.

pub mod attention;
mod flash;
pub(crate) mod gemm;
pub mod kernels;
pub mod rope;
mod threads;

pub use gemm::{GEMM_THREADS_VAR, gemm_flops, gemm_threads, matmul};
pub use threads::HostThreads;

use std::sync::Arc;

use draftpipe_compiler::plan::{BackendKind, WorkspaceLayout};

use super::{
    AttentionGrads, AttentionInputs, AttentionSaved, AttentionShape, Backend, BackendError,
    BackendResult, Buf, Dst, Element, FlashKernel, HostBatch, HsBuf, HsOperand, HsSrc, InputSlot,
    Kernel, Operand, Precision, Reinterpret, Src, StepPart, StepResults, gemm_shape,
    missing_last_hidden_states,
};
use crate::allreduce::AllReduce;
use crate::batch::HsSlice;
use attention::{AttentionGradSlices, AttentionSlices, HostKernels};
use draftpipe_compiler::workspace::STEP_SCALARS;
use gemm::{Mat, Strided, gemm, gemm_strided};

/// The host as a backend. See the module docs.
pub struct CpuBackend {
    /// Operands rounded to the product's precision (empty when the layout has no emulated precision).
    round_a: Vec<f32>,
    round_b: Vec<f32>,
    /// Rows of bf16/f16 hidden states widened for a product (the layout's `hs_tile`; empty for f32 inputs).
    hs_tile: Vec<f32>,
    /// The data-parallel group whose mean the gradients take, if any.
    group: Option<Arc<AllReduce>>,
    /// The step results "read back" per ring slot (a plain copy: host memory), as long as the layout's
    /// `step_scalars`.
    results: [Vec<f32>; 2],
    allocated: u64,
}

pub(crate) fn slice<'a, T: Element>(view: Src<'a, CpuBackend, T>) -> &'a [T] {
    let (raw, start, len) = view.parts();
    &raw[start..start + len]
}

fn slices<'a>(inputs: AttentionInputs<'a, CpuBackend>) -> AttentionSlices<'a> {
    AttentionSlices {
        q: slice(inputs.q),
        k_ctx: slice(inputs.k_ctx),
        v_ctx: slice(inputs.v_ctx),
        k_blk: slice(inputs.k_blk),
        v_blk: slice(inputs.v_blk),
        query_ranges: slice(inputs.query_ranges),
    }
}

pub(crate) fn slice_mut<'a, T: Element>(view: Dst<'a, CpuBackend, T>) -> &'a mut [T] {
    let (raw, start, len) = view.parts();
    &mut raw[start..start + len]
}

/// Rounds `x` to a float with `mantissa` explicit bits (round to nearest, ties to even); NaN and infinities
/// pass through.
fn round_mantissa(x: f32, mantissa: u32) -> f32 {
    if !x.is_finite() {
        return x;
    }
    let drop = 23 - mantissa;
    let bits = x.to_bits();
    let half = (1u32 << (drop - 1)) - 1 + ((bits >> drop) & 1);
    f32::from_bits((bits + half) & !((1u32 << drop) - 1))
}

impl<T: Element> Buf<CpuBackend, T> {
    /// The elements (host memory).
    pub fn as_slice(&self) -> &[T] {
        &self.raw
    }

    /// The elements, to write (host memory).
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        &mut self.raw
    }

    /// Exchanges the buffer's vector with `vec` (same length), without copying.
    ///
    /// # Panics
    /// When the lengths differ.
    pub fn swap_vec(&mut self, vec: &mut Vec<T>) {
        assert_eq!(vec.len(), self.len, "swap_vec: lengths differ");
        std::mem::swap(&mut self.raw, vec);
    }
}

impl CpuBackend {
    /// A backend with the rounding buffers `layout` asks for (`gemm_round_a`/`gemm_round_b`, present when the
    /// drafter's precision is emulated).
    pub fn new(layout: &WorkspaceLayout) -> Self {
        let round = |name| vec![0.0f32; layout.elements(name).unwrap_or(0)];
        let (round_a, round_b) = (round("gemm_round_a"), round("gemm_round_b"));
        let hs_tile = round("hs_tile");
        let allocated = 4 * (round_a.len() + round_b.len() + hs_tile.len()) as u64;
        let scalars = layout.elements("step_scalars").unwrap_or(STEP_SCALARS);
        Self {
            round_a,
            round_b,
            hs_tile,
            group: None,
            results: std::array::from_fn(|_| vec![0.0; scalars]),
            allocated,
        }
    }

    /// Averages the gradients over `group` in [`Backend::average_gradients`].
    pub fn with_group(mut self, group: Arc<AllReduce>) -> Self {
        self.group = Some(group);
        self
    }

    /// Rounds `data` into `scratch` and returns the rounded copy (or `data` at full precision).
    fn rounded<'a>(data: &'a [f32], scratch: &'a mut [f32], precision: Precision) -> &'a [f32] {
        let Some(mantissa) = Self::mantissa(precision) else {
            return data;
        };
        let scratch = &mut scratch[..data.len()];
        for (r, &x) in scratch.iter_mut().zip(data) {
            *r = round_mantissa(x, mantissa);
        }
        scratch
    }

    /// Explicit mantissa bits of `precision`'s operands, `None` for f32.
    fn mantissa(precision: Precision) -> Option<u32> {
        match precision {
            Precision::F32 => None,
            Precision::Tf32 => Some(10),
            Precision::Bf16 => Some(7),
        }
    }

    /// `c = alpha · a · b + beta · c` where `hs` (a if `hs_is_a`, else b) holds hidden states in a narrower
    /// precision: its stored rows are widened [`HS_TILE_ROWS`](draftpipe_compiler::workspace::HS_TILE_ROWS) at
    /// a time into `hs_tile`, and each tile is one product on the matching block of rows or columns of `c`
    /// (stored rows of `hs` along `m` or `n`) or one accumulation step (along `k`).
    #[allow(clippy::too_many_arguments)]
    fn gemm_tiled(
        &mut self,
        c: &mut [f32],
        (hs, hs_is_a): (HsOperand<'_, Self>, bool),
        other: Operand<'_, Self>,
        (m, k, n): (usize, usize, usize),
        alpha: f32,
        beta: f32,
        precision: Precision,
    ) {
        let scratch = if hs_is_a {
            &mut self.round_b
        } else {
            &mut self.round_a
        };
        let other_data = Self::rounded(slice(other.data), scratch, precision);
        let (o_rs, o_cs) = if other.transposed {
            (1, other.cols)
        } else {
            (other.cols, 1)
        };
        let other_at = |offset| Strided {
            data: other_data,
            offset,
            row_stride: o_rs,
            col_stride: o_cs,
        };
        let hs_rows: HsSlice<'_> = match hs.data {
            HsSrc::F32(v) => HsSlice::F32(slice(v)),
            HsSrc::Bf16(v) => HsSlice::Bf16(slice(v)),
            HsSrc::F16(v) => HsSlice::F16(slice(v)),
        };
        let (rows, cols) = (hs.rows, hs.cols);
        if rows == 0 || cols == 0 {
            // No tile: the product is empty along `k` (c = beta · c) or `c` has no element.
            c.iter_mut()
                .for_each(|x| *x = if beta == 0.0 { 0.0 } else { beta * *x });
            return;
        }
        let tile_rows = self.hs_tile.len() / cols;
        assert!(
            tile_rows > 0,
            "the layout has no `hs_tile` for narrow hidden states"
        );
        for first in (0..rows).step_by(tile_rows) {
            let count = tile_rows.min(rows - first);
            let tile = &mut self.hs_tile[..count * cols];
            hs_rows
                .slice(first * cols..(first + count) * cols)
                .widen_into(tile);
            if let Some(mantissa) = Self::mantissa(precision) {
                tile.iter_mut()
                    .for_each(|x| *x = round_mantissa(*x, mantissa));
            }
            let tile: &[f32] = tile;
            // The tile as used: its stored rows are the operand's, so a transposed operand reads it by columns.
            let tile = if hs.transposed {
                Strided {
                    data: tile,
                    offset: 0,
                    row_stride: 1,
                    col_stride: cols,
                }
            } else {
                Strided {
                    data: tile,
                    offset: 0,
                    row_stride: cols,
                    col_stride: 1,
                }
            };
            // Along `k`, every tile after the first adds to what the earlier ones wrote.
            let beta_k = if first == 0 { beta } else { 1.0 };
            match (hs_is_a, hs.transposed) {
                (true, false) => gemm_strided(
                    (&mut *c, first * n, n, 1),
                    tile,
                    other_at(0),
                    (count, k, n),
                    alpha,
                    beta,
                ),
                (true, true) => gemm_strided(
                    (&mut *c, 0, n, 1),
                    tile,
                    other_at(first * o_rs),
                    (m, count, n),
                    alpha,
                    beta_k,
                ),
                (false, false) => gemm_strided(
                    (&mut *c, 0, n, 1),
                    other_at(first * o_cs),
                    tile,
                    (m, count, n),
                    alpha,
                    beta_k,
                ),
                (false, true) => gemm_strided(
                    (&mut *c, first, n, 1),
                    other_at(0),
                    tile,
                    (m, k, count),
                    alpha,
                    beta,
                ),
            }
        }
    }
}

/// Copies hidden states `src` into the front of `dst`: as they are in their own precision, widened exactly into
/// an f32 slot (a layout made for f32); never rounded.
fn stage_hs(dst: &mut HsBuf<CpuBackend>, src: HsSlice<'_>) -> BackendResult {
    let n = src.len();
    match (dst, src) {
        (HsBuf::F32(dst), src) => src.widen_into(slice_mut(dst.at_mut(0, n))),
        (HsBuf::Bf16(dst), HsSlice::Bf16(src)) => slice_mut(dst.at_mut(0, n)).copy_from_slice(src),
        (HsBuf::F16(dst), HsSlice::F16(src)) => slice_mut(dst.at_mut(0, n)).copy_from_slice(src),
        (dst, src) => {
            return Err(BackendError::Unsupported(format!(
                "{} hidden states into a {} input slot (it would round them)",
                src.dtype().name(),
                dst.dtype().name()
            )));
        }
    }
    Ok(())
}

impl Backend for CpuBackend {
    type Raw<T: Element> = Vec<T>;
    type Read<'a, T: 'a> = &'a [T];
    type Write<'a, T: 'a> = &'a mut [T];

    fn kind(&self) -> BackendKind {
        BackendKind::Cpu
    }

    fn asynchronous(&self) -> bool {
        false
    }

    fn alloc<T: Element>(&mut self, len: usize) -> BackendResult<Buf<Self, T>> {
        self.allocated += (len * size_of::<T>()) as u64;
        Ok(Buf::from_raw(vec![T::default(); len], len))
    }

    fn allocated_bytes(&self) -> u64 {
        self.allocated
    }

    fn upload<T: Element>(&mut self, dst: Dst<'_, Self, T>, src: &[T]) -> BackendResult {
        slice_mut(dst).copy_from_slice(src);
        Ok(())
    }

    fn download<T: Element>(&mut self, src: Src<'_, Self, T>, dst: &mut [T]) -> BackendResult {
        dst.copy_from_slice(slice(src));
        Ok(())
    }

    fn stage(
        &mut self,
        _slot: usize,
        batch: HostBatch<'_>,
        input: &mut InputSlot<Self>,
    ) -> BackendResult {
        stage_hs(&mut input.hs, batch.hs)?;
        match (&mut input.last_hidden_states, batch.last_hidden_states) {
            (Some(dst), Some(src)) => stage_hs(dst, src)?,
            (Some(_), None) => return Err(missing_last_hidden_states()),
            // A family that does not read them leaves them on the host.
            (None, _) => {}
        }
        slice_mut(input.input_ids.at_mut(0, batch.input_ids.len()))
            .copy_from_slice(batch.input_ids);
        slice_mut(input.seq_lens.at_mut(0, batch.seq_lens.len())).copy_from_slice(batch.seq_lens);
        slice_mut(input.loss_mask.at_mut(0, batch.loss_mask.len()))
            .copy_from_slice(batch.loss_mask);
        Ok(())
    }

    fn begin_step(&mut self, _slot: usize, _ring: usize) -> BackendResult {
        Ok(())
    }

    fn run_part(
        &mut self,
        _part: StepPart,
        body: &mut dyn FnMut(&mut Self) -> BackendResult,
    ) -> BackendResult {
        body(self)
    }

    fn end_step(
        &mut self,
        _slot: usize,
        ring: usize,
        scalars: Src<'_, Self, f32>,
    ) -> BackendResult {
        self.results[ring].copy_from_slice(slice(scalars));
        Ok(())
    }

    fn read_results(&mut self, ring: usize) -> BackendResult<StepResults> {
        let values = &self.results[ring];
        Ok(StepResults {
            scalars: [values[0], values[1], values[2]],
            extra: values[STEP_SCALARS..].to_vec(),
            device_ms: None,
        })
    }

    fn fill(&mut self, dst: Dst<'_, Self, f32>, value: f32) -> BackendResult {
        slice_mut(dst).fill(value);
        Ok(())
    }

    fn copy(&mut self, dst: Dst<'_, Self, f32>, src: Src<'_, Self, f32>) -> BackendResult {
        slice_mut(dst).copy_from_slice(slice(src));
        Ok(())
    }

    fn gemm(
        &mut self,
        c: Dst<'_, Self, f32>,
        a: Operand<'_, Self>,
        b: Operand<'_, Self>,
        alpha: f32,
        beta: f32,
        precision: Precision,
    ) -> BackendResult {
        gemm_shape(c.len(), &a, &b);
        let a_data = Self::rounded(slice(a.data), &mut self.round_a, precision);
        let b_data = Self::rounded(slice(b.data), &mut self.round_b, precision);
        let mat = |data, op: &Operand<'_, Self>| {
            let m = Mat::new(data, op.rows, op.cols);
            if op.transposed { m.t() } else { m }
        };
        gemm(slice_mut(c), mat(a_data, &a), mat(b_data, &b), alpha, beta);
        Ok(())
    }

    fn gemm_hs(
        &mut self,
        c: Dst<'_, Self, f32>,
        a: HsOperand<'_, Self>,
        b: HsOperand<'_, Self>,
        alpha: f32,
        beta: f32,
        precision: Precision,
    ) -> BackendResult {
        let (m, n, k) = gemm_shape(c.len(), &a, &b);
        match (a.as_f32(), b.as_f32()) {
            (Some(a), Some(b)) => self.gemm(c, a, b, alpha, beta, precision),
            (None, Some(b)) => {
                self.gemm_tiled(
                    slice_mut(c),
                    (a, true),
                    b,
                    (m, k, n),
                    alpha,
                    beta,
                    precision,
                );
                Ok(())
            }
            (Some(a), None) => {
                self.gemm_tiled(
                    slice_mut(c),
                    (b, false),
                    a,
                    (m, k, n),
                    alpha,
                    beta,
                    precision,
                );
                Ok(())
            }
            (None, None) => panic!("gemm_hs: both operands hold narrow hidden states"),
        }
    }

    /// The host body (`HOST_BODIES`): a row's angles once, every head rotated with them.
    fn rope(
        &mut self,
        x: Dst<'_, Self, f32>,
        positions: Src<'_, Self, u32>,
        theta: f32,
        heads: usize,
        head_dim: usize,
        inverse: bool,
    ) -> BackendResult {
        rope::rope(
            slice_mut(x),
            slice(positions),
            theta,
            heads,
            head_dim,
            inverse,
        );
        Ok(())
    }

    /// The host body (`HOST_BODIES`): the lanes of `cpu/attention/lanes.rs`.
    fn attention_forward(
        &mut self,
        inputs: AttentionInputs<'_, Self>,
        shape: AttentionShape,
        out: Dst<'_, Self, f32>,
        lse: Dst<'_, Self, f32>,
    ) -> BackendResult {
        attention::attention_forward(
            HostKernels::Lanes,
            slices(inputs),
            shape,
            slice_mut(out),
            slice_mut(lse),
        );
        Ok(())
    }

    /// The host body (`HOST_BODIES`), which also checks every key range against the query ranges.
    fn attention_backward(
        &mut self,
        inputs: AttentionInputs<'_, Self>,
        shape: AttentionShape,
        saved: AttentionSaved<'_, Self>,
        delta: Dst<'_, Self, f32>,
        grads: AttentionGrads<'_, Self>,
    ) -> BackendResult {
        attention::attention_backward(
            HostKernels::Lanes,
            slices(inputs),
            shape,
            slice(saved.out),
            slice(saved.dout),
            slice(saved.lse),
            slice(saved.key_ranges_ctx),
            slice(saved.key_ranges_blk),
            slice_mut(delta),
            AttentionGradSlices {
                dq: slice_mut(grads.dq),
                dk_ctx: slice_mut(grads.dk_ctx),
                dv_ctx: slice_mut(grads.dv_ctx),
                dk_blk: slice_mut(grads.dk_blk),
                dv_blk: slice_mut(grads.dv_blk),
            },
        );
        Ok(())
    }

    fn average_gradients(&mut self, grads: Dst<'_, Self, f32>) -> BackendResult {
        if let Some(group) = &self.group {
            // The stop decision was taken in the round before the step (see `pipeline::worker`).
            group.mean(slice_mut(grads), || false);
        }
        Ok(())
    }

    fn launch(&mut self, kernel: Kernel<'_, Self>) -> BackendResult {
        check_device_data(&kernel);
        kernels::run(kernel);
        Ok(())
    }

    /// The flash table's bodies through the warp model (`cpu/flash.rs`): the host model of the CUDA
    /// backend's flash attention, which no CPU step takes.
    fn launch_flash(&mut self, kernel: FlashKernel<'_, Self>) -> BackendResult {
        flash::run_flash(kernel);
        Ok(())
    }

    fn read<'a, T: Element>(view: Src<'a, Self, T>) -> &'a [T] {
        slice(view)
    }

    fn write<'a, T: Element>(view: Dst<'a, Self, T>) -> &'a mut [T] {
        slice_mut(view)
    }

    fn split_write<'a, T: 'a>(view: &'a mut [T], mid: usize) -> (&'a mut [T], &'a mut [T]) {
        view.split_at_mut(mid)
    }

    fn reinterpret_read<'a, T: Reinterpret<U> + 'a, U: 'a>(view: &'a [T]) -> &'a [U] {
        let len = reinterpreted_len::<T, U>(view.len());
        // SAFETY: `Reinterpret` promises that whole `U`s of `T`s are valid and need no stricter alignment;
        // `len` `U`s cover exactly the slice's bytes.
        unsafe { std::slice::from_raw_parts(view.as_ptr().cast::<U>(), len) }
    }

    fn reinterpret_write<'a, T: Reinterpret<U> + 'a, U: 'a>(view: &'a mut [T]) -> &'a mut [U] {
        let len = reinterpreted_len::<T, U>(view.len());
        // SAFETY: as in `reinterpret_read`; the unique borrow moves into the result.
        unsafe { std::slice::from_raw_parts_mut(view.as_mut_ptr().cast::<U>(), len) }
    }
}

/// The `U`s that `len` `T`s hold.
///
/// # Panics
/// When they are not a whole number of `U`s.
fn reinterpreted_len<T, U>(len: usize) -> usize {
    let bytes = len * size_of::<T>();
    assert!(
        size_of::<U>() > 0 && bytes.is_multiple_of(size_of::<U>()),
        "{len} elements of {} bytes are not whole elements of {}",
        size_of::<T>(),
        size_of::<U>()
    );
    bytes / size_of::<U>()
}

/// The checks of device data that only the host can make before a launch: token ids and labels inside the
/// tables they index (the GPU's kernels trust the model's batch checks; a wrong id here is a bug, and a panic
/// names it instead of a read past the table).
fn check_device_data(kernel: &Kernel<'_, CpuBackend>) {
    match kernel {
        Kernel::vocab_loss_row { labels, vocab, .. }
        | Kernel::weighted_vocab_loss_row { labels, vocab, .. }
        | Kernel::weighted_vocab_loss_row_bf16 { labels, vocab, .. } => {
            if let Some(bad) = labels.iter().find(|&&l| l >= *vocab as i32) {
                panic!("label {bad} outside a vocabulary of {vocab}");
            }
        }
        Kernel::embedding_gather { ids, vocab, .. }
        | Kernel::embedding_gather_bf16 { ids, vocab, .. } => {
            if let Some(bad) = ids.iter().find(|&&id| id as usize >= *vocab) {
                panic!("embedding_gather: token id {bad} outside a table of {vocab} rows");
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::round_mantissa;

    #[test]
    fn rounding_matches_bf16_round_to_nearest_even() {
        for &x in &[
            1.0f32,
            1.0 + 1.0 / 256.0,
            1.0078125,
            -3.3,
            1e-30,
            65504.0,
            0.1,
            1.0 + 3.0 / 256.0,
        ] {
            assert_eq!(
                round_mantissa(x, 7),
                half::bf16::from_f32(x).to_f32(),
                "{x}"
            );
        }
        assert!(round_mantissa(f32::NAN, 7).is_nan());
        assert_eq!(round_mantissa(f32::INFINITY, 10), f32::INFINITY);
        // TF32 keeps 10 bits: 1 + 2^-10 survives, 1 + 2^-12 does not.
        assert_eq!(round_mantissa(1.0 + 1.0 / 1024.0, 10), 1.0 + 1.0 / 1024.0);
        assert_eq!(round_mantissa(1.0 + 1.0 / 4096.0, 10), 1.0);
    }
}
