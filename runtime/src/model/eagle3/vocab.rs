//! EAGLE-3's draft vocabulary: which target tokens the draft head predicts (`t2d`) and where each draft id
//! lands in the target vocabulary (`d2t`), built from token frequencies of the training data with SpecForge's
//! rule, read from and written to a safetensors file, and exported unchanged.
//!
//! ```text
//!  plan's source (files: ids and masks only │ synthetic: its first batches) ──count_source_tokens──┐
//!  source batches (input_ids, loss_mask) ──TokenCounts::add_sequence──▶ counts ──VocabMap::from_counts──▶ VocabMap
//!  `draftpipe vocab` ──VocabMap::write──▶ vocab.safetensors ──VocabMap::read──▶ the run (teacher, export)
//! ```
//!
//! The rule is SpecForge's `generate_vocab_mapping_file` / `count_effective_feature_tokens` and
//! `process_token_dict_to_mappings` (`specforge/data/preprocessing.py`, `specforge/training/vocab_mapping.py`):
//!
//! - only tokens whose `loss_mask` is set are counted, the ids as stored (not shifted), sequence by sequence;
//! - a Python `Counter` keeps first-insertion order and each sequence adds its distinct ids in ascending order
//!   (`tensor.unique` sorts), so among equal counts a token seen in an earlier sequence, then a smaller id, wins
//!   (`Counter.most_common` is a stable sort by count);
//! - with fewer distinct tokens than the draft vocabulary, ids of `0..draft_vocab` not yet counted are added
//!   with count 0 until there are `draft_vocab` of them, in the order CPython iterates
//!   `set(range(draft_vocab)) - set(counted)` ([`cpython_difference_order`] replays CPython 3.11's set table;
//!   it matters only when counted ids `≥ draft_vocab` leave more missing ids than are needed);
//! - the `draft_vocab` most common ids, sorted ascending, are the draft vocabulary: `d2t[i] = used[i] − i` (an
//!   offset, as SGLang and vLLM add it to the draft id) and `t2d[id]` is true exactly for the used ids.

use std::path::{Path, PathBuf};

use std::io::Write as _;

use safetensors::Dtype;
use safetensors::tensor::TensorView;

use draftpipe_compiler::plan::{Plan, SourceSpec};

use crate::output_file::{OutputError, write_output};
use crate::source::{
    BucketShapes, HsSource, SafetensorsDataset, SourceError, SyntheticSource, SyntheticTarget,
};
use crate::tensor_file::{TensorFile, TensorFileError, TensorProblem, TensorRead, decode_ids};

/// Name of the draft → target offset tensor (int64, `[draft_vocab]`), as SpecForge, SGLang and vLLM name it.
pub const D2T: &str = "d2t";
/// Name of the target → in-draft-vocabulary tensor (bool, `[vocab]`).
pub const T2D: &str = "t2d";

/// Synthetic batches a draft vocabulary is counted over when no count is given: the synthetic stream never ends,
/// and its chain's token frequencies settle long before this many batches.
pub const SYNTHETIC_COUNT_BATCHES: u64 = 1000;

/// The most synthetic batches one count makes: a synthetic stream never ends, so the count asked for is the
/// whole work (each batch generated, hidden states included), and like the checker's bounds on a `.pipe`
/// file's counts it is refused above this, a thousand times the default, whose frequencies long settled.
pub const MAX_SYNTHETIC_COUNT_BATCHES: u64 = 1000 * SYNTHETIC_COUNT_BATCHES;

/// Token counts of the training data, in the order SpecForge's `Counter` would hold them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenCounts {
    /// Loss-masked occurrences of each target id.
    counts: Vec<u64>,
    /// Rank of first insertion for each counted id (`u32::MAX`: never counted).
    first_seen: Vec<u32>,
    distinct: u32,
    /// Scratch for one sequence's selected ids.
    selected: Vec<usize>,
}

/// A token id outside the target vocabulary (the sources check ids as they read them, so this means a caller
/// passed unchecked data).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("token id {id} at position {position} is outside the target vocabulary 0..{vocab}")]
pub struct CountError {
    /// The id.
    pub id: i64,
    /// Its position in the sequence.
    pub position: usize,
    /// The target vocabulary.
    pub vocab: usize,
}

impl TokenCounts {
    /// No tokens counted yet, over a target vocabulary of `vocab` ids.
    pub fn new(vocab: usize) -> Self {
        Self {
            counts: vec![0; vocab],
            first_seen: vec![u32::MAX; vocab],
            distinct: 0,
            selected: Vec::new(),
        }
    }

    /// The target vocabulary.
    pub fn vocab(&self) -> usize {
        self.counts.len()
    }

    /// Counts the ids of one sequence whose mask byte is nonzero (`ids` and `mask` of one length; a shorter
    /// mask counts only the positions it covers).
    ///
    /// # Errors
    /// [`CountError`] for an id outside the vocabulary; nothing is counted from that sequence then.
    pub fn add_sequence(&mut self, ids: &[i64], mask: &[u8]) -> Result<(), CountError> {
        self.selected.clear();
        for (position, (&id, &keep)) in ids.iter().zip(mask).enumerate() {
            if keep == 0 {
                continue;
            }
            match usize::try_from(id) {
                Ok(index) if index < self.counts.len() => self.selected.push(index),
                _ => {
                    return Err(CountError {
                        id,
                        position,
                        vocab: self.counts.len(),
                    });
                }
            }
        }
        // `unique` hands the Counter a sequence's ids ascending: first insertions follow that order.
        self.selected.sort_unstable();
        for &index in &self.selected {
            if self.first_seen[index] == u32::MAX {
                self.first_seen[index] = self.distinct;
                self.distinct += 1;
            }
            self.counts[index] += 1;
        }
        Ok(())
    }

    /// Loss-masked occurrences of target id `id` (0 when never counted or outside the vocabulary).
    pub fn count(&self, id: usize) -> u64 {
        self.counts.get(id).copied().unwrap_or(0)
    }

    /// How many distinct ids were counted.
    pub fn distinct(&self) -> usize {
        self.distinct as usize
    }

    /// All counted occurrences.
    pub fn total(&self) -> u64 {
        self.counts.iter().sum()
    }
}

/// Why a draft vocabulary could not be built, read or written.
#[derive(Debug, thiserror::Error)]
pub enum VocabMapError {
    /// The file or one of its tensors is unreadable or malformed.
    #[error(transparent)]
    File(#[from] TensorFileError),
    /// The draft vocabulary is empty or larger than the target's.
    #[error("draft_vocab = {draft} must be between 1 and the target's vocabulary ({target})")]
    Sizes {
        /// The draft vocabulary.
        draft: usize,
        /// The target vocabulary.
        target: usize,
    },
    /// The source could not be opened or read.
    #[error(transparent)]
    Source(#[from] SourceError),
    /// The map's file could not be written (or what is at its path may not be replaced).
    #[error(transparent)]
    Output(#[from] OutputError),
    /// A stream's data arrives while the run trains, so nothing can be counted before it.
    #[error(
        "a stream source cannot be counted before training: record its data to files and run `draftpipe vocab` \
         over a pipeline reading them, then give the map with `vocab_map = \"FILE\"`"
    )]
    StreamSource,
    /// More synthetic batches asked for than one count makes.
    #[error(
        "{asked} batches of a synthetic source is more than a count makes ({MAX_SYNTHETIC_COUNT_BATCHES}): the \
         synthetic stream never ends, so the batches asked for are all the work; its token frequencies settle \
         within the default {SYNTHETIC_COUNT_BATCHES}"
    )]
    TooManySyntheticBatches {
        /// The batches asked for.
        asked: u64,
    },
    /// The plan's drafter has no draft vocabulary.
    #[error("the drafter is `{family}`; a draft vocabulary belongs to an `eagle3` drafter")]
    NotEagle3 {
        /// The plan's family.
        family: &'static str,
    },
    /// `t2d` and `d2t` describe different vocabularies.
    #[error(
        "{}: tensors `t2d` and `d2t` disagree: {detail} (the ids `t2d` selects, ascending, must equal \
         d2t[i] + i)",
        path.display()
    )]
    Inconsistent {
        /// The file.
        path: PathBuf,
        /// The first disagreement, in words.
        detail: String,
    },
}

/// The draft vocabulary maps: `d2t[i]` is the offset from draft id `i` to its target id (`i + d2t[i]`), `t2d[t]`
/// whether target id `t` is in the draft vocabulary. Never trained; exported as they are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VocabMap {
    /// Draft id → target id offset, `[draft_vocab]`.
    pub d2t: Vec<i64>,
    /// Target id → in the draft vocabulary, `[vocab]`.
    pub t2d: Vec<bool>,
}

impl VocabMap {
    /// SpecForge's draft vocabulary of `draft_vocab` ids from `counts` (see the module's rule).
    ///
    /// # Errors
    /// [`VocabMapError::Sizes`] when `draft_vocab` is 0 or larger than the target vocabulary.
    pub fn from_counts(counts: &TokenCounts, draft_vocab: usize) -> Result<Self, VocabMapError> {
        let vocab = counts.vocab();
        if draft_vocab == 0 || draft_vocab > vocab {
            return Err(VocabMapError::Sizes {
                draft: draft_vocab,
                target: vocab,
            });
        }
        // (id, count, insertion rank) in the Counter's order: counted ids first, then the zero-count padding.
        let mut entries: Vec<(usize, u64, u64)> = (0..vocab)
            .filter(|&id| counts.first_seen[id] != u32::MAX)
            .map(|id| (id, counts.counts[id], u64::from(counts.first_seen[id])))
            .collect();
        let needed = draft_vocab.saturating_sub(entries.len());
        let padding = if needed == 0 {
            Vec::new()
        } else {
            let counted = |id: usize| counts.first_seen[id] != u32::MAX;
            cpython_difference_order(draft_vocab, entries.len(), counted)
        };
        let padding = padding.into_iter().take(needed);
        let next_rank = u64::from(counts.distinct);
        entries.extend(
            padding
                .enumerate()
                .map(|(i, id)| (id, 0, next_rank + i as u64)),
        );
        // `most_common(n)`: descending count, ties in insertion order.
        entries.sort_by(|a, b| b.1.cmp(&a.1).then(a.2.cmp(&b.2)));
        let mut used: Vec<usize> = entries[..draft_vocab].iter().map(|e| e.0).collect();
        used.sort_unstable();
        Ok(Self::from_used(&used, vocab))
    }

    /// The identity map over `vocab` ids (the draft vocabulary is the target's).
    pub fn identity(vocab: usize) -> Self {
        Self {
            d2t: vec![0; vocab],
            t2d: vec![true; vocab],
        }
    }

    /// The map whose draft vocabulary is `used` (ascending, distinct, each `< vocab`).
    fn from_used(used: &[usize], vocab: usize) -> Self {
        let mut t2d = vec![false; vocab];
        let d2t = used
            .iter()
            .enumerate()
            .map(|(draft, &target)| {
                t2d[target] = true;
                target as i64 - draft as i64
            })
            .collect();
        Self { d2t, t2d }
    }

    /// The draft vocabulary's size.
    pub fn draft_vocab(&self) -> usize {
        self.d2t.len()
    }

    /// The target vocabulary's size.
    pub fn target_vocab(&self) -> usize {
        self.t2d.len()
    }

    /// The target id of each draft id, ascending.
    pub fn target_ids(&self) -> impl Iterator<Item = usize> + '_ {
        self.d2t
            .iter()
            .enumerate()
            .map(|(draft, &offset)| (draft as i64 + offset) as usize)
    }

    /// The draft id of each target id (`None` outside the draft vocabulary).
    pub fn draft_ids(&self) -> Vec<Option<u32>> {
        let mut draft_of = vec![None; self.target_vocab()];
        for (draft, target) in self.target_ids().enumerate() {
            draft_of[target] = Some(draft as u32);
        }
        draft_of
    }

    /// `d2t` as little-endian int64 bytes and `t2d` as safetensors bools (one byte, 0 or 1), to write.
    pub fn tensor_bytes(&self) -> (Vec<u8>, Vec<u8>) {
        let d2t = self.d2t.iter().flat_map(|v| v.to_le_bytes()).collect();
        let t2d = self.t2d.iter().map(|&b| u8::from(b)).collect();
        (d2t, t2d)
    }

    /// Writes `d2t` (I64) and `t2d` (BOOL) as one safetensors file at `path`.
    ///
    /// # Errors
    /// [`VocabMapError::File`] naming `path` when it cannot be written.
    pub fn write(&self, path: &Path) -> Result<(), VocabMapError> {
        let (d2t, t2d) = self.tensor_bytes();
        let bad = |e: safetensors::SafeTensorError| match e {
            safetensors::SafeTensorError::IoError(io) => TensorFileError::file(path, io),
            other => TensorFileError::file(path, TensorProblem::BadHeader(other.to_string())),
        };
        let views = [
            (
                D2T,
                TensorView::new(Dtype::I64, vec![self.draft_vocab()], &d2t).map_err(bad)?,
            ),
            (
                T2D,
                TensorView::new(Dtype::BOOL, vec![self.target_vocab()], &t2d).map_err(bad)?,
            ),
        ];
        let bytes = safetensors::serialize(views, None).map_err(bad)?;
        write_output(path, |out| out.write_all(&bytes))?;
        Ok(())
    }

    /// Reads `d2t` and `t2d` from the safetensors file at `path` (other tensors are ignored, so an export's
    /// `model.safetensors` serves too) and checks them: `d2t` I64 `[draft_vocab]`, `t2d` BOOL or U8 (each
    /// byte 0 or 1; another value is refused naming the element) `[vocab]`, the
    /// ids `t2d` selects equal to `d2t[i] + i`, and, when `expected` is given, the plan's
    /// `(draft_vocab, vocab)`.
    ///
    /// # Errors
    /// [`VocabMapError`] naming the file and the tensor.
    pub fn read(path: &Path, expected: Option<(usize, usize)>) -> Result<Self, VocabMapError> {
        let file = TensorFile::open(path)?;
        let d2t_len = rank1(
            &file,
            D2T,
            &[Dtype::I64],
            "I64",
            expected.map(|e| (e.0, "draft_vocab")),
        )?;
        // SpecForge writes a torch.bool; a user writing the mask with numpy or by hand often has uint8 0/1.
        let t2d_len = rank1(
            &file,
            T2D,
            &[Dtype::BOOL, Dtype::U8],
            "BOOL or U8 (0 or 1)",
            expected.map(|e| (e.1, "vocab")),
        )?;
        let (_, bytes) = file.element_bytes(D2T, 0..d2t_len)?;
        let mut d2t = vec![0i64; d2t_len];
        decode_ids(Dtype::I64, bytes, &mut d2t);
        let (_, bytes) = file.element_bytes(T2D, 0..t2d_len)?;
        let mut t2d = Vec::with_capacity(t2d_len);
        for (at, &byte) in bytes.iter().enumerate() {
            if byte > 1 {
                let problem = TensorProblem::OutOfRange {
                    value: i64::from(byte),
                    at: format!("[{at}]"),
                    allowed: "t2d marks each target id with 0 or 1".to_string(),
                };
                return Err(TensorFileError::tensor(path, T2D, problem).into());
            }
            t2d.push(byte == 1);
        }
        let map = Self { d2t, t2d };
        map.check_consistent(path)?;
        Ok(map)
    }

    /// `t2d`'s selected ids, ascending, equal `d2t[i] + i`.
    fn check_consistent(&self, path: &Path) -> Result<(), VocabMapError> {
        let inconsistent = |detail: String| VocabMapError::Inconsistent {
            path: path.to_path_buf(),
            detail,
        };
        let selected = self.t2d.iter().filter(|&&b| b).count();
        if selected != self.draft_vocab() {
            return Err(inconsistent(format!(
                "`t2d` selects {selected} ids, `d2t` has {} entries",
                self.draft_vocab()
            )));
        }
        let ids = self
            .t2d
            .iter()
            .enumerate()
            .filter(|(_, b)| **b)
            .map(|(id, _)| id);
        for (draft, (&offset, id)) in self.d2t.iter().zip(ids).enumerate() {
            if draft as i64 + offset != id as i64 {
                return Err(inconsistent(format!(
                    "d2t[{draft}] = {offset} maps draft id {draft} to target id {}, the {draft}th id `t2d` \
                     selects is {id}",
                    draft as i64 + offset
                )));
            }
        }
        Ok(())
    }
}

/// The length of tensor `name`, which must be rank 1 of one of `dtypes` (and `expected.0` long, the plan's
/// `expected.1`).
fn rank1(
    file: &TensorFile,
    name: &str,
    dtypes: &[Dtype],
    in_words: &'static str,
    expected: Option<(usize, &str)>,
) -> Result<usize, TensorFileError> {
    let info = file.require(name)?;
    let problem = if !dtypes.contains(&info.dtype) {
        TensorProblem::WrongDtype {
            found: info.dtype,
            expected: in_words,
        }
    } else if info.shape.len() != 1 {
        TensorProblem::WrongRank {
            found: info.shape.len(),
            shape: info.shape.clone(),
            expected: 1,
        }
    } else {
        match expected {
            Some((len, what)) if info.shape[0] != len => TensorProblem::WrongShape {
                found: info.shape.clone(),
                expected: format!("[{len}] (the plan's {what})"),
            },
            _ => return Ok(info.shape[0]),
        }
    };
    Err(TensorFileError::tensor(file.path(), name, problem))
}

/// The draft vocabulary a run of `plan` trains with: the file `given` (the drafter's `vocab_map`) checked against
/// the plan's `draft_vocab` and `vocab`; without one, the identity when the draft vocabulary is the whole target
/// vocabulary (SpecForge installs no map then; its rule would give the identity too), else SpecForge's rule over
/// the counts of the plan's source ([`count_source_tokens`], refused for a stream).
///
/// # Errors
/// [`VocabMapError`]: not an `eagle3` plan, an unreadable or mismatched file, a source that cannot be counted.
pub fn resolve_vocab_map(plan: &Plan, given: Option<&Path>) -> Result<VocabMap, VocabMapError> {
    let Some(spec) = plan.model.spec.as_eagle3() else {
        return Err(VocabMapError::NotEagle3 {
            family: plan.model.spec.kind(),
        });
    };
    match given {
        Some(path) => VocabMap::read(path, Some((spec.draft_vocab, spec.vocab))),
        None if spec.draft_vocab == spec.vocab => Ok(VocabMap::identity(spec.vocab)),
        None => {
            let (counts, _) = count_source_tokens(plan, None)?;
            VocabMap::from_counts(&counts, spec.draft_vocab)
        }
    }
}

/// Counts the loss-masked tokens of `plan`'s source: for files, every sequence of one epoch in file order (the
/// first `batches` planned batches when given), reading ids and masks only; for a synthetic target, its first
/// `batches` batches ([`SYNTHETIC_COUNT_BATCHES`] when `None`, at most [`MAX_SYNTHETIC_COUNT_BATCHES`]), the ones a
/// run trains on first. Returns the counts and the batches counted.
///
/// # Errors
/// [`VocabMapError::StreamSource`] for a stream, [`VocabMapError::TooManySyntheticBatches`] above the bound; the
/// source's errors (files named) otherwise.
pub fn count_source_tokens(
    plan: &Plan,
    batches: Option<u64>,
) -> Result<(TokenCounts, u64), VocabMapError> {
    let vocab = plan.target.vocab;
    let mut counts = TokenCounts::new(vocab);
    let shapes = BucketShapes::from_plan(plan);
    match &plan.target.source {
        SourceSpec::Stream { .. } => Err(VocabMapError::StreamSource),
        SourceSpec::Safetensors { pattern, .. } => {
            let dataset = SafetensorsDataset::open(pattern, &plan.target, &shapes)?;
            let limit = batches.map(|b| usize::try_from(b).unwrap_or(usize::MAX));
            dataset.visit_token_rows(limit, |path, ids, mask| {
                counts.add_sequence(ids, mask).map_err(|e| {
                    let problem = TensorProblem::OutOfRange {
                        value: e.id,
                        at: format!("[{}] of a sequence", e.position),
                        allowed: format!("token ids must lie in 0..{vocab}"),
                    };
                    TensorFileError::tensor(path, crate::source::safetensors::INPUT_IDS, problem)
                        .into()
                })
            })?;
            let counted = limit.map_or(dataset.batches(), |l| l.min(dataset.batches()));
            Ok((counts, counted as u64))
        }
        SourceSpec::Synthetic {
            seed,
            min_len,
            max_len,
        } => {
            let batches = batches.unwrap_or(SYNTHETIC_COUNT_BATCHES);
            if batches > MAX_SYNTHETIC_COUNT_BATCHES {
                return Err(VocabMapError::TooManySyntheticBatches { asked: batches });
            }
            let target = SyntheticTarget::new(
                *seed,
                vocab,
                plan.target.hidden,
                plan.target.tap_layers.len(),
            )?;
            let mut source = SyntheticSource::new(
                std::sync::Arc::new(target),
                &shapes,
                *min_len..*max_len,
                0,
                1,
            )?;
            let mut batch = shapes.buffer();
            let mut ids = Vec::new();
            for _ in 0..batches {
                let bucket = source
                    .next_bucket()?
                    .expect("a synthetic stream never ends");
                shapes.shape_for(&mut batch, bucket);
                source.fill_next(&mut batch)?;
                for s in 0..batch.sequences {
                    let rows = s * batch.padded_len..(s + 1) * batch.padded_len;
                    ids.clear();
                    ids.extend(
                        batch.input_ids[rows.clone()]
                            .iter()
                            .map(|&id| i64::from(id)),
                    );
                    counts
                        .add_sequence(&ids, &batch.loss_mask[rows])
                        .expect("synthetic ids lie in the vocabulary");
                }
            }
            Ok((counts, batches))
        }
    }
}

/// How much of the counted mass the draft vocabulary covers (SpecForge prints it as the "top N token frequency
/// ratio"); 0 when nothing was counted.
pub fn coverage(counts: &TokenCounts, map: &VocabMap) -> f64 {
    let total = counts.total();
    if total == 0 {
        return 0.0;
    }
    let covered: u64 = map.target_ids().map(|id| counts.count(id)).sum();
    covered as f64 / total as f64
}

/// The ids of `0..n` for which `counted` is false, in the order CPython 3.11 iterates `set(range(n)) - other`
/// where `other` is a set of `other_len` ids: its `set_difference` copies `set(range(n))` (ascending) and
/// discards when `n >> 2 > other_len`, and otherwise adds the kept ids, ascending, to a new set whose open-
/// addressing table (8 slots, 9 linear probes where they fit, then `i = 5i + 1 + perturb`, `perturb >>= 5`;
/// resized to the power of two above `4·used` once `5·fill ≥ 3·mask`) decides the order.
fn cpython_difference_order(
    n: usize,
    other_len: usize,
    counted: impl Fn(usize) -> bool,
) -> Vec<usize> {
    let kept = (0..n).filter(|&id| !counted(id));
    if (n >> 2) > other_len {
        return kept.collect();
    }
    const EMPTY: usize = usize::MAX;
    const LINEAR_PROBES: usize = 9;
    fn insert(table: &mut [usize], key: usize) {
        let mask = table.len() - 1;
        let (mut i, mut perturb) = (key & mask, key);
        loop {
            let probes = if i + LINEAR_PROBES <= mask {
                LINEAR_PROBES
            } else {
                0
            };
            if let Some(slot) = table[i..=i + probes].iter_mut().find(|s| **s == EMPTY) {
                *slot = key;
                return;
            }
            perturb >>= 5;
            i = (i.wrapping_mul(5).wrapping_add(1).wrapping_add(perturb)) & mask;
        }
    }
    let mut table = vec![EMPTY; 8];
    let mut fill = 0usize;
    for key in kept {
        insert(&mut table, key);
        fill += 1;
        if fill * 5 >= (table.len() - 1) * 3 {
            let min_used = if fill > 50_000 { fill * 2 } else { fill * 4 };
            let mut size = 8;
            while size <= min_used {
                size <<= 1;
            }
            let old = std::mem::replace(&mut table, vec![EMPTY; size]);
            for key in old.into_iter().filter(|&k| k != EMPTY) {
                insert(&mut table, key);
            }
        }
    }
    table.into_iter().filter(|&k| k != EMPTY).collect()
}
