//! The Chrome/Perfetto trace: one track per producer and drafter, one complete (`"ph": "X"`) event per
//! recorded phase span, and counter (`"ph": "C"`) tracks with every status line's tokens/s, the acceptance
//! check's τ (with an `acceptance` section) and per-drafter busy,
//! wait and GPU shares.
//!
//! Memory is bounded by keeping the **last** `max_spans_per_worker` spans of each worker: the telemetry thread
//! drains the workers' rings into a [`TraceBuffer`] every sampling period, and the oldest spans are evicted
//! (and counted) once a worker's buffer is full. The file is written once, at the end, streaming one event at
//! a time (no JSON tree is built in memory). Open it at <https://ui.perfetto.dev> or `chrome://tracing`.

use std::collections::VecDeque;
use std::io::Write;
use std::path::Path;

use serde::Serialize;

use super::TelemetryError;
use super::phase::{DrafterPhase, ProducerPhase};
use super::recorder::{Span, Telemetry, Worker};
use super::status::{DrafterStatus, StatusLine};
use crate::output_file::write_output;

/// Trace process id of the producers' tracks.
pub const PRODUCER_PID: u32 = 1;
/// Trace process id of the drafters' tracks.
pub const DRAFTER_PID: u32 = 2;

/// The most recent spans of every worker, bounded per worker.
#[derive(Debug)]
pub struct TraceBuffer {
    producers: Vec<VecDeque<Span>>,
    drafters: Vec<VecDeque<Span>>,
    max_spans_per_worker: usize,
    evicted: u64,
    /// The status lines' figures, as counter tracks beside the spans.
    status: VecDeque<StatusCounters>,
}

/// One status line's figures in the trace: what `--json` and `status.jsonl` say at the same instant.
#[derive(Debug, Clone)]
struct StatusCounters {
    ts_us: f64,
    /// Real tokens and token slots per second (`None` before the first step).
    real_tokens_per_s: Option<f64>,
    token_slots_per_s: Option<f64>,
    window_s: f64,
    drafters: Vec<DrafterStatus>,
    /// The acceptance check's newest real τ and teacher-forced τ, once there is one.
    acceptance_tau: Option<(f64, Option<f64>)>,
}

impl TraceBuffer {
    /// Default bound: at 8 spans per step, the last ~8k steps of each drafter, about 1.5 MiB per worker.
    pub const DEFAULT_MAX_SPANS_PER_WORKER: usize = 65_536;

    /// An empty buffer for `producers` and `drafters` workers, keeping at most `max_spans_per_worker` each.
    pub fn new(producers: usize, drafters: usize, max_spans_per_worker: usize) -> Self {
        Self {
            producers: vec![VecDeque::new(); producers],
            drafters: vec![VecDeque::new(); drafters],
            max_spans_per_worker: max_spans_per_worker.max(1),
            evicted: 0,
            status: VecDeque::new(),
        }
    }

    /// Adds a status line's figures as counter events (the same bound as a worker's spans, oldest dropped).
    pub fn push_status(&mut self, line: &StatusLine) {
        if self.status.len() == self.max_spans_per_worker {
            self.status.pop_front();
        }
        self.status.push_back(StatusCounters {
            ts_us: line.elapsed_s * 1e6,
            real_tokens_per_s: line.real_tokens_per_s,
            token_slots_per_s: line.token_slots_per_s,
            window_s: line.rate_window_s,
            drafters: line.drafters.clone(),
            acceptance_tau: line
                .acceptance
                .as_ref()
                .and_then(|a| a.tau.map(|tau| (tau, a.teacher_forced_tau_simulated))),
        });
    }

    /// Moves every span waiting in `telemetry`'s rings into this buffer.
    pub fn drain(&mut self, telemetry: &Telemetry) {
        let limit = self.max_spans_per_worker;
        let mut evicted = 0;
        telemetry.drain_spans(|worker, span| {
            let spans = match worker {
                Worker::Producer(i) => self.producers.get_mut(i),
                Worker::Drafter(i) => self.drafters.get_mut(i),
            };
            if let Some(spans) = spans {
                if spans.len() == limit {
                    spans.pop_front();
                    evicted += 1;
                }
                spans.push_back(span);
            }
        });
        self.evicted += evicted;
    }

    /// Spans held now over all workers.
    pub fn len(&self) -> usize {
        self.producers
            .iter()
            .chain(&self.drafters)
            .map(VecDeque::len)
            .sum()
    }

    /// Whether no span is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Spans evicted to respect the per-worker bound.
    pub fn evicted(&self) -> u64 {
        self.evicted
    }

    /// Writes the trace JSON to `path` (through the output rule's [`write_output`]: a new file or the
    /// regular file there replaced whole); `ring_dropped` (spans lost in full rings) goes into `otherData`.
    pub fn write(&self, path: &Path, ring_dropped: u64) -> Result<(), TelemetryError> {
        write_output(path, |out| self.write_to(out, ring_dropped))?;
        Ok(())
    }

    fn write_to(&self, out: &mut impl Write, ring_dropped: u64) -> std::io::Result<()> {
        out.write_all(b"{\"displayTimeUnit\":\"ms\",\"otherData\":")?;
        let other = OtherData {
            spans_evicted: self.evicted,
            spans_dropped_in_rings: ring_dropped,
        };
        serde_json::to_writer(&mut *out, &other)?;
        out.write_all(b",\"traceEvents\":[")?;
        let mut first = true;
        let mut event = |out: &mut dyn Write, value: &dyn ErasedEvent| -> std::io::Result<()> {
            if !first {
                out.write_all(b",\n")?;
            }
            first = false;
            value.write_json(out)
        };
        for (pid, name) in [(PRODUCER_PID, "producers"), (DRAFTER_PID, "drafters")] {
            let meta = Metadata {
                name: "process_name",
                ph: "M",
                pid,
                tid: 0,
                args: NameArg { name: name.into() },
            };
            event(out, &meta)?;
        }
        let tracks = self
            .producers
            .iter()
            .enumerate()
            .map(|(i, spans)| (PRODUCER_PID, i, format!("producer {i}"), spans))
            .chain(
                self.drafters
                    .iter()
                    .enumerate()
                    .map(|(i, spans)| (DRAFTER_PID, i, format!("drafter {i}"), spans)),
            );
        for (pid, tid, track, spans) in tracks {
            let meta = Metadata {
                name: "thread_name",
                ph: "M",
                pid,
                tid,
                args: NameArg { name: track },
            };
            event(out, &meta)?;
            for span in spans {
                let (name, cat) = if pid == PRODUCER_PID {
                    (
                        ProducerPhase::ALL
                            .get(usize::from(span.phase))
                            .map(|p| p.name()),
                        "producer",
                    )
                } else {
                    (
                        DrafterPhase::ALL
                            .get(usize::from(span.phase))
                            .map(|p| p.name()),
                        "drafter",
                    )
                };
                let complete = Complete {
                    name: name.unwrap_or("unknown"),
                    cat,
                    ph: "X",
                    pid,
                    tid,
                    ts: span.start_ns as f64 / 1e3,
                    dur: span.duration_ns as f64 / 1e3,
                };
                event(out, &complete)?;
            }
        }
        for status in &self.status {
            // No rate before the first step: the counter starts with it rather than at a false 0.
            if let (Some(real), Some(slots)) = (status.real_tokens_per_s, status.token_slots_per_s)
            {
                let rate = Counter {
                    name: "tokens/s".into(),
                    ph: "C",
                    pid: DRAFTER_PID,
                    ts: status.ts_us,
                    args: serde_json::json!({
                        "real tok/s": real,
                        "slots/s": slots,
                        "window_s": status.window_s,
                    }),
                };
                event(out, &rate)?;
            }
            if let Some((tau, teacher_forced)) = status.acceptance_tau {
                let mut args = serde_json::json!({ "real τ": tau });
                if let Some(teacher_forced) = teacher_forced {
                    args["teacher-forced τ"] = teacher_forced.into();
                }
                let accept = Counter {
                    name: "acceptance τ".into(),
                    ph: "C",
                    pid: DRAFTER_PID,
                    ts: status.ts_us,
                    args,
                };
                event(out, &accept)?;
            }
            for (i, drafter) in status.drafters.iter().enumerate() {
                let mut args = serde_json::json!({
                    "busy": drafter.busy_pct,
                    "wait": drafter.data_wait_pct,
                });
                if let Some(gpu) = drafter.gpu_pct {
                    args["gpu"] = gpu.into();
                }
                let shares = Counter {
                    name: format!("drafter {i} %"),
                    ph: "C",
                    pid: DRAFTER_PID,
                    ts: status.ts_us,
                    args,
                };
                event(out, &shares)?;
            }
        }
        out.write_all(b"]}\n")
    }
}

#[derive(Serialize)]
struct Counter {
    name: String,
    ph: &'static str,
    pid: u32,
    ts: f64,
    args: serde_json::Value,
}

trait ErasedEvent {
    fn write_json(&self, out: &mut dyn Write) -> std::io::Result<()>;
}

impl<T: Serialize> ErasedEvent for T {
    fn write_json(&self, out: &mut dyn Write) -> std::io::Result<()> {
        serde_json::to_writer(out, self).map_err(std::io::Error::from)
    }
}

#[derive(Serialize)]
struct OtherData {
    spans_evicted: u64,
    spans_dropped_in_rings: u64,
}

#[derive(Serialize)]
struct NameArg {
    name: String,
}

#[derive(Serialize)]
struct Metadata {
    name: &'static str,
    ph: &'static str,
    pid: u32,
    tid: usize,
    args: NameArg,
}

#[derive(Serialize)]
struct Complete {
    name: &'static str,
    cat: &'static str,
    ph: &'static str,
    pid: u32,
    tid: usize,
    ts: f64,
    dur: f64,
}
