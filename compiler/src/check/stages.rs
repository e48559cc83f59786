//! Checks of the `target`, `queue`, `drafter` and `telemetry` sections, each on its own.
//!
//! Cross-section rules (queue ends, buckets against the target, devices) live in [`super`]; the pieces they
//! need come back as separate `Option`s so one broken key does not hide the other sections' errors.

use crate::ast::{Call, QueueSection, StageSection, TelemetrySection, Value, ValueKind};
use crate::check::fields::Fields;
use crate::check::values::{self, MAX_CAPACITY, MAX_DIM, MAX_REPEATS, out_of_range};
use crate::diagnostic::Diagnostic;
use crate::family::{CheckedModel, REGISTRY, Registered, registered};
use crate::plan::{
    AdamWSpec, DEFAULT_STREAM_READ_TIMEOUT_MS, DrafterStage, HsDtype, LaunchMode, LossSpec,
    LrSchedule, MaskChecks, Placement, Precision, PullPolicy, QueueSpec, ScheduleKind, SourceSpec,
    SyncMode, TargetStage, TelemetrySpec, WeightsSpec,
};
use crate::span::Span;

type Errs = Vec<Diagnostic>;

/// Default tokens per chunk of the fused vocabulary loss.
pub const DEFAULT_CHUNK_TOKENS: usize = 1024;
/// Default per-head loss decay: every head weighs the same.
pub const DEFAULT_HEAD_DECAY: f32 = 1.0;
/// Default weight decay per unroll step of the `eagle3` loss: SpecForge's `0.8^k`.
pub const DEFAULT_STEP_DECAY: f32 = 0.8;
/// Default status-line period.
pub const DEFAULT_EVERY_MS: u64 = 1000;
/// Default `min_ready` watermark: consumers start as soon as one item is queued.
pub const DEFAULT_MIN_READY: usize = 1;

/// What the target section yields; `None` fields had errors (already reported).
pub(crate) struct TargetParts {
    pub hidden: Option<usize>,
    /// `layers` (the target's depth), when given: `Some(None)` when it had errors.
    pub layers: Option<Option<usize>>,
    pub tap_layers: Option<Vec<u32>>,
    /// How many layers `tap_layers` names and where it is written, when it is valid.
    pub tap_layers_span: Option<(usize, Span)>,
    pub vocab: Option<usize>,
    pub batch_tokens: Option<(usize, Span)>,
    pub source: Option<SourceSpec>,
    /// Synthetic sequence lengths `min..max` and where the range is written.
    pub lengths: Option<(usize, usize, Span)>,
    /// `max_rate`, when given: `Some(None)` when it had errors.
    pub max_rate: Option<Option<f64>>,
    /// `weights`, when given (`Some(None)`: given but invalid), and where.
    pub weights: Option<(Option<WeightsSpec>, Span)>,
    /// `hs_dtype`, when given: `Some(None)` when it had errors.
    pub hs_dtype: Option<Option<HsDtype>>,
    /// `end_of_turn` and `max_bad_mask_share`: `None` when one had errors.
    pub masks: Option<MaskChecks>,
}

pub(crate) fn check_target(section: &StageSection, errs: &mut Errs) -> TargetParts {
    let context = format!("target `{}`", section.name.name);
    let mut f = Fields::new(&section.block.entries, context, section.header, errs);
    let hidden = f
        .required("hidden", "4096")
        .and_then(|v| values::count_in(errs, "hidden", v, 1, MAX_DIM));
    let layers = f
        .optional("layers")
        .map(|v| (values::count_in(errs, "layers", v, 1, MAX_DIM), v.span));
    let depth = layers.and_then(|(layers, span)| Some((layers?, span)));
    let tap_layers_value = f.required("tap_layers", "[1, 18, 35]");
    let tap_layers = tap_layers_value.and_then(|v| tap_layers(errs, v, depth));
    let tap_layers_span = tap_layers_value
        .zip(tap_layers.as_ref())
        .map(|(v, taps)| (taps.len(), v.span));
    let vocab = f
        .required("vocab", "151936")
        .and_then(|v| values::count_in(errs, "vocab", v, 2, MAX_DIM));
    let batch_tokens = f
        .required("batch_tokens", "16384")
        .and_then(|v| values::count_in(errs, "batch_tokens", v, 1, MAX_DIM).map(|n| (n, v.span)));
    let mut lengths = None;
    let source = f
        .required("source", "synthetic(seed = 1, lengths = 64..512)")
        .and_then(|v| {
            let call = values::call(
                errs,
                "source",
                v,
                &["synthetic", "safetensors", "stream"],
                "synthetic(seed = 1, lengths = 64..512)",
            )?;
            source(errs, call, &mut lengths)
        });
    let max_rate = f.optional("max_rate").map(|v| {
        values::real_where(
            errs,
            "max_rate",
            v,
            ("must be a positive number of items per second", "20"),
            |x| x > 0.0 && x.is_finite(),
        )
    });
    let weights = f.optional("weights").map(|v| {
        let example = "safetensors(path = \"models/qwen3-8b\")";
        let spec = values::call(errs, "weights", v, &["safetensors"], example)
            .and_then(|call| weights(errs, call));
        (spec, v.span)
    });
    let hs_dtype = f.optional("hs_dtype").map(|v| {
        values::choice(
            errs,
            "hs_dtype",
            v,
            &[
                ("bf16", HsDtype::Bf16),
                ("f16", HsDtype::F16),
                ("f32", HsDtype::F32),
                ("fp8_e4m3", HsDtype::Fp8E4m3),
            ],
        )
    });
    let masks = super::masks::check_masks(&mut f, errs, vocab);
    f.finish(errs);
    TargetParts {
        hidden,
        layers: layers.map(|(layers, _)| layers),
        tap_layers,
        tap_layers_span,
        vocab,
        batch_tokens,
        source,
        lengths,
        max_rate,
        weights,
        hs_dtype,
        masks,
    }
}

/// `safetensors(path = "...")`: a file, a directory of shards or a glob of the target's checkpoint.
fn weights(errs: &mut Errs, call: &Call) -> Option<WeightsSpec> {
    let mut f = Fields::new(&call.args, "`safetensors(...)`".to_owned(), call.span, errs);
    let path = f
        .required("path", "\"models/qwen3-8b\"")
        .and_then(|v| values::nonempty_string(errs, "path", v));
    f.finish(errs);
    Some(WeightsSpec::Safetensors {
        path: path?.to_owned(),
    })
}

/// The taps of `tap_layers`, each at most the target's depth when the section gives one (`depth`: `layers` and
/// where it is written). Tap `t` is entry `t` of the hidden-states tuple, which has `layers + 1` entries (0: the
/// embeddings, `i`: after layer `i`, `layers`: the last layer's output), so `t ≤ layers`: a producer reading
/// transformers' `hidden_states` can give every one. The export's `target_layer_ids` holds `t − 1`, which the
/// serving engines capture before target layer `t` runs; `export-check` says which engine cannot serve a tap.
fn tap_layers(errs: &mut Errs, value: &Value, depth: Option<(usize, Span)>) -> Option<Vec<u32>> {
    let items = values::list(errs, "tap_layers", value)?;
    if items.is_empty() || items.len() as u64 > MAX_REPEATS {
        let rule = format!("must name 1 to {MAX_REPEATS} layers");
        let found = format!("{} layers", items.len());
        out_of_range(
            errs,
            "tap_layers",
            value,
            &rule,
            found,
            "for example `tap_layers = [1, 18, 35]`",
        );
        return None;
    }
    let mut layers = Vec::with_capacity(items.len());
    let mut ok = true;
    for item in items {
        let Some(layer) = values::count(errs, "tap_layers", item, 0) else {
            ok = false;
            continue;
        };
        let Ok(layer) = u32::try_from(layer) else {
            out_of_range(
                errs,
                "tap_layers",
                item,
                "entries must fit in 32 bits",
                layer,
                "layers count from 0",
            );
            ok = false;
            continue;
        };
        if let Some((depth, depth_span)) = depth
            && layer as usize > depth
        {
            errs.push(
                Diagnostic::error(
                    item.span,
                    format!("tap {layer} is beyond the target's {depth} layers"),
                )
                .label(format!("must be at most {depth}"))
                .related(depth_span, "the target's depth, set here")
                .help(format!(
                    "tap t is entry t of the target's hidden states, which a {depth}-layer target has {} of \
                     (0: the embeddings, {depth}: the last layer's output), so its deepest tap is {depth}",
                    depth + 1
                )),
            );
            ok = false;
        }
        if layers.contains(&layer) {
            errs.push(
                Diagnostic::error(item.span, format!("layer {layer} is tapped twice"))
                    .label("repeated")
                    .help("list each layer once"),
            );
            ok = false;
        }
        layers.push(layer);
    }
    ok.then_some(layers)
}

fn source(
    errs: &mut Errs,
    call: &Call,
    lengths: &mut Option<(usize, usize, Span)>,
) -> Option<SourceSpec> {
    let context = format!("`{}(...)`", call.name.name);
    let mut f = Fields::new(&call.args, context, call.span, errs);
    let spec = if call.name.name == "synthetic" {
        let seed = f
            .required("seed", "1")
            .and_then(|v| values::count(errs, "seed", v, 0));
        let range = f
            .required("lengths", "64..512")
            .and_then(|v| length_range(errs, v));
        if let Some((min_len, max_len)) = range {
            *lengths = f.optional("lengths").map(|v| (min_len, max_len, v.span));
        }
        seed.zip(range)
            .map(|(seed, (min_len, max_len))| SourceSpec::Synthetic {
                seed: seed as u64,
                min_len,
                max_len,
            })
    } else if call.name.name == "stream" {
        stream_source(errs, &mut f)
    } else {
        let pattern = f
            .required("path", "\"data/*.safetensors\"")
            .and_then(|v| values::nonempty_string(errs, "path", v));
        let epochs = match f.optional("epochs") {
            Some(v) => values::count_in(errs, "epochs", v, 1, MAX_EPOCHS).map(|n| n as u64),
            None => Some(1),
        };
        let shuffle = match f.optional("shuffle") {
            Some(v) => values::choice(errs, "shuffle", v, &[("true", true), ("false", false)]),
            None => Some(false),
        };
        let seed = match f.optional("seed") {
            Some(v) => values::count(errs, "seed", v, 0).map(|n| n as u64),
            None => Some(0),
        };
        match (pattern, epochs, shuffle, seed) {
            (Some(p), Some(epochs), Some(shuffle), Some(seed)) => Some(SourceSpec::Safetensors {
                pattern: p.to_owned(),
                epochs,
                shuffle_seed: shuffle.then_some(seed),
            }),
            _ => None,
        }
    };
    f.finish(errs);
    spec
}

/// `stream(listen = "127.0.0.1:7070", token = env("DRAFTPIPE_TOKEN"), max_message = 2GiB, read_timeout = 30s)`.
/// A listener reachable from other machines must have a token.
fn stream_source(errs: &mut Errs, f: &mut Fields<'_>) -> Option<SourceSpec> {
    let listen_value = f.required("listen", "\"127.0.0.1:7070\"");
    let listen = listen_value.and_then(|v| {
        let text = values::nonempty_string(errs, "listen", v)?;
        match parse_listen(text) {
            Ok(loopback) => Some((text, loopback, v.span)),
            Err(problem) => {
                errs.push(
                    Diagnostic::error(v.span, format!("`listen` {problem}, found \"{text}\""))
                        .label("not an address")
                        .help("write `\"IP:PORT\"` (for example \"127.0.0.1:7070\") or `\"unix:/path/to/socket\"`"),
                );
                None
            }
        }
    });
    let token_value = f.optional("token");
    let token_env = match token_value {
        Some(v) => match &v.kind {
            ValueKind::Env(name) if valid_env_name(&name.value) => Some(Some(name.value.clone())),
            ValueKind::Env(name) => {
                errs.push(
                    Diagnostic::error(name.span, format!("`{}` is not an environment variable name", name.value))
                        .label("not a variable name")
                        .help("names are letters, digits and `_`, not starting with a digit, e.g. `env(\"DRAFTPIPE_TOKEN\")`"),
                );
                None
            }
            _ => {
                errs.push(
                    Diagnostic::error(v.span, "`token` must come from the environment")
                        .label("expected `env(\"NAME\")`")
                        .help("write `token = env(\"DRAFTPIPE_TOKEN\")`: a token written in the file would be shared with it"),
                );
                None
            }
        },
        None => Some(None),
    };
    let max_message = match f.optional("max_message") {
        Some(v) => values::size_bytes(errs, "max_message", v).and_then(|bytes| {
            if bytes < MIN_STREAM_MESSAGE {
                out_of_range(
                    errs,
                    "max_message",
                    v,
                    "must be at least 64KiB",
                    format!("{bytes} bytes"),
                    "for example `max_message = 2GiB`",
                );
                return None;
            }
            Some(bytes)
        }),
        // Derived from the target's shape once it is known (`target_stage`).
        None => Some(0),
    };
    let read_timeout_ms = match f.optional("read_timeout") {
        Some(v) => values::duration_ms(errs, "read_timeout", v),
        None => Some(DEFAULT_STREAM_READ_TIMEOUT_MS),
    };
    let (listen, loopback, listen_span) = listen?;
    let token_env = token_env?;
    if !loopback && token_env.is_none() {
        errs.push(
            Diagnostic::error(listen_span, format!("`{listen}` accepts connections from other machines, and no `token` is set"))
                .label("not a loopback address")
                .help("add `token = env(\"DRAFTPIPE_TOKEN\")` (producers must present it), or listen on 127.0.0.1 or a unix socket"),
        );
        return None;
    }
    Some(SourceSpec::Stream {
        listen: listen.to_owned(),
        token_env,
        max_message_bytes: max_message?,
        read_timeout_ms: read_timeout_ms?,
    })
}

/// The most passes a file source may make.
const MAX_EPOCHS: u64 = 1_000_000;

/// The smallest `max_message` accepted: below it not even a hello-sized header fits.
const MIN_STREAM_MESSAGE: u64 = 64 << 10;

/// Parses a stream `listen` address; `Ok(true)` when only this machine can connect (loopback IP or unix socket).
pub fn parse_listen(text: &str) -> Result<bool, &'static str> {
    if let Some(path) = text.strip_prefix("unix:") {
        return if path.is_empty() {
            Err("needs a socket path after `unix:`")
        } else {
            Ok(true)
        };
    }
    if let Some(port) = text.strip_prefix("localhost:") {
        return port
            .parse::<u16>()
            .map(|_| true)
            .map_err(|_| "has no valid port after `localhost:`");
    }
    text.parse::<std::net::SocketAddr>()
        .map(|addr| addr.ip().is_loopback())
        .map_err(|_| "is not `IP:PORT` or `unix:/path`")
}

fn valid_env_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// `min..max` with `1 ≤ min < max`.
fn length_range(errs: &mut Errs, value: &Value) -> Option<(usize, usize)> {
    let (start, end) = values::int_range(errs, "lengths", value)?;
    if start < 1 || end <= start {
        errs.push(
            Diagnostic::error(
                value.span,
                format!(
                    "`lengths` must be a non-empty range of positive lengths, found {start}..{end}"
                ),
            )
            .label("empty or non-positive")
            .help("write `min..max` with 1 <= min < max (max is excluded)"),
        );
        return None;
    }
    Some((start as usize, end as usize))
}

/// Builds the target stage once its parts and placement are known to be valid.
pub(crate) fn target_stage(
    section: &StageSection,
    parts: TargetParts,
    placement: Placement,
) -> Option<TargetStage> {
    let source = parts.source?;
    let hs_dtype = match parts.hs_dtype {
        Some(dtype) => Some(dtype?),
        None => HsDtype::default_for(&source),
    };
    Some(TargetStage {
        name: section.name.name.clone(),
        placement,
        hidden: parts.hidden?,
        layers: match parts.layers {
            Some(layers) => Some(layers?),
            None => None,
        },
        tap_layers: parts.tap_layers?,
        vocab: parts.vocab?,
        batch_tokens: parts.batch_tokens?.0,
        source,
        max_rate: match parts.max_rate {
            Some(rate) => Some(rate?),
            None => None,
        },
        weights: match parts.weights {
            Some((weights, _)) => Some(weights?),
            None => None,
        },
        hs_dtype,
        masks: parts.masks?,
    })
    .map(|mut stage| {
        let default_limit = stage.default_max_message_bytes();
        if let SourceSpec::Stream {
            max_message_bytes, ..
        } = &mut stage.source
            && *max_message_bytes == 0
        {
            *max_message_bytes = default_limit;
        }
        stage
    })
}

/// What the queue section yields; `None` fields had errors.
pub(crate) struct QueueParts {
    pub capacity: Option<usize>,
    pub capacity_span: Option<Span>,
    pub min_ready: Option<usize>,
    pub buckets: Option<(Vec<usize>, Span)>,
    pub pull: Option<PullPolicy>,
}

pub(crate) fn check_queue(section: &QueueSection, errs: &mut Errs) -> QueueParts {
    let context = format!("queue `{}`", section.name.name);
    let mut f = Fields::new(&section.block.entries, context, section.header, errs);
    let capacity_value = f.required("capacity", "16");
    let capacity_span = capacity_value.map(|v| v.span);
    let capacity =
        capacity_value.and_then(|v| values::count_in(errs, "capacity", v, 1, MAX_CAPACITY));
    let min_ready = match f.optional("min_ready") {
        None => Some(DEFAULT_MIN_READY),
        Some(v) => values::count(errs, "min_ready", v, 0).and_then(|m| match capacity {
            Some(c) if m > c => {
                errs.push(
                    Diagnostic::error(
                        v.span,
                        format!("`min_ready` ({m}) is larger than `capacity` ({c})"),
                    )
                    .label("can never be reached")
                    .help("consumers would wait forever: make `min_ready` at most `capacity`"),
                );
                None
            }
            _ => Some(m),
        }),
    };
    let buckets = f
        .required("buckets", "[128, 256, 512]")
        .and_then(|v| buckets(errs, v).map(|b| (b, v.span)));
    let pull_options = [
        ("random_in_bucket", PullPolicy::RandomInBucket),
        ("round_robin", PullPolicy::RoundRobin),
        ("fifo", PullPolicy::Fifo),
    ];
    let pull = match f.optional("pull") {
        None => Some(PullPolicy::RandomInBucket),
        Some(v) => values::choice(errs, "pull", v, &pull_options),
    };
    f.finish(errs);
    QueueParts {
        capacity,
        capacity_span,
        min_ready,
        buckets,
        pull,
    }
}

/// A non-empty, strictly increasing list of positive lengths.
fn buckets(errs: &mut Errs, value: &Value) -> Option<Vec<usize>> {
    let items = values::list(errs, "buckets", value)?;
    if items.is_empty() {
        errs.push(
            Diagnostic::error(value.span, "`buckets` is empty")
                .label("no bucket")
                .help("give at least one upper bound on sequence length, e.g. `[512]`"),
        );
        return None;
    }
    let parsed: Vec<Option<usize>> = items
        .iter()
        .map(|v| values::count_in(errs, "buckets", v, 1, MAX_DIM))
        .collect();
    let bounds: Vec<usize> = parsed.into_iter().collect::<Option<_>>()?;
    let mut ok = true;
    for (i, pair) in bounds.windows(2).enumerate() {
        if pair[1] <= pair[0] {
            errs.push(
                Diagnostic::error(
                    items[i + 1].span,
                    format!(
                        "`buckets` must be strictly increasing: {} follows {}",
                        pair[1], pair[0]
                    ),
                )
                .label("not larger than the bucket before")
                .help("sort the bounds and remove repeats"),
            );
            ok = false;
        }
    }
    ok.then_some(bounds)
}

/// Builds the queue spec once the ends are resolved.
pub(crate) fn queue_spec(section: &QueueSection, parts: QueueParts) -> Option<QueueSpec> {
    Some(QueueSpec {
        name: section.name.name.clone(),
        from: section.from.name.clone(),
        to: section.to.name.clone(),
        capacity: parts.capacity?,
        min_ready: parts.min_ready?,
        buckets: parts.buckets?.0,
        pull: parts.pull?,
    })
}

/// The model family as written and where, known even when its arguments have errors, so the rules that depend
/// on the family (loss keys, target weights, taps) still run.
#[derive(Clone, Copy)]
pub(crate) struct ModelKind {
    pub family: &'static Registered,
    pub span: Span,
}

/// `schedule` as written, before `steps` resolves a warmup fraction: `Ok(steps)` or `Err(fraction)`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ScheduleParts {
    pub kind: ScheduleKind,
    pub warmup: Result<u64, f64>,
    /// The warmup's value (for errors that need `steps`), or the whole `schedule` value.
    pub warmup_span: Span,
    pub span: Span,
}

/// What the drafter section yields.
pub(crate) struct DrafterParts {
    pub model: Option<Box<dyn CheckedModel>>,
    pub model_kind: Option<ModelKind>,
    pub loss: Option<LossSpec>,
    pub optimizer: Option<AdamWSpec>,
    /// `schedule`, when written (`Some(None)`: written but invalid); `None`: constant.
    pub schedule: Option<Option<ScheduleParts>>,
    pub sync: Option<SyncMode>,
    pub launch: Option<LaunchMode>,
    /// Where `launch` was written, if it was: it applies to GPU drafters only.
    pub launch_span: Option<Span>,
    /// `precision`, when written (`Some(None)`: written but invalid), and where: the default depends on the
    /// placement, and `tf32` is refused on the CPU.
    pub precision: Option<(Option<Precision>, Span)>,
    pub steps: Option<Option<u64>>,
    /// `vocab_map`, when written (`Some(None)`: written but invalid), and where.
    pub vocab_map: Option<(Option<String>, Span)>,
}

/// The family names the grammar accepts, in registry order.
fn family_names() -> Vec<&'static str> {
    REGISTRY.iter().map(|family| family.name).collect()
}

pub(crate) fn check_drafter(section: &StageSection, errs: &mut Errs) -> DrafterParts {
    let context = format!("drafter `{}`", section.name.name);
    let mut f = Fields::new(&section.block.entries, context, section.header, errs);
    let example = "mlp(hidden = 1024, blocks = 2, intermediate = 2816, heads = 4)";
    let model_call = f
        .required("model", example)
        .and_then(|v| values::call(errs, "model", v, &family_names(), example));
    // `values::call` accepted only registered names.
    let model_kind = model_call.and_then(|c| {
        Some(ModelKind {
            family: registered(&c.name.name)?,
            span: c.name.span,
        })
    });
    let model = model_call
        .zip(model_kind)
        .and_then(|(c, kind)| (kind.family.check)(errs, c));
    let loss = match f.optional("loss") {
        None => Some(LossSpec {
            head_decay: DEFAULT_HEAD_DECAY,
            position_decay: None,
            step_decay: model_kind
                .filter(|m| m.family.weighting.0 == "step_decay")
                .map(|_| DEFAULT_STEP_DECAY),
            chunk_tokens: DEFAULT_CHUNK_TOKENS,
        }),
        Some(v) => values::call(
            errs,
            "loss",
            v,
            &["cross_entropy"],
            "cross_entropy(head_decay = 0.8)",
        )
        .and_then(|c| loss(errs, c, model_kind)),
    };
    let optimizer = match f.optional("optimizer") {
        None => Some(adamw_defaults()),
        Some(v) => values::call(errs, "optimizer", v, &["adamw"], "adamw(lr = 1e-3)")
            .and_then(|c| adamw(errs, c)),
    };
    let schedule = f.optional("schedule").map(|v| schedule(errs, v));
    let sync = match f.optional("sync") {
        None => Some(SyncMode::AllReduce),
        Some(v) => values::choice(
            errs,
            "sync",
            v,
            &[("allreduce", SyncMode::AllReduce), ("none", SyncMode::None)],
        ),
    };
    let launch_value = f.optional("launch");
    let launch_span = launch_value.map(|v| v.span);
    let launch = match launch_value {
        None => Some(LaunchMode::Graph),
        Some(v) => values::choice(
            errs,
            "launch",
            v,
            &[("graph", LaunchMode::Graph), ("eager", LaunchMode::Eager)],
        ),
    };
    let precision = f.optional("precision").map(|v| {
        let choice = values::choice(
            errs,
            "precision",
            v,
            &[
                ("f32", Precision::F32),
                ("tf32", Precision::Tf32),
                ("bf16", Precision::Bf16),
            ],
        );
        (choice, v.span)
    });
    let vocab_map = f.optional("vocab_map").map(|v| {
        let path = values::nonempty_string(errs, "vocab_map", v).map(str::to_owned);
        (
            path.filter(|_| takes_vocab_map(errs, v, model_kind)),
            v.span,
        )
    });
    let steps = match f.optional("steps") {
        None => Some(None),
        Some(v) => values::count(errs, "steps", v, 1).map(|n| Some(n as u64)),
    };
    f.finish(errs);
    DrafterParts {
        model,
        model_kind,
        loss,
        optimizer,
        schedule,
        sync,
        launch,
        launch_span,
        precision,
        steps,
        vocab_map,
    }
}

/// `launch` chooses how CUDA kernels are launched, so on a drafter placed on the CPU it can only be a mistake.
pub(crate) fn check_launch_placement(
    section: &StageSection,
    parts: &DrafterParts,
    placement: &Placement,
    errs: &mut Errs,
) {
    let on_cpu = placement.cpu_workers() == placement.workers.len();
    if let (true, Some(span)) = (on_cpu, parts.launch_span) {
        errs.push(
            Diagnostic::error(
                span,
                format!(
                    "`launch` applies to drafters on GPUs; drafter `{}` runs on the cpu",
                    section.name.name
                ),
            )
            .label("no CUDA launch on the cpu")
            .help("remove `launch`, or place the drafter on GPUs (e.g. `on gpu 0..2`)"),
        );
    }
}

/// `precision = tf32` on a CPU drafter is refused: TF32 is a tensor-core format, and the CPU would only add a
/// rounding pass to the same f32 products (bf16 is allowed there, emulated, so a configuration can be checked
/// on the CPU with the numerics it will have on the GPU).
pub(crate) fn check_precision_placement(
    section: &StageSection,
    parts: &DrafterParts,
    placement: &Placement,
    errs: &mut Errs,
) {
    let on_cpu = placement.cpu_workers() > 0;
    if let (true, Some((Some(Precision::Tf32), span))) = (on_cpu, parts.precision) {
        errs.push(
            Diagnostic::error(
                span,
                format!(
                    "`precision = tf32` needs GPU tensor cores; drafter `{}` runs on the cpu",
                    section.name.name
                ),
            )
            .label("no TF32 on the cpu")
            .help("use `precision = f32` (the cpu default) or `bf16` (emulated), or place the drafter on GPUs"),
        );
    }
}

/// Resolves `schedule` against `steps`: linear and cosine decay to 0 at the last step, so they need `steps`,
/// and a warmup must fit in them. A fraction `f` warms up for `floor(f·steps)` steps (SpecForge's and Hugging
/// Face's `int(warmup_ratio · total_steps)`).
pub(crate) fn check_schedule(parts: &DrafterParts, errs: &mut Errs) -> Option<LrSchedule> {
    let Some(written) = parts.schedule else {
        return Some(LrSchedule::CONSTANT);
    };
    let written = written?;
    let steps = parts.steps?;
    let needs_steps = written.kind != ScheduleKind::Constant || written.warmup != Ok(0);
    let Some(steps) = steps.filter(|_| needs_steps) else {
        if needs_steps {
            let what = match written.kind {
                ScheduleKind::Constant => "a warmup".to_owned(),
                kind => format!("`schedule = {}`", kind.name()),
            };
            errs.push(
                Diagnostic::error(
                    written.span,
                    format!("{what} is laid out over the drafter's `steps`, and it has none"),
                )
                .label("no step count to schedule over")
                .help("add `steps = N` to the drafter, or use `schedule = constant`"),
            );
            return None;
        }
        return Some(LrSchedule::CONSTANT);
    };
    let warmup_steps = match written.warmup {
        Ok(count) if count > steps => {
            errs.push(
                Diagnostic::error(
                    written.warmup_span,
                    format!("`warmup` is {count} steps, more than the drafter's {steps} `steps`"),
                )
                .label("longer than the run")
                .help(format!(
                    "use at most {steps} steps, or a fraction of the run such as `warmup = 0.04`"
                )),
            );
            return None;
        }
        Ok(count) => count,
        Err(fraction) => (fraction * steps as f64).floor() as u64,
    };
    Some(LrSchedule {
        kind: written.kind,
        warmup_steps,
    })
}

/// `schedule = constant | linear(warmup = f) | cosine(warmup = f)`: `warmup` a fraction of `steps` in
/// `[0, 1)` or a whole number of steps; bare `linear` and `cosine` have no warmup.
fn schedule(errs: &mut Errs, value: &Value) -> Option<ScheduleParts> {
    let kinds = [
        ("constant", ScheduleKind::Constant),
        ("linear", ScheduleKind::Linear),
        ("cosine", ScheduleKind::Cosine),
    ];
    match &value.kind {
        ValueKind::Call(_) => {}
        _ => {
            let kind = values::choice(errs, "schedule", value, &kinds)?;
            return Some(ScheduleParts {
                kind,
                warmup: Ok(0),
                warmup_span: value.span,
                span: value.span,
            });
        }
    }
    let names = kinds.map(|(name, _)| name);
    let call = values::call(errs, "schedule", value, &names, "cosine(warmup = 0.04)")?;
    let kind = kinds
        .iter()
        .find(|(name, _)| *name == call.name.name)
        .map(|(_, kind)| *kind)?;
    let context = format!("`{}(...)`", call.name.name);
    let mut f = Fields::new(&call.args, context, call.span, errs);
    let warmup = f.optional("warmup").map(|v| (warmup(errs, v), v.span));
    f.finish(errs);
    let (warmup, warmup_span) = match warmup {
        Some((warmup, span)) => (warmup?, span),
        None => (Ok(0), call.span),
    };
    Some(ScheduleParts {
        kind,
        warmup,
        warmup_span,
        span: value.span,
    })
}

/// A warmup: an integer is a step count, a float a fraction of `steps` in `[0, 1)`.
fn warmup(errs: &mut Errs, value: &Value) -> Option<Result<u64, f64>> {
    match value.kind {
        ValueKind::Integer(_) => values::count(errs, "warmup", value, 0).map(|n| Ok(n as u64)),
        _ => values::real_where(
            errs,
            "warmup",
            value,
            (
                "as a fraction of `steps` must lie in [0, 1) (write a step count as an integer)",
                "0.04",
            ),
            |x| (0.0..1.0).contains(&x),
        )
        .map(Err),
    }
}

/// Builds the drafter stage (and its model dimensions) once its parts and placement are known to be valid.
pub(crate) fn drafter_stage(
    section: &StageSection,
    parts: DrafterParts,
    placement: Placement,
    schedule: LrSchedule,
) -> Option<(DrafterStage, Box<dyn CheckedModel>)> {
    let precision = match parts.precision {
        None => Precision::default_for(*placement.workers.first()?),
        Some((precision, _)) => precision?,
    };
    let stage = DrafterStage {
        name: section.name.name.clone(),
        placement,
        loss: parts.loss?,
        optimizer: AdamWSpec {
            schedule,
            ..parts.optimizer?
        },
        sync: parts.sync?,
        launch: parts.launch?,
        precision,
        steps: parts.steps?,
        vocab_map: match parts.vocab_map {
            Some((path, _)) => Some(path?),
            None => None,
        },
    };
    Some((stage, parts.model?))
}

/// `vocab_map` is read only by a family with its own draft vocabulary; records an error for the others.
fn takes_vocab_map(errs: &mut Errs, value: &Value, model: Option<ModelKind>) -> bool {
    let Some(model) = model.filter(|m| !m.family.takes_vocab_map) else {
        return true;
    };
    let takers: Vec<String> = REGISTRY
        .iter()
        .filter(|family| family.takes_vocab_map)
        .map(|family| format!("`{}`", family.name))
        .collect();
    let (this, article) = (model.family.name, model.family.article);
    errs.push(
        Diagnostic::error(
            value.span,
            format!(
                "`vocab_map` applies to {} drafters; this drafter is `{this}`",
                takers.join(" and ")
            ),
        )
        .label(format!("not {article} `{this}` setting"))
        .related(model.span, format!("model is `{this}`"))
        .help(format!(
            "remove `vocab_map` (a `{this}` drafter predicts over the target's whole vocabulary)"
        )),
    );
    false
}

/// Refuses a loss key that weighs another family's predictions: each family owns one ([`Registered::weighting`]).
fn loss_key_for(errs: &mut Errs, (key, value): (&str, &Value), model: Option<ModelKind>) -> bool {
    let Some(model) = model.filter(|m| m.family.weighting.0 != key) else {
        return true;
    };
    let owners: Vec<String> = REGISTRY
        .iter()
        .filter(|family| family.weighting.0 == key)
        .map(|family| format!("`{}`", family.name))
        .collect();
    let (this, article) = (model.family.name, model.family.article);
    let (own_key, weighs) = model.family.weighting;
    errs.push(
        Diagnostic::error(
            value.span,
            format!(
                "`{key}` applies to {} drafters; this drafter is `{this}`",
                owners.join(" and ")
            ),
        )
        .label(format!("not {article} `{this}` setting"))
        .related(model.span, format!("model is `{this}`"))
        .help(format!("remove `{key}` (`{own_key}` weighs {weighs})")),
    );
    false
}

fn loss(errs: &mut Errs, call: &Call, model: Option<ModelKind>) -> Option<LossSpec> {
    let mut f = Fields::new(
        &call.args,
        "`cross_entropy(...)`".to_owned(),
        call.span,
        errs,
    );
    let head_decay = match f.optional("head_decay") {
        None => Some(DEFAULT_HEAD_DECAY as f64),
        Some(v) if !loss_key_for(errs, ("head_decay", v), model) => None,
        Some(v) => values::real_where(errs, "head_decay", v, ("must lie in (0, 1]", "0.8"), |x| {
            x > 0.0 && x <= 1.0
        }),
    };
    let position_decay = match f.optional("position_decay") {
        None => Some(None),
        Some(v) if !loss_key_for(errs, ("position_decay", v), model) => None,
        Some(v) => values::real_where(
            errs,
            "position_decay",
            v,
            ("must be positive", "7.0"),
            |x| x > 0.0 && x.is_finite() && (x as f32) > 0.0 && (x as f32).is_finite(),
        )
        .map(|x| Some(x as f32)),
    };
    // The family that weighs its unroll's steps gets SpecForge's 0.8 when the file says nothing.
    let step_decay = match f.optional("step_decay") {
        None => Some(
            model
                .filter(|m| m.family.weighting.0 == "step_decay")
                .map(|_| DEFAULT_STEP_DECAY),
        ),
        Some(v) if !loss_key_for(errs, ("step_decay", v), model) => None,
        Some(v) => values::real_where(errs, "step_decay", v, ("must lie in (0, 1]", "0.8"), |x| {
            x > 0.0 && x <= 1.0
        })
        .map(|x| Some(x as f32)),
    };
    let chunk_tokens = match f.optional("chunk_tokens") {
        None => Some(DEFAULT_CHUNK_TOKENS),
        Some(v) => values::count_in(errs, "chunk_tokens", v, 1, MAX_DIM),
    };
    f.finish(errs);
    Some(LossSpec {
        head_decay: head_decay? as f32,
        position_decay: position_decay?,
        step_decay: step_decay?,
        chunk_tokens: chunk_tokens?,
    })
}

/// PyTorch's `torch.optim.AdamW` defaults, no gradient clipping.
pub fn adamw_defaults() -> AdamWSpec {
    AdamWSpec {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        clip_grad_norm: None,
        schedule: LrSchedule::CONSTANT,
    }
}

fn adamw(errs: &mut Errs, call: &Call) -> Option<AdamWSpec> {
    let defaults = adamw_defaults();
    let mut f = Fields::new(&call.args, "`adamw(...)`".to_owned(), call.span, errs);
    let positive = |x: f64| x > 0.0 && x.is_finite() && (x as f32) > 0.0;
    let lr = f.optional("lr").map_or(Some(defaults.lr as f64), |v| {
        values::real_where(errs, "lr", v, ("must be positive", "1e-3"), positive)
    });
    let betas = match f.optional("betas") {
        None => Some((defaults.beta1, defaults.beta2)),
        Some(v) => values::tuple(errs, "betas", v, 2, "(0.9, 0.999)").and_then(|items| {
            let unit = |x: f64| (0.0..1.0).contains(&x);
            let b1 = values::real_where(
                errs,
                "betas",
                &items[0],
                ("must lie in [0, 1)", "(0.9, 0.999)"),
                unit,
            );
            let b2 = values::real_where(
                errs,
                "betas",
                &items[1],
                ("must lie in [0, 1)", "(0.9, 0.999)"),
                unit,
            );
            Some((b1? as f32, b2? as f32))
        }),
    };
    let eps = f.optional("eps").map_or(Some(defaults.eps as f64), |v| {
        values::real_where(errs, "eps", v, ("must be positive", "1e-8"), positive)
    });
    let weight_decay = f
        .optional("weight_decay")
        .map_or(Some(defaults.weight_decay as f64), |v| {
            values::real_where(
                errs,
                "weight_decay",
                v,
                ("must be non-negative", "0.01"),
                |x| x >= 0.0 && x.is_finite(),
            )
        });
    let clip_grad_norm = match f.optional("clip_grad_norm") {
        None => Some(None),
        Some(v) => values::real_where(
            errs,
            "clip_grad_norm",
            v,
            ("must be positive", "1.0"),
            positive,
        )
        .map(|x| Some(x as f32)),
    };
    f.finish(errs);
    let (beta1, beta2) = betas?;
    Some(AdamWSpec {
        lr: lr? as f32,
        beta1,
        beta2,
        eps: eps? as f32,
        weight_decay: weight_decay? as f32,
        clip_grad_norm: clip_grad_norm?,
        schedule: LrSchedule::CONSTANT,
    })
}

/// Telemetry settings; defaults when the section is absent.
pub(crate) fn check_telemetry(
    section: Option<&TelemetrySection>,
    errs: &mut Errs,
) -> Option<TelemetrySpec> {
    let Some(section) = section else {
        return Some(TelemetrySpec {
            every_ms: DEFAULT_EVERY_MS,
            trace: None,
            tensorboard: None,
        });
    };
    let mut f = Fields::new(
        &section.block.entries,
        "`telemetry`".to_owned(),
        section.header,
        errs,
    );
    let every_ms = f.optional("every").map_or(Some(DEFAULT_EVERY_MS), |v| {
        values::duration_ms(errs, "every", v)
    });
    let trace = match f.optional("trace") {
        None => Some(None),
        Some(v) => values::nonempty_string(errs, "trace", v).map(|s| Some(s.to_owned())),
    };
    let tensorboard = match f.optional("tensorboard") {
        None => Some(None),
        Some(v) => values::nonempty_string(errs, "tensorboard", v).map(|s| Some(s.to_owned())),
    };
    f.finish(errs);
    Some(TelemetrySpec {
        every_ms: every_ms?,
        trace: trace?,
        tensorboard: tensorboard?,
    })
}
