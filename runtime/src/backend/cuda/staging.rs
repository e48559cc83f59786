//! Pinned host staging of one input slot: [`CudaBackend::stage`](crate::backend::Backend::stage) writes a batch
//! into page-locked buffers and enqueues their copies into the slot on the copy stream, so the transfer
//! overlaps the step that is running.
//!
//! ```text
//!  HsBatch (bf16 | f16 | f32) ──one pass──▶ pinned staging, in the slot's dtype ──async H2D (copy stream)──▶ slot
//! ```
//!
//! Hidden states cross in the slot's precision: a bf16 (f16) slot receives the batch's 16-bit values as they
//! are, half the bytes of f32; an f32 slot (CUDA at f32 or TF32 precision, whose products read f32) receives a
//! narrower batch widened exactly in the pass that fills the staging buffer anyway.

use std::sync::Arc;

use cudarc::driver::result as driver;
use cudarc::driver::sys::CUstream;
use cudarc::driver::{CudaContext, DeviceRepr, PinnedHostSlice};
use half::{bf16, f16};

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
                    HsDtype::F32 => PinnedHs::F32(ctx.alloc_pinned(len)?),
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
