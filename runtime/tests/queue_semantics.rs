//! Single-threaded and small multi-threaded checks of the queue's contract, run against both the
//! lock-free `HsQueue` and the `MutexQueue` baseline, so the two are shown to mean the same thing.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use draftpipe_runtime::queue::baseline::MutexQueue;
use draftpipe_runtime::queue::{
    HsQueue, PopError, PullPolicy, PushError, QueueConfig, QueueConfigError, SeqLen,
};

/// A test item: an id and a sequence length.
#[derive(Debug, PartialEq, Eq)]
struct Item {
    id: usize,
    len: usize,
}

impl SeqLen for Item {
    fn seq_len(&self) -> usize {
        self.len
    }
}

fn item(id: usize, len: usize) -> Item {
    Item { id, len }
}

fn config(capacity: usize, min_ready: usize, buckets: &[usize], pull: PullPolicy) -> QueueConfig {
    QueueConfig {
        capacity,
        min_ready,
        buckets: buckets.to_vec(),
        pull,
        seed: 42,
    }
}

/// The operations both queues offer, so every test below runs on both.
trait Queue<T>: Send + Sync {
    fn build(config: QueueConfig) -> Result<Self, QueueConfigError>
    where
        Self: Sized;
    fn try_push(&self, item: T) -> Result<(), PushError<T>>;
    fn push(&self, item: T) -> Result<(), PushError<T>>;
    fn push_timeout(&self, item: T, timeout: Duration) -> Result<(), PushError<T>>;
    fn try_pop(&self) -> Result<T, PopError>;
    fn pop(&self) -> Option<T>;
    fn pop_timeout(&self, timeout: Duration) -> Result<T, PopError>;
    fn close(&self);
    fn len(&self) -> usize;
}

macro_rules! impl_queue {
    ($queue:ident) => {
        impl<T: SeqLen + Send> Queue<T> for $queue<T> {
            fn build(config: QueueConfig) -> Result<Self, QueueConfigError> {
                $queue::new(config)
            }
            fn try_push(&self, item: T) -> Result<(), PushError<T>> {
                $queue::try_push(self, item)
            }
            fn push(&self, item: T) -> Result<(), PushError<T>> {
                $queue::push(self, item)
            }
            fn push_timeout(&self, item: T, timeout: Duration) -> Result<(), PushError<T>> {
                $queue::push_timeout(self, item, timeout)
            }
            fn try_pop(&self) -> Result<T, PopError> {
                $queue::try_pop(self)
            }
            fn pop(&self) -> Option<T> {
                $queue::pop(self)
            }
            fn pop_timeout(&self, timeout: Duration) -> Result<T, PopError> {
                $queue::pop_timeout(self, timeout)
            }
            fn close(&self) {
                $queue::close(self)
            }
            fn len(&self) -> usize {
                $queue::len(self)
            }
        }
    };
}
impl_queue!(HsQueue);
impl_queue!(MutexQueue);

/// Runs a generic test body against both queues.
macro_rules! both {
    ($($name:ident),* $(,)?) => {
        mod lockfree {
            $(#[test] fn $name() { super::$name::<draftpipe_runtime::queue::HsQueue<super::Item>>(); })*
        }
        mod baseline {
            $(#[test] fn $name() { super::$name::<draftpipe_runtime::queue::baseline::MutexQueue<super::Item>>(); })*
        }
    };
}

both!(
    bad_configs_are_refused,
    too_long_item_comes_back_with_both_numbers,
    capacity_is_total_over_buckets,
    watermark_holds_until_close,
    close_refuses_pushes_and_drains,
    timeouts_give_up_and_return_the_item,
    fifo_takes_oldest_over_all_buckets,
    round_robin_serves_every_nonempty_bucket_each_round,
    random_in_bucket_serves_every_bucket_each_round,
    random_in_bucket_is_uniform_inside_a_bucket,
    blocked_push_wakes_on_pop,
    blocked_pop_wakes_at_watermark,
    close_releases_blocked_push_and_pop,
);

fn bad_configs_are_refused<Q: Queue<Item>>() {
    let cases = [
        (
            config(0, 0, &[8], PullPolicy::Fifo),
            QueueConfigError::ZeroCapacity,
        ),
        (
            config(4, 5, &[8], PullPolicy::Fifo),
            QueueConfigError::WatermarkAboveCapacity {
                min_ready: 5,
                capacity: 4,
            },
        ),
        (
            config(4, 1, &[], PullPolicy::Fifo),
            QueueConfigError::NoBuckets,
        ),
        (
            config(4, 1, &[0, 8], PullPolicy::Fifo),
            QueueConfigError::ZeroBucket,
        ),
        (
            config(4, 1, &[8, 8], PullPolicy::RoundRobin),
            QueueConfigError::BucketsNotIncreasing {
                previous: 8,
                next: 8,
            },
        ),
        (
            config(usize::MAX, 1, &[8], PullPolicy::RandomInBucket),
            QueueConfigError::CapacityTooLarge {
                capacity: usize::MAX,
                max: draftpipe_runtime::queue::MAX_CAPACITY,
            },
        ),
    ];
    for (config, expected) in cases {
        assert_eq!(Q::build(config).err(), Some(expected));
    }
}

fn too_long_item_comes_back_with_both_numbers<Q: Queue<Item>>() {
    let queue = Q::build(config(4, 1, &[16, 64], PullPolicy::Fifo)).unwrap();
    let err = queue.try_push(item(9, 65)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "sequence length 65 is longer than the largest bucket (64)"
    );
    assert!(matches!(
        err,
        PushError::TooLong {
            len: 65,
            max: 64,
            ..
        }
    ));
    assert_eq!(err.into_inner(), item(9, 65));
    // The bounds are inclusive: 64 fits the last bucket, 16 the first.
    queue.try_push(item(1, 64)).unwrap();
    queue.try_push(item(2, 16)).unwrap();
    assert_eq!(queue.len(), 2);
}

fn capacity_is_total_over_buckets<Q: Queue<Item>>() {
    let queue = Q::build(config(3, 1, &[8, 16, 32], PullPolicy::RoundRobin)).unwrap();
    for (id, len) in [(0, 1), (1, 12), (2, 30)] {
        queue.try_push(item(id, len)).unwrap();
    }
    match queue.try_push(item(3, 5)) {
        Err(PushError::Full(back)) => assert_eq!(back, item(3, 5)),
        other => panic!("expected Full, got {other:?}"),
    }
    queue.try_pop().unwrap();
    queue.try_push(item(3, 5)).unwrap();
    assert_eq!(queue.len(), 3);
}

fn watermark_holds_until_close<Q: Queue<Item>>() {
    let queue = Q::build(config(8, 3, &[8], PullPolicy::Fifo)).unwrap();
    assert_eq!(queue.try_pop().err(), Some(PopError::Empty));
    queue.try_push(item(0, 1)).unwrap();
    queue.try_push(item(1, 1)).unwrap();
    assert_eq!(queue.try_pop().err(), Some(PopError::BelowWatermark));
    assert_eq!(
        queue.pop_timeout(Duration::from_millis(5)).err(),
        Some(PopError::Timeout)
    );
    queue.try_push(item(2, 1)).unwrap();
    assert_eq!(queue.try_pop().map(|i| i.id), Ok(0));
    // Two left, below the watermark again.
    assert_eq!(queue.try_pop().err(), Some(PopError::BelowWatermark));
    queue.close();
    assert_eq!(queue.try_pop().map(|i| i.id), Ok(1));
    assert_eq!(queue.pop().map(|i| i.id), Some(2));
}

fn close_refuses_pushes_and_drains<Q: Queue<Item>>() {
    let queue = Q::build(config(4, 4, &[8, 16], PullPolicy::RandomInBucket)).unwrap();
    queue.try_push(item(0, 3)).unwrap();
    queue.try_push(item(1, 13)).unwrap();
    queue.close();
    assert!(matches!(
        queue.try_push(item(2, 3)),
        Err(PushError::Closed(_))
    ));
    assert!(matches!(queue.push(item(2, 3)), Err(PushError::Closed(_))));
    let mut ids: Vec<usize> = std::iter::from_fn(|| queue.pop()).map(|i| i.id).collect();
    ids.sort_unstable();
    assert_eq!(ids, [0, 1]);
    assert_eq!(queue.try_pop().err(), Some(PopError::Closed));
    assert_eq!(
        queue.pop_timeout(Duration::from_millis(1)).err(),
        Some(PopError::Closed)
    );
    assert_eq!(queue.len(), 0);
}

fn timeouts_give_up_and_return_the_item<Q: Queue<Item>>() {
    let queue = Q::build(config(1, 1, &[8], PullPolicy::Fifo)).unwrap();
    queue
        .push_timeout(item(0, 1), Duration::from_millis(5))
        .unwrap();
    match queue.push_timeout(item(1, 1), Duration::from_millis(5)) {
        Err(PushError::Timeout(back)) => assert_eq!(back.id, 1),
        other => panic!("expected Timeout, got {other:?}"),
    }
    assert_eq!(
        queue.pop_timeout(Duration::from_millis(5)).map(|i| i.id),
        Ok(0)
    );
    assert_eq!(
        queue.pop_timeout(Duration::from_millis(5)).err(),
        Some(PopError::Timeout)
    );
}

fn fifo_takes_oldest_over_all_buckets<Q: Queue<Item>>() {
    let queue = Q::build(config(16, 1, &[8, 16, 32], PullPolicy::Fifo)).unwrap();
    let lens = [30, 2, 2, 15, 31, 1, 9, 9];
    for (id, &len) in lens.iter().enumerate() {
        queue.try_push(item(id, len)).unwrap();
    }
    let ids: Vec<usize> = (0..lens.len())
        .map(|_| queue.try_pop().unwrap().id)
        .collect();
    assert_eq!(ids, (0..lens.len()).collect::<Vec<_>>());
}

/// Pops everything from a queue filled with a skewed spread over four buckets and checks that
/// whenever a bucket is non-empty, it is served within one round of four pops. Returns the
/// bucket and id of every pop.
fn served_within_one_round<Q: Queue<Item>>(pull: PullPolicy) -> Vec<(usize, usize)> {
    let bounds = [8, 16, 32, 64];
    let queue = Q::build(config(64, 1, &bounds, pull)).unwrap();
    // 40 items in the last bucket, 8, 4 and 2 in the others: a heavy bucket that must not crowd
    // out the light ones.
    let spread = [(2, 2), (4, 12), (8, 20), (40, 50)];
    let mut id = 0;
    let mut left = [0usize; 4];
    for (bucket, &(count, len)) in spread.iter().enumerate() {
        for _ in 0..count {
            queue.try_push(item(id, len)).unwrap();
            id += 1;
        }
        left[bucket] = count;
    }
    let bucket_of = |len: usize| bounds.iter().position(|&b| len <= b).unwrap();
    let mut since_served = [0usize; 4];
    let mut pops = Vec::new();
    while let Ok(popped) = queue.try_pop() {
        let served = bucket_of(popped.len);
        left[served] -= 1;
        for (bucket, gap) in since_served.iter_mut().enumerate() {
            if bucket == served {
                *gap = 0;
            } else if left[bucket] > 0 {
                *gap += 1;
                assert!(
                    *gap < bounds.len(),
                    "bucket {bucket} waited {gap} pops with items queued"
                );
            }
        }
        pops.push((served, popped.id));
    }
    assert_eq!(pops.len(), id);
    pops
}

fn round_robin_serves_every_nonempty_bucket_each_round<Q: Queue<Item>>() {
    let pops = served_within_one_round::<Q>(PullPolicy::RoundRobin);
    // Oldest first inside each bucket.
    let mut last_id: HashMap<usize, usize> = HashMap::new();
    for (bucket, id) in pops {
        if let Some(previous) = last_id.insert(bucket, id) {
            assert!(previous < id, "bucket {bucket}: {id} after {previous}");
        }
    }
}

fn random_in_bucket_serves_every_bucket_each_round<Q: Queue<Item>>() {
    let pops = served_within_one_round::<Q>(PullPolicy::RandomInBucket);
    // Random inside a bucket: the heavy bucket's 40 items do not come out in push order.
    let heavy: Vec<usize> = pops.iter().filter(|p| p.0 == 3).map(|p| p.1).collect();
    assert!(heavy.windows(2).any(|w| w[0] > w[1]), "{heavy:?}");
}

fn random_in_bucket_is_uniform_inside_a_bucket<Q: Queue<Item>>() {
    // Which of 8 queued items is taken first, over many seeded queues: each should win about
    // 1/8 of the time. Chi-square with 7 degrees of freedom: 24.3 is the 0.999 quantile.
    const ITEMS: usize = 8;
    const TRIALS: usize = if cfg!(miri) { 400 } else { 4000 };
    let mut wins = [0usize; ITEMS];
    for trial in 0..TRIALS {
        let mut cfg = config(ITEMS, ITEMS, &[100], PullPolicy::RandomInBucket);
        cfg.seed = trial as u64;
        let queue = Q::build(cfg).unwrap();
        for id in 0..ITEMS {
            queue.try_push(item(id, 10)).unwrap();
        }
        wins[queue.try_pop().unwrap().id] += 1;
    }
    let expected = TRIALS as f64 / ITEMS as f64;
    let chi2: f64 = wins
        .iter()
        .map(|&w| (w as f64 - expected).powi(2) / expected)
        .sum();
    assert!(chi2 < 24.3, "first-pick counts {wins:?}, chi2 {chi2}");
}

fn blocked_push_wakes_on_pop<Q: Queue<Item> + 'static>() {
    let queue = Arc::new(Q::build(config(2, 1, &[8], PullPolicy::Fifo)).unwrap());
    queue.try_push(item(0, 1)).unwrap();
    queue.try_push(item(1, 1)).unwrap();
    let producer = {
        let queue = Arc::clone(&queue);
        thread::spawn(move || queue.push(item(2, 1)).map_err(|e| e.to_string()))
    };
    thread::sleep(Duration::from_millis(20));
    assert_eq!(queue.len(), 2, "the push must wait while the queue is full");
    assert_eq!(queue.pop().map(|i| i.id), Some(0));
    producer.join().unwrap().unwrap();
    let ids: Vec<usize> = (0..2).map(|_| queue.pop().unwrap().id).collect();
    assert_eq!(ids, [1, 2]);
}

fn blocked_pop_wakes_at_watermark<Q: Queue<Item> + 'static>() {
    let queue = Arc::new(Q::build(config(8, 3, &[8], PullPolicy::Fifo)).unwrap());
    let popped = Arc::new(AtomicUsize::new(0));
    let consumer = {
        let (queue, popped) = (Arc::clone(&queue), Arc::clone(&popped));
        thread::spawn(move || {
            let first = queue.pop().map(|i| i.id);
            popped.store(1, Ordering::SeqCst);
            first
        })
    };
    for id in 0..2 {
        queue.push(item(id, 1)).unwrap();
        thread::sleep(Duration::from_millis(10));
        assert_eq!(
            popped.load(Ordering::SeqCst),
            0,
            "popped below the watermark"
        );
    }
    queue.push(item(2, 1)).unwrap();
    assert_eq!(consumer.join().unwrap(), Some(0));
}

fn close_releases_blocked_push_and_pop<Q: Queue<Item> + 'static>() {
    let full = Arc::new(Q::build(config(1, 1, &[8], PullPolicy::Fifo)).unwrap());
    full.try_push(item(0, 1)).unwrap();
    let producer = {
        let full = Arc::clone(&full);
        thread::spawn(move || match full.push(item(1, 1)) {
            Err(PushError::Closed(back)) => back.id,
            other => panic!("expected Closed, got {other:?}"),
        })
    };
    let starved = Arc::new(Q::build(config(4, 2, &[8], PullPolicy::Fifo)).unwrap());
    starved.try_push(item(2, 1)).unwrap();
    let consumer = {
        let starved = Arc::clone(&starved);
        thread::spawn(move || {
            let ids: Vec<usize> = std::iter::from_fn(|| starved.pop()).map(|i| i.id).collect();
            ids
        })
    };
    thread::sleep(Duration::from_millis(20));
    full.close();
    starved.close();
    assert_eq!(producer.join().unwrap(), 1, "the refused item comes back");
    assert_eq!(
        consumer.join().unwrap(),
        [2],
        "close lifts the watermark, then ends the pops"
    );
}

/// Counts drops, so leaks and double drops both show.
struct Counted {
    len: usize,
    drops: Arc<AtomicUsize>,
}

impl SeqLen for Counted {
    fn seq_len(&self) -> usize {
        self.len
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.drops.fetch_add(1, Ordering::SeqCst);
    }
}

/// Fills a queue (over 64 items in one bucket, so the random store's second bitmap word is
/// used), pops some, drops the queue, and checks every item was dropped exactly once.
fn drops_left_items<Q: Queue<Counted>>() {
    for pull in [
        PullPolicy::Fifo,
        PullPolicy::RoundRobin,
        PullPolicy::RandomInBucket,
    ] {
        let drops = Arc::new(AtomicUsize::new(0));
        let queue = Q::build(config(130, 1, &[4, 8, 16], pull)).unwrap();
        for i in 0..100 {
            let len = if i < 70 { 16 } else { i % 8 + 1 };
            let counted = Counted {
                len,
                drops: Arc::clone(&drops),
            };
            assert!(queue.try_push(counted).is_ok());
        }
        for _ in 0..30 {
            drop(queue.try_pop().unwrap());
        }
        assert_eq!(drops.load(Ordering::SeqCst), 30);
        drop(queue);
        assert_eq!(drops.load(Ordering::SeqCst), 100, "{pull:?}");
    }
}

#[test]
fn lockfree_drops_items_left_in_a_dropped_queue() {
    drops_left_items::<HsQueue<Counted>>();
}

#[test]
fn baseline_drops_items_left_in_a_dropped_queue() {
    drops_left_items::<MutexQueue<Counted>>();
}

#[test]
fn config_routes_a_length_to_the_first_bucket_that_holds_it() {
    let config = QueueConfig {
        capacity: 20,
        min_ready: 10,
        buckets: vec![512, 1024, 2048],
        pull: PullPolicy::RandomInBucket,
        seed: 9,
    };
    assert_eq!(config.bucket_of(1), Some(0));
    assert_eq!(config.bucket_of(512), Some(0));
    assert_eq!(config.bucket_of(513), Some(1));
    assert_eq!(config.bucket_of(2049), None);
}

#[test]
fn stats_report_depth_traffic_and_waiting() {
    let queue = Arc::new(HsQueue::new(config(2, 2, &[8, 16], PullPolicy::RoundRobin)).unwrap());
    assert_eq!(queue.try_pop().err(), Some(PopError::Empty));
    queue.try_push(item(0, 3)).unwrap();
    queue.try_push(item(1, 12)).unwrap();
    assert!(matches!(
        queue.try_push(item(2, 12)),
        Err(PushError::Full(_))
    ));
    assert_eq!(queue.stats().per_bucket, vec![1, 1]);
    assert_eq!(queue.try_pop().map(|i| i.id), Ok(0));
    assert_eq!(queue.try_pop().err(), Some(PopError::BelowWatermark));
    let below_before = queue.stats().seen_below_watermark;
    let consumer = {
        let queue = Arc::clone(&queue);
        // One item queued, watermark two: this pop waits for the push below.
        thread::spawn(move || queue.pop().map(|i| i.id))
    };
    // The pop counts the watermark it found before it parks: from then on it is waiting, and the push comes
    // 20 ms later, however late a loaded machine started the thread.
    wait_until("the pop found the queue below its watermark", || {
        queue.stats().seen_below_watermark > below_before
    });
    thread::sleep(Duration::from_millis(20));
    queue.try_push(item(3, 5)).unwrap();
    // Round-robin: bucket 0 was served last, so bucket 1 is next.
    assert_eq!(consumer.join().unwrap(), Some(1));
    let stats = queue.stats();
    assert_eq!(stats.pushes, 3);
    assert_eq!(stats.pops, 2);
    assert_eq!(stats.depth, 1);
    assert_eq!(stats.per_bucket, vec![1, 0]);
    assert_eq!(stats.capacity, 2);
    assert_eq!(stats.min_ready, 2);
    assert_eq!(stats.seen_full, 1);
    assert!(stats.seen_below_watermark >= 3, "{stats:?}");
    assert!(
        stats.consumer_blocked >= Duration::from_millis(5),
        "{stats:?}"
    );
    let json = serde_json::to_value(&stats).unwrap();
    assert_eq!(json["per_bucket"], serde_json::json!([1, 0]));
    assert_eq!(json["seen_full"], serde_json::json!(1));
}

/// Polls `condition` until it holds, failing the test after 30 s.
fn wait_until(what: &str, condition: impl Fn() -> bool) {
    let started = Instant::now();
    while !condition() {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{what}: not within 30 s"
        );
        thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn producer_blocked_time_is_counted() {
    let queue = Arc::new(HsQueue::new(config(1, 1, &[8], PullPolicy::Fifo)).unwrap());
    queue.try_push(item(0, 1)).unwrap();
    let consumer = {
        let queue = Arc::clone(&queue);
        thread::spawn(move || {
            // The push counts the full queue before it parks: it has waited 30 ms when this pop frees a slot.
            wait_until("the push found the queue full", || {
                queue.stats().seen_full > 0
            });
            thread::sleep(Duration::from_millis(30));
            queue.pop().unwrap()
        })
    };
    queue.push(item(1, 1)).unwrap();
    consumer.join().unwrap();
    let stats = queue.stats();
    assert_eq!(stats.seen_full, 1);
    assert!(
        stats.producer_blocked >= Duration::from_millis(10),
        "{stats:?}"
    );
}

#[test]
fn queue_is_send_and_sync_for_send_items() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<HsQueue<Box<Item>>>();
    assert_send_sync::<MutexQueue<Box<Item>>>();
}
