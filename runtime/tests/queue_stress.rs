//! P producers × C consumers (up to 4 × 4) moving at least 10^6 items through the lock-free
//! queue with every pull policy (fewer under miri), checking:
//!
//! - exactly-once delivery: every id arrives once (a seen-bitmap), the count and a checksum match;
//! - capacity: the sampled depth and a lower bound on it computed from the test's own counters
//!   never exceed it (the per-bucket depths are read one bucket at a time, so their sum under
//!   traffic is not an instantaneous count: miri's scheduling showed it one above capacity);
//! - the watermark: a pop that returned before close happened while at least `min_ready` could
//!   have been queued (an upper bound from the test's counters, so a violation cannot hide);
//! - no starvation: under `fifo` and `round_robin` an item leaves within a bounded number of
//!   pops after its push; every bucket is served before close;
//! - clean drain: after close, consumers drain, nothing is left, and counters agree.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::thread;

use draftpipe_runtime::queue::{HsQueue, PullPolicy, QueueConfig, SeqLen};

const BOUNDS: [usize; 4] = [64, 256, 1024, 4096];

/// Items per run: 10^6 natively, a few hundred under miri (which is ~10^4 times slower).
const ITEMS: u64 = if cfg!(miri) { 240 } else { 1_000_000 };

/// A boxed item, so double delivery or loss would also show as double free or leak under miri.
struct Item {
    id: u64,
    len: usize,
}

// `Box` is fundamental, so this is the same impl the runtime writes for `Box<HsBatch>`.
impl SeqLen for Box<Item> {
    fn seq_len(&self) -> usize {
        self.len
    }
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Lengths spread uniformly over 1..=4096, so the buckets get 1.6%, 4.7%, 18.8% and 75% of the
/// items: light buckets that a heavy one could starve.
fn len_of(id: u64) -> usize {
    (mix(id) % 4096) as usize + 1
}

fn bucket_of(len: usize) -> usize {
    BOUNDS.iter().position(|&b| len <= b).unwrap()
}

/// The test's own view of the traffic, independent of the queue's counters.
#[derive(Default)]
struct Ops {
    pushes_started: AtomicU64,
    pushes_done: AtomicU64,
    pops_started: AtomicU64,
    pops_done: AtomicU64,
    closing: AtomicBool,
}

struct Outcome {
    seen: Vec<bool>,
    checksum: u64,
    count: u64,
    popped_at: Vec<(u64, u64)>,
    served_before_close: [u64; 4],
}

fn run(pull: PullPolicy, producers: u64, consumers: u64, capacity: usize, min_ready: usize) {
    let queue = Arc::new(
        HsQueue::<Box<Item>>::new(QueueConfig {
            capacity,
            min_ready,
            buckets: BOUNDS.to_vec(),
            pull,
            seed: producers * 10 + consumers,
        })
        .unwrap(),
    );
    let ops = Arc::new(Ops::default());
    let done = Arc::new(AtomicBool::new(false));
    let max_seen_depth = Arc::new(AtomicUsize::new(0));
    let start = Arc::new(Barrier::new((producers + consumers) as usize));
    // Per id: `pops_started` right after its push returned; with the consumer's ticket (the same
    // counter just before its pop) the difference counts the pops that went before the item.
    let pushed_at: Arc<Vec<AtomicU64>> = Arc::new((0..ITEMS).map(|_| AtomicU64::new(0)).collect());

    let monitor = {
        let (queue, ops, done, max_seen_depth) = (
            Arc::clone(&queue),
            Arc::clone(&ops),
            Arc::clone(&done),
            Arc::clone(&max_seen_depth),
        );
        thread::spawn(move || {
            while !done.load(Ordering::SeqCst) {
                // Read in this order, `pushes_done - pops_started` is a lower bound on the depth.
                let pushed = ops.pushes_done.load(Ordering::SeqCst);
                let popping = ops.pops_started.load(Ordering::SeqCst);
                let lower_bound = pushed.saturating_sub(popping) as usize;
                let stats = queue.stats();
                assert!(stats.per_bucket.iter().all(|&depth| depth <= capacity));
                let depth = stats.depth.max(lower_bound);
                max_seen_depth.fetch_max(depth, Ordering::SeqCst);
                thread::yield_now();
            }
        })
    };

    let producer_threads: Vec<_> = (0..producers)
        .map(|p| {
            let (queue, ops, start) = (Arc::clone(&queue), Arc::clone(&ops), Arc::clone(&start));
            let pushed_at = Arc::clone(&pushed_at);
            thread::spawn(move || {
                start.wait();
                let mut id = p;
                while id < ITEMS {
                    ops.pushes_started.fetch_add(1, Ordering::SeqCst);
                    let item = Box::new(Item {
                        id,
                        len: len_of(id),
                    });
                    assert!(queue.push(item).is_ok(), "push failed before close");
                    ops.pushes_done.fetch_add(1, Ordering::SeqCst);
                    pushed_at[id as usize]
                        .store(ops.pops_started.load(Ordering::SeqCst), Ordering::SeqCst);
                    id += producers;
                }
            })
        })
        .collect();

    let consumer_threads: Vec<_> = (0..consumers)
        .map(|_| {
            let (queue, ops, start) = (Arc::clone(&queue), Arc::clone(&ops), Arc::clone(&start));
            thread::spawn(move || {
                start.wait();
                let mut out = Outcome {
                    seen: vec![false; ITEMS as usize],
                    checksum: 0,
                    count: 0,
                    popped_at: Vec::new(),
                    served_before_close: [0; 4],
                };
                loop {
                    let completed_before = ops.pops_done.load(Ordering::SeqCst);
                    // Read before the pop, so a consumer preempted after its pop does not make
                    // the item look older than it was.
                    let ticket = ops.pops_started.fetch_add(1, Ordering::SeqCst);
                    let Some(item) = queue.pop() else { break };
                    let pushes_started = ops.pushes_started.load(Ordering::SeqCst);
                    ops.pops_done.fetch_add(1, Ordering::SeqCst);
                    if !ops.closing.load(Ordering::SeqCst) {
                        // At the claim, queued ≤ pushes started − pops completed.
                        let queued_at_most = pushes_started - completed_before;
                        assert!(
                            queued_at_most >= min_ready as u64,
                            "popped with at most {queued_at_most} queued, min_ready {min_ready}"
                        );
                        out.served_before_close[bucket_of(item.len)] += 1;
                    }
                    out.popped_at.push((item.id, ticket));
                    assert_eq!(item.len, len_of(item.id), "item corrupted");
                    assert!(
                        !out.seen[item.id as usize],
                        "item {} delivered twice",
                        item.id
                    );
                    out.seen[item.id as usize] = true;
                    out.checksum = out.checksum.wrapping_add(mix(item.id));
                    out.count += 1;
                }
                out
            })
        })
        .collect();

    for producer in producer_threads {
        producer.join().unwrap();
    }
    ops.closing.store(true, Ordering::SeqCst);
    queue.close();
    let outcomes: Vec<Outcome> = consumer_threads
        .into_iter()
        .map(|c| c.join().unwrap())
        .collect();
    done.store(true, Ordering::SeqCst);
    monitor.join().unwrap();

    let label = format!("{pull:?} {producers}P×{consumers}C cap {capacity} min_ready {min_ready}");
    let count: u64 = outcomes.iter().map(|o| o.count).sum();
    assert_eq!(count, ITEMS, "{label}: count");
    let checksum = outcomes
        .iter()
        .fold(0u64, |sum, o| sum.wrapping_add(o.checksum));
    assert_eq!(
        checksum,
        (0..ITEMS).fold(0u64, |s, id| s.wrapping_add(mix(id))),
        "{label}"
    );
    for id in 0..ITEMS as usize {
        let deliveries = outcomes.iter().filter(|o| o.seen[id]).count();
        assert_eq!(
            deliveries, 1,
            "{label}: item {id} delivered {deliveries} times"
        );
    }
    let max_depth = max_seen_depth.load(Ordering::SeqCst);
    assert!(
        max_depth <= capacity,
        "{label}: depth {max_depth} > capacity"
    );

    // Starvation: an item has at most `capacity - 1` items ahead of it (in its bucket, for
    // round-robin, which serves its bucket at least once per round of `BOUNDS.len()` pops).
    // The slack covers pushes and pops in flight around the two counter reads.
    let slack = producers + 2 * consumers;
    let max_age = outcomes
        .iter()
        .flat_map(|o| &o.popped_at)
        .map(|&(id, popped)| popped.saturating_sub(pushed_at[id as usize].load(Ordering::SeqCst)))
        .max()
        .unwrap();
    let rounds = match pull {
        PullPolicy::Fifo => Some(1),
        PullPolicy::RoundRobin => Some(BOUNDS.len() as u64),
        PullPolicy::RandomInBucket => None,
    };
    if let Some(rounds) = rounds {
        let bound = rounds * (capacity as u64 + slack);
        assert!(
            max_age <= bound,
            "{label}: an item waited {max_age} pops (bound {bound})"
        );
    }
    for bucket in 0..BOUNDS.len() {
        let served: u64 = outcomes.iter().map(|o| o.served_before_close[bucket]).sum();
        assert!(
            served > 0 || cfg!(miri),
            "{label}: bucket {bucket} never served before close"
        );
    }

    let stats = queue.stats();
    assert_eq!((stats.pushes, stats.pops), (ITEMS, ITEMS), "{label}");
    assert_eq!(stats.depth, 0, "{label}");
    assert_eq!(stats.per_bucket, vec![0; BOUNDS.len()], "{label}");
    assert!(queue.is_empty() && queue.is_closed());
    println!("{label}: max depth {max_depth}, max age {max_age} pops, {stats:?}");
}

/// The thread shapes each policy is run with: balanced, and lopsided both ways.
const SHAPES: &[(u64, u64)] = if cfg!(miri) {
    &[(2, 2), (1, 2)]
} else {
    &[(1, 1), (2, 2), (4, 4), (1, 4), (4, 1)]
};

#[test]
fn fifo_many_producers_many_consumers() {
    for &(p, c) in SHAPES {
        run(PullPolicy::Fifo, p, c, 64, 8);
    }
}

#[test]
fn round_robin_many_producers_many_consumers() {
    for &(p, c) in SHAPES {
        run(PullPolicy::RoundRobin, p, c, 64, 8);
    }
}

#[test]
fn random_in_bucket_many_producers_many_consumers() {
    for &(p, c) in SHAPES {
        run(PullPolicy::RandomInBucket, p, c, 64, 8);
    }
}

/// The settings of the Python queue this replaces: capacity 20, watermark 10.
#[test]
fn python_settings_capacity_20_min_ready_10() {
    run(PullPolicy::RandomInBucket, 4, 4, 20, 10);
    run(PullPolicy::RoundRobin, 2, 3, 20, 10);
}

/// A watermark equal to capacity: consumers only ever take from a full queue.
#[test]
fn watermark_at_capacity() {
    run(PullPolicy::Fifo, 3, 2, 16, 16);
}
