//! Loom model checks of the queue protocol: every interleaving (up to a preemption bound) of a
//! few threads on a tiny queue (and a group's rounds, `HsQueue::with_rounds`). Run with
//! `RUSTFLAGS="--cfg loom" cargo test -p draftpipe-runtime --test queue_loom --release`.
//!
//! Under `cfg(loom)` the queue's counters, slot bitmaps, slot cells, mutexes and condition
//! variables are loom's (see `queue/sync.rs`), so loom explores the claim/publish steps, the
//! random store's slot hand-over and the park/notify protocol. A lost wake-up shows as a loom
//! deadlock; a data race on a slot as a loom causality error. (`ArrayQueue`, used by the `fifo`
//! and `round_robin` stores, is crossbeam's and opaque to loom: those models still check the
//! counters and parking around it.)
#![cfg(loom)]

use loom::sync::Arc;
use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::thread;

use draftpipe_runtime::queue::{HsQueue, PullPolicy, QueueConfig, SeqLen};

struct Item(usize);

impl SeqLen for Item {
    fn seq_len(&self) -> usize {
        self.0
    }
}

fn queue(capacity: usize, min_ready: usize, pull: PullPolicy) -> Arc<HsQueue<Item>> {
    Arc::new(
        HsQueue::new(QueueConfig {
            capacity,
            min_ready,
            buckets: vec![2, 4],
            pull,
            seed: 3,
        })
        .unwrap(),
    )
}

/// Explores interleavings with up to `preemptions` forced thread switches (loom's bound; 2–3
/// finds the known bug patterns while keeping a model to minutes).
fn model(preemptions: usize, f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(preemptions);
    builder.check(f);
}

/// Capacity 1 forces the producer to park on a full queue and the consumer to park on an empty
/// one; both must be woken (no lost wake-up), and both items arrive, in push order.
fn handoff_both_ways(pull: PullPolicy) {
    model(3, move || {
        let q = queue(1, 1, pull);
        let producer = {
            let q = Arc::clone(&q);
            thread::spawn(move || {
                assert!(q.push(Item(1)).is_ok());
                assert!(q.push(Item(3)).is_ok());
            })
        };
        let first = q.pop().map(|i| i.0);
        let second = q.pop().map(|i| i.0);
        producer.join().unwrap();
        assert_eq!((first, second), (Some(1), Some(3)));
        assert!(q.is_empty());
    });
}

#[test]
fn handoff_random_in_bucket() {
    handoff_both_ways(PullPolicy::RandomInBucket);
}

#[test]
fn handoff_fifo() {
    handoff_both_ways(PullPolicy::Fifo);
}

/// Watermark 2 with two producers: the parked consumer must wake only once both are queued,
/// and then must wake (the second publish meets the watermark whichever comes last).
#[test]
fn watermark_wakes_parked_consumer() {
    model(3, || {
        let q = queue(2, 2, PullPolicy::RandomInBucket);
        let producers: Vec<_> = [1, 4]
            .into_iter()
            .map(|len| {
                let q = Arc::clone(&q);
                thread::spawn(move || assert!(q.try_push(Item(len)).is_ok()))
            })
            .collect();
        let taken = q.pop().map(|i| i.0);
        assert!(matches!(taken, Some(1 | 4)));
        for producer in producers {
            producer.join().unwrap();
        }
        // The other item stays below the watermark until close.
        assert!(q.try_pop().is_err());
        q.close();
        assert!(q.pop().is_some());
        assert!(q.pop().is_none());
    });
}

/// Close racing a push and a draining consumer: an item whose push succeeded is delivered, and
/// the consumer ends (with `None`) instead of waiting forever or returning early.
#[test]
fn close_races_push_and_drain() {
    model(3, || {
        let q = queue(2, 2, PullPolicy::RandomInBucket);
        let producer = {
            let q = Arc::clone(&q);
            thread::spawn(move || q.try_push(Item(3)).is_ok())
        };
        let consumer = {
            let q = Arc::clone(&q);
            thread::spawn(move || {
                let mut got = 0;
                while q.pop().is_some() {
                    got += 1;
                }
                got
            })
        };
        q.close();
        let pushed = producer.join().unwrap();
        let got = consumer.join().unwrap();
        assert_eq!(got, usize::from(pushed));
        assert!(q.is_empty());
    });
}

/// Two consumers and two items in the random store: each item goes to exactly one consumer,
/// and the slot hand-over (write, publish bit, claim bit, read) has no data race.
#[test]
fn two_consumers_split_two_items() {
    model(2, || {
        let q = queue(2, 1, PullPolicy::RandomInBucket);
        let total = Arc::new(AtomicUsize::new(0));
        let consumers: Vec<_> = (0..2)
            .map(|_| {
                let (q, total) = (Arc::clone(&q), Arc::clone(&total));
                thread::spawn(move || {
                    if let Some(item) = q.pop() {
                        total.fetch_add(item.0, Ordering::SeqCst);
                    }
                })
            })
            .collect();
        assert!(q.try_push(Item(1)).is_ok());
        assert!(q.try_push(Item(2)).is_ok());
        for consumer in consumers {
            consumer.join().unwrap();
        }
        assert_eq!(total.load(Ordering::SeqCst), 3);
    });
}

fn rounds_queue(capacity: usize, members: usize) -> Arc<HsQueue<Item>> {
    Arc::new(
        HsQueue::with_rounds(
            QueueConfig {
                capacity,
                min_ready: 1,
                buckets: vec![2, 4],
                pull: PullPolicy::RandomInBucket,
                seed: 3,
            },
            members,
        )
        .unwrap(),
    )
}

/// A group of two parked for a round while a producer pushes one item of bucket 1 and two of bucket 0, then
/// closes: the members must wake (no lost wake-up between the claim, the fill and the other member's take),
/// both get an item of bucket 0 in round 0, and both end with `None` (the lone bucket-1 item is no round).
#[test]
fn a_round_reaches_both_parked_members_and_the_close_ends_them() {
    model(2, || {
        let q = rounds_queue(3, 2);
        let producer = {
            let q = Arc::clone(&q);
            thread::spawn(move || {
                for len in [3, 1, 2] {
                    assert!(q.push(Item(len)).is_ok());
                }
                q.close();
            })
        };
        let other = {
            let q = Arc::clone(&q);
            thread::spawn(move || {
                let round = q.pop_round(1).map(|r| (r.round, r.bucket, r.item.0));
                (round, q.pop_round(1).is_none())
            })
        };
        let mine = q.pop_round(0).map(|r| (r.round, r.bucket, r.item.0));
        assert!(q.pop_round(0).is_none());
        producer.join().unwrap();
        let (theirs, ended) = other.join().unwrap();
        assert!(ended);
        let (mine, theirs) = (mine.unwrap(), theirs.unwrap());
        assert_eq!((mine.0, mine.1, theirs.0, theirs.1), (0, 0, 0, 0));
        assert_eq!(mine.2 + theirs.2, 3, "items 1 and 2, once each");
        assert_eq!(q.stats().depth, 1);
    });
}
