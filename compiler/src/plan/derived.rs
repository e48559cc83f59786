//! What the compiler derives from the stages and the model: the flat tensor layout ([`TensorView`]), each
//! bucket's shape and cost ([`BucketPlan`]), memory per device and on the host, the step's phases.

use serde::{Deserialize, Serialize};

use crate::plan::stages::Device;

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
