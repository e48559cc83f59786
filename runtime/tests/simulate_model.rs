//! The simulator's model: properties that hold for every plan (throughput bounded by the slower side, depth
//! bounded by capacity, the two infinitely-fast limits), the queue's watermark rule, and the seed's question.

use draftpipe_compiler::plan::PullPolicy;
use draftpipe_runtime::simulate::{BucketModel, Model};
use draftpipe_runtime::telemetry::Bottleneck;
use proptest::prelude::*;

fn model(
    capacity: usize,
    min_ready: usize,
    producers: usize,
    produce_mean_s: f64,
    drafters: usize,
    step_mean_s: f64,
) -> Model {
    Model {
        name: "test".into(),
        capacity,
        min_ready,
        pull: PullPolicy::RandomInBucket,
        buckets: vec![BucketModel {
            padded_len: 512,
            tokens: 2048,
            share: 1.0,
            step_mean_s,
            step_std_s: 0.0,
        }],
        producers,
        produce_mean_s,
        produce_std_s: 0.0,
        drafters,
        lockstep: true,
        rounds: false,
        all_reduce_s: 0.0,
        step_common_share: 0.0,
        real_share: None,
        producer_origin: "test".into(),
        drafter_origin: "test".into(),
    }
}

/// Simulated seconds that keep a case to about `events` events.
fn duration_for(m: &Model, events: f64) -> f64 {
    let fastest = m
        .buckets
        .iter()
        .map(|b| b.step_mean_s)
        .fold(f64::INFINITY, f64::min);
    let per_second =
        m.producers as f64 / m.produce_mean_s.max(1e-9) + m.drafters as f64 / fastest.max(1e-9);
    (events / per_second).max(1.0)
}

fn arbitrary_model() -> impl Strategy<Value = Model> {
    (
        1usize..48,
        0.0f64..=1.0,
        1usize..5,
        0.001f64..1.0,
        1usize..5,
        prop::collection::vec((0.05f64..1.0, 1usize..9, 0.001f64..1.0, 0.0f64..0.4), 1..4),
        (any::<bool>(), any::<bool>()),
        prop_oneof![
            Just(PullPolicy::RandomInBucket),
            Just(PullPolicy::RoundRobin),
            Just(PullPolicy::Fifo)
        ],
    )
        .prop_map(
            |(capacity, ready, producers, produce, drafters, buckets, (lockstep, rounds), pull)| {
                // Rounds need a capacity that always holds one (the runtime refuses less).
                let capacity = if rounds {
                    capacity.max(buckets.len() * (drafters - 1) + 1)
                } else {
                    capacity
                };
                let mut m = model(
                    capacity,
                    (ready * capacity as f64) as usize,
                    producers,
                    produce,
                    drafters,
                    0.0,
                );
                let total: f64 = buckets.iter().map(|b| b.0).sum();
                m.buckets = buckets
                    .iter()
                    .enumerate()
                    .map(|(i, &(share, tokens, step, spread))| BucketModel {
                        padded_len: 128 << i,
                        tokens: tokens * 256,
                        share: share / total,
                        step_mean_s: step,
                        step_std_s: step * spread,
                    })
                    .collect();
                m.produce_std_s = produce * 0.2;
                m.lockstep = lockstep;
                m.rounds = rounds;
                m.pull = pull;
                m
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Throughput never beats the slower side. Times vary, so the bound is each side's capacity at the times
    /// this run actually drew, which for tens of thousands of draws sits within a few percent of the mean;
    /// plus what was already queued (or in a step) when the measured window began.
    #[test]
    fn throughput_never_exceeds_the_slower_side(m in arbitrary_model(), seed in any::<u64>()) {
        let duration = duration_for(&m, 40_000.0);
        let p = m.predict(duration, seed).unwrap();
        let bound = m.producer_capacity().min(m.drafter_capacity());
        let max_tokens = m.buckets.iter().map(|b| b.tokens).max().unwrap() as f64;
        let buffered = (m.capacity + m.drafters + m.producers) as f64 * max_tokens / p.outcome.measured_s;
        prop_assert!(
            p.outcome.slots_per_s <= bound * 1.08 + buffered,
            "{} tok/s above the bound {bound} (+{buffered} buffered)\n{p}",
            p.outcome.slots_per_s
        );
    }

    /// The depth distribution covers exactly `0..=capacity` and all of the measured time.
    #[test]
    fn depth_never_exceeds_capacity(m in arbitrary_model(), seed in any::<u64>()) {
        let p = m.predict(duration_for(&m, 20_000.0), seed).unwrap();
        prop_assert_eq!(p.outcome.depth_share.len(), m.capacity + 1);
        let total: f64 = p.outcome.depth_share.iter().sum();
        prop_assert!((total - 1.0).abs() < 1e-6, "time at depths sums to {total}");
    }

    /// Producers that make items in no time keep the queue full; the drafters are the bottleneck.
    #[test]
    fn infinitely_fast_producers_keep_the_queue_full(mut m in arbitrary_model(), seed in any::<u64>()) {
        m.produce_mean_s = 0.0;
        m.produce_std_s = 0.0;
        let p = m.predict(duration_for(&m, 20_000.0), seed).unwrap();
        prop_assert!(p.outcome.depth_share[m.capacity] > 0.999, "{p}");
        prop_assert_eq!(p.bottleneck, Bottleneck::Consumers);
        prop_assert!(p.outcome.drafter_wait < 1e-9, "{p}");
    }

    /// Drafters that step in no time wait all the time (for data, or under lockstep for a peer that waits for
    /// data); the producers are the bottleneck.
    #[test]
    fn infinitely_fast_drafters_wait(mut m in arbitrary_model(), seed in any::<u64>()) {
        // The single pop's watermark: a round needs one item per drafter of one bucket, so it may queue more.
        m.rounds = false;
        for bucket in &mut m.buckets {
            bucket.step_mean_s = 0.0;
            bucket.step_std_s = 0.0;
        }
        let p = m.predict(duration_for(&m, 20_000.0), seed).unwrap();
        prop_assert!(p.outcome.drafter_wait + p.outcome.drafter_barrier > 0.999, "{p}");
        prop_assert!(p.outcome.producer_blocked < 1e-9, "{p}");
        // The queue never holds more than the watermark's worth minus one between hand-offs.
        let watermark = m.min_ready.max(1);
        prop_assert!(p.below_watermark > 0.999, "{p}");
        prop_assert!(p.outcome.depth_share[watermark..].iter().sum::<f64>() < 1e-9);
        prop_assert_eq!(p.bottleneck, Bottleneck::Producers);
    }
}

#[test]
fn throughput_is_the_slower_side_when_nothing_varies() {
    // One producer at 10 items/s against two drafters at 10 steps/s each: producer-bound at 10 items/s.
    let producer_bound = model(16, 4, 1, 0.1, 2, 0.1).predict(3600.0, 1).unwrap();
    assert!((producer_bound.outcome.slots_per_s / (10.0 * 2048.0) - 1.0).abs() < 0.01);
    assert_eq!(producer_bound.bottleneck, Bottleneck::Producers);
    // The same against drafters at 2 s per step in lockstep: 2 × 2048 tokens per 2 s.
    let drafter_bound = model(16, 4, 1, 0.1, 2, 2.0).predict(3600.0, 1).unwrap();
    assert!((drafter_bound.outcome.slots_per_s / 2048.0 - 1.0).abs() < 0.01);
    assert_eq!(drafter_bound.bottleneck, Bottleneck::Consumers);
}

#[test]
fn the_watermark_holds_drafters_until_the_queue_refills_to_min_ready() {
    // Producers at 1 item/s, instant independent drafters, min_ready 5: a pop needs 5 queued, so each arrival
    // that makes 5 lets exactly one drafter take one and the queue sits at 4 (the runtime's claim rule:
    // `published - claimed ≥ min_ready`), never at 5 or more, and never refills from empty after the first fill.
    let mut m = model(20, 5, 1, 1.0, 5, 0.0);
    m.lockstep = false;
    let p = m.predict(1000.0, 1).unwrap();
    assert!(
        p.outcome.depth_share[4] > 0.999,
        "{:?}",
        p.outcome.depth_share
    );
    assert!(
        (900..=901).contains(&p.outcome.steps),
        "one step per arrival in the measured 900 s (both ends included): {}",
        p.outcome.steps
    );
}

#[test]
fn the_seeds_question_a_deeper_queue_does_not_help_drafter_bound_pipelines() {
    // Drafters are the bottleneck: capacity 20 → 60 with min_ready 10 changes nothing, another drafter or a
    // faster step does.
    let mut base = model(20, 1, 5, 0.05, 3, 0.5);
    base.buckets[0].step_std_s = 0.1;
    base.produce_std_s = 0.01;
    let rate = |m: &Model| m.predict(3600.0, 7).unwrap().outcome.slots_per_s;
    let baseline = rate(&base);
    let deeper = rate(&Model {
        capacity: 60,
        min_ready: 10,
        ..base.clone()
    });
    assert!(
        (deeper / baseline - 1.0).abs() < 0.01,
        "{deeper} vs {baseline}"
    );
    let more = rate(&Model {
        drafters: 4,
        ..base.clone()
    });
    assert!(more / baseline > 1.25, "{more} vs {baseline}");
    let mut faster = base.clone();
    faster.buckets[0].step_mean_s *= 0.8;
    faster.buckets[0].step_std_s *= 0.8;
    assert!(rate(&faster) / baseline > 1.2);
}

#[test]
fn producers_that_deliver_in_bursts_are_named_bursty_as_the_diagnosis_names_them() {
    // One producer averaging 10 items/s with a spread four times its mean (long silences, then items in quick
    // succession) against a drafter as fast on average, through a queue of 4: the queue fills and the producer
    // blocks, then it drains and the drafter waits.
    let mut bursty = model(4, 1, 1, 0.1, 1, 0.08);
    bursty.produce_std_s = 0.4;
    let p = bursty.predict(3600.0, 3).unwrap();
    assert!(
        p.outcome.producer_blocked >= 0.1 && p.outcome.drafter_wait >= 0.1,
        "{p}"
    );
    assert_eq!(p.bottleneck, Bottleneck::Bursty, "{p}");
    assert!(p.to_string().contains("bursts"), "{p}");
    // The same mean rate delivered evenly: the producer sets the pace, nobody blocks.
    let even = model(4, 1, 1, 0.1, 1, 0.08).predict(3600.0, 3).unwrap();
    assert_eq!(even.bottleneck, Bottleneck::Producers, "{even}");
}

/// Three lockstep drafters over two buckets of equal share, one step 1 s and the other 3.5 s (the ratio of
/// `dflash-5x3.pipe`'s 2048 and 8192 buckets per token), producers never the bottleneck.
fn two_bucket_lockstep(rounds: bool) -> Model {
    let mut m = model(30, 4, 8, 0.01, 3, 0.0);
    m.buckets = [(1.0, 2048), (3.5, 8192)]
        .into_iter()
        .map(|(step_mean_s, tokens)| BucketModel {
            padded_len: tokens,
            tokens,
            share: 0.5,
            step_mean_s,
            step_std_s: 0.0,
        })
        .collect();
    m.rounds = rounds;
    m
}

#[test]
fn a_round_of_one_bucket_costs_that_buckets_step_not_the_slowest_members() {
    let with = two_bucket_lockstep(true).predict(3600.0, 3).unwrap();
    let without = two_bucket_lockstep(false).predict(3600.0, 3).unwrap();
    // Rounds alternate the buckets (round-robin among those that hold a round): a round costs 1 s or 3.5 s.
    let rounds_per_s = with.outcome.steps as f64 / with.outcome.measured_s;
    assert!(
        (rounds_per_s * 2.25 - 1.0).abs() < 0.02,
        "{rounds_per_s} rounds/s\n{with}"
    );
    assert!(with.outcome.drafter_barrier < 1e-9, "{with}");
    // Each drafter's own pop mixes the buckets in almost every round, which then costs the 3.5 s bucket.
    let mixed_per_s = without.outcome.steps as f64 / without.outcome.measured_s;
    assert!(mixed_per_s < 1.0 / 3.0, "{mixed_per_s} rounds/s\n{without}");
    assert!(without.outcome.drafter_barrier > 0.1, "{without}");
    assert!(with.outcome.slots_per_s > 1.2 * without.outcome.slots_per_s);
}

#[test]
fn rounds_need_a_capacity_that_always_holds_one() {
    let mut m = two_bucket_lockstep(true);
    // Two buckets × (3 − 1) + 1 = 5.
    m.capacity = 4;
    let err = m.validate().unwrap_err().to_string();
    assert!(err.contains("queue.capacity"), "{err}");
    m.capacity = 5;
    m.validate().unwrap();
    m.capacity = 4;
    m.rounds = false;
    m.validate().unwrap();
}
