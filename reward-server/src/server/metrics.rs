//! Prometheus metrics: requests by API and outcome, latency histograms, sandbox outcomes, and
//! the sandbox's queue depth and in-flight runs (read at scrape time).

use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, Opts, Registry, TextEncoder,
};

use crate::sandbox::BwrapSandbox;

pub struct Metrics {
    registry: Registry,
    requests: IntCounterVec,
    latency: HistogramVec,
    sandbox_runs: IntCounterVec,
    queue_depth: IntGauge,
    in_flight: IntGauge,
}

impl Metrics {
    pub fn new() -> Self {
        let registry =
            Registry::new_custom(Some("cotrain_reward".into()), None).expect("valid prefix");
        let requests = IntCounterVec::new(
            Opts::new("requests_total", "Requests by endpoint and outcome"),
            &["endpoint", "outcome"],
        )
        .expect("valid metric");
        let latency = HistogramVec::new(
            HistogramOpts::new("request_duration_seconds", "Request latency by endpoint").buckets(
                vec![
                    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                ],
            ),
            &["endpoint"],
        )
        .expect("valid metric");
        let sandbox_runs = IntCounterVec::new(
            Opts::new(
                "sandbox_runs_total",
                "Sandboxed runs by kind (exec, tests) and outcome",
            ),
            &["kind", "outcome"],
        )
        .expect("valid metric");
        let queue_depth = IntGauge::new("sandbox_queue_depth", "Runs waiting for a sandbox slot")
            .expect("valid metric");
        let in_flight = IntGauge::new("sandbox_in_flight", "Sandboxed runs executing now")
            .expect("valid metric");
        for c in [
            Box::new(requests.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(latency.clone()),
            Box::new(sandbox_runs.clone()),
            Box::new(queue_depth.clone()),
            Box::new(in_flight.clone()),
        ] {
            registry.register(c).expect("metric registered once");
        }
        Self {
            registry,
            requests,
            latency,
            sandbox_runs,
            queue_depth,
            in_flight,
        }
    }

    pub fn observe_request(&self, endpoint: &str, outcome: &str, secs: f64) {
        self.requests.with_label_values(&[endpoint, outcome]).inc();
        self.latency.with_label_values(&[endpoint]).observe(secs);
    }

    pub fn observe_sandbox(&self, kind: &str, outcome: &str) {
        self.sandbox_runs.with_label_values(&[kind, outcome]).inc();
    }

    /// The text exposition format, with the sandbox gauges refreshed.
    pub fn render(&self, sandbox: &BwrapSandbox) -> String {
        self.queue_depth.set(sandbox.queue_depth() as i64);
        self.in_flight.set(sandbox.in_flight() as i64);
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .expect("text encoding cannot fail");
        String::from_utf8(buf).unwrap_or_default()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
