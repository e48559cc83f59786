//! The discrete-event engine: producers, the bucketed queue and drafters on one simulated clock.
//!
//! ```text
//!  producer p: produce (time ~ item distribution) ─▶ push ──full?──▶ blocked until a pop makes room
//!  queue:      per-bucket counts (fifo: arrival order), capacity, watermark max(min_ready, 1)
//!  drafter d:  wait until depth ≥ watermark ─▶ pop (pull policy) ─▶ step (time ~ its bucket's distribution)
//!              ─▶ lockstep: wait at the all-reduce for every drafter ─▶ all-reduce ─▶ next pop
//!  rounds:     lockstep drafters pop together: one bucket holding an item per drafter, one item each
//! ```
//!
//! The queue keeps the runtime's rules (`runtime/src/queue`, `docs/queue.md`): a push needs `depth < capacity`
//! and otherwise blocks; a pop needs `depth ≥ max(min_ready, 1)`, so after drafters drain it below the
//! watermark they wait for it to refill to `min_ready`, not for one item; `round_robin` and `random_in_bucket`
//! visit the non-empty buckets from a shared cursor and move it past the one served, `fifo` takes the oldest
//! item. Items of one bucket are alike to the model (same tokens, same step-time distribution), so the random
//! pick inside a bucket and the oldest-first pick time out the same. A waiting drafter or blocked producer is
//! served in the order it began waiting, as the queue's parking does for the ones that sleep.
//!
//! With [`Model::rounds`] (what the runtime does under `sync = allreduce` with several drafters, see
//! `runtime/src/queue/rounds.rs`) the group takes a round once all of it waits: the buckets holding one item
//! per drafter, round-robin from a cursor, while `depth ≥ max(watermark, drafters)`; so a round's time is its
//! one bucket's step on every drafter (each with its own spread). Without it, each drafter pops on its own and
//! the round waits for the slowest bucket among them.
//!
//! Every figure is time-weighted over the measured part of the run (after a warm-up share of the simulated
//! time, which starts empty, as a run does): the depth histogram, producers' blocked time, drafters' data wait
//! and all-reduce wait, and token slots of the steps that complete in it.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, VecDeque};

use draftpipe_compiler::plan::PullPolicy;

use super::Model;

/// What one simulation measured, over its measured window.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// Simulated seconds measured (after the warm-up share).
    pub measured_s: f64,
    /// Token slots (padded lengths) of the steps completed in the window, per second.
    pub slots_per_s: f64,
    /// Global steps completed in the window (rounds under lockstep; steps of all drafters otherwise).
    pub steps: u64,
    /// Share of the window at each depth `0..=capacity`.
    pub depth_share: Vec<f64>,
    /// Share of the producers' time blocked on a full queue.
    pub producer_blocked: f64,
    /// Share of the drafters' time waiting for data.
    pub drafter_wait: f64,
    /// Share of the drafters' time waiting at the all-reduce for the slowest peer.
    pub drafter_barrier: f64,
    /// Events processed (for the speed figure).
    pub events: u64,
    /// The simulated time at which the engine stopped at its event bound, before the time asked for.
    pub stopped_at: Option<f64>,
}

impl Outcome {
    /// Mean depth over the window.
    pub fn mean_depth(&self) -> f64 {
        self.depth_share
            .iter()
            .enumerate()
            .map(|(d, share)| d as f64 * share)
            .sum()
    }

    /// The smallest depth at or below which `q` of the time was spent.
    pub fn depth_quantile(&self, q: f64) -> usize {
        let mut cumulative = 0.0;
        for (depth, share) in self.depth_share.iter().enumerate() {
            cumulative += share;
            if cumulative >= q - 1e-12 {
                return depth;
            }
        }
        self.depth_share.len().saturating_sub(1)
    }

    /// Share of time at a depth that satisfies `keep`.
    pub fn share_where(&self, keep: impl Fn(usize) -> bool) -> f64 {
        self.depth_share
            .iter()
            .enumerate()
            .filter(|(d, _)| keep(*d))
            .map(|(_, s)| s)
            .sum()
    }
}

/// The log-normal time of this mean and standard deviation at standard normal `z`.
fn lognormal(mean: f64, std: f64, z: f64) -> f64 {
    if std <= 0.0 || mean <= 0.0 {
        return mean.max(0.0);
    }
    let sigma2 = (1.0 + (std / mean).powi(2)).ln();
    let mu = mean.ln() - sigma2 / 2.0;
    (mu + sigma2.sqrt() * z).exp()
}

/// SplitMix64 with Box–Muller normals: seeded, tiny, and fixed here so a seed replays the same run forever.
struct Random {
    state: u64,
    spare: Option<f64>,
}

impl Random {
    fn new(seed: u64) -> Self {
        Self {
            state: seed ^ 0x5151_7E1E_0000_0004,
            spare: None,
        }
    }

    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `(0, 1]`.
    fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    fn normal(&mut self) -> f64 {
        if let Some(z) = self.spare.take() {
            return z;
        }
        let (u, v) = (self.unit(), self.unit());
        let radius = (-2.0 * u.ln()).sqrt();
        let angle = std::f64::consts::TAU * v;
        self.spare = Some(radius * angle.sin());
        radius * angle.cos()
    }

    /// A positive time with this mean and standard deviation: log-normal (service times are skewed to the
    /// right and never negative); exactly `mean` when `std` is 0.
    fn duration(&mut self, mean: f64, std: f64) -> f64 {
        let z = self.normal();
        lognormal(mean, std, z)
    }

    /// An index drawn with the probabilities in `cdf` (cumulative, last ≈ 1).
    fn pick(&mut self, cdf: &[f64]) -> usize {
        let u = self.unit() * cdf.last().copied().unwrap_or(1.0);
        cdf.iter()
            .position(|&c| u <= c)
            .unwrap_or(cdf.len().saturating_sub(1))
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Event {
    Produced(usize),
    Stepped(usize),
    RoundDone,
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct Scheduled {
    at: f64,
    order: u64,
    event: Event,
}

impl Eq for Scheduled {}

impl PartialOrd for Scheduled {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Scheduled {
    /// Earliest first in a max-heap; ties in schedule order, so a run is reproducible.
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .at
            .total_cmp(&self.at)
            .then(other.order.cmp(&self.order))
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Drafter {
    Waiting { since: f64 },
    Stepping { bucket: usize },
    AtBarrier { since: f64, bucket: usize },
}

/// The queue's state: counts per bucket, arrival order for `fifo`, the round-robin cursor.
struct Queue {
    counts: Vec<usize>,
    arrivals: VecDeque<usize>,
    depth: usize,
    cursor: usize,
    pull: PullPolicy,
}

impl Queue {
    fn push(&mut self, bucket: usize) {
        self.counts[bucket] += 1;
        self.depth += 1;
        if self.pull == PullPolicy::Fifo {
            self.arrivals.push_back(bucket);
        }
    }

    /// The bucket of the next round of `members` items (the runtime's rule: buckets in turn among those that
    /// hold a round), taking them; `None` if no bucket holds one.
    fn pop_round(&mut self, members: usize) -> Option<usize> {
        let n = self.counts.len();
        let bucket = (0..n)
            .map(|k| (self.cursor + k) % n)
            .find(|&b| self.counts[b] >= members)?;
        self.cursor = bucket + 1;
        self.counts[bucket] -= members;
        self.depth -= members;
        Some(bucket)
    }

    fn pop(&mut self) -> usize {
        let bucket = match self.pull {
            PullPolicy::Fifo => self.arrivals.pop_front().unwrap_or(0),
            PullPolicy::RoundRobin | PullPolicy::RandomInBucket => {
                let n = self.counts.len();
                let bucket = (0..n)
                    .map(|k| (self.cursor + k) % n)
                    .find(|&b| self.counts[b] > 0)
                    .unwrap_or(0);
                self.cursor = bucket + 1;
                bucket
            }
        };
        self.counts[bucket] -= 1;
        self.depth -= 1;
        bucket
    }
}

/// The simulation of one model for `duration_s` simulated seconds, the first `warmup_share` of them unmeasured,
/// stopping after `max_events` events (and saying when, in [`Outcome::stopped_at`]).
pub(super) fn simulate(
    model: &Model,
    duration_s: f64,
    warmup_share: f64,
    seed: u64,
    max_events: u64,
) -> Outcome {
    let mut random = Random::new(seed);
    let capacity = model.capacity;
    let watermark = model.min_ready.max(1);
    let mut cdf = Vec::with_capacity(model.buckets.len());
    let mut total = 0.0;
    for bucket in &model.buckets {
        total += bucket.share;
        cdf.push(total);
    }
    let mut queue = Queue {
        counts: vec![0; model.buckets.len()],
        arrivals: VecDeque::new(),
        depth: 0,
        cursor: 0,
        pull: model.pull,
    };
    let measure_from = duration_s * warmup_share;
    let mut heap = BinaryHeap::new();
    let mut order = 0u64;
    let mut schedule = |heap: &mut BinaryHeap<Scheduled>, at: f64, event: Event| {
        order += 1;
        heap.push(Scheduled { at, order, event });
    };

    // Time-weighted accounting, clipped to the measured window.
    let measured = |from: f64, to: f64| (to.min(duration_s) - from.max(measure_from)).max(0.0);
    let mut depth_time = vec![0.0; capacity + 1];
    let mut depth_since = 0.0;
    let mut blocked_time = 0.0;
    let mut wait_time = 0.0;
    let mut barrier_time = 0.0;
    let mut slots = 0.0;
    let mut steps = 0u64;
    let mut events = 0u64;

    let mut blocked: VecDeque<(usize, f64, usize)> = VecDeque::new();
    let mut drafters = vec![Drafter::Waiting { since: 0.0 }; model.drafters];
    let mut waiting: VecDeque<usize> = (0..model.drafters).collect();
    let mut at_barrier = 0usize;
    // The part of the step-time spread common to every drafter of a round (the machine, not the replica).
    let common = model.step_common_share.clamp(0.0, 1.0);
    let mut round_z = random.normal();

    for p in 0..model.producers {
        let at = random.duration(model.produce_mean_s, model.produce_std_s);
        schedule(&mut heap, at, Event::Produced(p));
    }

    let mut stopped_at = None;
    while let Some(Scheduled { at: now, event, .. }) = heap.pop() {
        if now > duration_s {
            break;
        }
        if events == max_events {
            stopped_at = Some(now);
            break;
        }
        events += 1;
        let depth_changed = |depth_time: &mut Vec<f64>, depth: usize, depth_since: &mut f64| {
            depth_time[depth] += measured(*depth_since, now);
            *depth_since = now;
        };
        match event {
            Event::Produced(p) => {
                let bucket = random.pick(&cdf);
                if queue.depth < capacity {
                    depth_changed(&mut depth_time, queue.depth, &mut depth_since);
                    queue.push(bucket);
                    let next = now + random.duration(model.produce_mean_s, model.produce_std_s);
                    schedule(&mut heap, next, Event::Produced(p));
                } else {
                    blocked.push_back((p, now, bucket));
                }
            }
            Event::Stepped(d) => {
                let Drafter::Stepping { bucket } = drafters[d] else {
                    unreachable!("only a stepping drafter finishes a step")
                };
                if model.lockstep && model.drafters > 1 {
                    drafters[d] = Drafter::AtBarrier { since: now, bucket };
                    at_barrier += 1;
                    if at_barrier == model.drafters {
                        schedule(&mut heap, now + model.all_reduce_s, Event::RoundDone);
                    }
                } else {
                    if now >= measure_from {
                        slots += model.buckets[bucket].tokens as f64;
                        steps += 1;
                    }
                    drafters[d] = Drafter::Waiting { since: now };
                    waiting.push_back(d);
                }
            }
            Event::RoundDone => {
                let round_done = now;
                for (d, state) in drafters.iter_mut().enumerate() {
                    if let Drafter::AtBarrier { since, bucket } = *state {
                        barrier_time += measured(since, round_done);
                        if round_done >= measure_from {
                            slots += model.buckets[bucket].tokens as f64;
                        }
                        *state = Drafter::Waiting { since: round_done };
                        waiting.push_back(d);
                    }
                }
                if round_done >= measure_from {
                    steps += 1;
                }
                at_barrier = 0;
                round_z = random.normal();
            }
        }
        // Under rounds, hand the whole group one round once all of it waits; each item lets one blocked
        // producer in.
        let rounds = model.rounds && model.lockstep && model.drafters > 1;
        if rounds && waiting.len() == model.drafters && queue.depth >= watermark.max(model.drafters)
        {
            depth_changed(&mut depth_time, queue.depth, &mut depth_since);
            if let Some(bucket) = queue.pop_round(model.drafters) {
                let spec = &model.buckets[bucket];
                while let Some(d) = waiting.pop_front() {
                    let Drafter::Waiting { since } = drafters[d] else {
                        unreachable!("only waiting drafters queue for items")
                    };
                    wait_time += measured(since, now);
                    let z = common.sqrt() * round_z + (1.0 - common).sqrt() * random.normal();
                    let step = lognormal(spec.step_mean_s, spec.step_std_s, z);
                    drafters[d] = Drafter::Stepping { bucket };
                    schedule(&mut heap, now + step, Event::Stepped(d));
                    if let Some((p, since, item)) = blocked.pop_front() {
                        blocked_time += measured(since, now);
                        depth_changed(&mut depth_time, queue.depth, &mut depth_since);
                        queue.push(item);
                        let next = now + random.duration(model.produce_mean_s, model.produce_std_s);
                        schedule(&mut heap, next, Event::Produced(p));
                    }
                }
            }
        }
        // Hand items to waiting drafters while the watermark holds; each pop lets one blocked producer in.
        while !rounds && queue.depth >= watermark {
            let Some(d) = waiting.pop_front() else { break };
            let Drafter::Waiting { since } = drafters[d] else {
                unreachable!("only waiting drafters queue for items")
            };
            wait_time += measured(since, now);
            depth_changed(&mut depth_time, queue.depth, &mut depth_since);
            let bucket = queue.pop();
            let spec = &model.buckets[bucket];
            let z = common.sqrt() * round_z + (1.0 - common).sqrt() * random.normal();
            let step = lognormal(spec.step_mean_s, spec.step_std_s, z);
            drafters[d] = Drafter::Stepping { bucket };
            schedule(&mut heap, now + step, Event::Stepped(d));
            if let Some((p, since, item)) = blocked.pop_front() {
                blocked_time += measured(since, now);
                depth_changed(&mut depth_time, queue.depth, &mut depth_since);
                queue.push(item);
                let next = now + random.duration(model.produce_mean_s, model.produce_std_s);
                schedule(&mut heap, next, Event::Produced(p));
            }
        }
    }

    // Close the open intervals at the end of the simulated time.
    let end = duration_s;
    depth_time[queue.depth] += measured(depth_since, end);
    for &(_, since, _) in &blocked {
        blocked_time += measured(since, end);
    }
    for state in &drafters {
        match *state {
            Drafter::Waiting { since } => wait_time += measured(since, end),
            Drafter::AtBarrier { since, .. } => barrier_time += measured(since, end),
            Drafter::Stepping { .. } => {}
        }
    }
    let window = (duration_s - measure_from).max(f64::MIN_POSITIVE);
    let share = |time: f64, workers: usize| (time / (window * workers.max(1) as f64)).min(1.0);
    Outcome {
        measured_s: window,
        slots_per_s: slots / window,
        steps,
        depth_share: depth_time.iter().map(|t| t / window).collect(),
        producer_blocked: share(blocked_time, model.producers),
        drafter_wait: share(wait_time, model.drafters),
        drafter_barrier: share(barrier_time, model.drafters),
        events,
        stopped_at,
    }
}
