//! Checks: from a syntactically valid AST to a [`Plan`], reporting every semantic error of the file.
//!
//! ```text
//!  AST ──sections (one of each, known names)──▶ per-section checks (stages.rs, devices.rs)
//!      ──cross-section rules (queue ends, buckets, lengths, devices)──▶ cost model ──memory fits?──▶ Plan
//! ```
//!
//! Each check reads what it can, records what is wrong and goes on; the plan is built only when nothing was
//! recorded, so a file with errors yields all of them and no plan.

mod acceptance;
mod devices;
pub(crate) mod fields;
mod masks;
mod stages;
mod suggest;
pub use suggest::closest;
pub(crate) mod values;

use crate::ast::{
    AcceptanceSection, PipelineDecl, PipelineFile, QueueSection, Section, StageSection,
    TelemetrySection,
};
use crate::cost::{self, format_bytes};
use crate::diagnostic::Diagnostic;
use crate::family::{REGISTRY, TargetFacts};
use crate::plan::{
    DeclaredDevice, Device, DeviceMemory, HostMemory, HsDtype, ModelPlan, Placement, Plan,
    SourceSpec, StepPhase, SyncMode,
};
use crate::span::Span;

pub use acceptance::{DEFAULT_MAX_NEW_TOKENS, DEFAULT_TIMEOUT_MS};
pub use devices::{MAX_DEVICES, device_name};
pub use stages::{
    DEFAULT_CHUNK_TOKENS, DEFAULT_EVERY_MS, DEFAULT_HEAD_DECAY, DEFAULT_MIN_READY,
    DEFAULT_STEP_DECAY, adamw_defaults,
};

type Errs = Vec<Diagnostic>;

/// Largest supported parameter count (4 TiB of f32 parameters); it also bounds the cost model's arithmetic.
pub const MAX_PARAMETERS: u128 = 1 << 40;

const SECTION_KEYWORDS: [&str; 7] = [
    "pipeline",
    "devices",
    "target",
    "queue",
    "drafter",
    "telemetry",
    "acceptance",
];

/// The top-level sections of a file, sorted by kind.
#[derive(Default)]
struct Sections<'a> {
    pipeline: Vec<&'a PipelineDecl>,
    devices: Vec<&'a crate::ast::DevicesSection>,
    targets: Vec<&'a StageSection>,
    queues: Vec<&'a QueueSection>,
    drafters: Vec<&'a StageSection>,
    telemetry: Vec<&'a TelemetrySection>,
    acceptance: Vec<&'a AcceptanceSection>,
}

/// Checks `file` and builds its plan with its warnings ([`plan_warnings`]), or returns every error found.
pub(crate) fn check(file: &PipelineFile) -> Result<(Plan, Vec<Diagnostic>), Errs> {
    let mut errs = Errs::new();
    let sections = sort_sections(file, &mut errs);
    check_unique_names(&sections, &mut errs);

    let name = sections.pipeline.first().map(|p| p.name.value.clone());
    let declared = sections
        .devices
        .first()
        .map(|d| devices::check_devices(d, &mut errs));
    let telemetry = stages::check_telemetry(sections.telemetry.first().copied(), &mut errs);

    let target = sections
        .targets
        .first()
        .map(|s| (s, stages::check_target(s, &mut errs)));
    let target_placement = sections
        .targets
        .first()
        .and_then(|s| devices::check_placement(&s.placement, &mut errs));
    let drafter = sections
        .drafters
        .first()
        .map(|s| (s, stages::check_drafter(s, &mut errs)));
    let precision_span = drafter
        .as_ref()
        .and_then(|(_, d)| d.precision.map(|(_, span)| span));
    let drafter_placement = sections
        .drafters
        .first()
        .and_then(|s| devices::check_placement(&s.placement, &mut errs));
    if let (Some((s, d)), Some(p)) = (&drafter, &drafter_placement) {
        stages::check_launch_placement(s, d, p, &mut errs);
        stages::check_precision_placement(s, d, p, &mut errs);
    }
    let schedule = drafter
        .as_ref()
        .and_then(|(_, d)| stages::check_schedule(d, &mut errs));
    let acceptance = acceptance::check_acceptance(
        sections.acceptance.first().copied(),
        drafter.as_ref().and_then(|(_, d)| d.model_kind),
        &mut errs,
    );
    if let (Some((ts, t)), Some((_, d))) = (&target, &drafter) {
        check_model_against_target(ts, t, d, &mut errs);
    }
    let queue = sections
        .queues
        .first()
        .map(|q| (q, stages::check_queue(q, &mut errs)));

    if let Some((q, _)) = &queue {
        check_queue_ends(q, &sections, &mut errs);
    }
    if let (Some((_, t)), Some((_, q))) = (&target, &queue) {
        check_buckets_against_target(t, q, &mut errs);
    }
    if let (Some((_, q)), Some((_, d)), Some(p)) = (&queue, &drafter, &drafter_placement) {
        check_capacity_holds_a_round(q, d, p, &mut errs);
    }
    let mut placed = Vec::new();
    if let (Some(s), Some(p)) = (sections.targets.first(), &target_placement) {
        placed.push(("target", s.name.name.as_str(), p, s.placement.span));
    }
    if let (Some(s), Some(p)) = (sections.drafters.first(), &drafter_placement) {
        placed.push(("drafter", s.name.name.as_str(), p, s.placement.span));
    }
    devices::check_device_use(&placed, declared.as_deref(), &mut errs);

    if !errs.is_empty() {
        return Err(errs);
    }
    // No error was recorded, so every section exists once and every part is present; a `None` here is a
    // check that failed without saying why, which `compile_source` turns into an internal error.
    let drafter_section = sections.drafters.first().copied();
    let stages = (
        name,
        target
            .zip(target_placement)
            .and_then(|((s, t), p)| stages::target_stage(s, t, p)),
        queue.and_then(|(s, q)| stages::queue_spec(s, q)),
        drafter
            .zip(drafter_placement)
            .zip(schedule)
            .and_then(|(((s, d), p), schedule)| stages::drafter_stage(s, d, p, schedule)),
        drafter_section,
        telemetry,
        acceptance,
    );
    let (
        Some(name),
        Some(target),
        Some(queue),
        Some((drafter, model)),
        Some(drafter_section),
        Some(telemetry),
        Some(acceptance),
    ) = stages
    else {
        return Err(errs);
    };
    let spec = model.spec(&target);
    let too_large = |what: &str| {
        vec![
            Diagnostic::error(
                drafter_section.header,
                format!("the {what} of drafter `{}` is too large", drafter.name),
            )
            .label("model too large")
            .help(format!(
                "draftpipe supports models up to {MAX_PARAMETERS} parameters"
            )),
        ]
    };
    if target.hs_dtype == Some(HsDtype::Fp8E4m3) && spec.reads_last_hidden_states() {
        // The teacher's `last_hidden_states` would need their own per-token scales through every source.
        return Err(vec![
            Diagnostic::error(
                drafter_section.header,
                format!(
                    "drafter `{}` reads the target's `last_hidden_states`, which this build does not hold in fp8_e4m3",
                    drafter.name
                ),
            )
            .label("reads last_hidden_states")
            .help("write `hs_dtype = bf16` on the target, or use a drafter that reads only the taps (mlp, dflash)"),
        ]);
    }
    if spec.family().parameter_count_wide() > MAX_PARAMETERS {
        return Err(too_large("parameter count"));
    }
    let buckets = cost::bucket_plans(&target, &queue, &spec, &drafter.loss)
        .ok_or_else(|| too_large("cost per step"))?;
    let memory = cost::device_memory(
        &drafter.placement,
        &spec,
        &buckets,
        &drafter.loss,
        (drafter.precision, target.hs_dtype_or_widest()),
    )
    .ok_or_else(|| too_large("memory plan"))?;
    let host_memory = cost::host_memory(
        (
            queue.capacity,
            target.placement.workers.len(),
            drafter.placement.workers.len(),
        ),
        &buckets,
        // A drafter that reads `last_hidden_states` gets `hidden` more elements per token, in the same dtype.
        (
            target.hs_width() + usize::from(spec.reads_last_hidden_states()) * target.hidden,
            target.hs_dtype_or_widest(),
        ),
        cost::stream_receive_bytes(&target),
    )
    .ok_or_else(|| too_large("memory plan"))?;
    // No error was recorded, so every declared memory was read.
    let declared: Vec<(DeclaredDevice, Span)> = declared
        .unwrap_or_default()
        .into_iter()
        .filter_map(|d| {
            Some((
                DeclaredDevice {
                    device: d.device,
                    memory_bytes: d.memory_bytes?,
                },
                d.span,
            ))
        })
        .collect();
    check_memory(
        (&memory, host_memory),
        &declared,
        drafter_section,
        &mut errs,
    );
    if !errs.is_empty() {
        return Err(errs);
    }
    let mut schedule = vec![
        StepPhase::Copy,
        StepPhase::Forward,
        StepPhase::Loss,
        StepPhase::Backward,
    ];
    if drafter.sync == SyncMode::AllReduce && drafter.placement.workers.len() > 1 {
        schedule.push(StepPhase::AllReduce);
    }
    schedule.push(StepPhase::Optimizer);
    let plan = Plan {
        name,
        devices: declared.into_iter().map(|(d, _)| d).collect(),
        model: ModelPlan::new(spec),
        target,
        queue,
        drafter,
        buckets,
        memory,
        host_memory,
        schedule,
        telemetry,
        acceptance,
    };
    let warnings = plan_warnings(&plan, precision_span.unwrap_or(drafter_section.header));
    Ok((plan, warnings))
}

/// What a valid plan will do that its author may not expect, each a warning at `precision`'s span (the
/// drafter's header when it is not written): a CUDA `dflash` drafter at `precision = bf16` whose heads or
/// block size the flash kernels refuse runs attention on the f32 CUDA-core kernels
/// ([`crate::family::dflash::flash`]), several times slower than the tensor-core kernels it asked for.
fn plan_warnings(plan: &Plan, precision: Span) -> Vec<Diagnostic> {
    let drafter = &plan.drafter;
    let on_gpu = drafter.placement.workers.iter().any(|&d| d != Device::Cpu);
    let Some(spec) = plan.model.spec.as_dflash() else {
        return Vec::new();
    };
    if !on_gpu || drafter.precision != crate::plan::Precision::Bf16 {
        return Vec::new();
    }
    let heads = (spec.heads, spec.kv_heads, spec.head_dim);
    crate::family::dflash::flash::flash_refusal(heads, spec.block)
        .map(|why| {
            Diagnostic::warning(
                precision,
                format!(
                    "drafter `{}` runs attention on the f32 CUDA-core kernels, not the bf16 flash kernels: \
                     they do not take {why}",
                    drafter.name
                ),
            )
            .label("attention falls back to f32")
            .help(
                "a head_dim of 64 or 128, 1 to 8 query heads per kv head and `block = 16` put attention on \
                 the tensor cores",
            )
        })
        .into_iter()
        .collect()
}

/// Rules between the drafter's model and the target: the family's own ([`ModelArgs::check_against_target`],
/// e.g. a token id inside the vocabulary), the number of taps a family fixes, and the target's frozen weights: a
/// family that reads the target's embedding and `lm_head` needs a target that says where they are (or a
/// synthetic one, which makes its own), and a family that trains its own head must not be given any.
///
/// [`ModelArgs::check_against_target`]: crate::family::ModelArgs::check_against_target
fn check_model_against_target(
    target_section: &StageSection,
    target: &stages::TargetParts,
    drafter: &stages::DrafterParts,
    errs: &mut Errs,
) {
    let Some(kind) = drafter.model_kind else {
        return;
    };
    if let Some(model) = &drafter.model {
        model.check_against_target(
            &TargetFacts {
                vocab: target.vocab,
            },
            errs,
        );
    }
    let family = kind.family;
    if let (Some(wanted), Some((taps, taps_span))) = (family.taps, &target.tap_layers_span)
        && *taps != wanted
    {
        errs.push(
            Diagnostic::error(
                *taps_span,
                format!(
                    "{} `{}` drafter reads exactly {wanted} tapped layers; target `{}` taps {taps}",
                    family.article,
                    family.name,
                    target_section.name.name
                ),
            )
            .label(format!("{taps} layers, expected {wanted}"))
            .related(kind.span, format!("model is `{}`", family.name))
            .help(format!(
                "tap {wanted} layers (a low, a middle and a high one, e.g. `tap_layers = [2, 18, 33]` of a 36-layer target)"
            )),
        );
    }
    let stream = matches!(target.source, Some(SourceSpec::Stream { .. }));
    if family.takes_vocab_map && stream && drafter.vocab_map.is_none() {
        errs.push(
            Diagnostic::error(
                kind.span,
                format!(
                    "{} `{}` drafter fed by a `stream` source needs `vocab_map`",
                    family.article, family.name
                ),
            )
            .label("no draft vocabulary given")
            .related(target_section.header, "the target's source is a stream")
            .help(
                "a stream's tokens arrive while the run trains, so the draft vocabulary cannot be counted \
                 before it: record the data to files, run `draftpipe vocab PIPE --out FILE` over a pipeline \
                 reading them, and add `vocab_map = \"FILE\"` to this drafter",
            ),
        );
    }
    let synthetic = matches!(target.source, Some(SourceSpec::Synthetic { .. }));
    match (family.reads_target_weights, &target.weights) {
        (true, None) if target.source.is_some() && !synthetic => errs.push(
            Diagnostic::error(
                kind.span,
                format!(
                    "{} `{}` drafter needs the target's frozen weights, and target `{}` has no `weights`",
                    family.article,
                    family.name,
                    target_section.name.name
                ),
            )
            .label("reads the target's embedding and lm_head")
            .related(target_section.header, "no `weights` here")
            .help("add `weights = safetensors(path = \"DIR\")` to the target (a file, a directory of shards or a glob)"),
        ),
        (false, Some((_, span))) => {
            let readers: Vec<String> = REGISTRY
                .iter()
                .filter(|f| f.reads_target_weights)
                .map(|f| format!("`{}`", f.name))
                .collect();
            errs.push(
                Diagnostic::error(
                    *span,
                    format!(
                        "`weights` are read by {} drafters; this drafter is `{}`",
                        readers.join(" and "),
                        family.name
                    ),
                )
                .label(format!("not used by {} `{}`", family.article, family.name))
                .related(kind.span, format!("model is `{}`", family.name))
                .help(format!(
                    "remove `weights` (the {} trains its own lm_head)",
                    family.name
                )),
            )
        }
        _ => {}
    }
}

fn sort_sections<'a>(file: &'a PipelineFile, errs: &mut Errs) -> Sections<'a> {
    let mut s = Sections::default();
    for section in &file.sections {
        match section {
            Section::Pipeline(p) => s.pipeline.push(p),
            Section::Devices(d) => s.devices.push(d),
            Section::Target(t) => s.targets.push(t),
            Section::Queue(q) => s.queues.push(q),
            Section::Drafter(d) => s.drafters.push(d),
            Section::Telemetry(t) => s.telemetry.push(t),
            Section::Acceptance(a) => s.acceptance.push(a),
            Section::Unknown(u) => errs.push(
                Diagnostic::error(
                    u.keyword.span,
                    format!("unknown section `{}`", u.keyword.name),
                )
                .label("unknown section")
                .help(suggest::help(
                    &u.keyword.name,
                    "the sections are",
                    &SECTION_KEYWORDS,
                )),
            ),
        }
    }
    let file_start = Span::new(0, 0);
    let rules: [(&str, Vec<Span>, bool, &str); 7] = [
        (
            "pipeline",
            s.pipeline.iter().map(|p| p.span).collect(),
            true,
            "pipeline \"NAME\"",
        ),
        (
            "devices",
            s.devices.iter().map(|d| d.span).collect(),
            false,
            "",
        ),
        (
            "target",
            s.targets.iter().map(|t| t.header).collect(),
            true,
            "target NAME on cpu { ... }",
        ),
        (
            "queue",
            s.queues.iter().map(|q| q.header).collect(),
            true,
            "queue NAME from TARGET to DRAFTER { ... }",
        ),
        (
            "drafter",
            s.drafters.iter().map(|d| d.header).collect(),
            true,
            "drafter NAME on cpu { ... }",
        ),
        (
            "telemetry",
            s.telemetry.iter().map(|t| t.header).collect(),
            false,
            "",
        ),
        (
            "acceptance",
            s.acceptance.iter().map(|a| a.header).collect(),
            false,
            "",
        ),
    ];
    for (keyword, found, required, example) in rules {
        if found.is_empty() && required {
            errs.push(
                Diagnostic::error(file_start, format!("missing `{keyword}` section"))
                    .label(format!("this file has no `{keyword}`"))
                    .help(format!("add `{example}`")),
            );
        }
        for extra in found.iter().skip(1) {
            errs.push(
                Diagnostic::error(*extra, format!("a pipeline has one `{keyword}` section"))
                    .label("second one")
                    .related(found[0], "first one")
                    .help(format!("merge the two `{keyword}` sections or remove one")),
            );
        }
    }
    s
}

/// Targets, queues and drafters share one namespace.
fn check_unique_names(s: &Sections<'_>, errs: &mut Errs) {
    let mut seen: Vec<(&str, &crate::ast::Ident)> = Vec::new();
    let named = s
        .targets
        .iter()
        .map(|t| ("target", &t.name))
        .chain(s.queues.iter().map(|q| ("queue", &q.name)))
        .chain(s.drafters.iter().map(|d| ("drafter", &d.name)));
    let mut named: Vec<_> = named.collect();
    named.sort_by_key(|(_, ident)| ident.span.start);
    for (kind, ident) in named {
        if let Some((first_kind, first)) = seen.iter().find(|(_, i)| i.name == ident.name) {
            errs.push(
                Diagnostic::error(ident.span, format!("duplicate stage name `{}`", ident.name))
                    .label(format!("{kind} named again"))
                    .related(first.span, format!("{first_kind} `{}` defined", first.name))
                    .help("give every target, queue and drafter its own name"),
            );
        }
        seen.push((kind, ident));
    }
}

/// A queue goes from a target to a drafter.
fn check_queue_ends(q: &QueueSection, s: &Sections<'_>, errs: &mut Errs) {
    let kind_of = |name: &str| {
        if s.targets.iter().any(|t| t.name.name == name) {
            Some("target")
        } else if s.drafters.iter().any(|d| d.name.name == name) {
            Some("drafter")
        } else if s.queues.iter().any(|q| q.name.name == name) {
            Some("queue")
        } else {
            None
        }
    };
    let stage_names: Vec<&str> = s
        .targets
        .iter()
        .chain(&s.drafters)
        .map(|t| t.name.name.as_str())
        .collect();
    for (end, wanted, ident) in [("from", "target", &q.from), ("to", "drafter", &q.to)] {
        match kind_of(&ident.name) {
            Some(kind) if kind == wanted => {}
            Some(kind) => errs.push(
                Diagnostic::error(ident.span, format!("queue `{}` {end} `{}`, which is a {kind}", q.name.name, ident.name))
                    .label(format!("expected a {wanted} stage"))
                    .help(format!("a queue goes `from` a target stage `to` a drafter stage; `{end}` must name a {wanted}")),
            ),
            None => errs.push(
                Diagnostic::error(ident.span, format!("queue `{}` {end} `{}`, which names no stage", q.name.name, ident.name))
                    .label("no such stage")
                    .help(suggest::help(&ident.name, "the stages are", &stage_names)),
            ),
        }
    }
}

/// Every bucket fits one item; the source's longest sequence fits the largest bucket.
/// Data-parallel drafters (`sync = allreduce`, several workers) take rounds of one bucket, one batch per
/// worker; a full queue with fewer than that in every bucket holds no round, and producers and drafters would
/// wait on each other forever. The runtime's queue refuses it too (`HsQueue::with_rounds`).
fn check_capacity_holds_a_round(
    q: &stages::QueueParts,
    d: &stages::DrafterParts,
    placement: &Placement,
    errs: &mut Errs,
) {
    let workers = placement.workers.len();
    let (Some(capacity), Some(span), Some((buckets, buckets_span)), Some(SyncMode::AllReduce)) =
        (q.capacity, q.capacity_span, &q.buckets, d.sync)
    else {
        return;
    };
    // Under `fifo` the drafters take no rounds (`Plan::drafters_take_rounds`).
    if q.pull == Some(crate::plan::PullPolicy::Fifo) {
        return;
    }
    let needed = buckets.len() * workers.saturating_sub(1) + 1;
    if workers > 1 && capacity < needed {
        errs.push(
            Diagnostic::error(
                span,
                format!(
                    "`capacity` ({capacity}) cannot always hold a round for {workers} drafters: {} buckets need at \
                     least {needed}",
                    buckets.len()
                ),
            )
            .label("a full queue may hold no round")
            .related(*buckets_span, "buckets set")
            .help(format!(
                "under `sync = allreduce` the drafters take rounds of one bucket, one batch each; with {} in every \
                 bucket the queue is full and holds no round: make `capacity` at least buckets × (drafters − 1) + \
                 1 = {needed}, or use fewer buckets",
                workers - 1
            )),
        );
    }
}

fn check_buckets_against_target(t: &stages::TargetParts, q: &stages::QueueParts, errs: &mut Errs) {
    let Some((buckets, buckets_span)) = &q.buckets else {
        return;
    };
    let Some(&largest) = buckets.last() else {
        return;
    };
    if let Some((batch_tokens, batch_span)) = t.batch_tokens
        && largest > batch_tokens
    {
        errs.push(
            Diagnostic::error(*buckets_span, format!("the largest bucket ({largest}) exceeds `batch_tokens` ({batch_tokens})"))
                .label("does not fit in one queue item")
                .related(batch_span, "`batch_tokens` set")
                .help("a queue item holds `batch_tokens` tokens, so every bucket must hold at least one sequence: raise `batch_tokens` or lower the bucket"),
        );
    }
    if let Some((_, max_len, lengths_span)) = t.lengths
        && max_len - 1 > largest
    {
        errs.push(
            Diagnostic::error(
                lengths_span,
                format!(
                    "sequences up to {} tokens long fit no bucket (largest is {largest})",
                    max_len - 1
                ),
            )
            .label("longer than every bucket")
            .related(*buckets_span, "buckets set")
            .help(format!(
                "add a bucket of at least {} or shorten `lengths` (the end is excluded)",
                max_len - 1
            )),
        );
    }
}

/// Every declared device's memory holds the plan's use of it; the host's (`cpu`) holds the CPU drafters' replicas
/// and the hidden-state pool. Devices that fail the same way (same needs, same capacity) share one error.
fn check_memory(
    (memory, host): (&[DeviceMemory], HostMemory),
    declared: &[(DeclaredDevice, Span)],
    drafter: &StageSection,
    errs: &mut Errs,
) {
    let needs: Vec<(DeviceMemory, u64)> = memory
        .iter()
        .filter(|m| m.device != Device::Cpu)
        .map(|m| (m.clone(), 0))
        .chain(std::iter::once((
            memory
                .iter()
                .find(|m| m.device == Device::Cpu)
                .cloned()
                .unwrap_or(DeviceMemory {
                    device: Device::Cpu,
                    parameters: 0,
                    gradients: 0,
                    optimizer_state: 0,
                    frozen_weights: 0,
                    workspaces: 0,
                }),
            host.total(),
        )))
        .collect();
    // Devices over their declared memory, those that fail the same way (same needs, same capacity) grouped.
    struct Over<'a> {
        need: &'a (DeviceMemory, u64),
        have: &'a DeclaredDevice,
        declared_at: Span,
        names: Vec<String>,
    }
    let mut over: Vec<Over<'_>> = Vec::new();
    for need in &needs {
        let (device_need, host_need) = need;
        let Some((have, declared_at)) = declared
            .iter()
            .find(|(d, _)| d.device == device_need.device)
        else {
            continue;
        };
        if device_need.total() + host_need <= have.memory_bytes {
            continue;
        }
        let same = |group: &&mut Over<'_>| {
            group.have.memory_bytes == have.memory_bytes
                && group.need.1 == *host_need
                && DeviceMemory {
                    device: device_need.device,
                    ..group.need.0.clone()
                } == *device_need
        };
        match over.iter_mut().find(same) {
            Some(group) => group.names.push(device_name(device_need.device)),
            None => over.push(Over {
                need,
                have,
                declared_at: *declared_at,
                names: vec![device_name(device_need.device)],
            }),
        }
    }
    for Over {
        need: (need, host_need),
        have,
        declared_at: decl_span,
        names,
    } in over
    {
        let total = need.total() + host_need;
        let (device, has) = match names.as_slice() {
            [one] => (one.clone(), "which has"),
            many => (format!("each of {}", many.join(", ")), "which have"),
        };
        let parts: Vec<String> = [
            ("parameters", need.parameters),
            ("gradients", need.gradients),
            ("optimizer state", need.optimizer_state),
            ("frozen target weights", need.frozen_weights),
            ("workspaces", need.workspaces),
        ]
        .into_iter()
        .filter(|&(_, bytes)| bytes > 0)
        .map(|(part, bytes)| format!("{part} {}", format_bytes(bytes)))
        .chain((*host_need > 0).then(|| {
            format!(
                "hs pool {} ({} buffers of {})",
                format_bytes(host.hs_pool()),
                host.hs_pool_buffers,
                format_bytes(host.hs_buffer_bytes)
            )
        }))
        .chain((*host_need > 0 && host.stream_receive > 0).then(|| {
            format!(
                "stream receive buffers {}",
                format_bytes(host.stream_receive)
            )
        }))
        .collect();
        errs.push(
            Diagnostic::error(
                drafter.placement.span,
                format!(
                    "drafter `{}` needs {} on {device}, {has} {} (over by {})",
                    drafter.name.name,
                    format_bytes(total),
                    format_bytes(have.memory_bytes),
                    format_bytes(total - have.memory_bytes)
                ),
            )
            .label("does not fit")
            .related(decl_span, format!("{} declared", names.join(", ")))
            .help(format!(
                "needed: {}; shrink the queue capacity, the buckets or the model",
                parts.join(" + ")
            )),
        );
    }
}
