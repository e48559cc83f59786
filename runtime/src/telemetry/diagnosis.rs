//! The diagnosis: from a [`RunSummary`], which side limits throughput (by who waits on whom) and where the
//! drafters' time went (from their phase totals).
//!
//! Who waits on whom: a bounded queue between producers and drafters makes the faster side wait for the
//! slower one. Producers blocked on a full queue wait on the drafters; drafters waiting for data while the queue
//! ran low wait on the producers. The side the other one waits on is the limit; when neither waits both keep
//! pace; when both wait in turn, the data arrives in bursts the queue cannot absorb (it fills, the producers
//! block, it drains, the drafters wait). The depth histogram only tells a drafter's wait for data from one at the
//! hand-off beside a full queue (a host-side gap, not the producers' doing). `draftpipe simulate` judges its
//! predictions by the same [`Bottleneck::judge`].

use std::fmt;

use serde::Serialize;

use super::phase::{DrafterPhase, ProducerPhase};
use super::summary::{DrafterSummary, RunSummary};
use crate::figures::{amount, seconds};

/// Share of a side's time spent waiting on the other side that counts as waiting: 10% is an idle time worth
/// acting on and well above the jitter of a side that keeps pace (a few percent at step boundaries).
pub const WAIT_SIGNIFICANT: f64 = 0.10;

/// Share of depth samples below the watermark for drafters' waits to be waits on the producers: beside a queue
/// that held data in more than 90% of the samples, a drafter's wait is the hand-off, not missing data.
pub const RAN_LOW_FRACTION: f64 = 0.10;

/// With fewer depth samples than this (a very short run) the histogram says little, and the drafters' waits
/// count as waits on the producers whatever the depth.
pub const MIN_DEPTH_SAMPLES: u64 = 20;

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
    /// The drafters (consumers) are slower: producers block on a full queue, drafters do not wait.
    Consumers,
    /// The producers are slower: drafters wait for data, producers do not block.
    Producers,
    /// Both wait in turn: the producers deliver in bursts larger than the queue absorbs.
    Bursty,
    /// Neither side waits: both keep pace.
    Balanced,
}

/// What the verdict is judged from: each side's waiting on the other, and how often the queue ran low.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Waits {
    /// Share (0–1) of the producers' time blocked on a full queue.
    pub producer_blocked: f64,
    /// Share (0–1) of the drafters' time waiting for data.
    pub drafter_wait: f64,
    /// Share (0–1) of the depth samples below the watermark; `None` with too few samples to tell.
    pub below_watermark: Option<f64>,
}

impl Bottleneck {
    /// The verdict by who waits on whom (module docs): the rule the diagnosis of a run applies, and the one
    /// `draftpipe simulate` applies to a prediction.
    pub fn judge(waits: Waits) -> Self {
        let producers_wait = waits.producer_blocked >= WAIT_SIGNIFICANT;
        let drafters_wait = waits.drafter_wait >= WAIT_SIGNIFICANT
            && waits
                .below_watermark
                .is_none_or(|below| below >= RAN_LOW_FRACTION);
        match (producers_wait, drafters_wait) {
            (true, true) => Self::Bursty,
            (true, false) => Self::Consumers,
            (false, true) => Self::Producers,
            (false, false) => Self::Balanced,
        }
    }

    /// How the report names the side.
    pub fn describe(self) -> &'static str {
        match self {
            Self::Consumers => "the drafters (consumers)",
            Self::Producers => "the producers (target)",
            Self::Bursty => "the producers' bursts (both sides wait in turn)",
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
    /// Seconds each drafter waited for its first data (the first producer), apart from any step.
    pub first_data_wait_s: f64,
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
            first_data_wait_s: mean(&|t| t.first_data_wait_s),
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
    /// `dflash`, `eagle3`: the mean exact acceptance length of the same steps.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub final_tau_exact: Option<f64>,
    /// The mean of SpecForge's simulated acceptance length over the same steps.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub final_tau_simulated: Option<f64>,
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
        let round_never_filled = summary.ending.as_ref().and_then(round_never_filled);
        let (bottleneck, reason) = match &round_never_filled {
            // No step ran, so there is no pace to judge: the drafters waited for data that could not make a round.
            Some((reason, _)) => (Bottleneck::Producers, reason.clone()),
            None => verdict(&queue, producer_blocked, drafter_wait),
        };

        let all: Vec<&DrafterSummary> = summary.drafters.iter().collect();
        let drafters = DrafterBreakdown::of(&all, summary.wall_s);
        let per_drafter = summary
            .drafters
            .iter()
            .map(|d| DrafterBreakdown::of(&[d], summary.wall_s))
            .collect();

        let mut findings = Vec::new();
        let idle = drafters.share(DrafterPhase::DataWait).percent + drafters.untracked_pct;
        let host_side_gaps = !matches!(bottleneck, Bottleneck::Producers | Bottleneck::Bursty)
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
        if drafters.steps > 0 && overhead_pct >= 100.0 * OVERHEAD_SIGNIFICANT {
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
        if let Some(masks) = summary.masks.as_ref().filter(|masks| masks.any_bad()) {
            findings.push(format!("loss masks: {}", masks.describe()));
        }
        findings.extend(summary.ending.iter().flat_map(super::RunEnding::notices));
        let advice = match round_never_filled {
            Some((_, advice)) => advice,
            None => advice(bottleneck, host_side_gaps, &drafters),
        };
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
            final_tau_exact: summary.final_tau_exact,
            final_tau_simulated: summary.final_tau_simulated,
            final_slot_accuracy: summary.final_slot_accuracy.clone(),
            final_steps: summary.final_steps,
        }
    }
}

/// For a lockstep run whose data ended before it filled a single round: the verdict's reason and the advice.
fn round_never_filled(ending: &super::RunEnding) -> Option<(String, String)> {
    let members = ending.round_members?;
    if ending.steps_this_run > 0 || ending.untrained.is_empty() {
        return None;
    }
    let left = ending
        .untrained
        .iter()
        .map(|bucket| format!("{} of bucket {}", bucket.batches, bucket.padded_len))
        .collect::<Vec<_>>()
        .join(", ");
    Some((
        format!(
            "no step was trained: the {members} lockstep drafters waited for a round of {members} batches of one \
             bucket, and the data ended with {left}"
        ),
        format!(
            "give the run more data (at least {members} batches of one bucket make a step), or train it on one \
             drafter."
        ),
    ))
}

fn verdict(q: &QueueEvidence, producer_blocked: f64, drafter_wait: f64) -> (Bottleneck, String) {
    let enough_samples = q.samples >= MIN_DEPTH_SAMPLES;
    let bottleneck = Bottleneck::judge(Waits {
        producer_blocked,
        drafter_wait,
        below_watermark: enough_samples.then_some(q.below_watermark_pct / 100.0),
    });
    let waits = format!(
        "producers blocked on a full queue {:.1}% of their time, drafters waiting for data {:.1}% (pushes found \
         the queue full {} times, pops found it below the watermark {} times)",
        q.producer_blocked_pct, q.drafter_wait_pct, q.seen_full, q.seen_below_watermark
    );
    let depth = if enough_samples {
        format!(
            "queue at ≥{} of {} in {:.0}% of {} samples, below the watermark {} in {:.0}% (mean depth {:.1})",
            q.capacity.saturating_sub(1).max(1),
            q.capacity,
            q.near_full_pct,
            q.samples,
            q.min_ready,
            q.below_watermark_pct,
            q.mean_depth
        )
    } else {
        format!("only {} depth samples, the waits alone decide", q.samples)
    };
    let significant = 100.0 * WAIT_SIGNIFICANT;
    let why = match bottleneck {
        Bottleneck::Consumers => {
            format!("the producers wait on the drafters (≥{significant:.0}%), not the reverse")
        }
        Bottleneck::Producers => {
            format!("the drafters wait on the producers (≥{significant:.0}%), not the reverse")
        }
        Bottleneck::Bursty => format!(
            "both sides wait ≥{significant:.0}% in turn: the queue fills and the producers block, then it drains \
             and the drafters wait"
        ),
        Bottleneck::Balanced if drafter_wait >= WAIT_SIGNIFICANT => format!(
            "neither waits on the other: the drafters' waits came with a queue that held data (below the \
             watermark in under {:.0}% of samples), so they are the hand-off, not the producers",
            100.0 * RAN_LOW_FRACTION
        ),
        Bottleneck::Balanced => format!("neither side waits ≥{significant:.0}% on the other"),
    };
    (bottleneck, format!("{why}: {waits}; {depth}"))
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
        (Bottleneck::Bursty, _) => format!(
            "the producers deliver in bursts: a larger queue (capacity, and `min_ready` no higher than needed) \
             absorbs them, and a producer that sends evenly (smaller messages, more often) needs none. Past the \
             bursts, the producers' mean rate sets the pace: drafters idle {:.1}% waiting for data.",
            drafters.share(DrafterPhase::DataWait).percent
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
                "{} real tokens ({:.0}% of {} token slots; {} with loss, {:.0}%) in {} ({} real tok/s, {} \
                 slots/s)",
                self.real_tokens,
                share(self.real_tokens),
                self.token_slots,
                self.loss_tokens,
                share(self.loss_tokens),
                seconds(self.wall_s),
                amount(rate(self.real_tokens)),
                amount(rate(self.token_slots))
            )?;
        } else {
            write!(
                f,
                "{} token slots (the build that wrote this summary did not count real tokens) in {} ({} slots/s)",
                self.token_slots,
                seconds(self.wall_s),
                amount(rate(self.token_slots))
            )?;
        }
        let over = match self.final_steps {
            0 | 1 => "last step".to_string(),
            n => format!("last {n} steps"),
        };
        if let Some(loss) = self.final_loss {
            write!(f, ", final loss {loss:.4} (mean of the {over})")?;
        }
        if let Some(simulated) = self.final_tau_simulated {
            let slots: Vec<String> = self
                .final_slot_accuracy
                .iter()
                .map(|acc| format!("{acc:.2}"))
                .collect();
            // A summary of an older build has the simulated figure only.
            let exact = self
                .final_tau_exact
                .map_or_else(String::new, |exact| format!("{exact:.3} exact, "));
            write!(
                f,
                ", τ {exact}{simulated:.3} simulated (slot accuracy {}; same steps)",
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
                "steady state {} per drafter at {} real tok/s, measured apart from start-up {}, waiting for the \
                 first data {}, warm-up {:.0} step(s) {} (first step per bucket: workspace, graph capture, first \
                 fill) and shut-down {}",
                seconds(w.steady_s),
                amount(w.steady_tokens_per_s),
                seconds(w.startup_s),
                seconds(w.first_data_wait_s),
                w.warmup_steps,
                seconds(w.warmup_s),
                seconds(w.shutdown_s)
            )?;
        }
        let d = &self.drafters;
        if self.steps == 0 {
            // Without a step the breakdown would read a start-up's few milliseconds as "busy 100%".
            writeln!(
                f,
                "drafters: no step completed, so there is no step time to break down"
            )?;
            for finding in &self.findings {
                writeln!(f, "note: {finding}")?;
            }
            return write!(f, "advice: {}", self.advice);
        }
        let scope = if self.warmup.is_some() {
            "drafters (steady state)"
        } else {
            "drafters"
        };
        write!(
            f,
            "{scope}: {}/step, busy {:.1}%",
            seconds(d.step_ms / 1e3),
            d.busy_pct
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
