//! When a step part runs as a CUDA graph, and how a capture always ends: the rules [`CudaBackend`]'s `run_part`
//! follows, kept apart from the driver so the host tests check them without a GPU.
//!
//! ```text
//!  run_part(part) ──first time──▶ eager ──second time──▶ capture → upload → launch ──after──▶ launch
//! ```
//!
//! - **Eager before capture.** A part's first run is eager, its second is captured: drivers before CUDA 12.3
//!   refuse to capture work whose kernels or libraries have not run once (lazy module loading, cuBLAS's first
//!   call), and an eager first step also tells a kernel fault apart from a capture fault.
//! - **A capture always ends.** An error or a panic inside the captured body ends the capture before it
//!   propagates: a stream left capturing would turn every later call on it (the tear-down's synchronisation
//!   included) into a capture error.
//!
//! [`CudaBackend`]: crate::backend::cuda::CudaBackend

use std::collections::{HashMap, HashSet};
use std::hash::Hash;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};

/// How a part runs this time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PartRun {
    /// Enqueue the body directly (its first run).
    Eager,
    /// Capture the body into a graph, then launch it (its second run).
    Capture,
    /// Launch the graph captured before.
    Replay,
}

/// The graphs of a backend's step parts, and which parts have already run once.
#[derive(Debug)]
pub(crate) struct PartGraphs<K, G> {
    ran_eagerly: HashSet<K>,
    graphs: HashMap<K, G>,
}

impl<K: Eq + Hash + Clone, G> PartGraphs<K, G> {
    /// No part has run yet.
    pub(crate) fn new() -> Self {
        Self {
            ran_eagerly: HashSet::new(),
            graphs: HashMap::new(),
        }
    }

    /// How `part` runs now; a part said [`PartRun::Eager`] once is said [`PartRun::Capture`] next, until its
    /// graph is [`Self::insert`]ed (a capture that failed is tried again).
    pub(crate) fn next(&mut self, part: &K) -> PartRun {
        if self.graphs.contains_key(part) {
            PartRun::Replay
        } else if self.ran_eagerly.insert(part.clone()) {
            PartRun::Eager
        } else {
            PartRun::Capture
        }
    }

    /// Keeps `part`'s captured graph.
    pub(crate) fn insert(&mut self, part: K, graph: G) {
        self.graphs.insert(part, graph);
    }

    /// `part`'s graph, once captured.
    pub(crate) fn get(&self, part: &K) -> Option<&G> {
        self.graphs.get(part)
    }
}

/// Runs `body` between a capture that `state` has begun and `end`, which ends it: `end` runs whether the body
/// succeeded, failed or panicked, and a panic resumes after it. Returns the body's result and `end`'s.
pub(crate) fn ended_capture<S, E, G>(
    state: &mut S,
    body: impl FnOnce(&mut S) -> Result<(), E>,
    end: impl FnOnce(&mut S) -> G,
) -> (Result<(), E>, G) {
    let enqueued = catch_unwind(AssertUnwindSafe(|| body(state)));
    let ended = end(state);
    match enqueued {
        Ok(enqueued) => (enqueued, ended),
        Err(panic) => resume_unwind(panic),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_part_runs_eagerly_once_then_is_captured_then_replayed() {
        let mut graphs = PartGraphs::new();
        assert_eq!(graphs.next(&(0, 1)), PartRun::Eager);
        assert_eq!(graphs.next(&(1, 1)), PartRun::Eager, "parts are apart");
        assert_eq!(graphs.next(&(0, 1)), PartRun::Capture);
        // A capture that failed leaves no graph: the next run captures again, never eagerly inside a graph run.
        assert_eq!(graphs.next(&(0, 1)), PartRun::Capture);
        graphs.insert((0, 1), "graph");
        assert_eq!(graphs.next(&(0, 1)), PartRun::Replay);
        assert_eq!(graphs.get(&(0, 1)), Some(&"graph"));
        assert_eq!(graphs.get(&(1, 1)), None);
        assert_eq!(graphs.next(&(1, 1)), PartRun::Capture);
    }

    /// A stand-in for the stream: whether it is capturing.
    #[derive(Default)]
    struct Stream {
        capturing: bool,
    }

    fn end(stream: &mut Stream) -> &'static str {
        stream.capturing = false;
        "graph"
    }

    #[test]
    fn a_capture_ends_after_a_body_that_succeeds_or_fails() {
        let mut stream = Stream { capturing: true };
        let (enqueued, graph) = ended_capture(&mut stream, |_| Ok::<(), &str>(()), end);
        assert_eq!(
            (enqueued, graph, stream.capturing),
            (Ok(()), "graph", false)
        );
        let mut stream = Stream { capturing: true };
        let (enqueued, _) = ended_capture(&mut stream, |_| Err("launch failed"), end);
        assert_eq!((enqueued, stream.capturing), (Err("launch failed"), false));
    }

    #[test]
    fn a_capture_ends_before_a_panic_in_its_body_propagates() {
        let mut stream = Stream { capturing: true };
        let panicked = catch_unwind(AssertUnwindSafe(|| {
            ended_capture(
                &mut stream,
                |_| -> Result<(), ()> { panic!("assertion in a kernel launcher") },
                end,
            )
        }));
        assert!(panicked.is_err(), "the panic propagates");
        assert!(!stream.capturing, "after the capture was ended");
    }
}
