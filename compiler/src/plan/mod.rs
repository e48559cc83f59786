//! The compiled plan: plain data that the runtime executes.
//!
//! Everything here is derived from a checked `.pipe` file. The runtime never re-reads the source: stage
//! placement, queue semantics, the model's flat parameter layout, per-bucket shapes and the memory plan are all
//! decided here. The stages' settings are in [`stages`], the figures the compiler derives (tensor layout,
//! bucket costs, memory) in [`derived`], and each model family's dimensions in its own module under
//! [`family`](crate::family), re-exported here so the runtime has one path to every plan type.

use serde::{Deserialize, Serialize};

pub mod derived;
pub mod masks;
pub mod stages;

pub use crate::family::dflash::{DFLASH_RMS_NORM_EPS, DflashSpec};
pub use crate::family::eagle3::{EAGLE3_DEFAULT_TTT, EAGLE3_RMS_NORM_EPS, EAGLE3_TAPS, Eagle3Spec};
pub use crate::family::mlp::MlpSpec;
pub use crate::family::{Family, ModelSpec};
pub use crate::workspace::{BackendKind, WorkspaceLayout};
pub use derived::{BucketPlan, DeviceMemory, HostMemory, StepPhase, TensorView};
pub use masks::{DEFAULT_MAX_BAD_MASK_SHARE, MaskChecks};
pub use stages::*;

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
    /// The draft-and-verify check `draftpipe run` runs every N steps, when the pipeline has an `acceptance`
    /// section.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acceptance: Option<AcceptanceSpec>,
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
            parameters: spec.family().parameter_count(),
            layout: spec.family().layout(),
            spec,
        }
    }
}

impl Plan {
    /// Whether the drafters take rounds of one bucket from the queue: data-parallel workers (`sync = allreduce`,
    /// more than one) under a pull policy that picks by bucket. `fifo` keeps its one order over all buckets
    /// instead (rounds would make the order of a run depend on timing, and a resume would not retrace it), so
    /// its synced replicas may step batches of different buckets.
    pub fn drafters_take_rounds(&self) -> bool {
        self.drafter.sync == SyncMode::AllReduce
            && self.drafter.placement.workers.len() > 1
            && self.queue.pull != PullPolicy::Fifo
    }

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
