//! `draftpipe simulate FILE.pipe`: predict a plan's throughput and bottleneck with the discrete-event model,
//! and what `--set` what-ifs would change.

use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context as _;
use draftpipe_compiler::cost::gpu::gpu_step_model;
use draftpipe_compiler::{Plan, compile_file, plan::Device};
use draftpipe_runtime::figures::amount;
use draftpipe_runtime::simulate::{
    Comparison, Model, StepTime, assumed_flops_per_s, parse_what_ifs,
};
use draftpipe_runtime::telemetry::{SUMMARY_FILE, load_summary, validate_summary};

use super::input::{MAX_SUMMARY_BYTES, require_regular_file};
use super::{CommandResult, compile_failure, say};
use crate::cli::SimulateArgs;

/// The longest simulated time: a week, a thousand times the prediction's default hour would be hours of
/// wall time at the event rates of a busy plan; NaN or an infinity would never end.
const MAX_DURATION_S: f64 = 7.0 * 24.0 * 3600.0;

/// Prints the prediction (or the comparison); an error for an invalid file, what-if or run directory.
pub fn run(args: &SimulateArgs) -> CommandResult {
    anyhow::ensure!(
        args.duration.is_finite() && args.duration > 0.0 && args.duration <= MAX_DURATION_S,
        "--duration must be a number of simulated seconds above 0 and at most {MAX_DURATION_S}, found {}",
        amount(args.duration)
    );
    let plan = compile_file(&args.file).map_err(compile_failure)?;
    let what_ifs = parse_what_ifs(&args.set)?;
    let base = base_model(args, &plan)?;
    let variants = if args.compare {
        std::iter::once(("plan".to_string(), base.clone()))
            .chain(what_ifs.apply_each(&base)?)
            .collect::<Vec<_>>()
    } else if what_ifs.variants.is_empty() {
        vec![("plan".to_string(), base)]
    } else {
        vec![("what-if".to_string(), what_ifs.apply_together(&base)?)]
    };
    for (_, model) in &variants {
        model.validate()?;
    }
    let started = Instant::now();
    let predictions: Vec<_> = variants
        .into_iter()
        .map(|(label, model)| Ok((label, model.predict(args.duration, args.seed)?)))
        .collect::<anyhow::Result<_>>()?;
    let took = started.elapsed();
    if args.compare {
        for (label, prediction) in &predictions {
            say(format_args!("── {label}\n{prediction}\n"))?;
        }
        say(Comparison {
            variants: predictions,
        })?;
    } else if let Some((_, prediction)) = predictions.first() {
        say(prediction)?;
    }
    say(format_args!(
        "(simulated in {:.0} ms)",
        took.as_secs_f64() * 1e3
    ))?;
    Ok(ExitCode::SUCCESS)
}

/// The model before what-ifs: measured from a run, or from the plan with the rates given.
fn base_model(args: &SimulateArgs, plan: &Plan) -> anyhow::Result<Model> {
    if let Some(rate) = args.producer_rate {
        anyhow::ensure!(
            rate > 0.0,
            "--producer-rate must be a positive number of items per second, found {}",
            amount(rate)
        );
    }
    let mut model = match &args.from {
        Some(dir) => {
            let context = || format!("cannot read the run in {}", dir.display());
            let path = dir.join(SUMMARY_FILE);
            require_regular_file(&path, "the run summary", MAX_SUMMARY_BYTES)
                .with_context(context)?;
            let summary = load_summary(dir).with_context(context)?;
            validate_summary(&summary)
                .with_context(|| format!("{} holds values no run writes", path.display()))
                .with_context(context)?;
            Model::from_run(plan, &summary, &dir.display().to_string())?
        }
        None => {
            let step = match args.step_time {
                Some(seconds) => {
                    anyhow::ensure!(
                        seconds.is_finite() && seconds >= 0.0,
                        "--step-time must be a duration in seconds, found {}",
                        amount(seconds)
                    );
                    StepTime::Fixed { seconds }
                }
                None => {
                    let device = plan
                        .drafter
                        .placement
                        .workers
                        .first()
                        .copied()
                        .unwrap_or(Device::Cpu);
                    match args.drafter_gflops {
                        Some(gflops) => {
                            anyhow::ensure!(
                                gflops.is_finite() && gflops > 0.0,
                                "--drafter-gflops must be positive, found {}",
                                amount(gflops)
                            );
                            StepTime::CostModel {
                                flops_per_s: gflops * 1e9,
                            }
                        }
                        // GPU drafters: the compiler's GPU time model, when their family has one.
                        None if gpu_step_model(plan).is_some() => StepTime::GpuModel,
                        None => StepTime::CostModel {
                            flops_per_s: assumed_flops_per_s(device),
                        },
                    }
                }
            };
            Model::from_plan(plan, args.producer_rate, step)?
        }
    };
    if let (Some(rate), Some(_)) = (args.producer_rate, &args.from) {
        model.produce_mean_s = 1.0 / rate;
        model.produce_std_s = 0.0;
        model.producer_origin = format!(
            "--producer-rate {} items/s per worker (no spread)",
            amount(rate)
        );
    }
    Ok(model)
}
