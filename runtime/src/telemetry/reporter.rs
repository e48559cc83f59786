//! The telemetry thread's side: samples the queue, prints status lines, logs them, keeps the trace, and at the
//! end writes the run summary.
//!
//! ```text
//!  every SAMPLE_PERIOD:  tick(queue) ──▶ depth histogram, drain span rings
//!  every `every`:        └──▶ StatusLine ──▶ out (plain │ progress │ json) + RUN_DIR/status.jsonl
//!                                      └──▶ the TensorBoard event file (`telemetry.tensorboard`)
//!  at the end:           finish(queue) ──▶ RUN_DIR/summary.json, trace file ──▶ RunSummary
//! ```

use std::collections::VecDeque;
use std::fs::File;
use std::io::{BufWriter, IsTerminal, Write};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::TelemetryError;
use super::acceptance::AcceptanceStatus;
use super::counts::TelemetrySnapshot;
use super::recorder::Telemetry;
use super::status::{QueueSnapshot, StatusLine};
use super::summary::{
    DepthSample, DrafterSummary, LossSample, ProducerSummary, QueueSummary, RunSummary,
    STATUS_FILE, SUMMARY_FILE, SUMMARY_FORMAT, Thinned, write_summary,
};
use super::tensorboard::EventWriter;
use super::trace::TraceBuffer;
use draftpipe_compiler::plan::LrSchedule;

/// How status lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputMode {
    /// One human-readable line per period.
    Plain,
    /// One line redrawn in place (`\r`), with a progress bar when the step total is known.
    Progress,
    /// One JSON object per line.
    Json,
}

impl OutputMode {
    /// `Json` when asked for, else `Progress` when stdout is a terminal, else `Plain`.
    pub fn detect(json: bool) -> Self {
        if json {
            Self::Json
        } else if std::io::stdout().is_terminal() {
            Self::Progress
        } else {
            Self::Plain
        }
    }
}

/// What the reporter needs to know about the run.
#[derive(Debug, Clone)]
pub struct ReporterConfig {
    /// The plan's name, recorded in the summary.
    pub plan_name: String,
    /// Status-line period (`telemetry.every`).
    pub every: Duration,
    /// How lines are written to the output.
    pub mode: OutputMode,
    /// The step limit, when known (draws the progress bar), counted from step 0 as `first_step` is.
    pub total_steps: Option<u64>,
    /// The step this run starts from: a resumed checkpoint's step, 0 for a fresh run. Status lines count from
    /// it, so a run resumed at step 50 of 100 shows `step 50/100` rising to `100/100`.
    pub first_step: u64,
    /// Where `status.jsonl` and `summary.json` go; `None` writes neither.
    pub run_dir: Option<PathBuf>,
    /// Where the trace goes; `None` keeps no trace (the telemetry should then be made without rings).
    pub trace_path: Option<PathBuf>,
    /// Trace memory bound: spans kept per worker.
    pub max_spans_per_worker: usize,
    /// Queue capacity and watermark (fix the depth histogram's size).
    pub queue_capacity: usize,
    /// Consumers' watermark.
    pub queue_min_ready: usize,
    /// The source's own status field (`producers=[3/5 connected]`), when it has one.
    pub source_status: Option<crate::source::SourceStatusProbe>,
    /// The acceptance check's column, when the pipeline has an `acceptance` section.
    pub acceptance_status: Option<AcceptanceProbe>,
    /// Where the TensorBoard event file goes (`telemetry.tensorboard`); `None` writes none.
    pub tensorboard_dir: Option<PathBuf>,
    /// The optimizer's learning rate and schedule, for the status line's `learning_rate`.
    pub learning_rate: Option<LearningRate>,
}

/// The learning rate the status line reports: the plan's `lr` and its schedule over the drafter's `steps`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LearningRate {
    /// The configured rate.
    pub lr: f64,
    /// Its schedule.
    pub schedule: LrSchedule,
    /// The steps the schedule runs over (the drafter's `steps`, as the device is given them).
    pub schedule_total: u64,
}

impl LearningRate {
    /// The rate of the latest applied step after `step` applied steps (`None` before the first).
    pub fn of_step(&self, step: u64) -> Option<f64> {
        let applied_before = step.checked_sub(1)?;
        Some(self.lr * self.schedule.factor(applied_before, self.schedule_total))
    }
}

/// The acceptance check's status-line column, read by the telemetry thread at each line.
#[derive(Clone)]
pub struct AcceptanceProbe(Arc<dyn Fn() -> AcceptanceStatus + Send + Sync>);

impl AcceptanceProbe {
    /// A probe that calls `status` each time the line is drawn.
    pub fn new(status: impl Fn() -> AcceptanceStatus + Send + Sync + 'static) -> Self {
        Self(Arc::new(status))
    }
}

impl std::fmt::Debug for AcceptanceProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("AcceptanceProbe").field(&(self.0)()).finish()
    }
}

impl ReporterConfig {
    /// Plain output, no run directory, no trace, for a queue of `queue_capacity` with watermark
    /// `queue_min_ready`.
    pub fn new(
        plan_name: impl Into<String>,
        every: Duration,
        queue_capacity: usize,
        queue_min_ready: usize,
    ) -> Self {
        Self {
            plan_name: plan_name.into(),
            every,
            mode: OutputMode::Plain,
            total_steps: None,
            first_step: 0,
            run_dir: None,
            trace_path: None,
            max_spans_per_worker: TraceBuffer::DEFAULT_MAX_SPANS_PER_WORKER,
            queue_capacity,
            queue_min_ready,
            source_status: None,
            acceptance_status: None,
            tensorboard_dir: None,
            learning_rate: None,
        }
    }
}

/// Points kept in the loss curve and depth timeline of a summary, however long the run.
const MAX_SERIES_POINTS: usize = 4096;

/// The shortest window of the status line's tokens per second. Tokens count when a step completes, so the rate
/// over one short period jumps between zero and several steps' worth; ten seconds smooth that while staying
/// recent. With steps longer than a fifth of it the window grows to twice the longest step.
pub const RATE_WINDOW: Duration = Duration::from_secs(10);

/// Width of the progress bar in characters.
pub const BAR_WIDTH: usize = 24;

/// Turns counter snapshots into status lines, and at the end into the run summary.
///
/// # Examples
///
/// ```
/// use std::sync::Arc;
/// use std::time::{Duration, Instant};
/// use draftpipe_runtime::telemetry::{QueueSnapshot, Reporter, ReporterConfig, Telemetry};
///
/// let telemetry = Arc::new(Telemetry::new(1, 1, false));
/// let config = ReporterConfig::new("demo", Duration::from_secs(1), 20, 10);
/// let mut reporter = Reporter::new(config, Arc::clone(&telemetry), Vec::new()).unwrap();
/// let queue = QueueSnapshot { depth: 20, capacity: 20, min_ready: 10, per_bucket: vec![20], ..Default::default() };
/// reporter.sample(&queue);
/// let line = reporter.report(&queue).unwrap();
/// assert!(line.to_string().contains("q_hs=[20/20]"));
/// let summary = reporter.finish(&queue).unwrap();
/// assert_eq!(summary.queue.depth_histogram[20], 2);
/// ```
pub struct Reporter<W: Write> {
    config: ReporterConfig,
    telemetry: Arc<Telemetry>,
    out: W,
    status_log: Option<(PathBuf, BufWriter<File>)>,
    events: Option<EventWriter>,
    previous: TelemetrySnapshot,
    last_report: Duration,
    queue: QueueSummary,
    timeline: Thinned<DepthSample>,
    loss_curve: Thinned<LossSample>,
    trace: Option<TraceBuffer>,
    progress_drawn: bool,
    /// Snapshots of earlier reports, back to the start of the current rate window.
    rate_history: VecDeque<TelemetrySnapshot>,
}

impl<W: Write> Reporter<W> {
    /// How often [`Reporter::run`] samples the queue depth and drains the span rings: fine enough for a depth
    /// histogram that sees short dips, and a queue-stats read plus a ring drain every 10 ms costs nothing
    /// measurable.
    pub const SAMPLE_PERIOD: Duration = Duration::from_millis(10);

    /// A reporter writing lines to `out`; creates the run directory and its `status.jsonl` when configured.
    /// A trace path with a [`Telemetry`] made without span rings is refused: the trace would be empty.
    pub fn new(
        config: ReporterConfig,
        telemetry: Arc<Telemetry>,
        out: W,
    ) -> Result<Self, TelemetryError> {
        if let Some(path) = &config.trace_path
            && !telemetry.tracing()
        {
            return Err(TelemetryError::TraceWithoutRings { path: path.clone() });
        }
        let status_log = match &config.run_dir {
            Some(dir) => {
                std::fs::create_dir_all(dir).map_err(|source| TelemetryError::Io {
                    action: "create",
                    path: dir.clone(),
                    source,
                })?;
                let path = dir.join(STATUS_FILE);
                let file = File::create(&path).map_err(|source| TelemetryError::Io {
                    action: "create",
                    path: path.clone(),
                    source,
                })?;
                Some((path, BufWriter::new(file)))
            }
            None => None,
        };
        let events = config
            .tensorboard_dir
            .as_deref()
            .map(EventWriter::create)
            .transpose()?;
        let trace = config.trace_path.as_ref().map(|_| {
            TraceBuffer::new(
                telemetry.producer_count(),
                telemetry.drafter_count(),
                config.max_spans_per_worker,
            )
        });
        let sample_ms = Self::SAMPLE_PERIOD.as_secs_f64() * 1e3;
        Ok(Self {
            queue: QueueSummary::new(config.queue_capacity, config.queue_min_ready, sample_ms),
            previous: TelemetrySnapshot {
                drafters: vec![Default::default(); telemetry.drafter_count()],
                producers: vec![Default::default(); telemetry.producer_count()],
                ..Default::default()
            },
            config,
            telemetry,
            out,
            status_log,
            events,
            last_report: Duration::ZERO,
            timeline: Thinned::new(MAX_SERIES_POINTS),
            loss_curve: Thinned::new(MAX_SERIES_POINTS),
            trace,
            progress_drawn: false,
            rate_history: VecDeque::new(),
        })
    }

    /// Records the queue depth in the histogram and moves pending trace spans out of the workers' rings.
    pub fn sample(&mut self, queue: &QueueSnapshot) {
        self.queue.add_depth(queue.depth);
        if let Some(trace) = &mut self.trace {
            trace.drain(&self.telemetry);
        }
    }

    /// [`Reporter::sample`], then a status line when `every` has passed since the last one.
    pub fn tick(&mut self, queue: &QueueSnapshot) -> Result<Option<StatusLine>, TelemetryError> {
        self.sample(queue);
        if self
            .telemetry
            .epoch()
            .elapsed()
            .saturating_sub(self.last_report)
            >= self.config.every
        {
            return self.report(queue).map(Some);
        }
        Ok(None)
    }

    /// Writes a status line now, over the interval since the previous one.
    pub fn report(&mut self, queue: &QueueSnapshot) -> Result<StatusLine, TelemetryError> {
        self.report_at(Instant::now(), queue)
    }

    /// [`Reporter::report`] as of `now` (a test's clock, or the real one).
    pub fn report_at(
        &mut self,
        now: Instant,
        queue: &QueueSnapshot,
    ) -> Result<StatusLine, TelemetryError> {
        let current = self.telemetry.snapshot_at(now);
        let longest_step = current
            .drafters
            .iter()
            .map(|d| d.longest_step)
            .max()
            .unwrap_or_default();
        let window = RATE_WINDOW.max(2 * longest_step);
        // The window starts at the latest report at least `window` ago (the run's start until there is one).
        let cutoff = current.elapsed.saturating_sub(window);
        while self.rate_history.len() > 1 && self.rate_history[1].elapsed <= cutoff {
            self.rate_history.pop_front();
        }
        let start = TelemetrySnapshot {
            drafters: vec![Default::default(); current.drafters.len()],
            ..Default::default()
        };
        let window_start = self.rate_history.front().unwrap_or(&start);
        let mut line =
            StatusLine::between(&self.previous, &current, queue, self.config.total_steps)
                .with_rate_window(window_start, &current);
        line.step += self.config.first_step;
        line.learning_rate = self
            .config
            .learning_rate
            .and_then(|rate| rate.of_step(line.step));
        line.source = self.config.source_status.as_ref().map(|probe| probe.read());
        line.acceptance = self
            .config
            .acceptance_status
            .as_ref()
            .map(|probe| (probe.0)());
        // The label names the window asked for; the first lines of a run cover what there is so far.
        line.rate_window_s = window.as_secs_f64();
        self.rate_history.push_back(current.clone());
        if let Some(trace) = &mut self.trace {
            trace.push_status(&line);
        }
        let interval_had_loss = current.drafters.iter().map(|d| d.loss_count).sum::<u64>()
            > self
                .previous
                .drafters
                .iter()
                .map(|d| d.loss_count)
                .sum::<u64>();
        if let (Some(loss), true) = (line.loss, interval_had_loss) {
            self.loss_curve.push(LossSample {
                step: line.step,
                elapsed_s: line.elapsed_s,
                loss,
            });
        }
        self.timeline.push(DepthSample {
            elapsed_ms: u64::try_from(current.elapsed.as_millis()).unwrap_or(u64::MAX),
            depth: queue.depth,
            per_bucket: queue.per_bucket.clone(),
        });
        self.write_line(&line)
            .map_err(|source| TelemetryError::Output { source })?;
        if let Some((path, log)) = &mut self.status_log {
            let written = self.telemetry.files().write(path, || {
                serde_json::to_writer(&mut *log, &line)
                    .map_err(|source| TelemetryError::Encode { source })?;
                writeln!(log)
                    .and_then(|_| log.flush())
                    .map_err(|source| TelemetryError::Io {
                        action: "write",
                        path: path.clone(),
                        source,
                    })
            });
            if !written && let Some((_, log)) = self.status_log.take() {
                // Given up: what is still buffered is discarded, not flushed again on drop.
                drop(log.into_parts());
            }
        }
        if let Some(events) = &mut self.events {
            let path = events.path().to_path_buf();
            if !self
                .telemetry
                .files()
                .write(&path, || events.write_line(&line))
            {
                self.events = None;
            }
        }
        self.last_report = current.elapsed;
        self.previous = current;
        Ok(line)
    }

    fn write_line(&mut self, line: &StatusLine) -> std::io::Result<()> {
        match self.config.mode {
            OutputMode::Plain => writeln!(self.out, "{line}")?,
            OutputMode::Json => {
                serde_json::to_writer(&mut self.out, line)?;
                writeln!(self.out)?;
            }
            OutputMode::Progress => {
                // `\x1b[K` clears what a longer previous line left to the right.
                write!(self.out, "\r{}\x1b[K", line.progress_line(BAR_WIDTH))?;
                self.progress_drawn = true;
            }
        }
        self.out.flush()
    }

    /// Samples every [`Reporter::SAMPLE_PERIOD`] and reports every `every` until `stop` is set; `queue` reads
    /// the queue's statistics. This is the telemetry thread's whole loop.
    pub fn run(
        &mut self,
        stop: &AtomicBool,
        mut queue: impl FnMut() -> QueueSnapshot,
    ) -> Result<(), TelemetryError> {
        while !stop.load(Ordering::Acquire) {
            std::thread::sleep(Self::SAMPLE_PERIOD);
            self.tick(&queue())?;
        }
        Ok(())
    }

    /// Final status line, then `summary.json` (when a run directory is set) and the trace (when configured),
    /// each through [`Telemetry::files`](super::Telemetry::files): a file that cannot be written is a warning,
    /// and the summary is returned all the same. Call after the workers have stopped, so the totals are final.
    pub fn finish(self, queue: &QueueSnapshot) -> Result<RunSummary, TelemetryError> {
        self.finish_at(Instant::now(), queue)
    }

    /// [`Reporter::finish`] as of `now` (a test's clock, or the real one).
    pub fn finish_at(
        mut self,
        now: Instant,
        queue: &QueueSnapshot,
    ) -> Result<RunSummary, TelemetryError> {
        self.sample(queue);
        let line = self.report_at(now, queue)?;
        if self.progress_drawn {
            writeln!(self.out)
                .and_then(|_| self.out.flush())
                .map_err(|source| TelemetryError::Output { source })?;
        }
        self.queue.set_counters(queue);
        let snapshot = &self.previous;
        let mut queue_summary = self.queue;
        queue_summary.timeline = self.timeline.into_vec();
        let summary = RunSummary {
            format: SUMMARY_FORMAT,
            plan: self.config.plan_name.clone(),
            steps: line.step - self.config.first_step,
            token_slots: line.token_slots,
            real_tokens: line.real_tokens,
            loss_tokens: line.loss_tokens,
            wall_s: snapshot.elapsed.as_secs_f64(),
            skipped_nonfinite: snapshot.skipped(),
            final_loss: mean(
                snapshot
                    .drafters
                    .iter()
                    .flat_map(|d| &d.recent_losses)
                    .copied(),
            ),
            final_tau_exact: mean(
                snapshot
                    .drafters
                    .iter()
                    .flat_map(|d| &d.recent_taus)
                    .map(|t| t.exact),
            ),
            final_tau_simulated: mean(
                snapshot
                    .drafters
                    .iter()
                    .flat_map(|d| &d.recent_taus)
                    .map(|t| t.simulated),
            ),
            final_slot_accuracy: final_slot_accuracy(snapshot),
            final_steps: snapshot
                .drafters
                .iter()
                .map(|d| d.recent_losses.len().max(d.recent_taus.len()) as u64)
                .max()
                .unwrap_or(0),
            drafters: snapshot
                .drafters
                .iter()
                .map(DrafterSummary::from_counts)
                .collect(),
            producers: snapshot
                .producers
                .iter()
                .map(ProducerSummary::from_counts)
                .collect(),
            queue: queue_summary,
            loss_curve: self.loss_curve.into_vec(),
            spans_dropped: snapshot.spans_dropped,
            ending: None,
            acceptance: None,
            masks: None,
        };
        if let Some(dir) = &self.config.run_dir {
            let files = self.telemetry.files();
            files.write(&dir.join(SUMMARY_FILE), || {
                write_summary(dir, &summary).map(drop)
            });
        }
        if let (Some(trace), Some(path)) = (&self.trace, &self.config.trace_path) {
            self.telemetry
                .files()
                .write(path, || trace.write(path, snapshot.spans_dropped));
        }
        Ok(summary)
    }
}

/// The mean of `values` (`None` when there are none).
fn mean(values: impl Iterator<Item = f64>) -> Option<f64> {
    let (sum, count) = values.fold((0.0, 0u32), |(sum, n), v| (sum + v, n + 1));
    (count > 0).then(|| sum / f64::from(count))
}

/// Per block slot, the mean of the drafters' recent slot accuracies (`dflash`; empty for `mlp`).
fn final_slot_accuracy(snapshot: &TelemetrySnapshot) -> Vec<f32> {
    let measured: Vec<&Vec<f32>> = snapshot
        .drafters
        .iter()
        .map(|d| &d.recent_slot_accuracy)
        .filter(|acc| !acc.is_empty())
        .collect();
    let slots = measured.iter().map(|acc| acc.len()).min().unwrap_or(0);
    (0..slots)
        .map(|s| measured.iter().map(|acc| acc[s]).sum::<f32>() / measured.len() as f32)
        .collect()
}
