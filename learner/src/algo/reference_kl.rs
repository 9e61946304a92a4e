//! The reference KL as return shaping (CoMLRL 2026, `reference_kl.placement: returns`): one KL
//! estimate per sampled completion, measured without gradient, subtracted from the completion's
//! return before the group baseline (upstream `comlrl/utils/reference_kl.py` and MAGRPO's
//! `_apply_reference_kl_to_returns`, OpenMLRL/CoMLRL 86d1bb9).

use crate::config::KlEstimator;

/// KL_j = Σ_t k_t over a completion's tokens, with d_t = lr_t − lp_t (lp: the log-prob of the
/// sampled token under the policy that sampled it, lr: under the frozen reference) and
/// k3_t = exp(d_t) − d_t − 1 or k1_t = −d_t = lp_t − lr_t (Schulman, "Approximating KL divergence",
/// 2020). Both slices hold the tokens to count, one value each (the caller leaves the EOS out).
pub fn sequence_kl(policy: &[f32], reference: &[f32], estimator: KlEstimator) -> f64 {
    assert_eq!(
        policy.len(),
        reference.len(),
        "one reference log-prob per policy log-prob"
    );
    policy
        .iter()
        .zip(reference)
        .map(|(&lp, &lr)| {
            let d = lr as f64 - lp as f64;
            match estimator {
                KlEstimator::K3 => d.exp() - d - 1.0,
                KlEstimator::K1 => -d,
            }
        })
        .sum()
}

/// R'_j = R_j − coef·KL_j for each of a node's completions: the returns the group baseline and
/// the advantage normalisation then see (the shaping is a constant: it carries no gradient).
pub fn kl_shaped_returns(returns: &[f64], kls: &[f64], coef: f64) -> Vec<f64> {
    assert_eq!(returns.len(), kls.len(), "one KL per return");
    returns
        .iter()
        .zip(kls)
        .map(|(r, kl)| r - coef * kl)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: &[f64], b: &[f64]) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() < 1e-12, "{a:?} vs {b:?}");
        }
    }

    #[test]
    fn returns_are_shaped_as_upstreams_unit_test() {
        // Upstream's test_magrpo_applies_reference_kl_to_returns: R = [1, 2], KL = [0.2, 0.4],
        // coef 0.5 → [1 − 0.1, 2 − 0.2] = [0.9, 1.8].
        close(
            &kl_shaped_returns(&[1.0, 2.0], &[0.2, 0.4], 0.5),
            &[0.9, 1.8],
        );
        // coef 0 leaves the returns.
        close(
            &kl_shaped_returns(&[1.0, -2.0], &[3.0, 4.0], 0.0),
            &[1.0, -2.0],
        );
    }

    #[test]
    fn k3_sums_over_the_completion_tokens() {
        // Token 1: lp = −1, lr = −1 → d = 0, k3 = e^0 − 0 − 1 = 0.
        // Token 2: lp = −2, lr = −1.5 → d = 0.5, k3 = e^0.5 − 0.5 − 1 = 1.6487212707 − 1.5 = 0.1487212707.
        // Token 3: lp = −0.5, lr = −1.5 → d = −1, k3 = e^−1 + 1 − 1 = 0.3678794412.
        // KL = 0.5166007119.
        let lp = [-1.0f32, -2.0, -0.5];
        let lr = [-1.0f32, -1.5, -1.5];
        let kl = sequence_kl(&lp, &lr, KlEstimator::K3);
        assert!((kl - 0.516_600_711_9).abs() < 1e-9, "{kl}");
        // k1 = Σ(lp − lr) = 0 − 0.5 + 1 = 0.5.
        assert!((sequence_kl(&lp, &lr, KlEstimator::K1) - 0.5).abs() < 1e-12);
        // The policy against itself: 0; no tokens: 0.
        assert_eq!(sequence_kl(&lp, &lp, KlEstimator::K3), 0.0);
        assert_eq!(sequence_kl(&[], &[], KlEstimator::K3), 0.0);
    }
}
