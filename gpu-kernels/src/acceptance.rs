//! The exact teacher-forced acceptance length's device half: per step, after the loss kernels wrote each
//! drafted slot's `correct` flag (1 where the argmax is the label, 0 for a miss *and* for a slot without a
//! label), the accepted prefixes of all blocks summed into one step scalar, read back with the others.
//!
//! ```text
//!  loss kernels ──▶ correct [rows] ──accepted_prefix_sum──▶ step_scalars[accepted] ──read back──▶ τ_exact
//! ```
//!
//! A "block" is a DFlash block (its drafted slots `1..B`) or an EAGLE-3 start row (its TTT steps `0..ttt`);
//! strides place both in the same loop. The length divided by the blocks counted (a host-known figure: the
//! blocks whose first drafted slot has a label) and plus the bonus token is τ_exact (docs/dflash.md).

use crate::plane::Plane;

/// `accepted[0] = Σ_b L_b` over `blocks` blocks, `L_b` the number of leading slots `k < slots` of block `b` whose
/// `correct[b · block_stride + k · slot_stride]` is non-zero: the first zero (a miss, or a slot without a label)
/// ends the block's accepted prefix, whatever follows it. Counts are exact in f32 below 2²⁴.
///
/// Launch: one plane.
///
/// # Safety
/// `correct` holds every `b · block_stride + k · slot_stride` for `b < blocks`, `k < slots`; `accepted` one
/// element.
#[inline(always)]
pub unsafe fn accepted_prefix_sum(
    correct: *const f32,
    accepted: *mut f32,
    blocks: usize,
    slots: usize,
    block_stride: usize,
    slot_stride: usize,
    plane: impl Plane,
) {
    let total = plane.sum(blocks, |b| {
        let mut length = 0.0f32;
        for k in 0..slots {
            // SAFETY: `b < blocks`, `k < slots`: inside `correct` by the contract.
            if unsafe { *correct.add(b * block_stride + k * slot_stride) } == 0.0 {
                break;
            }
            length += 1.0;
        }
        length
    });
    if plane.is_leader() {
        // SAFETY: `accepted` has one element.
        unsafe { *accepted = total };
    }
}

/// The elements `accepted_prefix_sum` reads: one past the largest index, 0 without a block or a slot.
#[inline(always)]
pub const fn strided_len(
    blocks: usize,
    slots: usize,
    block_stride: usize,
    slot_stride: usize,
) -> usize {
    if blocks == 0 || slots == 0 {
        0
    } else {
        (blocks - 1) * block_stride + (slots - 1) * slot_stride + 1
    }
}
