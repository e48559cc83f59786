//! The stages' settings as the checks resolved them: devices and placement, the target and its source, the
//! queue, the drafter's loss, optimizer, schedule and precision, telemetry. Plain data, the bottom of the
//! compiler's modules: everything else reads these and this module reads nothing of ours.

use serde::{Deserialize, Serialize};

/// A device a stage can run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Device {
    /// The host CPU (several workers may share it).
    Cpu,
    /// CUDA device with this ordinal.
    Gpu(u32),
}

/// A device declared in the `devices` block, with its memory capacity.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeclaredDevice {
    /// The device.
    pub device: Device,
    /// Memory capacity in bytes.
    pub memory_bytes: u64,
}

/// Where a stage runs: one worker per entry of `workers` (a CPU stage `on cpu x2` has two `Device::Cpu`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    /// The device of each worker, in worker order.
    pub workers: Vec<Device>,
}

impl Placement {
    /// How many of the workers run on the CPU.
    pub fn cpu_workers(&self) -> usize {
        self.workers
            .iter()
            .filter(|&&device| device == Device::Cpu)
            .count()
    }
}

/// The frozen target model that produces hidden states.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TargetStage {
    /// Stage name.
    pub name: String,
    /// Producer workers.
    pub placement: Placement,
    /// Hidden size of the target model.
    pub hidden: usize,
    /// The target's depth (decoder layers): the section's `layers`, or, when a run starts, `num_hidden_layers`
    /// from the `config.json` beside the target's `weights`. `None`: neither says it (a `dflash` export then
    /// writes the least depth the taps allow and says it is assumed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layers: Option<usize>,
    /// Target layers whose hidden states are concatenated per token.
    pub tap_layers: Vec<u32>,
    /// Target vocabulary size (also the drafter's).
    pub vocab: usize,
    /// Tokens in one queue item (sequences × padded length of its bucket).
    pub batch_tokens: usize,
    /// Where hidden states come from.
    pub source: SourceSpec,
    /// At most this many items per second per worker (`max_rate`): a slow target on demand, to see a
    /// producer-bound pipeline on any machine. `None`: as fast as the source goes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_rate: Option<f64>,
    /// The target's frozen weights a `dflash` drafter reads (embedding and `lm_head`); `None`: none given, which
    /// only a synthetic target allows (it generates its own from its seed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights: Option<WeightsSpec>,
    /// Precision hidden states are held in from the source to the step (`hs_dtype`): the pool, the queue and
    /// the drafters' input slots. `None` only for a file source without `hs_dtype`: the files decide, when they
    /// are opened (see the runtime's `source::resolve_hs_dtype`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hs_dtype: Option<HsDtype>,
    /// What the sources check in the loss masks (`end_of_turn`, `max_bad_mask_share`).
    #[serde(default)]
    pub masks: super::MaskChecks,
}

/// Where the target's frozen weights are read from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum WeightsSpec {
    /// A safetensors checkpoint: one file, a directory of shards, or a glob of files.
    Safetensors {
        /// The path as written in the `.pipe` file.
        path: String,
    },
}

impl TargetStage {
    /// Width of one token's hidden state: `hidden × tap_layers.len()`.
    pub fn hs_width(&self) -> usize {
        self.hidden * self.tap_layers.len()
    }

    /// The precision hidden states are held in, f32 when the files decide and have not been looked at (the
    /// widest, so a memory figure from it is an upper bound).
    pub fn hs_dtype_or_widest(&self) -> HsDtype {
        self.hs_dtype.unwrap_or(HsDtype::F32)
    }
}

/// The element type of hidden states in the pool, the queue and the drafters' input slots (`hs_dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum HsDtype {
    /// 32-bit float.
    F32,
    /// bfloat16: the top half of an f32 (what targets usually produce).
    Bf16,
    /// IEEE half precision.
    F16,
    /// OCP FP8 E4M3 (max 448, no infinities) with one f32 scale per token row: 1 byte per element plus
    /// [`HsDtype::scale_bytes_per_row`] per token. Dequantised to f32 when a batch is staged for the step.
    Fp8E4m3,
}

impl HsDtype {
    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            HsDtype::F32 => 4,
            HsDtype::Bf16 | HsDtype::F16 => 2,
            HsDtype::Fp8E4m3 => 1,
        }
    }

    /// Bytes of scale beside each token's row of hidden states: the f32 scale of an FP8 row, 0 for the
    /// float dtypes (which need none).
    pub fn scale_bytes_per_row(self) -> usize {
        match self {
            HsDtype::Fp8E4m3 => 4,
            HsDtype::F32 | HsDtype::Bf16 | HsDtype::F16 => 0,
        }
    }

    /// The `.pipe` spelling.
    pub fn name(self) -> &'static str {
        match self {
            HsDtype::F32 => "f32",
            HsDtype::Bf16 => "bf16",
            HsDtype::F16 => "f16",
            HsDtype::Fp8E4m3 => "fp8_e4m3",
        }
    }

    /// The default for a source when `hs_dtype` is not written: bf16 for `stream` (targets send bf16), f32 for
    /// `synthetic`, and `None` (the files' dtype) for `safetensors`.
    pub fn default_for(source: &SourceSpec) -> Option<Self> {
        match source {
            SourceSpec::Synthetic { .. } => Some(HsDtype::F32),
            SourceSpec::Stream { .. } => Some(HsDtype::Bf16),
            SourceSpec::Safetensors { .. } => None,
        }
    }
}

/// Where a target stage gets its hidden states.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum SourceSpec {
    /// A seeded synthetic target; sequence lengths uniform in `min_len..max_len` (half-open).
    Synthetic {
        /// RNG seed.
        seed: u64,
        /// Smallest sequence length (inclusive).
        min_len: usize,
        /// Largest sequence length (exclusive).
        max_len: usize,
    },
    /// Recorded hidden states read from safetensors files.
    Safetensors {
        /// Glob pattern of the files, e.g. `data/*.safetensors`.
        pattern: String,
        /// Passes over the data (at least 1).
        #[serde(default = "one_epoch")]
        epochs: u64,
        /// Seed of each epoch's shuffled batch order; `None` reads the batches in file order.
        #[serde(default)]
        shuffle_seed: Option<u64>,
    },
    /// Hidden states pushed over a socket by producer processes that run the target.
    Stream {
        /// `IP:PORT` (`localhost:PORT` is `127.0.0.1:PORT`; port 0 picks a free one) or `unix:/path`.
        listen: String,
        /// The environment variable holding the token producers must present; `None`: no token.
        token_env: Option<String>,
        /// The largest message accepted, in bytes (the hello's reply tells producers).
        max_message_bytes: u64,
        /// A producer that stalls this long in the middle of a hello or a message is disconnected.
        read_timeout_ms: u64,
    },
}

fn one_epoch() -> u64 {
    1
}

/// Default stall allowed inside a stream message or hello.
pub const DEFAULT_STREAM_READ_TIMEOUT_MS: u64 = 30_000;

impl TargetStage {
    /// The stream source's default message limit: two items' worth of tokens in f32 with i64 ids and masks
    /// (so any sequence a bucket holds fits in one message), plus 1 MiB for the safetensors header.
    pub fn default_max_message_bytes(&self) -> u64 {
        let per_token = 4 * self.hs_width() as u64 + 16;
        2 * self.batch_tokens as u64 * per_token + (1 << 20)
    }
}

/// How consumers choose the next item.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PullPolicy {
    /// Round-robin over non-empty buckets, uniform at random inside the chosen bucket.
    RandomInBucket,
    /// Round-robin over non-empty buckets, oldest item first inside a bucket.
    RoundRobin,
    /// Oldest item over all buckets.
    Fifo,
}

/// The hidden-state queue.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueSpec {
    /// Queue name.
    pub name: String,
    /// Producer stage name.
    pub from: String,
    /// Consumer stage name.
    pub to: String,
    /// Total items over all buckets.
    pub capacity: usize,
    /// Consumers wait until this many items are queued (except while draining).
    pub min_ready: usize,
    /// Strictly increasing upper bounds on sequence length.
    pub buckets: Vec<usize>,
    /// Pull policy.
    pub pull: PullPolicy,
}

/// The drafter training stage.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DrafterStage {
    /// Stage name.
    pub name: String,
    /// Consumer workers (data-parallel replicas).
    pub placement: Placement,
    /// Loss configuration.
    pub loss: LossSpec,
    /// Optimizer configuration.
    pub optimizer: AdamWSpec,
    /// Gradient synchronisation between workers.
    pub sync: SyncMode,
    /// Kernel launch mode on CUDA.
    pub launch: LaunchMode,
    /// Precision of the step's matrix products.
    pub precision: Precision,
    /// Optional step limit.
    pub steps: Option<u64>,
    /// The draft vocabulary map an `eagle3` drafter reads (`vocab_map`): a safetensors file of `d2t` (i64) and
    /// `t2d` (bool or u8), as `draftpipe vocab` writes it. `None`: the run computes it from the source's data
    /// before training (synthetic and file sources; the checker refuses a stream source without one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vocab_map: Option<String>,
}

/// Gradient synchronisation between drafter workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SyncMode {
    /// Average gradients over all workers every step.
    AllReduce,
    /// Independent replicas.
    None,
}

/// How a step's kernels are launched on CUDA.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum LaunchMode {
    /// One captured CUDA graph per bucket.
    Graph,
    /// Kernel by kernel.
    Eager,
}

/// Precision of the drafter's matrix products; parameters, gradients, optimizer state and every other kernel
/// stay f32 whatever is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Precision {
    /// Full f32 (no tensor cores on CUDA).
    F32,
    /// Operands rounded to TF32 (10-bit mantissa) by the tensor cores, f32 accumulation. GPU only.
    Tf32,
    /// Operands rounded to bf16, f32 accumulation and output; the CPU emulates the rounding.
    Bf16,
}

impl Precision {
    /// The default for a drafter on `device`: bf16 on a GPU, f32 on the CPU.
    pub fn default_for(device: Device) -> Self {
        match device {
            Device::Cpu => Precision::F32,
            Device::Gpu(_) => Precision::Bf16,
        }
    }

    /// The `.pipe` spelling.
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Tf32 => "tf32",
            Precision::Bf16 => "bf16",
        }
    }
}

/// Multi-head (`mlp`), multi-position (`dflash`) or multi-step (`eagle3`) cross-entropy loss.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LossSpec {
    /// `mlp`: head `j` is weighted `head_decay^j` (1 on the other families, where the checker refuses the key).
    pub head_decay: f32,
    /// `dflash`: block slot `k ≥ 1` is weighted `exp(−(k−1)/position_decay)` (SpecForge's `loss_decay_gamma`);
    /// `None`: every slot weighs the same. Always `None` on the other families, where the checker refuses the key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub position_decay: Option<f32>,
    /// `eagle3`: TTT step `k` is weighted `step_decay^k` (SpecForge's `0.8^k`, the checker's default), no
    /// renormalisation; `None` on the other families, where the checker refuses the key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_decay: Option<f32>,
    /// Tokens per chunk of the fused vocabulary loss.
    pub chunk_tokens: usize,
}

/// AdamW with PyTorch semantics.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdamWSpec {
    /// Learning rate.
    pub lr: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Denominator epsilon.
    pub eps: f32,
    /// Decoupled weight decay.
    pub weight_decay: f32,
    /// Global gradient-norm clip, when configured.
    pub clip_grad_norm: Option<f32>,
    /// The learning rate's schedule over the drafter's `steps` (constant unless `schedule = ...` says otherwise).
    #[serde(default)]
    pub schedule: LrSchedule,
}

/// The shape of the learning-rate schedule (Hugging Face's `get_*_schedule_with_warmup`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum ScheduleKind {
    /// `lr` every step (after the warmup, if any).
    #[default]
    Constant,
    /// Linear warmup from 0, then linear decay to 0 at the last step.
    Linear,
    /// Linear warmup from 0, then half a cosine down to 0 at the last step.
    Cosine,
}

impl ScheduleKind {
    /// The `.pipe` spelling.
    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::Constant => "constant",
            ScheduleKind::Linear => "linear",
            ScheduleKind::Cosine => "cosine",
        }
    }
}

/// The learning-rate schedule, resolved to steps by the compiler. With `s` the steps applied before this one
/// and `T` the drafter's `steps`: `s < warmup_steps`: `lr·s/max(1, warmup_steps)`; then `Linear`:
/// `lr·max(0, (T−s)/max(1, T−warmup_steps))`, `Cosine`: `lr·max(0, ½(1 + cos(π·(s−w)/max(1, T−w))))`,
/// `Constant`: `lr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct LrSchedule {
    /// The shape after the warmup.
    pub kind: ScheduleKind,
    /// Steps of linear warmup from 0 (a `warmup` fraction is resolved against `steps`).
    pub warmup_steps: u64,
}

impl LrSchedule {
    /// The default: the configured `lr` at every step.
    pub const CONSTANT: LrSchedule = LrSchedule {
        kind: ScheduleKind::Constant,
        warmup_steps: 0,
    };

    /// The multiplier of `lr` for the step that follows `applied` applied steps, out of `total` (the host's
    /// copy of the formula above, for reports and tests; the device computes its own).
    ///
    /// # Examples
    /// ```
    /// use draftpipe_compiler::plan::{LrSchedule, ScheduleKind};
    ///
    /// let cosine = LrSchedule { kind: ScheduleKind::Cosine, warmup_steps: 2 };
    /// assert_eq!(cosine.factor(0, 10), 0.0);
    /// assert_eq!(cosine.factor(1, 10), 0.5);
    /// assert_eq!(cosine.factor(2, 10), 1.0);
    /// assert!(cosine.factor(10, 10).abs() < 1e-12);
    /// ```
    pub fn factor(&self, applied: u64, total: u64) -> f64 {
        let (s, w, t) = (applied as f64, self.warmup_steps as f64, total as f64);
        if applied < self.warmup_steps {
            return s / w.max(1.0);
        }
        let progress = (s - w) / (t - w).max(1.0);
        match self.kind {
            ScheduleKind::Constant => 1.0,
            ScheduleKind::Linear => ((t - s) / (t - w).max(1.0)).max(0.0),
            ScheduleKind::Cosine => {
                (0.5 * (1.0 + (std::f64::consts::PI * progress).cos())).max(0.0)
            }
        }
    }
}

/// Telemetry settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TelemetrySpec {
    /// Status-line period in milliseconds.
    pub every_ms: u64,
    /// Chrome/Perfetto trace output path, when requested.
    pub trace: Option<String>,
    /// Directory of the TensorBoard event files, when requested (as written: relative to the working directory).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tensorboard: Option<String>,
}

/// `acceptance { ... }`: every `every` steps the run exports the drafter and runs the draft-and-verify loop
/// (`python -m draftpipe_client.speculative`) on it in the background, against `target` on `prompts`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AcceptanceSpec {
    /// The target the loop verifies with: a `transformers` model directory (as written: relative paths are
    /// the run's working directory's, as every path of a pipeline).
    pub target: String,
    /// The held-out prompts: JSON lines with `messages`, `text` or `input_ids`.
    pub prompts: String,
    /// Optimizer steps between two checks.
    pub every: u64,
    /// Tokens each prompt's decode generates at most.
    pub max_new_tokens: u64,
    /// The Python interpreter, when the pipeline names one (else `DRAFTPIPE_PYTHON`, else `python3`).
    pub python: Option<String>,
    /// The longest one check may run, in milliseconds; past it the child is killed.
    pub timeout_ms: u64,
}
