//! `draftpipe run FILE`: compile, run the pipeline, print the summary and the diagnosis.

use std::path::PathBuf;
use std::process::ExitCode;

use draftpipe_compiler::compile_file;
use draftpipe_compiler::plan::Plan;
use draftpipe_runtime::acceptance::ACCEPTANCE_DIR;
use draftpipe_runtime::backend::cpu::{GEMM_THREADS_VAR, gemm_threads};
use draftpipe_runtime::checkpoint::CONFIG_FILE;
use draftpipe_runtime::export_check::{CheckOptions, check_export};
use draftpipe_runtime::model::registry;
use draftpipe_runtime::pipeline::{RunError, RunOptions, StopReason, run as run_pipeline};
use draftpipe_runtime::telemetry::{EndReason, OutputMode};

use super::{CommandResult, StdoutClosed, compile_failure, say, signals};
use crate::cli::RunArgs;

/// Exit code when the data ran out before the step limit (or, with no limit, before a first step): the run trained
/// on all it could and saved, but did not do what was asked.
pub const EXIT_DATA_EXHAUSTED_EARLY: u8 = 3;

/// With several CPU drafters, gives each its share of the cores ([`gemm_threads`]) through `MATMUL_NUM_THREADS`,
/// which each drafter's pool reads, unless the user set it. One drafter takes every core.
fn share_cores_between_drafters(plan: &Plan) {
    let cpu_drafters = plan.drafter.placement.cpu_workers();
    if cpu_drafters < 2 || std::env::var_os(GEMM_THREADS_VAR).is_some() {
        return;
    }
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    let threads = gemm_threads(cores, cpu_drafters).to_string();
    // SAFETY: this process has started no thread yet (the signal thread comes after this call, the workers
    // later still), so nothing can read or write the environment at the same time.
    unsafe { std::env::set_var(GEMM_THREADS_VAR, threads) };
}

/// Runs the pipeline; exit 0 when it finishes, 3 when the data ran out before the step limit, 128 + N after
/// signal N (the step in hand finishes and the checkpoint is written first); an error otherwise.
pub fn run(args: &RunArgs) -> CommandResult {
    let plan = compile_file(&args.file).map_err(compile_failure)?;
    share_cores_between_drafters(&plan);
    let interrupts = signals::install()?;

    let mut options = RunOptions::for_plan(&plan);
    options.steps = args.steps;
    options.save_dir = args.save.clone();
    options.save_every = args.save.as_ref().map(|_| args.save_every);
    options.save_dtype = args.save_dtype.into();
    options.resume = args.resume.clone();
    options.init = args.init.clone();
    options.output = OutputMode::detect(args.json);
    options.run_dir = Some(
        args.run_dir
            .clone()
            .unwrap_or_else(|| PathBuf::from("runs").join(&plan.name)),
    );
    if let Some(dir) = &args.tensorboard {
        options.tensorboard = Some(dir.clone());
    }
    options.keep_going = args.keep_going;
    options.max_nonfinite_in_row = args.max_nonfinite;
    options.init_seed = args.seed;
    options.force_outputs = args.force;
    options.inputs = vec![args.file.clone()];

    let outcome = run_pipeline(
        &plan,
        &options,
        std::sync::Arc::clone(&interrupts.flag),
        std::io::stdout(),
    )
    .map_err(|error| {
        // A run refused before it trained is not one that stopped: nothing ran, and nothing was left behind.
        let ended = if matches!(error, RunError::NotStarted(_)) {
            "did not start"
        } else {
            "stopped"
        };
        anyhow::Error::new(error).context(format!(
            "pipeline \"{}\" ({}) {ended}",
            plan.name,
            args.file.display()
        ))
    })?;
    for error in &outcome.producer_errors {
        draftpipe_runtime::log_line!(
            "warning: {error} (continued with the other producers: --keep-going)"
        );
    }
    let ended_early = outcome
        .summary
        .ending
        .as_ref()
        .is_some_and(|e| e.reason == EndReason::DataExhaustedEarly);
    // The run's own exit status matters more than the report: a reader that went away only shortens it.
    match report(&plan, args, &options, &outcome) {
        Err(error) if !error.is::<StdoutClosed>() => return Err(error),
        _ => {}
    }
    if ended_early {
        let before = if outcome.summary.steps == 0 {
            "before this run's first step"
        } else {
            "before the step limit"
        };
        draftpipe_runtime::log_line!(
            "warning: the data ran out at step {} {before} (exit status {EXIT_DATA_EXHAUSTED_EARLY})",
            outcome.step
        );
    }
    Ok(match outcome.stop {
        StopReason::Interrupted => ExitCode::from(interrupts.exit_code()),
        _ if ended_early => ExitCode::from(EXIT_DATA_EXHAUSTED_EARLY),
        StopReason::StepLimit | StopReason::SourcesExhausted => ExitCode::SUCCESS,
    })
}

/// The diagnosis and where the run's files are, after a run without `--json`.
fn report(
    plan: &Plan,
    args: &RunArgs,
    options: &RunOptions,
    outcome: &draftpipe_runtime::pipeline::RunOutcome,
) -> anyhow::Result<()> {
    if args.json {
        return Ok(());
    }
    say("")?;
    say(&outcome.diagnosis)?;
    if let Some(dir) = &options.run_dir {
        say(format_args!(
            "run directory: {} (draftpipe diagnose {0})",
            dir.display()
        ))?;
    }
    if let (Some(record), Some(dir)) = (&outcome.summary.acceptance, &options.run_dir) {
        let newest = record.measurements.last().map_or_else(
            || "no figures".to_owned(),
            |m| {
                let exact = m.teacher_forced_tau_exact.map_or(String::new(), |tf| {
                    format!(", teacher-forced {tf:.3} exact")
                });
                let forced = m.teacher_forced_tau_simulated.map_or(exact.clone(), |tf| {
                    format!("{exact}, teacher-forced {tf:.3} simulated")
                });
                format!("newest τ {:.3} at step {}{forced}", m.tau, m.step)
            },
        );
        say(format_args!(
            "acceptance: {} checks ({newest}), {} skipped while one ran, {} failed: {}",
            record.measurements.len(),
            record.skipped_busy.len(),
            record.failures.len(),
            dir.join(ACCEPTANCE_DIR).display()
        ))?;
    }
    if let Some(trace) = &options.trace {
        say(format_args!(
            "trace: {} (open in ui.perfetto.dev or chrome://tracing)",
            trace.display()
        ))?;
    }
    if let Some(dir) = &options.save_dir {
        if outcome.summary.steps == 0 {
            // Nothing was trained, so nothing was saved: a checkpoint there is an older run's, if any.
            say(format_args!(
                "checkpoint: none written to {} (no step was trained)",
                dir.display()
            ))?;
            return Ok(());
        }
        say(format_args!(
            "checkpoint: {} (step {})",
            dir.display(),
            outcome.step
        ))?;
        // An export with a serving config (`dflash`) is what people serve: say at once whether the engines
        // would load it.
        let served = registry::spec(&plan.model.spec).architecture().is_some();
        if served && dir.join(CONFIG_FILE).is_file() {
            let report = check_export(dir, &CheckOptions::default())?;
            say(format_args!("{}", report.to_string().trim_end()))?;
        }
    }
    Ok(())
}
