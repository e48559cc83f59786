//! The plan's queue block (`queue hs { capacity, min_ready, buckets, pull }`) as the queue's own configuration:
//! the one place the language's types meet the queue, which stays a data structure that knows no plan.

use draftpipe_compiler::plan::{self, QueueSpec};

use crate::queue::{PullPolicy, QueueConfig};

/// The configuration a plan's queue block describes, with `seed` for the random pull policy.
pub fn queue_config(spec: &QueueSpec, seed: u64) -> QueueConfig {
    QueueConfig {
        capacity: spec.capacity,
        min_ready: spec.min_ready,
        buckets: spec.buckets.clone(),
        pull: pull_policy(spec.pull),
        seed,
    }
}

/// The queue's pull policy for the plan's.
fn pull_policy(pull: plan::PullPolicy) -> PullPolicy {
    match pull {
        plan::PullPolicy::RandomInBucket => PullPolicy::RandomInBucket,
        plan::PullPolicy::RoundRobin => PullPolicy::RoundRobin,
        plan::PullPolicy::Fifo => PullPolicy::Fifo,
    }
}

#[cfg(test)]
mod tests {
    use draftpipe_compiler::plan::{self, QueueSpec};

    use super::queue_config;
    use crate::queue::{PullPolicy, QueueConfig};

    #[test]
    fn every_field_and_policy_comes_from_the_plan_spec() {
        for (planned, taken) in [
            (plan::PullPolicy::RandomInBucket, PullPolicy::RandomInBucket),
            (plan::PullPolicy::RoundRobin, PullPolicy::RoundRobin),
            (plan::PullPolicy::Fifo, PullPolicy::Fifo),
        ] {
            let spec = QueueSpec {
                name: "hs".into(),
                from: "target".into(),
                to: "drafter".into(),
                capacity: 20,
                min_ready: 10,
                buckets: vec![512, 1024, 2048],
                pull: planned,
            };
            assert_eq!(
                queue_config(&spec, 9),
                QueueConfig {
                    capacity: 20,
                    min_ready: 10,
                    buckets: vec![512, 1024, 2048],
                    pull: taken,
                    seed: 9,
                }
            );
        }
    }
}
