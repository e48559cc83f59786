//! Issue 32's acceptance of FP8 hidden states: `pipelines/dflash-quickstart.pipe` (its model, data and
//! optimizer; fewer steps, FIFO pulls so both runs see the same batches in the same order) trained once with
//! bf16 and once with `fp8_e4m3` hidden states ends with a loss and a τ within 2% of each other at the same
//! step; and the pool an fp8 run allocates is the one `compile` reports (a byte per element, 4 per token).

use std::io::sink;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use draftpipe_compiler::compile_source;
use draftpipe_compiler::plan::{HsDtype, Plan};
use draftpipe_runtime::pipeline::{RunOptions, run};
use draftpipe_runtime::source::{BatchPool, Producer, open_sources};
use draftpipe_runtime::telemetry::RunSummary;

const QUICKSTART: &str = include_str!("../../pipelines/dflash-quickstart.pipe");
/// Enough for the loss to fall from ln(512) ≈ 6.2 well into the learnt regime (about 10 s per run on 2 cores).
const STEPS: u64 = 1500;

/// The quick start with hidden states in `dtype`, `STEPS` steps (so its cosine schedule ends there) and FIFO.
fn quickstart_in(dtype: HsDtype) -> Plan {
    let source = "source       = synthetic(seed = 1, lengths = 32..128)";
    let text = QUICKSTART
        .replace(
            source,
            &format!("{source}\n    hs_dtype     = {}", dtype.name()),
        )
        .replace("steps     = 12000", &format!("steps     = {STEPS}"))
        .replace("pull      = random_in_bucket", "pull      = fifo");
    for changed in [source, "steps     = 12000", "pull      = random_in_bucket"] {
        assert!(
            QUICKSTART.contains(changed),
            "the quick start no longer has `{changed}`"
        );
    }
    let plan = compile_source("dflash-quickstart.pipe", &text).unwrap();
    assert_eq!(plan.target.hs_dtype, Some(dtype));
    plan
}

fn train(plan: &Plan) -> RunSummary {
    let options = RunOptions::for_plan(plan);
    let outcome = run(plan, &options, Arc::new(AtomicBool::new(false)), sink()).unwrap();
    assert_eq!(outcome.step, STEPS, "{}", plan.name);
    outcome.summary
}

#[test]
fn fp8_hidden_states_train_the_quickstart_to_bf16s_loss_and_tau_within_two_percent() {
    let bf16 = train(&quickstart_in(HsDtype::Bf16));
    let fp8 = train(&quickstart_in(HsDtype::Fp8E4m3));
    let figure = |summary: &RunSummary| {
        (
            summary.final_loss.expect("a final loss"),
            summary.final_tau_exact.expect("an exact τ"),
            summary.final_tau_simulated.expect("a simulated τ"),
        )
    };
    let (bf16_loss, bf16_tau, bf16_tau_sim) = figure(&bf16);
    let (fp8_loss, fp8_tau, fp8_tau_sim) = figure(&fp8);
    println!(
        "step {STEPS}: loss bf16 {bf16_loss:.4} fp8 {fp8_loss:.4} ({:+.2}%), τ exact bf16 {bf16_tau:.4} fp8 \
         {fp8_tau:.4} ({:+.2}%), τ simulated bf16 {bf16_tau_sim:.4} fp8 {fp8_tau_sim:.4}",
        100.0 * (fp8_loss / bf16_loss - 1.0),
        100.0 * (fp8_tau / bf16_tau - 1.0),
    );
    // The run learnt something (from ln 512 ≈ 6.24 at the start), so agreeing is not two untrained runs agreeing.
    assert!(bf16_loss < 0.75 * (512f64).ln(), "bf16 loss {bf16_loss}");
    assert!(bf16_tau > 1.5, "bf16 τ {bf16_tau}");
    let within = |a: f64, b: f64| (a - b).abs() <= 0.02 * b.abs();
    assert!(
        within(fp8_loss, bf16_loss),
        "loss fp8 {fp8_loss} vs bf16 {bf16_loss}"
    );
    assert!(
        within(fp8_tau, bf16_tau),
        "τ fp8 {fp8_tau} vs bf16 {bf16_tau}"
    );
    assert!(
        within(fp8_tau_sim, bf16_tau_sim),
        "simulated τ fp8 {fp8_tau_sim} vs bf16 {bf16_tau_sim}"
    );
    assert_eq!(fp8.skipped_nonfinite, 0);
}

/// The quickstart's model normalises each token's input, so a wrong per-token scale would barely move its loss:
/// the values staging dequantises (`widen_into`, what the CPU and CUDA staging call) are checked here against
/// the bf16 run's, batch for batch, so the comparison above is of correctly scaled hidden states.
#[test]
fn the_synthetic_targets_fp8_batches_dequantise_to_its_bf16_values_within_e4m3s_step() {
    let batches = |plan: &Plan| {
        let pool = BatchPool::for_plan(plan).unwrap();
        let mut producer = Producer::new(open_sources(plan).unwrap().remove(0));
        let stop = AtomicBool::new(false);
        (0..4)
            .map(|_| {
                let batch = producer.next_batch(&pool, &stop).unwrap().unwrap();
                let values = batch.hs.to_f32_vec(0..batch.hs.len());
                pool.give_back(batch).unwrap();
                values
            })
            .collect::<Vec<_>>()
    };
    let (bf16, fp8) = (
        batches(&quickstart_in(HsDtype::Bf16)),
        batches(&quickstart_in(HsDtype::Fp8E4m3)),
    );
    for (b, (bf16, fp8)) in bf16.iter().zip(&fp8).enumerate() {
        for (row, (bf16, fp8)) in bf16.chunks(192).zip(fp8.chunks(192)).enumerate() {
            let amax = bf16.iter().fold(0f32, |m, x| m.max(x.abs()));
            for (d, (&want, &got)) in bf16.iter().zip(fp8).enumerate() {
                // E4M3's half step relative to the value, or its subnormal step (2⁻⁹ of the scale, amax / 448),
                // and bf16's own rounding of the reference (2⁻⁹ relative).
                let bound = want.abs() / 16.0 + amax / 448.0 / 512.0 + want.abs() / 256.0;
                assert!(
                    (got - want).abs() <= bound,
                    "batch {b} token {row} element {d}: {got} vs {want}"
                );
            }
        }
    }
}

#[test]
fn the_fp8_pool_allocates_exactly_the_host_memory_compile_reports() {
    let (bf16, fp8) = (
        quickstart_in(HsDtype::Bf16),
        quickstart_in(HsDtype::Fp8E4m3),
    );
    for plan in [&bf16, &fp8] {
        let pool = BatchPool::for_plan(plan).unwrap();
        assert_eq!(pool.items() as u64, plan.host_memory.hs_pool_buffers);
        assert_eq!(
            pool.allocated_bytes(),
            plan.host_memory.hs_pool(),
            "{:?}",
            plan.target.hs_dtype
        );
    }
    // Per token: 192 elements (64 × 3 taps) at 2 bytes in bf16, at 1 byte plus a 4-byte scale in fp8.
    let tokens = bf16.buckets.iter().map(|b| b.tokens as u64).max().unwrap();
    let buffers = bf16.host_memory.hs_pool_buffers;
    assert_eq!(
        bf16.host_memory.hs_pool() - fp8.host_memory.hs_pool(),
        buffers * tokens * (2 * 192 - (192 + 4))
    );
}
