//! What-ifs: `--set KEY=VALUE` changes to the model, checked with the compiler's spanned diagnostics.
//!
//! The command line's `--set` arguments are one source text (joined by spaces), so an error points into it
//! the way the checker points into a `.pipe` file:
//!
//! ```text
//! error: `queue.min_ready` (30) is above `queue.capacity` (20): consumers could never take an item
//!   --> --set:1:1
//!    |
//!  1 | queue.min_ready=30
//!    |                 ^^ above the capacity
//! ```
//!
//! One `--set` may hold several assignments separated by commas; it is one variant of `--compare`. A key set
//! twice in what applies together (one variant, or every `--set` without `--compare`) is an error naming both
//! places, as the checker refuses a field written twice: which one should win is the user's to say.

use draftpipe_compiler::plan::PullPolicy;
use draftpipe_compiler::span::Span;
use draftpipe_compiler::{Diagnostic, Diagnostics};

use super::Model;

/// The keys a what-if may set, with what each takes.
pub const KEYS: [(&str, &str); 9] = [
    ("queue.capacity", "items, at least 1"),
    ("queue.min_ready", "items, at most the capacity"),
    ("queue.pull", "random_in_bucket | round_robin | fifo"),
    ("drafter.devices", "drafter workers, at least 1"),
    (
        "drafter.step_time",
        "a duration (`450ms`, `0.5s`) or a factor (`0.8x`)",
    ),
    ("drafter.sync", "allreduce | none"),
    (
        "queue.rounds",
        "true (lockstep drafters take rounds of one bucket) | false",
    ),
    ("producer.workers", "producer workers, at least 1"),
    (
        "producer.rate",
        "items/s per worker (`2.5`) or a factor (`1.5x`)",
    ),
];

/// One `KEY=VALUE` with where it is written.
#[derive(Debug, Clone, PartialEq)]
pub struct Assignment {
    /// The key as written.
    pub key: String,
    /// The value as written.
    pub value: String,
    /// Where the key is in the `--set` text.
    pub key_span: Span,
    /// Where the value is.
    pub value_span: Span,
}

/// One variant: the assignments of one `--set` argument.
#[derive(Debug, Clone, PartialEq)]
pub struct WhatIf {
    /// The argument as written (the variant's label in a comparison).
    pub label: String,
    /// Its assignments, in order.
    pub assignments: Vec<Assignment>,
}

/// A number, or a factor of the base value (`1.5x`).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Amount {
    Absolute(f64),
    Factor(f64),
}

/// The `--set` arguments as one text, and the variants in it.
#[derive(Debug, Clone, PartialEq)]
pub struct WhatIfs {
    source: String,
    /// One per `--set` argument.
    pub variants: Vec<WhatIf>,
}

/// Splits the `--set` arguments into variants of assignments; every malformed one is an error.
pub fn parse_what_ifs(arguments: &[String]) -> Result<WhatIfs, Diagnostics> {
    let source = arguments.join(" ");
    let mut errors = Vec::new();
    let mut variants = Vec::new();
    let mut offset = 0;
    for argument in arguments {
        let mut assignments = Vec::new();
        let mut start = offset;
        for part in argument.split(',') {
            let span = Span::new(start, start + part.len());
            start += part.len() + 1;
            let trimmed = part.trim();
            let lead = part.len() - part.trim_start().len();
            let Some(eq) = trimmed.find('=') else {
                errors.push(
                    Diagnostic::error(span, format!("expected KEY=VALUE, found `{part}`"))
                        .label("no `=`")
                        .help(keys_help()),
                );
                continue;
            };
            let key_start = span.start + lead;
            let key = trimmed[..eq].trim_end();
            let value = trimmed[eq + 1..].trim();
            let value_start = key_start
                + eq
                + 1
                + (trimmed[eq + 1..].len() - trimmed[eq + 1..].trim_start().len());
            assignments.push(Assignment {
                key: key.to_string(),
                value: value.to_string(),
                key_span: Span::new(key_start, key_start + key.len()),
                value_span: Span::new(value_start, value_start + value.len()),
            });
        }
        variants.push(WhatIf {
            label: argument.clone(),
            assignments,
        });
        offset += argument.len() + 1;
    }
    let what_ifs = WhatIfs { source, variants };
    if errors.is_empty() {
        Ok(what_ifs)
    } else {
        Err(what_ifs.diagnostics(errors))
    }
}

fn keys_help() -> String {
    let keys: Vec<String> = KEYS
        .iter()
        .map(|(key, takes)| format!("`{key}` ({takes})"))
        .collect();
    format!("the keys are {}", keys.join(", "))
}

impl WhatIfs {
    fn diagnostics(&self, errors: Vec<Diagnostic>) -> Diagnostics {
        let mut diagnostics = Diagnostics::new("--set", &self.source);
        diagnostics.extend(errors);
        diagnostics
    }

    /// Every assignment of every variant applied to `base` together (one what-if).
    pub fn apply_together(&self, base: &Model) -> Result<Model, Diagnostics> {
        let all = WhatIf {
            label: self
                .variants
                .iter()
                .map(|v| v.label.as_str())
                .collect::<Vec<_>>()
                .join(","),
            assignments: self
                .variants
                .iter()
                .flat_map(|v| v.assignments.iter().cloned())
                .collect(),
        };
        all.apply(base).map_err(|errors| self.diagnostics(errors))
    }

    /// Each variant applied to `base` on its own (`--compare`), with its label.
    pub fn apply_each(&self, base: &Model) -> Result<Vec<(String, Model)>, Diagnostics> {
        let mut errors = Vec::new();
        let mut models = Vec::new();
        for variant in &self.variants {
            match variant.apply(base) {
                Ok(model) => models.push((variant.label.clone(), model)),
                Err(mut e) => errors.append(&mut e),
            }
        }
        if errors.is_empty() {
            Ok(models)
        } else {
            Err(self.diagnostics(errors))
        }
    }
}

impl WhatIf {
    /// `base` with these assignments, or every error they have.
    fn apply(&self, base: &Model) -> Result<Model, Vec<Diagnostic>> {
        let mut model = base.clone();
        let mut errors = self.repeated_keys();
        let mut capacity_at = None;
        let mut min_ready_at = None;
        for a in &self.assignments {
            let result = match a.key.as_str() {
                "queue.capacity" => count(a, 1).map(|n| {
                    model.capacity = n;
                    capacity_at = Some(a.value_span);
                }),
                "queue.min_ready" => count(a, 0).map(|n| {
                    model.min_ready = n;
                    min_ready_at = Some(a.value_span);
                }),
                "queue.pull" => match a.value.as_str() {
                    "random_in_bucket" => Ok(PullPolicy::RandomInBucket),
                    "round_robin" => Ok(PullPolicy::RoundRobin),
                    "fifo" => Ok(PullPolicy::Fifo),
                    other => Err(Diagnostic::error(
                        a.value_span,
                        format!("unknown pull policy `{other}`"),
                    )
                    .label("not a pull policy")
                    .help("expected `random_in_bucket`, `round_robin` or `fifo`")),
                }
                .map(|pull| model.pull = pull),
                "drafter.devices" => count(a, 1).map(|n| model.drafters = n),
                "drafter.sync" => match a.value.as_str() {
                    "allreduce" => Ok(true),
                    "none" => Ok(false),
                    other => Err(Diagnostic::error(
                        a.value_span,
                        format!("unknown sync mode `{other}`"),
                    )
                    .label("not a sync mode")
                    .help("expected `allreduce` or `none`")),
                }
                .map(|lockstep| model.lockstep = lockstep),
                "queue.rounds" => match a.value.as_str() {
                    "true" => Ok(true),
                    "false" => Ok(false),
                    other => Err(Diagnostic::error(
                        a.value_span,
                        format!("`queue.rounds` takes `true` or `false`, found `{other}`"),
                    )
                    .label("not a boolean")),
                }
                .map(|rounds| model.rounds = rounds),
                "drafter.step_time" => duration_or_factor(a).map(|amount| {
                    for bucket in &mut model.buckets {
                        let scale = match amount {
                            Amount::Factor(f) => f,
                            Amount::Absolute(seconds) => {
                                // An absolute time sets the mean step; buckets keep their ratios.
                                let mean: f64 =
                                    base.buckets.iter().map(|b| b.share * b.step_mean_s).sum();
                                if mean > 0.0 { seconds / mean } else { 0.0 }
                            }
                        };
                        bucket.step_mean_s *= scale;
                        bucket.step_std_s *= scale;
                    }
                    model.drafter_origin =
                        format!("{} with step time {}", base.drafter_origin, a.value);
                }),
                "producer.workers" => count(a, 1).map(|n| model.producers = n),
                "producer.rate" => rate_or_factor(a).map(|amount| {
                    let (mean, std) = (model.produce_mean_s, model.produce_std_s);
                    let new_mean = match amount {
                        Amount::Factor(f) => mean / f,
                        Amount::Absolute(rate) => 1.0 / rate,
                    };
                    model.produce_std_s = if mean > 0.0 {
                        std * new_mean / mean
                    } else {
                        0.0
                    };
                    model.produce_mean_s = new_mean;
                    model.producer_origin = format!("{} at rate {}", base.producer_origin, a.value);
                }),
                unknown => Err(Diagnostic::error(
                    a.key_span,
                    format!("unknown what-if key `{unknown}`"),
                )
                .label("unknown key")
                .help(
                    match draftpipe_compiler::closest(unknown, KEYS.iter().map(|(key, _)| *key)) {
                        Some(key) => format!("did you mean `{key}`? {}", keys_help()),
                        None => keys_help(),
                    },
                )),
            };
            if let Err(error) = result {
                errors.push(error);
            }
        }
        if errors.is_empty() && model.min_ready > model.capacity {
            let span = min_ready_at.or(capacity_at).unwrap_or_default();
            errors.push(
                Diagnostic::error(
                    span,
                    format!(
                        "`queue.min_ready` ({}) is above `queue.capacity` ({}): consumers could never take an item",
                        model.min_ready, model.capacity
                    ),
                )
                .label(if min_ready_at.is_some() {
                    "above the capacity"
                } else {
                    "below the watermark"
                })
                .help("min_ready must be at most capacity (the checker's rule for the file)"),
            );
        }
        if errors.is_empty() {
            Ok(model)
        } else {
            Err(errors)
        }
    }
}

impl WhatIf {
    /// An error for every key set again after its first assignment, pointing at both.
    fn repeated_keys(&self) -> Vec<Diagnostic> {
        let mut first_at = std::collections::HashMap::new();
        let mut errors = Vec::new();
        for a in &self.assignments {
            match first_at.get(a.key.as_str()) {
                Some(&first) => errors.push(
                    Diagnostic::error(a.key_span, format!("`{}` is set twice", a.key))
                        .label("set again here")
                        .related(first, "first set here")
                        .help(
                            "give each key once: the what-ifs apply together (compare values with one \
                             `--set` each and `--compare`)",
                        ),
                ),
                None => {
                    first_at.insert(a.key.as_str(), a.key_span);
                }
            }
        }
        errors
    }
}

/// The most workers a what-if may set, on either side: the checker's limit on `xN` and on a device list.
const MAX_WORKERS: usize = 1024;

/// The largest count `key` accepts, as the checker bounds the same field of a `.pipe` file: the simulation
/// allocates per worker and per queued item, so an unbounded count would abort or exhaust memory.
fn count_limit(key: &str) -> usize {
    match key {
        "queue.capacity" | "queue.min_ready" => crate::queue::MAX_CAPACITY,
        _ => MAX_WORKERS,
    }
}

fn count(a: &Assignment, at_least: usize) -> Result<usize, Diagnostic> {
    let at_most = count_limit(&a.key);
    match a.value.parse::<i64>() {
        Ok(n) if n >= at_least as i64 && n as u64 <= at_most as u64 => Ok(n as usize),
        Ok(n) if n >= at_least as i64 => Err(Diagnostic::error(
            a.value_span,
            format!("`{}` must be at most {at_most}, found {n}", a.key),
        )
        .label("too large")),
        Ok(n) => Err(Diagnostic::error(
            a.value_span,
            format!("`{}` must be at least {at_least}, found {n}", a.key),
        )
        .label("too small")),
        Err(_) if a.value.parse::<u128>().is_ok() => Err(Diagnostic::error(
            a.value_span,
            format!("`{}` must be at most {at_most}, found {}", a.key, a.value),
        )
        .label("too large")),
        Err(_) => Err(Diagnostic::error(
            a.value_span,
            format!("`{}` takes a whole number, found `{}`", a.key, a.value),
        )
        .label("not a whole number")),
    }
}

fn positive(a: &Assignment, text: &str, what: &str) -> Result<f64, Diagnostic> {
    match text.parse::<f64>() {
        Ok(x) if x > 0.0 && x.is_finite() => Ok(x),
        Ok(x) => Err(Diagnostic::error(
            a.value_span,
            format!("`{}` must be positive, found {x}", a.key),
        )
        .label(if x < 0.0 { "negative" } else { "not positive" })),
        Err(_) => Err(Diagnostic::error(
            a.value_span,
            format!("`{}` takes {what}, found `{}`", a.key, a.value),
        )
        .label("not a number")),
    }
}

fn factor(a: &Assignment) -> Option<Result<Amount, Diagnostic>> {
    a.value
        .strip_suffix('x')
        .map(|f| positive(a, f, "a factor such as `1.5x`").map(Amount::Factor))
}

fn rate_or_factor(a: &Assignment) -> Result<Amount, Diagnostic> {
    factor(a).unwrap_or_else(|| {
        positive(a, &a.value, "items per second or a factor such as `1.5x`").map(Amount::Absolute)
    })
}

fn duration_or_factor(a: &Assignment) -> Result<Amount, Diagnostic> {
    if let Some(amount) = factor(a) {
        return amount;
    }
    let (number, scale) = if let Some(ms) = a.value.strip_suffix("ms") {
        (ms, 1e-3)
    } else if let Some(s) = a.value.strip_suffix('s') {
        (s, 1.0)
    } else {
        return Err(Diagnostic::error(
            a.value_span,
            format!(
                "`{}` takes a duration or a factor, found `{}`",
                a.key, a.value
            ),
        )
        .label("no unit")
        .help("write `450ms`, `0.5s` or `0.8x`"));
    };
    positive(a, number, "a duration such as `450ms`").map(|x| Amount::Absolute(x * scale))
}
