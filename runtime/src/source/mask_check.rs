//! The loss masks of the data, counted as the sources check it: every row of a file or a stream message passes
//! through [`MaskReport::add_row`] in the sources' shared checks (`safetensors::check_tensors`).
//!
//! ```text
//!  file rows ──check_tensors──▶ MaskReport per file ──merge──▶ the dataset's ──check (max_bad_mask_share)──▶ run
//!  message rows ──check_tensors──▶ MaskReport per message ──▶ the connection's (bound) and the run's (summary)
//!                                                       RunSummary.masks ◀── the run's report
//! ```
//!
//! A chat template that marks the wrong tokens trains without any error: the loss falls, on the wrong text. So
//! each row's mask is judged by what the source can see in it:
//!
//! - **all zeros**: a row with tokens and no loss (it trains nothing and is skipped; a template that lost the
//!   assistant's turns makes these);
//! - **all ones**: every position from the row's first token to its last label has loss, the prompt included
//!   (positions after the last label are padding to the source);
//! - **missing end of turn**: a masked span whose last token is not the target's end-of-turn token (a reply
//!   truncated by a length limit, or a template that leaves the token out of the mask).
//!
//! The last two need the data to be chat: they count only when the stage names its `end_of_turn` token
//! ([`MaskChecks`]). Plain text is trained on every token by design, so without it only all zeros count.

use std::sync::Arc;

use draftpipe_compiler::plan::MaskChecks;
use serde::{Deserialize, Serialize};

/// Sequence ids kept per kind: enough to find the template's fault, few enough for one error message.
pub const FIRST_IDS: usize = 5;

/// The rows of one kind of bad mask: how many, and the first few by id (`file row N`, `peer message K row N`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BadMasks {
    /// Rows of this kind.
    pub count: u64,
    /// The first [`FIRST_IDS`] of them, in reading order.
    pub first_ids: Vec<String>,
}

impl BadMasks {
    fn add(&mut self, id: &dyn Fn() -> String) {
        self.count += 1;
        if self.first_ids.len() < FIRST_IDS {
            self.first_ids.push(id());
        }
    }

    fn merge(&mut self, other: &BadMasks) {
        self.count += other.count;
        let room = FIRST_IDS.saturating_sub(self.first_ids.len());
        self.first_ids
            .extend(other.first_ids.iter().take(room).cloned());
    }

    /// `all ones 3 (a.safetensors row 0, a.safetensors row 4, …)`.
    fn describe(&self, kind: &str) -> String {
        let more = if self.count > self.first_ids.len() as u64 {
            ", …"
        } else {
            ""
        };
        format!(
            "{kind} {} ({}{more})",
            self.count,
            self.first_ids.join(", ")
        )
    }
}

/// What the loss masks of some data hold: the share of tokens with a loss and the rows whose mask is bad.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MaskReport {
    /// Rows seen with at least one token (an all-zero row included).
    pub sequences: u64,
    /// Tokens of those rows the run keeps (up to each row's last label).
    pub tokens: u64,
    /// Tokens with the loss mask set.
    pub loss_tokens: u64,
    /// `loss_tokens / tokens` (0 without tokens), written for whoever reads `summary.json`.
    pub loss_token_share: f64,
    /// Whether `all_ones` and `missing_end_of_turn` were counted (the stage named its `end_of_turn`).
    pub chat: bool,
    /// Rows with tokens and no loss.
    pub all_zeros: BadMasks,
    /// Rows with loss on every position up to their last label (only with `end_of_turn`).
    pub all_ones: BadMasks,
    /// Rows with a masked span that does not end on the end-of-turn token (only with `end_of_turn`).
    pub missing_end_of_turn: BadMasks,
    /// Rows of at least one bad kind (a row of two kinds counts once).
    pub bad_sequences: u64,
}

impl MaskReport {
    /// An empty report for data judged by `checks`.
    pub fn new(checks: &MaskChecks) -> Self {
        Self {
            chat: checks.end_of_turn.is_some(),
            ..Self::default()
        }
    }

    /// Judges one row: `ids` and `mask` (nonzero = loss) of its `seq` positions, of which the run keeps the
    /// first `kept` (0 for a row with no loss). `id` names the row, called only when it is among the first few
    /// of a kind.
    pub fn add_row(
        &mut self,
        (ids, mask): (&[i64], &[u8]),
        kept: usize,
        end_of_turn: Option<u32>,
        id: &dyn Fn() -> String,
    ) {
        if mask.is_empty() {
            return;
        }
        self.sequences += 1;
        let labelled = mask
            .iter()
            .rposition(|&m| m != 0)
            .map_or(0, |last| last + 1);
        let loss = mask[..labelled].iter().filter(|&&m| m != 0).count();
        self.tokens += kept as u64;
        self.loss_tokens += loss as u64;
        let all_zeros = loss == 0;
        let all_ones = end_of_turn.is_some() && loss > 0 && loss == labelled;
        let missing_end = end_of_turn.is_some_and(|end| {
            // A span ends where a labelled position is followed by an unlabelled one or by the row's end.
            (0..labelled).any(|at| {
                mask[at] != 0
                    && mask.get(at + 1).is_none_or(|&next| next == 0)
                    && ids.get(at) != Some(&i64::from(end))
            })
        });
        if all_zeros {
            self.all_zeros.add(id);
        }
        if all_ones {
            self.all_ones.add(id);
        }
        if missing_end {
            self.missing_end_of_turn.add(id);
        }
        if all_zeros || all_ones || missing_end {
            self.bad_sequences += 1;
        }
        self.loss_token_share = share(self.loss_tokens, self.tokens);
    }

    /// Adds `other`'s counts (the next file, the next message), keeping the first ids in order.
    pub fn merge(&mut self, other: &MaskReport) {
        self.sequences += other.sequences;
        self.tokens += other.tokens;
        self.loss_tokens += other.loss_tokens;
        self.chat |= other.chat;
        self.all_zeros.merge(&other.all_zeros);
        self.all_ones.merge(&other.all_ones);
        self.missing_end_of_turn.merge(&other.missing_end_of_turn);
        self.bad_sequences += other.bad_sequences;
        self.loss_token_share = share(self.loss_tokens, self.tokens);
    }

    /// True when some row has a bad mask (the diagnosis then prints [`Self::describe`]).
    pub fn any_bad(&self) -> bool {
        self.bad_sequences > 0
    }

    /// True when the bad rows are more than `max_share` of `max(sequences, at_least)`: a stream judges its
    /// first sequences as if `at_least` had arrived, so one early bad row does not stop a producer at 1%.
    pub fn over(&self, max_share: f64, at_least: u64) -> bool {
        self.bad_sequences as f64 > max_share * self.sequences.max(at_least) as f64
    }

    /// One line: `40 sequences, loss on 31.2% of 5120 tokens; bad masks 3 (7.5%): all zeros 1 (…), all ones 2
    /// (…), missing end of turn 0` (without `end_of_turn`, the chat kinds are said to be unchecked).
    pub fn describe(&self) -> String {
        let mut line = format!(
            "{} sequences, loss on {:.1}% of {} tokens; bad masks {} ({:.1}%): {}",
            self.sequences,
            100.0 * self.loss_token_share,
            self.tokens,
            self.bad_sequences,
            100.0 * share(self.bad_sequences, self.sequences),
            self.all_zeros.describe("all zeros")
        );
        if self.chat {
            line.push_str(&format!(
                ", {}, {}",
                self.all_ones.describe("all ones"),
                self.missing_end_of_turn.describe("missing end of turn")
            ));
        } else {
            line.push_str(
                " (all ones and end of turn unchecked: no `end_of_turn` in the target stage)",
            );
        }
        line.replace(" ()", "")
    }
}

/// The run's [`MaskReport`] as its source has it now (a stream's grows as messages arrive), read at the end of
/// the run for `summary.json`.
#[derive(Clone)]
pub struct MaskProbe(Arc<dyn Fn() -> MaskReport + Send + Sync>);

impl MaskProbe {
    /// A probe that calls `report` each time it is read.
    pub fn new(report: impl Fn() -> MaskReport + Send + Sync + 'static) -> Self {
        Self(Arc::new(report))
    }

    /// The report now.
    pub fn read(&self) -> MaskReport {
        (self.0)()
    }
}

impl std::fmt::Debug for MaskProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("MaskProbe").field(&self.read()).finish()
    }
}

fn share(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 / whole as f64
    }
}

/// Data whose bad masks are over the stage's `max_bad_mask_share`: refused before it trains.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error(
    "loss masks of {data}: {bad} of {sequences} sequences ({percent:.1}%) have a bad mask, over \
     `max_bad_mask_share` = {max_share} — {report}. Fix the masks (see `draftpipe_client.chat`) or raise \
     `max_bad_mask_share` in the target stage",
    bad = report.bad_sequences,
    sequences = report.sequences,
    percent = 100.0 * share(report.bad_sequences, report.sequences),
    report = report.describe()
)]
pub struct MaskRefusal {
    /// What was judged: the files with a bad row (`a.safetensors, b.safetensors`), or the producer.
    pub data: String,
    /// Their counts.
    pub report: MaskReport,
    /// The bound they are over.
    pub max_share: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    const END: u32 = 9;

    fn judge(rows: &[(&[i64], &[u8])], end_of_turn: Option<u32>) -> MaskReport {
        let mut report = MaskReport::new(&MaskChecks {
            end_of_turn,
            ..MaskChecks::default()
        });
        for (row, &(ids, mask)) in rows.iter().enumerate() {
            let kept = mask
                .iter()
                .rposition(|&m| m != 0)
                .map_or(0, |last| last + 1);
            report.add_row((ids, mask), kept, end_of_turn, &|| format!("row {row}"));
        }
        report
    }

    #[test]
    fn a_chat_mask_on_the_replies_and_their_end_tokens_is_good() {
        // prompt prompt reply END pad | prompt reply END prompt reply END
        let report = judge(
            &[
                (&[1, 2, 3, END as i64, 0], &[0, 0, 1, 1, 0]),
                (&[1, 3, 9, 2, 3, 9], &[0, 1, 1, 0, 1, 1]),
            ],
            Some(END),
        );
        assert_eq!(report.bad_sequences, 0, "{report:?}");
        assert_eq!(
            (report.sequences, report.tokens, report.loss_tokens),
            (2, 10, 6)
        );
        assert!((report.loss_token_share - 0.6).abs() < 1e-12);
    }

    #[test]
    fn each_kind_is_counted_and_named() {
        let report = judge(
            &[
                (&[1, 2, 3, 9], &[0, 0, 1, 1]),       // good
                (&[1, 2, 3, 9], &[0, 0, 0, 0]),       // all zeros
                (&[1, 2, 3, 9], &[1, 1, 1, 1]),       // all ones (and ends on END)
                (&[1, 2, 3, 4], &[0, 0, 1, 1]),       // truncated reply: no END
                (&[1, 2, 9, 4, 5], &[0, 1, 0, 1, 1]), // first span ends before its END
            ],
            Some(END),
        );
        assert_eq!(report.all_zeros.first_ids, ["row 1"]);
        assert_eq!(report.all_ones.first_ids, ["row 2"]);
        assert_eq!(report.missing_end_of_turn.first_ids, ["row 3", "row 4"]);
        assert_eq!(report.bad_sequences, 4);
        let line = report.describe();
        assert!(line.contains("all zeros 1 (row 1)"), "{line}");
        assert!(
            line.contains("missing end of turn 2 (row 3, row 4)"),
            "{line}"
        );
    }

    #[test]
    fn without_an_end_of_turn_token_only_all_zeros_count() {
        let report = judge(&[(&[1, 2, 3], &[1, 1, 1]), (&[1, 2, 3], &[0, 0, 0])], None);
        assert_eq!(
            (report.all_ones.count, report.missing_end_of_turn.count),
            (0, 0)
        );
        assert_eq!(report.all_zeros.count, 1);
        assert!(
            report.describe().contains("unchecked"),
            "{}",
            report.describe()
        );
    }

    #[test]
    fn a_row_of_two_kinds_is_one_bad_sequence_and_ids_stop_at_the_limit() {
        let rows: Vec<(&[i64], &[u8])> = vec![(&[1, 2, 3], &[1, 1, 1]); FIRST_IDS + 2];
        let report = judge(&rows, Some(END));
        assert_eq!(report.all_ones.count, FIRST_IDS as u64 + 2);
        assert_eq!(report.missing_end_of_turn.count, FIRST_IDS as u64 + 2);
        assert_eq!(report.bad_sequences, FIRST_IDS as u64 + 2);
        assert_eq!(report.all_ones.first_ids.len(), FIRST_IDS);
        assert!(report.describe().contains(", …)"), "{}", report.describe());
    }

    #[test]
    fn merging_keeps_the_first_ids_in_order_and_the_bound_counts_a_floor() {
        let mut whole = judge(&[(&[1, 2], &[0, 0])], None);
        let next = judge(&[(&[1, 2], &[1, 1]), (&[1, 2], &[0, 0])], None);
        whole.merge(&next);
        assert_eq!(whole.all_zeros.first_ids, ["row 0", "row 1"]);
        assert_eq!((whole.sequences, whole.bad_sequences), (3, 2));
        assert!(whole.over(0.5, 0));
        // 2 bad rows of 3 judged as if 100 had arrived: 2% is over 1%, not over 5%.
        assert!(whole.over(0.01, 100) && !whole.over(0.05, 100));
        assert!(!whole.over(1.0, 0));
    }

    #[test]
    fn the_refusal_names_the_data_each_kind_and_the_bound() {
        let report = judge(
            &[(&[1, 2, 3], &[0, 0, 0]), (&[1, 2, 3], &[0, 1, 1])],
            Some(END),
        );
        let message = MaskRefusal {
            data: "a.safetensors".into(),
            report,
            max_share: 0.01,
        }
        .to_string();
        for needle in [
            "a.safetensors",
            "2 of 2 sequences (100.0%)",
            "`max_bad_mask_share` = 0.01",
            "all zeros 1 (row 0)",
            "missing end of turn 1 (row 1)",
            "all ones 0",
        ] {
            assert!(message.contains(needle), "{needle}: {message}");
        }
    }
}
