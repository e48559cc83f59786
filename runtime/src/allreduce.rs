//! In-process gradient all-reduce for data-parallel CPU drafter workers.
//!
//! ```text
//!  drafter 0 ─ grads ─┐                      ┌─▶ mean grads ─▶ AdamW (replica 0)
//!  drafter 1 ─ grads ─┼─▶ AllReduce::mean ───┼─▶ mean grads ─▶ AdamW (replica 1)
//!  drafter N ─ grads ─┘   (one round a step)  └─▶ ...
//! ```
//!
//! Every worker keeps a full replica of the parameters; after each round all replicas hold the same mean
//! gradient, so identical AdamW updates keep them identical. A round also carries one shared decision (stop
//! after this step or not), taken once by the worker that completes the round, so workers that run in
//! lockstep never disagree about when to stop — disagreement would leave one of them waiting forever.
//!
//! A worker that runs out of data calls [`AllReduce::leave`]; the rounds after that average over the workers
//! that remain, and a round the leaver was the last to complete finishes at once, with the leaver taking its
//! stop decision.
//!
//! A worker that fails calls [`AllReduce::abort`]: the members waiting in the current round and every later
//! call of [`AllReduce::mean`] return at once with `aborted` (and `stop`) set, and the hooks registered with
//! [`AllReduce::on_abort`] run once — the GPU workers register the abort of their NCCL communicators there, the
//! collective that would otherwise wait forever for the failed rank.

use std::sync::{Condvar, Mutex, PoisonError, RwLock};

/// What [`AllReduce::on_abort`] registers.
type AbortHook = Box<dyn FnOnce() + Send>;

/// Mean of the gradient buffers of a group of workers, one round per training step.
///
/// # Examples
///
/// ```
/// use draftpipe_runtime::allreduce::AllReduce;
/// use std::sync::Arc;
///
/// let group = Arc::new(AllReduce::new(2, 3));
/// let handles: Vec<_> = (0..2)
///     .map(|worker| {
///         let group = Arc::clone(&group);
///         std::thread::spawn(move || {
///             let mut grads = vec![worker as f32; 3];
///             let outcome = group.mean(&mut grads, || false);
///             assert!(!outcome.stop);
///             grads
///         })
///     })
///     .collect();
/// for handle in handles {
///     assert_eq!(handle.join().unwrap(), vec![0.5; 3]);
/// }
/// ```
pub struct AllReduce {
    round: Mutex<Round>,
    round_done: Condvar,
    result: RwLock<Vec<f32>>,
    abort_hooks: Mutex<Vec<AbortHook>>,
}

impl std::fmt::Debug for AllReduce {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AllReduce")
            .field("round", &self.round)
            .finish_non_exhaustive()
    }
}

#[derive(Debug)]
struct Round {
    members: usize,
    arrived: usize,
    generation: u64,
    sum: Vec<f32>,
    stop: bool,
    participants: usize,
    aborted: bool,
}

/// What a finished round tells every worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoundOutcome {
    /// The shared decision to stop after this step.
    pub stop: bool,
    /// Workers whose gradients the mean is over (0 when aborted).
    pub participants: usize,
    /// A member aborted the group: the gradients were left as they were, and every worker must stop.
    pub aborted: bool,
}

impl RoundOutcome {
    const ABORTED: Self = Self {
        stop: true,
        participants: 0,
        aborted: true,
    };
}

impl AllReduce {
    /// A group of `members` workers exchanging gradient buffers of `len` elements.
    pub fn new(members: usize, len: usize) -> Self {
        Self {
            round: Mutex::new(Round {
                members,
                arrived: 0,
                generation: 0,
                sum: vec![0.0; len],
                stop: false,
                participants: 0,
                aborted: false,
            }),
            round_done: Condvar::new(),
            result: RwLock::new(vec![0.0; len]),
            abort_hooks: Mutex::new(Vec::new()),
        }
    }

    /// Replaces `grads` with the mean over every member's `grads` of this round.
    ///
    /// `should_stop` is evaluated once per round, by the worker that completes it; its answer reaches every
    /// member in the returned [`RoundOutcome`].
    ///
    /// # Panics
    ///
    /// When `grads` is not as long as the group's buffers (a programming error, not bad input).
    pub fn mean(&self, grads: &mut [f32], should_stop: impl FnOnce() -> bool) -> RoundOutcome {
        let mut round = self.round.lock().unwrap_or_else(PoisonError::into_inner);
        assert_eq!(grads.len(), round.sum.len(), "all-reduce buffer length");
        if round.aborted {
            return RoundOutcome::ABORTED;
        }
        if round.arrived == 0 {
            round.sum.copy_from_slice(grads);
        } else {
            for (total, value) in round.sum.iter_mut().zip(grads.iter()) {
                *total += *value;
            }
        }
        round.arrived += 1;
        let generation = round.generation;
        if round.arrived >= round.members {
            self.finish_round(&mut round, should_stop());
        } else {
            while round.generation == generation && !round.aborted {
                round = self
                    .round_done
                    .wait(round)
                    .unwrap_or_else(PoisonError::into_inner);
            }
            if round.generation == generation {
                return RoundOutcome::ABORTED;
            }
        }
        let outcome = RoundOutcome {
            stop: round.stop,
            participants: round.participants,
            aborted: false,
        };
        drop(round);
        // The result of this round is rewritten only when every member has arrived at the next round, which
        // this worker has not: reading it outside the round lock is safe.
        grads.copy_from_slice(&self.result.read().unwrap_or_else(PoisonError::into_inner));
        outcome
    }

    /// Removes one member for good (it has no more data, or it failed). Completes the current round if the
    /// others are all waiting in it; `should_stop` then takes the round's decision, as it would have in
    /// [`AllReduce::mean`], so a round the leaver completes stops exactly when a full one would.
    pub fn leave(&self, should_stop: impl FnOnce() -> bool) {
        let mut round = self.round.lock().unwrap_or_else(PoisonError::into_inner);
        round.members = round.members.saturating_sub(1);
        if round.arrived > 0 && round.arrived >= round.members {
            self.finish_round(&mut round, should_stop());
        }
    }

    /// Ends the group because a member failed: the members waiting in the current round return at once, every
    /// later round too (all with [`RoundOutcome::aborted`]), and the abort hooks run once, on this thread.
    pub fn abort(&self) {
        {
            let mut round = self.round.lock().unwrap_or_else(PoisonError::into_inner);
            if round.aborted {
                return;
            }
            round.aborted = true;
            self.round_done.notify_all();
        }
        let hooks = std::mem::take(
            &mut *self
                .abort_hooks
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        );
        for hook in hooks {
            hook();
        }
    }

    /// Runs `hook` when the group is aborted (at once, on this thread, if it already is).
    pub fn on_abort(&self, hook: impl FnOnce() + Send + 'static) {
        let aborted = self
            .round
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .aborted;
        if aborted {
            hook();
        } else {
            self.abort_hooks
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(Box::new(hook));
        }
    }

    fn finish_round(&self, round: &mut Round, stop: bool) {
        let participants = round.arrived;
        let scale = 1.0 / participants as f32;
        {
            let mut result = self.result.write().unwrap_or_else(PoisonError::into_inner);
            for (out, total) in result.iter_mut().zip(round.sum.iter()) {
                *out = *total * scale;
            }
        }
        round.participants = participants;
        round.stop = stop;
        round.arrived = 0;
        round.generation += 1;
        self.round_done.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn mean_over_rounds_matches_f64_reference() {
        let members = 3;
        let len = 257;
        let rounds = 50;
        let group = Arc::new(AllReduce::new(members, len));
        let value = |worker: usize, round: usize, i: usize| {
            ((worker * 7919 + round * 131 + i) % 97) as f32 - 48.0
        };
        let handles: Vec<_> = (0..members)
            .map(|worker| {
                let group = Arc::clone(&group);
                std::thread::spawn(move || {
                    for round in 0..rounds {
                        let mut grads: Vec<f32> =
                            (0..len).map(|i| value(worker, round, i)).collect();
                        let outcome = group.mean(&mut grads, || round == rounds - 1);
                        assert_eq!(outcome.participants, members);
                        assert_eq!(outcome.stop, round == rounds - 1);
                        for (i, got) in grads.iter().enumerate() {
                            let want: f64 =
                                (0..members).map(|w| value(w, round, i) as f64).sum::<f64>()
                                    / members as f64;
                            assert!(
                                (*got as f64 - want).abs() <= 1e-5 * want.abs().max(1.0),
                                "round {round} i {i}"
                            );
                        }
                    }
                })
            })
            .collect();
        for handle in handles {
            handle.join().unwrap();
        }
    }

    #[test]
    fn a_leaving_member_releases_the_waiting_ones_with_its_stop_decision() {
        for leaver_stops in [false, true] {
            let group = Arc::new(AllReduce::new(2, 4));
            let waiter = {
                let group = Arc::clone(&group);
                std::thread::spawn(move || {
                    let mut grads = vec![2.0; 4];
                    let outcome = group.mean(&mut grads, || unreachable!("the leaver decides"));
                    (grads, outcome)
                })
            };
            while group.round.lock().unwrap().arrived == 0 {
                std::thread::yield_now();
            }
            group.leave(|| leaver_stops);
            let (grads, outcome) = waiter.join().unwrap();
            assert_eq!(grads, vec![2.0; 4]);
            assert_eq!(
                outcome,
                RoundOutcome {
                    stop: leaver_stops,
                    participants: 1,
                    aborted: false,
                }
            );
            let mut alone = vec![3.0; 4];
            assert_eq!(
                group.mean(&mut alone, || true),
                RoundOutcome {
                    stop: true,
                    participants: 1,
                    aborted: false,
                }
            );
            assert_eq!(alone, vec![3.0; 4]);
        }
    }

    /// Three workers train in lockstep; worker 1 fails in round 5 (a fake failing rank). It records its error
    /// and aborts the group, the way a GPU worker aborts its NCCL communicators: the others, blocked in round 5,
    /// must return at once with the abort and stop, so the run ends with the failed worker's error. A hang is
    /// caught by the timeout instead of hanging the test.
    #[test]
    fn a_failing_rank_ends_the_run_with_its_error_instead_of_hanging() {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::mpsc;
        use std::time::Duration;

        let group = Arc::new(AllReduce::new(3, 8));
        let hook_ran = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&hook_ran);
        group.on_abort(move || flag.store(true, Ordering::SeqCst));
        let (done, finished) = mpsc::channel();
        for worker in 0..3 {
            let (group, done) = (Arc::clone(&group), done.clone());
            std::thread::spawn(move || {
                let mut rounds = 0;
                let result = loop {
                    if worker == 1 && rounds == 5 {
                        group.abort();
                        break Err(format!(
                            "worker {worker}: fake device fault in step {rounds}"
                        ));
                    }
                    let mut grads = vec![worker as f32; 8];
                    let outcome = group.mean(&mut grads, || false);
                    if outcome.aborted {
                        assert_eq!(
                            grads,
                            vec![worker as f32; 8],
                            "an aborted round leaves the gradients"
                        );
                        break Ok(rounds);
                    }
                    assert_eq!(grads, vec![1.0; 8]);
                    rounds += 1;
                };
                done.send((worker, result)).unwrap();
            });
        }
        let mut results: Vec<_> = (0..3)
            .map(|_| {
                finished
                    .recv_timeout(Duration::from_secs(10))
                    .expect("a worker hung after another failed")
            })
            .collect();
        results.sort_by_key(|(worker, _)| *worker);
        assert_eq!(results[0].1, Ok(5));
        assert_eq!(
            results[1].1,
            Err("worker 1: fake device fault in step 5".to_owned())
        );
        assert_eq!(results[2].1, Ok(5));
        assert!(hook_ran.load(Ordering::SeqCst), "the abort hook ran");
        let mut late = vec![0.0; 8];
        assert!(
            group.mean(&mut late, || false).aborted,
            "later rounds stay aborted"
        );
        let ran_at_once = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&ran_at_once);
        group.on_abort(move || flag.store(true, Ordering::SeqCst));
        assert!(
            ran_at_once.load(Ordering::SeqCst),
            "a hook registered after the abort runs at once"
        );
    }

    #[test]
    fn a_member_leaving_between_rounds_decides_nothing() {
        let group = AllReduce::new(2, 1);
        group.leave(|| unreachable!("no round is waiting"));
        let mut grads = vec![1.0];
        assert!(!group.mean(&mut grads, || false).stop);
    }
}
