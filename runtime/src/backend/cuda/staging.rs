//! Pinned host staging of one input slot: [`CudaBackend::stage`](crate::backend::Backend::stage) writes a batch
//! into page-locked buffers and enqueues their copies into the slot on the copy stream, so the transfer
//! overlaps the step that is running; [`Backend::stage_upload`](crate::backend::Backend::stage_upload) does the
//! same for what a family builds on the host beside the batch (`dflash`'s block plan), through the slot's
//! [`PlanStaging`]. Every buffer is allocated once, with the backend, for the layout's largest bucket.
//!
//! ```text
//!  HsBatch (bf16 | f16 | f32 | fp8) ──one pass──▶ pinned staging, in the slot's dtype ──async H2D (copy stream)──▶ slot
//!  block plan (11 arrays)     ──copy─────▶ the slot's pinned plan arena, packed ─async H2D (copy stream)──▶ plan slot
//! ```
//!
//! Hidden states cross in the slot's precision: a bf16 (f16) slot receives the batch's 16-bit values as they
//! are, half the bytes of f32; an f32 slot (CUDA at f32 or TF32 precision, whose products read f32) receives a
//! narrower batch widened exactly in the pass that fills the staging buffer anyway. An FP8 batch always goes to
//! an f32 slot and is dequantised (`code · scale`) on the host in that same pass: no kernel reads FP8.

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::result as driver;
use cudarc::driver::sys::CUstream;
use cudarc::driver::{CudaContext, DeviceRepr, PinnedHostSlice};
use half::{bf16, f16};

use draftpipe_compiler::plan::WorkspaceLayout;

use super::{CudaError, DevicePtr};
use crate::backend::{BackendError, BackendResult, Element, HostBatch};
use crate::batch::{HsDtype, HsSlice};

/// Staged hidden states, in the slot's precision (write-combined pinned memory: the host only writes it).
enum PinnedHs {
    F32(PinnedHostSlice<f32>),
    Bf16(PinnedHostSlice<bf16>),
    F16(PinnedHostSlice<f16>),
}

/// A slot's hidden states on the device, in their precision.
pub(crate) enum SlotHs {
    /// 32-bit floats.
    F32(DevicePtr<f32>),
    /// bfloat16.
    Bf16(DevicePtr<bf16>),
    /// IEEE half.
    F16(DevicePtr<f16>),
}

/// Where an input slot's buffers start on the device (each at least as long as the batch staged into it).
pub(crate) struct SlotPointers {
    /// Hidden states.
    pub hs: SlotHs,
    /// The target's final-norm output, when the slot has it and the batch carries it.
    pub last_hidden_states: Option<SlotHs>,
    /// Token ids.
    pub input_ids: DevicePtr<u32>,
    /// Sequence lengths.
    pub seq_lens: DevicePtr<u32>,
    /// Label mask.
    pub loss_mask: DevicePtr<u8>,
}

/// Pinned host staging for one input slot.
pub(crate) struct PinnedInput {
    hs: PinnedHs,
    /// Staging of `last_hidden_states`, in the precision of `hs`, when the slot has them.
    last_hidden_states: Option<PinnedHs>,
    input_ids: PinnedHostSlice<u32>,
    seq_lens: PinnedHostSlice<u32>,
    loss_mask: PinnedHostSlice<u8>,
}

impl PinnedInput {
    /// Staging for a slot of `tokens` tokens of `din` hidden states held in `hs`, and `sequences` sequences;
    /// with `last_hidden` (the width of `last_hidden_states`) when the slot holds those too.
    pub(crate) fn new(
        ctx: &Arc<CudaContext>,
        hs: HsDtype,
        (tokens, din, sequences): (usize, usize, usize),
        last_hidden: Option<usize>,
    ) -> Result<Self, CudaError> {
        // SAFETY: the pinned buffers are plain numbers, written by the host before each upload.
        let pinned_hs = |len: usize| -> Result<PinnedHs, CudaError> {
            unsafe {
                Ok(match hs {
                    // FP8 batches are dequantised into f32 slots (`WorkspaceLayout::with_hs_dtype`).
                    HsDtype::F32 | HsDtype::Fp8E4m3 => PinnedHs::F32(ctx.alloc_pinned(len)?),
                    HsDtype::Bf16 => PinnedHs::Bf16(ctx.alloc_pinned(len)?),
                    HsDtype::F16 => PinnedHs::F16(ctx.alloc_pinned(len)?),
                })
            }
        };
        let last_hidden_states = last_hidden
            .map(|hidden| pinned_hs(tokens * hidden))
            .transpose()?;
        // SAFETY: as above.
        unsafe {
            Ok(Self {
                hs: pinned_hs(tokens * din)?,
                last_hidden_states,
                input_ids: ctx.alloc_pinned(tokens)?,
                seq_lens: ctx.alloc_pinned(sequences)?,
                loss_mask: ctx.alloc_pinned(tokens)?,
            })
        }
    }

    /// Writes `batch` into the staging buffers and enqueues their copies into `slot` on `stream`.
    ///
    /// Fails with [`BackendError::Unsupported`] when the batch is wider than a 16-bit slot or of the other
    /// 16-bit type (the copy would round it), and with [`CudaError::LengthMismatch`] when a slot buffer is
    /// shorter than the batch.
    ///
    /// # Safety
    /// The slot's previous copies have been consumed (the staging buffers are overwritten now), the slot stays
    /// allocated until the copies ran, and no step reads it before they did (the caller orders that with
    /// events).
    pub(crate) unsafe fn enqueue(
        &mut self,
        batch: HostBatch<'_>,
        slot: SlotPointers,
        stream: CUstream,
    ) -> BackendResult {
        // SAFETY (each call): the caller's contract.
        unsafe {
            stage_hs("hs", &mut self.hs, slot.hs, batch.hs, stream)?;
            match (
                &mut self.last_hidden_states,
                slot.last_hidden_states,
                batch.last_hidden_states,
            ) {
                (Some(staging), Some(dst), Some(src)) => {
                    stage_hs("last_hidden_states", staging, dst, src, stream)?
                }
                (_, None, _) => {}
                _ => return Err(crate::backend::missing_last_hidden_states()),
            }
            copy_async(
                "input_ids",
                &mut self.input_ids,
                batch.input_ids,
                slot.input_ids,
                stream,
            )?;
            copy_async(
                "seq_lens",
                &mut self.seq_lens,
                batch.seq_lens,
                slot.seq_lens,
                stream,
            )?;
            copy_async(
                "loss_mask",
                &mut self.loss_mask,
                batch.loss_mask,
                slot.loss_mask,
                stream,
            )?;
        }
        Ok(())
    }
}

/// Writes hidden states `src` into `staging` (as they are, or widened exactly into an f32 slot) and enqueues
/// their copy into `dst`. Fails with [`BackendError::Unsupported`] when the copy would round them.
///
/// # Safety
/// As [`PinnedInput::enqueue`], for `dst`.
unsafe fn stage_hs(
    what: &'static str,
    staging: &mut PinnedHs,
    dst: SlotHs,
    src: HsSlice<'_>,
    stream: CUstream,
) -> BackendResult {
    // SAFETY (each call): the caller's contract.
    unsafe {
        match (staging, dst, src) {
            (PinnedHs::Bf16(staging), SlotHs::Bf16(dst), HsSlice::Bf16(src)) => {
                copy_async(what, staging, src, dst, stream)?
            }
            (PinnedHs::F16(staging), SlotHs::F16(dst), HsSlice::F16(src)) => {
                copy_async(what, staging, src, dst, stream)?
            }
            (PinnedHs::Bf16(staging), SlotHs::Bf16(dst), HsSlice::F16(src)) => {
                // The layout holds f16 hidden states in bf16 slots (`WorkspaceLayout::with_hs_dtype`): their
                // products are bf16 ones, which round them to bf16 anyway.
                let n = src.len();
                check_len(what, dst.len(), n)?;
                let staged = &mut staging.as_mut_slice().map_err(CudaError::from)?[..n];
                f16_to_bf16_into(src, staged);
                enqueue_htod(
                    &staging.as_slice().map_err(CudaError::from)?[..n],
                    dst,
                    stream,
                )?;
            }
            (PinnedHs::F32(staging), SlotHs::F32(dst), src) => {
                let n = src.len();
                check_len(what, dst.len(), n)?;
                src.widen_into(&mut staging.as_mut_slice().map_err(CudaError::from)?[..n]);
                enqueue_htod(
                    &staging.as_slice().map_err(CudaError::from)?[..n],
                    dst,
                    stream,
                )?;
            }
            (staging, _, src) => {
                let slot = match staging {
                    PinnedHs::F32(_) => HsDtype::F32,
                    PinnedHs::Bf16(_) => HsDtype::Bf16,
                    PinnedHs::F16(_) => HsDtype::F16,
                };
                return Err(BackendError::Unsupported(format!(
                    "{} {what} into a {} input slot (it would round them)",
                    src.dtype().name(),
                    slot.name()
                )));
            }
        }
    }
    Ok(())
}

/// `src` rounded to bfloat16 (to nearest, ties to even, as the tensor cores' bf16 conversion) into `out`.
fn f16_to_bf16_into(src: &[f16], out: &mut [bf16]) {
    for (out, &x) in out.iter_mut().zip(src) {
        *out = bf16::from_f32(x.to_f32());
    }
}

fn check_len(what: &'static str, slot: usize, batch: usize) -> Result<(), CudaError> {
    if slot >= batch {
        Ok(())
    } else {
        Err(CudaError::LengthMismatch {
            what,
            got: batch,
            expected: slot,
        })
    }
}

/// Copies `src` into the front of `staging` and enqueues its copy into `dst` on `stream`.
///
/// # Safety
/// As [`PinnedInput::enqueue`], for `dst`.
unsafe fn copy_async<T: Element>(
    what: &'static str,
    staging: &mut PinnedHostSlice<T>,
    src: &[T],
    dst: DevicePtr<T>,
    stream: CUstream,
) -> Result<(), CudaError> {
    check_len(what, dst.len(), src.len())?;
    staging.as_mut_slice()?[..src.len()].copy_from_slice(src);
    // SAFETY: the caller's contract; `dst` holds `src.len()` elements (checked above).
    unsafe { enqueue_htod(&staging.as_slice()?[..src.len()], dst, stream) }
}

/// Enqueues the copy of the pinned `src` into `dst`.
///
/// # Safety
/// `src` is pinned memory left untouched until the copy ran; `dst` holds `src.len()` elements.
unsafe fn enqueue_htod<T: DeviceRepr>(
    src: &[T],
    dst: DevicePtr<T>,
    stream: CUstream,
) -> Result<(), CudaError> {
    // SAFETY: the caller's contract.
    unsafe { driver::memcpy_htod_async(dst.addr(), src, stream) }?;
    Ok(())
}

/// The layout's buffers of input slot 0 that [`PinnedInput`] does not stage (what a family builds on the host
/// per batch: `dflash`'s block plan), as bytes of a [`PlanStaging`] arena: each rounded up to
/// [`PLAN_ALIGN`], as the arena packs them, with [`PLAN_ALIGN`] more so that a buffer may be staged in two
/// parts (`dflash`'s positions: the context rows, then the block rows).
pub(crate) fn plan_staging_bytes(layout: &WorkspaceLayout) -> usize {
    const BATCH: [&str; 5] = ["hs", "last_hs", "input_ids", "seq_lens", "loss_mask"];
    layout
        .buffers
        .iter()
        .filter_map(|b| b.name.strip_prefix("input0.").map(|field| (field, b)))
        .filter(|(field, _)| !BATCH.contains(field))
        .map(|(_, b)| (b.elements * b.dtype.bytes()).next_multiple_of(PLAN_ALIGN) + PLAN_ALIGN)
        .sum()
}

/// Where each array starts in a plan arena (the widest element the plans hold is 8 bytes; 16 keeps every
/// copy's source aligned as the DMA engines like it).
pub(crate) const PLAN_ALIGN: usize = 16;

/// The part of a plan arena already written for the batch being staged.
#[derive(Debug)]
pub(crate) struct PlanCursor {
    capacity: usize,
    used: usize,
}

impl PlanCursor {
    /// An empty arena of `capacity` bytes.
    pub(crate) fn new(capacity: usize) -> Self {
        Self { capacity, used: 0 }
    }

    /// The next batch starts at the front (its slot's previous copies have run).
    pub(crate) fn reset(&mut self) {
        self.used = 0;
    }

    /// The byte range of the next array of `bytes`, aligned to [`PLAN_ALIGN`]; fails with
    /// [`CudaError::LengthMismatch`] (`got` the bytes the batch would need) when the arena is full.
    pub(crate) fn claim(&mut self, bytes: usize) -> Result<Range<usize>, CudaError> {
        let start = self.used.next_multiple_of(PLAN_ALIGN);
        let end = start + bytes;
        if end > self.capacity {
            return Err(CudaError::LengthMismatch {
                what: "plan staging",
                got: end,
                expected: self.capacity,
            });
        }
        self.used = end;
        Ok(start..end)
    }
}

/// One input slot's pinned plan arena: every array a family stages beside the batch is packed into it and
/// copied from there into its device buffer on the copy stream. Allocated once; never waits.
pub(crate) struct PlanStaging {
    arena: Option<PinnedHostSlice<u8>>,
    cursor: PlanCursor,
}

impl PlanStaging {
    /// An arena of `bytes` (none for 0: a family without a plan).
    pub(crate) fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self, CudaError> {
        // SAFETY: plain bytes, written by the host before each copy.
        let arena = (bytes > 0)
            .then(|| unsafe { ctx.alloc_pinned::<u8>(bytes) })
            .transpose()?;
        Ok(Self {
            arena,
            cursor: PlanCursor::new(bytes),
        })
    }

    /// The next batch's arrays start at the front.
    pub(crate) fn reset(&mut self) {
        self.cursor.reset();
    }

    /// Copies `src` into the arena after the arrays staged since [`Self::reset`] and enqueues its copy into
    /// `dst` on `stream`.
    ///
    /// # Safety
    /// As [`PinnedInput::enqueue`]: the slot's previous copies have run (the caller waited for the slot, then
    /// reset), `dst` stays allocated until the copy ran, and no step reads it before (events).
    pub(crate) unsafe fn enqueue<T: Element>(
        &mut self,
        what: &'static str,
        src: &[T],
        dst: DevicePtr<T>,
        stream: CUstream,
    ) -> Result<(), CudaError> {
        check_len(what, dst.len(), src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        let range = self.cursor.claim(size_of_val(src))?;
        let arena = self.arena.as_mut().ok_or(CudaError::LengthMismatch {
            what: "plan staging",
            got: range.end,
            expected: 0,
        })?;
        let base = arena.as_mut_ptr()?;
        // SAFETY: `range` lies inside the arena (the cursor's capacity is its length) and starts at a multiple
        // of `PLAN_ALIGN` ≥ `align_of::<T>()` from a page-aligned allocation, so the elements are aligned; the
        // arena is plain bytes, so any `T: Element` (plain numbers) may be written there; `src` is host memory
        // apart from the pinned arena.
        let staged = unsafe {
            let first = base.add(range.start).cast::<T>();
            std::ptr::copy_nonoverlapping(src.as_ptr(), first, src.len());
            std::slice::from_raw_parts(first.cast_const(), src.len())
        };
        // SAFETY: the caller's contract; `dst` holds `src.len()` elements (checked above).
        unsafe { enqueue_htod(staged, dst, stream) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use draftpipe_compiler::workspace::{Dtype, WorkspaceBuffer};

    #[test]
    fn f16_hidden_states_round_to_nearest_even_bf16() {
        // 1 + 2⁻⁸ is a tie between bf16's 1 and 1 + 2⁻⁷: to even, 1; 1 + 3·2⁻⁸ rounds up to 1 + 2⁻⁶; the
        // smallest f16 subnormal and f16's largest value are bf16-exact or round as f32 would.
        let src = [
            1.0 + 2f32.powi(-8),
            1.0 + 3.0 * 2f32.powi(-8),
            2f32.powi(-24),
            -65504.0,
        ]
        .map(f16::from_f32);
        let mut out = [bf16::ZERO; 4];
        f16_to_bf16_into(&src, &mut out);
        assert_eq!(
            out.map(bf16::to_f32),
            [1.0, 1.0 + 2f32.powi(-6), 2f32.powi(-24), -65536.0]
        );
    }

    #[test]
    fn a_plan_arena_packs_aligned_arrays_until_it_is_full() {
        let mut cursor = PlanCursor::new(64);
        assert_eq!(cursor.claim(12).ok(), Some(0..12));
        assert_eq!(cursor.claim(4).ok(), Some(16..20), "aligned to 16");
        assert_eq!(cursor.claim(0).ok(), Some(32..32));
        let full = cursor.claim(40).unwrap_err();
        assert!(
            matches!(
                full,
                CudaError::LengthMismatch {
                    what: "plan staging",
                    got: 72,
                    expected: 64
                }
            ),
            "{full:?}"
        );
        cursor.reset();
        assert_eq!(
            cursor.claim(64).ok(),
            Some(0..64),
            "the next batch reuses it"
        );
    }

    #[test]
    fn the_plan_arena_holds_slot_zeros_plan_buffers_and_not_its_batch() {
        let buffer = |name: &str, dtype, elements| WorkspaceBuffer {
            name: name.to_owned(),
            dtype,
            elements,
        };
        let layout = WorkspaceLayout {
            tokens: 8,
            sequences: 2,
            chunk_rows: 8,
            input_slots: 2,
            hs_operand_elements: 0,
            buffers: vec![
                buffer("input0.hs", Dtype::Bf16, 64),
                buffer("input0.input_ids", Dtype::U32, 8),
                buffer("input0.seq_lens", Dtype::U32, 2),
                buffer("input0.loss_mask", Dtype::U8, 8),
                buffer("input0.block_ids", Dtype::U32, 5),
                buffer("input0.weights", Dtype::F32, 5),
                buffer("input0.inv_weight_sum", Dtype::F32, 1),
                buffer("input1.block_ids", Dtype::U32, 5),
                buffer("logits", Dtype::F32, 100),
            ],
        };
        // 20 → 32, 20 → 32, 4 → 16, each with 16 to spare: room for every buffer in two parts, in any order.
        assert_eq!(plan_staging_bytes(&layout), 128);
        let mut cursor = PlanCursor::new(plan_staging_bytes(&layout));
        for bytes in [4, 4, 8, 12, 20] {
            cursor.claim(bytes).expect("fits");
        }
    }
}
