//! Command-line arguments (clap derive); `commands::dispatch` sends a [`Command`] to its module in `commands/`.
//!
//! Exit codes: see `commands` (0 success, 1 errors, 2 usage errors through clap, 3 and 128 + N for `run`).

use clap::{Args, Parser, Subcommand, ValueEnum};
use std::path::PathBuf;

/// Train speculative-decoding drafters from a frozen target's hidden states.
#[derive(Debug, Parser)]
#[command(name = "draftpipe", version, about, propagate_version = true)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands; each has one `run` function in `commands/` (see `commands::dispatch`).
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Check `.pipe` files and report every error (exit 0 when all are valid, 1 when any has errors).
    Check(CheckArgs),
    /// Compile a `.pipe` file and print its plan (stages, queue, model, memory per device, cost per step).
    Compile(CompileArgs),
    /// Run a pipeline: producers, queue and drafters, with status lines, a diagnosis and checkpoints.
    Run(RunArgs),
    /// Explain a finished run from its run directory (which side was the bottleneck, where the time went).
    Diagnose(DiagnoseArgs),
    /// Write one self-contained HTML page of a run (ended, crashed or still going) with its charts and diagnosis.
    Report(ReportArgs),
    /// Evaluate a trained drafter on held-out data: loss, accuracy per block slot, acceptance length τ.
    Eval(EvalArgs),
    /// Predict a plan's throughput and bottleneck with a discrete-event model, and what `--set` what-ifs change.
    Simulate(SimulateArgs),
    /// Check that SGLang and vLLM would load a `dflash` or `eagle3` export, by their loaders' rules (exit 1 when
    /// an engine would not load it).
    ExportCheck(ExportCheckArgs),
    /// Count the loss-masked tokens of an `eagle3` pipeline's source and write its draft vocabulary (`d2t`,
    /// `t2d`, SpecForge's rule) for the pipeline's `vocab_map`.
    Vocab(VocabArgs),
}

/// Arguments of `draftpipe export-check`.
#[derive(Debug, Args)]
pub struct ExportCheckArgs {
    /// The export: the directory `run --save` wrote (`config.json`, `model.safetensors`).
    #[arg(value_name = "DIR")]
    pub dir: PathBuf,
    /// The target's tokenizer (`tokenizer.json` or its directory): the mask token must agree with it.
    #[arg(long, value_name = "PATH")]
    pub tokenizer: Option<PathBuf>,
    /// The speculative token count the engine will run with (vLLM's `num_speculative_tokens`; SGLang's
    /// `--speculative-num-draft-tokens` is one more), checked against the trained block size.
    #[arg(long, value_name = "N")]
    pub speculative_tokens: Option<usize>,
}

/// Arguments of `draftpipe vocab`.
#[derive(Debug, Args)]
pub struct VocabArgs {
    /// The `.pipe` file of an `eagle3` drafter whose source is counted (files or synthetic, not a stream).
    #[arg(value_name = "PIPE")]
    pub file: PathBuf,
    /// Where to write the map (a safetensors file with `d2t` int64 and `t2d` bool): a new path or an earlier
    /// map; never a file the command reads, nor anything but a regular file.
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
    /// Replace a regular file at `--out` that is not a draft vocabulary map.
    #[arg(long)]
    pub force: bool,
    /// Count only the first N batches of the source [default: all of the files' data; 1000 synthetic batches].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub batches: Option<u64>,
}

/// Arguments of `draftpipe check`.
#[derive(Debug, Args)]
pub struct CheckArgs {
    /// The `.pipe` files to check.
    #[arg(required = true, value_name = "FILE")]
    pub files: Vec<PathBuf>,
}

/// Arguments of `draftpipe compile`.
#[derive(Debug, Args)]
pub struct CompileArgs {
    /// The `.pipe` file to compile.
    #[arg(value_name = "FILE")]
    pub file: PathBuf,
    /// Output format: a readable summary, or the full plan as JSON.
    #[arg(long, value_enum, default_value_t = Emit::Text)]
    pub emit: Emit,
}

/// Arguments of `draftpipe run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// The `.pipe` file to run.
    #[arg(value_name = "FILE")]
    pub file: PathBuf,
    /// Stop after this many training steps (overrides the file's `steps`).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub steps: Option<u64>,
    /// Write checkpoints to this directory (every `--save-every` steps and at the end).
    #[arg(long, value_name = "DIR")]
    pub save: Option<PathBuf>,
    /// Checkpoint period in steps, with `--save`.
    #[arg(long, value_name = "N", default_value_t = 100, requires = "save", value_parser = clap::value_parser!(u64).range(1..))]
    pub save_every: u64,
    /// The dtype of the checkpoint's `model.safetensors`: `bf16` for serving engines (the exact f32 weights then
    /// go to `optimizer.safetensors`, so `--resume` stays exact).
    #[arg(long, value_enum, value_name = "DTYPE", default_value_t = SaveDtype::F32, requires = "save")]
    pub save_dtype: SaveDtype,
    /// Continue exactly from a checkpoint directory written by `--save`.
    #[arg(long, value_name = "DIR", conflicts_with = "init")]
    pub resume: Option<PathBuf>,
    /// Start from these weights, fresh optimizer state: a `model.safetensors` (F32, BF16 or F16; from `--save`
    /// or PyTorch) or a directory holding one (a `config.json` beside it is checked against the pipeline).
    #[arg(long, value_name = "DIR|FILE")]
    pub init: Option<PathBuf>,
    /// Write status lines as JSON objects, one per line.
    #[arg(long)]
    pub json: bool,
    /// Write TensorBoard event files to this directory (overrides the pipeline's `telemetry.tensorboard`).
    #[arg(long, value_name = "DIR")]
    pub tensorboard: Option<PathBuf>,
    /// Directory for `status.jsonl` and `summary.json` [default: runs/<pipeline name>].
    #[arg(long, value_name = "DIR")]
    pub run_dir: Option<PathBuf>,
    /// When a producer fails, report it and continue with the others.
    #[arg(long)]
    pub keep_going: bool,
    /// Stop after this many steps in a row with a non-finite loss or gradient.
    #[arg(long, value_name = "K", default_value_t = draftpipe_runtime::pipeline::DEFAULT_MAX_NONFINITE_IN_ROW)]
    pub max_nonfinite: u32,
    /// Seed of the drafter's initial weights.
    #[arg(long, value_name = "SEED", default_value_t = 0)]
    pub seed: u64,
    /// Replace a regular file at the plan's `telemetry.trace` path that is not a trace (an input of the run
    /// is never replaced).
    #[arg(long)]
    pub force: bool,
}

/// Arguments of `draftpipe diagnose`.
#[derive(Debug, Args)]
pub struct DiagnoseArgs {
    /// A run directory written by `draftpipe run` (holds `summary.json`).
    #[arg(value_name = "RUN_DIR")]
    pub run_dir: PathBuf,
    /// Print the diagnosis as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Arguments of `draftpipe report`.
#[derive(Debug, Args)]
pub struct ReportArgs {
    /// A run directory written by `draftpipe run --run-dir` (holds `status.jsonl`, and `summary.json` once the
    /// run ended).
    #[arg(value_name = "RUN_DIR")]
    pub run_dir: PathBuf,
    /// Where to write the page (default: `RUN_DIR/report.html`).
    #[arg(long, value_name = "FILE.html")]
    pub out: Option<PathBuf>,
    /// Replace a file at `--out` that is not a draftpipe report.
    #[arg(long)]
    pub force: bool,
}

/// Arguments of `draftpipe eval`.
#[derive(Debug, Args)]
pub struct EvalArgs {
    /// The checkpoint: a directory written by `--save` (its `config.json` is checked against the pipeline) or a
    /// `model.safetensors`.
    #[arg(value_name = "CHECKPOINT")]
    pub checkpoint: PathBuf,
    /// The `.pipe` file the drafter was trained with: its model, buckets and frozen target weights (the
    /// embedding and `lm_head` are not in the checkpoint).
    #[arg(long, value_name = "FILE")]
    pub pipeline: PathBuf,
    /// The held-out hidden states: a safetensors file, directory or glob, in the format of the target's
    /// `safetensors(...)` source; read once, in file order.
    #[arg(long, value_name = "PATH")]
    pub data: String,
    /// Print the metrics as one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// Arguments of `draftpipe simulate`.
#[derive(Debug, Args)]
pub struct SimulateArgs {
    /// The `.pipe` file to model.
    #[arg(value_name = "FILE")]
    pub file: PathBuf,
    /// Take the producers' and drafters' times (per bucket, with their spread) from a run directory.
    #[arg(long, value_name = "RUN_DIR")]
    pub from: Option<PathBuf>,
    /// Items per second one producer worker makes (needed without --from: the plan has no target cost).
    #[arg(long, allow_negative_numbers = true, value_name = "ITEMS_PER_S")]
    pub producer_rate: Option<f64>,
    /// Seconds per drafter step on every bucket, instead of the cost model's FLOPs (without --from).
    #[arg(
        long,
        allow_negative_numbers = true,
        value_name = "SECONDS",
        conflicts_with = "from"
    )]
    pub step_time: Option<f64>,
    /// GFLOP/s one drafter worker sustains, for the cost model (default: an assumption per device kind).
    #[arg(long, allow_negative_numbers = true, value_name = "GFLOPS", conflicts_with_all = ["from", "step_time"])]
    pub drafter_gflops: Option<f64>,
    /// A what-if, `KEY=VALUE[,KEY=VALUE...]` (repeatable): queue.capacity, queue.min_ready, queue.pull,
    /// queue.rounds, drafter.devices, drafter.step_time, drafter.sync, producer.workers, producer.rate.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Print the plan and each `--set` as its own variant, side by side (without it, all `--set`s apply together).
    #[arg(long)]
    pub compare: bool,
    /// Simulated seconds.
    #[arg(long, allow_negative_numbers = true, value_name = "SECONDS", default_value_t = draftpipe_runtime::simulate::DEFAULT_DURATION_S)]
    pub duration: f64,
    /// Seed of the simulated variability.
    #[arg(long, value_name = "SEED", default_value_t = 1)]
    pub seed: u64,
}

/// The dtypes `--save-dtype` offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SaveDtype {
    /// 32-bit floats: exactly the trained weights.
    F32,
    /// bfloat16, rounded to nearest even: what serving engines load, half the size.
    Bf16,
}

impl From<SaveDtype> for draftpipe_runtime::checkpoint::WeightsDtype {
    fn from(dtype: SaveDtype) -> Self {
        match dtype {
            SaveDtype::F32 => Self::F32,
            SaveDtype::Bf16 => Self::Bf16,
        }
    }
}

/// Output formats of `draftpipe compile`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Emit {
    /// A readable summary.
    Text,
    /// The plan as JSON (exactly what the runtime executes).
    Json,
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory as _;

    #[test]
    fn clap_definition_is_consistent() {
        super::Cli::command().debug_assert();
    }
}
