//! Checks on a summary read back from disk, before `draftpipe diagnose` explains it: a hand-edited or corrupt
//! `summary.json` (negative or infinite durations, phases longer than the run) is an error that names the field,
//! not a diagnosis of impossible percentages.

use super::summary::{PhaseTotal, RunSummary};

/// Slack allowed when a worker's recorded time is compared with the run's wall time: the workers' clocks and
/// the run's are read at slightly different moments.
const WALL_SLACK_FACTOR: f64 = 1.05;
/// Absolute slack in seconds for the same comparison on very short runs.
const WALL_SLACK_S: f64 = 1.0;

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

/// A duration in seconds must be finite and not negative.
fn seconds(field: impl FnOnce() -> String, value: f64) -> Result<(), InvalidSummary> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(invalid(
            field(),
            value,
            "a duration: finite and not negative",
        ))
    }
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
            format!("{sum:.3} s in all"),
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
        return Err(invalid("final_loss".into(), loss, "a finite loss"));
    }
    for (i, sample) in summary.loss_curve.iter().enumerate() {
        if !sample.loss.is_finite() {
            return Err(invalid(
                format!("loss_curve[{i}].loss"),
                sample.loss,
                "a finite loss",
            ));
        }
        seconds(|| format!("loss_curve[{i}].elapsed_s"), sample.elapsed_s)?;
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
            return Err(invalid(
                field.into(),
                value,
                format!("at most the run's wall time times the workers, {limit:.3} s"),
            ));
        }
    }
    if !(q.sample_period_ms.is_finite() && q.sample_period_ms > 0.0) {
        return Err(invalid(
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
                ("last_span_end_s", t.last_span_end_s),
                ("warmup_wall_s", t.warmup_wall_s),
                ("longest_step_s", t.longest_step_s),
            ] {
                seconds(|| format!("drafters[{i}].timeline.{name}"), value)?;
            }
            for total in &t.warmup_phases {
                seconds(
                    || {
                        format!(
                            "drafters[{i}].timeline.warmup_phases.{}.total_s",
                            total.phase.name()
                        )
                    },
                    total.total_s,
                )?;
            }
        }
        for (j, bucket) in drafter.buckets.iter().enumerate() {
            seconds(
                || format!("drafters[{i}].buckets[{j}].mean_s"),
                bucket.mean_s,
            )?;
            seconds(|| format!("drafters[{i}].buckets[{j}].std_s"), bucket.std_s)?;
        }
    }
    for (i, producer) in summary.producers.iter().enumerate() {
        if let Some(std) = producer.produce_std_s {
            seconds(|| format!("producers[{i}].produce_std_s"), std)?;
        }
    }
    Ok(())
}
