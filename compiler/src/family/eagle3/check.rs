//! The `eagle3(...)` arguments: their ranges, the shared attention checks, and the draft vocabulary against the
//! target's. The number of taps (exactly [`EAGLE3_TAPS`]) is a registry fact the checker applies to the target
//! section, so it is reported even when these arguments have errors.

use crate::ast::Call;
use crate::check::fields::Fields;
use crate::check::values::{self, MAX_DIM, MAX_REPEATS};
use crate::diagnostic::Diagnostic;
use crate::family::attention::{self, MAX_HEAD_DIM};
use crate::family::eagle3::{EAGLE3_DEFAULT_TTT, EAGLE3_TAPS, Eagle3Spec};
use crate::family::interface::{Errs, ModelArgs, TargetFacts};
use crate::plan::stages::TargetStage;
use crate::span::Span;

/// Largest `ttt`: every step's activations live until the backward pass, so the workspace grows with it;
/// SpecForge trains with 7.
const MAX_TTT: u64 = 64;

/// The RMSNorm epsilon of every norm (SpecForge's Llama configs for EAGLE-3: `rms_norm_eps` 1e-6).
pub const EAGLE3_RMS_NORM_EPS: f32 = 1e-6;

/// The `eagle3(...)` arguments a drafter section gives (width, taps and vocabulary come from the target).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Eagle3Args {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    intermediate: usize,
    ttt: usize,
    /// The draft vocabulary and where it is written: it must not exceed the target's.
    draft_vocab: (usize, Span),
    rope_theta: f32,
}

impl ModelArgs for Eagle3Args {
    const NAME: &'static str = "eagle3";
    const ARTICLE: &'static str = "an";
    const WEIGHTING: (&'static str, &'static str) = ("step_decay", "the eagle3 unroll's steps");
    const READS_TARGET_WEIGHTS: bool = true;
    const TAPS: Option<usize> = Some(EAGLE3_TAPS);
    const TAKES_VOCAB_MAP: bool = true;
    const READS_LAST_HIDDEN_STATES: bool = true;
    type Spec = Eagle3Spec;

    fn check(errs: &mut Errs, call: &Call) -> Option<Self> {
        let mut f = Fields::new(&call.args, "`eagle3(...)`".to_owned(), call.span, errs);
        let mut dim =
            |key: &'static str, example: &str, (min, max): (u64, u64), errs: &mut Errs| {
                f.required(key, example)
                    .and_then(|v| values::count_in(errs, key, v, min, max).map(|n| (n, v)))
            };
        let heads = dim("heads", "32", (1, MAX_REPEATS), errs);
        let kv_heads = dim("kv_heads", "8", (1, MAX_REPEATS), errs);
        let head_dim = dim("head_dim", "128", (2, MAX_HEAD_DIM), errs);
        let intermediate = dim("intermediate", "12288", (1, MAX_DIM), errs);
        let draft_vocab = dim("draft_vocab", "32000", (1, MAX_DIM), errs);
        let ttt = match f.optional("ttt") {
            Some(v) => values::count_in(errs, "ttt", v, 1, MAX_TTT),
            None => Some(EAGLE3_DEFAULT_TTT),
        };
        let rope_theta = attention::rope_theta(errs, &mut f);
        f.finish(errs);
        let ok = attention::check_heads(errs, heads, kv_heads, head_dim);
        let (draft_vocab, draft_value) = draft_vocab?;
        Some(Eagle3Args {
            heads: heads?.0,
            kv_heads: kv_heads?.0,
            head_dim: head_dim?.0,
            intermediate: intermediate?.0,
            ttt: ttt?,
            draft_vocab: (draft_vocab, draft_value.span),
            rope_theta: rope_theta?,
        })
        .filter(|_| ok)
    }

    /// The draft vocabulary is a subset of the target's: at most as large.
    fn check_against_target(&self, target: &TargetFacts, errs: &mut Errs) {
        let (draft_vocab, span) = self.draft_vocab;
        let Some(vocab) = target.vocab else {
            return;
        };
        if draft_vocab > vocab {
            errs.push(
                Diagnostic::error(
                    span,
                    format!(
                        "`draft_vocab` {draft_vocab} is larger than the target's vocabulary of {vocab} tokens"
                    ),
                )
                .label("more draft tokens than target tokens")
                .help(format!(
                    "the draft vocabulary is the target's most frequent tokens: use at most {vocab} (SpecForge uses 32000)"
                )),
            );
        }
    }

    fn spec(&self, target: &TargetStage) -> Eagle3Spec {
        Eagle3Spec {
            hidden: target.hidden,
            taps: target.tap_layers.len(),
            tap_layers: target.tap_layers.iter().map(|&l| l as usize).collect(),
            vocab: target.vocab,
            draft_vocab: self.draft_vocab.0,
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            intermediate: self.intermediate,
            ttt: self.ttt,
            rope_theta: self.rope_theta,
            rms_norm_eps: EAGLE3_RMS_NORM_EPS,
        }
    }
}
