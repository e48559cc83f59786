//! The hot-path side: per-worker lock-free counters and span rings, and the snapshots the telemetry thread
//! reads from them.
//!
//! Each worker owns one cache-padded slot. Its recorder is the only writer of that slot (the claim in
//! [`Telemetry::drafter`] / [`Telemetry::producer`] guarantees it), so recording is a few relaxed atomic adds on
//! a cache line no other thread writes, plus, when tracing, one `ArrayQueue::force_push` of a 24-byte span into
//! a ring allocated up front. Nothing allocates per step. Readers ([`Telemetry::snapshot`]) may see one counter
//! of a step updated and the next not yet: fine for a status line, and the totals are exact once workers stop.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crossbeam_queue::ArrayQueue;
use crossbeam_utils::CachePadded;

use super::TelemetryError;
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

#[derive(Default)]
struct DrafterCounters {
    phases: [PhaseCounter; DrafterPhase::COUNT],
    steps: AtomicU64,
    tokens: AtomicU64,
    skipped: AtomicU64,
    loss_sum_bits: AtomicU64,
    loss_count: AtomicU64,
    last_loss_bits: AtomicU64,
}

#[derive(Default)]
struct ProducerCounters {
    phases: [PhaseCounter; ProducerPhase::COUNT],
    items: AtomicU64,
    tokens: AtomicU64,
}

struct Slot<C> {
    counters: C,
    claimed: AtomicBool,
    spans: Option<ArrayQueue<Span>>,
    spans_dropped: AtomicU64,
}

impl<C: Default> Slot<C> {
    fn new(ring: Option<usize>) -> CachePadded<Self> {
        CachePadded::new(Self {
            counters: C::default(),
            claimed: AtomicBool::new(false),
            spans: ring.map(ArrayQueue::new),
            spans_dropped: AtomicU64::new(0),
        })
    }

    fn claim(&self, role: &'static str, index: usize) -> Result<(), TelemetryError> {
        if self.claimed.swap(true, Ordering::Acquire) {
            return Err(TelemetryError::AlreadyClaimed { role, index });
        }
        Ok(())
    }

    /// Adds `start..end` to `counter` (this slot's counter of phase `phase`) and, when tracing, pushes the span;
    /// an `end` before `start` counts as zero. The one recording path of drafters and producers alike.
    fn record(
        &self,
        telemetry: &Telemetry,
        phase: usize,
        counter: &PhaseCounter,
        start: Instant,
        end: Instant,
    ) {
        let duration_ns = nanos(end.saturating_duration_since(start));
        counter.add(duration_ns);
        if self.spans.is_some() {
            self.push_span(Span {
                phase: phase as u8,
                start_ns: telemetry.since_epoch_ns(start),
                duration_ns,
            });
        }
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
/// use draftpipe_runtime::telemetry::{DrafterPhase, Telemetry};
///
/// let telemetry = Arc::new(Telemetry::new(1, 2, false));
/// let drafter = telemetry.drafter(1).unwrap();
/// let start = Instant::now();
/// // ... the forward pass ...
/// drafter.record(DrafterPhase::Forward, start, Instant::now());
/// drafter.step_done(2048, 3.5);
/// let snapshot = telemetry.snapshot();
/// assert_eq!(snapshot.drafters[1].steps, 1);
/// assert_eq!(snapshot.drafters[1].phase(DrafterPhase::Forward).count, 1);
/// ```
pub struct Telemetry {
    epoch: Instant,
    drafters: Box<[CachePadded<Slot<DrafterCounters>>]>,
    producers: Box<[CachePadded<Slot<ProducerCounters>>]>,
    tracing: bool,
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
        }
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
        let drafters = self
            .drafters
            .iter()
            .map(|slot| {
                let c = &slot.counters;
                let last = f64::from_bits(c.last_loss_bits.load(Ordering::Relaxed));
                DrafterCounts {
                    phases: std::array::from_fn(|p| c.phases[p].read()),
                    steps: c.steps.load(Ordering::Relaxed),
                    tokens: c.tokens.load(Ordering::Relaxed),
                    skipped: c.skipped.load(Ordering::Relaxed),
                    loss_sum: f64::from_bits(c.loss_sum_bits.load(Ordering::Relaxed)),
                    loss_count: c.loss_count.load(Ordering::Relaxed),
                    last_loss: (c.loss_count.load(Ordering::Relaxed) > 0).then_some(last),
                }
            })
            .collect();
        let producers = self
            .producers
            .iter()
            .map(|slot| {
                let c = &slot.counters;
                ProducerCounts {
                    phases: std::array::from_fn(|p| c.phases[p].read()),
                    items: c.items.load(Ordering::Relaxed),
                    tokens: c.tokens.load(Ordering::Relaxed),
                }
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
            elapsed: self.epoch.elapsed(),
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
pub struct DrafterRecorder {
    telemetry: Arc<Telemetry>,
    index: usize,
}

impl DrafterRecorder {
    fn slot(&self) -> &Slot<DrafterCounters> {
        &self.telemetry.drafters[self.index]
    }

    /// Which drafter this records for.
    pub fn index(&self) -> usize {
        self.index
    }

    /// Adds the span `start..end` to `phase` (an `end` before `start` counts as zero).
    pub fn record(&self, phase: DrafterPhase, start: Instant, end: Instant) {
        let slot = self.slot();
        let index = phase.index();
        slot.record(
            &self.telemetry,
            index,
            &slot.counters.phases[index],
            start,
            end,
        );
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

    /// Counts one applied step of `tokens` tokens with its loss. A non-finite loss is left out of the loss mean
    /// (the step still counts); steps skipped for non-finite values go through [`Self::step_skipped`].
    pub fn step_done(&self, tokens: u64, loss: f64) {
        let c = &self.slot().counters;
        c.tokens.fetch_add(tokens, Ordering::Relaxed);
        if loss.is_finite() {
            // Single writer (the claim), so load-add-store cannot lose an update.
            let sum = f64::from_bits(c.loss_sum_bits.load(Ordering::Relaxed)) + loss;
            c.loss_sum_bits.store(sum.to_bits(), Ordering::Relaxed);
            c.last_loss_bits.store(loss.to_bits(), Ordering::Relaxed);
            c.loss_count.fetch_add(1, Ordering::Relaxed);
        }
        c.steps.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one step skipped because its loss or gradient was not finite.
    pub fn step_skipped(&self) {
        self.slot().counters.skipped.fetch_add(1, Ordering::Relaxed);
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
        slot.record(
            &self.telemetry,
            index,
            &slot.counters.phases[index],
            start,
            end,
        );
    }

    /// Records `*since..now` as `phase` and moves `*since` to now.
    pub fn lap(&self, phase: ProducerPhase, since: &mut Instant) {
        let now = Instant::now();
        self.record(phase, *since, now);
        *since = now;
    }

    /// Counts one item of `tokens` tokens pushed into the queue.
    pub fn item_done(&self, tokens: u64) {
        let c = &self.slot().counters;
        c.tokens.fetch_add(tokens, Ordering::Relaxed);
        c.items.fetch_add(1, Ordering::Relaxed);
    }
}

impl Drop for ProducerRecorder {
    fn drop(&mut self) {
        self.slot().claimed.store(false, Ordering::Release);
    }
}

/// Total time and number of spans of one phase.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PhaseCount {
    /// Sum of the recorded spans.
    pub total: Duration,
    /// Number of recorded spans.
    pub count: u64,
}

/// One drafter's counters at a snapshot.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DrafterCounts {
    /// Per phase, indexed by [`DrafterPhase::index`].
    pub phases: [PhaseCount; DrafterPhase::COUNT],
    /// Applied steps.
    pub steps: u64,
    /// Tokens trained on.
    pub tokens: u64,
    /// Steps skipped for a non-finite loss or gradient.
    pub skipped: u64,
    /// Sum of the finite losses passed to `step_done`.
    pub loss_sum: f64,
    /// Number of finite losses in `loss_sum`.
    pub loss_count: u64,
    /// The latest finite loss.
    pub last_loss: Option<f64>,
}

impl DrafterCounts {
    /// The counters of one phase.
    pub fn phase(&self, phase: DrafterPhase) -> PhaseCount {
        self.phases[phase.index()]
    }

    /// Time in every phase except waiting for data: the time the drafter was inside its step.
    pub fn busy(&self) -> Duration {
        DrafterPhase::ALL
            .iter()
            .filter(|&&p| p != DrafterPhase::DataWait)
            .map(|&p| self.phase(p).total)
            .sum()
    }
}

/// One producer's counters at a snapshot.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProducerCounts {
    /// Per phase, indexed by [`ProducerPhase::index`].
    pub phases: [PhaseCount; ProducerPhase::COUNT],
    /// Items pushed.
    pub items: u64,
    /// Tokens in the pushed items.
    pub tokens: u64,
}

impl ProducerCounts {
    /// The counters of one phase.
    pub fn phase(&self, phase: ProducerPhase) -> PhaseCount {
        self.phases[phase.index()]
    }
}

/// Every counter at one moment.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TelemetrySnapshot {
    /// Time since the telemetry epoch.
    pub elapsed: Duration,
    /// One entry per drafter.
    pub drafters: Vec<DrafterCounts>,
    /// One entry per producer.
    pub producers: Vec<ProducerCounts>,
    /// Spans overwritten in a full ring before the telemetry thread drained them.
    pub spans_dropped: u64,
}

impl TelemetrySnapshot {
    /// Steps every drafter has completed (data-parallel drafters step together, so this is the global step).
    pub fn step(&self) -> u64 {
        self.drafters.iter().map(|d| d.steps).min().unwrap_or(0)
    }

    /// Tokens trained on over all drafters.
    pub fn tokens(&self) -> u64 {
        self.drafters.iter().map(|d| d.tokens).sum()
    }

    /// Skipped non-finite steps over all drafters.
    pub fn skipped(&self) -> u64 {
        self.drafters.iter().map(|d| d.skipped).sum()
    }
}
