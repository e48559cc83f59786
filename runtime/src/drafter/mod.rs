//! A drafter on one backend: the batch checks, staging into input slots, the step (forward/loss/backward, the
//! gradient average, the update) and the read-back of its results, written once for every backend and for
//! every model family (a [`Family`] built by the [`registry`], asked through its trait).
//!
//! ```text
//!  stage(batch n+1) ── checks ──▶ Backend::stage (CUDA: pinned copy, async H2D into the free slot)
//!                                  └─ Family::stage (dflash: the batch's block plan, anchors seeded by (seed, step))
//!  step()  begin_step ─▶ run_part(ForwardBackward{bucket, slot}) ─▶ average_gradients ─▶ run_part(Update)
//!          ─▶ end_step (read-back of [grad_norm, clip, loss, the family's extra values] queued)
//!          ─▶ results of step n (CUDA) or n+1 (CPU), with Family::metrics (dflash: per-slot accuracy, τ)
//!  finish() results of the last step still in flight (CUDA), nothing on the CPU
//! ```
//!
//! On CUDA the host never waits for the step it has just launched: the outcome of step n is returned by the
//! call that launches step n + 1 (or by [`Drafter::finish`]). On the CPU the step has run when `step` returns,
//! and its outcome comes back at once. The gradient average runs between the two captured parts, never inside
//! a graph (NCCL's graph rules; see `docs/gpu.md`).

pub mod cpu;
pub mod cuda;
mod error;

pub use error::{DrafterError, StepError};

use std::any::Any;
use std::collections::VecDeque;
use std::time::Instant;

use draftpipe_compiler::plan::{
    AdamWSpec, BackendKind, BucketPlan, LossSpec, ModelPlan, Precision,
};

use crate::backend::{Backend, HostBatch, StepPart};
use crate::batch::{HsBatch, HsDtype};
use crate::model::eagle3::Eagle3;
use crate::model::family::FamilyPlan;
use crate::model::registry;
use crate::model::step::{PhaseTimes, StepShape};
use crate::model::{BlockMetrics, Family};
use crate::params::FlatState;

/// What [`Drafter::evaluate`] reports for one batch.
#[derive(Debug, Clone, PartialEq)]
pub struct Evaluation {
    /// The batch's loss.
    pub loss: f32,
    /// Its tokens.
    pub tokens: u64,
    /// `dflash`: per-slot accuracy and τ.
    pub blocks: Option<BlockMetrics>,
    /// `dflash`: per block slot, the rows predicted right and the rows with a label (the counts behind
    /// `blocks`, which `draftpipe eval` adds up over many batches); empty for `mlp`.
    pub slot_counts: Vec<(f32, u32)>,
}

/// What one finished step reports.
#[derive(Debug, Clone, PartialEq)]
pub struct StepOutcome {
    /// Index of the step since the drafter was created.
    pub index: u64,
    /// Its loss.
    pub loss: f32,
    /// Global gradient norm before clipping (non-finite: the update was skipped).
    pub grad_norm: f32,
    /// Factor the gradients were scaled by.
    pub clip_scale: f32,
    /// Tokens of its batch.
    pub tokens: u64,
    /// Device time of the whole step, milliseconds (CUDA events); `None` on the CPU.
    pub device_ms: Option<f32>,
    /// Host time of each phase, on a synchronous backend (CPU); `None` on CUDA, where the host only enqueues.
    pub phases: Option<StepPhases>,
    /// Host time spent in `step()` issuing it (up to, not including, reading back an earlier step), µs.
    pub host_us: f32,
    /// A `dflash` step's per-slot accuracy and τ (`None` for `mlp`).
    pub blocks: Option<BlockMetrics>,
}

impl StepOutcome {
    /// True when the update was skipped (non-finite gradient norm).
    pub fn skipped(&self) -> bool {
        !self.grad_norm.is_finite()
    }
}

/// Host time of each phase of a step on a synchronous backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StepPhases {
    /// Forward, loss, backward.
    pub compute: PhaseTimes,
    /// The gradient average.
    pub all_reduce: std::time::Duration,
    /// Gradient norm and AdamW.
    pub optimizer: std::time::Duration,
}

/// A staged batch waiting for its step.
#[derive(Debug, Clone)]
struct Staged {
    bucket: usize,
    slot: usize,
    tokens: u64,
    /// `dflash`: labelled rows per block slot.
    labelled: Option<Vec<u32>>,
}

/// A launched step whose results are not read yet.
#[derive(Debug, Clone)]
struct InFlight {
    index: u64,
    ring: usize,
    tokens: u64,
    phases: Option<StepPhases>,
    host_us: f32,
    labelled: Option<Vec<u32>>,
}

/// A drafter (any model family) on backend `B`. See the module docs.
pub struct Drafter<B: Backend> {
    /// Declared before `model`, so it drops first: the CUDA backend's `Drop` waits for its streams before the
    /// model's device buffers, which work in flight may still read, are freed.
    backend: B,
    model: Box<dyn Family<B>>,
    buckets: Vec<BucketPlan>,
    parameters: usize,
    slots: usize,
    next_slot: usize,
    staged: Option<Staged>,
    in_flight: VecDeque<InFlight>,
    launched: u64,
    /// `dflash`'s anchor draw: the run's seed and the training step of the first step launched here.
    sampler: (u64, u64),
}

impl<B: Backend> Drafter<B> {
    /// A drafter for `model` on `backend`, with the workspace of `buckets` at `precision` (allocated here, once),
    /// parameters and moments zero: load them with [`Drafter::upload_state`].
    ///
    /// # Errors
    /// [`DrafterError::Layout`] when `model` is not a canonical layout; allocation failures.
    pub fn new(
        backend: B,
        model: &ModelPlan,
        training: (LossSpec, AdamWSpec, Precision),
        buckets: &[BucketPlan],
    ) -> Result<Self, DrafterError> {
        Self::with_hs_dtype(backend, model, training, buckets, HsDtype::F32)
    }

    /// [`Drafter::new`] for batches whose hidden states are held in `hs_dtype` (the plan's `hs_dtype`): the
    /// input slots hold that precision where the backend reads it directly ([`WorkspaceLayout::with_hs_dtype`]).
    ///
    /// # Errors
    /// As [`Drafter::new`].
    pub fn with_hs_dtype(
        mut backend: B,
        model: &ModelPlan,
        settings: (LossSpec, AdamWSpec, Precision),
        buckets: &[BucketPlan],
        hs_dtype: HsDtype,
    ) -> Result<Self, DrafterError> {
        let (loss, optimizer, precision) = settings;
        let plan = FamilyPlan {
            model,
            loss,
            optimizer,
            precision,
            buckets,
            hs_dtype,
        };
        let (built, layout) = registry::build(&mut backend, plan)?;
        Ok(Self {
            backend,
            model: built,
            buckets: buckets.to_vec(),
            parameters: model.parameters,
            slots: layout.input_slots.max(1),
            next_slot: 0,
            staged: None,
            in_flight: VecDeque::with_capacity(2),
            launched: 0,
            sampler: (0, 0),
        })
    }

    /// Seeds `dflash`'s anchor draw with the run's `seed`, the first step launched here being training step
    /// `first_step` (a resumed run passes its step count, so it draws the anchors the uninterrupted run would).
    pub fn seed_sampler(&mut self, seed: u64, first_step: u64) {
        self.sampler = (seed, first_step);
    }

    /// Sets the step count the learning-rate schedule runs over (the drafter's `steps`); call it before the
    /// first step (a captured update keeps the value). Without it a linear or cosine schedule has no length.
    pub fn set_schedule_total(&mut self, total_steps: u64) {
        self.model.optimizer_mut().set_schedule_total(total_steps);
    }

    /// Copies the target's frozen embedding and `lm_head` (`[vocab, hidden]` each) into a model that reads
    /// them (`dflash`).
    ///
    /// # Errors
    /// [`DrafterError::Frozen`] for a family without frozen tensors (`mlp`) or tensors of the wrong size;
    /// backend failures.
    pub fn upload_frozen(&mut self, embed: &[f32], lm_head: &[f32]) -> Result<(), DrafterError> {
        let family = self.model.name();
        let Some((embed_buf, lm_head_buf)) = self.model.frozen_mut() else {
            return Err(DrafterError::Frozen(format!(
                "the {family} drafter has no frozen tensors"
            )));
        };
        let expected = embed_buf.len();
        for (name, len) in [("embedding", embed.len()), ("lm_head", lm_head.len())] {
            if len != expected {
                return Err(DrafterError::Frozen(format!(
                    "{name} has {len} elements, the model needs vocab × hidden = {expected}"
                )));
            }
        }
        self.backend.upload(embed_buf.all_mut(), embed)?;
        self.backend.upload(lm_head_buf.all_mut(), lm_head)?;
        self.model.frozen_uploaded(&mut self.backend)?;
        Ok(())
    }

    /// Copies an `eagle3` model's draft vocabulary (`d2t` offsets `[draft_vocab]`, `t2d` mask `[vocab]`, as
    /// SpecForge's `vocab_mapping` writes them) to the device; its teacher rows of the target's `lm_head` are
    /// gathered from them before the next step.
    ///
    /// # Errors
    /// [`DrafterError::Frozen`] for another family or a map that does not fit; backend failures.
    pub fn upload_vocab_map(&mut self, d2t: &[i64], t2d: &[bool]) -> Result<(), DrafterError> {
        let family = self.model.name();
        let Some(eagle3) = (self.model.as_mut() as &mut dyn Any).downcast_mut::<Eagle3<B>>() else {
            return Err(DrafterError::Frozen(format!(
                "the {family} drafter has no draft vocabulary"
            )));
        };
        eagle3
            .upload_vocab_map(&mut self.backend, d2t, t2d)?
            .map_err(|e| DrafterError::Frozen(e.to_string()))
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The backend and the model's buffers (tests, benchmarks).
    pub fn parts_mut(&mut self) -> (&mut B, &mut dyn Family<B>) {
        (&mut self.backend, self.model.as_mut())
    }

    /// The model's buffers.
    pub fn model(&self) -> &dyn Family<B> {
        self.model.as_ref()
    }

    /// Bytes of device memory this drafter allocated: the flat state and the workspace layout's buffers.
    pub fn allocated_bytes(&self) -> u64 {
        self.backend.allocated_bytes()
    }

    /// Copies `state`'s parameters, moments and step count to the device and waits (not a step-path call).
    ///
    /// # Errors
    /// [`StepError::StateSize`] when a buffer's length is not the model's; backend failures.
    pub fn upload_state(&mut self, state: &FlatState) -> Result<(), DrafterError> {
        self.check_state(state)?;
        let adamw = self.model.optimizer().adamw_state_for(state.step);
        let be = &mut self.backend;
        let (flat, adamw_state) = self.model.state_mut();
        be.upload(flat.params.all_mut(), &state.params)?;
        flat.refresh_bf16(be)?;
        be.upload(flat.exp_avg.all_mut(), &state.exp_avg)?;
        be.upload(flat.exp_avg_sq.all_mut(), &state.exp_avg_sq)?;
        be.upload(adamw_state.all_mut(), &adamw)?;
        Ok(())
    }

    /// Copies parameters, gradients, moments and the applied step count into `state`.
    ///
    /// # Errors
    /// [`DrafterError::StepInFlight`] until [`Drafter::finish`] has collected the last step (whose outcome
    /// would otherwise be lost); size mismatches; backend failures.
    pub fn download_state(&mut self, state: &mut FlatState) -> Result<(), DrafterError> {
        if !self.in_flight.is_empty() {
            return Err(DrafterError::StepInFlight);
        }
        self.check_state(state)?;
        let be = &mut self.backend;
        let (flat, adamw_state) = self.model.state_mut();
        be.download(flat.params.all(), &mut state.params)?;
        be.download(flat.grads.all(), &mut state.grads)?;
        be.download(flat.exp_avg.all(), &mut state.exp_avg)?;
        be.download(flat.exp_avg_sq.all(), &mut state.exp_avg_sq)?;
        let mut adamw = [0.0f64; 3];
        be.download(adamw_state.all(), &mut adamw)?;
        state.step = adamw[0] as u64;
        Ok(())
    }

    fn check_state(&self, state: &FlatState) -> Result<(), StepError> {
        let expected = self.parameters;
        for len in [
            state.params.len(),
            state.grads.len(),
            state.exp_avg.len(),
            state.exp_avg_sq.len(),
        ] {
            if len != expected {
                return Err(StepError::StateSize { expected, got: len });
            }
        }
        Ok(())
    }

    /// Checks `batch` against the model and buckets: the one set of batch checks of every backend.
    ///
    /// # Errors
    /// [`StepError`] naming what does not fit.
    pub fn check_batch(&self, batch: &HsBatch) -> Result<usize, StepError> {
        let (din, vocab) = self.model.input_width_and_vocab();
        let bucket = self
            .buckets
            .iter()
            .position(|b| b.padded_len == batch.padded_len && b.sequences == batch.sequences)
            .ok_or(StepError::NoBucket {
                padded_len: batch.padded_len,
                sequences: batch.sequences,
            })?;
        if batch.din != din {
            return Err(StepError::WrongDin {
                expected: din,
                got: batch.din,
            });
        }
        // A slot widens a narrower batch exactly; it never rounds one, except that CUDA holds f16 batches in bf16
        // slots (its products of them are bf16 ones: `WorkspaceLayout::with_hs_dtype`).
        let slot_dtype = self.model.input_hs_dtype();
        let held_as_bf16 = batch.hs.dtype() == HsDtype::F16
            && slot_dtype == HsDtype::Bf16
            && self.backend.kind() == BackendKind::Cuda;
        if batch.hs.dtype() != slot_dtype && slot_dtype != HsDtype::F32 && !held_as_bf16 {
            return Err(StepError::HsDtype {
                expected: slot_dtype.name(),
                got: batch.hs.dtype().name(),
            });
        }
        let tokens = batch.tokens();
        if tokens == 0 {
            return Err(StepError::EmptyBatch);
        }
        let sizes = [
            ("hs", tokens * batch.din, batch.hs.len()),
            ("input_ids", tokens, batch.input_ids.len()),
            ("loss_mask", tokens, batch.loss_mask.len()),
            ("seq_lens", batch.sequences, batch.seq_lens.len()),
        ];
        // The teacher's input, for a family that reads it (checked without allocating: the step path is
        // allocation-free).
        let last = match self.model.last_hidden_width() {
            Some(hidden) => {
                let last = batch
                    .last_hidden_states
                    .as_ref()
                    .ok_or(StepError::MissingLastHiddenStates { hidden })?;
                if last.dtype() != batch.hs.dtype() {
                    return Err(StepError::LastHiddenDtype {
                        expected: batch.hs.dtype().name(),
                        got: last.dtype().name(),
                    });
                }
                Some(("last_hidden_states", tokens * hidden, last.len()))
            }
            None => None,
        };
        for (buffer, expected, got) in sizes.into_iter().chain(last) {
            if expected != got {
                return Err(StepError::BatchBuffer {
                    buffer,
                    expected,
                    got,
                });
            }
        }
        for (sequence, &len) in batch.seq_lens.iter().enumerate() {
            if len as usize > batch.padded_len {
                return Err(StepError::SequenceTooLong {
                    sequence,
                    len,
                    padded_len: batch.padded_len,
                });
            }
            let start = sequence * batch.padded_len;
            for position in start..start + len as usize {
                let id = batch.input_ids[position];
                if id as usize >= vocab {
                    return Err(StepError::TokenOutOfRange {
                        position,
                        id,
                        vocab,
                    });
                }
            }
        }
        Ok(bucket)
    }

    /// Checks `batch` and copies it into the next input slot, for the next [`Drafter::step`].
    ///
    /// # Errors
    /// [`StepError`] for a batch that does not fit; backend failures.
    pub fn stage(&mut self, batch: &HsBatch) -> Result<(), DrafterError> {
        let bucket = self.check_batch(batch)?;
        let slot = self.next_slot;
        self.backend
            .stage(slot, HostBatch::from(batch), self.model.input_mut(slot))?;
        let (seed, first) = self.sampler;
        let labelled = self.model.stage(
            &mut self.backend,
            slot,
            batch,
            (seed, first + self.launched),
        )?;
        self.staged = Some(Staged {
            bucket,
            slot,
            tokens: batch.tokens() as u64,
            labelled,
        });
        self.next_slot = (slot + 1) % self.slots;
        Ok(())
    }

    /// Runs (CPU) or launches (CUDA) the step of the staged batch, and returns the outcome of the step that
    /// is now complete: this one on a synchronous backend, the previous one on an asynchronous one.
    ///
    /// # Errors
    /// [`DrafterError::NothingStaged`]; backend failures.
    pub fn step(&mut self) -> Result<Option<StepOutcome>, DrafterError> {
        let begin = Instant::now();
        let Staged {
            bucket,
            slot,
            tokens,
            labelled,
        } = self.staged.take().ok_or(DrafterError::NothingStaged)?;
        let ring = (self.launched % 2) as usize;
        let shape = StepShape {
            padded_len: self.buckets[bucket].padded_len,
            sequences: self.buckets[bucket].sequences,
        };
        let (be, model) = (&mut self.backend, self.model.as_mut());
        be.begin_step(slot, ring)?;
        let mut compute = PhaseTimes::default();
        be.run_part(StepPart::ForwardBackward { bucket, slot }, &mut |be| {
            compute = model.forward_backward(be, shape, slot)?;
            Ok(())
        })?;
        let reduce_started = Instant::now();
        be.average_gradients(model.state_mut().0.grads.all_mut())?;
        let update_started = Instant::now();
        be.run_part(StepPart::Update, &mut |be| model.update(be))?;
        let phases = StepPhases {
            compute,
            all_reduce: update_started - reduce_started,
            optimizer: update_started.elapsed(),
        };
        be.end_step(slot, ring, model.step_scalars().all())?;
        let synchronous = !be.asynchronous();
        self.in_flight.push_back(InFlight {
            index: self.launched,
            ring,
            tokens,
            phases: synchronous.then_some(phases),
            host_us: begin.elapsed().as_secs_f32() * 1e6,
            labelled,
        });
        self.launched += 1;
        if synchronous || self.in_flight.len() > 1 {
            self.collect().map(Some)
        } else {
            Ok(None)
        }
    }

    /// Evaluates `batch` without training: forward and loss only, waited for. `dflash` draws the batch's
    /// anchors as a step at the current step index would. Nothing of the model changes.
    ///
    /// # Errors
    /// [`DrafterError::StepInFlight`] while a step's outcome is still to be collected ([`Drafter::finish`]);
    /// [`StepError`] for a batch that does not fit; backend failures.
    pub fn evaluate(&mut self, batch: &HsBatch) -> Result<Evaluation, DrafterError> {
        if !self.in_flight.is_empty() {
            return Err(DrafterError::StepInFlight);
        }
        self.stage(batch)?;
        let Staged {
            bucket,
            slot,
            tokens,
            labelled,
        } = self.staged.take().ok_or(DrafterError::NothingStaged)?;
        let shape = StepShape {
            padded_len: self.buckets[bucket].padded_len,
            sequences: self.buckets[bucket].sequences,
        };
        let (be, model) = (&mut self.backend, self.model.as_mut());
        be.begin_step(slot, 0)?;
        model.forward_loss(be, shape, slot)?;
        be.end_step(slot, 0, model.step_scalars().all())?;
        let results = be.read_results(0)?;
        let slot_counts = labelled.as_ref().map_or_else(Vec::new, |labelled| {
            results
                .extra
                .iter()
                .copied()
                .zip(labelled.iter().copied())
                .collect()
        });
        Ok(Evaluation {
            loss: results.scalars[2],
            tokens,
            blocks: labelled.map(|labelled| model.metrics(&results.extra, &labelled)),
            slot_counts,
        })
    }

    /// Waits for the oldest step in flight and reads its results.
    fn collect(&mut self) -> Result<StepOutcome, DrafterError> {
        let step = self
            .in_flight
            .pop_front()
            .ok_or(DrafterError::NothingStaged)?;
        let results = self.backend.read_results(step.ring)?;
        let [grad_norm, clip_scale, loss] = results.scalars;
        Ok(StepOutcome {
            index: step.index,
            loss,
            grad_norm,
            clip_scale,
            tokens: step.tokens,
            device_ms: results.device_ms,
            phases: step.phases,
            host_us: step.host_us,
            blocks: step
                .labelled
                .map(|labelled| self.model.metrics(&results.extra, &labelled)),
        })
    }

    /// Waits for the last launched step, if one is in flight, and returns its outcome.
    ///
    /// # Errors
    /// Backend failures.
    pub fn finish(&mut self) -> Result<Option<StepOutcome>, DrafterError> {
        if self.in_flight.is_empty() {
            Ok(None)
        } else {
            self.collect().map(Some)
        }
    }

    /// Steps launched since the drafter was created.
    pub fn launched(&self) -> u64 {
        self.launched
    }
}
