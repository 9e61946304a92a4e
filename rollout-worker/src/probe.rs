//! The check after every weight update: the engine scores a fixed probe sequence and its
//! log-probs must match the ones the learner computed on the weights it pushed.
//!
//! Garbage output after a weight sync is the failure users of RL trainers report most: a tensor
//! loaded under the wrong name, a dtype cast gone wrong, a shard that never arrived. Each of them
//! shows in the log-probs of any ordinary sequence, so one short forward catches them before a
//! single sample is drawn from the broken weights.

/// A probe sequence and the learner's log-probs of it: `logprobs[i]` is
/// `log p(token_ids[i + 1] | token_ids[..=i])` under the pushed weights.
#[derive(Clone, Debug, PartialEq)]
pub struct Probe {
    /// The sequence.
    pub token_ids: Vec<u32>,
    /// One per token after the first.
    pub logprobs: Vec<f32>,
    /// Largest difference allowed; 0: the worker's default for its dtype.
    pub tolerance: f32,
}

/// What a probe check found.
#[derive(Clone, Debug, PartialEq)]
pub struct ProbeCheck {
    /// The largest difference between the engine's log-prob and the learner's.
    pub max_abs_diff: f32,
    /// At which position of the sequence (the predicted token's index).
    pub position: usize,
    /// The tolerance it was held to.
    pub tolerance: f32,
}

impl ProbeCheck {
    /// Whether the engine's weights agree with the learner's.
    pub fn passed(&self) -> bool {
        self.max_abs_diff <= self.tolerance
    }
}

/// The default tolerance for an engine computing in `dtype` (vLLM's name): the spread of an f32
/// forward computed by two different libraries is ~1e-5 and a half-precision one's ~1e-2 on short
/// sequences, while a wrong tensor moves the log-probs by whole nats.
pub fn default_tolerance(dtype: &str) -> f32 {
    match dtype {
        "float32" => 1e-2,
        _ => 0.25,
    }
}

impl Probe {
    /// Compares the engine's log-probs of the sequence (same layout as [`Probe::logprobs`]) with
    /// the learner's. A length mismatch or a non-finite value is a failure at that position.
    pub fn check(&self, engine: &[f32], default_tolerance: f32) -> ProbeCheck {
        let tolerance = if self.tolerance > 0.0 {
            self.tolerance
        } else {
            default_tolerance
        };
        let mut worst = ProbeCheck {
            max_abs_diff: 0.0,
            position: 0,
            tolerance,
        };
        if engine.len() != self.logprobs.len() {
            return ProbeCheck {
                max_abs_diff: f32::INFINITY,
                position: engine.len().min(self.logprobs.len()) + 1,
                tolerance,
            };
        }
        for (i, (e, l)) in engine.iter().zip(&self.logprobs).enumerate() {
            let d = (e - l).abs();
            let d = if d.is_finite() { d } else { f32::INFINITY };
            if d > worst.max_abs_diff || (d.is_infinite() && worst.max_abs_diff.is_finite()) {
                worst.max_abs_diff = d;
                worst.position = i + 1;
            }
        }
        worst
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe(logprobs: Vec<f32>) -> Probe {
        Probe {
            token_ids: (0..=logprobs.len() as u32).collect(),
            logprobs,
            tolerance: 0.0,
        }
    }

    /// Float noise passes; one position off by a tenth of a nat fails and is named.
    #[test]
    fn the_largest_difference_decides_and_is_located() {
        let p = probe(vec![-1.0, -2.0, -3.0]);
        let ok = p.check(&[-1.00001, -2.0, -2.99999], 1e-2);
        assert!(ok.passed(), "{ok:?}");
        let bad = p.check(&[-1.0, -2.1, -3.0], 1e-2);
        assert!(!bad.passed());
        assert_eq!(bad.position, 2);
        assert!((bad.max_abs_diff - 0.1).abs() < 1e-5, "{bad:?}");
    }

    /// NaN from a corrupted engine and a short answer both fail.
    #[test]
    fn nan_and_missing_positions_fail() {
        let p = probe(vec![-1.0, -2.0]);
        assert!(!p.check(&[f32::NAN, -2.0], 1.0).passed());
        assert!(!p.check(&[-1.0], 1.0).passed());
    }

    /// A tolerance sent with the push overrides the worker's default.
    #[test]
    fn the_push_may_set_the_tolerance() {
        let mut p = probe(vec![-1.0]);
        p.tolerance = 0.5;
        assert!(p.check(&[-1.3], 1e-2).passed());
    }
}
