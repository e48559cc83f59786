//! `last_hidden_states`, the target's final-norm output an `eagle3` drafter's teacher reads: files, the
//! synthetic target and the stream carry it when the plan's drafter reads it (checked like `hidden_states`,
//! errors naming the file or message and the tensor), and not a byte of it otherwise.

mod source_support;
mod stream_support;

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::Duration;

use draftpipe_compiler::plan::{Eagle3Spec, ModelPlan, Plan, SourceSpec};
use draftpipe_runtime::batch::HsBatch;
use draftpipe_runtime::source::stream::wire::Reply;
use draftpipe_runtime::source::{
    BatchPool, BucketShapes, HsSource, Producer, SourceError, StreamConfig, StreamStatus,
    SyntheticSource, SyntheticTarget, open_sources, open_stream,
};
use draftpipe_runtime::tensor_file::TensorProblem;
use safetensors::Dtype;
use source_support::{temp_dir, write_file};
use stream_support::{Client, LAYOUTS, batch};

const VOCAB: usize = 50;
const HIDDEN: usize = 4;
const TAPS: usize = 3;
const DIN: usize = HIDDEN * TAPS;

/// `plan` with an `eagle3` drafter (which reads `last_hidden_states`).
fn eagle3(mut plan: Plan) -> Plan {
    plan.model = ModelPlan::new(Eagle3Spec {
        hidden: HIDDEN,
        taps: TAPS,
        tap_layers: vec![0, 1, 2],
        vocab: VOCAB,
        draft_vocab: 20,
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

fn plan(source: SourceSpec) -> Plan {
    source_support::plan(source, VOCAB, HIDDEN, TAPS, &[8, 16], 32, 1)
}

fn files(pattern: &Path) -> SourceSpec {
    SourceSpec::Safetensors {
        pattern: pattern.display().to_string(),
        epochs: 1,
        shuffle_seed: None,
    }
}

/// The value of element `k` of token `t` of row `r` in `last_hidden_states` (bf16-exact).
fn last_value(r: usize, t: usize, k: usize) -> f64 {
    ((r * 29 + t * 7 + k * 3) % 37) as f64 / 4.0 - 4.5
}

/// A file of 2 rows of 6 tokens whose loss masks end at tokens 6 and 3 (kept 6 and 4 long for an eagle3
/// drafter, which reads the token after the last label; 6 and 3 for the others), with `last` as its
/// `last_hidden_states`.
fn data_file(path: &Path, last: Option<(Dtype, Vec<usize>, Vec<f64>)>) {
    let mut tensors = vec![
        (
            "hidden_states",
            Dtype::F32,
            vec![2, 6, DIN],
            vec![0.25; 2 * 6 * DIN],
        ),
        (
            "input_ids",
            Dtype::I64,
            vec![2, 6],
            (0..12).map(f64::from).collect(),
        ),
        (
            "loss_mask",
            Dtype::U8,
            vec![2, 6],
            vec![1., 1., 1., 1., 1., 1., 1., 1., 1., 0., 0., 0.],
        ),
    ];
    if let Some((dtype, shape, values)) = last {
        tensors.push(("last_hidden_states", dtype, shape, values));
    }
    write_file(path, &tensors);
}

fn good_last() -> (Dtype, Vec<usize>, Vec<f64>) {
    let values = (0..2 * 6 * HIDDEN)
        .map(|i| last_value(i / 24, i / HIDDEN % 6, i % HIDDEN))
        .collect();
    (Dtype::BF16, vec![2, 6, HIDDEN], values)
}

/// The one batch of a single-file plan, into a buffer poisoned with NaN.
fn only_batch(plan: &Plan) -> Result<HsBatch, SourceError> {
    let shapes = BucketShapes::from_plan(plan);
    let mut source = open_sources(plan)?.remove(0);
    let bucket = source.next_bucket()?.unwrap();
    let mut batch = shapes.buffer();
    shapes.shape_for(&mut batch, bucket);
    batch.hs.fill(f32::NAN);
    if let Some(last) = batch.last_hidden_states.as_mut() {
        last.fill(f32::NAN);
    }
    source.fill_next(&mut batch)?;
    Ok(batch)
}

#[test]
fn files_carry_last_hidden_states_for_an_eagle3_drafter_and_nothing_for_the_others() {
    let dir = temp_dir("last-hidden-files");
    let path = dir.join("a.safetensors");
    data_file(&path, Some(good_last()));
    let batch = only_batch(&eagle3(plan(files(&path)))).unwrap();
    assert_eq!(
        (batch.padded_len, batch.sequences, batch.last_hidden()),
        (8, 4, Some(HIDDEN))
    );
    let last = batch.last_hidden_states.as_ref().unwrap();
    for slot in 0..4 {
        for t in 0..8 {
            for k in 0..HIDDEN {
                let kept = [6, 4, 0, 0][slot];
                let want = if t < kept {
                    last_value(slot, t, k) as f32
                } else {
                    0.0
                };
                assert_eq!(
                    last.get(((slot * 8) + t) * HIDDEN + k),
                    want,
                    "slot {slot} token {t} dim {k}"
                );
            }
        }
    }
    // The same file for an mlp: the tensor is ignored and the batch carries none.
    let batch = only_batch(&plan(files(&path))).unwrap();
    assert!(batch.last_hidden_states.is_none());
    assert_eq!(
        batch.allocated_bytes(),
        BucketShapes::from_plan(&plan(files(&path)))
            .buffer()
            .allocated_bytes()
    );
}

/// SpecForge's offline EAGLE-3 shifts the ids and the teacher left by one, so the row of a sequence's last label
/// reads the next token and its final hidden state: an eagle3 plan keeps that position (up to `S`, the first row's
/// mask reaching its end), and another drafter, which reads nothing after the last label, pads it.
#[test]
fn an_eagle3_sequence_keeps_the_token_after_its_last_label() {
    let dir = temp_dir("last-hidden-after-label");
    let path = dir.join("a.safetensors");
    data_file(&path, Some(good_last()));
    let eagle = only_batch(&eagle3(plan(files(&path)))).unwrap();
    let mlp = only_batch(&plan(files(&path))).unwrap();
    // Row 1 holds ids 6..12 and its mask ends after token 2; token 3 is id 9.
    let ids = |batch: &HsBatch, slot: usize| batch.input_ids[slot * 8..slot * 8 + 8].to_vec();
    assert_eq!(ids(&eagle, 0), [0, 1, 2, 3, 4, 5, 0, 0]);
    assert_eq!(ids(&eagle, 1), [6, 7, 8, 9, 0, 0, 0, 0]);
    assert_eq!(ids(&mlp, 1), [6, 7, 8, 0, 0, 0, 0, 0]);
    let last = eagle.last_hidden_states.as_ref().unwrap();
    assert_eq!(last.get((8 + 3) * HIDDEN), last_value(1, 3, 0) as f32);
    assert_eq!(last.get((8 + 4) * HIDDEN), 0.0);
    // The kept token is no label: the loss mask stays 0 there.
    assert_eq!(eagle.loss_mask[8..16], [1, 1, 1, 0, 0, 0, 0, 0]);
}

/// The error opening (or reading) an eagle3 plan over a file with `last` as its `last_hidden_states`.
fn file_error(name: &str, last: Option<(Dtype, Vec<usize>, Vec<f64>)>) -> String {
    let dir = temp_dir(&format!("last-hidden-{name}"));
    let path = dir.join(format!("{name}.safetensors"));
    data_file(&path, last);
    let err = only_batch(&eagle3(plan(files(&path)))).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains(&format!("{name}.safetensors")) && text.contains("`last_hidden_states`"),
        "{text}"
    );
    if name == "nan" {
        assert!(
            matches!(&err, SourceError::File(e) if matches!(e.problem, TensorProblem::NonFinite { at: 13, .. })),
            "{err}"
        );
    }
    text
}

#[test]
fn bad_last_hidden_states_in_a_file_are_refused_naming_file_and_tensor() {
    assert!(file_error("missing", None).contains("missing tensor"));
    let (_, _, values) = good_last();
    assert!(
        file_error(
            "ints",
            Some((Dtype::I32, vec![2, 6, HIDDEN], values.clone()))
        )
        .contains("F32, BF16 or F16")
    );
    assert!(
        file_error(
            "rank",
            Some((Dtype::BF16, vec![12, HIDDEN], values.clone()))
        )
        .contains("rank 2")
    );
    let wide: Vec<f64> = vec![0.0; 2 * 6 * 8];
    let text = file_error("wide", Some((Dtype::BF16, vec![2, 6, 8], wide)));
    assert!(
        text.contains("[2, 6, 4]") && text.contains("final-norm output"),
        "{text}"
    );
    let mut nan = values;
    nan[13] = f64::NAN;
    file_error("nan", Some((Dtype::F32, vec![2, 6, HIDDEN], nan)));
}

#[test]
fn the_synthetic_targets_last_hidden_states_make_its_lm_head_predict_the_likeliest_next_token() {
    // The quickstart's target: hidden 64, vocabulary 512.
    let (vocab, hidden) = (512, 64);
    let source = SourceSpec::Synthetic {
        seed: 5,
        min_len: 8,
        max_len: 17,
    };
    let mut mlp = source_support::plan(source, vocab, hidden, TAPS, &[16], 64, 1);
    mlp.target.hs_dtype = Some(draftpipe_compiler::plan::HsDtype::F32);
    let mut reads = mlp.clone();
    reads.model = eagle3(plan(SourceSpec::Synthetic {
        seed: 5,
        min_len: 8,
        max_len: 17,
    }))
    .model;
    let target = Arc::new(SyntheticTarget::new(5, vocab, hidden, TAPS).unwrap());
    let lm_head = target.lm_head_table();
    let mut batches = Vec::new();
    for plan in [&mlp, &reads] {
        let shapes = BucketShapes::from_plan(plan);
        let mut source = SyntheticSource::new(target.clone(), &shapes, 8..17, 0, 1).unwrap();
        let mut batch = shapes.buffer();
        for _ in 0..8 {
            shapes.shape_for(&mut batch, source.next_bucket().unwrap().unwrap());
            source.fill_next(&mut batch).unwrap();
            batches.push(batch.clone());
        }
    }
    let (without, with) = batches.split_at(8);
    let (mut likeliest, mut successor, mut tokens) = (0, 0, 0);
    for (plain, full) in without.iter().zip(with) {
        // The tokens and hidden states are the stream the other families train on, unchanged.
        assert_eq!(
            (&plain.input_ids, &plain.hs, &plain.seq_lens),
            (&full.input_ids, &full.hs, &full.seq_lens)
        );
        assert!(plain.last_hidden_states.is_none());
        let last = full.last_hidden_states.as_ref().unwrap();
        for s in 0..full.sequences {
            for t in 0..full.padded_len {
                let at = s * full.padded_len + t;
                let row = last.to_f32_vec(at * hidden..(at + 1) * hidden);
                if t >= full.seq_lens[s] as usize {
                    assert!(row.iter().all(|&v| v == 0.0), "padding is zero");
                    continue;
                }
                let logit = |x: usize| -> f32 {
                    (0..hidden).map(|k| lm_head[x * hidden + k] * row[k]).sum()
                };
                let argmax = (0..vocab)
                    .max_by(|&a, &b| logit(a).total_cmp(&logit(b)))
                    .unwrap();
                let successors: Vec<u32> = (0..4)
                    .map(|k| target.successor(full.input_ids[at], k))
                    .collect();
                likeliest += usize::from(argmax as u32 == successors[0]);
                successor += usize::from(successors.contains(&(argmax as u32)));
                tokens += 1;
            }
        }
    }
    // Random embeddings blur the logits (module docs of the synthetic source): the argmax is one of the chain's
    // four successors nearly always, the likeliest one most often; chance would be 1 in 512.
    let counts = format!("likeliest {likeliest}, a successor {successor}, of {tokens}");
    assert!(
        successor * 100 >= tokens * 95 && likeliest * 2 >= tokens,
        "{counts}"
    );
}

#[test]
fn a_stream_asks_for_last_hidden_states_and_places_them_on_either_path() {
    for layout in LAYOUTS {
        let server = stream_server(true);
        let (reply, got) = exchange(server, |client| {
            let mut message = batch(2, 16, DIN, VOCAB, &[16, 9], 3);
            message.push(last_tensor(2, 16, None));
            let ack = client.send_in(layout, &message);
            assert!(ack.ok, "{layout:?}: {ack:?}");
        });
        assert!(
            reply.last_hidden_states,
            "the hello tells the producer to send them"
        );
        let got = got.expect("one full item");
        let last = got.last_hidden_states.as_ref().unwrap();
        for slot in 0..2 {
            for t in 0..16 {
                // The mask covers 9 tokens of the second row: an eagle3 drafter keeps the one after them.
                let kept = [16, 10][slot];
                for k in 0..HIDDEN {
                    let want = if t < kept {
                        last_value(slot, t, k) as f32
                    } else {
                        0.0
                    };
                    assert_eq!(
                        last.get((slot * 16 + t) * HIDDEN + k),
                        want,
                        "{layout:?} slot {slot} t {t}"
                    );
                }
            }
        }
    }
    // An mlp's stream neither asks for them nor carries them.
    let server = stream_server(false);
    let (reply, got) = exchange(server, |client| {
        assert!(client.send(&batch(2, 16, DIN, VOCAB, &[16, 9], 3)).ok);
    });
    assert!(!reply.last_hidden_states);
    assert!(got.unwrap().last_hidden_states.is_none());
}

#[test]
fn a_stream_message_without_good_last_hidden_states_is_refused_naming_the_tensor() {
    for layout in LAYOUTS {
        let server = stream_server(true);
        exchange(server, |client| {
            let reply = client.send_in(layout, &batch(2, 16, DIN, VOCAB, &[16, 9], 3));
            let error = reply.error.unwrap_or_default();
            assert!(
                error.contains("`last_hidden_states`") && error.contains("missing"),
                "{layout:?}: {error}"
            );
        });
        let server = stream_server(true);
        exchange(server, |client| {
            let mut message = batch(2, 16, DIN, VOCAB, &[16, 9], 3);
            message.push(last_tensor(2, 16, Some(70)));
            let reply = client.send_in(layout, &message);
            let error = reply.error.unwrap_or_default();
            assert!(
                error.contains("`last_hidden_states`")
                    && error.contains("non-finite")
                    && error.contains("element 70"),
                "{layout:?}: {error}"
            );
        });
    }
}

/// `[rows, seq, HIDDEN]` bf16 `last_hidden_states`, NaN at element `nan`.
fn last_tensor(
    rows: usize,
    seq: usize,
    nan: Option<usize>,
) -> (&'static str, Dtype, Vec<usize>, Vec<f64>) {
    let mut values: Vec<f64> = (0..rows * seq * HIDDEN)
        .map(|i| last_value(i / (seq * HIDDEN), i / HIDDEN % seq, i % HIDDEN))
        .collect();
    if let Some(at) = nan {
        values[at] = f64::NAN;
    }
    (
        "last_hidden_states",
        Dtype::BF16,
        vec![rows, seq, HIDDEN],
        values,
    )
}

/// A one-slot stream server (its producer, status and pool) for an eagle3 plan (`reads`) or an mlp.
type Server = (Producer, StreamStatus, BatchPool);

fn stream_server(reads: bool) -> Server {
    let source = SourceSpec::Stream {
        listen: "127.0.0.1:0".into(),
        token_env: None,
        max_message_bytes: 1 << 20,
        read_timeout_ms: 300,
    };
    let plan = if reads {
        eagle3(plan(source))
    } else {
        plan(source)
    };
    let shapes = BucketShapes::from_plan(&plan);
    let (mut sources, status) = open_stream(StreamConfig {
        listen: "127.0.0.1:0".into(),
        token: None,
        max_message_bytes: 1 << 20,
        read_timeout: Duration::from_millis(300),
        target: plan.target.clone(),
        shapes: shapes.clone(),
        producers: 1,
        log: Arc::new(|_: &str| {}),
    })
    .unwrap();
    let producer = Producer::new(Box::new(sources.remove(0)));
    (producer, status, BatchPool::new(shapes, 4).unwrap())
}

/// Connects to `server`, says hello, runs `talk`, then says done on a new connection (the first may have been
/// refused); returns the hello's reply and the first batch queued, if any.
fn exchange(server: Server, talk: impl FnOnce(&mut Client)) -> (Reply, Option<HsBatch>) {
    let (mut producer, status, pool) = server;
    let stop = AtomicBool::new(false);
    let (to_test, batches) = mpsc::channel::<HsBatch>();
    let address = status.address().to_string();
    let hello = Client::hello_for(HIDDEN, TAPS, VOCAB, "", "p0");
    let reply = std::thread::scope(|scope| {
        let (stop, pool) = (&stop, &pool);
        scope.spawn(move || {
            while let Ok(Some(batch)) = producer.next_batch(pool, stop) {
                to_test.send((*batch).clone()).unwrap();
                pool.give_back(batch).unwrap();
            }
        });
        let mut client = Client::connect(&address);
        let reply = client.hello(&hello);
        talk(&mut client);
        let mut closing = Client::connect(&address);
        assert!(closing.hello(&hello).ok);
        assert!(closing.done().done);
        stop.store(true, Ordering::Release);
        reply
    });
    (reply, batches.try_recv().ok())
}
