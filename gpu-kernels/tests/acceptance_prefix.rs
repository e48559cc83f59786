//! The exact acceptance length's kernel (`gpu-kernels/src/acceptance.rs`) on the host plane, against a
//! brute-force f64 count written from the rule (walk each block's drafted slots, stop at the first miss), on
//! batches whose misses are correlated, so the simulated figure (the product of marginal accuracies) differs
//! from the exact one. DFlash's layout (blocks as rows, slots as columns, the anchor column skipped) and
//! EAGLE-3's (TTT steps as rows, start rows as columns) both run; a deliberate mistake (counting every hit,
//! not only those before the first miss) must disagree with the kernel. The output starts as NaN (poisoned).

use draftpipe_gpu_kernels::acceptance::{accepted_prefix_sum, strided_len};
use draftpipe_gpu_kernels::plane::HostPlane;

/// `correct[b][k]` of the tests: blocks that are all right, all wrong, right for two slots, and mixed, so misses
/// fall together on the same blocks (the case where Π acc_j and the accepted prefix part).
fn correlated(blocks: usize, slots: usize) -> Vec<Vec<bool>> {
    (0..blocks)
        .map(|b| {
            (0..slots)
                .map(|k| match b % 4 {
                    0 => true,
                    1 => false,
                    2 => k < 2,
                    _ => (b + k) % 3 != 0,
                })
                .collect()
        })
        .collect()
}

/// The brute force: per block, the slots before the first miss.
fn brute_force(correct: &[Vec<bool>]) -> f64 {
    correct
        .iter()
        .map(|block| block.iter().take_while(|&&c| c).count() as f64)
        .sum()
}

/// The mistake a reviewer would miss: every hit counted, not only the prefix before the first miss.
fn every_hit(correct: &[Vec<bool>]) -> f64 {
    correct.iter().flatten().filter(|&&c| c).count() as f64
}

/// SpecForge's simulated figure's accepted part, `Σ_k Π_{j≤k} acc_j`, times the blocks (comparable sums).
fn simulated(correct: &[Vec<bool>]) -> f64 {
    let blocks = correct.len() as f64;
    let slots = correct[0].len();
    let mut chain = 1.0;
    let mut sum = 0.0;
    for k in 0..slots {
        chain *= correct.iter().filter(|b| b[k]).count() as f64 / blocks;
        sum += chain;
    }
    sum * blocks
}

/// Runs the kernel over `flags` laid out at `b · block_stride + k · slot_stride + offset`.
fn kernel(correct: &[Vec<bool>], block_stride: usize, slot_stride: usize, offset: usize) -> f32 {
    let (blocks, slots) = (correct.len(), correct[0].len());
    let mut flags = vec![0.0f32; offset + strided_len(blocks, slots, block_stride, slot_stride)];
    for (b, block) in correct.iter().enumerate() {
        for (k, &c) in block.iter().enumerate() {
            flags[offset + b * block_stride + k * slot_stride] = if c { 1.0 } else { 0.0 };
        }
    }
    let mut accepted = f32::NAN;
    // SAFETY: `flags` holds every strided index past `offset`; `accepted` one element.
    unsafe {
        accepted_prefix_sum(
            flags.as_ptr().add(offset),
            &mut accepted,
            blocks,
            slots,
            block_stride,
            slot_stride,
            HostPlane,
        )
    };
    accepted
}

#[test]
fn dflash_blocks_count_the_prefix_before_the_first_miss() {
    // 37 blocks of 4 (slot 0 the anchor, never labelled: 0), more blocks than a warp's lanes.
    let (blocks, block) = (37, 4);
    let drafted = correlated(blocks, block - 1);
    let accepted = kernel(&drafted, block, 1, 1);
    let expected = brute_force(&drafted);
    assert_eq!(f64::from(accepted), expected);
    assert_ne!(
        expected,
        every_hit(&drafted),
        "the mistake must change the count"
    );
    assert_ne!(f64::from(accepted), every_hit(&drafted));
    let (exact, sim) = (
        1.0 + expected / blocks as f64,
        1.0 + simulated(&drafted) / blocks as f64,
    );
    assert!(
        (exact - sim).abs() > 0.1,
        "correlated misses: exact {exact}, simulated {sim}"
    );
}

#[test]
fn eagle3_start_rows_count_their_unroll_before_the_first_miss() {
    // 7 TTT steps of 45 start rows, stored `[step, row]`: block = start row, stride 1; slot = step, stride 45.
    let (rows, steps) = (45, 7);
    let unroll = correlated(rows, steps);
    let accepted = kernel(&unroll, 1, rows, 0);
    let expected = brute_force(&unroll);
    assert_eq!(f64::from(accepted), expected);
    assert_ne!(f64::from(accepted), every_hit(&unroll));
    let (exact, sim) = (
        1.0 + expected / rows as f64,
        1.0 + simulated(&unroll) / rows as f64,
    );
    assert!(
        (exact - sim).abs() > 0.1,
        "correlated misses: exact {exact}, simulated {sim}"
    );
}

#[test]
fn nothing_to_count_reads_nothing_and_writes_zero() {
    assert_eq!(strided_len(0, 3, 4, 1), 0);
    assert_eq!(strided_len(2, 0, 4, 1), 0);
    let mut accepted = f32::NAN;
    // SAFETY: no block, so nothing is read.
    unsafe { accepted_prefix_sum(std::ptr::null(), &mut accepted, 0, 3, 4, 1, HostPlane) };
    assert_eq!(accepted, 0.0);
}
