//! The hot-path side: per-worker lock-free counters and span rings, and the snapshots the telemetry thread
//! reads from them.
//!
//! Each worker owns one cache-padded slot. Its recorder is the only writer of that slot (the claim in
//! [`Telemetry::drafter`] / [`Telemetry::producer`] guarantees it), so recording is a few relaxed atomic adds on
//! a cache line no other thread writes, plus, when tracing, one `ArrayQueue::force_push` of a 24-byte span into
//! a ring allocated up front. Nothing allocates per step.
//!
//! **Open spans.** A span is recorded when it ends, but a status line must also count the part of a span still
//! running (a 3 s step under a 1 s period). So each slot also publishes the phase its worker is in now and since
//! when (one packed atomic, [`OpenSpan`]): a drafter is *waiting* from [`DrafterRecorder::waiting`] until its data
//! wait is recorded, then *inside the step* until [`DrafterRecorder::step_done`]. The recorded spans start where
//! the open one started, so "closed totals + open part up to `now`" is a cumulative time that only grows, and the
//! difference of two snapshots is exactly the time inside the interval between them.
//!
//! **Consistent reads.** A writer bumps its slot's sequence number to odd, updates the counters and the open span,
//! and bumps it to even (a seqlock: two plain stores on the writer's own cache line); [`Telemetry::snapshot`] retries
//! a slot whose sequence changed or was odd while it read, so a span is never counted both as closed and as open.
//!
//! **Warm-up.** [`DrafterRecorder::begin_step`] names the step's bucket; the first step of each bucket (workspace
//! allocation, graph capture, the first fill of the queue) is counted apart as warm-up, with its phases, so the
//! diagnosis can judge the steady state alone. Steady steps also feed per-bucket step-time statistics (count,
//! mean, spread) that `draftpipe simulate --from RUN_DIR` models the drafters with.

use std::cell::Cell;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering, fence};
use std::time::{Duration, Instant};

use crossbeam_queue::ArrayQueue;
use crossbeam_utils::CachePadded;

use super::TelemetryError;
use super::counts::{
    BucketSteps, DrafterCounts, PhaseCount, ProducerCounts, StepTokens, Taus, TelemetrySnapshot,
};
use super::phase::{DrafterPhase, ProducerPhase};

/// One recorded span: a phase of one worker, relative to the telemetry epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Span {
    pub(crate) phase: u8,
    pub(crate) start_ns: u64,
    pub(crate) duration_ns: u64,
}

#[derive(Default)]
struct PhaseCounter {
    total_ns: AtomicU64,
    count: AtomicU64,
}

impl PhaseCounter {
    fn add(&self, nanos: u64) {
        self.total_ns.fetch_add(nanos, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    fn read(&self) -> PhaseCount {
        PhaseCount {
            total: Duration::from_nanos(self.total_ns.load(Ordering::Relaxed)),
            count: self.count.load(Ordering::Relaxed),
        }
    }
}

/// Most distinct buckets whose step times are kept apart; a plan with more shares the last entry.
pub const MAX_BUCKET_STATS: usize = 16;

/// Block slots whose latest accuracy a drafter's counters keep (`dflash`; later slots are left out).
pub const MAX_SLOT_METRICS: usize = 32;

/// Steps whose loss, τ and slot accuracy the summary's final figures average: the last step alone is often a
/// part-filled item (the data's end, a stream's last message) whose loss says little; ten steps smooth that
/// while still describing the model as it ends.
pub const FINAL_STEPS: usize = 10;

/// Running sums of one bucket's steady-state step times (seconds, stored as `f64` bits; one writer).
#[derive(Default)]
struct BucketCounter {
    padded_len: AtomicU64,
    steps: AtomicU64,
    sum_bits: AtomicU64,
    sum_squares_bits: AtomicU64,
}

impl BucketCounter {
    fn read(&self) -> Option<BucketSteps> {
        let steps = self.steps.load(Ordering::Relaxed);
        (steps > 0).then(|| BucketSteps {
            padded_len: self.padded_len.load(Ordering::Relaxed) as usize,
            steps,
            sum_s: f64::from_bits(self.sum_bits.load(Ordering::Relaxed)),
            sum_squares_s2: f64::from_bits(self.sum_squares_bits.load(Ordering::Relaxed)),
        })
    }
}

#[derive(Default)]
struct DrafterCounters {
    phases: [PhaseCounter; DrafterPhase::COUNT],
    steps: AtomicU64,
    token_slots: AtomicU64,
    real_tokens: AtomicU64,
    loss_tokens: AtomicU64,
    skipped: AtomicU64,
    loss_sum_bits: AtomicU64,
    loss_count: AtomicU64,
    last_loss_bits: AtomicU64,
    /// `dflash`, `eagle3`: sum and count of the steps' τ (`[exact, simulated]`, f64 bits), the latest τ, and
    /// the latest per-slot accuracies (f32 bits).
    tau_sum_bits: [AtomicU64; 2],
    tau_count: AtomicU64,
    last_tau_bits: [AtomicU64; 2],
    slot_accuracy_bits: [AtomicU32; MAX_SLOT_METRICS],
    slot_metrics: AtomicU32,
    /// `dflash`: per block slot, the sum of the accuracies of the steps counted in `tau_count` (f64 bits).
    slot_accuracy_sum_bits: [AtomicU64; MAX_SLOT_METRICS],
    /// Sum and count of the applied steps' gradient norms, and the latest (f64 bits).
    grad_norm_sum_bits: AtomicU64,
    grad_norm_count: AtomicU64,
    last_grad_norm_bits: AtomicU64,
    /// The last [`FINAL_STEPS`] finite losses and τ (f64 bits) and slot accuracies (f32 bits), each a ring
    /// indexed by its count modulo [`FINAL_STEPS`].
    recent_loss_bits: [AtomicU64; FINAL_STEPS],
    recent_tau_bits: [[AtomicU64; 2]; FINAL_STEPS],
    recent_slot_accuracy_bits: [[AtomicU32; MAX_SLOT_METRICS]; FINAL_STEPS],
    /// The drafter's first data wait (ns + 1; 0 until it ends): waiting for the first producer, kept out of the
    /// first step's window and of the warm-up.
    first_wait_ns_plus_one: AtomicU64,
    warmup_phases: [AtomicU64; DrafterPhase::COUNT],
    warmup_steps: AtomicU64,
    warmup_wall_ns: AtomicU64,
    longest_step_ns: AtomicU64,
    last_step_end_ns: AtomicU64,
    buckets: [BucketCounter; MAX_BUCKET_STATS],
}

#[derive(Default)]
struct ProducerCounters {
    phases: [PhaseCounter; ProducerPhase::COUNT],
    items: AtomicU64,
    tokens: AtomicU64,
    produce_squares_bits: AtomicU64,
}

/// `OpenSpan` packed in a `u64`: the top byte is the state (0 none, [`IN_STEP`], or phase index + 1), the
/// rest the start in nanoseconds since the epoch (2⁵⁶ ns is over two years).
const OPEN_START_MASK: u64 = (1 << 56) - 1;
/// The top-byte code of "inside a drafter step, phase not known yet".
const IN_STEP: u64 = 0xFF;

fn pack_open(code: u64, start_ns: u64) -> u64 {
    (code << 56) | start_ns.min(OPEN_START_MASK)
}

struct Slot<C> {
    counters: C,
    claimed: AtomicBool,
    spans: Option<ArrayQueue<Span>>,
    spans_dropped: AtomicU64,
    /// Seqlock over `counters` and `open`: odd while the worker writes.
    sequence: AtomicU64,
    open: AtomicU64,
    first_start_ns: AtomicU64,
    last_end_ns: AtomicU64,
}

impl<C: Default> Slot<C> {
    fn new(ring: Option<usize>) -> CachePadded<Self> {
        CachePadded::new(Self {
            counters: C::default(),
            claimed: AtomicBool::new(false),
            spans: ring.map(ArrayQueue::new),
            spans_dropped: AtomicU64::new(0),
            sequence: AtomicU64::new(0),
            open: AtomicU64::new(0),
            first_start_ns: AtomicU64::new(u64::MAX),
            last_end_ns: AtomicU64::new(0),
        })
    }

    /// Runs `write` as one seqlock write section: readers retry rather than see half of it. One writer per slot
    /// (the claim), so the sequence is read and stored, not read-modify-written.
    fn write<R>(&self, write: impl FnOnce() -> R) -> R {
        let sequence = self.sequence.load(Ordering::Relaxed);
        self.sequence.store(sequence + 1, Ordering::Relaxed);
        fence(Ordering::Release);
        let result = write();
        self.sequence.store(sequence + 2, Ordering::Release);
        result
    }

    /// Reads `read` consistently with respect to [`Self::write`] sections.
    fn read<R>(&self, read: impl Fn() -> R) -> R {
        loop {
            let before = self.sequence.load(Ordering::Acquire);
            if before.is_multiple_of(2) {
                let value = read();
                fence(Ordering::Acquire);
                if self.sequence.load(Ordering::Relaxed) == before {
                    return value;
                }
            }
            std::hint::spin_loop();
        }
    }

    fn set_open(&self, code: u64, start_ns: u64) {
        self.open
            .store(pack_open(code, start_ns), Ordering::Relaxed);
    }

    fn read_open(&self) -> Option<(u64, Duration)> {
        let packed = self.open.load(Ordering::Relaxed);
        let code = packed >> 56;
        (code != 0).then(|| (code, Duration::from_nanos(packed & OPEN_START_MASK)))
    }

    fn claim(&self, role: &'static str, index: usize) -> Result<(), TelemetryError> {
        if self.claimed.swap(true, Ordering::Acquire) {
            return Err(TelemetryError::AlreadyClaimed { role, index });
        }
        Ok(())
    }

    /// Adds `start..end` to `counter` (this slot's counter of phase `phase`) and, when tracing, pushes the span;
    /// an `end` before `start` counts as zero. The one recording path of drafters and producers alike.
    /// Returns the span's duration and end in nanoseconds since the epoch. Call inside [`Self::write`].
    fn record(
        &self,
        telemetry: &Telemetry,
        phase: usize,
        counter: &PhaseCounter,
        start: Instant,
        end: Instant,
    ) -> (u64, u64) {
        let duration_ns = nanos(end.saturating_duration_since(start));
        counter.add(duration_ns);
        let start_ns = telemetry.since_epoch_ns(start);
        let end_ns = start_ns.saturating_add(duration_ns);
        if start_ns < self.first_start_ns.load(Ordering::Relaxed) {
            self.first_start_ns.store(start_ns, Ordering::Relaxed);
        }
        if end_ns > self.last_end_ns.load(Ordering::Relaxed) {
            self.last_end_ns.store(end_ns, Ordering::Relaxed);
        }
        if self.spans.is_some() {
            self.push_span(Span {
                phase: phase as u8,
                start_ns,
                duration_ns,
            });
        }
        (duration_ns, end_ns)
    }

    fn first_and_last(&self) -> Option<(Duration, Duration)> {
        let first = self.first_start_ns.load(Ordering::Relaxed);
        (first != u64::MAX).then(|| {
            (
                Duration::from_nanos(first),
                Duration::from_nanos(self.last_end_ns.load(Ordering::Relaxed)),
            )
        })
    }

    fn push_span(&self, span: Span) {
        if let Some(ring) = &self.spans
            && ring.force_push(span).is_some()
        {
            self.spans_dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The shared measurement state of one run: one slot per producer and per drafter.
///
/// # Examples
///
/// ```
/// use std::sync::Arc;
/// use std::time::Instant;
/// use draftpipe_runtime::telemetry::{DrafterPhase, StepTokens, Telemetry};
///
/// let telemetry = Arc::new(Telemetry::new(1, 2, false));
/// let drafter = telemetry.drafter(1).unwrap();
/// let start = Instant::now();
/// // ... the forward pass ...
/// drafter.record(DrafterPhase::Forward, start, Instant::now());
/// drafter.step_done(StepTokens::unpadded(2048), 3.5);
/// let snapshot = telemetry.snapshot();
/// assert_eq!(snapshot.drafters[1].steps, 1);
/// assert_eq!(snapshot.drafters[1].phase(DrafterPhase::Forward).count, 1);
/// ```
pub struct Telemetry {
    epoch: Instant,
    drafters: Box<[CachePadded<Slot<DrafterCounters>>]>,
    producers: Box<[CachePadded<Slot<ProducerCounters>>]>,
    tracing: bool,
    files: super::files::TelemetryFiles,
}

impl Telemetry {
    /// Spans each worker's ring holds between two drains by the telemetry thread. A drafter step records about
    /// eight spans, so this covers 500 steps between two drains (every 10 ms); older spans are overwritten and
    /// counted as dropped.
    pub const DEFAULT_RING_CAPACITY: usize = 4096;

    /// Telemetry for `producers` producers and `drafters` drafters; `trace` allocates the span rings.
    pub fn new(producers: usize, drafters: usize, trace: bool) -> Self {
        Self::with_ring_capacity(
            producers,
            drafters,
            trace.then_some(Self::DEFAULT_RING_CAPACITY),
        )
    }

    /// As [`Telemetry::new`], with span rings of `ring_capacity` spans per worker (`None`: no trace).
    /// A capacity of 0 is raised to 1 (`ArrayQueue` needs at least one slot).
    pub fn with_ring_capacity(
        producers: usize,
        drafters: usize,
        ring_capacity: Option<usize>,
    ) -> Self {
        let ring = ring_capacity.map(|capacity| capacity.max(1));
        Self {
            epoch: Instant::now(),
            drafters: (0..drafters).map(|_| Slot::new(ring)).collect(),
            producers: (0..producers).map(|_| Slot::new(ring)).collect(),
            tracing: ring.is_some(),
            files: super::files::TelemetryFiles::default(),
        }
    }

    /// The run's telemetry files, which every writer of one goes through.
    pub fn files(&self) -> &super::files::TelemetryFiles {
        &self.files
    }

    /// The instant all elapsed times and trace timestamps are measured from.
    pub fn epoch(&self) -> Instant {
        self.epoch
    }

    /// Whether spans are kept for a trace.
    pub fn tracing(&self) -> bool {
        self.tracing
    }

    /// Number of drafter slots.
    pub fn drafter_count(&self) -> usize {
        self.drafters.len()
    }

    /// Number of producer slots.
    pub fn producer_count(&self) -> usize {
        self.producers.len()
    }

    /// The recorder of drafter `index`. Each slot has one recorder at a time (it is the slot's only writer);
    /// dropping the recorder frees the slot.
    pub fn drafter(self: &Arc<Self>, index: usize) -> Result<DrafterRecorder, TelemetryError> {
        let slot = self
            .drafters
            .get(index)
            .ok_or(TelemetryError::NoSuchWorker {
                role: "drafter",
                index,
                count: self.drafters.len(),
            })?;
        slot.claim("drafter", index)?;
        Ok(DrafterRecorder {
            telemetry: Arc::clone(self),
            index,
            step_phases: Default::default(),
            step_began_ns: Cell::new(None),
            last_end_ns: Cell::new(0),
            warm_up: Cell::new(false),
            bucket: Cell::new(None),
            seen_buckets: Default::default(),
        })
    }

    /// The recorder of producer `index`, claimed like [`Telemetry::drafter`].
    pub fn producer(self: &Arc<Self>, index: usize) -> Result<ProducerRecorder, TelemetryError> {
        let slot = self
            .producers
            .get(index)
            .ok_or(TelemetryError::NoSuchWorker {
                role: "producer",
                index,
                count: self.producers.len(),
            })?;
        slot.claim("producer", index)?;
        Ok(ProducerRecorder {
            telemetry: Arc::clone(self),
            index,
        })
    }

    /// Reads every counter now (allocates; meant for the telemetry thread, not the hot path).
    pub fn snapshot(&self) -> TelemetrySnapshot {
        self.snapshot_at(Instant::now())
    }

    /// Reads every counter as of `now`: open spans count up to `now`. The reporter passes the real clock; tests
    /// may pass instants of their own to replay hours of recorded spans in microseconds.
    pub fn snapshot_at(&self, now: Instant) -> TelemetrySnapshot {
        let elapsed = now.saturating_duration_since(self.epoch);
        let drafters = self
            .drafters
            .iter()
            .map(|slot| {
                let (mut counts, open) = slot.read(|| {
                    let c = &slot.counters;
                    let last = f64::from_bits(c.last_loss_bits.load(Ordering::Relaxed));
                    let span = slot.first_and_last();
                    let slot_metrics = c.slot_metrics.load(Ordering::Relaxed) as usize;
                    let recent_losses =
                        (c.loss_count.load(Ordering::Relaxed) as usize).min(FINAL_STEPS);
                    let recent_taus =
                        (c.tau_count.load(Ordering::Relaxed) as usize).min(FINAL_STEPS);
                    let counts = DrafterCounts {
                        phases: std::array::from_fn(|p| c.phases[p].read()),
                        steps: c.steps.load(Ordering::Relaxed),
                        token_slots: c.token_slots.load(Ordering::Relaxed),
                        real_tokens: c.real_tokens.load(Ordering::Relaxed),
                        loss_tokens: c.loss_tokens.load(Ordering::Relaxed),
                        skipped: c.skipped.load(Ordering::Relaxed),
                        loss_sum: f64::from_bits(c.loss_sum_bits.load(Ordering::Relaxed)),
                        loss_count: c.loss_count.load(Ordering::Relaxed),
                        last_loss: (c.loss_count.load(Ordering::Relaxed) > 0).then_some(last),
                        tau_sum: load_taus(&c.tau_sum_bits),
                        tau_count: c.tau_count.load(Ordering::Relaxed),
                        last_tau: (c.tau_count.load(Ordering::Relaxed) > 0)
                            .then(|| load_taus(&c.last_tau_bits)),
                        slot_accuracy_sum: c.slot_accuracy_sum_bits[..slot_metrics]
                            .iter()
                            .map(|bits| f64::from_bits(bits.load(Ordering::Relaxed)))
                            .collect(),
                        grad_norm_sum: f64::from_bits(c.grad_norm_sum_bits.load(Ordering::Relaxed)),
                        grad_norm_count: c.grad_norm_count.load(Ordering::Relaxed),
                        last_grad_norm: (c.grad_norm_count.load(Ordering::Relaxed) > 0)
                            .then(|| f64::from_bits(c.last_grad_norm_bits.load(Ordering::Relaxed))),
                        last_slot_accuracy: c.slot_accuracy_bits[..slot_metrics]
                            .iter()
                            .map(|bits| f32::from_bits(bits.load(Ordering::Relaxed)))
                            .collect(),
                        recent_losses: c.recent_loss_bits[..recent_losses]
                            .iter()
                            .map(|bits| f64::from_bits(bits.load(Ordering::Relaxed)))
                            .collect(),
                        recent_taus: c.recent_tau_bits[..recent_taus]
                            .iter()
                            .map(load_taus)
                            .collect(),
                        recent_slot_accuracy: (0..slot_metrics)
                            .map(|s| {
                                let sum: f32 = c.recent_slot_accuracy_bits[..recent_taus]
                                    .iter()
                                    .map(|step| f32::from_bits(step[s].load(Ordering::Relaxed)))
                                    .sum();
                                sum / recent_taus.max(1) as f32
                            })
                            .collect(),
                        open_busy: Duration::ZERO,
                        open_wait: Duration::ZERO,
                        warmup_phases: std::array::from_fn(|p| {
                            Duration::from_nanos(c.warmup_phases[p].load(Ordering::Relaxed))
                        }),
                        first_data_wait: c
                            .first_wait_ns_plus_one
                            .load(Ordering::Relaxed)
                            .checked_sub(1)
                            .map(Duration::from_nanos),
                        warmup_steps: c.warmup_steps.load(Ordering::Relaxed),
                        warmup_wall: Duration::from_nanos(c.warmup_wall_ns.load(Ordering::Relaxed)),
                        longest_step: Duration::from_nanos(
                            c.longest_step_ns.load(Ordering::Relaxed),
                        ),
                        last_step_end: Duration::from_nanos(
                            c.last_step_end_ns.load(Ordering::Relaxed),
                        ),
                        first_span_start: span.map(|(first, _)| first),
                        last_span_end: span.map_or(Duration::ZERO, |(_, last)| last),
                        buckets: c.buckets.iter().filter_map(BucketCounter::read).collect(),
                    };
                    (counts, slot.read_open())
                });
                match open {
                    Some((code, start)) if code == IN_STEP => {
                        counts.open_busy = elapsed.saturating_sub(start);
                    }
                    Some((code, start)) if code == DrafterPhase::DataWait.index() as u64 + 1 => {
                        counts.open_wait = elapsed.saturating_sub(start);
                    }
                    _ => {}
                }
                counts
            })
            .collect();
        let producers = self
            .producers
            .iter()
            .map(|slot| {
                slot.read(|| {
                    let c = &slot.counters;
                    ProducerCounts {
                        phases: std::array::from_fn(|p| c.phases[p].read()),
                        items: c.items.load(Ordering::Relaxed),
                        tokens: c.tokens.load(Ordering::Relaxed),
                        produce_squares_s2: f64::from_bits(
                            c.produce_squares_bits.load(Ordering::Relaxed),
                        ),
                    }
                })
            })
            .collect();
        let spans_dropped = self
            .drafters
            .iter()
            .map(|s| s.spans_dropped.load(Ordering::Relaxed))
            .chain(
                self.producers
                    .iter()
                    .map(|s| s.spans_dropped.load(Ordering::Relaxed)),
            )
            .sum();
        TelemetrySnapshot {
            elapsed,
            drafters,
            producers,
            spans_dropped,
        }
    }

    /// Moves every span now in the rings to `sink` as `(worker, span)`.
    pub(crate) fn drain_spans(&self, mut sink: impl FnMut(Worker, Span)) {
        for (index, slot) in self.producers.iter().enumerate() {
            if let Some(ring) = &slot.spans {
                while let Some(span) = ring.pop() {
                    sink(Worker::Producer(index), span);
                }
            }
        }
        for (index, slot) in self.drafters.iter().enumerate() {
            if let Some(ring) = &slot.spans {
                while let Some(span) = ring.pop() {
                    sink(Worker::Drafter(index), span);
                }
            }
        }
    }

    fn since_epoch_ns(&self, at: Instant) -> u64 {
        nanos(at.saturating_duration_since(self.epoch))
    }
}

/// A worker's identity in the trace: its role and index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Worker {
    /// Producer `i`.
    Producer(usize),
    /// Drafter `i`.
    Drafter(usize),
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The handle a drafter worker records its phases and steps through.
///
/// A worker's loop calls, per step: [`Self::waiting`] before it blocks on the queue, [`Self::lap`] /
/// [`Self::record`] for each phase (the data wait first), [`Self::begin_step`] with the batch's bucket once it
/// has one, and [`Self::step_done`] (or [`Self::step_skipped`]) at the end.
pub struct DrafterRecorder {
    telemetry: Arc<Telemetry>,
    index: usize,
    /// This step's time per phase so far (moved to the warm-up or bucket totals when the step ends).
    step_phases: [Cell<u64>; DrafterPhase::COUNT],
    /// Where this step's window began: the end of the previous step, or the first span.
    step_began_ns: Cell<Option<u64>>,
    /// End of the latest recorded span.
    last_end_ns: Cell<u64>,
    /// The current step is the first of its bucket.
    warm_up: Cell<bool>,
    /// The current step's entry in the bucket statistics.
    bucket: Cell<Option<usize>>,
    /// Padded lengths of the buckets seen so far, in order of first appearance.
    seen_buckets: std::cell::RefCell<Vec<usize>>,
}

impl DrafterRecorder {
    fn slot(&self) -> &Slot<DrafterCounters> {
        &self.telemetry.drafters[self.index]
    }

    /// Which drafter this records for.
    pub fn index(&self) -> usize {
        self.index
    }

    /// Adds the span `start..end` to `phase` (an `end` before `start` counts as zero). The worker is inside its
    /// step from `end` on, until [`Self::step_done`].
    pub fn record(&self, phase: DrafterPhase, start: Instant, end: Instant) {
        let slot = self.slot();
        let index = phase.index();
        slot.write(|| {
            let (duration_ns, end_ns) = slot.record(
                &self.telemetry,
                index,
                &slot.counters.phases[index],
                start,
                end,
            );
            let first_span = self.step_began_ns.get().is_none();
            if first_span && phase == DrafterPhase::DataWait {
                // Waiting for the first producer (a stream not yet connected, a target loading): its own period,
                // not the first step's, so neither the warm-up nor the longest step (the rate window) holds it.
                slot.counters
                    .first_wait_ns_plus_one
                    .store(duration_ns + 1, Ordering::Relaxed);
                self.step_began_ns.set(Some(end_ns));
            } else {
                let cell = &self.step_phases[index];
                cell.set(cell.get() + duration_ns);
                if first_span {
                    self.step_began_ns.set(Some(end_ns - duration_ns));
                }
            }
            self.last_end_ns.set(self.last_end_ns.get().max(end_ns));
            slot.set_open(IN_STEP, end_ns);
        });
    }

    /// Adds a span of `duration` starting at `start`: for times measured by device events (CUDA event
    /// elapsed time), anchored at the host instant the work was enqueued.
    pub fn record_duration(&self, phase: DrafterPhase, start: Instant, duration: Duration) {
        self.record(phase, start, start + duration);
    }

    /// Records `*since..now` as `phase` and moves `*since` to now: one clock read per phase boundary.
    pub fn lap(&self, phase: DrafterPhase, since: &mut Instant) {
        let now = Instant::now();
        self.record(phase, *since, now);
        *since = now;
    }

    /// Says the worker is blocked waiting for a batch since `since` (the start its data-wait span will have), so
    /// a status line printed before the batch arrives counts the wait so far.
    pub fn waiting(&self, since: Instant) {
        let slot = self.slot();
        let start_ns = self.telemetry.since_epoch_ns(since);
        slot.write(|| slot.set_open(DrafterPhase::DataWait.index() as u64 + 1, start_ns));
    }

    /// Names the bucket (by its padded length) of the step under way. The first step of each bucket is warm-up:
    /// it allocates the bucket's workspace (and captures its graph on a GPU), so its time is kept apart from the
    /// steady state's.
    pub fn begin_step(&self, padded_len: usize) {
        let mut seen = self.seen_buckets.borrow_mut();
        let entry = match seen.iter().position(|&len| len == padded_len) {
            Some(entry) => entry,
            None => {
                seen.push(padded_len);
                self.warm_up.set(true);
                seen.len() - 1
            }
        }
        .min(MAX_BUCKET_STATS - 1);
        let counter = &self.slot().counters.buckets[entry];
        if counter.steps.load(Ordering::Relaxed) == 0 {
            counter
                .padded_len
                .store(padded_len as u64, Ordering::Relaxed);
        }
        self.bucket.set(Some(entry));
    }

    /// Counts one applied step of `tokens` with its loss. A non-finite loss is left out of the loss mean
    /// (the step still counts); steps skipped for non-finite values go through [`Self::step_skipped`].
    pub fn step_done(&self, tokens: StepTokens, loss: f64) {
        let slot = self.slot();
        slot.write(|| {
            let c = &slot.counters;
            c.token_slots.fetch_add(tokens.slots, Ordering::Relaxed);
            c.real_tokens.fetch_add(tokens.real, Ordering::Relaxed);
            c.loss_tokens.fetch_add(tokens.with_loss, Ordering::Relaxed);
            if loss.is_finite() {
                // Single writer (the claim), so load-add-store cannot lose an update.
                let sum = f64::from_bits(c.loss_sum_bits.load(Ordering::Relaxed)) + loss;
                c.loss_sum_bits.store(sum.to_bits(), Ordering::Relaxed);
                c.last_loss_bits.store(loss.to_bits(), Ordering::Relaxed);
                let count = c.loss_count.fetch_add(1, Ordering::Relaxed);
                c.recent_loss_bits[count as usize % FINAL_STEPS]
                    .store(loss.to_bits(), Ordering::Relaxed);
            }
            c.steps.fetch_add(1, Ordering::Relaxed);
            self.end_step();
        });
    }

    /// Records a `dflash` or `eagle3` step's block metrics (before its [`Self::step_done`]): its two τ and the
    /// accuracy of its slots `1..block` (the first [`MAX_SLOT_METRICS`] of them).
    pub fn block_metrics(&self, tau: Taus, slot_accuracy: &[f32]) {
        let slot = self.slot();
        slot.write(|| {
            let c = &slot.counters;
            let kept = slot_accuracy.len().min(MAX_SLOT_METRICS);
            if tau.exact.is_finite() && tau.simulated.is_finite() {
                store_taus(&c.tau_sum_bits, load_taus(&c.tau_sum_bits) + tau);
                store_taus(&c.last_tau_bits, tau);
                let count = c.tau_count.fetch_add(1, Ordering::Relaxed) as usize;
                store_taus(&c.recent_tau_bits[count % FINAL_STEPS], tau);
                let recent = &c.recent_slot_accuracy_bits[count % FINAL_STEPS];
                for (bits, acc) in recent.iter().zip(&slot_accuracy[..kept]) {
                    bits.store(acc.to_bits(), Ordering::Relaxed);
                }
                for (bits, &acc) in c.slot_accuracy_sum_bits.iter().zip(&slot_accuracy[..kept]) {
                    let sum = f64::from_bits(bits.load(Ordering::Relaxed)) + f64::from(acc);
                    bits.store(sum.to_bits(), Ordering::Relaxed);
                }
            }
            for (bits, acc) in c.slot_accuracy_bits.iter().zip(&slot_accuracy[..kept]) {
                bits.store(acc.to_bits(), Ordering::Relaxed);
            }
            c.slot_metrics.store(kept as u32, Ordering::Relaxed);
        });
    }

    /// Records an applied step's global gradient norm before clipping (before its [`Self::step_done`]); it comes
    /// with the loss in the step's read-back, so recording it costs no device sync. A non-finite norm is left out
    /// (that step is skipped, not applied).
    pub fn grad_norm(&self, norm: f64) {
        if !norm.is_finite() {
            return;
        }
        let slot = self.slot();
        slot.write(|| {
            let c = &slot.counters;
            let sum = f64::from_bits(c.grad_norm_sum_bits.load(Ordering::Relaxed)) + norm;
            c.grad_norm_sum_bits.store(sum.to_bits(), Ordering::Relaxed);
            c.last_grad_norm_bits
                .store(norm.to_bits(), Ordering::Relaxed);
            c.grad_norm_count.fetch_add(1, Ordering::Relaxed);
        });
    }

    /// Counts one step skipped because its loss or gradient was not finite.
    pub fn step_skipped(&self) {
        let slot = self.slot();
        slot.write(|| {
            slot.counters.skipped.fetch_add(1, Ordering::Relaxed);
            self.end_step();
        });
    }

    /// Closes the step's window: its time goes to the warm-up totals or to its bucket's statistics, and the worker
    /// is between steps (in no phase) until it records or waits again. Call inside a write section.
    fn end_step(&self) {
        let slot = self.slot();
        let c = &slot.counters;
        let end_ns = self.last_end_ns.get();
        let wall_ns = end_ns.saturating_sub(self.step_began_ns.get().unwrap_or(end_ns));
        c.longest_step_ns.fetch_max(wall_ns, Ordering::Relaxed);
        c.last_step_end_ns.store(end_ns, Ordering::Relaxed);
        let phases: [u64; DrafterPhase::COUNT] =
            std::array::from_fn(|p| self.step_phases[p].take());
        if self.warm_up.take() {
            for (total, ns) in c.warmup_phases.iter().zip(phases) {
                total.fetch_add(ns, Ordering::Relaxed);
            }
            c.warmup_steps.fetch_add(1, Ordering::Relaxed);
            c.warmup_wall_ns.fetch_add(wall_ns, Ordering::Relaxed);
        } else if let Some(entry) = self.bucket.get() {
            // The step's own time: waiting for data and for the slowest peer in the all-reduce are not the step.
            let own_ns: u64 = DrafterPhase::ALL
                .iter()
                .filter(|p| !matches!(p, DrafterPhase::DataWait | DrafterPhase::AllReduce))
                .map(|p| phases[p.index()])
                .sum();
            let seconds = own_ns as f64 * 1e-9;
            let counter = &c.buckets[entry];
            let add = |bits: &AtomicU64, value: f64| {
                bits.store(
                    (f64::from_bits(bits.load(Ordering::Relaxed)) + value).to_bits(),
                    Ordering::Relaxed,
                );
            };
            add(&counter.sum_bits, seconds);
            add(&counter.sum_squares_bits, seconds * seconds);
            counter.steps.fetch_add(1, Ordering::Relaxed);
        }
        self.step_began_ns.set(Some(end_ns));
        slot.set_open(0, end_ns);
    }
}

impl Drop for DrafterRecorder {
    fn drop(&mut self) {
        self.slot().claimed.store(false, Ordering::Release);
    }
}

/// The handle a producer records its phases and items through.
pub struct ProducerRecorder {
    telemetry: Arc<Telemetry>,
    index: usize,
}

impl ProducerRecorder {
    fn slot(&self) -> &Slot<ProducerCounters> {
        &self.telemetry.producers[self.index]
    }

    /// Which producer this records for.
    pub fn index(&self) -> usize {
        self.index
    }

    /// Adds the span `start..end` to `phase`.
    pub fn record(&self, phase: ProducerPhase, start: Instant, end: Instant) {
        let slot = self.slot();
        let index = phase.index();
        slot.write(|| {
            let (duration_ns, _) = slot.record(
                &self.telemetry,
                index,
                &slot.counters.phases[index],
                start,
                end,
            );
            if phase == ProducerPhase::Produce {
                // The spread of the time per item, for `draftpipe simulate --from`.
                let bits = &slot.counters.produce_squares_bits;
                let seconds = duration_ns as f64 * 1e-9;
                let sum = f64::from_bits(bits.load(Ordering::Relaxed)) + seconds * seconds;
                bits.store(sum.to_bits(), Ordering::Relaxed);
            }
        });
    }

    /// Records `*since..now` as `phase` and moves `*since` to now.
    pub fn lap(&self, phase: ProducerPhase, since: &mut Instant) {
        let now = Instant::now();
        self.record(phase, *since, now);
        *since = now;
    }

    /// Counts one item of `tokens` tokens pushed into the queue.
    pub fn item_done(&self, tokens: u64) {
        let slot = self.slot();
        slot.write(|| {
            let c = &slot.counters;
            c.tokens.fetch_add(tokens, Ordering::Relaxed);
            c.items.fetch_add(1, Ordering::Relaxed);
        });
    }
}

impl Drop for ProducerRecorder {
    fn drop(&mut self) {
        self.slot().claimed.store(false, Ordering::Release);
    }
}

/// The `[exact, simulated]` f64 bits of a τ pair.
fn load_taus(bits: &[AtomicU64; 2]) -> Taus {
    Taus {
        exact: f64::from_bits(bits[0].load(Ordering::Relaxed)),
        simulated: f64::from_bits(bits[1].load(Ordering::Relaxed)),
    }
}

fn store_taus(bits: &[AtomicU64; 2], tau: Taus) {
    bits[0].store(tau.exact.to_bits(), Ordering::Relaxed);
    bits[1].store(tau.simulated.to_bits(), Ordering::Relaxed);
}
