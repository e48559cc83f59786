//! State every worker thread of a run reads: the queue, the pool, stop flags, the first fatal error and the
//! data positions a checkpoint records.
//!
//! ```text
//!  producers ──push──▶ Shared.queue ──pop──▶ drafters        any thread ──fail(error)──▶ Shared.fatal (first wins)
//!  drafters  ──consume(position) at staging──▶ consumed ──round completes──▶ trained ──▶ checkpoint positions
//! ```

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use crate::acceptance::AcceptanceMonitor;
use crate::batch::HsBatch;
use crate::checkpoint::ProducerRecord;
use crate::model::eagle3::vocab::VocabMap;
use crate::queue::{HsQueue, QueueStats};
use crate::source::{BatchPool, MaskProbe, StreamStatus};
use crate::telemetry::QueueSnapshot;

use super::error::RunError;

/// Runs `on_panic` if the thread unwinds through it: a panicking worker must still release the threads that
/// wait for it (the queue, the all-reduce group), or the run would hang instead of failing.
pub(super) struct OnPanic<F: FnMut()>(pub(super) F);

impl<F: FnMut()> Drop for OnPanic<F> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            (self.0)();
        }
    }
}

/// State every worker thread reads: the queue, the pool, stop flags and the first fatal error.
pub(super) struct Shared {
    pub(super) queue: HsQueue<Box<HsBatch>>,
    pub(super) pool: BatchPool,
    /// Raised by the caller (Ctrl-C): drafters finish the step in hand and stop.
    pub(super) interrupt: Arc<AtomicBool>,
    /// Raised when the drafters are done: producers stop filling.
    pub(super) producers_stop: AtomicBool,
    /// Producers still running; the last one to finish closes the queue so the drafters drain it.
    pub(super) live_producers: AtomicU32,
    pub(super) fatal: Mutex<Option<RunError>>,
    pub(super) fatal_raised: AtomicBool,
    /// Per producer, the position after the newest batch a drafter has taken: where a resumed run restarts.
    pub(super) consumed: Mutex<Vec<u64>>,
    /// `consumed` as it stood when the last all-reduce round completed: every batch it counts is in that round's
    /// update, and none taken since (a fast worker may already hold its next batch while worker 0 saves).
    pub(super) trained: Mutex<Vec<u64>>,
    pub(super) producer_errors: Mutex<Vec<String>>,
    /// What the end of the run needs: the final save's record of a last good state.
    pub(super) end: EndState,
    /// The stream's producer names and counts, when the source is a stream (saved with each checkpoint).
    pub(super) stream: Option<StreamStatus>,
    /// The run's draft vocabulary (`eagle3`), exported with each save.
    pub(super) vocab_map: Option<VocabMap>,
    /// The pipeline's `acceptance` check, which worker 0 starts every `every` steps.
    pub(super) acceptance: Option<Arc<AcceptanceMonitor>>,
    /// What the source's loss masks hold, read into the summary when the run ends.
    pub(super) masks: Option<MaskProbe>,
    /// Stepped all-reduce rounds whose replicas' batches had different padded lengths (counted by worker 0).
    pub(super) mixed_rounds: AtomicU64,
}

impl Shared {
    /// The queue's statistics in the telemetry's view of them (the status lines' and the summary's).
    pub(super) fn queue_snapshot(&self) -> QueueSnapshot {
        let stats: QueueStats = self.queue.stats();
        QueueSnapshot {
            depth: stats.depth,
            capacity: stats.capacity,
            min_ready: stats.min_ready,
            per_bucket: stats.per_bucket,
            pushes: stats.pushes,
            pops: stats.pops,
            producer_blocked: stats.producer_blocked,
            consumer_blocked: stats.consumer_blocked,
            seen_full: stats.seen_full,
            seen_below_watermark: stats.seen_below_watermark,
            rounds: stats.rounds,
            mixed_rounds: self.mixed_rounds.load(Ordering::Relaxed),
        }
    }

    /// Shared state for a run over `queue` and `pool` whose producers start at `first_positions`.
    pub(super) fn new(
        queue: HsQueue<Box<HsBatch>>,
        pool: BatchPool,
        interrupt: Arc<AtomicBool>,
        first_positions: Vec<u64>,
        first_optimizer_step: u64,
        (stream, vocab_map, acceptance, masks): (
            Option<StreamStatus>,
            Option<VocabMap>,
            Option<Arc<AcceptanceMonitor>>,
            Option<MaskProbe>,
        ),
    ) -> Self {
        Self {
            queue,
            pool,
            interrupt,
            producers_stop: AtomicBool::new(false),
            live_producers: AtomicU32::new(first_positions.len() as u32),
            fatal: Mutex::new(None),
            fatal_raised: AtomicBool::new(false),
            consumed: Mutex::new(first_positions.clone()),
            trained: Mutex::new(first_positions),
            producer_errors: Mutex::new(Vec::new()),
            end: EndState::new(first_optimizer_step),
            stream,
            vocab_map,
            acceptance,
            masks,
            mixed_rounds: AtomicU64::new(0),
        }
    }

    /// The stream's producers by name, for a checkpoint (empty without a stream).
    pub(super) fn stream_producers(&self) -> Vec<ProducerRecord> {
        self.stream
            .as_ref()
            .map(StreamStatus::records)
            .unwrap_or_default()
    }

    pub(super) fn fail(&self, error: RunError) {
        let mut fatal = self.fatal.lock().unwrap_or_else(PoisonError::into_inner);
        if fatal.is_none() {
            *fatal = Some(error);
        }
        self.fatal_raised.store(true, Ordering::Release);
        self.queue.close();
    }

    pub(super) fn should_stop(&self) -> bool {
        self.interrupt.load(Ordering::Acquire) || self.fatal_raised.load(Ordering::Acquire)
    }

    /// Marks the batch at `source_position` as taken by a drafter: a resumed run restarts after it.
    pub(super) fn consume(&self, source_position: u64) {
        let mut consumed = self.consumed.lock().unwrap_or_else(PoisonError::into_inner);
        let producers = consumed.len() as u64;
        let owner = (source_position % producers) as usize;
        consumed[owner] = consumed[owner].max(source_position + producers);
    }

    /// The data positions now (see `consumed`).
    pub(super) fn consumed_positions(&self) -> Vec<u64> {
        self.consumed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Records `consumed` as trained; called once per all-reduce round, when every member has its batch.
    pub(super) fn mark_trained(&self) {
        let positions = self.consumed_positions();
        *self.trained.lock().unwrap_or_else(PoisonError::into_inner) = positions;
    }

    /// The data positions of the last completed all-reduce round.
    pub(super) fn trained_positions(&self) -> Vec<u64> {
        self.trained
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Counts a stepped all-reduce round that mixed buckets (`same_bucket` false).
    pub(super) fn count_round(&self, same_bucket: bool) {
        if !same_bucket {
            self.mixed_rounds.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub(super) fn producer_finished(&self) {
        if self.live_producers.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.queue.close();
        }
    }
}

/// What the end of the run needs to know from its start, and what the final save did.
#[derive(Debug)]
pub(super) struct EndState {
    /// AdamW's step count when the run started: unchanged at the end means no step was applied.
    pub(super) first_optimizer_step: u64,
    /// Step and directory of a last good state saved after an error.
    pub(super) saved_after_error: Mutex<Option<(u64, PathBuf)>>,
}

impl EndState {
    pub(super) fn new(first_optimizer_step: u64) -> Self {
        Self {
            first_optimizer_step,
            saved_after_error: Mutex::new(None),
        }
    }
}
