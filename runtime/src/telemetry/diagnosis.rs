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

/// Where one drafter's (or all drafters') time went.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DrafterBreakdown {
    /// Steps taken.
    pub steps: u64,
    /// Wall milliseconds per step.
    pub step_ms: f64,
    /// Percent of wall time inside the step (every phase but data wait).
    pub busy_pct: f64,
    /// Percent of wall time in forward, loss, backward and optimizer.
    pub compute_pct: f64,
    /// Percent of wall time in no recorded phase (between steps, unmeasured work).
    pub untracked_pct: f64,
    /// Every phase, in step order.
    pub phases: Vec<PhaseShare>,
}

impl DrafterBreakdown {
    fn of(drafters: &[&DrafterSummary], wall_s: f64) -> Self {
        let wall = wall_s * drafters.len() as f64;
        let steps: u64 = drafters.iter().map(|d| d.steps).sum();
        let seconds = |phase| drafters.iter().map(|d| d.seconds(phase)).sum::<f64>();
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
    /// All drafters together.
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
    /// Tokens trained on.
    pub tokens: u64,
    /// Wall seconds.
    pub wall_s: f64,
    /// The latest finite loss.
    pub final_loss: Option<f64>,
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
        let drafter_wait = fraction_of_wall(
            recorded_or_queue(
                summary
                    .drafters
                    .iter()
                    .map(|d| d.seconds(DrafterPhase::DataWait))
                    .sum(),
                q.consumer_blocked_s,
            ),
            summary.drafters.len(),
        );
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
            && drafters.busy_pct < 100.0 * HOST_GAP_BUSY_BELOW
            && idle >= 100.0 * HOST_GAP_IDLE_ABOVE;
        if host_side_gaps {
            findings.push(format!(
                "host-side gaps: drafters busy only {:.1}% although the queue was below the watermark in only \
                 {:.0}% of samples; idle {:.1}% = waiting on the queue hand-off {:.1}% + between recorded phases \
                 {:.1}%",
                drafters.busy_pct,
                queue.below_watermark_pct,
                idle,
                drafters.share(DrafterPhase::DataWait).percent,
                drafters.untracked_pct,
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
            drafters,
            per_drafter,
            host_side_gaps,
            findings,
            advice,
            steps: summary.steps,
            tokens: summary.tokens,
            wall_s: summary.wall_s,
            final_loss: summary.final_loss,
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
    if q.samples < MIN_DEPTH_SAMPLES {
        let prefix = format!(
            "only {} depth samples, judged by blocked times: {blocked}",
            q.samples
        );
        return if producer_blocked >= FALLBACK_BLOCKED_FRACTION {
            (Bottleneck::Consumers, prefix)
        } else if drafter_wait >= FALLBACK_BLOCKED_FRACTION {
            (Bottleneck::Producers, prefix)
        } else {
            (Bottleneck::Balanced, prefix)
        };
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
    if near_full >= PINNED_FULL_FRACTION {
        (Bottleneck::Consumers, format!("{depth}; {blocked}"))
    } else if below >= STARVED_FRACTION && drafter_wait >= DATA_WAIT_SIGNIFICANT {
        (Bottleneck::Producers, format!("{depth}; {blocked}"))
    } else {
        (Bottleneck::Balanced, format!("{depth}; {blocked}"))
    }
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
        let rate = if self.wall_s > 0.0 {
            self.tokens as f64 / self.wall_s
        } else {
            0.0
        };
        write!(
            f,
            "run \"{}\": {} steps, {} tokens in {:.1} s ({:.0} tok/s)",
            self.plan, self.steps, self.tokens, self.wall_s, rate
        )?;
        match self.final_loss {
            Some(loss) => writeln!(f, ", final loss {loss:.4}")?,
            None => writeln!(f)?,
        }
        let side = match self.bottleneck {
            Bottleneck::Consumers => "the drafters (consumers)",
            Bottleneck::Producers => "the producers (target)",
            Bottleneck::Balanced => "neither side (balanced)",
        };
        writeln!(f, "bottleneck: {side}\n  {}", self.reason)?;
        let d = &self.drafters;
        writeln!(
            f,
            "drafters: {:.2} ms/step, busy {:.1}%, compute {:.1}%, untracked {:.1}%",
            d.step_ms, d.busy_pct, d.compute_pct, d.untracked_pct
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
