//! One received message: a safetensors blob checked like a hidden-state file, cut into bucketed batches.
//!
//! ```text
//!  frame bytes ──TensorBlob::parse──▶ check_tensors (the file source's checks) ──▶ rows by bucket ──▶ items
//! ```
//!
//! Rows go to the smallest bucket that holds them, in row order; a bucket's item is cut when it is full, and
//! the partly filled ones at the end in bucket order, exactly as the file source plans one file. A message is
//! thus independent of the next one, and its acknowledgement can be sent as soon as its own items are queued.

use std::ops::Range;
use std::path::PathBuf;

use draftpipe_compiler::plan::TargetStage;
use safetensors::Dtype;

use super::scan::{first_non_finite, first_overflow};
use crate::batch::{HsBatch, HsDtype};
use crate::source::safetensors::{HIDDEN_STATES, INPUT_IDS, LOSS_MASK, check_tensors};
use crate::source::{BucketShapes, SourceError};
use crate::tensor_file::{
    TensorBlob, TensorFileError, TensorProblem, TensorRead, decode_floats_into, decode_ids,
    decode_mask,
};

/// One planned item: its bucket and its rows (a range of the kept rows).
#[derive(Debug, Clone)]
pub(super) struct Item {
    pub(super) bucket: usize,
    pub(super) rows: Range<usize>,
}

/// How a message's rows become items.
#[derive(Debug, Clone)]
pub(super) struct ItemPlan {
    /// `(row, length)` of every kept row, grouped by item.
    pub(super) rows: Vec<(usize, usize)>,
    /// The items, each a range of `rows`.
    pub(super) items: Vec<Item>,
}

/// Plans the items of rows of `lengths`: each row goes to the smallest bucket that holds it, in row order; a
/// bucket's item is cut when it is full, and the partly filled ones at the end in bucket order. A row too long
/// for every bucket is the error, as `(row, length)`.
pub(super) fn plan_items(
    lengths: &[usize],
    shapes: &BucketShapes,
) -> Result<ItemPlan, (usize, usize)> {
    let mut pending: Vec<Vec<(usize, usize)>> = vec![Vec::new(); shapes.buckets.len()];
    let mut rows = Vec::new();
    let mut items = Vec::new();
    let mut cut = |bucket: usize, group: &mut Vec<(usize, usize)>, rows: &mut Vec<_>| {
        let start = rows.len();
        rows.append(group);
        items.push(Item {
            bucket,
            rows: start..rows.len(),
        });
    };
    for (row, &len) in lengths.iter().enumerate() {
        if len == 0 {
            continue;
        }
        let bucket = shapes.bucket_for_len(len).ok_or((row, len))?;
        pending[bucket].push((row, len));
        if pending[bucket].len() == shapes.buckets[bucket].1 {
            cut(bucket, &mut pending[bucket], &mut rows);
        }
    }
    for (bucket, group) in pending.iter_mut().enumerate() {
        if !group.is_empty() {
            cut(bucket, group, &mut rows);
        }
    }
    Ok(ItemPlan { rows, items })
}

/// A checked message and the items it makes.
#[derive(Debug)]
pub(super) struct Message {
    blob: TensorBlob,
    seq: usize,
    has_mask: bool,
    /// `(row, length)` of every kept row, grouped by item.
    rows: Vec<(usize, usize)>,
    items: Vec<Item>,
    next: usize,
    ids: Vec<i64>,
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
        // here, it refuses this message only, before any of its items is queued.
        let din = shapes.din;
        for (row, &len) in checked.lengths.iter().enumerate() {
            let first = row * checked.seq * din;
            let found = blob
                .element_bytes(HIDDEN_STATES, first..first + len * din)
                .map(|(dtype, bytes)| {
                    first_non_finite(dtype, bytes)
                        .map(|(at, value)| TensorProblem::NonFinite {
                            value,
                            at: first + at,
                        })
                        .or_else(|| {
                            first_overflow(dtype, shapes.hs_dtype, bytes).map(|(at, value)| {
                                TensorProblem::Overflows {
                                    value,
                                    at: first + at,
                                    held: shapes.hs_dtype.name(),
                                }
                            })
                        })
                });
            let problem = match found {
                Ok(None) => continue,
                Ok(Some(problem)) => problem,
                Err(e) => e.problem,
            };
            let origin = blob.origin().to_path_buf();
            let error = TensorFileError::tensor(&origin, HIDDEN_STATES, problem);
            return Err((Box::new(error.into()), blob.into_bytes()));
        }
        let ItemPlan { rows, items } = match plan_items(&checked.lengths, shapes) {
            Ok(planned) => planned,
            Err((row, len)) => {
                let largest = shapes.buckets.last().map_or(0, |b| b.0);
                let problem = TensorProblem::WrongShape {
                    found: vec![row, len],
                    expected: format!(
                        "sequence {row} (length {len}) to fit the largest bucket, {largest} tokens"
                    ),
                };
                let error = TensorFileError::tensor(
                    &PathBuf::from(crate::tensor_file::TensorRead::origin(&blob)),
                    INPUT_IDS,
                    problem,
                );
                return Err((Box::new(error.into()), blob.into_bytes()));
            }
        };
        Ok(Self {
            blob,
            seq: checked.seq,
            has_mask: checked.has_mask,
            rows,
            items,
            next: 0,
            ids: Vec::new(),
        })
    }

    /// True when every item has been handed out.
    pub(super) fn exhausted(&self) -> bool {
        self.next >= self.items.len()
    }

    /// The bucket of the next item.
    pub(super) fn next_bucket(&self) -> Option<usize> {
        self.items.get(self.next).map(|item| item.bucket)
    }

    /// Items this message makes.
    pub(super) fn batches(&self) -> usize {
        self.items.len()
    }

    /// Rows this message queues.
    pub(super) fn sequences(&self) -> usize {
        self.rows.len()
    }

    /// Fills `out` (shaped for the next item's bucket) with the next item, padding zeroed, and advances.
    pub(super) fn fill_next(
        &mut self,
        out: &mut HsBatch,
        shapes: &BucketShapes,
    ) -> Result<(), SourceError> {
        let Some(item) = self.items.get(self.next).cloned() else {
            return Err(SourceError::Buffer("the message has no batch left".into()));
        };
        if !shapes.matches(out, item.bucket) {
            return Err(SourceError::Buffer(format!(
                "a batch of bucket {} {:?} needs its shape, got a {}×{} buffer",
                item.bucket, shapes.buckets[item.bucket], out.sequences, out.padded_len
            )));
        }
        let (padded, din) = (out.padded_len, out.din);
        for slot in 0..out.sequences {
            let len = match self.rows.get(item.rows.start + slot) {
                Some(&(row, len)) if item.rows.start + slot < item.rows.end => {
                    self.copy_row(row, len, slot, out)?;
                    len
                }
                _ => 0,
            };
            out.seq_lens[slot] = len as u32;
            let (start, end) = (slot * padded + len, (slot + 1) * padded);
            out.input_ids[start..end].fill(0);
            out.loss_mask[start..end].fill(0);
            out.hs.zero(start * din..end * din);
        }
        self.next += 1;
        Ok(())
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
        let (dtype, bytes) = self
            .blob
            .element_bytes(HIDDEN_STATES, first * din..(first + len) * din)?;
        if !decode_floats_into(dtype, bytes, &mut out.hs, base * din) {
            return Err(corrupt(HIDDEN_STATES));
        }
        // The message was scanned for NaN when it was parsed; only a narrowing conversion (f32 into bf16, bf16
        // into f16) can make a new infinity, by rounding a huge finite value.
        let widening = matches!(
            (dtype, out.hs.dtype()),
            (_, HsDtype::F32) | (Dtype::BF16, HsDtype::Bf16) | (Dtype::F16, HsDtype::F16)
        );
        let hs = out.hs.as_slice().slice(base * din..(base + len) * din);
        if let Some((at, value)) = (!widening).then(|| hs.first_non_finite()).flatten() {
            let problem = TensorProblem::NonFinite {
                value,
                at: first * din + at,
            };
            return Err(TensorFileError::tensor(&origin, HIDDEN_STATES, problem).into());
        }
        Ok(())
    }

    /// The message's buffer, for the next message.
    pub(super) fn into_bytes(self) -> Vec<u8> {
        self.blob.into_bytes()
    }
}
