//! Reading one message off a producer's socket: the safetensors header and the small tensors first, then,
//! when every row goes to one bucket whose open item has room for them all and `hidden_states` comes last,
//! its rows straight into that open item; any other message whole into the connection's buffer, for
//! [`super::message::Message::parse`].
//!
//! ```text
//!  frame ──header, input_ids, loss_mask, last_hidden_states──▶ check_tensors, bucket_rows
//!        ├─ one bucket, room enough, hidden_states last ──▶ each row read into its slot of the open item, a
//!        │                                   chunk at a time, every chunk scanned for NaN/inf while in cache
//!        │                                   ──full: fill_next swaps it with the pooled batch (no copy)──▶ queue
//!        └─ otherwise ──▶ the rest of the frame into the buffer ──▶ Message::parse (checks, copy per row)
//! ```
//!
//! The producer waits for each acknowledgement (the queue's backpressure), so whatever the server does with a
//! message after its last byte arrived adds to the time per message. Buffered, that was two more passes over
//! the hidden states (the NaN scan and the copy into the pooled batch); received in place, a message costs
//! the socket copy and a scan of bytes still in cache, and the full item is swapped with the pooled one.
//!
//! Both paths run the same checks in the same order and report the same errors; a message refused on the
//! direct path has placed nothing: its rows count as filled only once all of them were read and checked.

use std::ops::Range;
use std::path::Path;
use std::time::Duration;

use draftpipe_compiler::plan::TargetStage;
use safetensors::Dtype;
use safetensors::tensor::{Metadata, TensorInfo};

use super::StreamConfig;
use super::message::bucket_rows;
use super::open_items::OpenItems;
use super::scan::{first_non_finite, first_overflow};
use super::wire::{Connection, WireError};
use crate::batch::{HsBatch, HsData, HsDtype};
use crate::fp8::{HIDDEN_STATES_SCALE, ScaledRowsError};
use crate::source::mask_check::MaskReport;
use crate::source::safetensors::{
    HIDDEN_STATES, INPUT_IDS, LAST_HIDDEN_STATES, LOSS_MASK, check_tensors,
};
use crate::source::{BucketShapes, SourceError};
use crate::tensor_file::{
    TensorFileError, TensorProblem, TensorRead, decode_floats_into, decode_ids, decode_mask,
};

/// Bytes read per socket call on the direct path: a chunk is scanned right after it lands, while it is still
/// in the core's cache.
const CHUNK_BYTES: usize = 1 << 20;

/// The largest safetensors header the direct path reads; a message with more metadata is buffered.
const MAX_DIRECT_HEADER: u64 = 1 << 20;

/// Where a received message is.
#[derive(Debug, Clone)]
pub(super) enum Received {
    /// The whole frame is in the buffer, unchecked.
    Buffered,
    /// Every row is in its bucket's open item, checked and padded (not yet counted as filled there).
    Placed {
        /// The rows' bucket.
        bucket: usize,
        /// Rows placed.
        sequences: usize,
        /// What the message's loss masks hold.
        masks: MaskReport,
    },
}

/// Why a message could not be received.
#[derive(Debug)]
pub(super) enum ReceiveError {
    /// The socket failed, closed or stalled inside the frame.
    Wire(WireError),
    /// The message fails the file source's checks.
    Content(Box<SourceError>),
}

impl From<WireError> for ReceiveError {
    fn from(error: WireError) -> Self {
        Self::Wire(error)
    }
}

impl From<SourceError> for ReceiveError {
    fn from(error: SourceError) -> Self {
        Self::Content(Box::new(error))
    }
}

impl From<TensorFileError> for ReceiveError {
    fn from(error: TensorFileError) -> Self {
        Self::Content(Box::new(error.into()))
    }
}

/// A producer slot's receiving state, kept across messages so steady state allocates nothing.
#[derive(Debug, Default)]
pub(super) struct DirectReceiver {
    /// One row's token ids, decoded.
    ids: Vec<i64>,
}

/// What the header and the small tensors of a direct message said.
struct Head {
    metadata: Metadata,
    /// Body offset of the first data byte.
    data_start: usize,
    hs: TensorInfo,
    seq: usize,
    has_mask: bool,
    bucket: usize,
    /// `(row, length)` of the kept rows, in row order: the `k`-th goes to the open item's `k`-th free slot.
    rows: Vec<(usize, usize)>,
    /// What the rows' loss masks hold.
    masks: MaskReport,
}

/// The body of one frame, read in order.
struct Body<'a> {
    connection: &'a mut Connection,
    len: u64,
    timeout: Duration,
    at: u64,
    /// Raised when the run ends: the frame is abandoned.
    stop: &'a dyn Fn() -> bool,
}

impl Body<'_> {
    /// Reads the next `out.len()` bytes.
    fn read(&mut self, out: &mut [u8]) -> Result<(), WireError> {
        self.connection
            .read_frame_body(out, (self.at, self.len), self.timeout, self.stop)?;
        self.at += out.len() as u64;
        Ok(())
    }

    /// Reads up to body offset `end` into `buffer`, at its own offsets. The buffer grows as bytes arrive (at
    /// most doubling what has arrived, by [`CHUNK_BYTES`] at least), never by what the frame announces: a
    /// length prefix alone must not cost the memory it names.
    fn read_into(&mut self, buffer: &mut Vec<u8>, end: usize) -> Result<(), WireError> {
        while (self.at as usize) < end {
            let start = self.at as usize;
            let step_end = end.min(start + start.max(CHUNK_BYTES));
            if buffer.len() < step_end {
                buffer.resize(step_end, 0);
            }
            self.read(&mut buffer[start..step_end])?;
        }
        Ok(())
    }

    /// Reads and drops the next `bytes` bytes, through `scratch`.
    fn skip(&mut self, mut bytes: usize, scratch: &mut [u8]) -> Result<(), WireError> {
        while bytes > 0 {
            let n = bytes.min(scratch.len());
            self.read(&mut scratch[..n])?;
            bytes -= n;
        }
        Ok(())
    }
}

impl DirectReceiver {
    /// Reads the body of a frame of `len` bytes whose length prefix was read. `origin` names the message in
    /// errors; `buffer` is the connection's reusable buffer; `open` the slot's open items, which a direct
    /// message is read into.
    pub(super) fn receive(
        &mut self,
        connection: &mut Connection,
        len: u64,
        config: &StreamConfig,
        (origin, stop): (&Path, &dyn Fn() -> bool),
        buffer: &mut Vec<u8>,
        open: &mut OpenItems,
    ) -> Result<Received, ReceiveError> {
        let mut body = Body {
            connection,
            len,
            timeout: config.read_timeout,
            at: 0,
            stop,
        };
        let received = self.receive_body(&mut body, config, origin, buffer, open);
        if let Err(ReceiveError::Content(_)) = received {
            // The buffered path reads a bad message whole before it answers, and so does this one: closing a
            // socket with unread data resets the connection, and the producer, still sending, would see the
            // reset instead of the error.
            if buffer.len() < CHUNK_BYTES {
                buffer.resize(CHUNK_BYTES, 0);
            }
            let rest = (len - body.at) as usize;
            let _ = body.skip(rest, &mut buffer[..CHUNK_BYTES]);
        }
        received
    }

    fn receive_body(
        &mut self,
        body: &mut Body<'_>,
        config: &StreamConfig,
        origin: &Path,
        buffer: &mut Vec<u8>,
        open: &mut OpenItems,
    ) -> Result<Received, ReceiveError> {
        let shapes = &config.shapes;
        let rooms = open.rooms(shapes);
        let Some(head) = read_head(body, buffer, origin, &config.target, shapes, &rooms)? else {
            body.read_into(buffer, body.len as usize)?;
            return Ok(Received::Buffered);
        };
        let prefix_end = head.data_start + head.hs.data_offsets.0;
        // Past the small tensors, the buffer serves as the scratch for padding and conversions.
        if buffer.len() < prefix_end + CHUNK_BYTES {
            buffer.resize(prefix_end + CHUNK_BYTES, 0);
        }
        let (prefix, scratch) = buffer.split_at_mut(prefix_end);
        let prefix = Prefix {
            origin,
            metadata: &head.metadata,
            data: &prefix[head.data_start..],
        };
        let (item, first_slot) = open.next_slot(head.bucket, shapes);
        receive_rows(
            body,
            &head,
            item,
            first_slot,
            &mut scratch[..CHUNK_BYTES],
            origin,
        )?;
        fill_tokens(&head, &prefix, item, first_slot, &mut self.ids)?;
        Ok(Received::Placed {
            bucket: head.bucket,
            sequences: head.rows.len(),
            masks: head.masks,
        })
    }
}

/// Reads the header and every tensor before `hidden_states` into `buffer` and runs the file source's checks.
/// `rooms` are the free sequence slots of each bucket's open item. `None`: the message is not for the direct
/// path (it is then read whole, and parsed as before, so every
/// malformed header gets the buffered path's error).
fn read_head(
    body: &mut Body<'_>,
    buffer: &mut Vec<u8>,
    origin: &Path,
    target: &TargetStage,
    shapes: &BucketShapes,
    rooms: &[usize],
) -> Result<Option<Head>, ReceiveError> {
    let len = body.len;
    if len < 8 {
        return Ok(None);
    }
    body.read_into(buffer, 8)?;
    let Some(&header_len) = buffer.first_chunk::<8>() else {
        return Ok(None);
    };
    let header_len = u64::from_le_bytes(header_len);
    if header_len > MAX_DIRECT_HEADER || 8 + header_len > len {
        return Ok(None);
    }
    let data_start = 8 + header_len as usize;
    body.read_into(buffer, data_start)?;
    let Ok(metadata) = serde_json::from_slice::<Metadata>(&buffer[8..data_start]) else {
        return Ok(None);
    };
    let data_len = metadata.data_len();
    let Some(hs) = metadata.info(HIDDEN_STATES).cloned() else {
        return Ok(None);
    };
    if data_start as u64 + data_len as u64 != len || hs.data_offsets.1 != data_len {
        return Ok(None);
    }
    // `last_hidden_states`, when the drafter reads them, are copied from the prefix: they must precede
    // `hidden_states` (the Python producer sends them so).
    if shapes.last_hidden.is_some()
        && metadata
            .info(LAST_HIDDEN_STATES)
            .is_some_and(|last| last.data_offsets.1 > hs.data_offsets.0)
    {
        return Ok(None);
    }
    // FP8 goes direct only as it is held: its rows' codes land in place and their scales, which must precede
    // `hidden_states`, are copied from the prefix. A conversion into or out of FP8 needs whole rows at once
    // (a row's scale is its largest magnitude), which the buffered path has.
    let fp8_wire = hs.dtype == Dtype::F8_E4M3;
    if fp8_wire != (shapes.hs_dtype == HsDtype::Fp8E4m3)
        || fp8_wire
            && metadata
                .info(HIDDEN_STATES_SCALE)
                .is_none_or(|scale| scale.data_offsets.1 > hs.data_offsets.0)
    {
        return Ok(None);
    }
    body.read_into(buffer, data_start + hs.data_offsets.0)?;
    let mut prefix = Prefix {
        origin,
        metadata: &metadata,
        data: &buffer[data_start..data_start + hs.data_offsets.0],
    };
    let checked = check_tensors(&mut prefix, target, shapes)?;
    let Ok(kept) = bucket_rows(&checked.lengths, shapes) else {
        return Ok(None);
    };
    let Some(bucket) = kept.first().map(|row| row.bucket) else {
        return Ok(None);
    };
    if kept.iter().any(|row| row.bucket != bucket) || kept.len() > rooms[bucket] {
        return Ok(None);
    }
    let rows = kept.iter().map(|row| (row.row, row.len)).collect();
    Ok(Some(Head {
        metadata,
        data_start,
        hs,
        seq: checked.seq,
        has_mask: checked.has_mask,
        bucket,
        rows,
        masks: checked.masks,
    }))
}

/// Reads every row of `hidden_states`: the `k`-th kept row's tokens into slot `first_slot + k` of `out`, its
/// padding and the dropped rows into `scratch`. Each chunk is scanned for NaN/inf and, before a narrowing
/// conversion, for finite values the conversion would make infinite.
fn receive_rows(
    body: &mut Body<'_>,
    head: &Head,
    out: &mut HsBatch,
    first_slot: usize,
    scratch: &mut [u8],
    origin: &Path,
) -> Result<(), ReceiveError> {
    let dtype = head.hs.dtype;
    let width = dtype.bitsize() / 8;
    let (din, padded) = (out.din, out.padded_len);
    let rows = head.hs.shape[0];
    let held = out.hs.dtype();
    let in_place = cfg!(target_endian = "little") && same_precision(dtype, held);
    let chunk = scratch.len() / width;
    let mut kept = head.rows.iter().enumerate().peekable();
    for row in 0..rows {
        let first = row * head.seq * din;
        let mut len = 0;
        if let Some((slot, &(_, row_len))) = kept.next_if(|(_, (r, _))| *r == row) {
            len = row_len;
            let base = (first_slot + slot) * padded * din;
            for done in (0..len * din).step_by(chunk) {
                let n = chunk.min(len * din - done);
                let dst = base + done..base + done + n;
                let at = |index: usize| first + done + index;
                let problem = if in_place {
                    let bytes = raw_bytes_mut(&mut out.hs, dst);
                    body.read(bytes)?;
                    first_non_finite(dtype, bytes)
                        .map(|(i, value)| TensorProblem::NonFinite { value, at: at(i) })
                } else {
                    let bytes = &mut scratch[..n * width];
                    body.read(bytes)?;
                    // A narrowing conversion (f32 into bf16) turns a huge finite value into an infinity.
                    let problem = first_non_finite(dtype, bytes)
                        .map(|(i, value)| TensorProblem::NonFinite { value, at: at(i) })
                        .or_else(|| {
                            first_overflow(dtype, held, bytes).map(|(i, value)| {
                                TensorProblem::Overflows {
                                    value,
                                    at: at(i),
                                    held: held.name(),
                                }
                            })
                        });
                    if problem.is_none() {
                        decode_floats_into(dtype, bytes, &mut out.hs, dst.start);
                    }
                    problem
                };
                if let Some(problem) = problem {
                    return Err(TensorFileError::tensor(origin, HIDDEN_STATES, problem).into());
                }
            }
        }
        body.skip((head.seq - len) * din * width, scratch)?;
    }
    Ok(())
}

/// True when wire elements of `dtype` are stored as they are in hidden states held in `held`.
fn same_precision(dtype: Dtype, held: HsDtype) -> bool {
    matches!(
        (dtype, held),
        (Dtype::F32, HsDtype::F32)
            | (Dtype::BF16, HsDtype::Bf16)
            | (Dtype::F16, HsDtype::F16)
            | (Dtype::F8_E4M3, HsDtype::Fp8E4m3)
    )
}

/// The bytes of elements `range` (little-endian on the hosts the direct path runs on).
fn raw_bytes_mut(data: &mut HsData, range: Range<usize>) -> &mut [u8] {
    match data {
        HsData::F32(v) => bytemuck::cast_slice_mut(&mut v[range]),
        HsData::Bf16(v) => bytemuck::cast_slice_mut(&mut v[range]),
        HsData::F16(v) => bytemuck::cast_slice_mut(&mut v[range]),
        // The codes; their rows' scales are copied from the prefix by `fill_tokens`.
        HsData::Fp8E4m3(rows) => &mut rows.parts_mut().0[range],
    }
}

/// Writes the ids, mask, length and (when the drafter reads them) `last_hidden_states` of the slots from
/// `first_slot` on that the message's rows fill, and zeroes their padding. `last_hidden_states` are scanned as
/// `hidden_states` are (non-finite values, and finite ones the conversion into the held precision overflows).
fn fill_tokens(
    head: &Head,
    prefix: &Prefix<'_>,
    out: &mut HsBatch,
    first_slot: usize,
    ids: &mut Vec<i64>,
) -> Result<(), ReceiveError> {
    let (padded, din) = (out.padded_len, out.din);
    let corrupt = || -> ReceiveError {
        let problem = TensorProblem::BadHeader("data changed after it was checked".into());
        TensorFileError::tensor(prefix.origin, INPUT_IDS, problem).into()
    };
    for (k, &(row, len)) in head.rows.iter().enumerate() {
        let slot = first_slot + k;
        let base = slot * padded;
        let tokens = row * head.seq..row * head.seq + len;
        let (dtype, bytes) = prefix.element_bytes(INPUT_IDS, tokens.clone())?;
        ids.resize(len, 0);
        if !decode_ids(dtype, bytes, ids) {
            return Err(corrupt());
        }
        for (dst, &id) in out.input_ids[base..base + len].iter_mut().zip(ids.iter()) {
            *dst = u32::try_from(id).map_err(|_| corrupt())?;
        }
        let mask = &mut out.loss_mask[base..base + len];
        if head.has_mask {
            let (dtype, bytes) = prefix.element_bytes(LOSS_MASK, tokens)?;
            if !decode_mask(dtype, bytes, mask) {
                return Err(corrupt());
            }
        } else {
            mask.fill(1);
        }
        out.seq_lens[slot] = len as u32;
        let (start, end) = (base + len, base + padded);
        out.input_ids[start..end].fill(0);
        out.loss_mask[start..end].fill(0);
        if let HsData::Fp8E4m3(held) = &mut out.hs {
            // The codes were read in place; their scales come from the prefix.
            let first = row * head.seq;
            let (_, scales) = prefix.element_bytes(HIDDEN_STATES_SCALE, first..first + len)?;
            held.set_scales(base, scales).map_err(|error| {
                let problem = match error {
                    ScaledRowsError::NonFiniteScale { row, value } => TensorProblem::NonFinite {
                        value,
                        at: first + row,
                    },
                    ScaledRowsError::Shape { .. } => {
                        TensorProblem::BadHeader("data changed after it was checked".into())
                    }
                };
                TensorFileError::tensor(prefix.origin, HIDDEN_STATES_SCALE, problem)
            })?;
        }
        out.hs.zero(start * din..end * din);
        let hidden = out.last_hidden();
        if let (Some(last), Some(hidden)) = (out.last_hidden_states.as_mut(), hidden) {
            let first = row * head.seq * hidden;
            let (dtype, bytes) =
                prefix.element_bytes(LAST_HIDDEN_STATES, first..first + len * hidden)?;
            let held = last.dtype();
            let problem = first_non_finite(dtype, bytes)
                .map(|(i, value)| TensorProblem::NonFinite {
                    value,
                    at: first + i,
                })
                .or_else(|| {
                    first_overflow(dtype, held, bytes).map(|(i, value)| TensorProblem::Overflows {
                        value,
                        at: first + i,
                        held: held.name(),
                    })
                });
            if let Some(problem) = problem {
                return Err(
                    TensorFileError::tensor(prefix.origin, LAST_HIDDEN_STATES, problem).into(),
                );
            }
            if !decode_floats_into(dtype, bytes, last, base * hidden) {
                let problem = TensorProblem::BadHeader("data changed after it was checked".into());
                return Err(
                    TensorFileError::tensor(prefix.origin, LAST_HIDDEN_STATES, problem).into(),
                );
            }
            last.zero(start * hidden..end * hidden);
        }
    }
    Ok(())
}

/// The part of a message read so far: its header and the data before `hidden_states`.
struct Prefix<'a> {
    origin: &'a Path,
    metadata: &'a Metadata,
    data: &'a [u8],
}

impl TensorRead for Prefix<'_> {
    fn origin(&self) -> &Path {
        self.origin
    }

    fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.metadata.info(name)
    }

    /// The bytes received so far: the tensors before `hidden_states` (a range past them is refused).
    fn data_section(&self) -> Result<&[u8], TensorFileError> {
        Ok(self.data)
    }
}
