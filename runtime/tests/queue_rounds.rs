//! Rounds of one bucket for a data-parallel group (`HsQueue::with_rounds`): every member of a round gets an
//! item of the same bucket, the watermark and the pull policy hold per round, and a close, a stop, a member
//! leaving or the end of the data ends the group's pops without a hang and without handing out an item twice.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::Duration;

use draftpipe_runtime::queue::{
    HsQueue, PopError, PullPolicy, QueueConfig, QueueConfigError, SeqLen,
};

/// An item: its sequence length and a unique id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Item {
    len: usize,
    id: u64,
}

impl SeqLen for Item {
    fn seq_len(&self) -> usize {
        self.len
    }
}

const BUCKETS: [usize; 3] = [8, 16, 32];

fn bucket_of(len: usize) -> usize {
    BUCKETS.iter().position(|&bound| len <= bound).unwrap()
}

fn config(capacity: usize, min_ready: usize, pull: PullPolicy) -> QueueConfig {
    QueueConfig {
        capacity,
        min_ready,
        buckets: BUCKETS.to_vec(),
        pull,
        seed: 3,
    }
}

/// A generous bound on any wait in these tests: a pop still parked after it is a hang.
const HANG: Duration = Duration::from_secs(20);

#[test]
fn every_member_of_a_round_gets_an_item_of_the_rounds_bucket_exactly_once() {
    const MEMBERS: usize = 3;
    const ITEMS: u64 = 3000;
    for pull in [
        PullPolicy::RandomInBucket,
        PullPolicy::RoundRobin,
        PullPolicy::Fifo,
    ] {
        // The least capacity that always holds a round: every bucket at MEMBERS − 1, plus one.
        let queue = Arc::new(HsQueue::with_rounds(config(7, 2, pull), MEMBERS).unwrap());
        let producers: Vec<_> = (0..2u64)
            .map(|producer| {
                let queue = Arc::clone(&queue);
                thread::spawn(move || {
                    for id in (producer..ITEMS).step_by(2) {
                        // Lengths 1..=32 in a scrambled order, so the buckets fill unevenly.
                        let len = (id.wrapping_mul(2_654_435_761) % 32 + 1) as usize;
                        queue.push(Item { len, id }).unwrap();
                    }
                })
            })
            .collect();
        let members: Vec<_> = (0..MEMBERS)
            .map(|member| {
                let queue = Arc::clone(&queue);
                thread::spawn(move || {
                    let mut got = Vec::new();
                    while let Ok(round) = queue.pop_round_timeout(member, HANG) {
                        assert_eq!(bucket_of(round.item.len), round.bucket, "{pull:?}");
                        got.push((round.round, round.bucket, round.item.id));
                    }
                    got
                })
            })
            .collect();
        for producer in producers {
            producer.join().unwrap();
        }
        queue.close();
        let mut rounds: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
        let mut ids = Vec::new();
        for member in members {
            let got = member.join().unwrap();
            // A member's rounds are consecutive: it never skips one.
            for (expected, (round, _, _)) in got.iter().enumerate() {
                assert_eq!(*round, expected as u64, "{pull:?}");
            }
            for (round, bucket, id) in got {
                rounds.entry(round).or_default().push(bucket);
                ids.push(id);
            }
        }
        for (round, buckets) in &rounds {
            assert_eq!(buckets.len(), MEMBERS, "{pull:?} round {round}");
            assert!(
                buckets.iter().all(|&b| b == buckets[0]),
                "{pull:?} round {round}: {buckets:?}"
            );
        }
        // Exactly once; what no round took is still queued (fewer than MEMBERS per bucket).
        let handed = ids.len();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), handed, "{pull:?}: an item went out twice");
        let stats = queue.stats();
        assert_eq!(stats.rounds, rounds.len() as u64);
        assert_eq!(handed as u64 + stats.depth as u64, ITEMS, "{pull:?}");
        assert!(stats.per_bucket.iter().all(|&left| left < MEMBERS));
        assert_eq!(stats.pops, handed as u64);
    }
}

#[test]
fn a_round_waits_for_the_watermark_and_for_a_bucket_that_can_fill_it() {
    let queue = HsQueue::with_rounds(config(12, 4, PullPolicy::RoundRobin), 3).unwrap();
    let mut id = 0;
    let mut push = |len: usize| {
        id += 1;
        queue.try_push(Item { len, id }).unwrap();
    };
    // Two items of two buckets: below the watermark of 4.
    push(4);
    push(12);
    assert_eq!(
        queue.try_pop_round(0).unwrap_err(),
        PopError::BelowWatermark
    );
    // Five items: above the watermark, but no bucket holds the round's three.
    push(5);
    push(13);
    push(30);
    assert_eq!(
        queue.try_pop_round(0).unwrap_err(),
        PopError::BelowWatermark
    );
    // A third item of bucket 1 makes a round there.
    push(14);
    let first = queue.try_pop_round(2).unwrap();
    assert_eq!((first.round, first.bucket), (0, 1));
    // Every other member gets its item of the same round without waiting, whatever is queued.
    for member in [0, 1] {
        let round = queue.try_pop_round(member).unwrap();
        assert_eq!((round.round, round.bucket), (0, 1));
    }
    // Three left: below the watermark again, though bucket 0 and 2 hold 2 and 1.
    assert_eq!(queue.stats().per_bucket, vec![2, 0, 1]);
    assert_eq!(
        queue.try_pop_round(1).unwrap_err(),
        PopError::BelowWatermark
    );
    assert!(queue.stats().seen_below_watermark >= 3);
}

#[test]
fn a_member_ahead_of_the_others_waits_for_them_to_take_the_round() {
    let queue = HsQueue::with_rounds(config(8, 1, PullPolicy::RoundRobin), 2).unwrap();
    for id in 0..4 {
        queue.try_push(Item { len: 3, id }).unwrap();
    }
    let first = queue.try_pop_round(0).unwrap();
    assert_eq!(first.round, 0);
    // Member 0 may not take round 1 while member 1 has not taken round 0: it would reuse its slot.
    assert!(queue.try_pop_round(0).is_err());
    assert_eq!(queue.try_pop_round(1).unwrap().round, 0);
    assert_eq!(queue.try_pop_round(0).unwrap().round, 1);
    assert_eq!(queue.try_pop_round(1).unwrap().round, 1);
}

#[test]
fn the_pull_policy_chooses_the_bucket_per_round_and_the_items_inside_it() {
    // Buckets in turn among those that can fill a round.
    let queue = HsQueue::with_rounds(config(16, 1, PullPolicy::RoundRobin), 2).unwrap();
    for (id, len) in [3, 4, 5, 6, 20, 21, 22, 23].into_iter().enumerate() {
        queue.try_push(Item { len, id: id as u64 }).unwrap();
    }
    let mut order = Vec::new();
    for _ in 0..4 {
        let round = queue.try_pop_round(0).unwrap();
        let other = queue.try_pop_round(1).unwrap();
        assert_eq!(round.bucket, other.bucket);
        order.push((round.bucket, round.item.id, other.item.id));
    }
    // round_robin: bucket 0, then 2 (bucket 1 holds no round), then back; oldest first inside each.
    assert_eq!(order, vec![(0, 0, 1), (2, 4, 5), (0, 2, 3), (2, 6, 7)]);

    // random_in_bucket: the items of a round are drawn at random inside its bucket. Over seeds, the first
    // round of [0, 1, 2, 3] (all bucket 0) must not always be the two oldest.
    let mut firsts = std::collections::BTreeSet::new();
    for seed in 0..64 {
        let mut random = config(8, 1, PullPolicy::RandomInBucket);
        random.seed = seed;
        let queue = HsQueue::with_rounds(random, 2).unwrap();
        for id in 0..4 {
            queue.try_push(Item { len: 2, id }).unwrap();
        }
        let (a, b) = (
            queue.try_pop_round(0).unwrap(),
            queue.try_pop_round(1).unwrap(),
        );
        firsts.insert((a.item.id.min(b.item.id), a.item.id.max(b.item.id)));
    }
    assert!(firsts.len() >= 4, "random pairs seen: {firsts:?}");
}

#[test]
fn a_close_while_the_group_waits_ends_every_member_and_hands_out_no_partial_round() {
    let queue =
        Arc::new(HsQueue::with_rounds(config(8, 1, PullPolicy::RandomInBucket), 3).unwrap());
    // Two items of bucket 0: one short of a round.
    queue.try_push(Item { len: 1, id: 0 }).unwrap();
    queue.try_push(Item { len: 2, id: 1 }).unwrap();
    let members: Vec<_> = (0..3)
        .map(|member| {
            let queue = Arc::clone(&queue);
            thread::spawn(move || {
                queue
                    .pop_round_timeout(member, HANG)
                    .map(|round| round.round)
            })
        })
        .collect();
    thread::sleep(Duration::from_millis(50));
    queue.close();
    for member in members {
        assert_eq!(member.join().unwrap(), Err(PopError::Closed));
    }
    // The two items stay queued: no member trained a round the others could not.
    assert_eq!(queue.stats().depth, 2);
    assert_eq!(queue.stats().rounds, 0);
}

#[test]
fn a_round_claimed_before_the_close_still_reaches_every_member() {
    let queue = HsQueue::with_rounds(config(8, 1, PullPolicy::RoundRobin), 2).unwrap();
    for id in 0..3 {
        queue.try_push(Item { len: 10, id }).unwrap();
    }
    assert_eq!(queue.try_pop_round(0).unwrap().round, 0);
    queue.close();
    assert_eq!(queue.try_pop_round(1).unwrap().round, 0);
    // One item left of bucket 1: the end of the data for a group of two.
    assert_eq!(queue.try_pop_round(0).unwrap_err(), PopError::Closed);
    assert_eq!(queue.try_pop_round(1).unwrap_err(), PopError::Closed);
    assert_eq!(queue.stats().depth, 1);
}

#[test]
fn at_the_end_of_the_data_the_group_drains_every_bucket_that_holds_a_round() {
    let queue = HsQueue::with_rounds(config(16, 4, PullPolicy::RandomInBucket), 2).unwrap();
    // Bucket 0: 5 items, bucket 1: 2, bucket 2: 1. Below the watermark of 4 once a few are gone, but closed.
    for (id, len) in [1, 2, 3, 4, 5, 9, 10, 17].into_iter().enumerate() {
        queue.try_push(Item { len, id: id as u64 }).unwrap();
    }
    queue.close();
    let mut buckets = Vec::new();
    while let Some(round) = queue.pop_round(0) {
        let other = queue.pop_round(1).unwrap();
        assert_eq!(other.bucket, round.bucket);
        buckets.push(round.bucket);
    }
    buckets.sort_unstable();
    assert_eq!(buckets, vec![0, 0, 1]);
    // What is left: one of bucket 0 and one of bucket 2, fewer than a round each.
    assert_eq!(queue.stats().per_bucket, vec![1, 0, 1]);
    assert!(queue.pop_round(1).is_none());
}

#[test]
fn a_stop_or_a_member_leaving_releases_the_waiting_members() {
    let queue = Arc::new(HsQueue::with_rounds(config(8, 1, PullPolicy::RoundRobin), 2).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let stopped = {
        let (queue, stop) = (Arc::clone(&queue), Arc::clone(&stop));
        thread::spawn(move || {
            queue
                .pop_round_unless(0, || stop.load(Ordering::Relaxed), Duration::from_millis(5))
                .map(|round| round.round)
        })
    };
    thread::sleep(Duration::from_millis(30));
    stop.store(true, Ordering::Relaxed);
    assert_eq!(stopped.join().unwrap(), Err(PopError::Stopped));

    let waiting = {
        let queue = Arc::clone(&queue);
        thread::spawn(move || queue.pop_round_timeout(1, HANG).map(|round| round.round))
    };
    thread::sleep(Duration::from_millis(30));
    queue.leave_rounds();
    assert_eq!(waiting.join().unwrap(), Err(PopError::GroupLeft));
    // After a member left, no round is claimed even with data: the group can no longer step together.
    queue.try_push(Item { len: 1, id: 0 }).unwrap();
    queue.try_push(Item { len: 1, id: 1 }).unwrap();
    assert_eq!(queue.try_pop_round(0).unwrap_err(), PopError::GroupLeft);
    assert_eq!(queue.stats().depth, 2);
}

#[test]
fn a_queue_with_rounds_refuses_what_would_break_a_round() {
    // A full queue of 3 buckets × 1 item holds no round of two.
    let err = HsQueue::<Item>::with_rounds(config(3, 1, PullPolicy::RoundRobin), 2).unwrap_err();
    assert_eq!(
        err,
        QueueConfigError::CapacityBelowRound {
            capacity: 3,
            buckets: 3,
            members: 2,
            needed: 4
        }
    );
    assert!(err.to_string().contains("below 4"), "{err}");
    assert_eq!(
        HsQueue::<Item>::with_rounds(config(3, 1, PullPolicy::RoundRobin), 0).unwrap_err(),
        QueueConfigError::NoMembers
    );

    let queue = HsQueue::with_rounds(config(8, 1, PullPolicy::RoundRobin), 2).unwrap();
    queue.try_push(Item { len: 1, id: 0 }).unwrap();
    // A single pop would take an item a round was counted with.
    let single = queue.try_pop().unwrap_err();
    assert_eq!(
        single,
        PopError::NotAMember {
            member: None,
            members: 2
        }
    );
    assert!(single.to_string().contains("pop_round"), "{single}");
    assert!(matches!(
        queue.try_pop_round(2),
        Err(PopError::NotAMember {
            member: Some(2),
            members: 2
        })
    ));
    let plain = HsQueue::new(config(8, 1, PullPolicy::RoundRobin)).unwrap();
    plain.try_push(Item { len: 1, id: 0 }).unwrap();
    assert!(matches!(
        plain.try_pop_round(0),
        Err(PopError::NotAMember { members: 0, .. })
    ));
    assert_eq!(plain.round_members(), None);
    assert_eq!(queue.round_members(), Some(2));
}
