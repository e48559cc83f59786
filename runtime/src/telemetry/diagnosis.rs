//! The diagnosis: from a [`RunSummary`], which side limits throughput (by queueing logic) and where the
//! drafters' time went (from their phase totals).
//!
//! Queueing logic: a bounded queue between producers and consumers sits at capacity when producers are
//! faster (they block on full, so consumers set the pace) and sits empty/below the watermark when consumers
//! are faster (they wait for data, so producers set the pace). The depth histogram sampled over the run says
//! which of the two held most of the time; the blocked and waiting times confirm it.

use std::fmt;

use serde::Serialize;

use super::phase::{DrafterPhase, ProducerPhase};
use super::summary::{DrafterSummary, RunSummary};

/// Share of depth samples at `capacity − 1` or more for the queue to count as pinned full. Below about 0.5 a
/// queue that is merely high on average (bursty producers, drafters catching up) would count as pinned;
/// 0.7 demands the queue be full most of the time, the signature of consumers that cannot keep up.
pub const PINNED_FULL_FRACTION: f64 = 0.7;

/// Share of depth samples below the watermark for the queue to count as starved. Symmetric to
/// [`PINNED_FULL_FRACTION`].
pub const STARVED_FRACTION: f64 = 0.7;

/// Share of the drafters' wall time spent waiting for data that confirms a starved queue actually stalls
/// them. A queue can sit low while drafters barely wait (items are popped as soon as they arrive and the
/// drafters' step is about as long as the producers'); 10% is an idle time worth acting on.
pub const DATA_WAIT_SIGNIFICANT: f64 = 0.10;

/// With fewer depth samples than this (a very short run) the histogram says little, and the verdict falls back
/// to blocked/wait times alone.
pub const MIN_DEPTH_SAMPLES: u64 = 20;

/// Share of their time producers (or drafters) must spend blocked (or waiting) for the fallback verdict.
/// Half of the time is a clear majority that cannot come from jitter.
pub const FALLBACK_BLOCKED_FRACTION: f64 = 0.5;

/// Drafter busy fraction under which the drafters are not saturated. The target is ≥ 99% with a fast source;
/// 90% leaves room for step-boundary bookkeeping while catching gaps that cost real throughput.
pub const HOST_GAP_BUSY_BELOW: f64 = 0.90;

/// Share of drafter wall time, waiting for data or between recorded phases, that counts as a gap when the
/// queue was not starved: 5% is a throughput loss worth fixing and well above timer noise.
pub const HOST_GAP_IDLE_ABOVE: f64 = 0.05;

/// Share of drafter wall time inside the step but outside compute (copy, all-reduce, other) worth pointing
/// at: at 15% the non-compute part is a fair fraction of a step and overlapping it pays.
pub const OVERHEAD_SIGNIFICANT: f64 = 0.15;

/// Which side limits throughput.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Bottleneck {
    /// The drafters (consumers) are slower: the queue is pinned at capacity and producers block.
    Consumers,
    /// The producers are slower: the queue sits under the watermark and drafters wait for data.
    Producers,
    /// Neither side dominates.
    Balanced,
}

impl Bottleneck {
    /// The verdict from the queue's depth shares and the two sides' blocked shares (fractions, 0–1): the rule
    /// the diagnosis of a run applies, and the one `draftpipe simulate` applies to a prediction. With fewer than
    /// [`MIN_DEPTH_SAMPLES`] depth samples the blocked shares alone decide.
    pub fn judge(
        samples: u64,
        near_full: f64,
        below_watermark: f64,
        producer_blocked: f64,
        drafter_wait: f64,
    ) -> Self {
        if samples < MIN_DEPTH_SAMPLES {
            if producer_blocked >= FALLBACK_BLOCKED_FRACTION {
                Self::Consumers
            } else if drafter_wait >= FALLBACK_BLOCKED_FRACTION {
                Self::Producers
            } else {
                Self::Balanced
            }
        } else if near_full >= PINNED_FULL_FRACTION {
            Self::Consumers
        } else if below_watermark >= STARVED_FRACTION && drafter_wait >= DATA_WAIT_SIGNIFICANT {
            Self::Producers
        } else {
            Self::Balanced
        }
    }

    /// How the report names the side.
    pub fn describe(self) -> &'static str {
        match self {
            Self::Consumers => "the drafters (consumers)",
            Self::Producers => "the producers (target)",
            Self::Balanced => "neither side (balanced)",
        }
    }
}

/// The queue-side numbers behind the verdict.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct QueueEvidence {
    /// Depth samples taken.
    pub samples: u64,
    /// Mean sampled depth.
    pub mean_depth: f64,
    /// Queue capacity.
    pub capacity: usize,
    /// Consumers' watermark.
    pub min_ready: usize,
    /// Percent of samples at `capacity − 1` or more.
    pub near_full_pct: f64,
    /// Percent of samples below the watermark.
    pub below_watermark_pct: f64,
    /// Percent of the producers' wall time spent blocked on a full queue.
    pub producer_blocked_pct: f64,
    /// Percent of the drafters' wall time spent waiting for data.
    pub drafter_wait_pct: f64,
    /// Times a push found the queue full (queue's count).
    pub seen_full: u64,
    /// Times a pop found the queue below the watermark (queue's count).
    pub seen_below_watermark: u64,
}

/// One phase's share of a drafter's time.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PhaseShare {
    /// The phase.
    pub phase: DrafterPhase,
    /// Percent of wall time.
    pub percent: f64,
    /// Milliseconds per step.
    pub ms_per_step: f64,
}

/// Where one drafter's (or all drafters') time went, in the steady state: start-up before the first step,
/// the warm-up steps (the first of each bucket) and shut-down after the last step are left out when the
/// summary says where they are (see [`WarmupEvidence`]).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DrafterBreakdown {
    /// Steady-state steps taken.
    pub steps: u64,
    /// Wall milliseconds per step.
    pub step_ms: f64,
    /// Percent of wall time inside the step (every phase but data wait).
    pub busy_pct: f64,
    /// Percent of wall time in forward, loss, backward and optimizer.
    pub compute_pct: f64,
    /// Percent of wall time in no recorded phase (between steps, unmeasured work).
    pub untracked_pct: f64,
    /// On a GPU: percent of wall time the device executed steps (CUDA events); `busy_pct` is the host's time
    /// inside a step, and the difference is the device idling inside the step.
    pub gpu_pct: Option<f64>,
    /// Every phase, in step order.
    pub phases: Vec<PhaseShare>,
}

impl DrafterBreakdown {
    fn of(drafters: &[&DrafterSummary], wall_s: f64) -> Self {
        let wall: f64 = drafters
            .iter()
            .map(|d| d.timeline.as_ref().map_or(wall_s, |t| t.steady_wall_s()))
            .sum();
        let steps: u64 = drafters.iter().map(|d| d.steady_steps()).sum();
        let seconds = |phase| {
            drafters
                .iter()
                .map(|d| d.steady_seconds(phase))
                .sum::<f64>()
        };
        let pct = |s: f64| if wall > 0.0 { 100.0 * s / wall } else { 0.0 };
        let per_step = |s: f64| {
            if steps > 0 {
                1e3 * s / steps as f64
            } else {
                0.0
            }
        };
        let recorded: f64 = DrafterPhase::ALL.iter().map(|&p| seconds(p)).sum();
        let busy = recorded - seconds(DrafterPhase::DataWait);
        let compute: f64 = DrafterPhase::ALL
            .iter()
            .filter(|p| p.is_compute())
            .map(|&p| seconds(p))
            .sum();
        Self {
            steps: steps / drafters.len().max(1) as u64,
            step_ms: per_step(wall),
            busy_pct: pct(busy),
            compute_pct: pct(compute),
            untracked_pct: pct((wall - recorded).max(0.0)),
            gpu_pct: drafters
                .iter()
                .any(|d| d.seconds(DrafterPhase::DeviceStep) > 0.0)
                .then(|| pct(seconds(DrafterPhase::DeviceStep))),
            phases: DrafterPhase::ALL
                .iter()
                .map(|&phase| PhaseShare {
                    phase,
                    percent: pct(seconds(phase)),
                    ms_per_step: per_step(seconds(phase)),
                })
                .collect(),
        }
    }

    /// The share of one phase.
    pub fn share(&self, phase: DrafterPhase) -> PhaseShare {
        self.phases[phase.index()]
    }
}

/// What came before and after the steady state, averaged over the drafters.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WarmupEvidence {
    /// Seconds from the start of the run to a drafter's first recorded span (threads, workspaces, devices).
    pub startup_s: f64,
    /// Warm-up steps per drafter (the first step of each bucket: workspace, graph capture, the first fill).
    pub warmup_steps: f64,
    /// Their wall seconds per drafter.
    pub warmup_s: f64,
    /// Seconds of steady state per drafter.
    pub steady_s: f64,
    /// Seconds from a drafter's last span to the end of the run (joins, final save, summary).
    pub shutdown_s: f64,
    /// Real tokens per second of the steady state, all drafters (the rate a longer run tends to; the run's own
    /// figure divides by the whole wall time). Token slots per second for summaries of older builds, which
    /// did not count real tokens.
    pub steady_tokens_per_s: f64,
}

impl WarmupEvidence {
    fn of(summary: &RunSummary) -> Option<Self> {
        let timelines: Vec<_> = summary
            .drafters
            .iter()
            .filter_map(|d| d.timeline.as_ref())
            .collect();
        if timelines.is_empty() || timelines.len() != summary.drafters.len() {
            return None;
        }
        let n = timelines.len() as f64;
        let mean = |f: &dyn Fn(&super::summary::DrafterTimeline) -> f64| {
            timelines.iter().map(|t| f(t)).sum::<f64>() / n
        };
        Some(Self {
            startup_s: mean(&|t| t.first_span_s),
            warmup_steps: mean(&|t| t.warmup_steps as f64),
            warmup_s: mean(&|t| t.warmup_wall_s),
            steady_s: mean(&|t| t.steady_wall_s()),
            shutdown_s: mean(&|t| (summary.wall_s - t.last_span_end_s).max(0.0)),
            steady_tokens_per_s: summary
                .drafters
                .iter()
                .filter_map(|d| {
                    let wall = d.timeline.as_ref()?.steady_wall_s();
                    let steps = (d.steps + d.skipped).max(1) as f64;
                    let tokens = if d.real_tokens > 0 {
                        d.real_tokens
                    } else {
                        d.token_slots
                    };
                    (wall > 0.0).then(|| tokens as f64 * d.steady_steps() as f64 / steps / wall)
                })
                .sum(),
        })
    }
}

/// The verdict with its numbers and the findings that follow from them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Diagnosis {
    /// The plan's name.
    pub plan: String,
    /// Which side limits throughput.
    pub bottleneck: Bottleneck,
    /// Why: the sentence with the numbers that decided the verdict.
    pub reason: String,
    /// The queue-side numbers.
    pub queue: QueueEvidence,
    /// Start-up, warm-up and shut-down, left out of `drafters` (absent for summaries of older builds).
    pub warmup: Option<WarmupEvidence>,
    /// All drafters together, steady state.
    pub drafters: DrafterBreakdown,
    /// Each drafter.
    pub per_drafter: Vec<DrafterBreakdown>,
    /// Busy well under 100% while the queue had data: the gap is on the drafter's host side.
    pub host_side_gaps: bool,
    /// Further observations, each with its numbers (host-side gaps, non-compute overhead, skipped steps).
    pub findings: Vec<String>,
    /// What to change first.
    pub advice: String,
    /// Steps, tokens, wall time and throughput, for the report's first line.
    pub steps: u64,
    /// Token slots trained on, padding included.
    pub token_slots: u64,
    /// Real tokens trained on (0 for summaries of older builds).
    pub real_tokens: u64,
    /// Real tokens with the loss mask set (0 for summaries of older builds).
    pub loss_tokens: u64,
    /// Wall seconds.
    pub wall_s: f64,
    /// The mean finite loss of the last `final_steps` steps.
    pub final_loss: Option<f64>,
    /// `dflash`: the mean τ of the same steps.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub final_tau: Option<f64>,
    /// `dflash`: the mean accuracy of block slots `1..` over the same steps.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub final_slot_accuracy: Vec<f32>,
    /// Steps per drafter the final figures average.
    pub final_steps: u64,
}

impl Diagnosis {
    /// Diagnoses a run from its summary.
    pub fn from_summary(summary: &RunSummary) -> Self {
        let q = &summary.queue;
        let near_full_from = q.capacity.saturating_sub(1).max(1);
        let watermark = q.min_ready.max(1);
        let samples = q.samples();
        let mean_depth = if samples > 0 {
            q.depth_histogram
                .iter()
                .enumerate()
                .map(|(d, n)| d as f64 * *n as f64)
                .sum::<f64>()
                / samples as f64
        } else {
            0.0
        };
        let near_full = q.fraction_where(|d| d >= near_full_from);
        let below = q.fraction_where(|d| d < watermark);
        let fraction_of_wall = |seconds: f64, workers: usize| {
            let wall = summary.wall_s * workers as f64;
            if wall > 0.0 {
                (seconds / wall).clamp(0.0, 1.0)
            } else {
                0.0
            }
        };
        // The workers' own spans are preferred; a pipeline whose workers record no wait phase still has the
        // queue's blocked-time counters, which measure the same waits from the queue's side.
        let recorded_or_queue =
            |recorded: f64, queue: f64| if recorded > 0.0 { recorded } else { queue };
        let producer_blocked = fraction_of_wall(
            recorded_or_queue(
                summary
                    .producers
                    .iter()
                    .map(|p| p.seconds(ProducerPhase::BlockedFull))
                    .sum(),
                q.producer_blocked_s,
            ),
            summary.producers.len(),
        );
        let steady_wall: Option<f64> = summary
            .drafters
            .iter()
            .map(|d| d.timeline.as_ref().map(|t| t.steady_wall_s()))
            .sum();
        let drafter_wait = match steady_wall {
            // The first fill of the queue is warm-up: the steady state's waits are the ones that say who is slow.
            Some(wall) if wall > 0.0 => (summary
                .drafters
                .iter()
                .map(|d| d.steady_seconds(DrafterPhase::DataWait))
                .sum::<f64>()
                / wall)
                .clamp(0.0, 1.0),
            _ => fraction_of_wall(
                recorded_or_queue(
                    summary
                        .drafters
                        .iter()
                        .map(|d| d.seconds(DrafterPhase::DataWait))
                        .sum(),
                    q.consumer_blocked_s,
                ),
                summary.drafters.len(),
            ),
        };
        let queue = QueueEvidence {
            samples,
            mean_depth,
            capacity: q.capacity,
            min_ready: q.min_ready,
            near_full_pct: 100.0 * near_full,
            below_watermark_pct: 100.0 * below,
            producer_blocked_pct: 100.0 * producer_blocked,
            drafter_wait_pct: 100.0 * drafter_wait,
            seen_full: q.seen_full,
            seen_below_watermark: q.seen_below_watermark,
        };
        let (bottleneck, reason) =
            verdict(&queue, near_full, below, producer_blocked, drafter_wait);

        let all: Vec<&DrafterSummary> = summary.drafters.iter().collect();
        let drafters = DrafterBreakdown::of(&all, summary.wall_s);
        let per_drafter = summary
            .drafters
            .iter()
            .map(|d| DrafterBreakdown::of(&[d], summary.wall_s))
            .collect();

        let mut findings = Vec::new();
        let idle = drafters.share(DrafterPhase::DataWait).percent + drafters.untracked_pct;
        let host_side_gaps = bottleneck != Bottleneck::Producers
            && drafters.steps > 0
            && drafters.busy_pct < 100.0 * HOST_GAP_BUSY_BELOW
            && idle >= 100.0 * HOST_GAP_IDLE_ABOVE;
        if host_side_gaps {
            findings.push(format!(
                "host-side gaps: in the steady state drafters were busy only {:.1}% although the queue was below \
                 the watermark in only {:.0}% of samples; idle {:.1}% = waiting on the queue hand-off {:.1}% + \
                 between recorded phases {:.1}%",
                drafters.busy_pct,
                queue.below_watermark_pct,
                idle,
                drafters.share(DrafterPhase::DataWait).percent,
                drafters.untracked_pct,
            ));
        }
        let device_gaps = drafters.gpu_pct.is_some_and(|gpu| {
            drafters.busy_pct >= 100.0 * HOST_GAP_BUSY_BELOW
                && drafters.busy_pct - gpu >= 100.0 * HOST_GAP_IDLE_ABOVE
        });
        if let Some(gpu) = drafters.gpu_pct {
            let low = if device_gaps {
                "gpu is the low one: the host is inside the step but the device idles in it (launches, host \
                 syncs, copies not overlapped): the gaps in activity are inside the step"
            } else if host_side_gaps {
                "busy is the low one: the host is between steps (queue hand-off, bookkeeping), so the device \
                 waits for work"
            } else {
                "both are high: the device is kept busy"
            };
            findings.push(format!(
                "busy {:.1}% (host inside a step) vs gpu {gpu:.1}% (device executing, CUDA events): {low}",
                drafters.busy_pct
            ));
        }
        let mut overhead: Vec<PhaseShare> = [
            DrafterPhase::Copy,
            DrafterPhase::AllReduce,
            DrafterPhase::Other,
        ]
        .iter()
        .map(|&p| drafters.share(p))
        .collect();
        let overhead_pct: f64 = overhead.iter().map(|s| s.percent).sum();
        if overhead_pct >= 100.0 * OVERHEAD_SIGNIFICANT {
            overhead.sort_by(|a, b| b.percent.total_cmp(&a.percent));
            let parts: Vec<String> = overhead
                .iter()
                .map(|s| {
                    format!(
                        "{} {:.1}% ({:.2} ms/step)",
                        s.phase.name(),
                        s.percent,
                        s.ms_per_step
                    )
                })
                .collect();
            findings.push(format!(
                "{overhead_pct:.1}% of drafter time is inside the step but not compute: {}",
                parts.join(", ")
            ));
        }
        if summary.skipped_nonfinite > 0 {
            findings.push(format!(
                "{} steps skipped for a non-finite loss or gradient",
                summary.skipped_nonfinite
            ));
        }
        findings.extend(summary.ending.iter().flat_map(super::RunEnding::notices));
        let advice = advice(bottleneck, host_side_gaps, &drafters);
        Self {
            plan: summary.plan.clone(),
            bottleneck,
            reason,
            queue,
            warmup: WarmupEvidence::of(summary),
            drafters,
            per_drafter,
            host_side_gaps,
            findings,
            advice,
            steps: summary.steps,
            token_slots: summary.token_slots,
            real_tokens: summary.real_tokens,
            loss_tokens: summary.loss_tokens,
            wall_s: summary.wall_s,
            final_loss: summary.final_loss,
            final_tau: summary.final_tau,
            final_slot_accuracy: summary.final_slot_accuracy.clone(),
            final_steps: summary.final_steps,
        }
    }
}

fn verdict(
    q: &QueueEvidence,
    near_full: f64,
    below: f64,
    producer_blocked: f64,
    drafter_wait: f64,
) -> (Bottleneck, String) {
    let blocked = format!(
        "producers blocked on full {:.1}% of their time, drafters waiting for data {:.1}% (pushes found the \
         queue full {} times, pops found it below the watermark {} times)",
        q.producer_blocked_pct, q.drafter_wait_pct, q.seen_full, q.seen_below_watermark
    );
    let bottleneck = Bottleneck::judge(q.samples, near_full, below, producer_blocked, drafter_wait);
    if q.samples < MIN_DEPTH_SAMPLES {
        return (
            bottleneck,
            format!(
                "only {} depth samples, judged by blocked times: {blocked}",
                q.samples
            ),
        );
    }
    let depth = format!(
        "queue at ≥{} of {} in {:.0}% of {} samples, below the watermark {} in {:.0}% (mean depth {:.1})",
        q.capacity.saturating_sub(1).max(1),
        q.capacity,
        q.near_full_pct,
        q.samples,
        q.min_ready,
        q.below_watermark_pct,
        q.mean_depth
    );
    (bottleneck, format!("{depth}; {blocked}"))
}

fn advice(bottleneck: Bottleneck, host_side_gaps: bool, drafters: &DrafterBreakdown) -> String {
    let mut heaviest: Vec<PhaseShare> = drafters
        .phases
        .iter()
        .copied()
        .filter(|s| s.phase != DrafterPhase::DataWait)
        .collect();
    heaviest.sort_by(|a, b| b.percent.total_cmp(&a.percent));
    let top = heaviest
        .iter()
        .take(2)
        .map(|s| format!("{} ({:.2} ms/step)", s.phase.name(), s.ms_per_step))
        .collect::<Vec<_>>()
        .join(" and ");
    match (bottleneck, host_side_gaps) {
        (Bottleneck::Consumers, false) => format!(
            "speed up the drafter step, heaviest first: {top}; or add drafters. More producers or a larger queue \
             will not help."
        ),
        (Bottleneck::Consumers | Bottleneck::Balanced, true) => format!(
            "close the host-side gaps first (the queue hand-off and work between phases), then the step itself: \
             {top}."
        ),
        (Bottleneck::Producers, _) => format!(
            "add producers (target GPUs) or make the source faster: drafters idle {:.1}% waiting for data. A \
             faster drafter step will not help.",
            drafters.share(DrafterPhase::DataWait).percent
        ),
        (Bottleneck::Balanced, false) => format!(
            "producers and drafters keep pace; the queue absorbs the jitter. Throughput needs both sides faster; \
             on the drafters, heaviest first: {top}."
        ),
    }
}

impl fmt::Display for Diagnosis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let rate = |count: u64| {
            if self.wall_s > 0.0 {
                count as f64 / self.wall_s
            } else {
                0.0
            }
        };
        write!(f, "run \"{}\": {} steps, ", self.plan, self.steps)?;
        if self.real_tokens > 0 || self.token_slots == 0 {
            let share = |count: u64| 100.0 * count as f64 / self.token_slots.max(1) as f64;
            write!(
                f,
                "{} real tokens ({:.0}% of {} token slots; {} with loss, {:.0}%) in {:.1} s ({:.0} real tok/s, \
                 {:.0} slots/s)",
                self.real_tokens,
                share(self.real_tokens),
                self.token_slots,
                self.loss_tokens,
                share(self.loss_tokens),
                self.wall_s,
                rate(self.real_tokens),
                rate(self.token_slots)
            )?;
        } else {
            write!(
                f,
                "{} token slots (the build that wrote this summary did not count real tokens) in {:.1} s ({:.0} slots/s)",
                self.token_slots,
                self.wall_s,
                rate(self.token_slots)
            )?;
        }
        let over = match self.final_steps {
            0 | 1 => "last step".to_string(),
            n => format!("last {n} steps"),
        };
        if let Some(loss) = self.final_loss {
            write!(f, ", final loss {loss:.4} (mean of the {over})")?;
        }
        if let Some(tau) = self.final_tau {
            let slots: Vec<String> = self
                .final_slot_accuracy
                .iter()
                .map(|acc| format!("{acc:.2}"))
                .collect();
            write!(
                f,
                ", τ {tau:.3} (slot accuracy {}; same steps)",
                slots.join(" ")
            )?;
        }
        writeln!(f)?;
        writeln!(
            f,
            "bottleneck: {}\n  {}",
            self.bottleneck.describe(),
            self.reason
        )?;
        if let Some(w) = &self.warmup {
            writeln!(
                f,
                "steady state {:.1} s per drafter at {:.0} real tok/s, measured apart from start-up {:.2} s, warm-up \
                 {:.0} step(s) {:.2} s (first step per bucket: workspace, graph capture, first fill) and shut-down \
                 {:.2} s",
                w.steady_s,
                w.steady_tokens_per_s,
                w.startup_s,
                w.warmup_steps,
                w.warmup_s,
                w.shutdown_s
            )?;
        }
        let d = &self.drafters;
        let scope = if self.warmup.is_some() {
            "drafters (steady state)"
        } else {
            "drafters"
        };
        write!(
            f,
            "{scope}: {:.2} ms/step, busy {:.1}%",
            d.step_ms, d.busy_pct
        )?;
        if let Some(gpu) = d.gpu_pct {
            write!(f, ", gpu {gpu:.1}%")?;
        }
        writeln!(
            f,
            ", compute {:.1}%, untracked {:.1}%",
            d.compute_pct, d.untracked_pct
        )?;
        writeln!(f, "  {:<11} {:>6} {:>9}", "phase", "%", "ms/step")?;
        // A phase the backend never records (the copy and the device step on the CPU, the host phases of a GPU
        // step) would only print zeros; waiting for data stays, since zero there is a finding.
        let shown = d
            .phases
            .iter()
            .filter(|share| share.phase == DrafterPhase::DataWait || share.ms_per_step > 0.0);
        for share in shown {
            writeln!(
                f,
                "  {:<11} {:>6.1} {:>9.3}",
                share.phase.name(),
                share.percent,
                share.ms_per_step
            )?;
        }
        if self.per_drafter.len() > 1 {
            let each: Vec<String> = self
                .per_drafter
                .iter()
                .enumerate()
                .map(|(i, b)| {
                    format!(
                        "d{i} busy {:.1}% wait {:.1}%",
                        b.busy_pct,
                        b.share(DrafterPhase::DataWait).percent
                    )
                })
                .collect();
            writeln!(f, "  per drafter: {}", each.join(" | "))?;
        }
        for finding in &self.findings {
            writeln!(f, "note: {finding}")?;
        }
        write!(f, "advice: {}", self.advice)
    }
}
