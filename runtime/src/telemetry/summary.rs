//! The run summary: everything the diagnosis needs, written to `RUN_DIR/summary.json` at the end of a run
//! and read back by `draftpipe diagnose RUN_DIR`.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::TelemetryError;
use super::counts::{BucketSteps, DrafterCounts, PhaseCount, ProducerCounts};
use super::phase::{DrafterPhase, ProducerPhase};
use super::status::QueueSnapshot;

/// The `format` this build writes and reads; bumped when a field changes meaning.
pub const SUMMARY_FORMAT: u32 = 1;

/// File name of the summary inside a run directory.
pub const SUMMARY_FILE: &str = "summary.json";

/// File name of the status-line log (one JSON object per line) inside a run directory.
pub const STATUS_FILE: &str = "status.jsonl";

/// Total time and span count of one phase.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PhaseTotal<P> {
    /// The phase.
    pub phase: P,
    /// Seconds spent in it.
    pub total_s: f64,
    /// Spans recorded.
    pub count: u64,
}

/// Seconds recorded for `phase` in `phases` (0 when absent).
fn seconds_in<P: PartialEq>(phases: &[PhaseTotal<P>], phase: P) -> f64 {
    phases
        .iter()
        .filter(|p| p.phase == phase)
        .map(|p| p.total_s)
        .sum()
}

/// One total per phase of `all`, read through `count`.
fn phase_totals<P: Copy>(all: &[P], count: impl Fn(P) -> PhaseCount) -> Vec<PhaseTotal<P>> {
    all.iter()
        .map(|&phase| {
            let c = count(phase);
            PhaseTotal {
                phase,
                total_s: c.total.as_secs_f64(),
                count: c.count,
            }
        })
        .collect()
}

/// One drafter's totals.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DrafterSummary {
    /// Applied steps.
    pub steps: u64,
    /// Token slots trained on, padding included.
    #[serde(alias = "tokens")]
    pub token_slots: u64,
    /// Real tokens trained on (0 in summaries of older builds).
    #[serde(default)]
    pub real_tokens: u64,
    /// Real tokens with the loss mask set (0 in summaries of older builds).
    #[serde(default)]
    pub loss_tokens: u64,
    /// Steps skipped for non-finite values.
    pub skipped: u64,
    /// Time per phase, one entry per [`DrafterPhase`].
    pub phases: Vec<PhaseTotal<DrafterPhase>>,
    /// Where the steady state begins and ends, and what came before it (absent in summaries of older builds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeline: Option<DrafterTimeline>,
    /// Steady-state step times per bucket (empty in summaries of older builds).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub buckets: Vec<BucketStepTimes>,
}

/// A drafter's start-up, warm-up and shut-down, so the diagnosis can judge the steady state alone.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DrafterTimeline {
    /// Seconds from the start of the run to the drafter's first recorded span (start-up: threads, workspaces,
    /// device set-up before the loop).
    pub first_span_s: f64,
    /// Seconds from the start of the run to the end of its last recorded span (after it: shut-down).
    pub last_span_end_s: f64,
    /// Seconds of the drafter's first data wait: waiting for the first producer (a stream's connection, a
    /// target loading), in the `data_wait` phase but in no step (0 in summaries of older builds, whose
    /// warm-up held it).
    #[serde(default)]
    pub first_data_wait_s: f64,
    /// Warm-up steps: the first step of each bucket (workspace, graph capture, the queue's first fill).
    pub warmup_steps: u64,
    /// Their wall time, their data wait included.
    pub warmup_wall_s: f64,
    /// Their time per phase, included in the drafter's `phases`.
    pub warmup_phases: Vec<PhaseTotal<DrafterPhase>>,
    /// The longest step's wall time (its data wait included).
    pub longest_step_s: f64,
}

impl DrafterTimeline {
    /// Warm-up seconds in `phase`.
    pub fn warmup_seconds(&self, phase: DrafterPhase) -> f64 {
        seconds_in(&self.warmup_phases, phase)
    }

    /// Wall seconds of the steady state: first span to last, less the first data wait and the warm-up steps.
    pub fn steady_wall_s(&self) -> f64 {
        (self.last_span_end_s - self.first_span_s - self.first_data_wait_s - self.warmup_wall_s)
            .max(0.0)
    }
}

/// The steady-state step time of one bucket: the step's own time (its phases but the data wait and the
/// all-reduce, which also hold waiting for others).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BucketStepTimes {
    /// The bucket's padded sequence length.
    pub padded_len: usize,
    /// Steady steps of this bucket.
    pub steps: u64,
    /// Mean step time in seconds.
    pub mean_s: f64,
    /// Standard deviation of the step time in seconds.
    pub std_s: f64,
}

impl BucketStepTimes {
    fn from_sums(sums: &BucketSteps) -> Self {
        let n = sums.steps.max(1) as f64;
        let mean = sums.sum_s / n;
        Self {
            padded_len: sums.padded_len,
            steps: sums.steps,
            mean_s: mean,
            std_s: (sums.sum_squares_s2 / n - mean * mean).max(0.0).sqrt(),
        }
    }
}

impl DrafterSummary {
    /// Seconds spent in `phase` (0 when absent).
    pub fn seconds(&self, phase: DrafterPhase) -> f64 {
        seconds_in(&self.phases, phase)
    }

    /// Seconds spent in `phase` during the steady state (all of them when the summary has no timeline).
    pub fn steady_seconds(&self, phase: DrafterPhase) -> f64 {
        let before_steady = self.timeline.as_ref().map_or(0.0, |t| {
            let first_wait = if phase == DrafterPhase::DataWait {
                t.first_data_wait_s
            } else {
                0.0
            };
            t.warmup_seconds(phase) + first_wait
        });
        (self.seconds(phase) - before_steady).max(0.0)
    }

    /// Steady-state steps (all of them when the summary has no timeline).
    pub fn steady_steps(&self) -> u64 {
        let warmup = self.timeline.as_ref().map_or(0, |t| t.warmup_steps);
        (self.steps + self.skipped).saturating_sub(warmup)
    }

    pub(crate) fn from_counts(counts: &DrafterCounts) -> Self {
        let seconds = |d: std::time::Duration| d.as_secs_f64();
        Self {
            steps: counts.steps,
            token_slots: counts.token_slots,
            real_tokens: counts.real_tokens,
            loss_tokens: counts.loss_tokens,
            skipped: counts.skipped,
            phases: phase_totals(&DrafterPhase::ALL, |phase| counts.phase(phase)),
            timeline: counts.first_span_start.map(|first| DrafterTimeline {
                first_span_s: seconds(first),
                last_span_end_s: seconds(counts.last_span_end),
                first_data_wait_s: counts.first_data_wait.map_or(0.0, seconds),
                warmup_steps: counts.warmup_steps,
                warmup_wall_s: seconds(counts.warmup_wall),
                warmup_phases: phase_totals(&DrafterPhase::ALL, |phase| PhaseCount {
                    total: counts.warmup_phases[phase.index()],
                    count: 0,
                }),
                longest_step_s: seconds(counts.longest_step),
            }),
            buckets: counts
                .buckets
                .iter()
                .map(BucketStepTimes::from_sums)
                .collect(),
        }
    }
}

/// One producer's totals.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProducerSummary {
    /// Items pushed.
    pub items: u64,
    /// Tokens in them.
    pub tokens: u64,
    /// Time per phase, one entry per [`ProducerPhase`].
    pub phases: Vec<PhaseTotal<ProducerPhase>>,
    /// Standard deviation of the time to produce one item, in seconds (absent in older summaries).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub produce_std_s: Option<f64>,
}

impl ProducerSummary {
    /// Seconds spent in `phase` (0 when absent).
    pub fn seconds(&self, phase: ProducerPhase) -> f64 {
        seconds_in(&self.phases, phase)
    }

    /// Mean seconds to produce one item (`None` before the first).
    pub fn produce_mean_s(&self) -> Option<f64> {
        let count = self
            .phases
            .iter()
            .find(|p| p.phase == ProducerPhase::Produce)
            .map_or(0, |p| p.count);
        (count > 0).then(|| self.seconds(ProducerPhase::Produce) / count as f64)
    }

    pub(crate) fn from_counts(counts: &ProducerCounts) -> Self {
        let produce = counts.phase(ProducerPhase::Produce);
        let produce_std_s = (produce.count > 0).then(|| {
            let n = produce.count as f64;
            let mean = produce.total.as_secs_f64() / n;
            (counts.produce_squares_s2 / n - mean * mean)
                .max(0.0)
                .sqrt()
        });
        Self {
            items: counts.items,
            tokens: counts.tokens,
            phases: phase_totals(&ProducerPhase::ALL, |phase| counts.phase(phase)),
            produce_std_s,
        }
    }
}

/// Queue depth at one status period.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DepthSample {
    /// Milliseconds since the start.
    pub elapsed_ms: u64,
    /// Total depth.
    pub depth: usize,
    /// Depth per bucket.
    pub per_bucket: Vec<usize>,
}

/// The queue over the whole run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QueueSummary {
    /// Most items the queue holds.
    pub capacity: usize,
    /// Consumers' watermark.
    pub min_ready: usize,
    /// Items pushed.
    pub pushes: u64,
    /// Items popped.
    pub pops: u64,
    /// Seconds producers spent blocked on a full queue (queue's own count).
    pub producer_blocked_s: f64,
    /// Seconds consumers spent blocked below the watermark (queue's own count).
    pub consumer_blocked_s: f64,
    /// Times a push found the queue full.
    pub seen_full: u64,
    /// Times a pop found the queue below the watermark.
    pub seen_below_watermark: u64,
    /// Rounds of one bucket handed to the data-parallel group (`sync = allreduce` with several drafters).
    #[serde(default)]
    pub rounds: u64,
    /// Stepped all-reduce rounds whose replicas' batches had different padded lengths: 0, always, while the
    /// queue hands out rounds (the drafters check it on every step).
    #[serde(default)]
    pub mixed_rounds: u64,
    /// Period of the depth samples in milliseconds (the telemetry thread's sampling period).
    pub sample_period_ms: f64,
    /// `depth_histogram[d]` = samples that saw depth `d` (length `capacity + 1`; deeper samples count in the
    /// last bin and show in `max_depth`).
    pub depth_histogram: Vec<u64>,
    /// Largest depth sampled.
    pub max_depth: usize,
    /// Depth at each status period, thinned to a bounded number of points on long runs.
    pub timeline: Vec<DepthSample>,
}

impl QueueSummary {
    /// Number of depth samples.
    pub fn samples(&self) -> u64 {
        self.depth_histogram.iter().sum()
    }

    /// Fraction of samples whose depth satisfies `keep` (0 with no samples).
    pub fn fraction_where(&self, keep: impl Fn(usize) -> bool) -> f64 {
        let total = self.samples();
        if total == 0 {
            return 0.0;
        }
        let hits: u64 = self
            .depth_histogram
            .iter()
            .enumerate()
            .filter(|(d, _)| keep(*d))
            .map(|(_, n)| n)
            .sum();
        hits as f64 / total as f64
    }

    pub(crate) fn new(capacity: usize, min_ready: usize, sample_period_ms: f64) -> Self {
        Self {
            capacity,
            min_ready,
            pushes: 0,
            pops: 0,
            producer_blocked_s: 0.0,
            consumer_blocked_s: 0.0,
            seen_full: 0,
            seen_below_watermark: 0,
            rounds: 0,
            mixed_rounds: 0,
            sample_period_ms,
            depth_histogram: vec![0; capacity + 1],
            max_depth: 0,
            timeline: Vec::new(),
        }
    }

    pub(crate) fn add_depth(&mut self, depth: usize) {
        let last = self.depth_histogram.len() - 1;
        self.depth_histogram[depth.min(last)] += 1;
        self.max_depth = self.max_depth.max(depth);
    }

    pub(crate) fn set_counters(&mut self, queue: &QueueSnapshot) {
        self.pushes = queue.pushes;
        self.pops = queue.pops;
        self.producer_blocked_s = queue.producer_blocked.as_secs_f64();
        self.consumer_blocked_s = queue.consumer_blocked.as_secs_f64();
        self.seen_full = queue.seen_full;
        self.seen_below_watermark = queue.seen_below_watermark;
        self.rounds = queue.rounds;
        self.mixed_rounds = queue.mixed_rounds;
    }
}

/// Mean loss at one status period.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LossSample {
    /// Global step.
    pub step: u64,
    /// Seconds since the start.
    pub elapsed_s: f64,
    /// Mean loss over the period.
    pub loss: f64,
}

/// Everything measured in one run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunSummary {
    /// [`SUMMARY_FORMAT`] of the writer.
    pub format: u32,
    /// The plan's name.
    pub plan: String,
    /// Steps completed by this run (a resumed run's steps after its checkpoint's step; `ending.step` is the
    /// step reached, counted from 0).
    pub steps: u64,
    /// Token slots trained on over all drafters, padding included (what the steps cost).
    #[serde(alias = "tokens")]
    pub token_slots: u64,
    /// Real tokens trained on over all drafters (what `eval` counts; 0 in summaries of older builds).
    #[serde(default)]
    pub real_tokens: u64,
    /// Real tokens with the loss mask set (0 in summaries of older builds).
    #[serde(default)]
    pub loss_tokens: u64,
    /// Wall time of the run in seconds.
    pub wall_s: f64,
    /// Steps skipped for a non-finite loss or gradient.
    pub skipped_nonfinite: u64,
    /// The mean finite loss of the last `final_steps` steps of every drafter.
    pub final_loss: Option<f64>,
    /// `dflash`, `eagle3`: the mean exact acceptance length (each block's drafted prefix matching its labels,
    /// bonus token counted) of the same steps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_tau_exact: Option<f64>,
    /// The mean of SpecForge's simulated acceptance length `1 + Σ_k Π_{j≤k} acc_j` of the same steps
    /// (`final_tau` in summaries written before the exact figure existed).
    #[serde(default, alias = "final_tau", skip_serializing_if = "Option::is_none")]
    pub final_tau_simulated: Option<f64>,
    /// `dflash`: the mean accuracy of block slots `1..` over the same steps.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub final_slot_accuracy: Vec<f32>,
    /// Steps per drafter the final figures average (at most [`FINAL_STEPS`](super::FINAL_STEPS); 1 in
    /// summaries of older builds, which kept the last step's figures).
    #[serde(default = "one_step")]
    pub final_steps: u64,
    /// Per drafter totals.
    pub drafters: Vec<DrafterSummary>,
    /// Per producer totals.
    pub producers: Vec<ProducerSummary>,
    /// Queue counters and sampled depth.
    pub queue: QueueSummary,
    /// Loss per status period, thinned to a bounded number of points on long runs.
    pub loss_curve: Vec<LossSample>,
    /// Trace spans lost to full rings (0 without a trace).
    pub spans_dropped: u64,
    /// How the run ended (set by the pipeline after the telemetry's totals; absent from older summaries).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ending: Option<super::ending::RunEnding>,
    /// The draft-and-verify checks of a pipeline with an `acceptance` section (set by the pipeline once the
    /// last check has ended; absent without one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acceptance: Option<super::acceptance::AcceptanceSummary>,
    /// What the data's loss masks held (set by the pipeline from a file or stream source; absent for synthetic
    /// data and in older summaries).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub masks: Option<crate::source::MaskReport>,
}

fn one_step() -> u64 {
    1
}

impl RunSummary {
    /// Share (0–1) of the token slots that held a real token (`None` before a step, or for summaries of older
    /// builds that did not count real tokens).
    pub fn real_fill(&self) -> Option<f64> {
        (self.token_slots > 0 && self.real_tokens > 0)
            .then(|| self.real_tokens as f64 / self.token_slots as f64)
    }
}

fn io_error(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> TelemetryError {
    let path = path.to_path_buf();
    move |source| TelemetryError::Io {
        action,
        path,
        source,
    }
}

/// Writes `dir/summary.json` atomically: a crash mid-write leaves the previous file (or none), never half of one.
pub fn write_summary(dir: &Path, summary: &RunSummary) -> Result<PathBuf, TelemetryError> {
    fs::create_dir_all(dir).map_err(io_error("create", dir))?;
    let path = dir.join(SUMMARY_FILE);
    let temporary = dir.join(format!("{SUMMARY_FILE}.tmp"));
    let json =
        serde_json::to_vec_pretty(summary).map_err(|source| TelemetryError::Encode { source })?;
    let mut file = fs::File::create(&temporary).map_err(io_error("create", &temporary))?;
    file.write_all(&json)
        .map_err(io_error("write", &temporary))?;
    file.sync_all().map_err(io_error("sync", &temporary))?;
    fs::rename(&temporary, &path).map_err(io_error("rename into place", &path))?;
    Ok(path)
}

/// Reads `dir/summary.json` back (what `draftpipe diagnose RUN_DIR` does).
pub fn load_summary(dir: &Path) -> Result<RunSummary, TelemetryError> {
    let path = dir.join(SUMMARY_FILE);
    let bytes = fs::read(&path).map_err(io_error("read", &path))?;
    let format = serde_json::from_slice::<serde_json::Value>(&bytes)
        .map_err(|source| TelemetryError::Parse {
            path: path.clone(),
            source,
        })?
        .get("format")
        .and_then(serde_json::Value::as_u64);
    if format != Some(u64::from(SUMMARY_FORMAT)) {
        return Err(TelemetryError::Format {
            path,
            found: format,
            expected: SUMMARY_FORMAT,
        });
    }
    serde_json::from_slice(&bytes).map_err(|source| TelemetryError::Parse { path, source })
}

/// A series that keeps at most `limit` points of an unbounded stream: when full it drops every other point
/// and from then on keeps every second (then fourth, ...) new point, so memory stays bounded and the points
/// stay evenly spread over the whole run.
#[derive(Debug, Clone)]
pub(crate) struct Thinned<T> {
    points: Vec<T>,
    stride: u64,
    offered: u64,
    limit: usize,
}

impl<T> Thinned<T> {
    pub(crate) fn new(limit: usize) -> Self {
        Self {
            points: Vec::new(),
            stride: 1,
            offered: 0,
            limit: limit.max(2),
        }
    }

    pub(crate) fn push(&mut self, point: T) {
        let keep = self.offered.is_multiple_of(self.stride);
        self.offered += 1;
        if !keep {
            return;
        }
        if self.points.len() == self.limit {
            let mut index = 0;
            self.points.retain(|_| {
                index += 1;
                index % 2 == 1
            });
            self.stride *= 2;
            if !(self.offered - 1).is_multiple_of(self.stride) {
                return;
            }
        }
        self.points.push(point);
    }

    pub(crate) fn into_vec(self) -> Vec<T> {
        self.points
    }
}
