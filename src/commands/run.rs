//! `draftpipe run FILE`: compile, run the pipeline, print the summary and the diagnosis.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Context as _;
use draftpipe_compiler::plan::Plan;
use draftpipe_compiler::{CompileError, compile_file};
use draftpipe_runtime::cpu::{GEMM_THREADS_VAR, gemm_threads};
use draftpipe_runtime::pipeline::{RunOptions, StopReason, run as run_pipeline};
use draftpipe_runtime::telemetry::OutputMode;

use crate::cli::RunArgs;

/// Exit code after Ctrl-C (128 + SIGINT), as shells report it.
const EXIT_INTERRUPTED: u8 = 130;

/// With several CPU drafters, gives each its share of the cores for its GEMMs ([`gemm_threads`]) through
/// matrixmultiply's `MATMUL_NUM_THREADS`, unless the user set it. One drafter keeps matrixmultiply's default (the
/// physical cores).
fn share_cores_between_drafters(plan: &Plan) {
    let cpu_drafters = plan.drafter.placement.cpu_workers();
    if cpu_drafters < 2 || std::env::var_os(GEMM_THREADS_VAR).is_some() {
        return;
    }
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    let threads = gemm_threads(cores, cpu_drafters).to_string();
    // SAFETY: this process has started no thread yet (the Ctrl-C handler's comes after this call, the workers
    // later still), so nothing can read or write the environment at the same time.
    unsafe { std::env::set_var(GEMM_THREADS_VAR, threads) };
}

/// Runs the pipeline; exit 0 when it finishes, 1 on an error, 130 after Ctrl-C (the step in hand finishes and
/// the checkpoint is written first).
pub fn run(args: &RunArgs) -> ExitCode {
    let plan = match compile_file(&args.file) {
        Ok(plan) => plan,
        Err(CompileError::Invalid(diagnostics)) => {
            eprintln!("{diagnostics}");
            return super::invalid();
        }
        Err(error) => {
            super::report(&anyhow::Error::new(error));
            return super::invalid();
        }
    };
    share_cores_between_drafters(&plan);
    let interrupt = Arc::new(AtomicBool::new(false));
    let handler_flag = Arc::clone(&interrupt);
    let installed = ctrlc::set_handler(move || {
        if handler_flag.swap(true, Ordering::AcqRel) {
            // A second Ctrl-C means the user will not wait for the step in hand.
            std::process::exit(i32::from(EXIT_INTERRUPTED));
        }
        eprintln!(
            "\ninterrupted: finishing the current step, then saving (Ctrl-C again to quit now)"
        );
    });
    if let Err(error) = installed {
        super::report(&anyhow::Error::new(error).context("cannot install the Ctrl-C handler"));
        return super::invalid();
    }

    let mut options = RunOptions::for_plan(&plan);
    options.steps = args.steps;
    options.save_dir = args.save.clone();
    options.save_every = args.save.as_ref().map(|_| args.save_every);
    options.resume = args.resume.clone();
    options.init = args.init.clone();
    options.output = OutputMode::detect(args.json);
    options.run_dir = Some(
        args.run_dir
            .clone()
            .unwrap_or_else(|| PathBuf::from("runs").join(&plan.name)),
    );
    options.keep_going = args.keep_going;
    options.max_nonfinite_in_row = args.max_nonfinite;
    options.init_seed = args.seed;

    let outcome = run_pipeline(&plan, &options, interrupt, std::io::stdout()).with_context(|| {
        format!(
            "pipeline \"{}\" ({}) stopped",
            plan.name,
            args.file.display()
        )
    });
    let outcome = match outcome {
        Ok(outcome) => outcome,
        Err(error) => {
            super::report(&error);
            return super::invalid();
        }
    };
    for error in &outcome.producer_errors {
        eprintln!("warning: {error} (continued with the other producers: --keep-going)");
    }
    if !args.json {
        println!();
        println!("{}", outcome.diagnosis);
        if let Some(dir) = &options.run_dir {
            println!("run directory: {} (draftpipe diagnose {0})", dir.display());
        }
        if let Some(trace) = &options.trace {
            println!(
                "trace: {} (open in ui.perfetto.dev or chrome://tracing)",
                trace.display()
            );
        }
        if let Some(dir) = &options.save_dir {
            println!("checkpoint: {} (step {})", dir.display(), outcome.step);
        }
    }
    match outcome.stop {
        StopReason::Interrupted => ExitCode::from(EXIT_INTERRUPTED),
        StopReason::StepLimit | StopReason::SourcesExhausted => ExitCode::SUCCESS,
    }
}
