//! When a step part runs as a CUDA graph, and how a capture always ends: [`run_part`] is the whole of
//! [`CudaBackend`]'s `run_part`, written over [`Capturing`] (the four driver calls it makes), so the host tests
//! drive the same flow through a stand-in stream without a GPU.
//!
//! ```text
//!  run_part(part) ──until one succeeds──▶ eager ──next──▶ begin capture → body → end capture (always) → upload
//!                 → launch ──after──▶ launch
//! ```
//!
//! - **Eager before capture.** A part runs eagerly until one run has succeeded, then it is captured: drivers
//!   before CUDA 12.3 refuse to capture work whose kernels or libraries have not run once (lazy module loading,
//!   cuBLAS's first call), and an eager first step also tells a kernel fault apart from a capture fault.
//! - **A capture always ends.** An error or a panic inside the captured body ends the capture before it
//!   propagates (the graph is discarded, and the next run captures again): a stream left capturing would turn
//!   every later call on it (the tear-down's synchronisation included) into a capture error.
//! - With graphs off ([`LaunchMode::Eager`]) every run is eager; the first still counts as warm-up for the
//!   step-path counter.
//!
//! [`CudaBackend`]: crate::backend::cuda::CudaBackend
//! [`LaunchMode::Eager`]: draftpipe_compiler::plan::LaunchMode::Eager

use std::collections::{HashMap, HashSet};
use std::hash::Hash;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};

use cudarc::driver::CudaGraph;
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode_enum};
use draftpipe_compiler::plan::LaunchMode;

use super::{CudaBackend, CudaError};
use crate::backend::{BackendResult, StepPart};

/// How a part runs this time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PartRun {
    /// Enqueue the body directly (no run of it has succeeded yet).
    Eager,
    /// Capture the body into a graph, then launch it.
    Capture,
    /// Launch the graph captured before.
    Replay,
}

/// The graphs of a backend's step parts, and which parts have run once.
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

    /// How `part` runs now: eagerly until [`Self::ran_eagerly`], then captured until its graph is
    /// [`Self::insert`]ed (a capture that failed is tried again), then replayed.
    pub(crate) fn next(&self, part: &K) -> PartRun {
        if self.graphs.contains_key(part) {
            PartRun::Replay
        } else if self.ran_eagerly.contains(part) {
            PartRun::Capture
        } else {
            PartRun::Eager
        }
    }

    /// An eager run of `part` succeeded.
    pub(crate) fn ran_eagerly(&mut self, part: K) {
        self.ran_eagerly.insert(part);
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

/// What [`run_part`] needs of a backend: its part graphs, and the stream's capture and launch.
pub(crate) trait Capturing: Sized {
    /// A captured, instantiated graph.
    type Graph;
    /// The backend's graphs.
    fn part_graphs(&mut self) -> &mut PartGraphs<StepPart, Self::Graph>;
    /// Whether parts become graphs at all.
    fn launch_mode(&self) -> LaunchMode;
    /// Begins capturing the compute stream.
    fn begin_capture(&mut self) -> BackendResult;
    /// Ends the capture (always called once it began) and instantiates what it recorded.
    fn end_capture(&mut self) -> BackendResult<Self::Graph>;
    /// Launches `part`'s graph.
    fn launch(&mut self, part: &StepPart) -> BackendResult;
    /// A part's first run begins (`true`) or ends (`false`).
    fn first_run(&mut self, inside: bool);
}

/// Runs `body` as step part `part` of `backend`, by the rules of the module docs.
pub(crate) fn run_part<S: Capturing>(
    backend: &mut S,
    part: StepPart,
    body: &mut dyn FnMut(&mut S) -> BackendResult,
) -> BackendResult {
    match backend.part_graphs().next(&part) {
        PartRun::Eager => {
            backend.first_run(true);
            let ran = body(backend);
            backend.first_run(false);
            ran?;
            backend.part_graphs().ran_eagerly(part);
            Ok(())
        }
        _ if backend.launch_mode() == LaunchMode::Eager => body(backend),
        PartRun::Capture => {
            backend.begin_capture()?;
            let (enqueued, graph) = ended_capture(backend, body, S::end_capture);
            enqueued?;
            backend.part_graphs().insert(part, graph?);
            backend.launch(&part)
        }
        PartRun::Replay => backend.launch(&part),
    }
}

/// Runs `body` between a capture that `state` has begun and `end`, which ends it: `end` runs whether the body
/// succeeded, failed or panicked, and a panic resumes after it. Returns the body's result and `end`'s.
fn ended_capture<S, E, G>(
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

/// A captured step part. `CudaGraph` holds raw driver handles and so is not `Send`, but a graph exec may be
/// launched from any thread (cudarc binds the context on launch); the backend owning it uses it from one
/// thread at a time.
pub(crate) struct StepGraph(CudaGraph);

// SAFETY: see above; the graph is only reached through `&mut CudaBackend`.
unsafe impl Send for StepGraph {}

impl Capturing for CudaBackend {
    type Graph = StepGraph;

    fn part_graphs(&mut self) -> &mut PartGraphs<StepPart, StepGraph> {
        &mut self.graphs
    }

    fn launch_mode(&self) -> LaunchMode {
        self.launch
    }

    fn begin_capture(&mut self) -> BackendResult {
        self.compute
            .begin_capture(CUstreamCaptureMode_enum::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(CudaError::from)?;
        Ok(())
    }

    fn end_capture(&mut self) -> BackendResult<StepGraph> {
        let graph = self
            .compute
            .end_capture(CUgraphInstantiate_flags(0))
            .map_err(CudaError::from)?
            .ok_or(CudaError::EmptyCapture)?;
        graph.upload().map_err(CudaError::from)?;
        Ok(StepGraph(graph))
    }

    fn launch(&mut self, part: &StepPart) -> BackendResult {
        let graph = self.graphs.get(part).ok_or(CudaError::EmptyCapture)?;
        graph.0.launch().map_err(CudaError::from)?;
        Ok(())
    }

    fn first_run(&mut self, inside: bool) {
        self.step_path.first_run(inside);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::BackendError;

    const PART: StepPart = StepPart::ForwardBackward { bucket: 0, slot: 1 };
    const OTHER: StepPart = StepPart::Update;

    /// A stand-in backend: a stream that records what happens to it, and graphs that are the list of body
    /// calls captured.
    struct Stream {
        launch: LaunchMode,
        graphs: PartGraphs<StepPart, Vec<&'static str>>,
        capturing: bool,
        /// What the stream was given, in order ("eager body", "begin", "captured body", "end", "launch").
        log: Vec<&'static str>,
        /// What `end_capture` returns.
        end_fails: bool,
        first_runs: usize,
    }

    impl Stream {
        fn new(launch: LaunchMode) -> Self {
            Self {
                launch,
                graphs: PartGraphs::new(),
                capturing: false,
                log: Vec::new(),
                end_fails: false,
                first_runs: 0,
            }
        }

        /// Runs `part` with a body that enqueues one call, or fails, or panics.
        fn run(&mut self, part: StepPart, body: Body) -> BackendResult {
            self.log.clear();
            run_part(self, part, &mut |s: &mut Stream| {
                s.log.push(if s.capturing {
                    "captured body"
                } else {
                    "eager body"
                });
                match body {
                    Body::Enqueues => Ok(()),
                    Body::Fails => Err(BackendError::Unsupported("launch failed".into())),
                    Body::Panics => panic!("assertion in a kernel launcher"),
                }
            })
        }
    }

    #[derive(Clone, Copy)]
    enum Body {
        Enqueues,
        Fails,
        Panics,
    }

    impl Capturing for Stream {
        type Graph = Vec<&'static str>;

        fn part_graphs(&mut self) -> &mut PartGraphs<StepPart, Self::Graph> {
            &mut self.graphs
        }

        fn launch_mode(&self) -> LaunchMode {
            self.launch
        }

        fn begin_capture(&mut self) -> BackendResult {
            assert!(!self.capturing, "a capture began inside another");
            self.capturing = true;
            self.log.push("begin");
            Ok(())
        }

        fn end_capture(&mut self) -> BackendResult<Self::Graph> {
            assert!(self.capturing, "a capture ended that had not begun");
            self.capturing = false;
            self.log.push("end");
            if self.end_fails {
                return Err(BackendError::Unsupported("capture invalidated".into()));
            }
            Ok(vec!["captured body"])
        }

        fn launch(&mut self, part: &StepPart) -> BackendResult {
            assert!(self.graphs.get(part).is_some(), "launch without a graph");
            self.log.push("launch");
            Ok(())
        }

        fn first_run(&mut self, inside: bool) {
            self.first_runs += usize::from(inside);
        }
    }

    #[test]
    fn the_first_run_is_eager_the_second_captured_and_later_ones_replay() {
        let mut stream = Stream::new(LaunchMode::Graph);
        stream.run(PART, Body::Enqueues).unwrap();
        assert_eq!(stream.log, ["eager body"]);
        stream.run(OTHER, Body::Enqueues).unwrap();
        assert_eq!(stream.log, ["eager body"], "parts are apart");
        stream.run(PART, Body::Enqueues).unwrap();
        assert_eq!(stream.log, ["begin", "captured body", "end", "launch"]);
        for _ in 0..2 {
            stream.run(PART, Body::Enqueues).unwrap();
            assert_eq!(stream.log, ["launch"], "replayed, the body not called");
        }
        assert_eq!(stream.first_runs, 2, "one first run per part");
    }

    #[test]
    fn a_failed_eager_run_is_not_a_warm_up_a_capture_may_follow() {
        let mut stream = Stream::new(LaunchMode::Graph);
        assert!(stream.run(PART, Body::Fails).is_err());
        stream.run(PART, Body::Enqueues).unwrap();
        assert_eq!(stream.log, ["eager body"], "still eager after a failure");
        stream.run(PART, Body::Enqueues).unwrap();
        assert_eq!(stream.log, ["begin", "captured body", "end", "launch"]);
    }

    #[test]
    fn a_failure_in_the_captured_body_ends_the_capture_and_returns_the_error() {
        let mut stream = Stream::new(LaunchMode::Graph);
        stream.run(PART, Body::Enqueues).unwrap();
        let failed = stream.run(PART, Body::Fails).unwrap_err();
        assert!(failed.to_string().contains("launch failed"), "{failed}");
        assert_eq!(stream.log, ["begin", "captured body", "end"], "no launch");
        assert!(!stream.capturing);
        // The graph was discarded: the next run captures again.
        stream.run(PART, Body::Enqueues).unwrap();
        assert_eq!(stream.log, ["begin", "captured body", "end", "launch"]);
    }

    #[test]
    fn a_panic_in_the_captured_body_ends_the_capture_before_it_resumes() {
        let mut stream = Stream::new(LaunchMode::Graph);
        stream.run(PART, Body::Enqueues).unwrap();
        let panicked = catch_unwind(AssertUnwindSafe(|| stream.run(PART, Body::Panics)));
        assert!(panicked.is_err(), "the panic propagates");
        assert!(!stream.capturing, "after the capture was ended");
        assert_eq!(stream.log, ["begin", "captured body", "end"]);
        assert!(stream.graphs.get(&PART).is_none());
    }

    #[test]
    fn a_capture_the_driver_refuses_to_end_keeps_no_graph() {
        let mut stream = Stream::new(LaunchMode::Graph);
        stream.run(PART, Body::Enqueues).unwrap();
        stream.end_fails = true;
        let refused = stream.run(PART, Body::Enqueues).unwrap_err();
        assert!(refused.to_string().contains("invalidated"), "{refused}");
        assert!(stream.graphs.get(&PART).is_none());
        stream.end_fails = false;
        stream.run(PART, Body::Enqueues).unwrap();
        assert_eq!(stream.log, ["begin", "captured body", "end", "launch"]);
    }

    #[test]
    fn without_graphs_every_run_is_eager() {
        let mut stream = Stream::new(LaunchMode::Eager);
        for _ in 0..3 {
            stream.run(PART, Body::Enqueues).unwrap();
            assert_eq!(stream.log, ["eager body"]);
        }
        assert_eq!(stream.first_runs, 1, "the first still counts as warm-up");
    }
}
