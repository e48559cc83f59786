//! The threads of a CPU drafter: a rayon pool that the drafter's whole worker loop runs inside, over which every
//! GEMM (in blocks of rows or columns) and every other kernel launch (in parts of its indices) splits.
//!
//! ```text
//!  drafter thread ──HostThreads::run──▶ pool thread 0: the worker loop (stage, step, finish, …)
//!                                        │ each kernel launch: its indices in parts (launch::* → for_each_part)
//!                                        └──▶ pool threads 0..n take the parts (rayon's work stealing)
//! ```
//!
//! Running the loop inside the pool matters: a launch from a pool thread pushes its parts onto that thread's own
//! queue, where an idle pool thread steals them in about a microsecond, while a launch from outside a pool
//! would hand every launch to the pool and wait for it (a wake-up per launch, about the cost of a small
//! kernel). Outside a pool (tests, tools) launches run on the calling thread, with the same results: each
//! index is computed the same way wherever it runs.

use super::gemm::GEMM_THREADS_VAR;

/// A rayon pool for one CPU drafter's kernel launches.
#[derive(Debug)]
pub struct HostThreads {
    pool: rayon::ThreadPool,
}

impl HostThreads {
    /// A pool of `threads` threads (at least 1), named `NAME-kernels-I`.
    ///
    /// # Errors
    /// When the OS refuses a thread.
    pub fn new(name: &str, threads: usize) -> Result<Self, rayon::ThreadPoolBuildError> {
        let name = name.to_owned();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads.max(1))
            .thread_name(move |i| format!("{name}-kernels-{i}"))
            .build()?;
        Ok(Self { pool })
    }

    /// A drafter's thread count: [`GEMM_THREADS_VAR`] (which `run` sets when several CPU drafters share the
    /// cores), or every core.
    ///
    /// # Examples
    /// ```
    /// assert!(draftpipe_runtime::backend::cpu::HostThreads::drafter_threads() >= 1);
    /// ```
    pub fn drafter_threads() -> usize {
        std::env::var(GEMM_THREADS_VAR)
            .ok()
            .and_then(|value| value.trim().parse::<usize>().ok())
            .filter(|&threads| threads > 0)
            .unwrap_or_else(|| {
                std::thread::available_parallelism().map_or(1, std::num::NonZero::get)
            })
    }

    /// The pool's thread count.
    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// Runs `work` on one of the pool's threads (the caller waits), so the kernel launches inside it split
    /// over the pool.
    ///
    /// # Examples
    /// ```
    /// use draftpipe_runtime::backend::cpu::{HostThreads, kernels};
    ///
    /// let threads = HostThreads::new("doc", 2).unwrap();
    /// let inter = 64;
    /// let gate_up: Vec<f32> = (0..2 * inter * 500).map(|i| (i % 17) as f32 / 8.0 - 1.0).collect();
    /// let (mut serial, mut pooled) = (vec![0.0; inter * 500], vec![f32::NAN; inter * 500]);
    /// kernels::swiglu_forward(&gate_up, &mut serial, inter);
    /// threads.run(|| kernels::swiglu_forward(&gate_up, &mut pooled, inter));
    /// assert_eq!(serial, pooled);
    /// ```
    pub fn run<R: Send>(&self, work: impl FnOnce() -> R + Send) -> R {
        self.pool.install(work)
    }
}
