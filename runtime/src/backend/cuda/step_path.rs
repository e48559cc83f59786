//! What the step path must not do, counted: every stream synchronisation, device allocation and pinned host
//! allocation the CUDA backend makes passes through [`StepPathCounter::record`], which counts it when it falls
//! on the step path, so a test can require that a bucket's steps after its first make none.
//!
//! ```text
//!  upload_state … ─ off ─▶ stage(batch 1) ─ on ─▶ step 1: first run of each part (warm-up) ─▶ stage, step 2, …
//!                                                   ─▶ read_results leaves nothing staged or in flight ─ off ─▶ download
//! ```
//!
//! - **On the step path**: from a [`Backend::stage`](crate::backend::Backend::stage) until the
//!   [`Backend::read_results`](crate::backend::Backend::read_results) that leaves no batch staged and no step
//!   in flight. Loading and saving the state around a run (`upload`/`download`, which wait by contract) are
//!   off it; the same calls made while a batch is staged (a family staging its plan through `upload`, as
//!   `dflash` did) are on it.
//! - **Warm-up**: inside the first run of a step part (a bucket's first step, before it is captured) a call is
//!   counted apart, as allowed: lazy setup of the driver or a library may happen there. Everywhere else on the
//!   step path a call is a fault ([`StepPathCounts::steady`]).
//! - Not counted: waits on the pipeline's own events (the slot a batch is staged into, the read-back ring one
//!   step behind): they are the flow control of the design, not a drain of the device.

/// A call the step path must not make.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StepPathCall {
    /// A stream or device synchronisation (the host waits for everything queued).
    Sync,
    /// A device allocation.
    DeviceAlloc,
    /// A pinned (page-locked) host allocation.
    PinnedAlloc,
}

/// Calls of each kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CallCounts {
    /// Stream or device synchronisations.
    pub syncs: u64,
    /// Device allocations.
    pub device_allocs: u64,
    /// Pinned host allocations.
    pub pinned_allocs: u64,
}

impl CallCounts {
    /// Every call together.
    pub fn total(&self) -> u64 {
        self.syncs + self.device_allocs + self.pinned_allocs
    }

    fn add(&mut self, call: StepPathCall) {
        match call {
            StepPathCall::Sync => self.syncs += 1,
            StepPathCall::DeviceAlloc => self.device_allocs += 1,
            StepPathCall::PinnedAlloc => self.pinned_allocs += 1,
        }
    }
}

/// The step path's synchronisations and allocations so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepPathCounts {
    /// Inside the first run of a step part (allowed).
    pub warm_up: CallCounts,
    /// Anywhere else on the step path: must stay 0.
    pub steady: CallCounts,
}

/// Where the backend stands on the step path, and what it counted. See the module docs.
#[derive(Debug, Default)]
pub(crate) struct StepPathCounter {
    staged: usize,
    in_flight: usize,
    first_run: bool,
    counts: StepPathCounts,
}

impl StepPathCounter {
    /// A batch is being staged.
    pub(crate) fn staging(&mut self) {
        self.staged += 1;
    }

    /// The step of a staged batch begins.
    pub(crate) fn began(&mut self) {
        self.staged = self.staged.saturating_sub(1);
        self.in_flight += 1;
    }

    /// A step's results were read.
    pub(crate) fn read(&mut self) {
        self.in_flight = self.in_flight.saturating_sub(1);
    }

    /// The first run of a step part begins (`true`) or ends (`false`).
    pub(crate) fn first_run(&mut self, inside: bool) {
        self.first_run = inside;
    }

    /// Counts `call` when it falls on the step path.
    pub(crate) fn record(&mut self, call: StepPathCall) {
        if self.staged == 0 && self.in_flight == 0 {
            return;
        }
        if self.first_run {
            self.counts.warm_up.add(call);
        } else {
            self.counts.steady.add(call);
        }
    }

    /// What was counted.
    pub(crate) fn counts(&self) -> StepPathCounts {
        self.counts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The calls the CUDA backend makes for one step, replayed on the counter: `stage` (and the family's plan
    /// uploads, through `upload` before the fix), `begin_step`, the parts (the first run of a bucket's part
    /// with a lazy allocation inside), then the read-back of the step before.
    struct Model {
        counter: StepPathCounter,
        /// `dflash` before the fix: its nine plan uploads each allocated pinned memory and synchronised.
        plan_through_upload: bool,
        first_runs: std::collections::HashSet<usize>,
    }

    impl Model {
        fn new(plan_through_upload: bool) -> Self {
            Self {
                counter: StepPathCounter::default(),
                plan_through_upload,
                first_runs: Default::default(),
            }
        }

        /// Loading or saving the state: an upload that allocates pinned memory and waits.
        fn transfer(&mut self) {
            self.counter.record(StepPathCall::PinnedAlloc);
            self.counter.record(StepPathCall::Sync);
        }

        fn step(&mut self, bucket: usize, read_previous: bool) {
            self.counter.staging();
            if self.plan_through_upload {
                for _ in 0..9 {
                    self.transfer();
                }
            }
            self.counter.began();
            let first = self.first_runs.insert(bucket);
            self.counter.first_run(first);
            if first {
                // A library's lazy workspace, say: allowed in the first run.
                self.counter.record(StepPathCall::DeviceAlloc);
            }
            self.counter.first_run(false);
            if read_previous {
                self.counter.read();
            }
        }
    }

    #[test]
    fn a_bucket_may_allocate_in_its_first_step_and_never_after() {
        let mut model = Model::new(false);
        model.transfer();
        model.step(0, false);
        model.step(0, true);
        model.step(0, true);
        model.counter.read();
        model.transfer();
        let counts = model.counter.counts();
        assert_eq!(counts.steady.total(), 0, "{counts:?}");
        assert_eq!(
            counts.warm_up.device_allocs, 1,
            "one first run, counted apart"
        );
        // A second bucket has a first step of its own.
        model.step(1, false);
        assert_eq!(model.counter.counts().warm_up.device_allocs, 2);
        assert_eq!(model.counter.counts().steady.total(), 0);
    }

    #[test]
    fn a_plan_staged_through_waiting_uploads_counts_every_step() {
        let mut model = Model::new(true);
        for step in 0..3 {
            model.step(0, step > 0);
        }
        let counts = model.counter.counts();
        assert_eq!(counts.steady.syncs, 27, "nine uploads per staged batch");
        assert_eq!(counts.steady.pinned_allocs, 27);
        assert_eq!(counts.warm_up.device_allocs, 1);
    }

    #[test]
    fn calls_off_the_step_path_are_not_counted() {
        let mut counter = StepPathCounter::default();
        counter.record(StepPathCall::DeviceAlloc);
        counter.staging();
        counter.record(StepPathCall::Sync);
        counter.began();
        counter.record(StepPathCall::Sync);
        counter.read();
        counter.record(StepPathCall::PinnedAlloc);
        assert_eq!(
            counter.counts().steady,
            CallCounts {
                syncs: 2,
                ..CallCounts::default()
            }
        );
        // A read with nothing in flight (a misuse) does not turn the count negative or on.
        counter.read();
        counter.record(StepPathCall::Sync);
        assert_eq!(counter.counts().steady.total(), 2);
    }
}
