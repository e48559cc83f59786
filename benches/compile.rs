//! Check + compile of `pipelines/dflash-5x3.pipe`: parse, all checks, cost and memory model, plan.
//! Target: well under 5 ms.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};

const DFLASH: &str = include_str!("../pipelines/dflash-5x3.pipe");
const QUICKSTART: &str = include_str!("../pipelines/quickstart.pipe");

fn compile(c: &mut Criterion) {
    c.bench_function("compile/dflash-5x3", |b| {
        b.iter(|| {
            draftpipe_compiler::compile_source("dflash-5x3.pipe", black_box(DFLASH))
                .expect("valid pipeline")
        })
    });
    c.bench_function("compile/quickstart", |b| {
        b.iter(|| {
            draftpipe_compiler::compile_source("quickstart.pipe", black_box(QUICKSTART))
                .expect("valid pipeline")
        })
    });
    let broken = DFLASH
        .replace("capacity  = 60", "capcity = 60")
        .replace("lr = 6e-4", "lr = -6e-4");
    c.bench_function("compile/dflash-5x3-two-errors", |b| {
        b.iter(|| {
            let errors = draftpipe_compiler::compile_source("dflash-5x3.pipe", black_box(&broken))
                .unwrap_err();
            black_box(errors.to_string())
        })
    });
}

criterion_group!(benches, compile);
criterion_main!(benches);
