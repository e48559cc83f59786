//! `draftpipe eval CHECKPOINT --pipeline FILE --data "…safetensors"`: a trained drafter's loss, per-slot
//! accuracy and acceptance length `τ` on held-out data, with a progress bar on a terminal.

use std::io::{IsTerminal as _, Write as _};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context as _;
use draftpipe_compiler::compile_file;
use draftpipe_runtime::backend::cpu::HostThreads;
use draftpipe_runtime::eval::{
    EvalProgress, EvalTotals, eval_plan, evaluate_dataset, forward_only_model, frozen_tables,
    load_eval_weights, open_eval_data,
};
use draftpipe_runtime::telemetry::{BAR_WIDTH, progress_bar};
use draftpipe_runtime::tensor_file::TensorFile;

use super::{CommandResult, compile_failure, say};
use crate::cli::EvalArgs;

/// Prints the metrics; an error when the pipeline, the checkpoint or the data cannot be read or do not fit.
pub fn run(args: &EvalArgs) -> CommandResult {
    let plan = compile_file(&args.pipeline).map_err(compile_failure)?;
    let params = load_eval_weights(&plan, &args.checkpoint).with_context(|| {
        format!(
            "cannot evaluate {} with pipeline \"{}\"",
            args.checkpoint.display(),
            plan.name
        )
    })?;
    if let Some(trained_by) = trained_by_another_plan(&args.checkpoint, &plan.name) {
        draftpipe_runtime::log_line!(
            "warning: {} was trained by pipeline \"{trained_by}\", not \"{}\" ({}): its shapes fit, but the \
             target, the taps or the mask token the figures below assume may not be the ones it learned",
            args.checkpoint.display(),
            plan.name,
            args.pipeline.display()
        );
    }
    let frozen = frozen_tables(&plan).context("cannot load the target's embedding and lm_head")?;
    let read_data = || format!("cannot read the evaluation data `{}`", args.data);
    let plan = eval_plan(&plan, &args.data).with_context(read_data)?;
    let data = open_eval_data(&plan).with_context(read_data)?;
    let mut model =
        forward_only_model(&plan, &frozen, &params).context("cannot build the drafter")?;
    let started = Instant::now();
    let mut bar = ProgressBar::new(!args.json && std::io::stderr().is_terminal());
    // On a drafter's threads, as `run` trains: the forward's GEMMs and kernels split over them.
    let threads = HostThreads::new("eval", HostThreads::drafter_threads())
        .context("cannot start the evaluation threads")?;
    let totals =
        threads.run(|| evaluate_dataset(&plan, data, model.as_mut(), |p| bar.draw(p, started)))?;
    bar.clear();
    if args.json {
        say(serde_json::to_string_pretty(&json_report(args, &totals))?)?;
    } else {
        say(text_report(args, &totals, started.elapsed().as_secs_f64()))?;
    }
    Ok(ExitCode::SUCCESS)
}

/// The pipeline name a checkpoint's weights file records (`--save` writes it in the `plan` metadata) when it is
/// not `plan`. A weights file without the name (another trainer's) or unreadable here says nothing: loading it
/// reports its own errors.
fn trained_by_another_plan(checkpoint: &std::path::Path, plan: &str) -> Option<String> {
    let weights = if checkpoint.is_dir() {
        checkpoint.join("model.safetensors")
    } else {
        checkpoint.to_path_buf()
    };
    let file = TensorFile::open(&weights).ok()?;
    let trained_by = file.string_metadata()?.get("plan")?;
    (trained_by != plan).then(|| trained_by.clone())
}

/// The bar redrawn in place on standard error (standard output keeps only the report).
struct ProgressBar {
    enabled: bool,
    drawn: bool,
}

impl ProgressBar {
    fn new(enabled: bool) -> Self {
        Self {
            enabled,
            drawn: false,
        }
    }

    fn draw(&mut self, progress: EvalProgress, started: Instant) {
        if !self.enabled {
            return;
        }
        let elapsed = started.elapsed().as_secs_f64();
        let rate = progress.tokens as f64 / elapsed.max(1e-9);
        // A progress bar that cannot be drawn is not worth failing the evaluation for.
        let _ = write!(
            std::io::stderr(),
            "\r{} batch {}/{} | {:.0} tok/s | {elapsed:.1}s\x1b[K",
            progress_bar(progress.batches, progress.total, BAR_WIDTH),
            progress.batches,
            progress.total,
            rate,
        );
        self.drawn = true;
    }

    fn clear(&mut self) {
        if self.drawn {
            let _ = write!(std::io::stderr(), "\r\x1b[K");
        }
    }
}

fn text_report(args: &EvalArgs, totals: &EvalTotals, seconds: f64) -> String {
    let mut out = format!(
        "eval {}: {} batches, {} sequences, {} tokens from `{}` in {seconds:.1}s\n",
        args.checkpoint.display(),
        totals.batches,
        totals.sequences,
        totals.tokens,
        args.data
    );
    match totals.loss() {
        Some(loss) => out += &format!("loss {loss:.4} (Σ w·CE / Σ w, as in training)\n"),
        None => out += "loss - (no block slot had a label)\n",
    }
    out += "slot  accuracy  labelled\n";
    for (k, (accuracy, counted)) in totals
        .slot_accuracy()
        .into_iter()
        .zip(totals.sums.slot_counted.iter().skip(1))
        .enumerate()
    {
        let accuracy = accuracy.map_or_else(|| "-".to_string(), |a| format!("{a:.4}"));
        out += &format!("{:>4}  {accuracy:>8}  {counted:>8}\n", k + 1);
    }
    out += &format!(
        "τ {:.3} exact (each block's drafted prefix that matches its labels, plus the bonus token; {} blocks)\n\
         τ {:.3} simulated (SpecForge's 1 + Σ_k Π_{{j≤k}} acc_j; acceptance length {:.3})",
        totals.tau_exact(),
        totals.sums.blocks,
        totals.tau_simulated(),
        totals.acceptance_length(),
    );
    out
}

fn json_report(args: &EvalArgs, totals: &EvalTotals) -> serde_json::Value {
    serde_json::json!({
        "checkpoint": args.checkpoint,
        "data": args.data,
        "batches": totals.batches,
        "sequences": totals.sequences,
        "tokens": totals.tokens,
        "loss": totals.loss(),
        "slot_accuracy": totals.slot_accuracy(),
        "slot_labelled": totals.sums.slot_counted.iter().skip(1).collect::<Vec<_>>(),
        "acceptance_length": totals.acceptance_length(),
        "blocks": totals.sums.blocks,
        "tau_exact": totals.tau_exact(),
        "tau_simulated": totals.tau_simulated(),
    })
}
