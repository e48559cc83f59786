//! The target stage's loss-mask checks (`end_of_turn`, `max_bad_mask_share`): what the runtime's sources count
//! in every sequence's loss mask before and while it trains (`runtime/src/source/mask_check.rs`).

use serde::{Deserialize, Serialize};

/// The share of sequences with a bad loss mask a run accepts when `max_bad_mask_share` is not written: 1%.
pub const DEFAULT_MAX_BAD_MASK_SHARE: f64 = 0.01;

/// How the sources judge the loss masks of the data.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MaskChecks {
    /// The target's end-of-turn token (`end_of_turn`, e.g. Qwen's `<|im_end|>` = 151645). Writing it says the
    /// data is chat whose masks select the assistant's turns: each masked span must then end on this token, and
    /// a mask of all ones (the prompt trained on too) counts as bad. `None`: the data may be plain text, whose
    /// masks are all ones by design, so only masks of all zeros count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_of_turn: Option<u32>,
    /// The largest share (0–1) of sequences with a bad mask the run accepts (`max_bad_mask_share`): a file
    /// source over it refuses to start, a stream refuses the producer that goes over it.
    #[serde(default = "default_max_bad_share")]
    pub max_bad_share: f64,
}

fn default_max_bad_share() -> f64 {
    DEFAULT_MAX_BAD_MASK_SHARE
}

impl Default for MaskChecks {
    fn default() -> Self {
        Self {
            end_of_turn: None,
            max_bad_share: DEFAULT_MAX_BAD_MASK_SHARE,
        }
    }
}
