//! How one run is driven beyond what the plan says, and why it stopped.

use std::path::PathBuf;

use draftpipe_compiler::plan::Plan;

use crate::checkpoint::WeightsDtype;
use crate::telemetry::OutputMode;

/// How one run is driven, beyond what the plan says.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Step limit; overrides the plan's `steps`.
    pub steps: Option<u64>,
    /// Where checkpoints go.
    pub save_dir: Option<PathBuf>,
    /// Checkpoint every this many steps (and always at the end) when `save_dir` is set.
    pub save_every: Option<u64>,
    /// The dtype of the checkpoint's `model.safetensors` (the optimizer state stays f32).
    pub save_dtype: WeightsDtype,
    /// Continue from this checkpoint directory.
    pub resume: Option<PathBuf>,
    /// Start from these weights (a `model.safetensors`, or a directory holding one and maybe its
    /// `config.json`), with fresh optimizer state.
    pub init: Option<PathBuf>,
    /// How status lines are written.
    pub output: OutputMode,
    /// Where `status.jsonl` and `summary.json` go.
    pub run_dir: Option<PathBuf>,
    /// Where the trace goes (the plan's `telemetry.trace`, or none).
    pub trace: Option<PathBuf>,
    /// Where the TensorBoard event files go (the plan's `telemetry.tensorboard`, or none).
    pub tensorboard: Option<PathBuf>,
    /// Replace a regular file at the trace path that is not a trace (`draftpipe run --force`).
    pub force_outputs: bool,
    /// Files the run reads that the plan does not name (the `.pipe` file): no output may replace them.
    pub inputs: Vec<PathBuf>,
    /// Keep running on the other producers when one fails.
    pub keep_going: bool,
    /// Stop after this many non-finite steps in a row.
    pub max_nonfinite_in_row: u32,
    /// Seed of the drafter's initial weights.
    pub init_seed: u64,
    /// Fault injection for tests: the run's thread spawns after this many fail as if the OS refused them
    /// (`None`, the default, never).
    pub fail_spawn_after: Option<usize>,
}

impl RunOptions {
    /// Options for `plan` with nothing overridden: plain status lines, no checkpoints, the plan's trace path.
    pub fn for_plan(plan: &Plan) -> Self {
        Self {
            steps: None,
            save_dir: None,
            save_every: None,
            save_dtype: WeightsDtype::F32,
            resume: None,
            init: None,
            output: OutputMode::Plain,
            run_dir: None,
            trace: plan.telemetry.trace.as_ref().map(PathBuf::from),
            tensorboard: plan.telemetry.tensorboard.as_ref().map(PathBuf::from),
            force_outputs: false,
            inputs: Vec::new(),
            keep_going: false,
            max_nonfinite_in_row: DEFAULT_MAX_NONFINITE_IN_ROW,
            init_seed: 0,
            fail_spawn_after: None,
        }
    }

    /// The step limit of a run of `plan` with these options: `--steps`, else the plan's `steps`, counted from
    /// step 0 (a resumed run trains up to it, not that many more).
    pub fn step_limit(&self, plan: &Plan) -> Option<u64> {
        self.steps.or(plan.drafter.steps)
    }
}

/// Non-finite steps in a row after which a run gives up: a few can be a bad batch, more mean the run diverged.
pub const DEFAULT_MAX_NONFINITE_IN_ROW: u32 = 5;

/// Why a run stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// The step limit was reached.
    StepLimit,
    /// Every source was exhausted and the queue drained.
    SourcesExhausted,
    /// The caller's interrupt flag was raised (Ctrl-C).
    Interrupted,
}
