//! Counters for `GET /metrics`, written in the Prometheus text exposition format by hand (a
//! handful of counters, gauges and two histograms do not need a client library).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// Upper bounds (seconds) of the request-latency histogram.
const LATENCY_BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];
/// Upper bounds of the batch-size histogram (instances in flight at a step).
const BATCH_BUCKETS: [f64; 10] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0];

struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    fn observe(&mut self, v: f64) {
        for (b, c) in self.bounds.iter().zip(&mut self.counts) {
            if v <= *b {
                *c += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }

    fn write(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}", self.sum);
        let _ = writeln!(out, "{name}_count {}", self.count);
    }
}

/// What the server has done so far. Counters only grow; gauges are set by the worker.
pub struct Metrics {
    /// Requests answered, by HTTP status.
    responses: Mutex<BTreeMap<u16, u64>>,
    latency: Mutex<Histogram>,
    batch: Mutex<Histogram>,
    pub(crate) instances_done: AtomicU64,
    pub(crate) instances_failed: AtomicU64,
    pub(crate) instances_cancelled: AtomicU64,
    /// Instances the batch threads took and have not admitted yet.
    pub(crate) waiting: AtomicU64,
    /// Instances of the requests the batch threads hold (taken, not answered); the server's
    /// other accepted instances are still in its channel.
    pub(crate) held: AtomicU64,
    pub(crate) in_flight: AtomicU64,
    pub(crate) steps: AtomicU64,
    pub(crate) launches: AtomicU64,
    pub(crate) restarts: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            responses: Mutex::new(BTreeMap::new()),
            latency: Mutex::new(Histogram::new(&LATENCY_BUCKETS)),
            batch: Mutex::new(Histogram::new(&BATCH_BUCKETS)),
            instances_done: AtomicU64::new(0),
            instances_failed: AtomicU64::new(0),
            instances_cancelled: AtomicU64::new(0),
            waiting: AtomicU64::new(0),
            held: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
            steps: AtomicU64::new(0),
            launches: AtomicU64::new(0),
            restarts: AtomicU64::new(0),
        }
    }
}

impl Metrics {
    /// A predict request answered with `status` after `seconds`.
    pub(crate) fn response(&self, status: u16, seconds: f64) {
        if let Ok(mut m) = self.responses.lock() {
            *m.entry(status).or_default() += 1;
        }
        if let Ok(mut h) = self.latency.lock() {
            h.observe(seconds);
        }
    }

    pub(crate) fn batch(&self, size: usize) {
        if let Ok(mut h) = self.batch.lock() {
            h.observe(size as f64);
        }
    }

    /// Predict requests answered with `status` so far.
    pub fn responses(&self, status: u16) -> u64 {
        self.responses
            .lock()
            .map(|m| m.get(&status).copied().unwrap_or(0))
            .unwrap_or(0)
    }

    /// Instances dropped because their request went away (disconnect, timeout).
    pub fn cancelled(&self) -> u64 {
        self.instances_cancelled.load(Ordering::Relaxed)
    }

    /// The exposition text of `GET /metrics`; `outstanding` is the server's count of instances
    /// accepted and not answered.
    pub fn render(&self, model: &str, outstanding: u64) -> String {
        let mut out = String::new();
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
            );
        };
        let gauge = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        let _ = writeln!(
            out,
            "# HELP tumble_model_info The model served.\n# TYPE tumble_model_info gauge\n\
             tumble_model_info{{model=\"{}\"}} 1",
            // The text format's label escapes: backslash, double quote, line feed.
            model
                .replace('\\', "\\\\")
                .replace('"', "\\\"")
                .replace('\n', "\\n")
        );
        let _ = writeln!(
            out,
            "# HELP tumble_requests_total Predict requests answered, by HTTP status.\n\
             # TYPE tumble_requests_total counter"
        );
        if let Ok(m) = self.responses.lock() {
            for (code, n) in m.iter() {
                let _ = writeln!(out, "tumble_requests_total{{code=\"{code}\"}} {n}");
            }
        }
        let errors: u64 = self
            .responses
            .lock()
            .map(|m| m.iter().filter(|(c, _)| **c >= 400).map(|(_, n)| n).sum())
            .unwrap_or(0);
        counter(
            &mut out,
            "tumble_request_errors_total",
            "Predict requests answered with an error status.",
            errors,
        );
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        counter(
            &mut out,
            "tumble_instances_total",
            "Instances computed.",
            load(&self.instances_done),
        );
        counter(
            &mut out,
            "tumble_instance_errors_total",
            "Instances that failed to decode or run.",
            load(&self.instances_failed),
        );
        counter(
            &mut out,
            "tumble_instances_cancelled_total",
            "Instances dropped because their request went away (disconnect, timeout).",
            load(&self.instances_cancelled),
        );
        counter(
            &mut out,
            "tumble_steps_total",
            "Batch steps (one flush each).",
            load(&self.steps),
        );
        counter(
            &mut out,
            "tumble_launches_total",
            "Batched kernel launches.",
            load(&self.launches),
        );
        counter(
            &mut out,
            "tumble_batch_restarts_total",
            "Failed flushes after which the other instances in flight were restarted.",
            load(&self.restarts),
        );
        gauge(
            &mut out,
            "tumble_queue_depth",
            "Instances waiting to join the batch.",
            load(&self.waiting) + outstanding.saturating_sub(load(&self.held)),
        );
        gauge(
            &mut out,
            "tumble_in_flight",
            "Instances in the running batch.",
            load(&self.in_flight),
        );
        if let Ok(h) = self.latency.lock() {
            h.write(
                &mut out,
                "tumble_request_duration_seconds",
                "Predict request latency, arrival to answer.",
            );
        }
        if let Ok(h) = self.batch.lock() {
            h.write(
                &mut out,
                "tumble_batch_size",
                "Instances in flight at each batch step.",
            );
        }
        out
    }
}
