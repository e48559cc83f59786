//! One status line: what the run looks like over the last telemetry period, computed from two counter
//! snapshots and the queue's statistics.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::counts::{DrafterCounts, Taus, TelemetrySnapshot};
use super::phase::DrafterPhase;

/// The queue's statistics as telemetry reads them (the lead maps the queue's own stats type to this, which
/// keeps telemetry independent of the queue's implementation).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QueueSnapshot {
    /// Items queued now over all buckets.
    pub depth: usize,
    /// Most items the queue holds.
    pub capacity: usize,
    /// Watermark: consumers wait until this many items are queued.
    pub min_ready: usize,
    /// Items queued now, per bucket in bucket order.
    pub per_bucket: Vec<usize>,
    /// Items pushed so far.
    pub pushes: u64,
    /// Items popped so far.
    pub pops: u64,
    /// Total time producers spent blocked on a full queue.
    pub producer_blocked: Duration,
    /// Total time consumers spent blocked below the watermark.
    pub consumer_blocked: Duration,
    /// Times a push found the queue full.
    pub seen_full: u64,
    /// Times a pop found the queue below the watermark.
    pub seen_below_watermark: u64,
    /// Rounds of one bucket the queue handed to a data-parallel group (0 without one).
    pub rounds: u64,
    /// Stepped all-reduce rounds whose replicas' batches had different padded lengths (0 while the queue hands
    /// out rounds).
    pub mixed_rounds: u64,
}

/// Queue fill as `q_hs=[depth/capacity]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueFill {
    /// Items queued.
    pub depth: usize,
    /// Most items the queue holds.
    pub capacity: usize,
}

/// One drafter over the last interval.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DrafterStatus {
    /// Percent of the interval the host spent inside the step (every phase but data wait), a step still under
    /// way included.
    pub busy_pct: f64,
    /// Percent of the interval spent blocked waiting for a batch, a wait still under way included.
    pub data_wait_pct: f64,
    /// Percent of the interval spent in the gradient all-reduce (its wait for the slowest peer included); 0 in
    /// status lines of older builds and for a single drafter's near-empty all-reduce.
    #[serde(default)]
    pub all_reduce_pct: f64,
    /// On a GPU: percent of the interval the device executed steps (CUDA events, the `device_step` phase).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_pct: Option<f64>,
}

/// One status line. Display gives the human form, Serialize the `--json` / `status.jsonl` form.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatusLine {
    /// Seconds since the run started.
    pub elapsed_s: f64,
    /// Steps completed by every drafter.
    pub step: u64,
    /// Steps the run will take, when known.
    pub total_steps: Option<u64>,
    /// Token slots trained on so far over all drafters, padding included (`steps × sequences × padded_len`).
    #[serde(alias = "tokens")]
    pub token_slots: u64,
    /// Real tokens trained on so far (positions within the sequences' lengths: what `eval` counts).
    #[serde(default)]
    pub real_tokens: u64,
    /// Real tokens with the loss mask set.
    #[serde(default)]
    pub loss_tokens: u64,
    /// Real tokens per second of the steps completed over the last `rate_window_s` seconds (a window at least
    /// as long as the slowest step, so a line never reads 0 while every drafter is inside a step); `None`
    /// (JSON `null`) before the first step ends.
    pub real_tokens_per_s: Option<f64>,
    /// Token slots per second over the same window, padding included (`None` before the first step).
    pub token_slots_per_s: Option<f64>,
    /// Real tokens with a loss per second over the same window (`None` before the first step).
    pub loss_tokens_per_s: Option<f64>,
    /// The window of the rates, in seconds.
    #[serde(default, alias = "tokens_per_s_window_s")]
    pub rate_window_s: f64,
    /// Real tokens per second since the start (`None` before the first step).
    pub real_tokens_per_s_overall: Option<f64>,
    /// Total queue depth and capacity.
    pub q_hs: QueueFill,
    /// Queue depth per bucket.
    pub q_hsb: Vec<usize>,
    /// Per drafter, busy and data-wait percentages over the interval.
    pub drafters: Vec<DrafterStatus>,
    /// Mean of the finite losses reported in the interval (the latest known loss when the interval had none).
    pub loss: Option<f64>,
    /// `dflash`, `eagle3`: mean over the interval's steps of the exact acceptance length (each block's drafted
    /// prefix matching its labels, plus the bonus token; the latest when the interval had none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tau_exact: Option<f64>,
    /// The same mean of SpecForge's simulated acceptance length `1 + Σ_k Π_{j≤k} acc_j`; status files written
    /// before the exact figure existed call it `tau`.
    #[serde(default, alias = "tau", skip_serializing_if = "Option::is_none")]
    pub tau_simulated: Option<f64>,
    /// `dflash`: per block slot `1..`, the mean accuracy of the interval's steps over every drafter (the latest
    /// step's when the interval had none); empty for the other families.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub slot_accuracy: Vec<f64>,
    /// The learning rate the latest applied step used: the plan's `lr` times its schedule at this line's step
    /// (the host's copy of the device's formula); `None` before the first step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub learning_rate: Option<f64>,
    /// Mean global gradient norm, before clipping, of the interval's applied steps over every drafter (the
    /// latest when the interval had none); `None` before the first step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_norm: Option<f64>,
    /// Steps skipped so far for non-finite values.
    pub skipped: u64,
    /// Seconds the drafters have waited for the first data, while nothing has arrived yet (the run is waiting
    /// for its first producer, not stalled); `None` once a drafter has had data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_data_wait_s: Option<f64>,
    /// The source's own field (`producers=[3/5 connected]`), when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// The acceptance check's column (`accept τ 2.310 @ step 400`), when the pipeline has an `acceptance`
    /// section.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acceptance: Option<super::acceptance::AcceptanceStatus>,
}

fn per_second(count: u64, over: Duration) -> f64 {
    let seconds = over.as_secs_f64();
    if seconds > 0.0 {
        count as f64 / seconds
    } else {
        0.0
    }
}

fn percent(part: Duration, whole: Duration) -> f64 {
    let whole = whole.as_secs_f64();
    // Busy and wait count open spans, so they are exact; a device span is recorded (anchored at the host's view
    // of its end) a step late, which can push one interval of a GPU figure a step's length over 100%.
    if whole > 0.0 {
        (100.0 * part.as_secs_f64() / whole).clamp(0.0, 100.0)
    } else {
        0.0
    }
}

impl StatusLine {
    /// The status over the interval from `previous` to `current`.
    pub fn between(
        previous: &TelemetrySnapshot,
        current: &TelemetrySnapshot,
        queue: &QueueSnapshot,
        total_steps: Option<u64>,
    ) -> Self {
        let interval = current.elapsed.saturating_sub(previous.elapsed);
        let started = current.token_slots() > 0;
        let rate = |now: u64, before: u64, over: Duration| {
            started.then(|| per_second(now.saturating_sub(before), over))
        };
        let drafters = current
            .drafters
            .iter()
            .enumerate()
            .map(|(i, now)| {
                let before = previous.drafters.get(i).cloned().unwrap_or_default();
                let device = now.phase(DrafterPhase::DeviceStep).total;
                DrafterStatus {
                    busy_pct: percent(
                        now.busy_so_far().saturating_sub(before.busy_so_far()),
                        interval,
                    ),
                    data_wait_pct: percent(
                        now.wait_so_far().saturating_sub(before.wait_so_far()),
                        interval,
                    ),
                    all_reduce_pct: percent(
                        now.phase(DrafterPhase::AllReduce)
                            .total
                            .saturating_sub(before.phase(DrafterPhase::AllReduce).total),
                        interval,
                    ),
                    gpu_pct: (now.phase(DrafterPhase::DeviceStep).count > 0).then(|| {
                        percent(
                            device.saturating_sub(before.phase(DrafterPhase::DeviceStep).total),
                            interval,
                        )
                    }),
                }
            })
            .collect();
        let (mut loss_sum, mut loss_count) = (0.0, 0u64);
        for (i, now) in current.drafters.iter().enumerate() {
            let before = previous.drafters.get(i).cloned().unwrap_or_default();
            loss_sum += now.loss_sum - before.loss_sum;
            loss_count += now.loss_count.saturating_sub(before.loss_count);
        }
        let (mut tau_sum, mut tau_count) = (Taus::default(), 0u64);
        for (i, now) in current.drafters.iter().enumerate() {
            let before = previous.drafters.get(i).cloned().unwrap_or_default();
            tau_sum = tau_sum + (now.tau_sum - before.tau_sum);
            tau_count += now.tau_count.saturating_sub(before.tau_count);
        }
        let tau = if tau_count > 0 {
            Some(tau_sum.per(tau_count))
        } else {
            current.drafters.iter().find_map(|d| d.last_tau)
        };
        let (mut norm_sum, mut norm_count) = (0.0, 0u64);
        let mut accuracy_sums: Vec<f64> = Vec::new();
        for (i, now) in current.drafters.iter().enumerate() {
            let before = previous.drafters.get(i).cloned().unwrap_or_default();
            norm_sum += now.grad_norm_sum - before.grad_norm_sum;
            norm_count += now.grad_norm_count.saturating_sub(before.grad_norm_count);
            accuracy_sums.resize(accuracy_sums.len().max(now.slot_accuracy_sum.len()), 0.0);
            for (slot, sum) in now.slot_accuracy_sum.iter().enumerate() {
                accuracy_sums[slot] += sum - before.slot_accuracy_sum.get(slot).unwrap_or(&0.0);
            }
        }
        let grad_norm = if norm_count > 0 {
            Some(norm_sum / norm_count as f64)
        } else {
            current.drafters.iter().find_map(|d| d.last_grad_norm)
        };
        let slot_accuracy = if tau_count > 0 {
            accuracy_sums
                .iter()
                .map(|sum| sum / tau_count as f64)
                .collect()
        } else {
            current
                .drafters
                .iter()
                .find(|d| !d.last_slot_accuracy.is_empty())
                .map(|d| d.last_slot_accuracy.iter().map(|&a| f64::from(a)).collect())
                .unwrap_or_default()
        };
        let loss = if loss_count > 0 {
            Some(loss_sum / loss_count as f64)
        } else {
            current.drafters.iter().find_map(|d| d.last_loss)
        };
        Self {
            elapsed_s: current.elapsed.as_secs_f64(),
            step: current.step(),
            total_steps,
            token_slots: current.token_slots(),
            real_tokens: current.real_tokens(),
            loss_tokens: current.loss_tokens(),
            real_tokens_per_s: rate(current.real_tokens(), previous.real_tokens(), interval),
            token_slots_per_s: rate(current.token_slots(), previous.token_slots(), interval),
            loss_tokens_per_s: rate(current.loss_tokens(), previous.loss_tokens(), interval),
            rate_window_s: interval.as_secs_f64(),
            real_tokens_per_s_overall: rate(current.real_tokens(), 0, current.elapsed),
            q_hs: QueueFill {
                depth: queue.depth,
                capacity: queue.capacity,
            },
            q_hsb: queue.per_bucket.clone(),
            drafters,
            loss,
            tau_exact: tau.map(|t| t.exact),
            tau_simulated: tau.map(|t| t.simulated),
            slot_accuracy,
            learning_rate: None,
            grad_norm,
            skipped: current.skipped(),
            first_data_wait_s: current
                .drafters
                .iter()
                .all(|d| d.first_data_wait.is_none())
                .then(|| current.drafters.iter().map(|d| d.open_wait).max())
                .flatten()
                .filter(|wait| !wait.is_zero())
                .map(|wait| wait.as_secs_f64()),
            source: None,
            acceptance: None,
        }
    }

    /// Replaces the interval's token rates by the rates of the steps completed over a longer window, from
    /// `window_start` (an earlier snapshot) to `current`.
    ///
    /// Each drafter's tokens are divided by the time between its step completions, not by the window, so steps
    /// much longer than the period do not make the rate jump with how many completions a window happens to
    /// hold. A drafter that stops completing steps sees its rate decay: once it has gone longer than its longest
    /// step without one, the time since its last completion counts too.
    pub fn with_rate_window(
        mut self,
        window_start: &TelemetrySnapshot,
        current: &TelemetrySnapshot,
    ) -> Self {
        let now = current.elapsed;
        let rate = |count: fn(&DrafterCounts) -> u64| {
            let per_drafter = current.drafters.iter().enumerate().map(|(i, d)| {
                let before = window_start.drafters.get(i).cloned().unwrap_or_default();
                // From the last completion before the window (or the start of work) to the last one in it.
                let from = if before.token_slots > 0 {
                    before.last_step_end
                } else {
                    d.first_span_start.unwrap_or_default()
                };
                let completed = d.last_step_end.saturating_sub(from);
                let stalled = now.saturating_sub(from).saturating_sub(d.longest_step);
                per_second(
                    count(d).saturating_sub(count(&before)),
                    completed.max(stalled),
                )
            });
            (current.token_slots() > 0).then(|| per_drafter.sum())
        };
        self.real_tokens_per_s = rate(|d| d.real_tokens);
        self.token_slots_per_s = rate(|d| d.token_slots);
        self.loss_tokens_per_s = rate(|d| d.loss_tokens);
        self.rate_window_s = now.saturating_sub(window_start.elapsed).as_secs_f64();
        self
    }

    /// The line drawn in place on a terminal: a bar when the total is known, then the status.
    pub fn progress_line(&self, bar_width: usize) -> String {
        match self.total_steps {
            Some(total) if total > 0 => {
                format!("{} {self}", progress_bar(self.step, total, bar_width))
            }
            _ => self.to_string(),
        }
    }
}

/// `[#####.....]`: `done` of `total` as a bar of `width` characters (what `run` and `eval` draw on a terminal).
pub fn progress_bar(done: u64, total: u64, width: usize) -> String {
    let filled = ((done.min(total) as f64 / total.max(1) as f64) * width as f64) as usize;
    format!("[{}{}]", "#".repeat(filled), ".".repeat(width - filled))
}

fn join<T>(items: &[T], each: impl Fn(&T) -> String) -> String {
    items.iter().map(each).collect::<Vec<_>>().join(",")
}

impl fmt::Display for StatusLine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:>8.1}s step {}", self.elapsed_s, self.step)?;
        if let Some(total) = self.total_steps {
            write!(f, "/{total}")?;
        }
        if let Some(wait) = self.first_data_wait_s {
            // The drafters are ready and nothing has arrived: the wait is the producers', not a stall.
            write!(
                f,
                " | waiting for the first data from the producers: {wait:.1}s | q_hs=[{}/{}]",
                self.q_hs.depth, self.q_hs.capacity
            )?;
            if let Some(source) = &self.source {
                write!(f, " | {source}")?;
            }
            return Ok(());
        }
        // Before the first step completes there is no rate to show, only steps under way.
        let rate = |rate: Option<f64>| rate.map_or_else(|| "-".to_string(), crate::figures::amount);
        let share = |part: Option<f64>| match (part, self.token_slots_per_s) {
            (Some(part), Some(slots)) if slots > 0.0 => format!("{:.0}%", 100.0 * part / slots),
            _ => "-".to_string(),
        };
        write!(
            f,
            " | {} real tok/s ({:.0}s) (avg {}) of {} slots/s: {} real, {} with loss | q_hs=[{}/{}] q_hsb=[{}] \
             | busy=[{}]%",
            rate(self.real_tokens_per_s),
            self.rate_window_s,
            rate(self.real_tokens_per_s_overall),
            rate(self.token_slots_per_s),
            share(self.real_tokens_per_s),
            share(self.loss_tokens_per_s),
            self.q_hs.depth,
            self.q_hs.capacity,
            join(&self.q_hsb, |d| d.to_string()),
            join(&self.drafters, |d| format!("{:.0}", d.busy_pct)),
        )?;
        if self.drafters.iter().any(|d| d.gpu_pct.is_some()) {
            write!(
                f,
                " gpu=[{}]%",
                join(&self.drafters, |d| format!(
                    "{:.0}",
                    d.gpu_pct.unwrap_or(0.0)
                ))
            )?;
        }
        write!(
            f,
            " wait=[{}]%",
            join(&self.drafters, |d| format!("{:.0}", d.data_wait_pct))
        )?;
        match self.loss {
            Some(loss) => write!(f, " | loss {loss:.4}")?,
            None => write!(f, " | loss -")?,
        }
        match (self.tau_exact, self.tau_simulated) {
            (Some(exact), Some(simulated)) => {
                write!(f, " τ {exact:.3} exact ({simulated:.3} simulated)")?
            }
            (None, Some(simulated)) => write!(f, " τ {simulated:.3} simulated")?,
            (Some(exact), None) => write!(f, " τ {exact:.3} exact")?,
            (None, None) => {}
        }
        if let Some(acceptance) = &self.acceptance {
            write!(f, " | {acceptance}")?;
        }
        if self.skipped > 0 {
            write!(f, " | skipped {}", self.skipped)?;
        }
        if let Some(source) = &self.source {
            write!(f, " | {source}")?;
        }
        Ok(())
    }
}
