//! Checks on a summary read back from disk, before `draftpipe diagnose` explains it: a hand-edited or corrupt
//! `summary.json` (negative or infinite durations, phases longer than the run) is an error that names the field,
//! not a diagnosis of impossible percentages. Every duration is bounded: the run's wall time by
//! [`MAX_WALL_S`], every time inside the run (a drafter's timeline, a step, a bucket's mean) by the wall time,
//! so no figure the diagnosis derives from them can be a 300-digit number; the values quoted in an error are
//! written by [`amount`], as every figure is.

use crate::figures::amount;

use super::summary::{PhaseTotal, RunSummary};

/// Slack allowed when a worker's recorded time is compared with the run's wall time: the workers' clocks and
/// the run's are read at slightly different moments.
const WALL_SLACK_FACTOR: f64 = 1.05;
/// Absolute slack in seconds for the same comparison on very short runs.
const WALL_SLACK_S: f64 = 1.0;
/// The longest wall time a summary may claim: ten years, longer than any training run, short of the values
/// a corrupt or hand-edited file holds (`1e308`).
pub const MAX_WALL_S: f64 = 10.0 * 365.25 * 86_400.0;

/// A summary field with a value no run can produce.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("`{field}` is {value}: {expected}")]
pub struct InvalidSummary {
    /// The field, as a JSON path (`drafters[1].phases.loss.total_s`).
    pub field: String,
    /// The value found.
    pub value: String,
    /// What a real run writes there.
    pub expected: String,
}

fn invalid(field: String, value: impl ToString, expected: impl Into<String>) -> InvalidSummary {
    InvalidSummary {
        field,
        value: value.to_string(),
        expected: expected.into(),
    }
}

/// A number found in the file, written by the one rule for figures.
fn invalid_number(field: String, value: f64, expected: impl Into<String>) -> InvalidSummary {
    invalid(field, amount(value), expected)
}

/// A duration in seconds must be finite and not negative.
fn seconds(field: impl FnOnce() -> String, value: f64) -> Result<(), InvalidSummary> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(invalid_number(
            field(),
            value,
            "a duration: finite and not negative",
        ))
    }
}

/// A duration inside the run: valid, and no longer than the run's wall time (with the clocks' slack).
fn within_wall(field: impl Fn() -> String, value: f64, wall_s: f64) -> Result<(), InvalidSummary> {
    seconds(&field, value)?;
    if value > wall_s * WALL_SLACK_FACTOR + WALL_SLACK_S {
        return Err(invalid_number(
            field(),
            value,
            format!("at most the run's wall time, {wall_s:.3} s"),
        ));
    }
    Ok(())
}

/// One worker's phases: each a valid duration, together no longer than the run.
fn phases<P: Copy>(
    worker: &str,
    totals: &[PhaseTotal<P>],
    name: impl Fn(P) -> &'static str,
    wall_s: f64,
) -> Result<(), InvalidSummary> {
    let mut sum = 0.0;
    for total in totals {
        seconds(
            || format!("{worker}.phases.{}.total_s", name(total.phase)),
            total.total_s,
        )?;
        sum += total.total_s;
    }
    if sum > wall_s * WALL_SLACK_FACTOR + WALL_SLACK_S {
        return Err(invalid(
            format!("{worker}.phases"),
            format!("{} s in all", amount(sum)),
            format!("at most the run's wall time, {wall_s:.3} s"),
        ));
    }
    Ok(())
}

/// Checks every duration, loss and count of `summary` for values no run can write.
///
/// # Errors
/// The first field found wrong, with its value and what was expected.
pub fn validate_summary(summary: &RunSummary) -> Result<(), InvalidSummary> {
    seconds(|| "wall_s".into(), summary.wall_s)?;
    if summary.wall_s > MAX_WALL_S {
        return Err(invalid_number(
            "wall_s".into(),
            summary.wall_s,
            "at most ten years (315576000 s)",
        ));
    }
    let wall = summary.wall_s;
    for (i, drafter) in summary.drafters.iter().enumerate() {
        phases(
            &format!("drafters[{i}]"),
            &drafter.phases,
            |p| p.name(),
            wall,
        )?;
    }
    for (i, producer) in summary.producers.iter().enumerate() {
        phases(
            &format!("producers[{i}]"),
            &producer.phases,
            |p| p.name(),
            wall,
        )?;
    }
    if let Some(loss) = summary.final_loss
        && !loss.is_finite()
    {
        return Err(invalid_number("final_loss".into(), loss, "a finite loss"));
    }
    for (i, sample) in summary.loss_curve.iter().enumerate() {
        if !sample.loss.is_finite() {
            return Err(invalid_number(
                format!("loss_curve[{i}].loss"),
                sample.loss,
                "a finite loss",
            ));
        }
        within_wall(
            || format!("loss_curve[{i}].elapsed_s"),
            sample.elapsed_s,
            wall,
        )?;
    }
    let q = &summary.queue;
    let workers = |n: usize| n.max(1) as f64;
    for (field, value, limit) in [
        (
            "queue.producer_blocked_s",
            q.producer_blocked_s,
            wall * workers(summary.producers.len()),
        ),
        (
            "queue.consumer_blocked_s",
            q.consumer_blocked_s,
            wall * workers(summary.drafters.len()),
        ),
    ] {
        seconds(|| field.into(), value)?;
        if value > limit * WALL_SLACK_FACTOR + WALL_SLACK_S {
            return Err(invalid_number(
                field.into(),
                value,
                format!("at most the run's wall time times the workers, {limit:.3} s"),
            ));
        }
    }
    if !(q.sample_period_ms.is_finite() && q.sample_period_ms > 0.0) {
        return Err(invalid_number(
            "queue.sample_period_ms".into(),
            q.sample_period_ms,
            "a positive, finite period",
        ));
    }
    if q.depth_histogram.len() != q.capacity.saturating_add(1) {
        return Err(invalid(
            "queue.depth_histogram".into(),
            format!("{} bins long", q.depth_histogram.len()),
            format!("capacity + 1 = {} bins", q.capacity.saturating_add(1)),
        ));
    }
    if q.min_ready > q.capacity {
        return Err(invalid(
            "queue.min_ready".into(),
            q.min_ready,
            format!("at most the capacity, {}", q.capacity),
        ));
    }
    for (i, drafter) in summary.drafters.iter().enumerate() {
        if let Some(t) = &drafter.timeline {
            for (name, value) in [
                ("first_span_s", t.first_span_s),
                ("first_data_wait_s", t.first_data_wait_s),
                ("last_span_end_s", t.last_span_end_s),
                ("warmup_wall_s", t.warmup_wall_s),
                ("longest_step_s", t.longest_step_s),
            ] {
                within_wall(|| format!("drafters[{i}].timeline.{name}"), value, wall)?;
            }
            for total in &t.warmup_phases {
                within_wall(
                    || {
                        format!(
                            "drafters[{i}].timeline.warmup_phases.{}.total_s",
                            total.phase.name()
                        )
                    },
                    total.total_s,
                    wall,
                )?;
            }
        }
        for (j, bucket) in drafter.buckets.iter().enumerate() {
            within_wall(
                || format!("drafters[{i}].buckets[{j}].mean_s"),
                bucket.mean_s,
                wall,
            )?;
            within_wall(
                || format!("drafters[{i}].buckets[{j}].std_s"),
                bucket.std_s,
                wall,
            )?;
        }
    }
    for (i, producer) in summary.producers.iter().enumerate() {
        if let Some(std) = producer.produce_std_s {
            within_wall(|| format!("producers[{i}].produce_std_s"), std, wall)?;
        }
    }
    Ok(())
}
