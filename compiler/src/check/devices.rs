//! Devices: the `devices` declarations, stage placements, and the rules between them (no GPU in two stages,
//! no GPU outside the declared ones).

use crate::ast::{DevicesSection, PlacementExpr, Value, ValueKind};
use crate::check::values;
use crate::diagnostic::Diagnostic;
use crate::plan::{Device, Placement};
use crate::span::Span;

type Errs = Vec<Diagnostic>;

/// More workers or devices than this in one stage or declaration is certainly a typo (and would allocate a
/// huge worker list).
pub const MAX_DEVICES: usize = 1024;

/// A declared device, its memory (`None` when the declaration's memory has errors) and the declaration.
pub(crate) struct Declared {
    pub device: Device,
    pub memory_bytes: Option<u64>,
    pub span: Span,
}

pub(crate) fn check_devices(section: &DevicesSection, errs: &mut Errs) -> Vec<Declared> {
    let mut declared: Vec<Declared> = Vec::new();
    for decl in &section.decls {
        let mut f = crate::check::fields::Fields::new(
            &decl.block.entries,
            format!("`{}` declaration", decl.class.name),
            decl.class
                .span
                .join(decl.ids.as_ref().map_or(decl.class.span, |v| v.span)),
            errs,
        );
        let memory = f
            .required("memory", "80GiB")
            .and_then(|v| values::size_bytes(errs, "memory", v));
        f.finish(errs);
        let devices = match (decl.class.name.as_str(), &decl.ids) {
            ("cpu", None) => Some(vec![Device::Cpu]),
            ("cpu", Some(ids)) => {
                errs.push(cpu_with_ids(ids.span));
                None
            }
            (_, None) => {
                errs.push(gpu_without_ids(decl.class.span));
                None
            }
            (_, Some(ids)) => {
                gpu_ids(errs, ids).map(|ids| ids.into_iter().map(Device::Gpu).collect())
            }
        };
        // Devices stay declared even when their memory has errors, so their use is not reported as well.
        let Some(devices) = devices else { continue };
        for device in devices {
            if let Some(first) = declared.iter().find(|d| d.device == device) {
                errs.push(
                    Diagnostic::error(
                        decl.span,
                        format!("{} is declared twice", device_name(device)),
                    )
                    .label("declared again")
                    .related(first.span, "first declared")
                    .help("declare each device once"),
                );
                continue;
            }
            declared.push(Declared {
                device,
                memory_bytes: memory,
                span: decl.span,
            });
        }
    }
    declared
}

/// `cpu`, `cpu xN`, `gpu N`, `gpu A..B` or `gpu [..]` to a worker list.
pub(crate) fn check_placement(p: &PlacementExpr, errs: &mut Errs) -> Option<Placement> {
    match p.class.name.as_str() {
        "cpu" => {
            if let Some(ids) = &p.ids {
                errs.push(cpu_with_ids(ids.span));
                return None;
            }
            let workers = match p.workers {
                None => 1,
                Some((None, _)) => return None,
                Some((Some(n), span)) => {
                    if n == 0 || n as usize > MAX_DEVICES {
                        errs.push(
                            Diagnostic::error(
                                span,
                                format!("worker count must lie in 1..={MAX_DEVICES}, found {n}"),
                            )
                            .label("out of range")
                            .help("write `cpu` for one worker or `cpu xN` for N workers"),
                        );
                        return None;
                    }
                    n as usize
                }
            };
            Some(Placement {
                workers: vec![Device::Cpu; workers],
            })
        }
        _ => {
            if let Some((_, span)) = p.workers {
                errs.push(
                    Diagnostic::error(
                        span,
                        "a GPU stage runs one worker per GPU, not `xN` workers",
                    )
                    .label("not for `gpu`")
                    .help("list the GPUs instead, e.g. `gpu 0..2` for two workers"),
                );
                return None;
            }
            let Some(ids) = &p.ids else {
                errs.push(gpu_without_ids(p.class.span));
                return None;
            };
            gpu_ids(errs, ids).map(|ids| Placement {
                workers: ids.into_iter().map(Device::Gpu).collect(),
            })
        }
    }
}

/// GPU ordinals from `N`, `A..B` or `[a, b, ...]`: non-empty, distinct, at most [`MAX_DEVICES`].
fn gpu_ids(errs: &mut Errs, value: &Value) -> Option<Vec<u32>> {
    let ordinal = |errs: &mut Errs, v: &Value| {
        values::count(errs, "gpu", v, 0).and_then(|n| match u32::try_from(n) {
            Ok(id) => Some(id),
            Err(_) => {
                values::out_of_range(
                    errs,
                    "gpu",
                    v,
                    "ordinals must fit in 32 bits",
                    n,
                    "GPU ordinals count from 0",
                );
                None
            }
        })
    };
    let ids: Vec<u32> = match &value.kind {
        ValueKind::Range(start, end) => {
            let (a, b) = (ordinal(errs, start), ordinal(errs, end));
            let (a, b) = (a?, b?);
            if b <= a {
                errs.push(
                    Diagnostic::error(value.span, format!("empty device range {a}..{b}"))
                        .label("no devices")
                        .help("ranges are half-open: `gpu 0..2` is GPUs 0 and 1"),
                );
                return None;
            }
            if (b - a) as usize > MAX_DEVICES {
                let rule = format!("ranges hold at most {MAX_DEVICES} devices");
                values::out_of_range(errs, "gpu", value, &rule, b - a, "use a shorter range");
                return None;
            }
            (a..b).collect()
        }
        ValueKind::List(items) => {
            let ids: Vec<Option<u32>> = items.iter().map(|v| ordinal(errs, v)).collect();
            let ids: Vec<u32> = ids.into_iter().collect::<Option<_>>()?;
            if ids.is_empty() || ids.len() > MAX_DEVICES {
                let rule = format!("lists hold 1..={MAX_DEVICES} devices");
                values::out_of_range(
                    errs,
                    "gpu",
                    value,
                    &rule,
                    ids.len(),
                    "list at least one GPU",
                );
                return None;
            }
            for (i, id) in ids.iter().enumerate() {
                if ids[..i].contains(id) {
                    errs.push(
                        Diagnostic::error(items[i].span, format!("gpu {id} is listed twice"))
                            .label("repeated")
                            .help("list each GPU once"),
                    );
                    return None;
                }
            }
            ids
        }
        _ => vec![ordinal(errs, value)?],
    };
    Some(ids)
}

/// No GPU in both stages; every GPU declared when a `devices` section exists.
pub(crate) fn check_device_use(
    stages: &[(&str, &str, &Placement, Span)],
    declared: Option<&[Declared]>,
    errs: &mut Errs,
) {
    for (i, (kind, name, placement, span)) in stages.iter().enumerate() {
        for (other_kind, other_name, other, other_span) in &stages[..i] {
            let shared: Vec<u32> = gpus(placement)
                .filter(|g| gpus(other).any(|o| o == *g))
                .collect();
            if !shared.is_empty() {
                errs.push(
                    Diagnostic::error(
                        *span,
                        format!(
                            "{} {} used by both {other_kind} `{other_name}` and {kind} `{name}`",
                            gpu_list(&shared),
                            verb(&shared)
                        ),
                    )
                    .label("already in use")
                    .related(*other_span, format!("{other_kind} `{other_name}` placed"))
                    .help("give each stage its own GPUs"),
                );
            }
        }
        let Some(declared) = declared else { continue };
        let missing: Vec<u32> = gpus(placement)
            .filter(|g| !declared.iter().any(|d| d.device == Device::Gpu(*g)))
            .collect();
        if !missing.is_empty() {
            let known: Vec<u32> = declared
                .iter()
                .filter_map(|d| {
                    if let Device::Gpu(g) = d.device {
                        Some(g)
                    } else {
                        None
                    }
                })
                .collect();
            let known = if known.is_empty() {
                "no GPUs are declared".to_owned()
            } else {
                format!("declared: {}", gpu_list(&known))
            };
            errs.push(
                Diagnostic::error(
                    *span,
                    format!(
                        "{kind} `{name}` uses {} that {} not declared",
                        gpu_list(&missing),
                        verb(&missing)
                    ),
                )
                .label("outside the declared devices")
                .help(format!(
                    "{known}; declare the GPU or place the stage on declared ones"
                )),
            );
        }
    }
}

fn gpus(placement: &Placement) -> impl Iterator<Item = u32> + '_ {
    placement.workers.iter().filter_map(|d| {
        if let Device::Gpu(g) = d {
            Some(*g)
        } else {
            None
        }
    })
}

/// "gpu 5" or "gpus 5, 6, 7".
fn gpu_list(ids: &[u32]) -> String {
    let list: Vec<String> = ids.iter().map(u32::to_string).collect();
    match ids.len() {
        1 => format!("gpu {}", list[0]),
        _ => format!("gpus {}", list.join(", ")),
    }
}

fn verb(ids: &[u32]) -> &'static str {
    if ids.len() == 1 { "is" } else { "are" }
}

/// `cpu` or `gpu N`.
pub fn device_name(device: Device) -> String {
    match device {
        Device::Cpu => "cpu".to_owned(),
        Device::Gpu(g) => format!("gpu {g}"),
    }
}

fn cpu_with_ids(span: Span) -> Diagnostic {
    Diagnostic::error(span, "`cpu` takes no device numbers")
        .label("not for `cpu`")
        .help("write `cpu` for one worker or `cpu x4` for four")
}

fn gpu_without_ids(span: Span) -> Diagnostic {
    Diagnostic::error(span, "`gpu` needs device numbers")
        .label("which GPUs?")
        .help("write e.g. `gpu 0`, `gpu 0..4` or `gpu [0, 2]`")
}
