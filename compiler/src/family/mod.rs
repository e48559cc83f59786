//! Drafter families: one module each (its spec, checks, cost, workspace and tensor table), registered once here.
//!
//! ```text
//!  drafter { model = NAME(...) } ──REGISTRY[NAME].check──▶ args ──spec──▶ ModelSpec ──family()──▶ &dyn Family
//!                                                                                     (plan, cost, memory, summary)
//! ```
//!
//! This file is the only place that names every family: the [`ModelSpec`] variants (plain serde data in the
//! plan), the one `match` that turns a spec into its [`Family`], and the registry of the names the grammar
//! accepts with their argument checkers. Adding a family is a module beside `mlp` and `dflash` and one line in
//! each of those three places; the checks, the cost model and the summary ask the family, never match on it.

use serde::{Deserialize, Serialize};

use crate::ast::Call;
use crate::plan::derived::{BucketPlan, TensorView};
use crate::plan::stages::{LossSpec, Precision, TargetStage};
use crate::workspace::{BackendKind, WorkspaceLayout};

mod attention;
pub mod dflash;
pub mod eagle3;
mod interface;
pub mod mlp;

pub use interface::Family;
pub(crate) use interface::{Errs, ModelArgs, TargetFacts};

/// The drafter model family and its dimensions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ModelSpec {
    /// `model = mlp(...)`.
    Mlp(mlp::MlpSpec),
    /// `model = dflash(...)`.
    Dflash(dflash::DflashSpec),
    /// `model = eagle3(...)`.
    Eagle3(eagle3::Eagle3Spec),
}

impl From<mlp::MlpSpec> for ModelSpec {
    fn from(spec: mlp::MlpSpec) -> Self {
        ModelSpec::Mlp(spec)
    }
}

impl From<dflash::DflashSpec> for ModelSpec {
    fn from(spec: dflash::DflashSpec) -> Self {
        ModelSpec::Dflash(spec)
    }
}

impl From<eagle3::Eagle3Spec> for ModelSpec {
    fn from(spec: eagle3::Eagle3Spec) -> Self {
        ModelSpec::Eagle3(spec)
    }
}

/// The families the grammar accepts, in the order the checker lists them.
pub(crate) static REGISTRY: [Registered; 3] = [
    Registered::of::<mlp::MlpArgs>(),
    Registered::of::<dflash::DflashArgs>(),
    Registered::of::<eagle3::Eagle3Args>(),
];

impl ModelSpec {
    /// The family's facts: the one place that matches on the family.
    pub fn family(&self) -> &dyn Family {
        match self {
            ModelSpec::Mlp(spec) => spec,
            ModelSpec::Dflash(spec) => spec,
            ModelSpec::Eagle3(spec) => spec,
        }
    }

    /// The `.pipe` name of the family (`mlp`, `dflash`, ...).
    pub fn kind(&self) -> &'static str {
        self.family().name()
    }

    /// The `mlp` dimensions, when this is an `mlp`.
    pub fn as_mlp(&self) -> Option<&mlp::MlpSpec> {
        match self {
            ModelSpec::Mlp(spec) => Some(spec),
            _ => None,
        }
    }

    /// The `dflash` dimensions, when this is a `dflash`.
    pub fn as_dflash(&self) -> Option<&dflash::DflashSpec> {
        match self {
            ModelSpec::Dflash(spec) => Some(spec),
            _ => None,
        }
    }

    /// The `eagle3` dimensions, when this is an `eagle3`.
    pub fn as_eagle3(&self) -> Option<&eagle3::Eagle3Spec> {
        match self {
            ModelSpec::Eagle3(spec) => Some(spec),
            _ => None,
        }
    }

    /// The closed-form count of trained parameters.
    pub fn parameter_count(&self) -> usize {
        self.family().parameter_count()
    }

    /// The flat layout of the trained parameters, in buffer order.
    pub fn layout(&self) -> Vec<TensorView> {
        self.family().layout()
    }

    /// Whether the drafter reads a draft vocabulary map (the drafter's `vocab_map`, or one computed from the
    /// source's data before training).
    pub fn takes_vocab_map(&self) -> bool {
        registered(self.kind()).is_some_and(|family| family.takes_vocab_map)
    }

    /// Whether the drafter reads the target's final-norm output (`last_hidden_states`) beside the taps.
    pub fn reads_last_hidden_states(&self) -> bool {
        registered(self.kind()).is_some_and(|family| family.reads_last_hidden_states)
    }

    /// Whether the drafter reads the target's frozen embedding and `lm_head` (the target's `weights`).
    pub fn reads_target_weights(&self) -> bool {
        registered(self.kind()).is_some_and(|family| family.reads_target_weights)
    }
}

impl WorkspaceLayout {
    /// The workspace of `spec`'s model family ([`Family::workspace`]: [`WorkspaceLayout::mlp`],
    /// [`WorkspaceLayout::dflash`], ...).
    pub fn of_model(
        spec: &ModelSpec,
        buckets: &[BucketPlan],
        loss: &LossSpec,
        backend: BackendKind,
        precision: Precision,
    ) -> Option<Self> {
        spec.family().workspace(buckets, loss, backend, precision)
    }
}

/// A registered family as the checker sees it: its facts and its argument checker.
pub(crate) struct Registered {
    /// The `.pipe` name.
    pub name: &'static str,
    /// `a` or `an` before the name.
    pub article: &'static str,
    /// The loss key that weighs its predictions, and what it weighs.
    pub weighting: (&'static str, &'static str),
    /// Whether it reads the target's frozen weights.
    pub reads_target_weights: bool,
    /// How many tapped layers it reads, when it fixes the number.
    pub taps: Option<usize>,
    /// Whether it takes a draft vocabulary map (`vocab_map`).
    pub takes_vocab_map: bool,
    /// Whether it reads `last_hidden_states`.
    pub reads_last_hidden_states: bool,
    /// Whether `python -m draftpipe_client.speculative` has a draft-and-verify loop for its export (the
    /// pipeline's `acceptance` section).
    pub acceptance_loop: bool,
    /// Checks `model = NAME(...)`'s arguments.
    pub check: fn(&mut Errs, &Call) -> Option<Box<dyn CheckedModel>>,
}

impl Registered {
    const fn of<A: ModelArgs>() -> Self
    where
        A::Spec: Into<ModelSpec>,
    {
        Self {
            name: A::NAME,
            article: A::ARTICLE,
            weighting: A::WEIGHTING,
            reads_target_weights: A::READS_TARGET_WEIGHTS,
            taps: A::TAPS,
            takes_vocab_map: A::TAKES_VOCAB_MAP,
            reads_last_hidden_states: A::READS_LAST_HIDDEN_STATES,
            acceptance_loop: A::ACCEPTANCE_LOOP,
            check: check_boxed::<A>,
        }
    }
}

fn check_boxed<A: ModelArgs>(errs: &mut Errs, call: &Call) -> Option<Box<dyn CheckedModel>>
where
    A::Spec: Into<ModelSpec>,
{
    A::check(errs, call).map(|args| Box::new(args) as Box<dyn CheckedModel>)
}

/// The registered family called `name`.
pub(crate) fn registered(name: &str) -> Option<&'static Registered> {
    REGISTRY.iter().find(|family| family.name == name)
}

/// A family's checked arguments, whatever the family: what the checker does with them once they are valid.
pub(crate) trait CheckedModel {
    /// [`ModelArgs::check_against_target`].
    fn check_against_target(&self, target: &TargetFacts, errs: &mut Errs);
    /// [`ModelArgs::spec`], as a [`ModelSpec`].
    fn spec(&self, target: &TargetStage) -> ModelSpec;
}

impl<A: ModelArgs> CheckedModel for A
where
    A::Spec: Into<ModelSpec>,
{
    fn check_against_target(&self, target: &TargetFacts, errs: &mut Errs) {
        ModelArgs::check_against_target(self, target, errs);
    }

    fn spec(&self, target: &TargetStage) -> ModelSpec {
        ModelArgs::spec(self, target).into()
    }
}
