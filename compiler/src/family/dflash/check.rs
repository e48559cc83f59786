//! The `dflash(...)` arguments: their ranges, the shared attention checks, and the mask token against the
//! target's vocabulary.

use crate::ast::Call;
use crate::check::fields::Fields;
use crate::check::values::{self, MAX_DIM, MAX_REPEATS};
use crate::diagnostic::Diagnostic;
use crate::family::attention::{self, MAX_HEAD_DIM};
use crate::family::dflash::{DFLASH_RMS_NORM_EPS, DflashSpec};
use crate::family::interface::{Errs, ModelArgs, TargetFacts};
use crate::plan::stages::TargetStage;
use crate::span::Span;

/// Largest `layers` of a `dflash` drafter.
const MAX_DFLASH_LAYERS: u64 = 256;
/// Largest `block` (slots per block).
const MAX_BLOCK: u64 = 1024;
/// Largest `anchors` per sequence.
const MAX_ANCHORS: u64 = 1 << 20;

/// The `dflash(...)` arguments a drafter section gives (width, taps and vocabulary come from the target).
#[derive(Debug, Clone, Copy)]
pub(crate) struct DflashArgs {
    layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    intermediate: usize,
    block: usize,
    anchors: usize,
    /// The mask token and where it is written: it must lie inside the target's vocabulary.
    mask_token: (u32, Span),
    rope_theta: f32,
}

impl ModelArgs for DflashArgs {
    const NAME: &'static str = "dflash";
    const ARTICLE: &'static str = "a";
    const WEIGHTING: (&'static str, &'static str) = ("position_decay", "the dflash block's slots");
    const READS_TARGET_WEIGHTS: bool = true;
    const ACCEPTANCE_LOOP: bool = true;
    type Spec = DflashSpec;

    fn check(errs: &mut Errs, call: &Call) -> Option<Self> {
        let mut f = Fields::new(&call.args, "`dflash(...)`".to_owned(), call.span, errs);
        let mut dim =
            |key: &'static str, example: &str, (min, max): (u64, u64), errs: &mut Errs| {
                f.required(key, example)
                    .and_then(|v| values::count_in(errs, key, v, min, max).map(|n| (n, v)))
            };
        let layers = dim("layers", "5", (1, MAX_DFLASH_LAYERS), errs);
        let heads = dim("heads", "32", (1, MAX_REPEATS), errs);
        let kv_heads = dim("kv_heads", "8", (1, MAX_REPEATS), errs);
        let head_dim = dim("head_dim", "128", (2, MAX_HEAD_DIM), errs);
        let intermediate = dim("intermediate", "12288", (1, MAX_DIM), errs);
        let block = dim("block", "16", (2, MAX_BLOCK), errs);
        let anchors = dim("anchors", "512", (1, MAX_ANCHORS), errs);
        let mask_token = dim("mask_token", "151669", (0, u64::from(u32::MAX)), errs);
        let rope_theta = attention::rope_theta(errs, &mut f);
        f.finish(errs);
        let ok = attention::check_heads(errs, heads, kv_heads, head_dim);
        let (mask_token, mask_value) = mask_token?;
        Some(DflashArgs {
            layers: layers?.0,
            heads: heads?.0,
            kv_heads: kv_heads?.0,
            head_dim: head_dim?.0,
            intermediate: intermediate?.0,
            block: block?.0,
            anchors: anchors?.0,
            mask_token: (u32::try_from(mask_token).ok()?, mask_value.span),
            rope_theta: rope_theta?,
        })
        .filter(|_| ok)
    }

    /// The mask token is a token of the target's vocabulary.
    fn check_against_target(&self, target: &TargetFacts, errs: &mut Errs) {
        let (token, span) = self.mask_token;
        let Some(vocab) = target.vocab else {
            return;
        };
        if token as usize >= vocab {
            errs.push(
                Diagnostic::error(
                    span,
                    format!(
                        "`mask_token` {token} is outside the target's vocabulary of {vocab} tokens"
                    ),
                )
                .label("not a token id")
                .help(format!(
                    "use the target's mask (or another unused) token id, below {vocab}"
                )),
            );
        }
    }

    fn spec(&self, target: &TargetStage) -> DflashSpec {
        DflashSpec {
            hidden: target.hidden,
            taps: target.tap_layers.len(),
            tap_layers: target.tap_layers.iter().map(|&l| l as usize).collect(),
            vocab: target.vocab,
            layers: self.layers,
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            intermediate: self.intermediate,
            block: self.block,
            anchors: self.anchors,
            mask_token: self.mask_token.0,
            rope_theta: self.rope_theta,
            rms_norm_eps: DFLASH_RMS_NORM_EPS,
        }
    }
}
