//! Loss masks that cannot fail silently: hand-made shards and stream messages with each kind of bad mask (all
//! ones, all zeros, a span that misses the end-of-turn token) are counted and named, a file source over
//! `max_bad_mask_share` is refused before its first batch, and a stream refuses the producer that goes over it
//! while the next producer still delivers.

mod source_support;
mod stream_support;

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use draftpipe_compiler::plan::{MaskChecks, Plan, SourceSpec};
use draftpipe_runtime::source::{
    BatchPool, BucketShapes, Producer, SourceError, StreamConfig, open_sources, open_stream,
};
use safetensors::Dtype;
use source_support::{temp_dir, write_file};
use stream_support::{Client, Layout, Tensors};

const VOCAB: usize = 50;
const HIDDEN: usize = 4;
const TAPS: usize = 2;
const DIN: usize = HIDDEN * TAPS;
const SEQ: usize = 8;
/// The end-of-turn token of these tests.
const END: f64 = 9.0;

/// Rows of ids and masks, each `SEQ` long, as `(ids, mask)`.
type Rows = Vec<([f64; SEQ], [f64; SEQ])>;

/// prompt prompt reply reply END pad pad pad: loss on the reply and its end token only.
const GOOD: ([f64; SEQ], [f64; SEQ]) = (
    [1., 2., 3., 4., END, 0., 0., 0.],
    [0., 0., 1., 1., 1., 0., 0., 0.],
);
/// The prompt trained on too.
const ALL_ONES: ([f64; SEQ], [f64; SEQ]) = (
    [1., 2., 3., 4., END, 0., 0., 0.],
    [1., 1., 1., 1., 1., 0., 0., 0.],
);
/// Tokens and no loss.
const ALL_ZEROS: ([f64; SEQ], [f64; SEQ]) = ([1., 2., 3., 4., END, 0., 0., 0.], [0.; SEQ]);
/// A reply cut before its end token.
const CUT: ([f64; SEQ], [f64; SEQ]) = (
    [1., 2., 3., 4., 5., 6., 7., 8.],
    [0., 0., 1., 1., 1., 1., 1., 1.],
);

fn tensors(rows: &Rows) -> Tensors {
    let n = rows.len();
    vec![
        (
            "hidden_states",
            Dtype::F32,
            vec![n, SEQ, DIN],
            vec![0.25; n * SEQ * DIN],
        ),
        (
            "input_ids",
            Dtype::I64,
            vec![n, SEQ],
            rows.iter().flat_map(|(ids, _)| ids.to_vec()).collect(),
        ),
        (
            "loss_mask",
            Dtype::U8,
            vec![n, SEQ],
            rows.iter().flat_map(|(_, mask)| mask.to_vec()).collect(),
        ),
    ]
}

fn shard(path: &Path, rows: &Rows) {
    write_file(path, &tensors(rows));
}

fn files_plan(pattern: &Path, masks: MaskChecks) -> Plan {
    let source = SourceSpec::Safetensors {
        pattern: pattern.to_string_lossy().into_owned(),
        epochs: 1,
        shuffle_seed: None,
    };
    let mut plan = source_support::plan(source, VOCAB, HIDDEN, TAPS, &[8], 32, 1);
    plan.target.masks = masks;
    plan
}

fn chat(max_bad_share: f64) -> MaskChecks {
    MaskChecks {
        end_of_turn: Some(END as u32),
        max_bad_share,
    }
}

fn refusal(plan: &Plan) -> draftpipe_runtime::source::MaskRefusal {
    match open_sources(plan) {
        Err(SourceError::BadMasks(refusal)) => *refusal,
        Err(other) => panic!("expected a mask refusal, got {other}"),
        Ok(_) => panic!("expected a mask refusal, the source opened"),
    }
}

#[test]
fn each_kind_of_bad_mask_in_a_shard_is_refused_before_training_by_file_and_row() {
    let dir = temp_dir("masks-kinds");
    let path = dir.join("chat.safetensors");
    shard(&path, &vec![GOOD, ALL_ONES, GOOD, ALL_ZEROS, CUT, GOOD]);
    let refusal = refusal(&files_plan(&path, chat(0.01)));
    let row = |r: usize| format!("{} row {r}", path.display());
    let report = &refusal.report;
    assert_eq!(report.all_ones.first_ids, [row(1)]);
    assert_eq!(report.all_zeros.first_ids, [row(3)]);
    assert_eq!(report.missing_end_of_turn.first_ids, [row(4)]);
    assert_eq!((report.sequences, report.bad_sequences), (6, 3));
    // Tokens up to each row's last label: 5 + 5 + 5 + 0 + 8 + 5; loss: 3 + 5 + 3 + 0 + 6 + 3.
    assert_eq!((report.tokens, report.loss_tokens), (28, 20));
    let message = refusal.to_string();
    for needle in [
        path.display().to_string(),
        "3 of 6 sequences (50.0%)".into(),
        "`max_bad_mask_share` = 0.01".into(),
        format!("all zeros 1 ({})", row(3)),
        format!("all ones 1 ({})", row(1)),
        format!("missing end of turn 1 ({})", row(4)),
    ] {
        assert!(message.contains(&needle), "{needle}: {message}");
    }
}

#[test]
fn a_refusal_names_the_files_with_bad_rows_only() {
    let dir = temp_dir("masks-files");
    shard(&dir.join("a.safetensors"), &vec![GOOD, ALL_ZEROS]);
    shard(&dir.join("b.safetensors"), &vec![GOOD, GOOD]);
    shard(&dir.join("c.safetensors"), &vec![CUT, GOOD]);
    let refusal = refusal(&files_plan(&dir.join("*.safetensors"), chat(0.2)));
    assert_eq!(
        refusal.data,
        format!(
            "{}, {}",
            dir.join("a.safetensors").display(),
            dir.join("c.safetensors").display()
        )
    );
    assert_eq!(refusal.report.bad_sequences, 2);
}

#[test]
fn within_the_bound_the_source_opens_and_reports_its_counts() {
    let dir = temp_dir("masks-within");
    let path = dir.join("chat.safetensors");
    shard(&path, &vec![GOOD, GOOD, GOOD, ALL_ZEROS]);
    // 1 of 4 is 25%: within a bound of 25%, over one of 24%.
    let sources = open_sources(&files_plan(&path, chat(0.25))).unwrap();
    let report = sources[0]
        .mask_probe()
        .expect("a file source has masks")
        .read();
    assert_eq!((report.sequences, report.bad_sequences), (4, 1));
    assert!(report.chat);
    assert!((report.loss_token_share - 9.0 / 15.0).abs() < 1e-12);
    refusal(&files_plan(&path, chat(0.24)));
}

#[test]
fn without_an_end_of_turn_token_only_all_zero_masks_count() {
    let dir = temp_dir("masks-text");
    let path = dir.join("text.safetensors");
    // Plain text is trained on every token: all ones and a last token that is no END are what it looks like.
    shard(&path, &vec![ALL_ONES, CUT, ALL_ONES, ALL_ONES]);
    let text = MaskChecks::default();
    let sources = open_sources(&files_plan(&path, text)).unwrap();
    let report = sources[0].mask_probe().unwrap().read();
    assert_eq!(report.bad_sequences, 0);
    assert!(!report.chat);
    shard(&path, &vec![ALL_ONES, ALL_ZEROS, ALL_ONES, ALL_ONES]);
    let refusal = refusal(&files_plan(&path, text));
    assert_eq!(refusal.report.all_zeros.count, 1);
    assert!(refusal.to_string().contains("unchecked"), "{refusal}");
}

/// A one-slot stream server for `masks`; its log lines are collected.
fn stream_server(masks: MaskChecks) -> (Producer, String, BatchPool, Arc<Mutex<Vec<String>>>) {
    let source = SourceSpec::Stream {
        listen: "127.0.0.1:0".into(),
        token_env: None,
        max_message_bytes: 1 << 20,
        read_timeout_ms: 300,
    };
    let mut plan = source_support::plan(source, VOCAB, HIDDEN, TAPS, &[8], 32, 1);
    plan.target.masks = masks;
    let log = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&log);
    let shapes = BucketShapes::from_plan(&plan);
    let (mut sources, status) = open_stream(StreamConfig {
        listen: "127.0.0.1:0".into(),
        token: None,
        max_message_bytes: 1 << 20,
        read_timeout: Duration::from_millis(300),
        target: plan.target.clone(),
        shapes: shapes.clone(),
        producers: 1,
        log: Arc::new(move |line: &str| sink.lock().unwrap().push(line.to_string())),
    })
    .unwrap();
    let address = status.address().to_string();
    let producer = Producer::new(Box::new(sources.remove(0)));
    (producer, address, BatchPool::new(shapes, 8).unwrap(), log)
}

#[test]
fn a_stream_refuses_the_producer_whose_bad_masks_go_over_the_bound_and_serves_the_next() {
    for layout in [Layout::Reference, Layout::HiddenLast] {
        let (mut producer, address, pool, log) = stream_server(chat(0.01));
        let probe = producer.source_mut().mask_probe().unwrap();
        let stop = AtomicBool::new(false);
        std::thread::scope(|scope| {
            let (stop, pool) = (&stop, &pool);
            scope.spawn(move || {
                while let Some(batch) = producer.next_batch(pool, stop).unwrap() {
                    pool.give_back(batch).unwrap();
                }
            });
            let mut bad = Client::connect(&address);
            let hello = Client::hello_for(HIDDEN, TAPS, VOCAB, "", "bad");
            assert!(bad.hello(&hello).ok);
            // One bad sequence is judged over at least 100: 1% is not over the bound of 1%.
            assert!(bad.send_in(layout, &tensors(&vec![GOOD, ALL_ONES])).ok);
            // A second is 2 of 100: refused, this message not counted.
            let reply = bad.send_in(layout, &tensors(&vec![CUT, GOOD]));
            assert!(!reply.ok, "{reply:?}");
            let error = reply.error.unwrap_or_default();
            for needle in [
                "2 of 4 sequences",
                "`max_bad_mask_share` = 0.01",
                "all ones 1 (",
                "message 1 row 1",
                "missing end of turn 1 (",
                "message 2 row 0",
            ] {
                assert!(error.contains(needle), "{needle}: {error}");
            }
            drop(bad);
            let mut good = Client::connect(&address);
            let hello = Client::hello_for(HIDDEN, TAPS, VOCAB, "", "good");
            assert!(good.hello(&hello).ok);
            assert!(good.send_in(layout, &tensors(&vec![GOOD, GOOD])).ok);
            assert!(good.done().done);
            stop.store(true, Ordering::Release);
        });
        let server_log = log.lock().unwrap().join("\n");
        assert!(server_log.contains("have a bad mask"), "{server_log}");
        // The run's count holds the admitted messages: the bad producer's first and the good one's.
        let report = probe.read();
        assert_eq!(
            (report.sequences, report.bad_sequences),
            (4, 1),
            "{layout:?}"
        );
        assert_eq!(report.all_ones.count, 1);
    }
}
