//! EAGLE-3's draft vocabulary (`t2d`/`d2t`): SpecForge's rule on hand-computed cases, on cases whose expected
//! maps SpecForge's own `process_token_dict_to_mappings` produced, against a line-by-line transcription of that
//! function on random data, and the file's round trip and refusals.

mod source_support;

use std::collections::HashMap;

use draftpipe_compiler::plan::{Eagle3Spec, ModelPlan, Plan, SourceSpec};
use draftpipe_runtime::model::eagle3::vocab::{
    CountError, SYNTHETIC_COUNT_BATCHES, TokenCounts, VocabMap, VocabMapError, count_source_tokens,
    coverage, resolve_vocab_map,
};
use draftpipe_runtime::tensor_file::TensorProblem;
use proptest::prelude::*;
use safetensors::Dtype;
use source_support::{temp_dir, write_file};

/// Counts of `sequences` (`(ids, mask)`) over a vocabulary of `vocab`.
fn counted(vocab: usize, sequences: &[(&[i64], &[u8])]) -> TokenCounts {
    let mut counts = TokenCounts::new(vocab);
    for (ids, mask) in sequences {
        counts.add_sequence(ids, mask).unwrap();
    }
    counts
}

fn used(map: &VocabMap) -> Vec<usize> {
    map.target_ids().collect()
}

#[test]
fn only_loss_masked_tokens_are_counted_and_the_most_common_are_kept() {
    // Masked: 4 ×3, 1 ×2, 9 ×1; the unmasked 7s never count however many there are.
    let counts = counted(
        12,
        &[
            (&[7, 4, 4, 1, 7, 7], &[0, 1, 1, 1, 0, 0]),
            (&[4, 9, 1, 7], &[1, 1, 1, 0]),
        ],
    );
    assert_eq!(
        (
            counts.count(4),
            counts.count(1),
            counts.count(9),
            counts.count(7)
        ),
        (3, 2, 1, 0)
    );
    assert_eq!(counts.distinct(), 3);
    let map = VocabMap::from_counts(&counts, 2).unwrap();
    assert_eq!(used(&map), [1, 4]);
    // Sorted ascending, d2t is the offset: draft 0 → 1 (offset 1), draft 1 → 4 (offset 3).
    assert_eq!(map.d2t, [1, 3]);
    let selected: Vec<usize> = (0..12).filter(|&t| map.t2d[t]).collect();
    assert_eq!(selected, [1, 4]);
    assert_eq!(map.draft_ids()[4], Some(1));
    assert_eq!(map.draft_ids()[9], None);
    assert!((coverage(&counts, &map) - 5.0 / 6.0).abs() < 1e-12);
}

#[test]
fn ties_go_to_the_earlier_sequence_then_the_smaller_id() {
    // 8 and 3 both once in sequence 0 (3 first: a sequence adds its ids ascending), 2 once in sequence 1.
    let counts = counted(10, &[(&[8, 3], &[1, 1]), (&[2, 5, 5], &[1, 1, 1])]);
    assert_eq!(used(&VocabMap::from_counts(&counts, 2).unwrap()), [3, 5]);
    assert_eq!(used(&VocabMap::from_counts(&counts, 3).unwrap()), [3, 5, 8]);
}

#[test]
fn too_few_distinct_tokens_are_padded_with_the_smallest_missing_ids() {
    let counts = counted(10, &[(&[7, 7, 3], &[1, 1, 1])]);
    let map = VocabMap::from_counts(&counts, 5).unwrap();
    assert_eq!(used(&map), [0, 1, 2, 3, 7]);
    assert_eq!(map.d2t, [0, 0, 0, 0, 3]);
    // Nothing counted at all: the first ids.
    let map = VocabMap::from_counts(&TokenCounts::new(6), 3).unwrap();
    assert_eq!(used(&map), [0, 1, 2]);
}

#[test]
fn the_whole_vocabulary_is_the_identity_map() {
    let counts = counted(6, &[(&[5, 5, 1], &[1, 1, 1])]);
    assert_eq!(
        VocabMap::from_counts(&counts, 6).unwrap(),
        VocabMap::identity(6)
    );
}

#[test]
fn sizes_and_ids_out_of_range_are_refused() {
    let counts = TokenCounts::new(4);
    for draft in [0, 5] {
        let err = VocabMap::from_counts(&counts, draft).unwrap_err();
        assert!(matches!(err, VocabMapError::Sizes { draft: d, target: 4 } if d == draft));
    }
    let mut counts = TokenCounts::new(4);
    let err = counts.add_sequence(&[1, 4], &[1, 1]).unwrap_err();
    assert_eq!(
        err,
        CountError {
            id: 4,
            position: 1,
            vocab: 4
        }
    );
    assert!(counts.add_sequence(&[-1], &[1]).is_err());
    // A refused sequence counts nothing; an unmasked bad id is not looked at (SpecForge selects first).
    assert_eq!(counts.distinct(), 0);
    counts.add_sequence(&[9, 2], &[0, 1]).unwrap();
    assert_eq!(counts.distinct(), 1);
}

/// Cases whose expected maps came from SpecForge's `process_token_dict_to_mappings` itself
/// (`specforge/data/preprocessing.py` at the mirrored HEAD, run with Python 3.11.7 and torch 2.15 on counts made
/// as `generate_vocab_mapping_file` makes them: `ids[mask == 1].unique(return_counts=True)` per sequence).
#[test]
fn maps_equal_the_ones_specforge_computed() {
    let counts = counted(
        12,
        &[
            (&[5, 9, 5, 2, 7], &[1, 1, 1, 0, 1]),
            (&[2, 2, 9, 3], &[1, 1, 0, 1]),
        ],
    );
    assert_eq!(VocabMap::from_counts(&counts, 3).unwrap().d2t, [2, 4, 5]);

    let counts = counted(64, &[(&[40, 41, 42, 1], &[1, 1, 1, 1])]);
    assert_eq!(
        VocabMap::from_counts(&counts, 8).unwrap().d2t,
        [0, 0, 0, 0, 0, 35, 35, 35]
    );

    // 31 distinct ids, 30 of them below draft_vocab = 32 and 44 above: 5 and 13 are missing, one is needed,
    // and CPython's set iterates 13 before 5 (13 & 7 collides with 5 in the 8-slot table and probes to slot
    // 2), so SpecForge pads with 13, not the smaller 5.
    let first: [i64; 15] = [24, 23, 7, 15, 1, 20, 6, 31, 26, 3, 17, 18, 9, 28, 22];
    let second: [i64; 16] = [14, 44, 29, 16, 10, 25, 4, 21, 8, 2, 30, 11, 0, 19, 12, 27];
    let counts = counted(64, &[(&first, &[1; 15]), (&second, &[1; 16])]);
    let map = VocabMap::from_counts(&counts, 32).unwrap();
    let mut expected = vec![0i64; 5];
    expected.extend([1; 26]);
    expected.push(13);
    assert_eq!(map.d2t, expected);
    assert!(map.t2d[13] && !map.t2d[5] && map.t2d[44]);
}

/// SpecForge's counting and `process_token_dict_to_mappings`, line by line: a `Counter` as an insertion-
/// ordered list, `most_common(n)` as a stable sort by descending count. Padding iterates the missing ids
/// ascending, which is CPython's order whenever every missing id is needed (all counted ids below `draft`);
/// the generator below keeps to that case when it pads, and the test above covers the other.
fn specforge_transcribed(draft: usize, sequences: &[(Vec<i64>, Vec<u8>)]) -> Vec<i64> {
    let mut counter: Vec<(i64, u64)> = Vec::new();
    let mut index: HashMap<i64, usize> = HashMap::new();
    for (ids, mask) in sequences {
        let mut masked: Vec<i64> = ids
            .iter()
            .zip(mask)
            .filter(|(_, m)| **m == 1)
            .map(|(i, _)| *i)
            .collect();
        masked.sort();
        let mut unique: Vec<(i64, u64)> = Vec::new();
        for id in masked {
            match unique.last_mut() {
                Some((last, n)) if *last == id => *n += 1,
                _ => unique.push((id, 1)),
            }
        }
        for (id, n) in unique {
            let at = *index.entry(id).or_insert_with(|| {
                counter.push((id, 0));
                counter.len() - 1
            });
            counter[at].1 += n;
        }
    }
    if counter.len() < draft {
        for token in 0..draft as i64 {
            if let std::collections::hash_map::Entry::Vacant(entry) = index.entry(token) {
                entry.insert(counter.len());
                counter.push((token, 0));
                if counter.len() >= draft {
                    break;
                }
            }
        }
    }
    let mut top = counter.clone();
    top.sort_by_key(|&(_, count)| std::cmp::Reverse(count));
    let mut used: Vec<i64> = top[..draft].iter().map(|(id, _)| *id).collect();
    used.sort();
    (0..used.len()).map(|i| used[i] - i as i64).collect()
}

/// `(vocab, draft_vocab, sequences of (ids, mask))`.
type Case = (usize, usize, Vec<(Vec<i64>, Vec<u8>)>);

fn sequences_strategy() -> impl Strategy<Value = Case> {
    (8usize..40).prop_flat_map(|vocab| {
        (1..=vocab, any::<bool>()).prop_flat_map(move |(draft, low_only)| {
            // Ids from a narrow range make ties and padding likely; `low_only` keeps padding order-free.
            let top = if low_only { draft } else { vocab } as i64;
            let sequence = prop::collection::vec((0..top, 0u8..2), 0..12)
                .prop_map(|pairs| pairs.into_iter().unzip::<_, _, Vec<i64>, Vec<u8>>());
            (
                Just(vocab),
                Just(draft),
                prop::collection::vec(sequence, 0..6),
            )
        })
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]
    #[test]
    fn equals_specforge_transcribed((vocab, draft, sequences) in sequences_strategy()) {
        let mut counts = TokenCounts::new(vocab);
        for (ids, mask) in &sequences {
            counts.add_sequence(ids, mask).unwrap();
        }
        let padded_out_of_order = counts.distinct() < draft
            && (draft..vocab).any(|id| counts.count(id) > 0);
        prop_assume!(!padded_out_of_order);
        let map = VocabMap::from_counts(&counts, draft).unwrap();
        prop_assert_eq!(&map.d2t, &specforge_transcribed(draft, &sequences));
        prop_assert_eq!(map.t2d.iter().filter(|&&b| b).count(), draft);
    }
}

#[test]
fn the_file_round_trips_and_is_checked_against_the_plan() {
    let dir = temp_dir("eagle3-vocab-roundtrip");
    let path = dir.join("vocab.safetensors");
    let counts = counted(40, &[(&[3, 3, 17, 39, 8], &[1, 1, 1, 1, 0])]);
    let map = VocabMap::from_counts(&counts, 5).unwrap();
    map.write(&path).unwrap();
    assert_eq!(VocabMap::read(&path, Some((5, 40))).unwrap(), map);
    assert_eq!(VocabMap::read(&path, None).unwrap(), map);
    // The stored dtypes are the engines': d2t int64, t2d bool.
    let bytes = std::fs::read(&path).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(file.tensor("d2t").unwrap().dtype(), Dtype::I64);
    assert_eq!(file.tensor("t2d").unwrap().dtype(), Dtype::BOOL);

    let err = VocabMap::read(&path, Some((6, 40)))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("vocab.safetensors") && err.contains("`d2t`") && err.contains("draft_vocab"),
        "{err}"
    );
    let err = VocabMap::read(&path, Some((5, 41)))
        .unwrap_err()
        .to_string();
    assert!(err.contains("`t2d`") && err.contains("[41]"), "{err}");
}

/// `path`'s read error, as text.
fn read_error(
    name: &str,
    tensors: &[(&str, Dtype, Vec<usize>, Vec<f64>)],
) -> (VocabMapError, String) {
    let dir = temp_dir(&format!("eagle3-vocab-{name}"));
    let path = dir.join(format!("{name}.safetensors"));
    write_file(&path, tensors);
    let err = VocabMap::read(&path, None).unwrap_err();
    let text = err.to_string();
    assert!(text.contains(&format!("{name}.safetensors")), "{text}");
    (err, text)
}

#[test]
fn broken_files_are_refused_naming_the_file_and_tensor() {
    let t2d = ("t2d", Dtype::BOOL, vec![6], vec![0., 1., 0., 1., 0., 0.]);
    let d2t = ("d2t", Dtype::I64, vec![2], vec![1., 2.]);

    let (_, text) = read_error("missing", std::slice::from_ref(&t2d));
    assert!(text.contains("`d2t`") && text.contains("missing"), "{text}");

    let (_, text) = read_error(
        "float",
        &[t2d.clone(), ("d2t", Dtype::F32, vec![2], vec![1., 2.])],
    );
    assert!(text.contains("`d2t`") && text.contains("I64"), "{text}");

    let (_, text) = read_error(
        "rank",
        &[t2d.clone(), ("d2t", Dtype::I64, vec![1, 2], vec![1., 2.])],
    );
    assert!(text.contains("`d2t`") && text.contains("rank 2"), "{text}");

    // U8 is accepted (0/1 as numpy writes a mask); a wider integer is not.
    let (_, text) = read_error(
        "i16",
        &[("t2d", Dtype::I16, vec![6], vec![0.; 6]), d2t.clone()],
    );
    assert!(
        text.contains("`t2d`") && text.contains("BOOL or U8"),
        "{text}"
    );

    let (err, _) = read_error(
        "bytes",
        &[
            ("t2d", Dtype::BOOL, vec![6], vec![0., 2., 0., 1., 0., 0.]),
            d2t.clone(),
        ],
    );
    assert!(
        matches!(err, VocabMapError::File(e) if matches!(e.problem, TensorProblem::OutOfRange { value: 2, .. }))
    );

    // t2d selects 1 and 3; d2t [1, 2] maps to 1 and 3: consistent. Break it both ways.
    let (_, text) = read_error(
        "count",
        &[
            ("t2d", Dtype::BOOL, vec![6], vec![0., 1., 0., 1., 1., 0.]),
            d2t.clone(),
        ],
    );
    assert!(
        text.contains("selects 3 ids") && text.contains("2 entries"),
        "{text}"
    );
    let (_, text) = read_error(
        "offset",
        &[t2d.clone(), ("d2t", Dtype::I64, vec![2], vec![1., 3.])],
    );
    assert!(
        text.contains("d2t[1] = 3") && text.contains("target id 4"),
        "{text}"
    );

    // Other tensors (an export's weights beside the maps) are not a problem.
    let dir = temp_dir("eagle3-vocab-extra");
    let path = dir.join("model.safetensors");
    write_file(
        &path,
        &[
            t2d,
            d2t,
            ("fc.weight", Dtype::F32, vec![2], vec![0.5, 0.25]),
        ],
    );
    assert_eq!(VocabMap::read(&path, Some((2, 6))).unwrap().d2t, [1, 2]);
}

/// An `eagle3` plan over `source` with a target of `vocab` tokens, hidden 4, three taps, buckets 8 and 16 of
/// 32 tokens a batch, and a draft vocabulary of `draft_vocab`.
fn eagle3_plan(source: SourceSpec, vocab: usize, draft_vocab: usize) -> Plan {
    let mut plan = source_support::plan(source, vocab, 4, 3, &[8, 16], 32, 1);
    plan.model = ModelPlan::new(Eagle3Spec {
        hidden: 4,
        taps: 3,
        tap_layers: vec![1, 2, 3],
        vocab,
        draft_vocab,
        heads: 2,
        kv_heads: 1,
        head_dim: 2,
        intermediate: 8,
        ttt: 2,
        rope_theta: 10_000.0,
        rms_norm_eps: 1e-6,
    });
    plan
}

fn files_source(pattern: &std::path::Path) -> SourceSpec {
    SourceSpec::Safetensors {
        pattern: pattern.display().to_string(),
        epochs: 3,
        shuffle_seed: Some(7),
    }
}

/// A data file of `rows` sequences of 6 tokens: ids and mask as given, hidden states and the final-norm output
/// (which an eagle3 plan's files must carry) 0.5.
fn data_file(path: &std::path::Path, ids: &[f64], mask: &[f64]) {
    let rows = ids.len() / 6;
    write_file(
        path,
        &[
            (
                "hidden_states",
                Dtype::F32,
                vec![rows, 6, 12],
                vec![0.5; rows * 72],
            ),
            ("input_ids", Dtype::I64, vec![rows, 6], ids.to_vec()),
            ("loss_mask", Dtype::U8, vec![rows, 6], mask.to_vec()),
            (
                "last_hidden_states",
                Dtype::F32,
                vec![rows, 6, 4],
                vec![0.5; rows * 24],
            ),
        ],
    );
}

#[test]
fn a_files_source_is_counted_once_over_its_masked_tokens() {
    let dir = temp_dir("eagle3-vocab-files");
    // Two files, three sequences; the masked-out 9s and the all-zero row never count, epochs and shuffle don't
    // repeat anything.
    #[rustfmt::skip]
    data_file(&dir.join("a.safetensors"),
        &[1., 2., 2., 9., 9., 0., /**/ 3., 3., 3., 3., 3., 3.],
        &[1., 1., 1., 0., 0., 0., /**/ 0., 0., 0., 0., 0., 0.]);
    data_file(
        &dir.join("b.safetensors"),
        &[5., 2., 1., 1., 9., 4.],
        &[1., 1., 1., 1., 0., 1.],
    );
    let plan = eagle3_plan(files_source(&dir.join("*.safetensors")), 10, 3);
    let (counts, batches) = count_source_tokens(&plan, None).unwrap();
    let by_id: Vec<u64> = (0..10).map(|id| counts.count(id)).collect();
    assert_eq!(by_id, [0, 3, 3, 0, 1, 1, 0, 0, 0, 0]);
    assert_eq!(
        batches, 1,
        "two sequences of ≤ 8 tokens make one batch of bucket 8 (4 sequences)"
    );
    let map = resolve_vocab_map(&plan, None).unwrap();
    // 1 and 2 (3 each), then the tie 4 / 5: the second sequence adds 1, 2, 4, 5 ascending, so 4 was inserted
    // first and wins.
    assert_eq!(used(&map), [1, 2, 4]);

    // `--batches` limits what is counted; a given map is read and checked against the plan's sizes.
    let (_, batches) = count_source_tokens(&plan, Some(5)).unwrap();
    assert_eq!(batches, 1);
    let path = dir.join("vocab.safetensors");
    map.write(&path).unwrap();
    assert_eq!(resolve_vocab_map(&plan, Some(&path)).unwrap(), map);
    let other = eagle3_plan(files_source(&dir.join("*.safetensors")), 10, 4);
    let err = resolve_vocab_map(&other, Some(&path))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("vocab.safetensors") && err.contains("`d2t`") && err.contains("[4]"),
        "{err}"
    );
}

#[test]
fn a_synthetic_source_is_counted_over_its_first_batches() {
    let source = SourceSpec::Synthetic {
        seed: 3,
        min_len: 4,
        max_len: 16,
    };
    let plan = eagle3_plan(source, 50, 20);
    let (counts, batches) = count_source_tokens(&plan, Some(40)).unwrap();
    assert_eq!(batches, 40);
    let (again, _) = count_source_tokens(&plan, Some(40)).unwrap();
    assert_eq!(
        used(&VocabMap::from_counts(&counts, 20).unwrap()),
        used(&VocabMap::from_counts(&again, 20).unwrap())
    );
    // Every token of a synthetic sequence is a label: 40 batches of 2 or 4 sequences of 4..16 tokens.
    assert!(
        counts.total() >= 40 * 2 * 4 && counts.total() < 40 * 4 * 16,
        "{}",
        counts.total()
    );
    let (default, batches) = count_source_tokens(&plan, None).unwrap();
    assert_eq!(batches, SYNTHETIC_COUNT_BATCHES);
    assert!(default.total() > counts.total());
    // The whole vocabulary needs no counting.
    assert_eq!(
        resolve_vocab_map(&eagle3_plan(plan.target.source.clone(), 50, 50), None).unwrap(),
        VocabMap::identity(50)
    );
}

#[test]
fn a_stream_and_other_families_are_refused() {
    let stream = SourceSpec::Stream {
        listen: "127.0.0.1:0".into(),
        token_env: None,
        max_message_bytes: 1 << 20,
        read_timeout_ms: 1000,
    };
    let err = resolve_vocab_map(&eagle3_plan(stream, 10, 4), None).unwrap_err();
    assert!(matches!(err, VocabMapError::StreamSource), "{err}");
    assert!(err.to_string().contains("vocab_map"));
    let mlp = source_support::plan(
        files_source(std::path::Path::new("none")),
        10,
        4,
        3,
        &[8],
        32,
        1,
    );
    let err = resolve_vocab_map(&mlp, None).unwrap_err();
    assert!(
        matches!(err, VocabMapError::NotEagle3 { family: "mlp" }),
        "{err}"
    );
}
