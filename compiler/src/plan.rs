//! The compiled plan: plain data that the runtime executes.
//!
//! Everything here is derived from a checked `.pipe` file. The runtime never re-reads the source: stage
//! placement, queue semantics, the model's flat parameter layout, per-bucket shapes and the memory plan are all
//! decided here.

use serde::{Deserialize, Serialize};

pub use crate::eagle3::{EAGLE3_DEFAULT_TTT, EAGLE3_TAPS, Eagle3Spec};
pub use crate::workspace::{BackendKind, WorkspaceLayout};

/// One compiled pipeline.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// The name given by `pipeline "NAME"`.
    pub name: String,
    /// Devices declared in the `devices` block (empty when the file declares none).
    pub devices: Vec<DeclaredDevice>,
    /// The producer stage.
    pub target: TargetStage,
    /// The hidden-state queue between the target and the drafter.
    pub queue: QueueSpec,
    /// The consumer stage.
    pub drafter: DrafterStage,
    /// The drafter model, its parameter count and flat layout.
    pub model: ModelPlan,
    /// One entry per queue bucket, in bucket order.
    pub buckets: Vec<BucketPlan>,
    /// Memory needed on each drafter device the plan uses.
    pub memory: Vec<DeviceMemory>,
    /// Memory the run takes on the host outside the drafters' own: the hidden-state pool.
    pub host_memory: HostMemory,
    /// The ordered phases of one drafter training step.
    pub schedule: Vec<StepPhase>,
    /// Status-line period and trace output.
    pub telemetry: TelemetrySpec,
}

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
}

impl HsDtype {
    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            HsDtype::F32 => 4,
            HsDtype::Bf16 | HsDtype::F16 => 2,
        }
    }

    /// The `.pipe` spelling.
    pub fn name(self) -> &'static str {
        match self {
            HsDtype::F32 => "f32",
            HsDtype::Bf16 => "bf16",
            HsDtype::F16 => "f16",
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
    /// `mlp`: head `j` is weighted `head_decay^j` (1 on `dflash`, where the checker refuses the key).
    pub head_decay: f32,
    /// `dflash`: block slot `k ≥ 1` is weighted `exp(−(k−1)/position_decay)` (SpecForge's `loss_decay_gamma`);
    /// `None`: every slot weighs the same. Always `None` on `mlp`, where the checker refuses the key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub position_decay: Option<f32>,
    /// `eagle3`: TTT step `k` is weighted `step_decay^k` (SpecForge's `0.8^k`), no renormalisation; `None` on the
    /// other families.
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

/// Dimensions of the `mlp` drafter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MlpSpec {
    /// Input width per token (target hidden × tapped layers).
    pub din: usize,
    /// Drafter hidden size.
    pub hidden: usize,
    /// Number of SwiGLU blocks.
    pub blocks: usize,
    /// SwiGLU intermediate size.
    pub intermediate: usize,
    /// Number of prediction heads.
    pub heads: usize,
    /// Vocabulary size.
    pub vocab: usize,
}

/// One named tensor inside the flat parameter buffer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorView {
    /// PyTorch parameter name, e.g. `blocks.0.gate.weight`.
    pub name: String,
    /// Shape, PyTorch `[out, in]` for weights.
    pub shape: Vec<usize>,
    /// Offset in elements into the flat buffer.
    pub offset: usize,
}

impl TensorView {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// True when the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The element range of this tensor inside the flat buffer.
    pub fn range(&self) -> std::ops::Range<usize> {
        self.offset..self.offset + self.len()
    }
}

/// The drafter model family and its dimensions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ModelSpec {
    /// `model = mlp(...)`.
    Mlp(MlpSpec),
    /// `model = dflash(...)`.
    Dflash(DflashSpec),
    /// `model = eagle3(...)`.
    Eagle3(Eagle3Spec),
}

impl From<MlpSpec> for ModelSpec {
    fn from(spec: MlpSpec) -> Self {
        ModelSpec::Mlp(spec)
    }
}

impl From<DflashSpec> for ModelSpec {
    fn from(spec: DflashSpec) -> Self {
        ModelSpec::Dflash(spec)
    }
}

impl From<Eagle3Spec> for ModelSpec {
    fn from(spec: Eagle3Spec) -> Self {
        ModelSpec::Eagle3(spec)
    }
}

impl ModelSpec {
    /// The `.pipe` name of the family: `mlp`, `dflash` or `eagle3`.
    pub fn kind(&self) -> &'static str {
        match self {
            ModelSpec::Mlp(_) => "mlp",
            ModelSpec::Dflash(_) => "dflash",
            ModelSpec::Eagle3(_) => "eagle3",
        }
    }

    /// The `mlp` dimensions, when this is an `mlp`.
    pub fn as_mlp(&self) -> Option<&MlpSpec> {
        match self {
            ModelSpec::Mlp(spec) => Some(spec),
            ModelSpec::Dflash(_) | ModelSpec::Eagle3(_) => None,
        }
    }

    /// The `dflash` dimensions, when this is a `dflash`.
    pub fn as_dflash(&self) -> Option<&DflashSpec> {
        match self {
            ModelSpec::Dflash(spec) => Some(spec),
            ModelSpec::Mlp(_) | ModelSpec::Eagle3(_) => None,
        }
    }

    /// The `eagle3` dimensions, when this is an `eagle3`.
    pub fn as_eagle3(&self) -> Option<&Eagle3Spec> {
        match self {
            ModelSpec::Eagle3(spec) => Some(spec),
            ModelSpec::Mlp(_) | ModelSpec::Dflash(_) => None,
        }
    }

    /// The closed-form count of trained parameters.
    pub fn parameter_count(&self) -> usize {
        match self {
            ModelSpec::Mlp(spec) => spec.parameter_count(),
            ModelSpec::Dflash(spec) => spec.parameter_count(),
            ModelSpec::Eagle3(spec) => spec.parameter_count(),
        }
    }

    /// The flat layout of the trained parameters, in buffer order.
    pub fn layout(&self) -> Vec<TensorView> {
        match self {
            ModelSpec::Mlp(spec) => spec.layout(),
            ModelSpec::Dflash(spec) => spec.layout(),
            ModelSpec::Eagle3(spec) => spec.layout(),
        }
    }
}

/// The drafter model: family and dimensions, parameter count and named flat layout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelPlan {
    /// Family and dimensions.
    pub spec: ModelSpec,
    /// Total parameters (the flat buffer's length).
    pub parameters: usize,
    /// Named views, in buffer order.
    pub layout: Vec<TensorView>,
}

impl ModelPlan {
    /// The plan of `spec`: its closed-form parameter count and canonical flat layout.
    ///
    /// # Examples
    ///
    /// ```
    /// use draftpipe_compiler::plan::{MlpSpec, ModelPlan};
    ///
    /// let spec = MlpSpec { din: 8, hidden: 4, blocks: 1, intermediate: 6, heads: 2, vocab: 10 };
    /// let model = ModelPlan::new(spec);
    /// assert_eq!(model.parameters, model.layout.iter().map(|view| view.len()).sum::<usize>());
    /// ```
    pub fn new(spec: impl Into<ModelSpec>) -> Self {
        let spec = spec.into();
        Self {
            parameters: spec.parameter_count(),
            layout: spec.layout(),
            spec,
        }
    }
}

impl MlpSpec {
    /// The closed-form parameter count.
    pub fn parameter_count(&self) -> usize {
        let MlpSpec {
            din,
            hidden: h,
            blocks,
            intermediate: i,
            heads,
            vocab: v,
        } = *self;
        h * din + blocks * (h + 3 * i * h) + h + heads * h * h + v * h
    }

    /// The flat layout with PyTorch names and `[out, in]` weight shapes.
    pub fn layout(&self) -> Vec<TensorView> {
        let MlpSpec {
            din,
            hidden: h,
            blocks,
            intermediate: i,
            heads,
            vocab: v,
        } = *self;
        let mut shapes: Vec<(String, Vec<usize>)> = vec![("fc.weight".into(), vec![h, din])];
        for b in 0..blocks {
            shapes.push((format!("blocks.{b}.norm.weight"), vec![h]));
            shapes.push((format!("blocks.{b}.gate.weight"), vec![i, h]));
            shapes.push((format!("blocks.{b}.up.weight"), vec![i, h]));
            shapes.push((format!("blocks.{b}.down.weight"), vec![h, i]));
        }
        shapes.push(("norm.weight".into(), vec![h]));
        for j in 0..heads {
            shapes.push((format!("heads.{j}.weight"), vec![h, h]));
        }
        shapes.push(("lm_head.weight".into(), vec![v, h]));
        pack(shapes)
    }
}

/// Lays `shapes` out back to back from offset 0.
pub(crate) fn pack(shapes: Vec<(String, Vec<usize>)>) -> Vec<TensorView> {
    let mut offset = 0;
    shapes
        .into_iter()
        .map(|(name, shape)| {
            let view = TensorView {
                name,
                shape,
                offset,
            };
            offset += view.len();
            view
        })
        .collect()
}

/// Qwen3's RMSNorm epsilon, which z-lab's `DFlashDraftModel` config carries as `rms_norm_eps`.
pub const DFLASH_RMS_NORM_EPS: f32 = 1e-6;

/// Dimensions of the `dflash` drafter (SpecForge's / z-lab's `DFlashDraftModel`): a context projection of the
/// tapped target layers, `layers` Qwen3 decoder layers over blocks of `block` slots, the target's frozen
/// embedding and `lm_head` (not part of the trained parameters).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DflashSpec {
    /// The target's hidden size `H`, which is also the drafter's width.
    pub hidden: usize,
    /// Tapped target layers `L`; the context projection `fc` reads `L·H` per token.
    pub taps: usize,
    /// The target section's `tap_layers` as written: indices into the hidden-states tuple, whose entry 0 is the
    /// embeddings (target layer `i` is tap `i + 1`).
    pub tap_layers: Vec<usize>,
    /// The target's vocabulary (embedding and `lm_head` rows).
    pub vocab: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (grouped-query attention: `heads % kv_heads == 0`).
    pub kv_heads: usize,
    /// Width of one head (even: RoPE rotates pairs).
    pub head_dim: usize,
    /// SwiGLU intermediate size.
    pub intermediate: usize,
    /// Slots per block: the anchor token, then `block − 1` mask tokens to predict.
    pub block: usize,
    /// Most anchors (blocks) drawn per sequence.
    pub anchors: usize,
    /// The token id of the masked slots (`< vocab`).
    pub mask_token: u32,
    /// RoPE base.
    pub rope_theta: f32,
    /// RMSNorm epsilon of every norm ([`DFLASH_RMS_NORM_EPS`]).
    pub rms_norm_eps: f32,
}

impl DflashSpec {
    /// Block slots per sequence in a bucket of padded length `padded_len`: `anchors`, or the most anchor
    /// positions the bucket has (`padded_len − 1`, each needing a next token) when that is fewer; at least 1.
    pub fn block_slots(&self, padded_len: usize) -> usize {
        self.anchors.min(padded_len.saturating_sub(1)).max(1)
    }

    /// The closed-form count of trained parameters (frozen embedding and `lm_head` excluded).
    ///
    /// # Examples
    /// ```
    /// use draftpipe_compiler::plan::{DflashSpec, DFLASH_RMS_NORM_EPS};
    ///
    /// let spec = DflashSpec {
    ///     hidden: 64, taps: 3, tap_layers: vec![1, 2, 3], vocab: 512, layers: 2, heads: 4, kv_heads: 2,
    ///     head_dim: 16, intermediate: 128, block: 4, anchors: 64, mask_token: 511, rope_theta: 10000.0,
    ///     rms_norm_eps: DFLASH_RMS_NORM_EPS,
    /// };
    /// assert_eq!(spec.parameter_count(), spec.layout().iter().map(|v| v.len()).sum::<usize>());
    /// ```
    pub fn parameter_count(&self) -> usize {
        let h = self.hidden;
        let (q, kv) = (self.heads * self.head_dim, self.kv_heads * self.head_dim);
        h * self.taps * h + h + self.layers * self.layer_parameters(h, q, kv) + h
    }

    fn layer_parameters(&self, h: usize, q: usize, kv: usize) -> usize {
        2 * h + q * h + 2 * kv * h + 2 * self.head_dim + h * q + 3 * self.intermediate * h
    }

    /// The flat layout in z-lab's names and order, PyTorch `[out, in]` weight shapes.
    pub fn layout(&self) -> Vec<TensorView> {
        let (h, hd, i) = (self.hidden, self.head_dim, self.intermediate);
        let (q, kv) = (self.heads * hd, self.kv_heads * hd);
        let mut shapes: Vec<(String, Vec<usize>)> = vec![
            ("fc.weight".into(), vec![h, self.taps * h]),
            ("hidden_norm.weight".into(), vec![h]),
        ];
        for l in 0..self.layers {
            let p = format!("layers.{l}");
            shapes.extend([
                (format!("{p}.input_layernorm.weight"), vec![h]),
                (format!("{p}.self_attn.q_proj.weight"), vec![q, h]),
                (format!("{p}.self_attn.k_proj.weight"), vec![kv, h]),
                (format!("{p}.self_attn.v_proj.weight"), vec![kv, h]),
                (format!("{p}.self_attn.q_norm.weight"), vec![hd]),
                (format!("{p}.self_attn.k_norm.weight"), vec![hd]),
                (format!("{p}.self_attn.o_proj.weight"), vec![h, q]),
                (format!("{p}.post_attention_layernorm.weight"), vec![h]),
                (format!("{p}.mlp.gate_proj.weight"), vec![i, h]),
                (format!("{p}.mlp.up_proj.weight"), vec![i, h]),
                (format!("{p}.mlp.down_proj.weight"), vec![h, i]),
            ]);
        }
        shapes.push(("norm.weight".into(), vec![h]));
        pack(shapes)
    }
}

impl Plan {
    /// The workspace one drafter worker on `device` allocates (see [`WorkspaceLayout`]).
    /// `None` when a size overflows.
    pub fn workspace_layout(&self, device: Device) -> Option<WorkspaceLayout> {
        WorkspaceLayout::of_model(
            &self.model.spec,
            &self.buckets,
            &self.drafter.loss,
            BackendKind::of(device),
            self.drafter.precision,
        )?
        .with_hs_dtype(BackendKind::of(device), self.target.hs_dtype_or_widest())
    }
}

/// Static shapes and costs of one bucket.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BucketPlan {
    /// Upper bound on sequence length (the padded length of every sequence in the bucket).
    pub padded_len: usize,
    /// Sequences per queue item: `batch_tokens / padded_len`.
    pub sequences: usize,
    /// Tokens per step: `sequences × padded_len`.
    pub tokens: usize,
    /// Floating-point operations of one training step (forward + backward + optimizer).
    pub step_flops: u64,
    /// Bytes one step moves through device memory (a lower bound from the tensors it must touch).
    pub step_bytes: u64,
}

/// Memory needed on one device, in bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceMemory {
    /// The device.
    pub device: Device,
    /// Model parameters.
    pub parameters: u64,
    /// Gradients.
    pub gradients: u64,
    /// AdamW first and second moments.
    pub optimizer_state: u64,
    /// The target's frozen embedding and `lm_head` a `dflash` drafter reads (f32), one copy per worker; 0 for
    /// `mlp`.
    #[serde(default)]
    pub frozen_weights: u64,
    /// Activations and loss workspace, sized for the bucket that needs the most and shared by all buckets
    /// (a worker runs one step at a time); one per worker on the device.
    pub workspaces: u64,
}

impl DeviceMemory {
    /// Sum of all parts.
    pub fn total(&self) -> u64 {
        self.parameters
            + self.gradients
            + self.optimizer_state
            + self.frozen_weights
            + self.workspaces
    }
}

/// Host memory of a run outside any drafter's replica: the hidden-state pool, one allocation on the host that
/// every producer and drafter shares, whichever devices the drafters run on (a GPU drafter stages its batch
/// from it; the runtime's pool allocates exactly this many buffers of exactly this size), and a stream's
/// receive buffers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostMemory {
    /// Buffers in the pool: the queue's capacity, two per drafter (the batch in its step and the one staged
    /// for the next) and one per producer (the batch it is filling).
    pub hs_pool_buffers: u64,
    /// Bytes of one buffer: room for the bucket with the most tokens and the one with the most sequences
    /// (hidden states, token ids, loss mask, sequence lengths).
    pub hs_buffer_bytes: u64,
    /// The most a `stream` source's receive buffers may hold: one per producer slot, growing as a message's
    /// bytes arrive up to `max_message`; 0 for the other sources.
    #[serde(default)]
    pub stream_receive: u64,
}

impl HostMemory {
    /// Bytes of the whole pool.
    pub fn hs_pool(&self) -> u64 {
        self.hs_pool_buffers * self.hs_buffer_bytes
    }

    /// Sum of all parts.
    pub fn total(&self) -> u64 {
        self.hs_pool().saturating_add(self.stream_receive)
    }
}

/// One phase of a drafter step, in schedule order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum StepPhase {
    /// Host-to-device copy of the batch.
    Copy,
    /// Forward pass up to the final norm and heads.
    Forward,
    /// Fused vocabulary loss and its gradient.
    Loss,
    /// Backward pass.
    Backward,
    /// Gradient all-reduce over drafter workers.
    AllReduce,
    /// Fused AdamW.
    Optimizer,
}

/// Telemetry settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TelemetrySpec {
    /// Status-line period in milliseconds.
    pub every_ms: u64,
    /// Chrome/Perfetto trace output path, when requested.
    pub trace: Option<String>,
}
