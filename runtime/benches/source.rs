//! Producer throughput: how many tokens per second one source worker (synthetic, or reading BF16 files) fills
//! into pooled batches.
//!
//! The drafters must be the bottleneck for the queue to stay full, so this is the figure to hold against the
//! drafter step's tokens per second for the same shape.

use std::hint::black_box;
use std::sync::Arc;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use draftpipe_compiler::plan::{Device, HsDtype, Placement, SourceSpec, TargetStage};
use draftpipe_runtime::source::{
    BucketShapes, HsSource, SafetensorsDataset, SafetensorsSource, SyntheticSource, SyntheticTarget,
};
use safetensors::Dtype;
use safetensors::tensor::TensorView;

fn synthetic_fill(c: &mut Criterion) {
    let mut group = c.benchmark_group("synthetic_fill");
    // (vocab, hidden, taps, buckets, batch tokens): a quickstart-sized target and a 2k-hidden one.
    for (vocab, hidden, taps, buckets, batch_tokens) in [
        (4096, 256, 3, vec![128, 256, 512], 4096),
        (32_000, 2048, 3, vec![512, 1024, 2048], 4096),
    ] {
        let target = Arc::new(SyntheticTarget::new(1, vocab, hidden, taps).expect("valid target"));
        let shapes = BucketShapes {
            buckets: buckets.iter().map(|&p| (p, batch_tokens / p)).collect(),
            din: hidden * taps,
            hs_dtype: HsDtype::F32,
            last_hidden: None,
        };
        let longest = *buckets.last().expect("buckets");
        let mut source =
            SyntheticSource::new(target, &shapes, 16..longest + 1, 0, 1).expect("valid source");
        let mut batch = shapes.buffer();
        // Tokens filled per batch vary with the lengths drawn; the padded size is what the pipeline moves.
        group.throughput(Throughput::Elements(batch_tokens as u64));
        group.bench_function(format!("hidden{hidden}x{taps}_vocab{vocab}"), |b| {
            b.iter(|| {
                let bucket = source.next_bucket().expect("synthetic").expect("endless");
                shapes.shape_for(&mut batch, bucket);
                source.fill_next(&mut batch).expect("filled");
                black_box(&batch);
            })
        });
    }
    group.finish();
}

/// Reading recorded hidden states: BF16 rows decoded from a file (in the page cache after the first pass).
fn safetensors_fill(c: &mut Criterion) {
    let (rows, seq, hidden, taps, vocab) = (64, 512, 256, 3, 4096);
    let din = hidden * taps;
    let dir = std::env::temp_dir().join(format!("draftpipe-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("hs.safetensors");
    let hs: Vec<u8> = (0..rows * seq * din)
        .flat_map(|i| half::bf16::from_f32((i % 251) as f32 / 64.0).to_le_bytes())
        .collect();
    let ids: Vec<u8> = (0..rows * seq)
        .flat_map(|i| ((i % vocab) as i64).to_le_bytes())
        .collect();
    let tensors = [
        (
            "hidden_states",
            TensorView::new(Dtype::BF16, vec![rows, seq, din], &hs).expect("view"),
        ),
        (
            "input_ids",
            TensorView::new(Dtype::I64, vec![rows, seq], &ids).expect("view"),
        ),
    ];
    safetensors::serialize_to_file(tensors, None, &path).expect("bench file written");

    let shapes = BucketShapes {
        buckets: vec![(seq, 8)],
        din,
        hs_dtype: HsDtype::Bf16,
        last_hidden: None,
    };
    let target = TargetStage {
        name: "target".into(),
        placement: Placement {
            workers: vec![Device::Cpu],
        },
        hidden,
        layers: None,
        tap_layers: (0..taps as u32).collect(),
        vocab,
        batch_tokens: 8 * seq,
        source: SourceSpec::Safetensors {
            pattern: path.to_string_lossy().into_owned(),
            epochs: 1,
            shuffle_seed: None,
        },
        max_rate: None,
        weights: None,
        hs_dtype: Some(HsDtype::Bf16),
        masks: Default::default(),
    };
    let dataset =
        SafetensorsDataset::open(&path.to_string_lossy(), &target, &shapes).expect("dataset");
    let mut source = SafetensorsSource::new(Arc::new(dataset), 0, 1);
    let mut batch = shapes.buffer();
    let mut group = c.benchmark_group("safetensors_fill");
    group.throughput(Throughput::Elements((8 * seq) as u64));
    group.bench_function(format!("bf16_hidden{hidden}x{taps}"), |b| {
        b.iter(|| {
            if source.next_bucket().expect("readable").is_none() {
                source.seek(0).expect("own position");
            }
            source.fill_next(&mut batch).expect("filled");
            black_box(&batch);
        })
    });
    group.finish();
    std::fs::remove_dir_all(&dir).expect("temp dir removed");
}

criterion_group!(benches, synthetic_fill, safetensors_fill);
criterion_main!(benches);
