//! The DFlash block plan, built on the host when a batch is staged: which anchors each sequence trains on, and
//! every index array the step's kernels read (block token ids, RoPE positions, the attention mask as row
//! ranges, labels and loss weights), so that no kernel decides anything about the mask itself.
//!
//! ```text
//!  batch (input_ids, loss_mask, seq_lens) + (seed, step) ──▶ anchors: a with mask[a] ∧ mask[a+1], a+1 < len,
//!      up to A per sequence, drawn without replacement, sorted (all of them when fewer) ──▶ BlockPlan
//! ```
//!
//! Shapes are static so a bucket's step can be captured once: every sequence has `A = anchors` block slots,
//! present anchors first (sorted), absent ones after them with no label and empty key ranges. Rows: `T = N·S`
//! context rows (sequence-major), `Q = N·A·B` block rows (sequence, block, slot). A query row of block `j` sees
//! the context rows of its sequence strictly before its anchor and every row of its own block (SpecForge's
//! `create_dflash_block_mask`); the ranges are global row indices, as the attention kernels take them.

use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

/// What the block plan needs of the model and loss.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockGeometry {
    /// Slots per block (`B`): slot 0 the anchor token, the rest `mask_token`.
    pub block: usize,
    /// Block slots per sequence (`A`).
    pub anchors: usize,
    /// Token id of the masked slots.
    pub mask_token: u32,
    /// `γ` of the slot weights `exp(−(k−1)/γ)`; not positive or not finite: every slot weighs 1 (SpecForge's
    /// `loss_decay_gamma = None`).
    pub position_decay: f32,
}

impl BlockGeometry {
    /// The loss weight of slot `k ≥ 1`.
    pub fn slot_weight(&self, k: usize) -> f32 {
        let gamma = self.position_decay;
        if gamma > 0.0 && gamma.is_finite() {
            (-((k - 1) as f32) / gamma).exp()
        } else {
            1.0
        }
    }
}

/// The batch fields the plan reads (a view of an [`HsBatch`](crate::batch::HsBatch)).
#[derive(Debug, Clone, Copy)]
pub struct PlanInput<'a> {
    /// Padded length `S`.
    pub padded_len: usize,
    /// Token ids `[N·S]`.
    pub input_ids: &'a [u32],
    /// Label mask `[N·S]`.
    pub loss_mask: &'a [u8],
    /// Real lengths `[N]`.
    pub seq_lens: &'a [u32],
}

/// Every host array of one step's block plan, sized once for the largest bucket and refilled per batch.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockPlan {
    /// Sequences `N` of the batch planned last.
    pub sequences: usize,
    /// Padded length `S` of the batch planned last.
    pub padded_len: usize,
    /// Anchor position of each block slot `[N·A]` (0 for an absent block).
    pub anchors: Vec<u32>,
    /// Present anchors per sequence `[N]` (they come first in each sequence's slots).
    pub present: Vec<u32>,
    /// Token id of each block row `[Q]`.
    pub block_ids: Vec<u32>,
    /// RoPE position of each context row `[T]`: its position in the sequence.
    pub context_positions: Vec<u32>,
    /// RoPE position of each block row `[Q]`: anchor + slot.
    pub block_positions: Vec<u32>,
    /// Per query row `[Q, 4]`: context keys `[0]..[1]`, block keys `[2]..[3]` (global rows).
    pub query_ranges: Vec<u32>,
    /// Per context key `[T, 2]`: the query rows that see it (a suffix of the sequence's present blocks).
    pub context_key_ranges: Vec<u32>,
    /// Per block key `[Q, 2]`: the query rows that see it (its own block, or none when absent).
    pub block_key_ranges: Vec<u32>,
    /// Label of each block row `[Q]`: `input_ids[a + k]` for slot `k ≥ 1` when it exists and the loss mask
    /// allows it, else −1.
    pub labels: Vec<i32>,
    /// Loss weight of each block row `[Q]` (0 without a label).
    pub weights: Vec<f32>,
    /// `1 / Σ weights` over the batch (0 when no row has a label).
    pub inv_weight_sum: f32,
    /// Labelled rows per slot `[B]` (slot 0 never has one): the denominators of the per-slot accuracy.
    pub slot_labels: Vec<u32>,
    /// The head's rows, in order: the labelled block rows, then unlabelled padding up to the head's row count
    /// (the row count of [`BlockPlan::pad_head`]; its last row is always unlabelled). Each is the block row
    /// whose final-norm output it gathers (0 for padding).
    pub head_rows: Vec<u32>,
    /// Label of each head row (−1 for padding).
    pub head_labels: Vec<i32>,
    /// Loss weight of each head row (0 for padding).
    pub head_weights: Vec<f32>,
    /// Per block row `[Q]`: the head row holding it, or the last head row (unlabelled: its gradient is 0) for a
    /// row without a label; the gradient of the final-norm output is gathered back through it.
    pub head_index: Vec<u32>,
    /// Scratch: one sequence's valid anchors, then its draw (kept so a rebuild allocates nothing).
    valid: Vec<usize>,
}

/// The seed of sequence `sequence`'s anchor draw at `step` of a run seeded `seed` (SplitMix64 finaliser over
/// the three, so neighbouring steps and sequences draw independently and a resumed run draws the same).
fn draw_seed(seed: u64, step: u64, sequence: usize) -> u64 {
    let mut z = seed
        ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (sequence as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Valid anchors of one sequence (SpecForge's `_sample_anchor_positions`): positions `a` with `a + 1 < len`
/// whose token and next token are both supervised, so slot 1 has a label.
pub fn valid_anchors(loss_mask: &[u8], len: usize) -> impl Iterator<Item = usize> + '_ {
    (0..len.saturating_sub(1)).filter(move |&a| loss_mask[a] != 0 && loss_mask[a + 1] != 0)
}

/// Keeps up to `max` of `valid` drawn uniformly without replacement with `rng` (a partial Fisher–Yates
/// shuffle in place), sorted; every one of them, undrawn, when there are no more than `max` (small runs are
/// deterministic).
fn draw(valid: &mut Vec<usize>, max: usize, rng: &mut Xoshiro256PlusPlus) {
    if valid.len() > max {
        for i in 0..max {
            let j = rng.random_range(i..valid.len());
            valid.swap(i, j);
        }
        valid.truncate(max);
        valid.sort_unstable();
    }
}

impl BlockPlan {
    /// Rebuilds the plan for `batch` at training step `step` of a run seeded `seed`.
    ///
    /// # Panics
    /// When the batch's buffers disagree with its shape (the drafter checks batches before planning).
    pub fn build(&mut self, geometry: &BlockGeometry, batch: PlanInput<'_>, seed: u64, step: u64) {
        let (s, n) = (batch.padded_len, batch.seq_lens.len());
        let (a_max, b) = (geometry.anchors, geometry.block);
        assert_eq!(
            batch.input_ids.len(),
            n * s,
            "input_ids do not match the shape"
        );
        assert_eq!(
            batch.loss_mask.len(),
            n * s,
            "loss_mask does not match the shape"
        );
        let (t, q) = (n * s, n * a_max * b);
        self.sequences = n;
        self.padded_len = s;
        let u = |x: usize| u32::try_from(x).expect("row index fits in u32");
        self.anchors.clear();
        self.present.clear();
        self.block_ids.clear();
        self.block_positions.clear();
        self.query_ranges.clear();
        self.block_key_ranges.clear();
        self.labels.clear();
        self.weights.clear();
        self.context_positions.clear();
        self.context_positions
            .extend((0..n).flat_map(|_| (0..s).map(u)));
        self.context_key_ranges.clear();
        self.context_key_ranges.resize(2 * t, 0);
        self.slot_labels.clear();
        self.slot_labels.resize(b, 0);
        let mut weight_sum = 0.0f64;
        let mut chosen = std::mem::take(&mut self.valid);
        for seq in 0..n {
            let len = (batch.seq_lens[seq] as usize).min(s);
            let base = seq * s;
            let (ids, mask) = (
                &batch.input_ids[base..base + s],
                &batch.loss_mask[base..base + s],
            );
            chosen.clear();
            chosen.extend(valid_anchors(mask, len));
            let mut rng = Xoshiro256PlusPlus::seed_from_u64(draw_seed(seed, step, seq));
            draw(&mut chosen, a_max, &mut rng);
            self.present.push(u(chosen.len()));
            let first_row = seq * a_max * b;
            let present_end = first_row + chosen.len() * b;
            for slot in 0..a_max {
                let anchor = chosen.get(slot).copied();
                self.anchors.push(u(anchor.unwrap_or(0)));
                let block_start = first_row + slot * b;
                for k in 0..b {
                    let position = anchor.unwrap_or(0) + k;
                    self.block_positions.push(u(position));
                    self.block_ids.push(match anchor {
                        Some(a) if k == 0 => ids[a],
                        _ => geometry.mask_token,
                    });
                    let label = match anchor {
                        Some(_) if k >= 1 && position < len && mask[position] != 0 => {
                            i32::try_from(ids[position]).expect("token id fits in i32")
                        }
                        _ => -1,
                    };
                    self.labels.push(label);
                    let weight = if label >= 0 {
                        self.slot_labels[k] += 1;
                        geometry.slot_weight(k)
                    } else {
                        0.0
                    };
                    weight_sum += f64::from(weight);
                    self.weights.push(weight);
                    match anchor {
                        Some(a) => {
                            self.query_ranges.extend([
                                u(base),
                                u(base + a),
                                u(block_start),
                                u(block_start + b),
                            ]);
                            self.block_key_ranges
                                .extend([u(block_start), u(block_start + b)]);
                        }
                        None => {
                            self.query_ranges.extend([
                                u(base),
                                u(base),
                                u(block_start),
                                u(block_start),
                            ]);
                            self.block_key_ranges
                                .extend([u(block_start), u(block_start)]);
                        }
                    }
                }
            }
            // Context key at position p is seen by the present blocks whose anchor is > p: a suffix of the
            // sorted present blocks, found by one merge walk over positions.
            let mut first_block = 0;
            for p in 0..s {
                while first_block < chosen.len() && chosen[first_block] <= p {
                    first_block += 1;
                }
                let start = first_row + first_block * b;
                self.context_key_ranges[2 * (base + p)] = u(start.min(present_end));
                self.context_key_ranges[2 * (base + p) + 1] = u(present_end);
            }
        }
        self.valid = chosen;
        debug_assert_eq!(self.block_ids.len(), q);
        self.inv_weight_sum = if weight_sum > 0.0 {
            (1.0 / weight_sum) as f32
        } else {
            0.0
        };
        self.pad_head(self.labelled_rows() + 1);
    }

    /// Block rows with a label (the rows the loss needs the `lm_head` for).
    pub fn labelled_rows(&self) -> usize {
        self.labels.iter().filter(|&&label| label >= 0).count()
    }

    /// Rebuilds the head's arrays for `rows` head rows: the labelled block rows in order, then padding.
    ///
    /// # Panics
    /// When `rows` is not more than the labelled rows (the last head row must be unlabelled).
    pub fn pad_head(&mut self, rows: usize) {
        let labelled = self.labelled_rows();
        assert!(
            rows > labelled,
            "{rows} head rows for {labelled} labelled ones and the unlabelled one"
        );
        let u = |x: usize| u32::try_from(x).expect("row index fits in u32");
        self.head_rows.clear();
        self.head_labels.clear();
        self.head_weights.clear();
        self.head_index.clear();
        for (row, (&label, &weight)) in self.labels.iter().zip(&self.weights).enumerate() {
            if label >= 0 {
                self.head_index.push(u(self.head_rows.len()));
                self.head_rows.push(u(row));
                self.head_labels.push(label);
                self.head_weights.push(weight);
            } else {
                self.head_index.push(u(rows - 1));
            }
        }
        self.head_rows.resize(rows, 0);
        self.head_labels.resize(rows, -1);
        self.head_weights.resize(rows, 0.0);
    }

    /// Query rows `Q` of the plan.
    pub fn query_rows(&self) -> usize {
        self.block_ids.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geometry(block: usize, anchors: usize) -> BlockGeometry {
        BlockGeometry {
            block,
            anchors,
            mask_token: 99,
            position_decay: 2.0,
        }
    }

    /// Dense `[Q, T + Q]` mask from the ranges: what each query row sees.
    fn dense(plan: &BlockPlan) -> Vec<Vec<bool>> {
        let (t, q) = (plan.context_positions.len(), plan.query_rows());
        (0..q)
            .map(|r| {
                let g = &plan.query_ranges[4 * r..4 * r + 4];
                (0..t + q)
                    .map(|key| {
                        if key < t {
                            (g[0] as usize..g[1] as usize).contains(&key)
                        } else {
                            (g[2] as usize..g[3] as usize).contains(&(key - t))
                        }
                    })
                    .collect()
            })
            .collect()
    }

    /// One sequence of length 6 (padded 7), loss mask 0 1 1 1 0 1 | pad: valid anchors 1 and 2 only (3 has
    /// mask[4] = 0, 4 is masked, 5 has no next token inside the length). Two blocks of 3 slots, three anchor
    /// slots: the third is absent.
    #[test]
    fn a_hand_worked_mask_labels_and_weights() {
        let ids = [10, 11, 12, 13, 14, 15, 0];
        let mask = [0, 1, 1, 1, 0, 1, 0];
        let mut plan = BlockPlan::default();
        let input = PlanInput {
            padded_len: 7,
            input_ids: &ids,
            loss_mask: &mask,
            seq_lens: &[6],
        };
        plan.build(&geometry(3, 3), input, 1, 0);
        assert_eq!(plan.anchors, [1, 2, 0]);
        assert_eq!(plan.present, [2]);
        assert_eq!(plan.block_ids, [11, 99, 99, 12, 99, 99, 99, 99, 99]);
        assert_eq!(plan.block_positions, [1, 2, 3, 2, 3, 4, 0, 1, 2]);
        assert_eq!(plan.context_positions, [0, 1, 2, 3, 4, 5, 6]);
        // Block at anchor 1: slot 1 → ids[2], slot 2 → ids[3]. Block at anchor 2: slot 1 → ids[3], slot 2 →
        // position 4 is masked → none.
        assert_eq!(plan.labels, [-1, 12, 13, -1, 13, -1, -1, -1, -1]);
        let w2 = (-0.5f32).exp();
        assert_eq!(plan.weights, [0.0, 1.0, w2, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]);
        assert!((plan.inv_weight_sum - 1.0 / (2.0 + w2)).abs() < 1e-7);
        assert_eq!(plan.slot_labels, [0, 2, 1]);
        // The head: the three labelled rows and the unlabelled one every other row reads its gradient from.
        assert_eq!(plan.head_rows, [1, 2, 4, 0]);
        assert_eq!(plan.head_labels, [12, 13, 13, -1]);
        assert_eq!(plan.head_weights, [1.0, w2, 1.0, 0.0]);
        assert_eq!(plan.head_index, [3, 0, 1, 3, 2, 3, 3, 3, 3]);
        // Padded to the bucket's bound `N·A·(B − 1) + 1 = 7` (a captured step's shapes).
        plan.pad_head(7);
        assert_eq!(plan.head_rows, [1, 2, 4, 0, 0, 0, 0]);
        assert_eq!(plan.head_labels, [12, 13, 13, -1, -1, -1, -1]);
        assert_eq!(plan.head_index, [6, 0, 1, 6, 2, 6, 6, 6, 6]);
        // Columns: context 0..7, then block rows 0..9. Block 0 (anchor 1) sees context 0 and its own rows.
        let x = true;
        let o = false;
        #[rustfmt::skip]
        let expected: Vec<Vec<bool>> = [
            [x, o, o, o, o, o, o,  x, x, x, o, o, o, o, o, o],
            [x, o, o, o, o, o, o,  x, x, x, o, o, o, o, o, o],
            [x, o, o, o, o, o, o,  x, x, x, o, o, o, o, o, o],
            [x, x, o, o, o, o, o,  o, o, o, x, x, x, o, o, o],
            [x, x, o, o, o, o, o,  o, o, o, x, x, x, o, o, o],
            [x, x, o, o, o, o, o,  o, o, o, x, x, x, o, o, o],
            [o, o, o, o, o, o, o,  o, o, o, o, o, o, o, o, o],
            [o, o, o, o, o, o, o,  o, o, o, o, o, o, o, o, o],
            [o, o, o, o, o, o, o,  o, o, o, o, o, o, o, o, o],
        ]
        .iter()
        .map(|row| row.to_vec())
        .collect();
        assert_eq!(dense(&plan), expected);
        // Key ranges are the mask's columns: context 0 is seen by both blocks (rows 0..6), context 1 by the
        // second (rows 3..6), later ones by none; block keys by their own block.
        assert_eq!(&plan.context_key_ranges[..6], &[0, 6, 3, 6, 6, 6]);
        assert!(plan.context_key_ranges[6..].chunks(2).all(|r| r[0] == r[1]));
        assert_eq!(
            plan.block_key_ranges,
            [0, 3, 0, 3, 0, 3, 3, 6, 3, 6, 3, 6, 6, 6, 6, 6, 6, 6]
        );
    }

    /// The per-key ranges are exactly the transposed per-query ranges, over random batches.
    #[test]
    fn key_ranges_are_the_transpose_of_query_ranges() {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(5);
        for trial in 0..50 {
            let (n, s) = (3, 12);
            let ids: Vec<u32> = (0..n * s).map(|_| rng.random_range(0..50)).collect();
            let mask: Vec<u8> = (0..n * s).map(|_| u8::from(rng.random_bool(0.7))).collect();
            let lens: Vec<u32> = (0..n).map(|_| rng.random_range(0..=s as u32)).collect();
            let mut plan = BlockPlan::default();
            let input = PlanInput {
                padded_len: s,
                input_ids: &ids,
                loss_mask: &mask,
                seq_lens: &lens,
            };
            plan.build(&geometry(3, 4), input, 7, trial);
            let seen = dense(&plan);
            let t = n * s;
            for key in 0..t + plan.query_rows() {
                let ranges = if key < t {
                    &plan.context_key_ranges[2 * key..2 * key + 2]
                } else {
                    &plan.block_key_ranges[2 * (key - t)..2 * (key - t) + 2]
                };
                for (row, sees) in seen.iter().enumerate() {
                    let in_range = (ranges[0] as usize..ranges[1] as usize).contains(&row);
                    assert_eq!(sees[key], in_range, "trial {trial} key {key} row {row}");
                }
            }
            // Every present anchor is valid, sorted and distinct.
            for seq in 0..n {
                let present = plan.present[seq] as usize;
                let anchors = &plan.anchors[seq * 4..seq * 4 + present];
                assert!(anchors.windows(2).all(|w| w[0] < w[1]));
                let valid: Vec<usize> =
                    valid_anchors(&mask[seq * s..(seq + 1) * s], lens[seq] as usize).collect();
                assert!(anchors.iter().all(|&a| valid.contains(&(a as usize))));
                assert_eq!(present, valid.len().min(4));
            }
        }
    }

    /// The draw depends on (seed, step) only: the same pair draws the same anchors (a resumed run), another
    /// step draws others, and with no more valid positions than slots all of them are taken.
    #[test]
    fn draws_are_seeded_by_seed_and_step() {
        let s = 64;
        let ids = vec![1u32; s];
        let mask = vec![1u8; s];
        let input = PlanInput {
            padded_len: s,
            input_ids: &ids,
            loss_mask: &mask,
            seq_lens: &[s as u32],
        };
        let anchors = |seed, step, slots| {
            let mut plan = BlockPlan::default();
            plan.build(&geometry(2, slots), input, seed, step);
            plan.anchors
        };
        assert_eq!(anchors(3, 10, 8), anchors(3, 10, 8));
        assert_ne!(anchors(3, 10, 8), anchors(3, 11, 8));
        assert_ne!(anchors(3, 10, 8), anchors(4, 10, 8));
        let all: Vec<u32> = (0..s as u32 - 1).collect();
        assert_eq!(anchors(3, 10, 63), all);
        assert_eq!(anchors(9, 1, 63), all);
    }

    /// A row is one document (no source packs several into a row: docs/dflash.md, "Anchors and documents"), so
    /// anchors and blocks are counted per row: every anchor of a row lies inside that row's own length, and
    /// every label of its block is a token of the same row, before its end. Two rows of lengths 5 and 8 (padded
    /// 8): the blocks of the first never reach the second's tokens, and its anchors are at most its own four.
    #[test]
    fn anchors_and_blocks_stay_inside_their_own_row() {
        let s = 8;
        let ids: Vec<u32> = (0..2 * s as u32).map(|i| 100 + i).collect();
        let mask = vec![1u8; 2 * s];
        let lens = [5u32, 8];
        let input = PlanInput {
            padded_len: s,
            input_ids: &ids,
            loss_mask: &mask,
            seq_lens: &lens,
        };
        let (block, slots) = (3, 8);
        let mut plan = BlockPlan::default();
        plan.build(&geometry(block, slots), input, 1, 0);
        assert_eq!(plan.present, [4, 7], "valid anchors a + 1 < len, per row");
        for (seq, &len) in lens.iter().enumerate() {
            for slot in 0..plan.present[seq] as usize {
                let b = seq * slots + slot;
                let anchor = plan.anchors[b] as usize;
                assert!(
                    anchor + 1 < len as usize,
                    "row {seq}: anchor {anchor} of length {len}"
                );
                for k in 1..block {
                    let label = plan.labels[b * block + k];
                    if anchor + k < len as usize {
                        assert_eq!(
                            label,
                            ids[seq * s + anchor + k] as i32,
                            "row {seq}'s own token"
                        );
                    } else {
                        assert_eq!(label, -1, "row {seq}: no label past its end");
                    }
                }
            }
        }
    }

    /// Every valid position is drawn about equally often (without replacement: `A / valid` per step).
    #[test]
    fn draws_are_uniform_over_valid_positions() {
        let s = 64;
        let ids = vec![1u32; s];
        let mask = vec![1u8; s];
        let input = PlanInput {
            padded_len: s,
            input_ids: &ids,
            loss_mask: &mask,
            seq_lens: &[s as u32],
        };
        let mut counts = vec![0u32; s];
        let mut plan = BlockPlan::default();
        let steps = 4000;
        for step in 0..steps {
            plan.build(&geometry(2, 8), input, 13, step);
            for &a in &plan.anchors {
                counts[a as usize] += 1;
            }
        }
        let expected = steps as f64 * 8.0 / 63.0;
        for (position, &count) in counts[..63].iter().enumerate() {
            let ratio = f64::from(count) / expected;
            assert!(
                (0.8..1.2).contains(&ratio),
                "position {position}: {count} draws, {expected:.0} expected"
            );
        }
        assert_eq!(counts[63], 0, "the last position has no next token");
    }

    #[test]
    fn slot_weights_decay_from_slot_one() {
        let g = geometry(4, 1);
        assert_eq!(g.slot_weight(1), 1.0);
        assert!((g.slot_weight(3) - (-1.0f32).exp()).abs() < 1e-7);
        let flat = BlockGeometry {
            position_decay: 0.0,
            ..g
        };
        assert_eq!(flat.slot_weight(3), 1.0);
    }
}
