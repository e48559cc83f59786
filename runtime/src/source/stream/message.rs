//! One received message: a safetensors blob checked like a hidden-state file, its rows placed into the
//! producer slot's open items.
//!
//! ```text
//!  frame bytes ──TensorBlob::parse──▶ check_tensors (the file source's checks) ──▶ rows by bucket
//!        ──place_next──▶ the slot's open item of each row's bucket (open_items.rs) ──full──▶ queue
//! ```
//!
//! Rows go to the smallest bucket that holds them, in row order, into the first free sequence slot of that
//! bucket's open item; an item is handed out when it is full, so one message's rows may share an item with the
//! previous message's and the next one's. The acknowledgement is sent once every row is queued or held open.

use std::path::PathBuf;

use draftpipe_compiler::plan::TargetStage;
use safetensors::Dtype;

use super::open_items::OpenItems;
use super::scan::{first_non_finite, first_overflow};
use crate::batch::{HsBatch, HsDtype};
use crate::fp8::{HIDDEN_STATES_SCALE, store_fp8_rows};
use crate::source::mask_check::MaskReport;
use crate::source::safetensors::{
    HIDDEN_STATES, INPUT_IDS, LAST_HIDDEN_STATES, LOSS_MASK, check_tensors, too_long,
};
use crate::source::{BucketShapes, SourceError};
use crate::tensor_file::{
    TensorBlob, TensorFileError, TensorProblem, TensorRead, decode_floats_into, decode_ids,
    decode_mask,
};

/// A kept (non-empty) row of a message: its index, its length and the smallest bucket that holds it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Row {
    pub(super) row: usize,
    pub(super) len: usize,
    pub(super) bucket: usize,
}

/// A row too long for every bucket: `(row, length)`.
#[derive(Debug, Clone, Copy)]
pub(super) struct TooLong(pub(super) usize, pub(super) usize);

/// The kept rows of `lengths` in row order, each with the smallest bucket that holds it.
pub(super) fn bucket_rows(lengths: &[usize], shapes: &BucketShapes) -> Result<Vec<Row>, TooLong> {
    let mut rows = Vec::with_capacity(lengths.len());
    for (row, &len) in lengths.iter().enumerate() {
        if len == 0 {
            continue;
        }
        let bucket = shapes.bucket_for_len(len).ok_or(TooLong(row, len))?;
        rows.push(Row { row, len, bucket });
    }
    Ok(rows)
}

/// A checked message and the rows it places into the slot's open items.
#[derive(Debug)]
pub(super) struct Message {
    blob: TensorBlob,
    seq: usize,
    has_mask: bool,
    /// The kept rows, in row order.
    rows: Vec<Row>,
    /// Rows placed so far.
    next: usize,
    ids: Vec<i64>,
    /// What the message's loss masks hold.
    pub(super) masks: MaskReport,
}

/// The first non-finite value of the kept tokens of tensor `name` (`width` per token, rows of `seq` tokens of
/// which `lengths` are kept), or one the conversion into `held` would make infinite.
fn scan_rows(
    blob: &TensorBlob,
    name: &str,
    width: usize,
    lengths: &[usize],
    seq: usize,
    held: HsDtype,
) -> Result<(), TensorProblem> {
    for (row, &len) in lengths.iter().enumerate() {
        let first = row * seq * width;
        let (dtype, bytes) = blob
            .element_bytes(name, first..first + len * width)
            .map_err(|e| e.problem)?;
        let found = first_non_finite(dtype, bytes)
            .map(|(at, value)| TensorProblem::NonFinite {
                value,
                at: first + at,
            })
            .or_else(|| {
                first_overflow(dtype, held, bytes).map(|(at, value)| TensorProblem::Overflows {
                    value,
                    at: first + at,
                    held: held.name(),
                })
            });
        if let Some(problem) = found {
            return Err(problem);
        }
    }
    Ok(())
}

/// The first non-finite scale of the kept tokens (rows of `seq` tokens of which `lengths` are kept) of an
/// `F8_E4M3` message's `hidden_states_scale`, which `check_tensors` found present and `[N, S]` F32: the tokens
/// the direct path copies scales for, so both paths refuse the same messages. Nothing for a float message.
fn scan_scales(blob: &TensorBlob, lengths: &[usize], seq: usize) -> Result<(), TensorProblem> {
    if blob.tensor_info(HIDDEN_STATES).map(|hs| hs.dtype) != Some(Dtype::F8_E4M3) {
        return Ok(());
    }
    for (row, &len) in lengths.iter().enumerate() {
        let first = row * seq;
        let (dtype, bytes) = blob
            .element_bytes(HIDDEN_STATES_SCALE, first..first + len)
            .map_err(|e| e.problem)?;
        if let Some((at, value)) = first_non_finite(dtype, bytes) {
            return Err(TensorProblem::NonFinite {
                value,
                at: first + at,
            });
        }
    }
    Ok(())
}

impl Message {
    /// Parses and checks the first `len` bytes of `bytes`. On an error the buffer comes back for reuse.
    pub(super) fn parse(
        origin: PathBuf,
        bytes: Vec<u8>,
        len: usize,
        target: &TargetStage,
        shapes: &BucketShapes,
    ) -> Result<Self, (Box<SourceError>, Vec<u8>)> {
        let mut blob = TensorBlob::parse(origin, bytes, len)
            .map_err(|(e, b)| (Box::new(SourceError::File(*e)), b))?;
        let checked = match check_tensors(&mut blob, target, shapes) {
            Ok(checked) => checked,
            Err(e) => return Err((Box::new(e), blob.into_bytes())),
        };
        // As the file source: a NaN in the data would surface as a non-finite loss and be blamed on the run. So
        // would a finite value that the conversion into `hs_dtype` (f32 into bf16) rounds to an infinity: found
        // here, it refuses this message only, before any of its items is queued. `last_hidden_states`, when the
        // drafter reads them, are held in the same precision and checked the same way, after the hidden states.
        let floats = std::iter::once((HIDDEN_STATES, shapes.din)).chain(
            shapes
                .last_hidden
                .map(|hidden| (LAST_HIDDEN_STATES, hidden)),
        );
        for (name, width) in floats {
            if let Err(problem) = scan_rows(
                &blob,
                name,
                width,
                &checked.lengths,
                checked.seq,
                shapes.hs_dtype,
            ) {
                let origin = blob.origin().to_path_buf();
                let error = TensorFileError::tensor(&origin, name, problem);
                return Err((Box::new(error.into()), blob.into_bytes()));
            }
        }
        // A non-finite FP8 scale is refused before any row is placed, as a NaN is.
        if let Err(problem) = scan_scales(&blob, &checked.lengths, checked.seq) {
            let origin = blob.origin().to_path_buf();
            let error = TensorFileError::tensor(&origin, HIDDEN_STATES_SCALE, problem);
            return Err((Box::new(error.into()), blob.into_bytes()));
        }
        let rows = match bucket_rows(&checked.lengths, shapes) {
            Ok(rows) => rows,
            Err(TooLong(row, len)) => {
                let origin = blob.origin().to_path_buf();
                let error = too_long(&origin, row, checked.lengths.len(), len, shapes);
                return Err((Box::new(error), blob.into_bytes()));
            }
        };
        Ok(Self {
            blob,
            seq: checked.seq,
            has_mask: checked.has_mask,
            rows,
            next: 0,
            ids: Vec::new(),
            masks: checked.masks,
        })
    }

    /// Rows this message queues.
    pub(super) fn sequences(&self) -> usize {
        self.rows.len()
    }

    /// Copies the rows not yet placed into `open`, each into its bucket's open item (its padding zeroed), until
    /// an item is full (`Some(bucket)`: hand it out, then call again) or every row is placed (`None`).
    pub(super) fn place_next(
        &mut self,
        open: &mut OpenItems,
        shapes: &BucketShapes,
    ) -> Result<Option<usize>, SourceError> {
        while let Some(&Row { row, len, bucket }) = self.rows.get(self.next) {
            let (out, slot) = open.next_slot(bucket, shapes);
            self.copy_row(row, len, slot, out)?;
            let (padded, din) = (out.padded_len, out.din);
            out.seq_lens[slot] = len as u32;
            let (start, end) = (slot * padded + len, (slot + 1) * padded);
            out.input_ids[start..end].fill(0);
            out.loss_mask[start..end].fill(0);
            out.hs.zero(start * din..end * din);
            if let (Some(last), Some(hidden)) =
                (out.last_hidden_states.as_mut(), shapes.last_hidden)
            {
                last.zero(start * hidden..end * hidden);
            }
            self.next += 1;
            if open.filled(bucket, 1, shapes) {
                return Ok(Some(bucket));
            }
        }
        Ok(None)
    }

    /// Copies the first `len` tokens of row `row` into slot `slot` of `out`.
    fn copy_row(
        &mut self,
        row: usize,
        len: usize,
        slot: usize,
        out: &mut HsBatch,
    ) -> Result<(), SourceError> {
        let (din, base) = (out.din, slot * out.padded_len);
        let first = row * self.seq;
        let origin = crate::tensor_file::TensorRead::origin(&self.blob).to_path_buf();
        let corrupt = |tensor: &str| -> SourceError {
            TensorFileError::tensor(
                &origin,
                tensor,
                TensorProblem::BadHeader("data changed after it was checked".into()),
            )
            .into()
        };
        self.ids.resize(len, 0);
        let (dtype, bytes) = self.blob.element_bytes(INPUT_IDS, first..first + len)?;
        if !decode_ids(dtype, bytes, &mut self.ids) {
            return Err(corrupt(INPUT_IDS));
        }
        for (dst, &id) in out.input_ids[base..base + len].iter_mut().zip(&self.ids) {
            *dst = u32::try_from(id).map_err(|_| corrupt(INPUT_IDS))?;
        }
        let mask = &mut out.loss_mask[base..base + len];
        if self.has_mask {
            let (dtype, bytes) = self.blob.element_bytes(LOSS_MASK, first..first + len)?;
            if !decode_mask(dtype, bytes, mask) {
                return Err(corrupt(LOSS_MASK));
            }
        } else {
            mask.fill(1);
        }
        let hidden = out.last_hidden();
        let last = out.last_hidden_states.as_mut().zip(hidden);
        let floats = std::iter::once((HIDDEN_STATES, din, &mut out.hs))
            .chain(last.map(|(data, hidden)| (LAST_HIDDEN_STATES, hidden, data)));
        for (name, width, data) in floats {
            let (dtype, bytes) = self
                .blob
                .element_bytes(name, first * width..(first + len) * width)?;
            if dtype == Dtype::F8_E4M3 {
                let (_, scales) = self
                    .blob
                    .element_bytes(HIDDEN_STATES_SCALE, first..first + len)?;
                store_fp8_rows(bytes, scales, (width, first), data, base * width, &origin)?;
            } else if !decode_floats_into(dtype, bytes, data, base * width) {
                return Err(corrupt(name));
            }
            // The message was scanned for NaN when it was parsed; only a narrowing conversion (f32 into bf16, bf16
            // into f16) can make a new infinity, by rounding a huge finite value.
            let widening = matches!(
                (dtype, data.dtype()),
                (_, HsDtype::F32) | (Dtype::BF16, HsDtype::Bf16) | (Dtype::F16, HsDtype::F16)
            );
            let rows = data.as_slice().slice(base * width..(base + len) * width);
            if let Some((at, value)) = (!widening).then(|| rows.first_non_finite()).flatten() {
                let problem = TensorProblem::NonFinite {
                    value,
                    at: first * width + at,
                };
                return Err(TensorFileError::tensor(&origin, name, problem).into());
            }
        }
        Ok(())
    }

    /// The message's buffer, for the next message.
    pub(super) fn into_bytes(self) -> Vec<u8> {
        self.blob.into_bytes()
    }
}
