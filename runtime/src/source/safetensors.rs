//! Hidden states recorded from a real target, read from safetensors files.
//!
//! ```text
//!  PATH or GLOB ──expand──▶ files ──SafetensorsDataset::open (headers, ids, masks checked)──▶ batch list
//!        batch list ──shared──▶ SafetensorsSource × W ──rows from the memory map, on demand──▶ HsBatch
//! ```
//!
//! **Format** (see `docs/sources.md` for a script that writes it from Hugging Face `transformers`): each file
//! holds `hidden_states [N, S, D]` (F32, BF16 or F16; `D = hidden × tap layers`, the tapped layers concatenated
//! per token), `input_ids [N, S]` (I32 or I64, each `0 ≤ id < vocab`) and optionally `loss_mask [N, S]` (bool,
//! any integer or float; nonzero = the token may serve as a label). A drafter that reads the target's final-norm
//! output (`eagle3`) also needs `last_hidden_states [N, S, hidden]` (F32, BF16 or F16): what the target's
//! `lm_head` consumes, checked like `hidden_states`. Other tensors are ignored.
//!
//! **Lengths.** Without `loss_mask` every sequence has length `S`. With it, a sequence ends after its last
//! nonzero mask entry: the positions after it can never be labels, so the hidden states there would train
//! nothing, and right padding costs no compute. A drafter that reads `last_hidden_states` (`eagle3`) keeps one
//! position more (up to `S`): its ids and teacher are shifted left by one, so the last label's row reads the next
//! token and its final hidden state ([`BucketShapes::kept_after_last_label`]). A sequence whose mask is all zero
//! is skipped. A sequence longer than the largest bucket is an error (truncating silently would change the data).
//!
//! **Order.** Files are read in sorted path order and sequences in row order; each goes to the smallest bucket
//! that holds it, and a bucket's item is emitted when it is full, so batch positions follow the stream. At the
//! end, partly filled items are emitted in bucket order with their empty slots marked by length 0 and mask 0.
//! **Epochs.** `epochs = E` makes `E` passes over the same planned batches; with `shuffle = true` each epoch
//! visits them in a permutation drawn from `(seed, epoch)`. Batch position `p` is batch `order_e[p mod B]` of
//! epoch `e = p / B` (`B` batches per epoch), so a checkpoint's position says both the epoch and the place in
//! it, and a resumed run continues the same order. What is shuffled is the order of the batches (each a
//! bucket's worth of sequences); sequences stay with the batch the plan put them in. When the last epoch ends
//! the source is exhausted and the pipeline drains the queue.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

use draftpipe_compiler::plan::{MaskChecks, TargetStage};
use safetensors::Dtype;

use super::mask_check::{FIRST_IDS, MaskRefusal, MaskReport};
use super::{BucketShapes, HsSource, SourceError, check_owned};
use crate::batch::HsBatch;
use crate::fp8::{HIDDEN_STATES_SCALE, store_fp8_rows};
use crate::tensor_file::{
    TensorFile, TensorFileError, TensorProblem, TensorRead, decode_floats_into, decode_ids,
    decode_mask, is_float_dtype, is_id_dtype, is_mask_dtype,
};

/// Hidden-states tensor name.
pub const HIDDEN_STATES: &str = "hidden_states";
/// Token ids tensor name.
pub const INPUT_IDS: &str = "input_ids";
/// Optional loss mask tensor name.
pub const LOSS_MASK: &str = "loss_mask";
/// The target's final-norm output, `[N, S, hidden]`, required when the plan's drafter reads it (`eagle3`).
pub const LAST_HIDDEN_STATES: &str = "last_hidden_states";

/// One checked file: its shape and whether it has a mask.
#[derive(Debug, Clone)]
struct DataFile {
    path: PathBuf,
    seq: usize,
    has_mask: bool,
}

/// One sequence of one file.
#[derive(Debug, Clone, Copy)]
struct SeqRef {
    file: u32,
    row: u32,
    len: u32,
}

/// One planned batch: its bucket and its sequences (a range of `members`).
#[derive(Debug, Clone)]
struct PlannedBatch {
    bucket: usize,
    members: Range<usize>,
}

/// A checked set of hidden-state files and the batches they make, shared by all producers.
#[derive(Debug)]
pub struct SafetensorsDataset {
    files: Vec<DataFile>,
    shapes: BucketShapes,
    members: Vec<SeqRef>,
    batches: Vec<PlannedBatch>,
    epochs: u64,
    shuffle_seed: Option<u64>,
    /// One past the furthest position any producer has filled (for the status line's epoch).
    progress: AtomicU64,
    /// What the loss masks of every row of every file hold, counted as the files are checked.
    masks: MaskReport,
    /// The files with a bad mask in some row, in reading order (what a refusal names).
    files_with_bad_masks: Vec<PathBuf>,
}

impl SafetensorsDataset {
    /// Expands `pattern`, checks every file against `target` (width, vocabulary) and the buckets, and plans the
    /// batches. Reads headers, ids and masks; hidden states are read later, a batch at a time.
    pub fn open(
        pattern: &str,
        target: &TargetStage,
        shapes: &BucketShapes,
    ) -> Result<Self, SourceError> {
        if shapes.din != target.hs_width() {
            return Err(SourceError::Config(format!(
                "bucket width {} ≠ plan hidden-state width {}",
                shapes.din,
                target.hs_width()
            )));
        }
        let paths = expand_pattern(pattern)?;
        let mut dataset = Self {
            files: Vec::new(),
            shapes: shapes.clone(),
            members: Vec::new(),
            batches: Vec::new(),
            epochs: 1,
            shuffle_seed: None,
            progress: AtomicU64::new(0),
            masks: MaskReport::new(&target.masks),
            files_with_bad_masks: Vec::new(),
        };
        let mut pending: Vec<Vec<SeqRef>> = vec![Vec::new(); shapes.buckets.len()];
        for path in paths {
            let file_index = dataset.files.len() as u32;
            let (data_file, lengths, masks) = check_file(&path, target, shapes)?;
            if masks.any_bad() {
                dataset.files_with_bad_masks.push(path.clone());
            }
            dataset.masks.merge(&masks);
            let rows = lengths.len();
            for (row, len) in lengths.into_iter().enumerate() {
                if len == 0 {
                    continue;
                }
                let bucket = shapes
                    .bucket_for_len(len)
                    .ok_or_else(|| too_long(&path, row, rows, len, shapes))?;
                pending[bucket].push(SeqRef {
                    file: file_index,
                    row: row as u32,
                    len: len as u32,
                });
                if pending[bucket].len() == shapes.buckets[bucket].1 {
                    dataset.push_batch(bucket, &mut pending[bucket]);
                }
            }
            dataset.files.push(data_file);
        }
        for (bucket, group) in pending.iter_mut().enumerate() {
            if !group.is_empty() {
                dataset.push_batch(bucket, group);
            }
        }
        if dataset.batches.is_empty() {
            return Err(SourceError::Config(format!(
                "`{pattern}` holds no sequence with a kept token"
            )));
        }
        Ok(dataset)
    }

    fn push_batch(&mut self, bucket: usize, group: &mut Vec<SeqRef>) {
        let start = self.members.len();
        self.members.append(group);
        self.batches.push(PlannedBatch {
            bucket,
            members: start..self.members.len(),
        });
    }

    /// The same dataset read `epochs` times; with a `shuffle_seed`, each epoch visits the batches in its own
    /// order, a permutation drawn from `(seed, epoch)` alone, so any position can be recomputed on resume.
    pub fn with_epochs(mut self, epochs: u64, shuffle_seed: Option<u64>) -> Self {
        self.epochs = epochs.max(1);
        self.shuffle_seed = shuffle_seed;
        self
    }

    /// Passes over the data.
    pub fn epochs(&self) -> u64 {
        self.epochs
    }

    /// The epoch (from 1) the furthest producer is in, for the status line.
    pub fn current_epoch(&self) -> u64 {
        let done = self.progress.load(Ordering::Relaxed);
        (done.saturating_sub(1) / self.batches.len().max(1) as u64 + 1).min(self.epochs)
    }

    /// The batch order of epoch `epoch`: file order, or a seeded shuffle of it.
    fn epoch_order(&self, epoch: u64) -> Vec<u32> {
        let mut order: Vec<u32> = (0..self.batches.len() as u32).collect();
        if let Some(seed) = self.shuffle_seed {
            let mut rng =
                Xoshiro256PlusPlus::seed_from_u64(seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            // Fisher–Yates, written out so the order never depends on a library's shuffle algorithm.
            for i in (1..order.len()).rev() {
                let j = rng.random_range(0..=i);
                order.swap(i, j);
            }
        }
        order
    }

    /// The files, in reading order.
    pub fn files(&self) -> impl Iterator<Item = &Path> {
        self.files.iter().map(|f| f.path.as_path())
    }

    /// Batches in one pass over the data (an epoch).
    pub fn batches(&self) -> usize {
        self.batches.len()
    }

    /// Sequences in one pass (those with at least one kept token).
    pub fn sequences(&self) -> usize {
        self.members.len()
    }

    /// What the loss masks of all rows hold (each row once, whatever the epochs).
    pub fn masks(&self) -> &MaskReport {
        &self.masks
    }

    /// Refuses the data when its bad masks are more than `checks.max_bad_share` of its sequences, naming the
    /// files that hold them; what a run does before its first step.
    pub fn check_masks(&self, checks: &MaskChecks) -> Result<(), SourceError> {
        if !self.masks.over(checks.max_bad_share, 0) {
            return Ok(());
        }
        let mut data: Vec<String> = (self.files_with_bad_masks.iter())
            .take(FIRST_IDS)
            .map(|path| path.display().to_string())
            .collect();
        if self.files_with_bad_masks.len() > FIRST_IDS {
            data.push(format!(
                "{} more files",
                self.files_with_bad_masks.len() - FIRST_IDS
            ));
        }
        Err(SourceError::BadMasks(Box::new(MaskRefusal {
            data: data.join(", "),
            report: self.masks.clone(),
            max_share: checks.max_bad_share,
        })))
    }

    /// Calls `visit(ids, mask)` for every sequence of the first `batches` planned batches (all when `None`), in
    /// the unshuffled order of one epoch, reading only `input_ids` and `loss_mask` (no hidden state): what a
    /// draft vocabulary counts (`model::eagle3::vocab`).
    ///
    /// # Errors
    /// A file that cannot be read or changed since it was checked, or `visit`'s error.
    pub fn visit_token_rows(
        &self,
        batches: Option<usize>,
        mut visit: impl FnMut(&Path, &[i64], &[u8]) -> Result<(), SourceError>,
    ) -> Result<(), SourceError> {
        let mut open: Option<(u32, TensorFile)> = None;
        let (mut ids, mut mask, mut bytes) = (Vec::new(), Vec::new(), Vec::new());
        let planned = &self.batches[..batches.unwrap_or(usize::MAX).min(self.batches.len())];
        for member in planned.iter().flat_map(|b| b.members.clone()) {
            let seq = self.members[member];
            let data_file = &self.files[seq.file as usize];
            if open.as_ref().is_none_or(|(index, _)| *index != seq.file) {
                open = Some((seq.file, TensorFile::open(&data_file.path)?));
            }
            let file = &mut open.as_mut().expect("opened above").1;
            let (first, len) = (seq.row as usize * data_file.seq, seq.len as usize);
            let changed = |tensor: &str| -> SourceError {
                let problem = TensorProblem::BadHeader("file changed since it was checked".into());
                TensorFileError::tensor(&data_file.path, tensor, problem).into()
            };
            ids.resize(len, 0);
            let dtype = file.read_tensor_elements(INPUT_IDS, first..first + len, &mut bytes)?;
            if !decode_ids(dtype, &bytes, &mut ids) {
                return Err(changed(INPUT_IDS));
            }
            mask.resize(len, 1);
            if data_file.has_mask {
                let dtype = file.read_tensor_elements(LOSS_MASK, first..first + len, &mut bytes)?;
                if !decode_mask(dtype, &bytes, &mut mask) {
                    return Err(changed(LOSS_MASK));
                }
            } else {
                mask.fill(1);
            }
            visit(&data_file.path, &ids, &mask)?;
        }
        Ok(())
    }
}

pub(crate) fn too_long(
    path: &Path,
    row: usize,
    rows: usize,
    len: usize,
    shapes: &BucketShapes,
) -> SourceError {
    let problem = TensorProblem::TooLong {
        row,
        rows,
        len,
        largest: shapes.buckets.last().map_or(0, |b| b.0),
    };
    TensorFileError::tensor(path, INPUT_IDS, problem).into()
}

/// Checks one file's tensors against the plan and returns it with each row's length (0 = skip) and what its
/// loss masks hold.
fn check_file(
    path: &Path,
    target: &TargetStage,
    shapes: &BucketShapes,
) -> Result<(DataFile, Vec<usize>, MaskReport), SourceError> {
    let mut file = TensorFile::open(path)?;
    let checked = check_tensors(&mut file, target, shapes)?;
    Ok((
        DataFile {
            path: path.to_path_buf(),
            seq: checked.seq,
            has_mask: checked.has_mask,
        },
        checked.lengths,
        checked.masks,
    ))
}

/// What [`check_tensors`] found: the padded length `S`, whether a mask is present, and each row's length.
#[derive(Debug, Clone)]
pub struct CheckedTensors {
    /// Columns of `input_ids` (`S`).
    pub seq: usize,
    /// Whether `loss_mask` is present.
    pub has_mask: bool,
    /// Per row, its length: up to its last kept token (0 = nothing to train on).
    pub lengths: Vec<usize>,
    /// What the rows' loss masks hold, judged by the stage's `end_of_turn` (`mask_check`).
    pub masks: MaskReport,
}

/// The checks every hidden-state container passes, file or network message: names, dtypes, ranks, shapes
/// against the plan, token ids in the vocabulary, and each row's length from its mask.
pub fn check_tensors(
    file: &mut impl TensorRead,
    target: &TargetStage,
    shapes: &BucketShapes,
) -> Result<CheckedTensors, SourceError> {
    let path = file.origin().to_path_buf();
    let path = path.as_path();
    let bad = |tensor: &str, problem: TensorProblem| -> SourceError {
        TensorFileError::tensor(path, tensor, problem).into()
    };

    let hs = file.require_tensor(HIDDEN_STATES)?;
    if !is_float_dtype(hs.dtype) && hs.dtype != Dtype::F8_E4M3 {
        return Err(bad(
            HIDDEN_STATES,
            TensorProblem::WrongDtype {
                found: hs.dtype,
                expected: "F32, BF16, F16 or F8_E4M3 (with hidden_states_scale)",
            },
        ));
    }
    let fp8 = hs.dtype == Dtype::F8_E4M3;
    let &[rows, seq, width] = hs.shape.as_slice() else {
        return Err(bad(
            HIDDEN_STATES,
            TensorProblem::WrongRank {
                found: hs.shape.len(),
                shape: hs.shape.clone(),
                expected: 3,
            },
        ));
    };
    if width != shapes.din {
        let expected = format!(
            "[N, S, {}] (hidden {} × {} tap layers)",
            shapes.din,
            target.hidden,
            target.tap_layers.len()
        );
        return Err(bad(
            HIDDEN_STATES,
            TensorProblem::WrongShape {
                found: hs.shape.clone(),
                expected,
            },
        ));
    }
    if let Some(hidden) = shapes.last_hidden {
        let last = file.require_tensor(LAST_HIDDEN_STATES)?;
        let problem = if !is_float_dtype(last.dtype) {
            Some(TensorProblem::WrongDtype {
                found: last.dtype,
                expected: "F32, BF16 or F16",
            })
        } else if last.shape.len() != 3 {
            Some(TensorProblem::WrongRank {
                found: last.shape.len(),
                shape: last.shape.clone(),
                expected: 3,
            })
        } else if last.shape != [rows, seq, hidden] {
            Some(TensorProblem::WrongShape {
                found: last.shape.clone(),
                expected: format!(
                    "[{rows}, {seq}, {hidden}] (the target's final-norm output, hidden {hidden}, for each token \
                     of {HIDDEN_STATES})"
                ),
            })
        } else {
            None
        };
        if let Some(problem) = problem {
            return Err(bad(LAST_HIDDEN_STATES, problem));
        }
    }
    let check_rows =
        |name: &str, dtype: Dtype, shape: &[usize], ok: fn(Dtype) -> bool, kinds: &'static str| {
            if !ok(dtype) {
                return Err(bad(
                    name,
                    TensorProblem::WrongDtype {
                        found: dtype,
                        expected: kinds,
                    },
                ));
            }
            if shape.len() != 2 {
                return Err(bad(
                    name,
                    TensorProblem::WrongRank {
                        found: shape.len(),
                        shape: shape.to_vec(),
                        expected: 2,
                    },
                ));
            }
            if shape != [rows, seq] {
                let expected = format!("[{rows}, {seq}] to match {HIDDEN_STATES}");
                return Err(bad(
                    name,
                    TensorProblem::WrongShape {
                        found: shape.to_vec(),
                        expected,
                    },
                ));
            }
            Ok(())
        };
    if fp8 {
        // FP8 rows are meaningless without their scales: one f32 per token.
        let scale = file.require_tensor(HIDDEN_STATES_SCALE)?;
        let is_f32 = |dtype| dtype == Dtype::F32;
        check_rows(
            HIDDEN_STATES_SCALE,
            scale.dtype,
            &scale.shape,
            is_f32,
            "F32",
        )?;
    }
    let ids = file.require_tensor(INPUT_IDS)?;
    check_rows(INPUT_IDS, ids.dtype, &ids.shape, is_id_dtype, "I32 or I64")?;
    let has_mask = match file.tensor_info(LOSS_MASK) {
        Some(mask) => {
            check_rows(
                LOSS_MASK,
                mask.dtype,
                &mask.shape,
                is_mask_dtype,
                "bool, an integer or a float",
            )?;
            true
        }
        None => false,
    };

    // The header alone decides `rows` and `seq`; with zero elements (`[0, 2^40, D]`) the file holds no data to
    // bound them, so nothing is allocated by them before they are checked against the plan.
    if rows == 0 || seq == 0 {
        return Ok(CheckedTensors {
            seq,
            has_mask,
            lengths: Vec::new(),
            masks: MaskReport::new(&target.masks),
        });
    }
    if !has_mask && seq > shapes.buckets.last().map_or(0, |b| b.0) {
        return Err(too_long(path, 0, rows, seq, shapes));
    }
    let mut bytes = Vec::new();
    let mut ids_row = vec![0i64; seq];
    let mut mask_row = vec![1u8; seq];
    let mut lengths = Vec::with_capacity(rows);
    let kept_after = shapes.kept_after_last_label();
    let mut masks = MaskReport::new(&target.masks);
    for row in 0..rows {
        let elements = row * seq..(row + 1) * seq;
        let dtype = file.read_tensor_elements(INPUT_IDS, elements.clone(), &mut bytes)?;
        decode_ids(dtype, &bytes, &mut ids_row);
        if let Some((col, &id)) = ids_row
            .iter()
            .enumerate()
            .find(|&(_, &id)| id < 0 || id >= target.vocab as i64)
        {
            let allowed = format!("token ids must lie in 0..{}", target.vocab);
            return Err(bad(
                INPUT_IDS,
                TensorProblem::OutOfRange {
                    value: id,
                    at: format!("[{row}, {col}]"),
                    allowed,
                },
            ));
        }
        if has_mask {
            let dtype = file.read_tensor_elements(LOSS_MASK, elements, &mut bytes)?;
            decode_mask(dtype, &bytes, &mut mask_row);
        }
        let kept = mask_row
            .iter()
            .rposition(|&m| m != 0)
            .map_or(0, |last| (last + 1 + kept_after).min(seq));
        lengths.push(kept);
        let id = || format!("{} row {row}", path.display());
        masks.add_row((&ids_row, &mask_row), kept, target.masks.end_of_turn, &id);
    }
    Ok(CheckedTensors {
        seq,
        has_mask,
        lengths,
        masks,
    })
}

/// Expands a path or a glob whose wildcards (`*`, `?`) are in the file-name part; a directory means every
/// `*.safetensors` file in it. Matches are sorted.
pub fn expand_pattern(pattern: &str) -> Result<Vec<PathBuf>, SourceError> {
    let path = Path::new(pattern);
    let wild = |s: &str| s.contains(['*', '?']);
    let (dir, name_pattern) = if !wild(pattern) {
        if path.is_file() {
            return Ok(vec![path.to_path_buf()]);
        }
        if !path.is_dir() {
            return Err(SourceError::NoMatch {
                pattern: pattern.to_string(),
            });
        }
        (path, "*.safetensors")
    } else {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let dir = path
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        if wild(&dir.to_string_lossy()) {
            return Err(SourceError::Config(format!(
                "`{pattern}`: wildcards are allowed in the file name only"
            )));
        }
        (dir, name)
    };
    let list_err = |source| SourceError::ListDir {
        dir: dir.display().to_string(),
        source,
    };
    let mut matches = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(list_err)? {
        let entry = entry.map_err(list_err)?;
        let name = entry.file_name();
        let is_file = entry.path().is_file();
        if is_file
            && name
                .to_str()
                .is_some_and(|n| wildcard_match(name_pattern, n))
        {
            matches.push(entry.path());
        }
    }
    if matches.is_empty() {
        return Err(SourceError::NoMatch {
            pattern: pattern.to_string(),
        });
    }
    matches.sort();
    Ok(matches)
}

/// Matches `name` against `pattern`: `*` is any run of characters, `?` one character.
pub fn wildcard_match(pattern: &str, name: &str) -> bool {
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    let (mut pi, mut ni) = (0, 0);
    // The last `*` seen and the name position it was tried at: on a mismatch, let it swallow one more char.
    let mut star: Option<(usize, usize)> = None;
    while ni < n.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == n[ni]) {
            pi += 1;
            ni += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some((pi, ni));
            pi += 1;
        } else if let Some((sp, sn)) = star {
            pi = sp + 1;
            ni = sn + 1;
            star = Some((sp, sn + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

/// One producer's share of a [`SafetensorsDataset`]: global batch positions `p ≡ producer (mod producers)`.
#[derive(Debug)]
pub struct SafetensorsSource {
    dataset: Arc<SafetensorsDataset>,
    producer: usize,
    producers: usize,
    next: u64,
    open: Option<(u32, TensorFile)>,
    ids: Vec<i64>,
    /// The batch order of the epoch `next` is in, and that epoch.
    order: Option<(u64, Vec<u32>)>,
}

impl SafetensorsSource {
    /// Producer `producer` of `producers`, at its first position.
    pub fn new(dataset: Arc<SafetensorsDataset>, producer: usize, producers: usize) -> Self {
        Self {
            dataset,
            producer,
            producers,
            next: producer as u64,
            open: None,
            ids: Vec::new(),
            order: None,
        }
    }

    /// The planned batch at global position `position`, or `None` past the last epoch.
    fn planned(&mut self, position: u64) -> Option<PlannedBatch> {
        let per_epoch = self.dataset.batches.len() as u64;
        let epoch = position / per_epoch;
        if epoch >= self.dataset.epochs {
            return None;
        }
        if self.order.as_ref().is_none_or(|(e, _)| *e != epoch) {
            self.order = Some((epoch, self.dataset.epoch_order(epoch)));
        }
        let (_, order) = self.order.as_ref().expect("set above");
        let index = order[(position % per_epoch) as usize] as usize;
        self.dataset.batches.get(index).cloned()
    }

    /// The open handle of file `index`, reopening (and rechecking the header) when another file was open.
    fn file(&mut self, index: u32) -> Result<&mut TensorFile, SourceError> {
        if self.open.as_ref().is_none_or(|(open, _)| *open != index) {
            let file = TensorFile::open(&self.dataset.files[index as usize].path)?;
            self.open = Some((index, file));
        }
        Ok(&mut self.open.as_mut().expect("opened above").1)
    }

    /// Reads sequence `seq` into slot `slot` of `out`.
    fn read_sequence(
        &mut self,
        seq: SeqRef,
        slot: usize,
        out: &mut HsBatch,
    ) -> Result<(), SourceError> {
        let dataset = Arc::clone(&self.dataset);
        let data_file = &dataset.files[seq.file as usize];
        let (len, din, base) = (seq.len as usize, out.din, slot * out.padded_len);
        let first = seq.row as usize * data_file.seq;
        let mut ids = std::mem::take(&mut self.ids);
        ids.resize(len, 0);
        let file = self.file(seq.file)?;
        let path = file.path().to_path_buf();
        let changed = |tensor: &str| -> SourceError {
            TensorFileError::tensor(
                &path,
                tensor,
                TensorProblem::BadHeader("file changed since it was checked".into()),
            )
            .into()
        };

        let (dtype, bytes) = file.element_bytes(INPUT_IDS, first..first + len)?;
        if !decode_ids(dtype, bytes, &mut ids) {
            return Err(changed(INPUT_IDS));
        }
        for (dst, &id) in out.input_ids[base..base + len].iter_mut().zip(&ids) {
            *dst = u32::try_from(id).map_err(|_| changed(INPUT_IDS))?;
        }
        let mask = &mut out.loss_mask[base..base + len];
        if data_file.has_mask {
            let (dtype, bytes) = file.element_bytes(LOSS_MASK, first..first + len)?;
            if !decode_mask(dtype, bytes, mask) {
                return Err(changed(LOSS_MASK));
            }
        } else {
            mask.fill(1);
        }
        // Decoded straight from the mapping: only the pages of this row are read from disk.
        let (dtype, bytes) = file.element_bytes(HIDDEN_STATES, first * din..(first + len) * din)?;
        if dtype == Dtype::F8_E4M3 {
            let (_, scales) = file.element_bytes(HIDDEN_STATES_SCALE, first..first + len)?;
            store_fp8_rows(bytes, scales, (din, first), &mut out.hs, base * din, &path)?;
        } else if !decode_floats_into(dtype, bytes, &mut out.hs, base * din) {
            return Err(changed(HIDDEN_STATES));
        }
        // A NaN in the data (or an f32 too large for a narrower `hs_dtype`) would otherwise surface as a
        // non-finite loss and be blamed on the learning rate.
        let hs = out.hs.as_slice().slice(base * din..(base + len) * din);
        if let Some((at, value)) = hs.first_non_finite() {
            let problem = TensorProblem::NonFinite {
                value,
                at: first * din + at,
            };
            return Err(TensorFileError::tensor(&path, HIDDEN_STATES, problem).into());
        }
        if let (Some(last), Some(hidden)) =
            (out.last_hidden_states.as_mut(), dataset.shapes.last_hidden)
        {
            let elements = first * hidden..(first + len) * hidden;
            let (dtype, bytes) = file.element_bytes(LAST_HIDDEN_STATES, elements)?;
            if !decode_floats_into(dtype, bytes, last, base * hidden) {
                return Err(changed(LAST_HIDDEN_STATES));
            }
            let rows = last.as_slice().slice(base * hidden..(base + len) * hidden);
            if let Some((at, value)) = rows.first_non_finite() {
                let problem = TensorProblem::NonFinite {
                    value,
                    at: first * hidden + at,
                };
                return Err(TensorFileError::tensor(&path, LAST_HIDDEN_STATES, problem).into());
            }
        }
        self.ids = ids;
        Ok(())
    }
}

impl HsSource for SafetensorsSource {
    fn next_bucket(&mut self) -> Result<Option<usize>, SourceError> {
        Ok(self.planned(self.next).map(|b| b.bucket))
    }

    fn fill_next(&mut self, out: &mut HsBatch) -> Result<(), SourceError> {
        let Some(planned) = self.planned(self.next) else {
            return Err(SourceError::Buffer(format!(
                "position {} is past the end of the data",
                self.next
            )));
        };
        if !self.dataset.shapes.matches(out, planned.bucket) {
            return Err(SourceError::Buffer(format!(
                "position {} needs bucket {} {:?}, got a {}×{} buffer",
                self.next,
                planned.bucket,
                self.dataset.shapes.buckets[planned.bucket],
                out.sequences,
                out.padded_len
            )));
        }
        let (padded, din) = (out.padded_len, out.din);
        for slot in 0..out.sequences {
            let len = match planned.members.clone().nth(slot) {
                Some(member) => {
                    let seq = self.dataset.members[member];
                    self.read_sequence(seq, slot, out)?;
                    seq.len as usize
                }
                None => 0,
            };
            out.seq_lens[slot] = len as u32;
            let (start, end) = (slot * padded + len, (slot + 1) * padded);
            out.input_ids[start..end].fill(0);
            out.loss_mask[start..end].fill(0);
            out.hs.zero(start * din..end * din);
            if let (Some(last), Some(hidden)) = (
                out.last_hidden_states.as_mut(),
                self.dataset.shapes.last_hidden,
            ) {
                last.zero(start * hidden..end * hidden);
            }
        }
        out.source_position = self.next;
        self.dataset
            .progress
            .fetch_max(self.next + 1, Ordering::Relaxed);
        self.next += self.producers as u64;
        Ok(())
    }

    fn position(&self) -> u64 {
        self.next
    }

    fn seek(&mut self, position: u64) -> Result<(), SourceError> {
        check_owned(position, self.producer, self.producers)?;
        self.next = position;
        Ok(())
    }

    fn mask_probe(&self) -> Option<super::MaskProbe> {
        let dataset = Arc::clone(&self.dataset);
        Some(super::MaskProbe::new(move || dataset.masks().clone()))
    }

    fn status_probe(&self) -> Option<super::SourceStatusProbe> {
        let dataset = Arc::clone(&self.dataset);
        (dataset.epochs > 1).then(|| {
            super::SourceStatusProbe::new(move || {
                format!("epoch {}/{}", dataset.current_epoch(), dataset.epochs)
            })
        })
    }
}
