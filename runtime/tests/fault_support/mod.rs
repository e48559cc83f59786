//! A source that breaks on demand, shared by the pipeline fault tests.

use draftpipe_runtime::batch::HsBatch;
use draftpipe_runtime::source::{HsSource, SourceError};

/// The error every injected source failure carries, so a test can find it in messages and summaries.
pub const FAILURE: &str = "the disk went away (injected)";

/// Delegates to the plan's own source, and fails every `fill_next` after the first `batches`.
pub struct FailAfter {
    /// The plan's own source.
    pub inner: Box<dyn HsSource>,
    /// Batches delivered before every later `fill_next` fails.
    pub batches: usize,
}

impl HsSource for FailAfter {
    fn next_bucket(&mut self) -> Result<Option<usize>, SourceError> {
        self.inner.next_bucket()
    }

    fn fill_next(&mut self, out: &mut HsBatch) -> Result<(), SourceError> {
        if self.batches == 0 {
            return Err(SourceError::Buffer(FAILURE.into()));
        }
        self.batches -= 1;
        self.inner.fill_next(out)
    }

    fn position(&self) -> u64 {
        self.inner.position()
    }

    fn seek(&mut self, position: u64) -> Result<(), SourceError> {
        self.inner.seek(position)
    }
}
