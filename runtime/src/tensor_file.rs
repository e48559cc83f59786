//! Safetensors files read and written piece by piece, without holding a whole file in memory.
//!
//! ```text
//!  hidden-state files ──TensorFile::open (header only)──▶ source::safetensors reads rows on demand
//!  checkpoint::save ──write_tensors_as (f32 or bf16, streamed, fsynced)──▶ model.safetensors / optimizer.safetensors
//! ```
//!
//! Hidden-state datasets are far larger than memory, so a reader parses and validates the header once and then
//! reads byte ranges of single tensors from a memory map: only the pages a batch touches are read from disk,
//! and they are decoded straight from the page cache into the batch (no intermediate copy). The writer streams tensors straight from flat buffers in the layout
//! order, so a checkpoint never needs a second copy of the model. Header parsing and validation (contiguous
//! offsets, sizes that match shapes) reuse the `safetensors` crate's [`Metadata`].

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};

use safetensors::Dtype;
use safetensors::tensor::{Metadata, TensorInfo};

use crate::batch::HsData;

/// The largest header accepted, as in the `safetensors` crate: a corrupt length must not become a huge allocation.
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Elements converted per chunk when streaming f32 data to disk (as f32 or bf16).
const WRITE_CHUNK: usize = 16 * 1024;

/// What is wrong with a safetensors file or one of its tensors.
#[derive(Debug, thiserror::Error)]
pub enum TensorProblem {
    /// Reading or writing failed.
    #[error("i/o error: {0}")]
    Io(#[from] io::Error),
    /// The file ends before the header or the data it declares.
    #[error("truncated file: {needed} bytes needed, {actual} present")]
    Truncated {
        /// Bytes the header says the file holds.
        needed: u64,
        /// Bytes actually present.
        actual: u64,
    },
    /// The header is not valid safetensors metadata.
    #[error("invalid header: {0}")]
    BadHeader(String),
    /// A required tensor is absent.
    #[error("missing tensor")]
    Missing,
    /// A tensor the reader does not expect is present.
    #[error("unexpected tensor")]
    Unexpected,
    /// The tensor's element type is not one the reader accepts.
    #[error("dtype {found:?} not accepted (expected {expected})")]
    WrongDtype {
        /// Dtype in the file.
        found: Dtype,
        /// Accepted dtypes, in words.
        expected: &'static str,
    },
    /// The tensor has the wrong number of dimensions.
    #[error("rank {found} (shape {shape:?}), expected rank {expected}")]
    WrongRank {
        /// Rank in the file.
        found: usize,
        /// The file's shape.
        shape: Vec<usize>,
        /// Expected rank.
        expected: usize,
    },
    /// The tensor's shape disagrees with the plan or with another tensor.
    #[error("shape {found:?}, expected {expected}")]
    WrongShape {
        /// Shape in the file.
        found: Vec<usize>,
        /// The expected shape, in words.
        expected: String,
    },
    /// A sequence is longer than the plan's largest bucket (rows counted from 0, as the tensor's are).
    #[error(
        "sequence {row} of {rows} has {len} tokens; the largest bucket is {largest} (truncate or split longer \
         sequences, or add a larger bucket)"
    )]
    TooLong {
        /// The row.
        row: usize,
        /// Rows in the tensor.
        rows: usize,
        /// The row's length (its last nonzero loss-mask position, or the tensor's width without a mask).
        len: usize,
        /// The largest bucket's length.
        largest: usize,
    },
    /// A float value is NaN or infinite where only finite values can train (hidden states, weights).
    #[error("non-finite value {value} at element {at} (of the flattened tensor)")]
    NonFinite {
        /// The value found.
        value: f32,
        /// Its index in the flattened tensor.
        at: usize,
    },
    /// A weight so large that its square overflows f32 (|w| ≥ 2^64 ≈ 1.8e19): finite, but the first step's
    /// products, norms and AdamW moments would be infinite, so no step could train it.
    #[error(
        "weight {value:e} at element {at} (of the flattened tensor) is finite but too large to train: its square \
         overflows f32 (|w| must stay below 1.8e19), so its first step cannot be finite; the file is corrupt or \
         was edited"
    )]
    Untrainable {
        /// The value found.
        value: f32,
        /// Its index in the flattened tensor.
        at: usize,
    },
    /// A finite value too large for the precision hidden states are held in: converted, it would be infinite.
    #[error(
        "value {value} at element {at} (of the flattened tensor) overflows hs_dtype {held} (it would become infinite)"
    )]
    Overflows {
        /// The value found.
        value: f32,
        /// Its index in the flattened tensor.
        at: usize,
        /// The pipeline's `hs_dtype`.
        held: &'static str,
    },
    /// A value is out of its allowed range (a token id ≥ vocab, a negative id).
    #[error("value {value} at {at} out of range ({allowed})")]
    OutOfRange {
        /// The value found.
        value: i64,
        /// Where, e.g. `[3, 17]`.
        at: String,
        /// The allowed range, in words.
        allowed: String,
    },
}

/// A problem with one safetensors file, naming the file and (when it concerns one) the tensor.
#[derive(Debug, thiserror::Error)]
#[error("{}: {}{problem}", path.display(), tensor.as_ref().map(|t| format!("tensor `{t}`: ")).unwrap_or_default())]
pub struct TensorFileError {
    /// The file.
    pub path: PathBuf,
    /// The tensor concerned, if any.
    pub tensor: Option<String>,
    /// What is wrong.
    pub problem: TensorProblem,
}

impl TensorFileError {
    /// An error about the file as a whole.
    pub fn file(path: &Path, problem: impl Into<TensorProblem>) -> Self {
        Self {
            path: path.to_path_buf(),
            tensor: None,
            problem: problem.into(),
        }
    }

    /// An error about one tensor of the file.
    pub fn tensor(path: &Path, tensor: &str, problem: impl Into<TensorProblem>) -> Self {
        Self {
            path: path.to_path_buf(),
            tensor: Some(tensor.to_string()),
            problem: problem.into(),
        }
    }
}

/// An open safetensors file whose header has been read and checked against the file length, memory-mapped so
/// that a tensor's elements are read by the pages they touch, never the whole file.
#[derive(Debug)]
pub struct TensorFile {
    path: PathBuf,
    file: File,
    map: memmap2::Mmap,
    data_start: u64,
    metadata: Metadata,
}

impl TensorFile {
    /// Opens `path`, parses and validates its header, and checks that the file holds all the data it declares.
    pub fn open(path: &Path) -> Result<Self, TensorFileError> {
        let io_err = |e| TensorFileError::file(path, TensorProblem::Io(e));
        // Opening a FIFO blocks until a writer comes, and a device never ends: refuse both before opening.
        if !std::fs::metadata(path).map_err(io_err)?.is_file() {
            let problem = io::Error::new(io::ErrorKind::InvalidInput, "not a regular file");
            return Err(io_err(problem));
        }
        let file = File::open(path).map_err(io_err)?;
        let actual = file.metadata().map_err(io_err)?.len();
        let truncated =
            |needed| TensorFileError::file(path, TensorProblem::Truncated { needed, actual });
        if actual < 8 {
            return Err(truncated(8));
        }
        // SAFETY: the one `unsafe` of reading data files. A mapping's bytes can change if another process
        // writes the file while it is mapped, and an access past a truncation raises SIGBUS. Writes are the
        // hazard `read` has too (a row read twice could differ), and every row is checked as it is copied out
        // (token ids against the vocabulary, hidden states for NaN), so changed data is refused, not trusted.
        // Truncation is caught before each read by `Self::check_length` (fstat against the header's extent);
        // only a truncation racing with the copy of one row remains, as for any reader of a mapped file, and
        // datasets are written before training reads them. The bytes are only ever read as plain integers and
        // floats, so no value is invalid.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io_err)?;
        let header_len = u64::from_le_bytes(map[..8].try_into().expect("8 bytes checked above"));
        if header_len > MAX_HEADER_BYTES {
            let problem = format!("header length {header_len} exceeds {MAX_HEADER_BYTES} bytes");
            return Err(TensorFileError::file(
                path,
                TensorProblem::BadHeader(problem),
            ));
        }
        let data_start = 8 + header_len;
        if actual < data_start {
            return Err(truncated(data_start));
        }
        let header = &map[8..data_start as usize];
        let metadata: Metadata = serde_json::from_slice(header)
            .map_err(|e| TensorFileError::file(path, TensorProblem::BadHeader(e.to_string())))?;
        let needed = data_start + metadata.data_len() as u64;
        if actual < needed {
            return Err(truncated(needed));
        }
        Ok(Self {
            path: path.to_path_buf(),
            file,
            map,
            data_start,
            metadata,
        })
    }

    /// Fails when the file is now shorter than its header declares (truncated after it was opened), so no
    /// access of the mapping can fault (see the safety note in [`Self::open`]).
    fn check_length(&self) -> Result<(), TensorFileError> {
        let io_err = |e| TensorFileError::file(&self.path, TensorProblem::Io(e));
        let actual = self.file.metadata().map_err(io_err)?.len();
        let needed = self.data_start + self.metadata.data_len() as u64;
        if actual < needed {
            return Err(TensorFileError::file(
                &self.path,
                TensorProblem::Truncated { needed, actual },
            ));
        }
        Ok(())
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Names of all tensors in the file (without `__metadata__`), sorted.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.metadata.tensors().into_keys().collect();
        names.sort();
        names
    }

    /// The free-form `__metadata__` strings, if any.
    pub fn string_metadata(&self) -> Option<&HashMap<String, String>> {
        self.metadata.metadata().as_ref()
    }

    /// Dtype and shape of a tensor, or `None` when absent.
    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.metadata.info(name)
    }

    /// Dtype and shape of a tensor that must be present.
    pub fn require(&self, name: &str) -> Result<&TensorInfo, TensorFileError> {
        self.info(name)
            .ok_or_else(|| TensorFileError::tensor(&self.path, name, TensorProblem::Missing))
    }
}

/// True for the float dtypes hidden states and weights may be stored in.
pub fn is_float_dtype(dtype: Dtype) -> bool {
    matches!(dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16)
}

/// Decodes little-endian F32, F16 or BF16 bytes into `out` (`out.len()` elements). Returns false for another
/// dtype or a length mismatch.
pub fn decode_floats(dtype: Dtype, bytes: &[u8], out: &mut [f32]) -> bool {
    let width = dtype.bitsize() / 8;
    if !is_float_dtype(dtype) || bytes.len() != out.len() * width {
        return false;
    }
    if dtype == Dtype::BF16 {
        // bf16 is the top half of an f32: a shift, in a loop simple enough to vectorise (hidden states arrive
        // in bf16 far more often than not, and this runs over every byte of them).
        for (dst, src) in out.iter_mut().zip(bytes.chunks_exact(2)) {
            *dst = f32::from_bits(u32::from(u16::from_le_bytes([src[0], src[1]])) << 16);
        }
        return true;
    }
    for (dst, src) in out.iter_mut().zip(bytes.chunks_exact(width)) {
        *dst = match dtype {
            Dtype::F32 => f32::from_le_bytes([src[0], src[1], src[2], src[3]]),
            Dtype::F16 => half::f16::from_bits(u16::from_le_bytes([src[0], src[1]])).to_f32(),
            _ => half::bf16::from_bits(u16::from_le_bytes([src[0], src[1]])).to_f32(),
        };
    }
    true
}

/// Decodes little-endian F32, F16 or BF16 bytes into `out` from element `start` on, in `out`'s precision: a
/// copy when the dtypes agree, exact widening, or rounding to nearest (ties to even) when `out` is narrower.
/// Returns false for another dtype or when the elements do not fit.
pub fn decode_floats_into(dtype: Dtype, bytes: &[u8], out: &mut HsData, start: usize) -> bool {
    let width = dtype.bitsize() / 8;
    if !is_float_dtype(dtype) || width == 0 || !bytes.len().is_multiple_of(width) {
        return false;
    }
    let len = bytes.len() / width;
    if start.checked_add(len).is_none_or(|end| end > out.len()) {
        return false;
    }
    let range = start..start + len;
    let halves = || {
        bytes
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
    };
    match (out, dtype) {
        (HsData::F32(v), _) => return decode_floats(dtype, bytes, &mut v[range]),
        (HsData::Fp8E4m3(rows), _) => return rows.store_floats(dtype, bytes, start),
        // The same precision on a little-endian host: the bytes are the values, one memcpy (this is the path
        // every bf16 message and file row takes; an element loop ran at a fraction of copy speed).
        (HsData::Bf16(v), Dtype::BF16) if cfg!(target_endian = "little") => {
            bytemuck::cast_slice_mut::<_, u8>(&mut v[range]).copy_from_slice(bytes);
        }
        (HsData::F16(v), Dtype::F16) if cfg!(target_endian = "little") => {
            bytemuck::cast_slice_mut::<_, u8>(&mut v[range]).copy_from_slice(bytes);
        }
        (HsData::Bf16(v), Dtype::BF16) => {
            v[range]
                .iter_mut()
                .zip(halves())
                .for_each(|(d, x)| *d = half::bf16::from_bits(x));
        }
        (HsData::F16(v), Dtype::F16) => {
            v[range]
                .iter_mut()
                .zip(halves())
                .for_each(|(d, x)| *d = half::f16::from_bits(x));
        }
        (out, _) => {
            // A precision change (f32 or the other half type into a half type): through f32, a chunk at a time.
            let mut wide = [0.0f32; 256];
            for (i, chunk) in bytes.chunks(width * wide.len()).enumerate() {
                let n = chunk.len() / width;
                decode_floats(dtype, chunk, &mut wide[..n]);
                out.store_f32(start + i * wide.len(), &wide[..n]);
            }
        }
    }
    true
}

/// True for the integer dtypes token ids may be stored in.
pub fn is_id_dtype(dtype: Dtype) -> bool {
    matches!(dtype, Dtype::I32 | Dtype::I64)
}

/// Decodes little-endian I32 or I64 bytes into `out`. Returns false for another dtype or a length mismatch.
pub fn decode_ids(dtype: Dtype, bytes: &[u8], out: &mut [i64]) -> bool {
    let width = dtype.bitsize() / 8;
    if !is_id_dtype(dtype) || bytes.len() != out.len() * width {
        return false;
    }
    for (dst, src) in out.iter_mut().zip(bytes.chunks_exact(width)) {
        *dst = match dtype {
            Dtype::I32 => i64::from(i32::from_le_bytes([src[0], src[1], src[2], src[3]])),
            _ => i64::from_le_bytes(src.try_into().expect("chunks_exact yields 8 bytes")),
        };
    }
    true
}

/// True for the dtypes a loss mask may be stored in: bool, any integer, any float of 16, 32 or 64 bits.
pub fn is_mask_dtype(dtype: Dtype) -> bool {
    use Dtype::*;
    matches!(
        dtype,
        BOOL | U8 | I8 | I16 | U16 | I32 | U32 | I64 | U64 | F16 | BF16 | F32 | F64
    )
}

/// Decodes a mask (nonzero = keep) into 0/1 bytes. Returns false for another dtype or a length mismatch.
pub fn decode_mask(dtype: Dtype, bytes: &[u8], out: &mut [u8]) -> bool {
    let width = dtype.bitsize() / 8;
    if !is_mask_dtype(dtype) || bytes.len() != out.len() * width {
        return false;
    }
    for (dst, src) in out.iter_mut().zip(bytes.chunks_exact(width)) {
        let keep = match dtype {
            // -0.0 is zero: floats compare by value, integers by bits.
            Dtype::F16 => {
                half::f16::from_bits(u16::from_le_bytes([src[0], src[1]])).to_f32() != 0.0
            }
            Dtype::BF16 => {
                half::bf16::from_bits(u16::from_le_bytes([src[0], src[1]])).to_f32() != 0.0
            }
            Dtype::F32 => f32::from_le_bytes([src[0], src[1], src[2], src[3]]) != 0.0,
            Dtype::F64 => {
                f64::from_le_bytes(src.try_into().expect("chunks_exact yields 8 bytes")) != 0.0
            }
            _ => src.iter().any(|&b| b != 0),
        };
        *dst = u8::from(keep);
    }
    true
}

/// One f32 tensor to write: its name, shape and data (`data.len()` must equal the shape's product).
#[derive(Debug, Clone, Copy)]
pub struct F32Tensor<'a> {
    /// Tensor name.
    pub name: &'a str,
    /// Shape.
    pub shape: &'a [usize],
    /// Row-major data.
    pub data: &'a [f32],
}

/// Writes `tensors` as one safetensors file at `path` (created or truncated), in the given order, streaming from
/// the slices, then fsyncs the file. `string_metadata` goes to `__metadata__`.
pub fn write_f32_tensors(
    path: &Path,
    tensors: &[F32Tensor<'_>],
    string_metadata: HashMap<String, String>,
) -> Result<(), TensorFileError> {
    write_tensors_as(path, tensors, Dtype::F32, string_metadata)
}

/// [`write_f32_tensors`] storing every tensor as `stored`: `F32` as it is, or `BF16` rounded to nearest, ties
/// to even (the `half` crate's conversion, which keeps NaN and infinities). Other dtypes are refused.
pub fn write_tensors_as(
    path: &Path,
    tensors: &[F32Tensor<'_>],
    stored: Dtype,
    string_metadata: HashMap<String, String>,
) -> Result<(), TensorFileError> {
    if !matches!(stored, Dtype::F32 | Dtype::BF16) {
        return Err(TensorFileError::file(
            path,
            TensorProblem::WrongDtype {
                found: stored,
                expected: "F32 or BF16 to write",
            },
        ));
    }
    let width = stored.bitsize() / 8;
    let mut infos = Vec::with_capacity(tensors.len());
    let mut offset = 0;
    for t in tensors {
        let elements: usize = t.shape.iter().product();
        if elements != t.data.len() {
            let expected = format!("{} elements to match the data", t.data.len());
            let problem = TensorProblem::WrongShape {
                found: t.shape.to_vec(),
                expected,
            };
            return Err(TensorFileError::tensor(path, t.name, problem));
        }
        let bytes = elements * width;
        let info = TensorInfo {
            dtype: stored,
            shape: t.shape.to_vec(),
            data_offsets: (offset, offset + bytes),
        };
        infos.push((t.name.to_string(), info));
        offset += bytes;
    }
    let bad_header = |e: String| TensorFileError::file(path, TensorProblem::BadHeader(e));
    let metadata =
        Metadata::new(Some(string_metadata), infos).map_err(|e| bad_header(e.to_string()))?;
    let header = serde_json::to_value(&metadata).map_err(|e| bad_header(e.to_string()))?;
    let mut header =
        serde_json::to_vec(&sorted_keys(header)).map_err(|e| bad_header(e.to_string()))?;
    // Pad with spaces to 8 bytes, as the reference writer does, so the data that follows is aligned.
    header.resize(header.len().next_multiple_of(8), b' ');

    let io_err = |e| TensorFileError::file(path, TensorProblem::Io(e));
    let file = File::create(path).map_err(io_err)?;
    let mut out = BufWriter::with_capacity(1 << 20, file);
    out.write_all(&(header.len() as u64).to_le_bytes())
        .map_err(io_err)?;
    out.write_all(&header).map_err(io_err)?;
    let mut chunk = Vec::with_capacity(WRITE_CHUNK * width);
    for t in tensors {
        for values in t.data.chunks(WRITE_CHUNK) {
            chunk.clear();
            if stored == Dtype::BF16 {
                chunk.extend(
                    values
                        .iter()
                        .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()),
                );
            } else {
                chunk.extend(values.iter().flat_map(|v| v.to_le_bytes()));
            }
            out.write_all(&chunk).map_err(io_err)?;
        }
    }
    let file = out.into_inner().map_err(|e| io_err(e.into_error()))?;
    file.sync_all().map_err(io_err)
}

/// `value` with every object's keys in sorted order. `__metadata__` is a `HashMap`, whose order changes from run
/// to run; sorted keys make the same tensors always give the same bytes.
fn sorted_keys(value: serde_json::Value) -> serde_json::Value {
    match value {
        serde_json::Value::Object(map) => {
            let mut entries: Vec<_> = map.into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            serde_json::Value::Object(
                entries
                    .into_iter()
                    .map(|(k, v)| (k, sorted_keys(v)))
                    .collect(),
            )
        }
        other => other,
    }
}

/// What the hidden-state checks need from a safetensors container, whether a file on disk or a message in
/// memory: its tensors' metadata and byte ranges of their elements.
pub trait TensorRead {
    /// What errors name: the file's path, or for a message its peer and number.
    fn origin(&self) -> &Path;

    /// Dtype and shape of a tensor, or `None` when absent.
    fn tensor_info(&self, name: &str) -> Option<&TensorInfo>;

    /// The data section: every tensor's bytes, at the header's offsets (for a file, after checking that it still
    /// holds all of them).
    fn data_section(&self) -> Result<&[u8], TensorFileError>;

    /// The raw little-endian bytes of elements `elements` of tensor `name`, with the tensor's dtype (for a file,
    /// in the mapping: only the pages they span are read from disk).
    fn element_bytes(
        &self,
        name: &str,
        elements: Range<usize>,
    ) -> Result<(Dtype, &[u8]), TensorFileError> {
        let info = self.require_tensor(name)?;
        let (dtype, (start, end)) = (info.dtype, info.data_offsets);
        let width = dtype.bitsize() / 8;
        let (first, last) = (
            start.saturating_add(elements.start.saturating_mul(width)),
            start.saturating_add(elements.end.saturating_mul(width)),
        );
        let outside = || {
            let problem = format!(
                "element range {elements:?} outside the tensor or dtype {dtype:?} not byte-sized"
            );
            TensorFileError::tensor(self.origin(), name, TensorProblem::BadHeader(problem))
        };
        if width == 0 || last > end || first > last {
            return Err(outside());
        }
        let data = self.data_section()?;
        let bytes = data.get(first..last).ok_or_else(outside)?;
        Ok((dtype, bytes))
    }

    /// Copies the raw little-endian bytes of elements `elements` of tensor `name` into `out` (resized to fit).
    fn read_tensor_elements(
        &mut self,
        name: &str,
        elements: Range<usize>,
        out: &mut Vec<u8>,
    ) -> Result<Dtype, TensorFileError> {
        let (dtype, bytes) = self.element_bytes(name, elements)?;
        out.clear();
        out.extend_from_slice(bytes);
        Ok(dtype)
    }

    /// Dtype and shape of a tensor that must be present.
    fn require_tensor(&self, name: &str) -> Result<&TensorInfo, TensorFileError> {
        self.tensor_info(name)
            .ok_or_else(|| TensorFileError::tensor(self.origin(), name, TensorProblem::Missing))
    }
}

impl TensorRead for TensorFile {
    fn origin(&self) -> &Path {
        &self.path
    }

    fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.info(name)
    }

    fn data_section(&self) -> Result<&[u8], TensorFileError> {
        self.check_length()?;
        Ok(&self.map[self.data_start as usize..])
    }
}

/// A whole safetensors container held in memory (a network message), header checked against its length.
#[derive(Debug)]
pub struct TensorBlob {
    origin: PathBuf,
    metadata: Metadata,
    data_start: usize,
    bytes: Vec<u8>,
    len: usize,
}

impl TensorBlob {
    /// Parses the first `len` bytes of `bytes` as one safetensors container: the header must be valid metadata
    /// and the data exactly as long as it declares (a header that lies about a length is an error, not a
    /// short read later). `origin` names the blob in errors. `bytes` is kept (and given back by
    /// [`Self::into_bytes`]) so a connection reuses one buffer.
    pub fn parse(
        origin: PathBuf,
        bytes: Vec<u8>,
        len: usize,
    ) -> Result<Self, (Box<TensorFileError>, Vec<u8>)> {
        match Self::header(&bytes[..len.min(bytes.len())]) {
            Ok((metadata, data_start)) => Ok(Self {
                origin,
                metadata,
                data_start,
                bytes,
                len,
            }),
            Err(problem) => Err((Box::new(TensorFileError::file(&origin, problem)), bytes)),
        }
    }

    fn header(blob: &[u8]) -> Result<(Metadata, usize), TensorProblem> {
        let actual = blob.len() as u64;
        let Some(len_bytes) = blob.first_chunk::<8>() else {
            return Err(TensorProblem::Truncated { needed: 8, actual });
        };
        let header_len = u64::from_le_bytes(*len_bytes);
        if header_len > MAX_HEADER_BYTES {
            return Err(TensorProblem::BadHeader(format!(
                "header length {header_len} exceeds {MAX_HEADER_BYTES} bytes"
            )));
        }
        let data_start = 8 + header_len;
        if actual < data_start {
            return Err(TensorProblem::Truncated {
                needed: data_start,
                actual,
            });
        }
        let metadata: Metadata = serde_json::from_slice(&blob[8..data_start as usize])
            .map_err(|e| TensorProblem::BadHeader(e.to_string()))?;
        let needed = data_start + metadata.data_len() as u64;
        if actual != needed {
            return Err(TensorProblem::BadHeader(format!(
                "the header declares {needed} bytes in all, the message has {actual}"
            )));
        }
        Ok((metadata, data_start as usize))
    }

    /// The buffer, for reuse by the next message.
    pub fn into_bytes(self) -> Vec<u8> {
        self.bytes
    }
}

impl TensorRead for TensorBlob {
    fn origin(&self) -> &Path {
        &self.origin
    }

    fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.metadata.info(name)
    }

    fn data_section(&self) -> Result<&[u8], TensorFileError> {
        Ok(&self.bytes[self.data_start..self.len])
    }
}
