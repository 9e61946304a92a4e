//! Prometheus metrics of one worker, served as text on the HTTP port's `/metrics`.

use prometheus::{
    Encoder, GaugeVec, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Every metric the worker exports; cheap to clone (the vectors are shared handles).
#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    /// Completion tokens sampled, per model.
    pub generated_tokens: IntCounterVec,
    /// Prompt tokens prefilled, per model.
    pub prompt_tokens: IntCounterVec,
    /// Decode steps run, per model.
    pub decode_steps: IntCounterVec,
    /// Generate requests answered, per agent and outcome (`ok`, `invalid`, `overloaded`, `cancelled`, `error`).
    pub requests: IntCounterVec,
    /// Sequences decoding now, per model.
    pub running_sequences: IntGaugeVec,
    /// Running sequences over the batch capacity, per model.
    pub batch_occupancy: GaugeVec,
    /// Sequences admitted and waiting to join the batch, per model.
    pub queue_depth: IntGaugeVec,
    /// Generate requests admitted and not answered, all models.
    pub in_flight_requests: IntGauge,
    /// Completion tokens per second over the last second of decoding, per model.
    pub tokens_per_second: GaugeVec,
    /// Current policy version, per agent.
    pub policy_version: IntGaugeVec,
    /// Weight updates received, per model and outcome (`applied`, `rejected`).
    pub weight_updates: IntCounterVec,
    /// Conversations a learned verifier scored, per verifier.
    pub verifier_conversations: IntCounterVec,
    /// Weight-update payload bytes accepted into assemblies.
    pub weight_update_bytes: prometheus::IntCounter,
}

impl Metrics {
    /// Registers every metric in a fresh registry.
    pub fn new() -> Self {
        let registry = Registry::new_custom(Some("cotrain_rollout".into()), None)
            .expect("static prefix is valid");
        fn reg<C: prometheus::core::Collector + Clone + 'static>(r: &Registry, c: C) -> C {
            r.register(Box::new(c.clone()))
                .expect("metric names are unique");
            c
        }
        let counter = |name: &str, help: &str, labels: &[&str]| {
            reg(
                &registry,
                IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric"),
            )
        };
        let gauge = |name: &str, help: &str, labels: &[&str]| {
            reg(
                &registry,
                IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric"),
            )
        };
        let fgauge = |name: &str, help: &str, labels: &[&str]| {
            reg(
                &registry,
                GaugeVec::new(Opts::new(name, help), labels).expect("valid metric"),
            )
        };
        Self {
            generated_tokens: counter(
                "generated_tokens_total",
                "completion tokens sampled",
                &["model"],
            ),
            prompt_tokens: counter("prompt_tokens_total", "prompt tokens prefilled", &["model"]),
            decode_steps: counter("decode_steps_total", "decode steps run", &["model"]),
            requests: counter(
                "requests_total",
                "generate requests answered",
                &["agent", "outcome"],
            ),
            running_sequences: gauge("running_sequences", "sequences decoding now", &["model"]),
            batch_occupancy: fgauge(
                "batch_occupancy",
                "running sequences over batch capacity",
                &["model"],
            ),
            queue_depth: gauge(
                "queue_depth",
                "sequences waiting to join the batch",
                &["model"],
            ),
            in_flight_requests: reg(
                &registry,
                IntGauge::new(
                    "in_flight_requests",
                    "generate requests admitted and not answered",
                )
                .expect("valid metric"),
            ),
            tokens_per_second: fgauge(
                "tokens_per_second",
                "completion tokens per second, last second",
                &["model"],
            ),
            policy_version: gauge("policy_version", "current policy version", &["agent"]),
            weight_updates: counter(
                "weight_updates_total",
                "weight updates received",
                &["model", "outcome"],
            ),
            verifier_conversations: counter(
                "verifier_conversations_total",
                "conversations scored by a learned verifier",
                &["verifier"],
            ),
            weight_update_bytes: reg(
                &registry,
                prometheus::IntCounter::new(
                    "weight_update_bytes_total",
                    "weight-update payload bytes received",
                )
                .expect("valid metric"),
            ),
            registry,
        }
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .expect("encoding to a Vec cannot fail");
        String::from_utf8(buf).expect("prometheus text is utf-8")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_labelled_metrics() {
        let m = Metrics::new();
        m.generated_tokens.with_label_values(&["m"]).inc_by(7);
        m.policy_version.with_label_values(&["alice"]).set(3);
        let text = m.render();
        assert!(
            text.contains("cotrain_rollout_generated_tokens_total{model=\"m\"} 7"),
            "{text}"
        );
        assert!(
            text.contains("cotrain_rollout_policy_version{agent=\"alice\"} 3"),
            "{text}"
        );
    }
}
