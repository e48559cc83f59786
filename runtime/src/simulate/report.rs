//! What `draftpipe simulate` prints: one prediction in the shape of a run's diagnosis, or variants side by side.

use std::fmt;

use draftpipe_compiler::plan::PullPolicy;

use super::engine::Outcome;
use super::{Model, WARMUP_SHARE};
use crate::figures::{amount, seconds};
use crate::telemetry::Bottleneck;

/// One simulation's figures and verdict.
#[derive(Debug, Clone, PartialEq)]
pub struct Prediction {
    /// The model simulated.
    pub model: Model,
    /// What the engine measured.
    pub outcome: Outcome,
    /// The verdict, by the diagnosis's rule.
    pub bottleneck: Bottleneck,
    /// Share of time at `capacity − 1` or deeper.
    pub near_full: f64,
    /// Share of time below the watermark.
    pub below_watermark: f64,
    /// Simulated seconds.
    pub duration_s: f64,
    /// The seed.
    pub seed: u64,
}

fn pull_name(pull: PullPolicy) -> &'static str {
    match pull {
        PullPolicy::RandomInBucket => "random_in_bucket",
        PullPolicy::RoundRobin => "round_robin",
        PullPolicy::Fifo => "fifo",
    }
}

impl Prediction {
    /// The one-line verdict: who sets the pace and what would change throughput.
    pub fn verdict(&self) -> &'static str {
        match self.bottleneck {
            Bottleneck::Consumers => {
                "the drafters set the pace: the queue sits full and producers block. A larger queue or more \
                 producers will not change throughput; a faster step or another drafter will."
            }
            Bottleneck::Producers => {
                "the producers set the pace: drafters wait for data. Add producers or make the source faster; a \
                 larger queue or a faster drafter step will not help."
            }
            Bottleneck::Bursty => {
                "the producers deliver in bursts: the queue fills and they block, then it drains and the drafters \
                 wait. A larger queue absorbs the bursts; past them the producers' mean rate sets the pace."
            }
            Bottleneck::Balanced => {
                "neither side dominates: both keep pace and the queue absorbs the jitter. Throughput needs both \
                 sides faster."
            }
        }
    }

    /// Token slots per second (padding included: what the simulator counts, a bucket's padded length per
    /// item) and, for a model measured in a run, the real tokens they stand for at the run's real share:
    /// the two figures `run`'s status line shows, in its order when both exist.
    fn throughput_line(&self) -> String {
        let m = &self.model;
        let slots = self.outcome.slots_per_s;
        let capacities = format!(
            "producers could make {} slots/s, drafters could train on {}",
            amount(m.producer_capacity()),
            amount(m.drafter_capacity())
        );
        match m.real_share {
            Some(real) => format!(
                "{} real tok/s of {} slots/s ({:.0}% of the slots were real tokens in the run; {capacities})",
                amount(real * slots),
                amount(slots),
                100.0 * real
            ),
            None => format!(
                "{} slots/s (token slots, padding included: `run` leads with the real tokens, fewer by the \
                 padding; {capacities})",
                amount(slots)
            ),
        }
    }

    fn depth_line(&self) -> String {
        let o = &self.outcome;
        let m = &self.model;
        format!(
            "mean {:.1}, p10 {}, p50 {}, p90 {}; ≥{} of {} in {:.0}% of the time, below the watermark {} in {:.0}%",
            o.mean_depth(),
            o.depth_quantile(0.1),
            o.depth_quantile(0.5),
            o.depth_quantile(0.9),
            m.capacity.saturating_sub(1).max(1),
            m.capacity,
            100.0 * self.near_full,
            m.min_ready,
            100.0 * self.below_watermark
        )
    }
}

impl fmt::Display for Prediction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = &self.model;
        let o = &self.outcome;
        writeln!(
            f,
            "simulated \"{}\" for {} (seed {}; the first {:.0}% left out as warm-up; {} events)",
            m.name,
            seconds(self.duration_s),
            self.seed,
            100.0 * WARMUP_SHARE,
            o.events
        )?;
        let rate = if m.produce_mean_s > 0.0 {
            format!("{} items/s", amount(1.0 / m.produce_mean_s))
        } else {
            "unbounded".into()
        };
        writeln!(
            f,
            "  producers: {} × {rate} ({})",
            m.producers, m.producer_origin
        )?;
        let steps: Vec<String> = m
            .buckets
            .iter()
            .filter(|b| b.share > 0.0)
            .map(|b| {
                // A model without spread says so in its origin; "± 0 s" on every bucket would only repeat it.
                let spread = if b.step_std_s > 0.0 {
                    format!(" ± {}", seconds(b.step_std_s))
                } else {
                    String::new()
                };
                format!(
                    "{}: {}{spread} ({:.0}% of items)",
                    b.padded_len,
                    seconds(b.step_mean_s),
                    100.0 * b.share
                )
            })
            .collect();
        writeln!(
            f,
            "  drafters:  {} × step per bucket {}{} ({})",
            m.drafters,
            steps.join(", "),
            if m.lockstep && m.drafters > 1 && m.rounds {
                ", in lockstep (all-reduce), rounds of one bucket"
            } else if m.lockstep && m.drafters > 1 {
                ", in lockstep (all-reduce), each its own bucket"
            } else {
                ""
            },
            m.drafter_origin
        )?;
        writeln!(
            f,
            "  queue:     capacity {}, min_ready {}, {}",
            m.capacity,
            m.min_ready,
            pull_name(m.pull)
        )?;
        writeln!(f, "throughput: {}", self.throughput_line())?;
        writeln!(f, "queue depth: {}", self.depth_line())?;
        writeln!(
            f,
            "producers blocked on full {:.1}% of their time; drafters waiting for data {:.1}%, at the all-reduce \
             {:.1}%",
            100.0 * o.producer_blocked,
            100.0 * o.drafter_wait,
            100.0 * o.drafter_barrier
        )?;
        writeln!(f, "bottleneck: {}", self.bottleneck.describe())?;
        write!(f, "verdict: {}", self.verdict())
    }
}

/// Several predictions side by side: the base plan first, then each `--set` variant.
#[derive(Debug, Clone, PartialEq)]
pub struct Comparison {
    /// `(label, prediction)`, the base first.
    pub variants: Vec<(String, Prediction)>,
}

impl fmt::Display for Comparison {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some((_, base)) = self.variants.first() else {
            return Ok(());
        };
        let base_rate = base.outcome.slots_per_s;
        let rows: Vec<(&str, Vec<String>)> = vec![
            (
                "slots/s",
                self.variants
                    .iter()
                    .map(|(_, p)| {
                        let rate = p.outcome.slots_per_s;
                        if base_rate > 0.0 && !std::ptr::eq(p, base) {
                            format!(
                                "{} ({:+.1}%)",
                                amount(rate),
                                100.0 * (rate / base_rate - 1.0)
                            )
                        } else {
                            amount(rate)
                        }
                    })
                    .collect(),
            ),
            (
                "mean depth",
                self.variants
                    .iter()
                    .map(|(_, p)| format!("{:.1} of {}", p.outcome.mean_depth(), p.model.capacity))
                    .collect(),
            ),
            (
                "near full",
                self.variants
                    .iter()
                    .map(|(_, p)| format!("{:.0}%", 100.0 * p.near_full))
                    .collect(),
            ),
            (
                "producers blocked",
                self.variants
                    .iter()
                    .map(|(_, p)| format!("{:.1}%", 100.0 * p.outcome.producer_blocked))
                    .collect(),
            ),
            (
                "drafters waiting",
                self.variants
                    .iter()
                    .map(|(_, p)| format!("{:.1}%", 100.0 * p.outcome.drafter_wait))
                    .collect(),
            ),
            (
                "bottleneck",
                self.variants
                    .iter()
                    .map(|(_, p)| {
                        match p.bottleneck {
                            Bottleneck::Consumers => "drafters",
                            Bottleneck::Producers => "producers",
                            Bottleneck::Bursty => "bursty",
                            Bottleneck::Balanced => "balanced",
                        }
                        .to_string()
                    })
                    .collect(),
            ),
        ];
        let labels: Vec<&str> = self.variants.iter().map(|(l, _)| l.as_str()).collect();
        let widths: Vec<usize> = (0..labels.len())
            .map(|i| {
                rows.iter()
                    .map(|(_, cells)| cells[i].chars().count())
                    .chain([labels[i].chars().count()])
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        write!(f, "{:<18}", "")?;
        for (label, width) in labels.iter().zip(&widths) {
            write!(f, "  {label:>width$}")?;
        }
        for (name, cells) in &rows {
            write!(f, "\n{name:<18}")?;
            for (cell, width) in cells.iter().zip(&widths) {
                write!(f, "  {cell:>width$}")?;
            }
        }
        for (label, p) in &self.variants {
            write!(f, "\n{label}: {}", p.verdict())?;
        }
        Ok(())
    }
}
