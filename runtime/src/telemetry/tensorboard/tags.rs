//! The one table of TensorBoard tags: each tag (or family of tags, one per bucket, drafter or block slot) with
//! the `status.jsonl` field it equals. The writer, docs/telemetry.md's table and the Python test all follow it;
//! a new status field becomes a tag by one row here and one row in the docs.
//!
//! ```text
//!  StatusLine ──TAGS (tag, field, read)──▶ [(tag, value)] ──▶ one Summary event at the line's step
//! ```

use super::super::status::StatusLine;

/// How a row reads its values from a status line.
#[derive(Clone, Copy)]
enum Read {
    /// One scalar (absent when the line has none).
    One(fn(&StatusLine) -> Option<f64>),
    /// One scalar per index (a bucket, a drafter, a block slot); `{i}` in the tag is the index, from `first`.
    Each {
        /// The number of the first element (0 for buckets and drafters, 1 for block slots).
        first: usize,
        /// The values, in order; `None` where the line has none.
        values: fn(&StatusLine) -> Vec<Option<f64>>,
    },
}

/// One row of the table.
#[derive(Clone, Copy)]
pub struct Tag {
    /// The tag; `{i}` stands for the index of a family's member.
    pub tag: &'static str,
    /// The `status.jsonl` field it equals (`{i}` as in the tag).
    pub field: &'static str,
    read: Read,
}

const fn one(tag: &'static str, field: &'static str, read: fn(&StatusLine) -> Option<f64>) -> Tag {
    Tag {
        tag,
        field,
        read: Read::One(read),
    }
}

const fn each(
    tag: &'static str,
    field: &'static str,
    first: usize,
    values: fn(&StatusLine) -> Vec<Option<f64>>,
) -> Tag {
    Tag {
        tag,
        field,
        read: Read::Each { first, values },
    }
}

/// Every tag written, in the order of docs/telemetry.md's table.
pub const TAGS: &[Tag] = &[
    one("train/loss", "loss", |l| l.loss),
    one("train/tau_exact", "tau_exact", |l| l.tau_exact),
    one("train/tau_simulated", "tau_simulated", |l| l.tau_simulated),
    each("train/slot_accuracy/{i}", "slot_accuracy[{i-1}]", 1, |l| {
        l.slot_accuracy.iter().copied().map(Some).collect()
    }),
    one("train/learning_rate", "learning_rate", |l| l.learning_rate),
    one("train/grad_norm", "grad_norm", |l| l.grad_norm),
    one("train/skipped_steps", "skipped", |l| Some(l.skipped as f64)),
    one("throughput/real_tokens_per_s", "real_tokens_per_s", |l| {
        l.real_tokens_per_s
    }),
    one("throughput/token_slots_per_s", "token_slots_per_s", |l| {
        l.token_slots_per_s
    }),
    one("throughput/loss_tokens_per_s", "loss_tokens_per_s", |l| {
        l.loss_tokens_per_s
    }),
    one("queue/depth", "q_hs.depth", |l| Some(l.q_hs.depth as f64)),
    each("queue/bucket_{i}", "q_hsb[{i}]", 0, |l| {
        l.q_hsb.iter().map(|&d| Some(d as f64)).collect()
    }),
    each("drafter_{i}/busy_pct", "drafters[{i}].busy_pct", 0, |l| {
        l.drafters.iter().map(|d| Some(d.busy_pct)).collect()
    }),
    each(
        "drafter_{i}/data_wait_pct",
        "drafters[{i}].data_wait_pct",
        0,
        |l| l.drafters.iter().map(|d| Some(d.data_wait_pct)).collect(),
    ),
    each(
        "drafter_{i}/all_reduce_pct",
        "drafters[{i}].all_reduce_pct",
        0,
        |l| l.drafters.iter().map(|d| Some(d.all_reduce_pct)).collect(),
    ),
    each("drafter_{i}/gpu_pct", "drafters[{i}].gpu_pct", 0, |l| {
        l.drafters.iter().map(|d| d.gpu_pct).collect()
    }),
    one("acceptance/tau", "acceptance.tau", |l| {
        l.acceptance.as_ref()?.tau
    }),
    one(
        "acceptance/teacher_forced_tau_exact",
        "acceptance.teacher_forced_tau_exact",
        |l| l.acceptance.as_ref()?.teacher_forced_tau_exact,
    ),
    one(
        "acceptance/teacher_forced_tau_simulated",
        "acceptance.teacher_forced_tau_simulated",
        |l| l.acceptance.as_ref()?.teacher_forced_tau_simulated,
    ),
    one("acceptance/measured_step", "acceptance.step", |l| {
        l.acceptance.as_ref()?.step.map(|s| s as f64)
    }),
    one("acceptance/skipped", "acceptance.skipped", |l| {
        l.acceptance.as_ref().map(|a| a.skipped as f64)
    }),
    one("acceptance/failed", "acceptance.failed", |l| {
        l.acceptance.as_ref().map(|a| a.failed as f64)
    }),
];

/// Every scalar `line` carries, as `(tag, value)` in table order; rows the line has no value for are left out
/// (a τ before the first step, a GPU share on the CPU, acceptance figures without an `acceptance` section).
pub fn scalars(line: &StatusLine) -> Vec<(String, f64)> {
    let mut scalars = Vec::new();
    for row in TAGS {
        match row.read {
            Read::One(read) => {
                if let Some(value) = read(line) {
                    scalars.push((row.tag.to_owned(), value));
                }
            }
            Read::Each { first, values } => {
                for (i, value) in values(line).into_iter().enumerate() {
                    if let Some(value) = value {
                        scalars.push((row.tag.replace("{i}", &(first + i).to_string()), value));
                    }
                }
            }
        }
    }
    scalars
}
