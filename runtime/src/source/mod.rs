//! Producers' data: where hidden-state batches come from, and the pool of buffers they are written into.
//!
//! ```text
//!  SyntheticSource │ SafetensorsSource ──HsSource──▶ Producer ──Box<HsBatch>──▶ HS queue ──▶ drafter
//!                                                      ▲  take(bucket)                         │ give_back
//!                                                      └──────────────── BatchPool ◀───────────┘
//! ```
//!
//! A source is a deterministic stream of batches indexed by a global *position* `0, 1, 2, …`. With `W`
//! producer workers, worker `w` produces the positions `p ≡ w (mod W)` in increasing order, so the stream does
//! not depend on which worker runs first, and [`HsBatch::source_position`] tells which worker made a batch
//! (`p % W`) and where to restart it ([`HsSource::seek`]). Each batch belongs to one bucket (its static shape);
//! the source announces it ([`HsSource::next_bucket`]) before filling, so the producer can take a buffer of the
//! right shape from the [`BatchPool`] and steady state allocates nothing.
//!
//! # Examples
//!
//! One producer worker's loop (the queue push and the drafter side are the pipeline's):
//!
//! ```no_run
//! use std::sync::atomic::AtomicBool;
//! use draftpipe_runtime::source::{open_sources, BatchPool, Producer, SourceError};
//!
//! fn produce(plan: &draftpipe_compiler::plan::Plan, stop: &AtomicBool) -> Result<(), SourceError> {
//!     let pool = BatchPool::for_plan(plan)?;
//!     let mut producers: Vec<Producer> = open_sources(plan)?.into_iter().map(Producer::new).collect();
//!     // Resuming: producers[w].source_mut().seek(saved_positions[w])?;
//!     while let Some(batch) = producers[0].next_batch(&pool, stop)? {
//!         // push `batch` to the HS queue; the drafter that trains on it calls `pool.give_back(batch)`.
//!         pool.give_back(batch)?;
//!     }
//!     Ok(())
//! }
//! ```

pub mod mask_check;
pub mod safetensors;
pub mod stream;
pub mod synthetic;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crossbeam_queue::ArrayQueue;
use crossbeam_utils::Backoff;
use draftpipe_compiler::plan::{Plan, SourceSpec};

use crate::batch::{HsBatch, HsData, HsDtype};
use crate::tensor_file::{TensorFile, TensorFileError};

pub use self::mask_check::{MaskProbe, MaskRefusal, MaskReport};
pub use self::safetensors::{SafetensorsDataset, SafetensorsSource};
pub use self::stream::{StreamConfig, StreamSource, StreamStatus, open_stream};
pub use self::synthetic::{SyntheticSource, SyntheticTarget};

/// How long a producer sleeps between looks at an empty pool once spinning has not helped.
const POOL_WAIT: Duration = Duration::from_micros(200);

/// Why a source or the batch pool failed.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// The source's settings cannot work with the plan (e.g. a length no bucket holds).
    #[error("source configuration: {0}")]
    Config(String),
    /// A hidden-state file is unreadable or disagrees with the plan.
    #[error(transparent)]
    File(#[from] TensorFileError),
    /// A path or glob matched no file.
    #[error("no file matches `{pattern}`")]
    NoMatch {
        /// The path or glob given.
        pattern: String,
    },
    /// Listing the directory of a glob failed.
    #[error("cannot list `{dir}`: {source}")]
    ListDir {
        /// The directory.
        dir: String,
        /// The cause.
        source: std::io::Error,
    },
    /// A seek to a position this producer does not own.
    #[error("position {position} does not belong to producer {producer} of {producers}")]
    ForeignPosition {
        /// Requested position.
        position: u64,
        /// This producer's index.
        producer: usize,
        /// Number of producers.
        producers: usize,
    },
    /// The data's loss masks are bad in more than the stage's `max_bad_mask_share` of its sequences.
    #[error(transparent)]
    BadMasks(Box<MaskRefusal>),
    /// `fill_next` got a buffer whose shape is not the announced bucket's, or the stream is exhausted.
    #[error("batch buffer mismatch: {0}")]
    Buffer(String),
}

/// The static shapes of the plan's buckets, in bucket order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketShapes {
    /// `(padded_len, sequences)` per bucket; padded lengths strictly increase.
    pub buckets: Vec<(usize, usize)>,
    /// Width of one token's hidden state.
    pub din: usize,
    /// Precision the hidden states are held in.
    pub hs_dtype: HsDtype,
    /// Width of one token's `last_hidden_states` (the target's final-norm output, in `hs_dtype`) when the plan's
    /// drafter reads them, else `None`: batches then carry none and cost no byte more.
    pub last_hidden: Option<usize>,
}

impl BucketShapes {
    /// The shapes of `plan`'s buckets, hidden states in the plan's `hs_dtype` (f32 when the files decide and
    /// [`resolve_hs_dtype`] has not settled it).
    pub fn from_plan(plan: &Plan) -> Self {
        Self {
            buckets: plan
                .buckets
                .iter()
                .map(|b| (b.padded_len, b.sequences))
                .collect(),
            din: plan.target.hs_width(),
            hs_dtype: plan.target.hs_dtype_or_widest(),
            last_hidden: plan
                .model
                .spec
                .reads_last_hidden_states()
                .then_some(plan.target.hidden),
        }
    }

    /// Positions a sequence keeps after its last loss-masked token: 1 when the drafter reads
    /// `last_hidden_states` (EAGLE-3 shifts its ids and its teacher left by one, so the last label's row reads the
    /// next position's token and final hidden state, as SpecForge's offline path does), else 0 (nothing after the
    /// last label is read).
    pub fn kept_after_last_label(&self) -> usize {
        usize::from(self.last_hidden.is_some())
    }

    /// The smallest bucket whose padded length holds a sequence of `len` tokens, or `None` if none does.
    pub fn bucket_for_len(&self, len: usize) -> Option<usize> {
        self.buckets.iter().position(|&(padded, _)| len <= padded)
    }

    /// The most tokens any bucket's batch holds (the size every pooled buffer is allocated for).
    pub fn max_tokens(&self) -> usize {
        self.buckets.iter().map(|&(p, s)| p * s).max().unwrap_or(0)
    }

    /// Reshapes `batch` to bucket `bucket` without allocating when its buffers were made by [`Self::buffer`].
    ///
    /// # Panics
    /// If `bucket` is out of range.
    pub fn shape_for(&self, batch: &mut HsBatch, bucket: usize) {
        let (padded_len, sequences) = self.buckets[bucket];
        let tokens = padded_len * sequences;
        batch.padded_len = padded_len;
        batch.sequences = sequences;
        batch.din = self.din;
        batch.hs.resize(tokens * self.din);
        if let (Some(last), Some(hidden)) = (batch.last_hidden_states.as_mut(), self.last_hidden) {
            last.resize(tokens * hidden);
        }
        batch.input_ids.resize(tokens, 0);
        batch.loss_mask.resize(tokens, 0);
        batch.seq_lens.resize(sequences, 0);
    }

    /// A buffer with room for any bucket, shaped for bucket 0.
    pub fn buffer(&self) -> HsBatch {
        let tokens = self.max_tokens();
        let max_sequences = self.buckets.iter().map(|&(_, s)| s).max().unwrap_or(0);
        let mut batch = HsBatch {
            padded_len: 0,
            sequences: 0,
            din: self.din,
            hs: HsData::with_capacity(self.hs_dtype, self.din, tokens * self.din),
            last_hidden_states: self
                .last_hidden
                .map(|hidden| HsData::with_capacity(self.hs_dtype, hidden, tokens * hidden)),
            input_ids: Vec::with_capacity(tokens),
            seq_lens: Vec::with_capacity(max_sequences),
            loss_mask: Vec::with_capacity(tokens),
            source_position: 0,
        };
        if !self.buckets.is_empty() {
            self.shape_for(&mut batch, 0);
        }
        batch
    }

    /// True when `batch` has the shape of bucket `bucket`.
    pub fn matches(&self, batch: &HsBatch, bucket: usize) -> bool {
        let Some(&(padded_len, sequences)) = self.buckets.get(bucket) else {
            return false;
        };
        let tokens = padded_len * sequences;
        batch.padded_len == padded_len
            && batch.sequences == sequences
            && batch.din == self.din
            && batch.hs.dtype() == self.hs_dtype
            && batch.hs.len() == tokens * self.din
            && match (&batch.last_hidden_states, self.last_hidden) {
                (None, None) => true,
                (Some(last), Some(hidden)) => {
                    last.dtype() == self.hs_dtype && last.len() == tokens * hidden
                }
                _ => false,
            }
            && batch.input_ids.len() == tokens
            && batch.loss_mask.len() == tokens
            && batch.seq_lens.len() == sequences
    }
}

/// A deterministic, resumable stream of hidden-state batches for one producer worker.
pub trait HsSource: Send {
    /// The bucket of the next batch, or `None` when the stream is exhausted. Does not advance.
    fn next_bucket(&mut self) -> Result<Option<usize>, SourceError>;

    /// [`Self::next_bucket`] for a source that may wait for its data (a network stream): it also returns
    /// `None` once `stop` is raised. Asking for the next batch says the previous one was queued.
    fn next_bucket_until(&mut self, stop: &AtomicBool) -> Result<Option<usize>, SourceError> {
        let _ = stop;
        self.next_bucket()
    }

    /// Fills `out`, already shaped for the bucket [`Self::next_bucket`] announced, with the next batch (every
    /// element written, padding zeroed), sets `out.source_position`, and advances.
    fn fill_next(&mut self, out: &mut HsBatch) -> Result<(), SourceError>;

    /// The global position of the next batch this source will produce.
    fn position(&self) -> u64;

    /// Makes the batch at global `position` the next one (it must belong to this producer).
    fn seek(&mut self, position: u64) -> Result<(), SourceError>;

    /// The stream server's producer names and counts, when this is a stream source (every slot of one stream
    /// shares them).
    fn stream_status(&self) -> Option<StreamStatus> {
        None
    }

    /// What the source's loss masks hold, read for the run's summary (`None`: synthetic data has no masks to
    /// judge). Every slot of one dataset or stream shares it.
    fn mask_probe(&self) -> Option<MaskProbe> {
        None
    }

    /// What the status line should show of this source (connected producers, the epoch), if anything.
    fn status_probe(&self) -> Option<SourceStatusProbe> {
        None
    }
}

/// A source's field of the status line (`producers=[3/5 connected]`), read by the telemetry thread.
#[derive(Clone)]
pub struct SourceStatusProbe(std::sync::Arc<dyn Fn() -> String + Send + Sync>);

impl SourceStatusProbe {
    /// A probe that calls `describe` each time the line is drawn.
    pub fn new(describe: impl Fn() -> String + Send + Sync + 'static) -> Self {
        Self(std::sync::Arc::new(describe))
    }

    /// The field now.
    pub fn read(&self) -> String {
        (self.0)()
    }
}

impl std::fmt::Debug for SourceStatusProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("SourceStatusProbe")
            .field(&self.read())
            .finish()
    }
}

/// Checks that `position` belongs to producer `producer` of `producers`.
fn check_owned(position: u64, producer: usize, producers: usize) -> Result<(), SourceError> {
    if position % producers as u64 == producer as u64 {
        Ok(())
    } else {
        Err(SourceError::ForeignPosition {
            position,
            producer,
            producers,
        })
    }
}

/// `plan` with its hidden-state precision settled: a file source without `hs_dtype` takes the files' dtype (the
/// widest among them when they differ, so no file is rounded), read from their headers alone. The pool, the
/// sources and the drafters' input slots are then all built from the one returned plan.
pub fn resolve_hs_dtype(plan: &Plan) -> Result<Plan, SourceError> {
    let mut plan = plan.clone();
    if let (None, SourceSpec::Safetensors { pattern, .. }) =
        (plan.target.hs_dtype, &plan.target.source)
    {
        // `last_hidden_states`, when the drafter reads them, are held in the same precision: they count too.
        let mut names = vec![self::safetensors::HIDDEN_STATES];
        if plan.model.spec.reads_last_hidden_states() {
            names.push(self::safetensors::LAST_HIDDEN_STATES);
        }
        let mut widest = None;
        for path in self::safetensors::expand_pattern(pattern)? {
            let file = TensorFile::open(&path)?;
            for name in &names {
                let dtype = match file.info(name).map(|t| t.dtype) {
                    Some(::safetensors::Dtype::BF16) => HsDtype::Bf16,
                    Some(::safetensors::Dtype::F16) => HsDtype::F16,
                    Some(::safetensors::Dtype::F8_E4M3) => HsDtype::Fp8E4m3,
                    // F32, or a file the dataset's own checks will refuse with a precise error.
                    _ => HsDtype::F32,
                };
                widest = match widest {
                    None => Some(dtype),
                    Some(a) if a == dtype => Some(a),
                    Some(_) => Some(HsDtype::F32),
                };
            }
        }
        let widest = widest.unwrap_or(HsDtype::Bf16);
        plan.target.hs_dtype = Some(widest);
    }
    Ok(plan)
}

/// Opens one source per producer worker of `plan`'s target stage (worker `w` gets index `w`).
pub fn open_sources(plan: &Plan) -> Result<Vec<Box<dyn HsSource>>, SourceError> {
    let producers = plan.target.placement.workers.len();
    if producers == 0 {
        return Err(SourceError::Config(
            "the target stage has no workers".into(),
        ));
    }
    let shapes = BucketShapes::from_plan(plan);
    match &plan.target.source {
        SourceSpec::Synthetic {
            seed,
            min_len,
            max_len,
        } => {
            let target = std::sync::Arc::new(SyntheticTarget::new(
                *seed,
                plan.target.vocab,
                plan.target.hidden,
                plan.target.tap_layers.len(),
            )?);
            (0..producers)
                .map(|w| {
                    let source = SyntheticSource::new(
                        target.clone(),
                        &shapes,
                        *min_len..*max_len,
                        w,
                        producers,
                    )?;
                    Ok(Box::new(source) as Box<dyn HsSource>)
                })
                .collect()
        }
        SourceSpec::Stream {
            listen,
            token_env,
            max_message_bytes,
            read_timeout_ms,
        } => {
            let token = match token_env {
                Some(var) => match std::env::var(var) {
                    Ok(token) if !token.is_empty() => Some(token),
                    _ => {
                        return Err(SourceError::Config(format!(
                            "the stream's token comes from ${var}, which is not set or empty"
                        )));
                    }
                },
                None => None,
            };
            let (sources, _status) = open_stream(StreamConfig {
                listen: listen.clone(),
                token,
                max_message_bytes: *max_message_bytes,
                read_timeout: Duration::from_millis(*read_timeout_ms),
                target: plan.target.clone(),
                shapes,
                producers,
                log: stream::stderr_log(),
            })?;
            Ok(sources
                .into_iter()
                .map(|s| Box::new(s) as Box<dyn HsSource>)
                .collect())
        }
        SourceSpec::Safetensors {
            pattern,
            epochs,
            shuffle_seed,
        } => {
            let dataset = SafetensorsDataset::open(pattern, &plan.target, &shapes)?;
            // Before the first step: a template that marked the wrong tokens would otherwise train silently.
            dataset.check_masks(&plan.target.masks)?;
            let dataset = std::sync::Arc::new(dataset.with_epochs(*epochs, *shuffle_seed));
            Ok((0..producers)
                .map(|w| {
                    Box::new(SafetensorsSource::new(dataset.clone(), w, producers))
                        as Box<dyn HsSource>
                })
                .collect())
        }
    }
}

/// Preallocated batch buffers shared by producers and drafters: producers `take`, drafters `give_back`.
///
/// Every buffer has room for any bucket and is reshaped on `take`, so one pool serves all buckets and holds
/// `items × buffer` bytes, as the plan's host memory ([`HostMemory`](draftpipe_compiler::plan::HostMemory))
/// counts it.
#[derive(Debug)]
pub struct BatchPool {
    free: ArrayQueue<Box<HsBatch>>,
    shapes: BucketShapes,
    items: usize,
    allocated_bytes: u64,
}

impl BatchPool {
    /// A pool of `items` buffers for `shapes`.
    pub fn new(shapes: BucketShapes, items: usize) -> Result<Self, SourceError> {
        if items == 0 || shapes.buckets.is_empty() {
            return Err(SourceError::Config(
                "a batch pool needs at least one item and one bucket".into(),
            ));
        }
        let free = ArrayQueue::new(items);
        let mut allocated_bytes = 0;
        for _ in 0..items {
            let buffer = Box::new(shapes.buffer());
            allocated_bytes += buffer.allocated_bytes();
            free.push(buffer)
                .expect("the queue was sized for every item");
        }
        Ok(Self {
            free,
            shapes,
            items,
            allocated_bytes,
        })
    }

    /// The pool a pipeline for `plan` needs, as many buffers as its host memory counts: one per queue slot, two
    /// per drafter worker (the batch in the step and the one being prefetched) and one per producer worker (the
    /// batch being filled).
    pub fn for_plan(plan: &Plan) -> Result<Self, SourceError> {
        let items = usize::try_from(plan.host_memory.hs_pool_buffers).map_err(|_| {
            SourceError::Config(
                "the plan's batch pool has more buffers than this host can count".into(),
            )
        })?;
        Self::new(BucketShapes::from_plan(plan), items)
    }

    /// Bytes the pool's buffers hold room for, as allocated (what the plan's host memory figure must equal).
    pub fn allocated_bytes(&self) -> u64 {
        self.allocated_bytes
    }

    /// Takes a free buffer shaped for `bucket`, or `None` when all buffers are in use.
    ///
    /// # Panics
    /// If `bucket` is out of range.
    pub fn take(&self, bucket: usize) -> Option<Box<HsBatch>> {
        let mut batch = self.free.pop()?;
        self.shapes.shape_for(&mut batch, bucket);
        Some(batch)
    }

    /// Returns a buffer taken from this pool. A buffer that cannot have come from it (wrong width, too small,
    /// or more returned than taken) is refused.
    pub fn give_back(&self, batch: Box<HsBatch>) -> Result<(), SourceError> {
        let tokens = self.shapes.max_tokens();
        if batch.din != self.shapes.din
            || batch.hs.dtype() != self.shapes.hs_dtype
            || batch.hs.capacity() < tokens * self.shapes.din
            || batch.input_ids.capacity() < tokens
            || batch.loss_mask.capacity() < tokens
            || match (&batch.last_hidden_states, self.shapes.last_hidden) {
                (None, None) => false,
                (Some(last), Some(hidden)) => last.capacity() < tokens * hidden,
                _ => true,
            }
        {
            return Err(SourceError::Buffer(
                "buffer returned to a pool it does not belong to".into(),
            ));
        }
        self.free
            .push(batch)
            .map_err(|_| SourceError::Buffer("more buffers returned than taken".into()))
    }

    /// Buffers currently free.
    pub fn available(&self) -> usize {
        self.free.len()
    }

    /// Buffers the pool owns in all.
    pub fn items(&self) -> usize {
        self.items
    }

    /// The bucket shapes buffers are cut to.
    pub fn shapes(&self) -> &BucketShapes {
        &self.shapes
    }
}

/// One producer worker: a source plus the loop step that turns it into pooled batches.
pub struct Producer {
    source: Box<dyn HsSource>,
}

impl Producer {
    /// Wraps a source.
    pub fn new(source: Box<dyn HsSource>) -> Self {
        Self { source }
    }

    /// The next filled batch, waiting (spin, then short sleeps) for a free buffer. `Ok(None)` when the source is
    /// exhausted or `stop` is set while waiting. On an error the buffer goes back to the pool.
    pub fn next_batch(
        &mut self,
        pool: &BatchPool,
        stop: &AtomicBool,
    ) -> Result<Option<Box<HsBatch>>, SourceError> {
        let Some(bucket) = self.source.next_bucket_until(stop)? else {
            return Ok(None);
        };
        let backoff = Backoff::new();
        let mut batch = loop {
            if let Some(batch) = pool.take(bucket) {
                break batch;
            }
            if stop.load(Ordering::Relaxed) {
                return Ok(None);
            }
            // A pool drained for long means the queue is full: sleeping leaves the cores to the drafters.
            if backoff.is_completed() {
                std::thread::sleep(POOL_WAIT);
            } else {
                backoff.snooze();
            }
        };
        match self.source.fill_next(&mut batch) {
            Ok(()) => Ok(Some(batch)),
            Err(e) => {
                pool.give_back(batch)?;
                Err(e)
            }
        }
    }

    /// The source, e.g. to read its position for a checkpoint or seek it on resume.
    pub fn source_mut(&mut self) -> &mut dyn HsSource {
        self.source.as_mut()
    }
}
