//! Producer throughput: how many tokens per second one synthetic-source worker fills into pooled batches.
//!
//! The drafters must be the bottleneck for the queue to stay full, so this is the figure to hold against the
//! drafter step's tokens per second for the same shape.

use std::hint::black_box;
use std::sync::Arc;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use draftpipe_runtime::source::{BucketShapes, HsSource, SyntheticSource, SyntheticTarget};

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

criterion_group!(benches, synthetic_fill);
criterion_main!(benches);
