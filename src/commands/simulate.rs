//! `draftpipe simulate FILE.pipe`: predict a plan's throughput and bottleneck with the discrete-event model,
//! and what `--set` what-ifs would change.

use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context as _;
use draftpipe_compiler::{CompileError, compile_file, plan::Device};
use draftpipe_runtime::simulate::{
    Comparison, Model, StepTime, assumed_flops_per_s, parse_what_ifs,
};
use draftpipe_runtime::telemetry::load_summary;

use crate::cli::SimulateArgs;

/// Prints the prediction (or the comparison); exit 1 on an invalid file, what-if or run directory.
pub fn run(args: &SimulateArgs) -> ExitCode {
    let plan = match compile_file(&args.file) {
        Ok(plan) => plan,
        Err(error @ CompileError::Io { .. }) => {
            eprintln!("error: {error}");
            return super::invalid();
        }
        Err(CompileError::Invalid(diagnostics)) => {
            eprintln!("{diagnostics}");
            return super::invalid();
        }
    };
    let what_ifs = match parse_what_ifs(&args.set) {
        Ok(what_ifs) => what_ifs,
        Err(diagnostics) => {
            eprintln!("{diagnostics}");
            return super::invalid();
        }
    };
    let base = match base_model(args, &plan) {
        Ok(model) => model,
        Err(error) => {
            super::report(&error);
            return super::invalid();
        }
    };
    let variants = if args.compare {
        what_ifs.apply_each(&base).map(|each| {
            std::iter::once(("plan".to_string(), base.clone()))
                .chain(each)
                .collect::<Vec<_>>()
        })
    } else if what_ifs.variants.is_empty() {
        Ok(vec![("plan".to_string(), base.clone())])
    } else {
        what_ifs
            .apply_together(&base)
            .map(|model| vec![("what-if".to_string(), model)])
    };
    let variants = match variants {
        Ok(variants) => variants,
        Err(diagnostics) => {
            eprintln!("{diagnostics}");
            return super::invalid();
        }
    };
    if let Some(error) = variants.iter().find_map(|(_, m)| m.validate().err()) {
        super::report(&anyhow::Error::new(error));
        return super::invalid();
    }
    let started = Instant::now();
    let predictions: Vec<_> = variants
        .into_iter()
        .map(|(label, model)| (label, model.predict(args.duration, args.seed)))
        .collect();
    let took = started.elapsed();
    if args.compare {
        for (label, prediction) in &predictions {
            println!("── {label}\n{prediction}\n");
        }
        println!(
            "{}",
            Comparison {
                variants: predictions
            }
        );
    } else if let Some((_, prediction)) = predictions.first() {
        println!("{prediction}");
    }
    println!("(simulated in {:.0} ms)", took.as_secs_f64() * 1e3);
    ExitCode::SUCCESS
}

/// The model before what-ifs: measured from a run, or from the plan with the rates given.
fn base_model(args: &SimulateArgs, plan: &draftpipe_compiler::Plan) -> anyhow::Result<Model> {
    let mut model = match &args.from {
        Some(dir) => {
            let summary = load_summary(dir)
                .with_context(|| format!("cannot read the run in {}", dir.display()))?;
            Model::from_run(plan, &summary, &dir.display().to_string())?
        }
        None => {
            let step = match args.step_time {
                Some(seconds) => StepTime::Fixed { seconds },
                None => StepTime::CostModel {
                    flops_per_s: args.drafter_gflops.map_or_else(
                        || {
                            assumed_flops_per_s(
                                plan.drafter
                                    .placement
                                    .workers
                                    .first()
                                    .copied()
                                    .unwrap_or(Device::Cpu),
                            )
                        },
                        |g| g * 1e9,
                    ),
                },
            };
            Model::from_plan(plan, args.producer_rate, step)?
        }
    };
    if let (Some(rate), Some(_)) = (args.producer_rate, &args.from) {
        anyhow::ensure!(rate > 0.0, "--producer-rate must be positive, found {rate}");
        model.produce_mean_s = 1.0 / rate;
        model.produce_std_s = 0.0;
        model.producer_origin = format!("--producer-rate {rate} items/s per worker (no spread)");
    }
    Ok(model)
}
