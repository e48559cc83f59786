//! The figures a check's child writes (`--json`, the shape `python -m draftpipe_client.speculative` gives),
//! read with a size bound and checked against what the loop can report before the run records them.
//!
//! ```text
//!  step-N.json ──foreign_file::read_limited (1 MiB)──▶ LoopFigures ──check_ranges──▶ AcceptanceMeasurement
//!                                                                    └─ impossible: the check fails, naming the field
//! ```
//!
//! The ranges follow the loop's definitions: τ is the mean accepted length per verifying target forward with
//! the bonus token counted (1 up to the block, 0 when nothing was verified), the teacher-forced τ is
//! `1 + Σ_k Π_{j≤k} acc_j` (1 up to the block), the gap is `1 − τ / teacher-forced τ`, acceptance per position
//! is a share that cannot grow with the position, every prompt generates at least one token, and each target
//! forward yields at least one token.

use std::path::Path;

use serde::Deserialize;

use crate::foreign_file;

/// The largest figures file read (1 MiB: the loop's is under 1 KiB for a block of 16).
pub const MAX_FIGURES_BYTES: u64 = 1 << 20;
/// How far a figure the loop derives from others may be off by rounding.
const ROUNDING: f64 = 1e-6;

/// The figures of `python -m draftpipe_client.speculative --json` that the run records.
#[derive(Deserialize)]
pub(super) struct LoopFigures {
    pub(super) tau: f64,
    /// The loop's own teacher-forced figures on the same sequences (an older client names the simulated one
    /// `teacher_forced_tau`).
    #[serde(default, alias = "teacher_forced_tau")]
    pub(super) teacher_forced_tau_simulated: Option<f64>,
    #[serde(default)]
    pub(super) teacher_forced_tau_exact: Option<f64>,
    #[serde(default)]
    pub(super) gap: Option<f64>,
    pub(super) acceptance_by_position: Vec<f64>,
    #[serde(default)]
    pub(super) target_forwards_per_token: Option<f64>,
    pub(super) prompts: u64,
    pub(super) generated_tokens: u64,
}

impl LoopFigures {
    /// Reads and checks the figures in `path`; the error says what is wrong (unreadable, not the loop's shape,
    /// impossible).
    pub(super) fn read(path: &Path) -> Result<Self, String> {
        let bytes =
            foreign_file::read_limited(path, MAX_FIGURES_BYTES).map_err(|e| e.to_string())?;
        let figures: Self = serde_json::from_slice(&bytes).map_err(|error| {
            format!(
                "{} is not the loop's figures ({error}): expected `tau`, `acceptance_by_position`, `prompts` \
                 and `generated_tokens`",
                path.display()
            )
        })?;
        figures.check_ranges().map_err(|problem| {
            format!(
                "{} reports impossible figures: {problem}; the check counts as failed",
                path.display()
            )
        })?;
        Ok(figures)
    }

    /// The first figure outside what the loop can report, in words.
    fn check_ranges(&self) -> Result<(), String> {
        let positions = self.acceptance_by_position.len();
        let block = 1.0 + positions as f64;
        let mut previous = 1.0;
        for (index, &share) in self.acceptance_by_position.iter().enumerate() {
            if !(0.0..=1.0).contains(&share) {
                return Err(format!(
                    "`acceptance_by_position[{index}]` is {share}, not a share in [0, 1]"
                ));
            }
            if share > previous {
                return Err(format!(
                    "`acceptance_by_position[{index}]` is {share}, above the position before it ({previous}): a \
                     slot is accepted only when the slots before it are"
                ));
            }
            previous = share;
        }
        if !(self.tau == 0.0 || (1.0..=block).contains(&self.tau)) {
            return Err(format!(
                "`tau` is {}, not in [1, {block}] (the mean accepted length per verify, the bonus token counted, \
                 with {positions} drafted positions; 0 when nothing was verified)",
                self.tau
            ));
        }
        if let Some(teacher_forced) = self.teacher_forced_tau_simulated
            && !(1.0..=block).contains(&teacher_forced)
        {
            return Err(format!(
                "`teacher_forced_tau_simulated` is {teacher_forced}, not in [1, {block}] (1 + Σ_k Π_j≤k acc_j over \
                 {positions} drafted positions)"
            ));
        }
        if let Some(exact) = self.teacher_forced_tau_exact
            && !(1.0..=block).contains(&exact)
        {
            return Err(format!(
                "`teacher_forced_tau_exact` is {exact}, not in [1, {block}] (1 + the mean accepted prefix over \
                 {positions} drafted positions)"
            ));
        }
        match (self.gap, self.teacher_forced_tau_simulated) {
            (Some(gap), Some(teacher_forced)) => {
                let expected = 1.0 - self.tau / teacher_forced;
                let off = (gap - expected).abs();
                if off.is_nan() || off > ROUNDING {
                    return Err(format!(
                        "`gap` is {gap}, but 1 − tau / teacher_forced_tau_simulated is {expected} (tau {}, teacher-forced {})",
                        self.tau, teacher_forced
                    ));
                }
            }
            (Some(gap), None) if !(gap < 1.0 && gap > -block) => {
                return Err(format!(
                    "`gap` is {gap}, not in (−{block}, 1) (1 − tau / teacher_forced_tau_simulated)"
                ));
            }
            _ => {}
        }
        if self.prompts == 0 {
            return Err("`prompts` is 0: no prompt was decoded".to_owned());
        }
        if self.generated_tokens < self.prompts {
            return Err(format!(
                "`generated_tokens` is {}, fewer than the {} prompts (each generates at least one token)",
                self.generated_tokens, self.prompts
            ));
        }
        if let Some(per_token) = self.target_forwards_per_token {
            // At least the prefill of each prompt, at most one forward per generated token.
            let least = self.prompts as f64 / self.generated_tokens as f64;
            if !(per_token >= least - ROUNDING && per_token <= 1.0 + ROUNDING) {
                return Err(format!(
                    "`target_forwards_per_token` is {per_token}, not in [{least}, 1] (one prefill per prompt over \
                     {} generated tokens at least, one forward per token at most)",
                    self.generated_tokens
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One change to the loop's figures.
    type Edit = fn(&mut LoopFigures);

    fn figures(edit: impl FnOnce(&mut LoopFigures)) -> Result<(), String> {
        let mut figures = LoopFigures {
            tau: 1.75,
            teacher_forced_tau_simulated: Some(2.0),
            teacher_forced_tau_exact: Some(2.1),
            gap: Some(0.125),
            acceptance_by_position: vec![0.5, 0.25],
            target_forwards_per_token: Some(0.6),
            prompts: 4,
            generated_tokens: 96,
        };
        edit(&mut figures);
        figures.check_ranges()
    }

    #[test]
    fn the_loops_own_figures_pass_and_each_impossible_one_is_named() {
        assert_eq!(figures(|_| {}), Ok(()));
        // Nothing verified: τ 0, the gap then 1.
        let nothing_verified = figures(|f| {
            f.tau = 0.0;
            f.gap = Some(1.0);
        });
        assert_eq!(nothing_verified, Ok(()));
        let cases: [(Edit, &str); 9] = [
            (|f| f.tau = -5.0, "`tau` is -5"),
            (|f| f.tau = f64::NAN, "`tau` is NaN"),
            (|f| f.tau = 3.5, "`tau` is 3.5, not in [1, 3]"),
            (|f| f.gap = Some(-4.0), "`gap` is -4"),
            (
                |f| f.acceptance_by_position[1] = 1.5,
                "`acceptance_by_position[1]` is 1.5",
            ),
            (
                |f| f.acceptance_by_position[1] = 0.75,
                "above the position before it",
            ),
            (|f| f.prompts = 0, "`prompts` is 0"),
            (
                |f| f.generated_tokens = 3,
                "`generated_tokens` is 3, fewer than the 4 prompts",
            ),
            (
                |f| f.target_forwards_per_token = Some(1.5),
                "`target_forwards_per_token` is 1.5",
            ),
        ];
        for (edit, expected) in cases {
            let error = figures(edit).unwrap_err();
            assert!(error.contains(expected), "{error} (expected {expected})");
        }
    }
}
