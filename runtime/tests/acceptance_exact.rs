//! The exact acceptance length end to end below the models, on every backend present (`test_device!`): the
//! loss kernels' per-slot `correct` flags of a batch with correlated misses uploaded, `accepted_prefix_sum` run
//! through the `Backend` trait in DFlash's layout (`[blocks, B]`, the anchor column skipped) and EAGLE-3's
//! (`[ttt, rows]`), the result NaN-poisoned first, and the read-back turned into [`BlockMetrics`] as a step's
//! is. The exact τ must equal a brute-force f64 count of each block's prefix before its first miss, and differ
//! from SpecForge's simulated τ (the product of marginal accuracies) on these batches; a count of every hit
//! (the mistake of not stopping at the first miss) must not match.

mod backends;
mod kernels_support;

use backends::TestDevice;
use draftpipe_runtime::backend::Backend;
use draftpipe_runtime::model::BlockMetrics;
use draftpipe_runtime::model::eagle3::ttt_metrics;
use kernels_support::{bare, down, poisoned, up};

/// Blocks whose misses come together: all right, all wrong, right for two slots, and a mixed pattern.
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

/// The brute force: `1 + Σ_b (slots of block b before its first miss) / blocks`.
fn brute_force_tau(correct: &[Vec<bool>]) -> f64 {
    let accepted: usize = correct
        .iter()
        .map(|block| block.iter().take_while(|&&c| c).count())
        .sum();
    1.0 + accepted as f64 / correct.len() as f64
}

/// The mistake: every hit counted, the first miss not ending the prefix.
fn every_hit_tau(correct: &[Vec<bool>]) -> f64 {
    let hits = correct.iter().flatten().filter(|&&c| c).count();
    1.0 + hits as f64 / correct.len() as f64
}

fn flag(c: bool) -> f32 {
    if c { 1.0 } else { 0.0 }
}

fn dflash_exact_tau_is_the_brute_force_count<D: TestDevice>(device: &D) {
    let mut be = bare(device);
    let (blocks, block) = (41, 5);
    let drafted = correlated(blocks, block - 1);
    // `[blocks, B]`, slot 0 the anchor (no label: 0).
    let flags: Vec<f32> = drafted
        .iter()
        .flat_map(|slots| std::iter::once(0.0).chain(slots.iter().map(|&c| flag(c))))
        .collect();
    let correct = up(&mut be, &flags);
    let mut accepted = poisoned(&mut be, 1);
    be.accepted_prefix_sum(
        correct.at(1, flags.len() - 1),
        accepted.all_mut(),
        (blocks, block - 1),
        (block, 1),
    )
    .expect("accepted_prefix_sum");
    let accepted = down(&mut be, accepted.all())[0];
    // The per-slot counts the step's GEMM sums; every block labelled at every drafted slot.
    let counts: Vec<f32> = (0..block)
        .map(|k| (0..blocks).map(|b| flags[b * block + k]).sum())
        .collect();
    let labelled: Vec<u32> = (0..block)
        .map(|k| if k == 0 { 0 } else { blocks as u32 })
        .collect();
    let mut extra = counts;
    extra.push(accepted);
    let metrics = BlockMetrics::new(&extra, &labelled, extra[block]);
    let expected = brute_force_tau(&drafted);
    assert_eq!(metrics.blocks, blocks as u32);
    assert!(
        (f64::from(metrics.tau_exact) - expected).abs() < 1e-6,
        "{}: exact {} vs brute force {expected}",
        D::NAME,
        metrics.tau_exact
    );
    assert!((f64::from(metrics.tau_exact) - every_hit_tau(&drafted)).abs() > 0.1);
    assert!(
        (metrics.tau_exact - metrics.tau_simulated).abs() > 0.1,
        "{}: correlated misses part the two: exact {}, simulated {}",
        D::NAME,
        metrics.tau_exact,
        metrics.tau_simulated
    );
}
test_device!(dflash_exact_tau_is_the_brute_force_count);

fn eagle3_exact_tau_is_the_brute_force_count<D: TestDevice>(device: &D) {
    let mut be = bare(device);
    let (rows, steps) = (37, 7);
    let unroll = correlated(rows, steps);
    // `[ttt, rows]`: step k's row r drafts token r + k + 1 of start row r's unroll.
    let flags: Vec<f32> = (0..steps)
        .flat_map(|k| unroll.iter().map(move |u| flag(u[k])))
        .collect();
    let correct = up(&mut be, &flags);
    let mut accepted = poisoned(&mut be, 1);
    be.accepted_prefix_sum(correct.all(), accepted.all_mut(), (rows, steps), (1, rows))
        .expect("accepted_prefix_sum");
    let accepted = down(&mut be, accepted.all())[0];
    // The read-back after the first three: loss_k …, correct_k …, supervised_k …, accepted.
    let mut extra = vec![0.0; steps];
    extra.extend((0..steps).map(|k| unroll.iter().filter(|u| u[k]).count() as f32));
    extra.extend(std::iter::repeat_n(rows as f32, steps));
    extra.push(accepted);
    let metrics = ttt_metrics(&extra, steps);
    let expected = brute_force_tau(&unroll);
    assert_eq!(metrics.blocks, rows as u32);
    assert!(
        (f64::from(metrics.tau_exact) - expected).abs() < 1e-6,
        "{}: exact {} vs brute force {expected}",
        D::NAME,
        metrics.tau_exact
    );
    assert!((f64::from(metrics.tau_exact) - every_hit_tau(&unroll)).abs() > 0.1);
    assert!(
        (metrics.tau_exact - metrics.tau_simulated).abs() > 0.1,
        "{}: exact {}, simulated {}",
        D::NAME,
        metrics.tau_exact,
        metrics.tau_simulated
    );
}
test_device!(eagle3_exact_tau_is_the_brute_force_count);
