//! The hidden-state queue against its `Mutex<VecDeque>` + `Condvar` baseline, measured in the
//! same run: an uncontended push+pop pair, throughput with 1, 2 and 4 threads on each side, and
//! the hand-off latency from a push to a parked consumer waking (criterion's mean per queue,
//! then median and p99 from 2000 hand-offs to each queue in alternation, printed after the
//! group). Items are 8-byte handles, as in the pipeline (a `Box` or a pool index).
//!
//! `cargo bench --bench queue` (short check: append `-- --warm-up-time 1 --measurement-time 2`).

use std::hint::black_box;
use std::sync::{Arc, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use criterion::{
    BenchmarkId, Criterion, SamplingMode, Throughput, criterion_group, criterion_main,
};
use draftpipe_runtime::queue::baseline::MutexQueue;
use draftpipe_runtime::queue::{HsQueue, PullPolicy, PushError, QueueConfig, SeqLen};

/// A queue handle: what the pipeline moves (here just the sequence length it routes by).
#[derive(Clone, Copy)]
struct Handle(usize);

impl SeqLen for Handle {
    fn seq_len(&self) -> usize {
        self.0
    }
}

/// A handle stamped with its push time, for the hand-off latency.
struct Stamped(Instant);

impl SeqLen for Stamped {
    fn seq_len(&self) -> usize {
        1
    }
}

const BUCKETS: [usize; 4] = [512, 1024, 2048, 4096];

fn config(capacity: usize, min_ready: usize, pull: PullPolicy) -> QueueConfig {
    QueueConfig {
        capacity,
        min_ready,
        buckets: BUCKETS.to_vec(),
        pull,
        seed: 5,
    }
}

/// The operations the benchmarks use, so each runs the same code on both queues.
trait Queue<T>: Send + Sync + Sized {
    const NAME: &'static str;
    fn build(config: QueueConfig) -> Self;
    fn try_push(&self, item: T) -> Result<(), PushError<T>>;
    fn push(&self, item: T) -> Result<(), PushError<T>>;
    fn try_pop(&self) -> Option<T>;
    fn pop(&self) -> Option<T>;
    fn close(&self);
}

macro_rules! impl_queue {
    ($queue:ident, $name:literal) => {
        impl<T: SeqLen + Send> Queue<T> for $queue<T> {
            const NAME: &'static str = $name;
            fn build(config: QueueConfig) -> Self {
                $queue::new(config).expect("benchmark configs are valid")
            }
            fn try_push(&self, item: T) -> Result<(), PushError<T>> {
                $queue::try_push(self, item)
            }
            fn push(&self, item: T) -> Result<(), PushError<T>> {
                $queue::push(self, item)
            }
            fn try_pop(&self) -> Option<T> {
                $queue::try_pop(self).ok()
            }
            fn pop(&self) -> Option<T> {
                $queue::pop(self)
            }
            fn close(&self) {
                $queue::close(self)
            }
        }
    };
}
impl_queue!(HsQueue, "lockfree");
impl_queue!(MutexQueue, "baseline");

const POLICIES: [(PullPolicy, &str); 3] = [
    (PullPolicy::Fifo, "fifo"),
    (PullPolicy::RoundRobin, "round_robin"),
    (PullPolicy::RandomInBucket, "random_in_bucket"),
];

/// One thread, a queue holding 16 handles spread over the buckets: pop one, push it back.
fn pair<Q: Queue<Handle>>(
    c: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    pull: PullPolicy,
    policy: &str,
) {
    let queue = Q::build(config(64, 1, pull));
    for i in 0..16 {
        assert!(queue.try_push(Handle(i * 256 + 1)).is_ok());
    }
    c.bench_function(BenchmarkId::new(Q::NAME, policy), |b| {
        b.iter(|| {
            let handle = queue.try_pop().expect("16 queued");
            assert!(queue.try_push(black_box(handle)).is_ok());
        });
    });
}

fn uncontended_pair(c: &mut Criterion) {
    let mut group = c.benchmark_group("queue_pair");
    for (pull, policy) in POLICIES {
        pair::<HsQueue<Handle>>(&mut group, pull, policy);
        pair::<MutexQueue<Handle>>(&mut group, pull, policy);
    }
    group.finish();
}

/// Items moved per measured iteration of the throughput benchmark.
const ITEMS: usize = 100_000;

/// `threads` producers push `ITEMS` handles with blocking pushes; `threads` consumers pop until
/// the queue is closed and drained. Returns the wall time of the whole transfer.
fn transfer<Q: Queue<Handle>>(pull: PullPolicy, threads: usize) -> Duration {
    let queue = Q::build(config(64, 8, pull));
    let start = Instant::now();
    thread::scope(|scope| {
        let consumers: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    let mut taken = 0usize;
                    while let Some(handle) = queue.pop() {
                        black_box(handle);
                        taken += 1;
                    }
                    taken
                })
            })
            .collect();
        let producers: Vec<_> = (0..threads)
            .map(|p| {
                let queue = &queue;
                scope.spawn(move || {
                    for i in (p..ITEMS).step_by(threads) {
                        assert!(queue.push(Handle(i % 4096 + 1)).is_ok());
                    }
                })
            })
            .collect();
        for producer in producers {
            producer.join().expect("producer panicked");
        }
        queue.close();
        let taken: usize = consumers
            .into_iter()
            .map(|c| c.join().expect("consumer panicked"))
            .sum();
        assert_eq!(taken, ITEMS);
    });
    start.elapsed()
}

fn throughput(c: &mut Criterion) {
    let mut group = c.benchmark_group("queue_throughput");
    group
        .sampling_mode(SamplingMode::Flat)
        .sample_size(10)
        .throughput(Throughput::Elements(ITEMS as u64));
    for (pull, policy) in [POLICIES[0], POLICIES[2]] {
        for threads in [1, 2, 4] {
            let id = |name| BenchmarkId::new(name, format!("{policy}/{threads}x{threads}"));
            group.bench_function(id("lockfree"), |b| {
                b.iter_custom(|iters| {
                    (0..iters)
                        .map(|_| transfer::<HsQueue<Handle>>(pull, threads))
                        .sum()
                });
            });
            group.bench_function(id("baseline"), |b| {
                b.iter_custom(|iters| {
                    (0..iters)
                        .map(|_| transfer::<MutexQueue<Handle>>(pull, threads))
                        .sum()
                });
            });
        }
    }
    group.finish();
}

/// Whether thread `tid` of this process is asleep in the kernel (state `S`): a consumer parked
/// on its condition variable, not spinning or yielding.
fn is_sleeping(tid: &str) -> Option<bool> {
    let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).ok()?;
    // The state follows the parenthesised command name, which may itself contain spaces.
    let state = stat.rsplit_once(')')?.1.trim_start().chars().next()?;
    Some(state == 'S')
}

/// A consumer thread blocked in `pop` on its own queue, and the channel it reports on.
struct HandoffRig<Q: Queue<Stamped> + 'static> {
    queue: Arc<Q>,
    latencies: mpsc::Receiver<Duration>,
    consumer_tid: String,
    consumer: thread::JoinHandle<()>,
}

impl<Q: Queue<Stamped> + 'static> HandoffRig<Q> {
    fn start() -> Self {
        let queue = Arc::new(Q::build(config(64, 1, PullPolicy::Fifo)));
        let (report, latencies) = mpsc::channel();
        let (tid_report, tid) = mpsc::channel();
        let consumer = {
            let queue = Arc::clone(&queue);
            thread::spawn(move || {
                // "PID/task/TID" names this thread for the parked check.
                let me = std::fs::read_link("/proc/thread-self")
                    .ok()
                    .and_then(|path| path.file_name().map(|n| n.to_string_lossy().into_owned()))
                    .unwrap_or_default();
                tid_report.send(me).expect("bench thread alive");
                while let Some(Stamped(pushed)) = queue.pop() {
                    report.send(pushed.elapsed()).expect("bench thread alive");
                }
            })
        };
        let consumer_tid = tid.recv().expect("consumer started");
        Self {
            queue,
            latencies,
            consumer_tid,
            consumer,
        }
    }

    /// Waits until the consumer is asleep in `pop`, pushes a stamped item, and returns how long
    /// after the push the consumer returned with it.
    fn handoff(&self) -> Duration {
        let parked_by = Instant::now() + Duration::from_millis(20);
        while is_sleeping(&self.consumer_tid) == Some(false) && Instant::now() < parked_by {
            thread::sleep(Duration::from_micros(20));
        }
        if is_sleeping(&self.consumer_tid).is_none() {
            // No /proc: give the consumer ample time to finish its bounded spin and park.
            thread::sleep(Duration::from_micros(500));
        }
        assert!(self.queue.push(Stamped(Instant::now())).is_ok());
        self.latencies.recv().expect("consumer alive")
    }

    fn finish(self) {
        self.queue.close();
        self.consumer.join().expect("consumer panicked");
    }
}

fn handoffs<Q: Queue<Stamped> + 'static>(iters: u64) -> Duration {
    let rig = HandoffRig::<Q>::start();
    let total = (0..iters).map(|_| rig.handoff()).sum();
    rig.finish();
    total
}

fn percentile(sorted: &[Duration], q: f64) -> Duration {
    let index = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[index]
}

/// Hand-offs to both queues in alternation, so both see the same machine load; prints the
/// median and p99 of each.
fn interleaved_percentiles(rounds: usize) {
    let lockfree = HandoffRig::<HsQueue<Stamped>>::start();
    let baseline = HandoffRig::<MutexQueue<Stamped>>::start();
    let mut samples = [Vec::with_capacity(rounds), Vec::with_capacity(rounds)];
    // Which queue goes first in a round changes its latency (measured: about 3 µs first,
    // 13 µs second, either queue), so the order alternates.
    for round in 0..rounds {
        if round % 2 == 0 {
            samples[0].push(lockfree.handoff());
            samples[1].push(baseline.handoff());
        } else {
            samples[1].push(baseline.handoff());
            samples[0].push(lockfree.handoff());
        }
    }
    lockfree.finish();
    baseline.finish();
    for (name, samples) in ["lockfree", "baseline"].into_iter().zip(&mut samples) {
        samples.sort_unstable();
        println!(
            "queue_handoff/{name}: {} hand-offs to a parked consumer (interleaved), median {:.1} µs, p99 {:.1} µs",
            samples.len(),
            percentile(samples, 0.5).as_secs_f64() * 1e6,
            percentile(samples, 0.99).as_secs_f64() * 1e6,
        );
    }
}

fn handoff_latency(c: &mut Criterion) {
    let mut group = c.benchmark_group("queue_handoff");
    // The measured time is only the hand-offs, but each also waits for the consumer to park.
    group
        .sampling_mode(SamplingMode::Flat)
        .sample_size(10)
        .warm_up_time(Duration::from_millis(20))
        .measurement_time(Duration::from_millis(60));
    group.bench_function("lockfree", |b| {
        b.iter_custom(handoffs::<HsQueue<Stamped>>);
    });
    group.bench_function("baseline", |b| {
        b.iter_custom(handoffs::<MutexQueue<Stamped>>);
    });
    group.finish();
    interleaved_percentiles(2000);
}

criterion_group!(benches, uncontended_pair, throughput, handoff_latency);
criterion_main!(benches);
