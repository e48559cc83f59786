//! `draftpipe simulate`: a discrete-event model of a compiled plan, to answer "would a deeper queue (more
//! producers, another drafter, a faster step) help?" before spending device hours on a run.
//!
//! ```text
//!  Plan ─┬─ queue: capacity, min_ready, buckets, pull ───────────────────────────┐
//!        ├─ producers × rate per worker ◀─ --producer-rate │ --from RUN_DIR      ├─▶ Model ─ --set what-ifs ─▶ engine
//!        └─ drafters × step time per bucket ◀─ GPU time model │ FLOPs at an assumed rate (CPU) │ --step-time │ --from
//!                                                                              ┘        (seeded, discrete-event)
//!                                                                                              │
//!   Prediction: slots/s, queue depth distribution, producers blocked, drafters waiting ◀──────┘
//!               + the bottleneck by the same rule the run's diagnosis uses ([`Bottleneck::judge`])
//! ```
//!
//! The queue follows the runtime queue's semantics (see [`engine`](self) docs); drafters under `sync =
//! allreduce` step in lockstep (each round waits for the slowest replica); variability comes from the measured
//! spread of step and production times (log-normal, seeded).

mod engine;
mod report;
mod whatif;

use draftpipe_compiler::cost::gpu::{bucket_shares, gpu_step_model};
use draftpipe_compiler::plan::{Device, Plan, PullPolicy, SyncMode};

use crate::figures::{amount, seconds};
use crate::telemetry::{Bottleneck, DrafterPhase, RunSummary, Waits};

pub use engine::Outcome;
pub use report::{Comparison, Prediction};
pub use whatif::{Assignment, KEYS, WhatIf, WhatIfs, parse_what_ifs};

/// Simulated time of one prediction unless asked otherwise: an hour, long enough that the warm-up share and the
/// randomness settle to well under a percent on CPU and GPU step times alike.
pub const DEFAULT_DURATION_S: f64 = 3600.0;

/// Share of the simulated time left out of the figures: the model starts empty, as a run does, and the first
/// tenth covers the queue's first fill many times over.
pub const WARMUP_SHARE: f64 = 0.1;

/// What a drafter step costs on one bucket, and how often items of that bucket arrive.
#[derive(Debug, Clone, PartialEq)]
pub struct BucketModel {
    /// The bucket's padded sequence length.
    pub padded_len: usize,
    /// Token slots per item (and per step): the padded length times the sequences, padding included.
    pub tokens: usize,
    /// Share of the items produced that land in this bucket.
    pub share: f64,
    /// Mean step time on this bucket, seconds.
    pub step_mean_s: f64,
    /// Its standard deviation.
    pub step_std_s: f64,
}

/// The plan as the simulator sees it: queue rules, producers, drafters, and where each figure came from.
#[derive(Debug, Clone, PartialEq)]
pub struct Model {
    /// The plan's name.
    pub name: String,
    /// Most items queued.
    pub capacity: usize,
    /// Consumers' watermark.
    pub min_ready: usize,
    /// Pull policy.
    pub pull: PullPolicy,
    /// Per bucket: tokens, arrival share and step time.
    pub buckets: Vec<BucketModel>,
    /// Producer workers.
    pub producers: usize,
    /// Mean seconds for one producer to make one item (0: infinitely fast).
    pub produce_mean_s: f64,
    /// Its standard deviation.
    pub produce_std_s: f64,
    /// Drafter workers.
    pub drafters: usize,
    /// Drafters average gradients every step, so each round waits for the slowest.
    pub lockstep: bool,
    /// Lockstep drafters take rounds of one bucket from the queue (the runtime's rule under `sync = allreduce`
    /// with several drafters), so a round costs its bucket's step; without, each takes its own bucket and the
    /// round costs the slowest of them.
    pub rounds: bool,
    /// Seconds of the all-reduce itself, after the last replica arrives.
    pub all_reduce_s: f64,
    /// Share (0–1) of the step-time variance common to all drafters of a lockstep round: what slows the machine
    /// slows every replica alike and costs no waiting at the all-reduce; the rest is each replica's own.
    pub step_common_share: f64,
    /// Share (0–1) of the token slots that were real tokens, where a run measured it (`--from`); a plan
    /// alone says only how many slots a step trains on.
    pub real_share: Option<f64>,
    /// Where the producer figures came from (for the report).
    pub producer_origin: String,
    /// Where the drafter figures came from.
    pub drafter_origin: String,
}

/// Why a model cannot be built or a what-if applied.
#[derive(Debug, thiserror::Error)]
pub enum SimulateError {
    /// Nothing gives the producers' rate.
    #[error(
        "no producer rate: the cost model has no figure for the target (the plan does not describe the target \
         model's cost) and the plan sets no `max_rate`; give --producer-rate ITEMS_PER_S (per worker) or --from \
         RUN_DIR"
    )]
    NoProducerRate,
    /// A measured run does not fit the plan.
    #[error("the run in {run_dir} does not fit the plan: {reason}")]
    RunMismatch {
        /// The run directory.
        run_dir: String,
        /// What does not fit.
        reason: String,
    },
    /// The GPU time model was asked for a plan it has no model of.
    #[error(
        "no GPU time model for this plan (its drafters are not on GPUs, or the {family} family has no kernel \
         list yet); give --drafter-gflops or --step-time"
    )]
    NoGpuModel {
        /// The drafter family.
        family: &'static str,
    },
    /// A number given on the command line is out of range.
    #[error("{what} must be {expected}, found {}", amount(*.found))]
    OutOfRange {
        /// The option.
        what: &'static str,
        /// The range.
        expected: &'static str,
        /// The value.
        found: f64,
    },
    /// A rate or step time no machine has, from wherever the model took it.
    #[error("{what} must be {expected}, found {} (from {origin})", amount(*.found))]
    Implausible {
        /// The figure.
        what: &'static str,
        /// The range.
        expected: &'static str,
        /// The value.
        found: f64,
        /// Where the model took it (the report's origin line).
        origin: String,
    },
    /// The prediction would process more events than a prediction may.
    #[error(
        "simulating {} would take about {} events ({} items/s through the queue, up to 3 events each: \
         produced, stepped, a round's all-reduce), more than the {} a prediction may process; give a \
         --duration of at most {}",
        seconds(*.duration_s),
        amount(*.events),
        amount(*.items_per_s),
        amount(MAX_EVENTS as f64),
        seconds(*.longest_duration_s)
    )]
    TooManyEvents {
        /// The simulated time asked for.
        duration_s: f64,
        /// The events it would take.
        events: f64,
        /// Items per second the slower side lets through.
        items_per_s: f64,
        /// The longest simulated time within the bound.
        longest_duration_s: f64,
    },
    /// The engine reached the event bound before the simulated time ended (the estimate fell short).
    #[error(
        "the simulation stopped at the bound of {} events after {} of the {} asked for; give a shorter \
         --duration",
        amount(MAX_EVENTS as f64),
        seconds(*.reached_s),
        seconds(*.duration_s)
    )]
    EventBoundReached {
        /// The simulated time asked for.
        duration_s: f64,
        /// How far the simulated clock got.
        reached_s: f64,
    },
}

/// The most events one prediction processes (an item produced, a step done, a round's all-reduce): a few
/// seconds of a release build, tens of a debug one. The simulated time multiplies the work, so like the
/// checker's bounds on the counts of a `.pipe` file it is refused up front, with the longest duration that fits.
pub const MAX_EVENTS: u64 = 100_000_000;

/// The slowest producer rate a model takes, items per second per worker: one item in 11.6 days, which the
/// longest simulated time (a week) would not see; a slower figure is a typo or a corrupt summary.
pub const MIN_PRODUCER_RATE: f64 = 1e-6;

/// The fastest, items per second per worker: a billion, far past any target model (a GPU makes hundreds).
pub const MAX_PRODUCER_RATE: f64 = 1e9;

/// The longest drafter step a model takes, seconds: a week, the longest simulated time.
pub const MAX_STEP_S: f64 = 7.0 * 24.0 * 3600.0;

/// Where the drafters' step time comes from when no run is given.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum StepTime {
    /// The compiler's GPU time model (`draftpipe compile` prints it): each bucket's modelled forward, backward
    /// and optimizer time on the plan's GPU, and its modelled NCCL all-reduce after the round's last replica.
    GpuModel,
    /// The cost model's FLOPs per bucket at this many FLOP/s per drafter worker.
    CostModel {
        /// Sustained FLOP/s of one drafter worker.
        flops_per_s: f64,
    },
    /// The same step time for every bucket.
    Fixed {
        /// Seconds.
        seconds: f64,
    },
}

/// FLOP/s a drafter worker is assumed to sustain when nothing better is known: a CPU worker the quickstart's
/// measured 68.85 GFLOP per 0.78 s step with two workers on two cores (README), a GPU worker 40% of an H200's
/// dense bf16 peak. A GPU drafter whose family has a GPU time model gets [`StepTime::GpuModel`] instead; the
/// flat rate is left for CPU drafters and for families without a kernel list. Only the cost-model prediction
/// uses them, and the report says so.
pub fn assumed_flops_per_s(device: Device) -> f64 {
    match device {
        Device::Cpu => 88e9,
        Device::Gpu(_) => 0.4 * 989e12,
    }
}

impl Model {
    /// The model of `plan` with producers at `producer_rate` items/s per worker (`None`: error), drafters at
    /// `step`, and every bucket getting items in proportion to the plan's tokens (the synthetic source's rule
    /// when lengths are uniform; a measured run replaces it).
    pub fn from_plan(
        plan: &Plan,
        producer_rate: Option<f64>,
        step: StepTime,
    ) -> Result<Self, SimulateError> {
        // A target paced by `max_rate` makes exactly that many items per second when its source is faster.
        let (rate, origin) = match (producer_rate, plan.target.max_rate) {
            (Some(rate), _) => (
                rate,
                format!(
                    "--producer-rate {} items/s per worker (no spread)",
                    amount(rate)
                ),
            ),
            (None, Some(rate)) => (
                rate,
                format!("the plan's max_rate {} items/s per worker", amount(rate)),
            ),
            (None, None) => return Err(SimulateError::NoProducerRate),
        };
        if rate.is_nan() || rate <= 0.0 {
            return Err(SimulateError::OutOfRange {
                what: "--producer-rate",
                expected: "a positive number of items per second",
                found: rate,
            });
        }
        let shares = plan_bucket_shares(plan);
        let gpu = match step {
            StepTime::GpuModel => Some(gpu_step_model(plan).ok_or(SimulateError::NoGpuModel {
                family: plan.model.spec.kind(),
            })?),
            StepTime::CostModel { .. } | StepTime::Fixed { .. } => None,
        };
        let step_s: Vec<f64> = match step {
            StepTime::GpuModel => gpu
                .iter()
                .flat_map(|model| &model.buckets)
                .map(|bucket| bucket.compute_s())
                .collect(),
            StepTime::CostModel { flops_per_s } => plan
                .buckets
                .iter()
                .map(|bucket| bucket.step_flops as f64 / flops_per_s)
                .collect(),
            StepTime::Fixed { seconds } => vec![seconds; plan.buckets.len()],
        };
        let buckets = plan
            .buckets
            .iter()
            .zip(shares.into_iter().zip(step_s))
            .map(|(bucket, (share, step_mean_s))| BucketModel {
                padded_len: bucket.padded_len,
                tokens: bucket.tokens,
                share,
                step_mean_s,
                step_std_s: 0.0,
            })
            .collect();
        // The modelled all-reduce after a round's last replica (the same for every bucket: the whole gradient).
        let all_reduce_s = gpu
            .as_ref()
            .and_then(|model| model.buckets.first())
            .map_or(0.0, |bucket| bucket.phase_s[3]);
        let drafter_origin = match step {
            StepTime::GpuModel => format!(
                "the GPU time model (compile's): modelled forward + backward + optimizer per bucket on an \
                 H200, all-reduce {}, MFU {:.1}% over the mix (a model, no spread)",
                seconds(all_reduce_s),
                gpu.as_ref().map_or(0.0, |model| 100.0 * model.mfu)
            ),
            StepTime::CostModel { flops_per_s } => format!(
                "cost model: the plan's FLOPs per step at an assumed {} GFLOP/s per worker (no spread)",
                amount(flops_per_s / 1e9)
            ),
            StepTime::Fixed { seconds: step } => {
                format!("--step-time {} s (no spread)", amount(step))
            }
        };
        Ok(Self {
            name: plan.name.clone(),
            capacity: plan.queue.capacity,
            min_ready: plan.queue.min_ready,
            pull: plan.queue.pull,
            buckets,
            producers: plan.target.placement.workers.len(),
            produce_mean_s: 1.0 / rate,
            produce_std_s: 0.0,
            drafters: plan.drafter.placement.workers.len(),
            lockstep: plan.drafter.sync == SyncMode::AllReduce,
            rounds: plan.drafters_take_rounds(),
            all_reduce_s,
            step_common_share: 0.0,
            real_share: None,
            producer_origin: origin,
            drafter_origin,
        })
    }

    /// The model of `plan` with the producers' and drafters' times measured in a run (`summary` of `run_dir`).
    pub fn from_run(
        plan: &Plan,
        summary: &RunSummary,
        run_dir: &str,
    ) -> Result<Self, SimulateError> {
        let mismatch = |reason: String| SimulateError::RunMismatch {
            run_dir: run_dir.to_string(),
            reason,
        };
        let (mut produce_s, mut produce_sq, mut items) = (0.0, 0.0, 0u64);
        for producer in &summary.producers {
            let Some(mean) = producer.produce_mean_s() else {
                continue;
            };
            let n = producer.items.max(1) as f64;
            let std = producer.produce_std_s.unwrap_or(0.0);
            produce_s += mean * n;
            produce_sq += (std * std + mean * mean) * n;
            items += producer.items;
        }
        if items == 0 {
            return Err(mismatch("its producers made no item".into()));
        }
        let produce_mean_s = produce_s / items as f64;
        let produce_std_s = (produce_sq / items as f64 - produce_mean_s.powi(2))
            .max(0.0)
            .sqrt();

        // Steady-state step times per bucket, pooled over the drafters.
        let mut buckets: Vec<BucketModel> = plan
            .buckets
            .iter()
            .map(|b| BucketModel {
                padded_len: b.padded_len,
                tokens: b.tokens,
                share: 0.0,
                step_mean_s: 0.0,
                step_std_s: 0.0,
            })
            .collect();
        let mut sums = vec![(0u64, 0.0, 0.0); buckets.len()];
        for drafter in &summary.drafters {
            for measured in &drafter.buckets {
                let Some(index) = buckets
                    .iter()
                    .position(|b| b.padded_len == measured.padded_len)
                else {
                    return Err(mismatch(format!(
                        "it has steps of length {}, which is no bucket of the plan",
                        measured.padded_len
                    )));
                };
                let n = measured.steps as f64;
                let entry = &mut sums[index];
                entry.0 += measured.steps;
                entry.1 += measured.mean_s * n;
                entry.2 += (measured.std_s.powi(2) + measured.mean_s.powi(2)) * n;
            }
        }
        let total_steps: u64 = sums.iter().map(|s| s.0).sum();
        if total_steps == 0 {
            return Err(mismatch(
                "it has no steady-state step times per bucket (a run of an older build, or one whose every \
                 step was warm-up: run more steps)"
                    .into(),
            ));
        }
        let measured_mean = sums.iter().map(|s| s.1).sum::<f64>() / total_steps as f64;
        // A synthetic source's bucket mix is known exactly; the steps a short run took per bucket are not the
        // producers' mix (a full queue serves its buckets round-robin, and may hold a capacity's worth more of
        // one bucket), so they stand in only for sources whose mix the plan does not give.
        let plan_shares = plan_bucket_shares(plan);
        let synthetic = matches!(
            plan.target.source,
            draftpipe_compiler::plan::SourceSpec::Synthetic { .. }
        );
        for ((bucket, (steps, sum, squares)), plan_share) in
            buckets.iter_mut().zip(&sums).zip(plan_shares)
        {
            bucket.share = if synthetic {
                plan_share
            } else {
                *steps as f64 / total_steps as f64
            };
            if *steps > 0 {
                let n = *steps as f64;
                bucket.step_mean_s = sum / n;
                bucket.step_std_s = (squares / n - bucket.step_mean_s.powi(2)).max(0.0).sqrt();
            } else {
                // A bucket the run never stepped on in the steady state: the measured mean, scaled by tokens.
                bucket.step_mean_s = measured_mean;
            }
        }
        let producers = plan.target.placement.workers.len();
        let drafters = plan.drafter.placement.workers.len();
        if summary.producers.len() != producers || summary.drafters.len() != drafters {
            return Err(mismatch(format!(
                "it ran {} producer(s) and {} drafter(s), the plan has {producers} and {drafters} (use --set \
                 producer.workers / drafter.devices for what-ifs on the same plan)",
                summary.producers.len(),
                summary.drafters.len()
            )));
        }
        let mut model = Self {
            name: plan.name.clone(),
            capacity: plan.queue.capacity,
            min_ready: plan.queue.min_ready,
            pull: plan.queue.pull,
            buckets,
            producers,
            produce_mean_s,
            produce_std_s,
            drafters,
            lockstep: plan.drafter.sync == SyncMode::AllReduce,
            rounds: plan.drafters_take_rounds(),
            all_reduce_s: 0.0,
            step_common_share: 0.0,
            real_share: (summary.real_tokens > 0 && summary.token_slots > 0)
                .then(|| (summary.real_tokens as f64 / summary.token_slots as f64).min(1.0)),
            producer_origin: format!(
                "measured in {run_dir}: {} per item (spread {}) over {items} items",
                seconds(produce_mean_s),
                seconds(produce_std_s)
            ),
            drafter_origin: format!(
                "measured in {run_dir}: steady steps per bucket over {total_steps} steps"
            ),
        };
        if model.lockstep && drafters > 1 {
            model.calibrate_common_share(steady_share(summary, DrafterPhase::AllReduce));
            model.drafter_origin += &format!(
                ", {:.0}% of the spread common to a round",
                100.0 * model.step_common_share
            );
        }
        Ok(model)
    }

    /// Finds the share of the step-time spread common to a round from the run's measured wait at the
    /// all-reduce. With no common part each replica's spread makes the others wait (`w0`); with all of it common,
    /// only the buckets' different step times do (`w1`); the wait grows about as the independent part's
    /// standard deviation, `w ≈ w1 + (w0 − w1)·√(1 − share)`, which the measured share inverts.
    fn calibrate_common_share(&mut self, measured: f64) {
        let wait = |share: f64| {
            let mut probe = self.clone();
            probe.step_common_share = share;
            let mean_step: f64 = probe.buckets.iter().map(|b| b.share * b.step_mean_s).sum();
            // Enough rounds that the wait settles to a fraction of a percent.
            let duration = (mean_step * 20_000.0).max(1.0);
            engine::simulate(&probe, duration, WARMUP_SHARE, 0x5EED, MAX_EVENTS).drafter_barrier
        };
        let (w0, w1) = (wait(0.0), wait(1.0));
        self.step_common_share = if w0 - w1 > 1e-6 {
            let independent = ((measured - w1) / (w0 - w1)).clamp(0.0, 1.0);
            1.0 - independent * independent
        } else {
            0.0
        };
    }

    /// Checks what the engine needs: at least one worker a side, and rates and
    /// step times within what a machine can have ([`MIN_PRODUCER_RATE`], [`MAX_PRODUCER_RATE`],
    /// [`MAX_STEP_S`]), whether they came from the command line, a `--set` or a run's summary.
    pub fn validate(&self) -> Result<(), SimulateError> {
        let rate = 1.0 / self.produce_mean_s;
        if !(MIN_PRODUCER_RATE..=MAX_PRODUCER_RATE).contains(&rate) {
            return Err(SimulateError::Implausible {
                what: "the producer rate",
                expected: "between 1e-6 and 1e9 items per second per worker",
                found: rate,
                origin: self.producer_origin.clone(),
            });
        }
        if let Some(bucket) = self
            .buckets
            .iter()
            .find(|b| !(0.0..=MAX_STEP_S).contains(&b.step_mean_s) || !b.step_std_s.is_finite())
        {
            return Err(SimulateError::Implausible {
                what: "the drafter step time",
                expected: "between 0 and 604800 s (a week), with a finite spread",
                found: bucket.step_mean_s,
                origin: self.drafter_origin.clone(),
            });
        }
        for (what, count) in [
            ("producer.workers", self.producers),
            ("drafter.devices", self.drafters),
            ("queue.capacity", self.capacity),
        ] {
            if count == 0 {
                return Err(SimulateError::OutOfRange {
                    what,
                    expected: "at least 1",
                    found: 0.0,
                });
            }
        }
        let members = self.drafters;
        let round_capacity = self.buckets.len() * members.saturating_sub(1) + 1;
        if self.rounds && self.lockstep && members > 1 && self.capacity < round_capacity {
            // The runtime refuses such a queue (`HsQueue::with_rounds`): full, it could hold no round.
            return Err(SimulateError::OutOfRange {
                what: "queue.capacity",
                expected: "at least buckets × (drafters − 1) + 1 when lockstep drafters take rounds of one bucket",
                found: self.capacity as f64,
            });
        }
        Ok(())
    }

    /// Tokens per second the producers could make if never blocked.
    pub fn producer_capacity(&self) -> f64 {
        let per_item = self.mean_tokens();
        if self.produce_mean_s <= 0.0 {
            f64::INFINITY
        } else {
            self.producers as f64 * per_item / self.produce_mean_s
        }
    }

    /// Tokens per second the drafters could train on if never waiting for data (or for each other).
    pub fn drafter_capacity(&self) -> f64 {
        let mean_step: f64 = self.buckets.iter().map(|b| b.share * b.step_mean_s).sum();
        if mean_step <= 0.0 {
            f64::INFINITY
        } else {
            self.drafters as f64 * self.mean_tokens() / mean_step
        }
    }

    /// Mean tokens per item over the bucket mix.
    pub fn mean_tokens(&self) -> f64 {
        let total: f64 = self.buckets.iter().map(|b| b.share).sum();
        self.buckets
            .iter()
            .map(|b| b.share * b.tokens as f64)
            .sum::<f64>()
            / total.max(f64::MIN_POSITIVE)
    }

    /// Items per second the slower side lets through the queue (the producers' making, the drafters' taking).
    fn items_per_s(&self) -> f64 {
        let produced = self.producers as f64 / self.produce_mean_s;
        let mean_step: f64 = self.buckets.iter().map(|b| b.share * b.step_mean_s).sum();
        let taken = self.drafters as f64 / mean_step;
        produced.min(taken)
    }

    /// Simulates `duration_s` seconds with `seed` and judges the outcome as the run's diagnosis would.
    ///
    /// # Errors
    /// [`SimulateError::TooManyEvents`] when the simulated time at the model's rates would take more than
    /// [`MAX_EVENTS`] events (an item takes up to three), and [`SimulateError::EventBoundReached`] if the engine
    /// reaches the bound anyway.
    pub fn predict(&self, duration_s: f64, seed: u64) -> Result<Prediction, SimulateError> {
        let items_per_s = self.items_per_s();
        let events = 3.0 * (items_per_s * duration_s + self.capacity as f64);
        // NaN (a model without validation, both sides infinitely fast) is as unbounded as too many.
        if events.is_nan() || events > MAX_EVENTS as f64 {
            return Err(SimulateError::TooManyEvents {
                duration_s,
                events,
                items_per_s,
                longest_duration_s: (MAX_EVENTS as f64 / 3.0 - self.capacity as f64).max(0.0)
                    / items_per_s,
            });
        }
        let outcome = engine::simulate(self, duration_s, WARMUP_SHARE, seed, MAX_EVENTS);
        if let Some(reached_s) = outcome.stopped_at {
            return Err(SimulateError::EventBoundReached {
                duration_s,
                reached_s,
            });
        }
        let near_full_from = self.capacity.saturating_sub(1).max(1);
        let watermark = self.min_ready.max(1);
        let near_full = outcome.share_where(|d| d >= near_full_from);
        let below = outcome.share_where(|d| d < watermark);
        let bottleneck = Bottleneck::judge(Waits {
            producer_blocked: outcome.producer_blocked,
            drafter_wait: outcome.drafter_wait,
            below_watermark: Some(below),
        });
        Ok(Prediction {
            model: self.clone(),
            outcome,
            bottleneck,
            near_full,
            below_watermark: below,
            duration_s,
            seed,
        })
    }
}

/// Share of the drafters' steady-state wall time in `phase`.
fn steady_share(summary: &RunSummary, phase: DrafterPhase) -> f64 {
    let (mut seconds, mut wall) = (0.0, 0.0);
    for d in &summary.drafters {
        seconds += d.steady_seconds(phase);
        wall += d
            .timeline
            .as_ref()
            .map_or(summary.wall_s, |t| t.steady_wall_s());
    }
    if wall > 0.0 { seconds / wall } else { 0.0 }
}

/// The share of items per bucket the plan's source produces ([`bucket_shares`]: the compiler's, which its GPU
/// model's MFU over the mix weighs the buckets by too).
fn plan_bucket_shares(plan: &Plan) -> Vec<f64> {
    bucket_shares(&plan.target.source, &plan.buckets)
}
