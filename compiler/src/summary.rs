//! A readable summary of a [`Plan`]: what `draftpipe compile --emit text` prints.

use std::fmt::{self, Write as _};

use crate::check::device_name;
use crate::cost::format_bytes;
use crate::cost::gpu::gpu_step_model;
use crate::plan::{
    Device, LaunchMode, Placement, Plan, PullPolicy, ScheduleKind, SourceSpec, SyncMode,
};

/// Displays a plan as a summary: stages, devices, queue, model size, memory per device, cost per bucket.
///
/// # Examples
///
/// ```no_run
/// # fn show(plan: &draftpipe_compiler::Plan) {
/// println!("{}", draftpipe_compiler::summary::Summary(plan));
/// # }
/// ```
pub struct Summary<'a>(pub &'a Plan);

impl fmt::Display for Summary<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let plan = self.0;
        let (t, q, d, m) = (&plan.target, &plan.queue, &plan.drafter, &plan.model);
        writeln!(f, "pipeline \"{}\"", plan.name)?;
        let source = match &t.source {
            SourceSpec::Synthetic {
                seed,
                min_len,
                max_len,
            } => {
                format!("synthetic (seed {seed}, lengths {min_len}..{max_len})")
            }
            SourceSpec::Safetensors {
                pattern,
                epochs,
                shuffle_seed,
            } => {
                let order = match shuffle_seed {
                    Some(seed) => format!("shuffled per epoch, seed {seed}"),
                    None => "file order".to_string(),
                };
                format!(
                    "safetensors `{pattern}` ({epochs} epoch{}, {order})",
                    if *epochs == 1 { "" } else { "s" }
                )
            }
            SourceSpec::Stream {
                listen,
                token_env,
                max_message_bytes,
                ..
            } => format!(
                "stream on `{listen}` ({}, messages up to {:.1} MiB)",
                token_env
                    .as_ref()
                    .map_or("no token".to_string(), |v| format!("token from ${v}")),
                *max_message_bytes as f64 / (1u64 << 20) as f64
            ),
        };
        let source = match t.max_rate {
            Some(rate) => format!("{source}, at most {rate} items/s per worker"),
            None => source,
        };
        let source = match t.hs_dtype {
            Some(dtype) => format!("{source}, hidden states in {}", dtype.name()),
            None => format!(
                "{source}, hidden states in the files' dtype (memory counted at f32, an upper bound)"
            ),
        };
        writeln!(f, "\nstages")?;
        writeln!(
            f,
            "  target  {:<12} on {:<16} hidden {} × {} taps = {} per token, vocab {}, {} tokens per item, {source}",
            t.name,
            placement(&t.placement),
            t.hidden,
            t.tap_layers.len(),
            t.hs_width(),
            t.vocab,
            t.batch_tokens
        )?;
        let steps = d
            .steps
            .map_or("no step limit".to_owned(), |s| format!("{s} steps"));
        // `launch` means nothing to a CPU drafter (the compiler refuses it there), so only GPU drafters show it.
        let on_gpu = d.placement.cpu_workers() < d.placement.workers.len();
        let launch = match (on_gpu, d.launch) {
            (false, _) => "",
            (true, LaunchMode::Graph) => ", launch graph",
            (true, LaunchMode::Eager) => ", launch eager",
        };
        writeln!(
            f,
            "  drafter {:<12} on {:<16} sync {}{launch}, precision {}, {steps}",
            d.name,
            placement(&d.placement),
            match d.sync {
                SyncMode::AllReduce => "allreduce",
                SyncMode::None => "none",
            },
            d.precision.name(),
        )?;
        writeln!(
            f,
            "\nqueue {} ({} → {}): capacity {}, min_ready {}, pull {}, buckets {:?}",
            q.name,
            q.from,
            q.to,
            q.capacity,
            q.min_ready,
            match q.pull {
                PullPolicy::RandomInBucket => "random_in_bucket",
                PullPolicy::RoundRobin => "round_robin",
                PullPolicy::Fifo => "fifo",
            },
            q.buckets
        )?;
        let parameters = format!(
            "{} parameters ({})",
            group_digits(m.parameters as u64),
            format_bytes(m.parameters as u64 * 4)
        );
        let family = m.spec.family();
        writeln!(
            f,
            "\nmodel {}: {}",
            family.name(),
            family.summary(&parameters, t.weights.as_ref())
        )?;
        let decay = family.loss_summary(&d.loss);
        if m.spec.takes_vocab_map() {
            match &d.vocab_map {
                Some(path) => writeln!(f, "  draft vocabulary map (d2t, t2d) from `{path}`")?,
                None => writeln!(
                    f,
                    "  draft vocabulary map (d2t, t2d) counted from the source's data before training"
                )?,
            }
        }
        let o = &d.optimizer;
        let clip = o
            .clip_grad_norm
            .map_or("none".to_owned(), |c| c.to_string());
        let schedule = match o.schedule.kind {
            ScheduleKind::Constant if o.schedule.warmup_steps == 0 => String::new(),
            kind => format!(
                ", schedule {}(warmup {} steps)",
                kind.name(),
                o.schedule.warmup_steps
            ),
        };
        writeln!(
            f,
            "  loss cross_entropy({decay}, chunk_tokens {}); adamw(lr {:e}, betas ({}, {}), eps {:e}, \
             weight_decay {}, clip_grad_norm {clip}){schedule}",
            d.loss.chunk_tokens, o.lr, o.beta1, o.beta2, o.eps, o.weight_decay
        )?;
        write_tensor_table(f, plan)?;
        // Only a model that reads the target's frozen weights has the column.
        let frozen = plan.memory.iter().any(|m| m.frozen_weights > 0);
        let frozen_cell = |text: String| {
            if frozen {
                format!(" {text:>11}")
            } else {
                String::new()
            }
        };
        writeln!(f, "\nmemory per device")?;
        writeln!(
            f,
            "  {:<8} {:>11} {:>11} {:>11}{} {:>11} {:>11} {:>11}",
            "device",
            "parameters",
            "gradients",
            "optimizer",
            frozen_cell("frozen".to_owned()),
            "workspaces",
            "total",
            "declared"
        )?;
        for mem in &plan.memory {
            let declared = plan
                .devices
                .iter()
                .find(|dd| dd.device == mem.device)
                .map_or("-".to_owned(), |dd| format_bytes(dd.memory_bytes));
            writeln!(
                f,
                "  {:<8} {:>11} {:>11} {:>11}{} {:>11} {:>11} {:>11}",
                device_name(mem.device),
                format_bytes(mem.parameters),
                format_bytes(mem.gradients),
                format_bytes(mem.optimizer_state),
                frozen_cell(format_bytes(mem.frozen_weights)),
                format_bytes(mem.workspaces),
                format_bytes(mem.total()),
                declared
            )?;
        }
        let host = plan.host_memory;
        writeln!(
            f,
            "host: hs pool {} ({} buffers of {}: queue capacity {}, 2 per drafter, 1 per producer)",
            format_bytes(host.hs_pool()),
            host.hs_pool_buffers,
            format_bytes(host.hs_buffer_bytes),
            plan.queue.capacity
        )?;
        if host.stream_receive > 0 {
            writeln!(
                f,
                "host: stream receive buffers up to {} (max_message × {} producers)",
                format_bytes(host.stream_receive),
                plan.target.placement.workers.len()
            )?;
        }
        writeln!(f, "\ncost per step")?;
        writeln!(
            f,
            "  {:>8} {:>9} {:>8} {:>12} {:>12}",
            "bucket", "sequences", "tokens", "GFLOP", "GB moved"
        )?;
        for b in &plan.buckets {
            writeln!(
                f,
                "  {:>8} {:>9} {:>8} {:>12.1} {:>12.2}",
                b.padded_len,
                b.sequences,
                b.tokens,
                b.step_flops as f64 / 1e9,
                b.step_bytes as f64 / 1e9
            )?;
        }
        // GPU drafters: the modelled step per bucket and the MFU (cost/gpu); a family without a kernel list says so.
        if plan.drafter.placement.cpu_workers() < plan.drafter.placement.workers.len() {
            match gpu_step_model(plan) {
                Some(model) => writeln!(f, "\n{model}")?,
                None => writeln!(
                    f,
                    "\nGPU step model: none for the {} family yet",
                    plan.model.spec.kind()
                )?,
            }
        }
        let phases: Vec<String> = plan.schedule.iter().map(|p| format!("{p:?}")).collect();
        writeln!(f, "\nstep schedule: {}", phases.join(" → "))?;
        let trace = plan
            .telemetry
            .trace
            .as_deref()
            .map_or(String::new(), |t| format!(", trace to {t}"));
        write!(f, "telemetry: every {} ms{trace}", plan.telemetry.every_ms)?;
        if let Some(a) = &plan.acceptance {
            write!(
                f,
                "\nacceptance: every {} steps, the draft-and-verify loop against {} on {} ({} new tokens \
                 per prompt, at most {} s per check)",
                a.every,
                a.target,
                a.prompts,
                a.max_new_tokens,
                a.timeout_ms as f64 / 1e3
            )?;
        }
        Ok(())
    }
}

/// Tensors that differ only in a layer, block or head index, with their shape and how many there are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorGroup {
    /// The name with the index written `{i}`, e.g. `layers.{i}.mlp.up_proj.weight`.
    pub name: String,
    /// Shape of each.
    pub shape: Vec<usize>,
    /// How many tensors (1 for an unrepeated one).
    pub count: usize,
}

/// Groups `layout` by name with indices replaced by `{i}` (and shape), in order of first appearance.
///
/// # Examples
/// ```
/// use draftpipe_compiler::plan::{MlpSpec, ModelPlan};
/// use draftpipe_compiler::summary::tensor_groups;
///
/// let model = ModelPlan::new(MlpSpec { din: 8, hidden: 4, blocks: 3, intermediate: 6, heads: 2, vocab: 10 });
/// let groups = tensor_groups(&model.layout);
/// assert_eq!(groups[1].name, "blocks.{i}.norm.weight");
/// assert_eq!(groups[1].count, 3);
/// ```
pub fn tensor_groups(layout: &[crate::plan::TensorView]) -> Vec<TensorGroup> {
    let mut groups: Vec<TensorGroup> = Vec::new();
    for view in layout {
        let name = view
            .name
            .split('.')
            .map(|part| {
                if !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()) {
                    "{i}"
                } else {
                    part
                }
            })
            .collect::<Vec<_>>()
            .join(".");
        match groups
            .iter_mut()
            .find(|g| g.name == name && g.shape == view.shape)
        {
            Some(group) => group.count += 1,
            None => groups.push(TensorGroup {
                name,
                shape: view.shape.clone(),
                count: 1,
            }),
        }
    }
    groups
}

/// The trained parameters by tensor: name, shape, elements, and for repeated tensors (per layer, block or head)
/// the repeat count and the total.
fn write_tensor_table(f: &mut fmt::Formatter<'_>, plan: &Plan) -> fmt::Result {
    let groups = tensor_groups(&plan.model.layout);
    let shapes: Vec<String> = groups.iter().map(|g| format!("{:?}", g.shape)).collect();
    let name_width = groups.iter().map(|g| g.name.len()).max().unwrap_or(0);
    let shape_width = shapes.iter().map(String::len).max().unwrap_or(0);
    writeln!(f, "\nparameters by tensor")?;
    writeln!(
        f,
        "  {:<name_width$}  {:<shape_width$}  {:>13}  {:>5}  {:>15}",
        "tensor", "shape", "each", "×", "parameters"
    )?;
    for (group, shape) in groups.iter().zip(&shapes) {
        let each: usize = group.shape.iter().product();
        writeln!(
            f,
            "  {:<name_width$}  {shape:<shape_width$}  {:>13}  {:>5}  {:>15}",
            group.name,
            group_digits(each as u64),
            group.count,
            group_digits((each * group.count) as u64)
        )?;
    }
    writeln!(
        f,
        "  {:<name_width$}  {:<shape_width$}  {:>13}  {:>5}  {:>15}",
        "total",
        "",
        "",
        "",
        group_digits(plan.model.parameters as u64)
    )
}

/// `cpu x2`, `gpu 5..8`, `gpu [0, 2]`.
fn placement(p: &Placement) -> String {
    let gpus: Vec<u32> = p
        .workers
        .iter()
        .filter_map(|d| {
            if let Device::Gpu(g) = d {
                Some(*g)
            } else {
                None
            }
        })
        .collect();
    if gpus.is_empty() {
        return match p.workers.len() {
            1 => "cpu".to_owned(),
            n => format!("cpu x{n}"),
        };
    }
    // u64: ordinals may be as large as u32::MAX, and the range's end is one past the last.
    let contiguous = gpus
        .windows(2)
        .all(|w| u64::from(w[1]) == u64::from(w[0]) + 1);
    match (gpus.len(), contiguous) {
        (1, _) => format!("gpu {}", gpus[0]),
        (n, true) => format!("gpu {}..{}", gpus[0], u64::from(gpus[0]) + n as u64),
        _ => {
            let mut s = String::from("gpu [");
            for (i, g) in gpus.iter().enumerate() {
                let _ = write!(s, "{}{g}", if i == 0 { "" } else { ", " });
            }
            s + "]"
        }
    }
}

/// `189,530,112`.
fn group_digits(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}
