//! The policy loss over a batch of K completions, from per-token log-prob tensors.
//!
//! Original (MAGRPO, arXiv 2508.04652): L = (1/K) Σ_k −A_k · Σ_t log π(y_t | prompt, y_<t), the
//! log-prob SUMMED over the completion's tokens, no ratio, no clipping, no KL.
//! Options beside it: token-mean normalisation; PPO ratio clipping (Schulman et al. 2017, arXiv
//! 1707.06347) with separate low/high bounds ("clip-higher", DAPO, arXiv 2503.14476); a KL penalty to a
//! frozen reference with the k1 or k3 estimator (Schulman, "Approximating KL Divergence", 2020).

use tch::{Kind, Tensor};

use crate::config::{KlEstimator, KlPlacement, LossNormalization, TrainerSection};

/// A padded batch of K completions. All tensors are (K, T) except `advantages` (K,).
#[derive(Debug)]
pub struct PolicyBatch<'a> {
    /// log π_θ of each completion token under the current policy (carries the gradient).
    pub logprobs: &'a Tensor,
    /// 1.0 on completion tokens, 0.0 on padding.
    pub mask: &'a Tensor,
    /// One advantage per completion.
    pub advantages: &'a Tensor,
    /// Behaviour-policy log-probs (from the rollout worker); required when clipping.
    pub old_logprobs: Option<&'a Tensor>,
    /// Decoupled PPO: the proximal policy's log-probs (the learner's own before this step's first
    /// update). The ratio is clipped against them and the truncated importance weight is
    /// min(π_prox/μ, cap); without them both use the behaviour log-probs.
    pub proximal_logprobs: Option<&'a Tensor>,
    /// Frozen reference log-probs; required when the KL penalty is on.
    pub ref_logprobs: Option<&'a Tensor>,
    /// Per-sample loss weights (K,) (multi-turn: the turn weight of each sample's node); all 1 when
    /// absent.
    pub weights: Option<&'a Tensor>,
}

/// How the loss is formed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossOptions {
    pub normalization: LossNormalization,
    /// (clip_low, clip_high): the ratio is clipped to [1 − clip_low, 1 + clip_high].
    pub clip: Option<(f64, f64)>,
    /// (coef, estimator) of the KL penalty.
    pub kl: Option<(f64, KlEstimator)>,
    /// Multiplies the final loss: turn weight × early-termination weight × 1/N for shared parameters.
    pub scale: f64,
    /// Truncated importance sampling against the behaviour policy (asynchronous rollouts): each
    /// token's policy term is weighted by w_t = min(π_θ(y_t)/μ(y_t), cap), computed without
    /// gradient from the behaviour log-probs μ (Ionides 2008; as in verl's TIS for off-policy
    /// rollouts). `None`: no correction (the original).
    pub truncated_is: Option<f64>,
    /// Hand the behaviour log-probs to the loss even without clipping or correction, so that
    /// `logprob_gap` is measured (rollouts in another precision than training).
    pub measure_gap: bool,
}

impl LossOptions {
    /// The original's loss: summed log-probs, no clipping, no KL, scale 1.
    pub fn original() -> Self {
        Self {
            normalization: LossNormalization::Sum,
            clip: None,
            kl: None,
            scale: 1.0,
            truncated_is: None,
            measure_gap: false,
        }
    }

    /// The options a trainer section asks for (scale 1; the trainer sets turn/shared scaling).
    pub fn from_section(s: &TrainerSection) -> Self {
        Self {
            normalization: s.loss_normalization,
            clip: s
                .ppo_clip
                .enabled
                .then_some((s.ppo_clip.clip_low, s.ppo_clip.clip_high)),
            // With `placement: returns` the KL shapes the returns instead (see `algo::reference_kl`).
            kl: (s.reference_kl.enabled && s.reference_kl.placement == KlPlacement::Loss)
                .then_some((s.reference_kl.coef, s.reference_kl.estimator)),
            scale: 1.0,
            truncated_is: None,
            measure_gap: false,
        }
    }
}

/// The loss and its parts (scalars for logging).
#[derive(Debug)]
pub struct LossTerms {
    /// Scalar tensor to call `backward` on: `scale · (policy_loss + kl_coef · kl_term)`, where the
    /// KL term is k3 itself or, for k1, its score-function form (see [`policy_loss`]).
    pub loss: Tensor,
    pub policy_loss: f64,
    /// Mean per-sample KL estimate (0 when off).
    pub kl: f64,
    /// Fraction of completion tokens whose ratio was clipped (0 when off).
    pub clip_fraction: f64,
    /// Number of completion tokens in the batch.
    pub tokens: f64,
    /// With behaviour log-probs: the mean |log π_θ − log μ| per token (how far the trained policy
    /// is from the one that sampled: staleness and rollout/training precision), else 0.
    pub logprob_gap: f64,
    /// With truncated importance sampling: the mean weight per token, and the fraction of tokens
    /// whose weight was cut to the cap (0 when off).
    pub is_weight_mean: f64,
    pub is_truncated_fraction: f64,
}

impl LossTerms {
    /// False for NaN or infinite losses, which must skip the update (the original replaced them with a
    /// constant, silently).
    pub fn is_finite(&self) -> bool {
        let v = self.loss.double_value(&[]);
        v.is_finite()
    }
}

/// Why a loss cannot be computed.
#[derive(Debug, thiserror::Error)]
pub enum LossError {
    /// Tensor shapes disagree.
    #[error("shape mismatch: {0}")]
    Shape(String),
    /// Clipping needs the behaviour log-probs.
    #[error("ratio clipping is on but the batch has no behaviour log-probs")]
    MissingOldLogprobs,
    /// The KL penalty needs reference log-probs.
    #[error("the reference kl penalty is on but the batch has no reference log-probs")]
    MissingRefLogprobs,
    /// A libtorch error.
    #[error(transparent)]
    Torch(#[from] tch::TchError),
}

/// Per-sample reduction over tokens: Σ_t x·mask, or that divided by the sample's token count.
fn reduce(x: &Tensor, mask: &Tensor, norm: LossNormalization) -> Result<Tensor, tch::TchError> {
    let summed = x
        .f_mul(mask)?
        .f_sum_dim_intlist([1i64].as_slice(), false, Kind::Double)?;
    match norm {
        LossNormalization::Sum => Ok(summed),
        LossNormalization::TokenMean => {
            let n = mask
                .f_sum_dim_intlist([1i64].as_slice(), false, Kind::Double)?
                .f_clamp_min(1.0)?;
            summed.f_div(&n)
        }
    }
}

/// The loss of one batch: L = scale · [(1/K) Σ_k w_k·ℓ_k + kl_coef · (1/K) Σ_k w_k·P_k] (w_k the
/// sample weights, 1 when absent), with
/// P_k = KL3_k (k3) or P_k = sg(KL1_k) · reduce_t(log π_k,t) (k1, whose gradient in expectation is
/// ∇KL(π_θ‖π_ref)).
/// Without clipping ℓ_k = −A_k · reduce_t(log π_t); with clipping the per-token term is
/// −min(A_k·ρ_t, A_k·clip(ρ_t, 1 − low, 1 + high)) with ρ_t = exp(log π_t − log π_old,t), reduced the
/// same way. At ρ = 1 the clipped loss has the same gradient as the unclipped one.
/// With truncated importance sampling each token's policy term is also multiplied by
/// w_t = min(π_t/μ_t, cap). Clipping and the correction together are decoupled PPO (Hilton et al.
/// 2021, arXiv 2110.00641): the ratio is taken against the proximal policy π_prox (the batch's
/// `proximal_logprobs`) and w_t = min(π_prox,t/μ_t, cap); taking both against μ would count the
/// ratio twice (≈ ρ²·A).
pub fn policy_loss(batch: &PolicyBatch<'_>, opts: &LossOptions) -> Result<LossTerms, LossError> {
    let lp = batch.logprobs;
    let dims = lp.size();
    if dims.len() != 2 {
        return Err(LossError::Shape(format!(
            "logprobs must be (K, T), got {dims:?}"
        )));
    }
    if batch.mask.size() != dims {
        return Err(LossError::Shape(format!(
            "mask {:?} vs logprobs {dims:?}",
            batch.mask.size()
        )));
    }
    if batch.advantages.size() != [dims[0]] {
        return Err(LossError::Shape(format!(
            "advantages {:?} vs K = {}",
            batch.advantages.size(),
            dims[0]
        )));
    }
    let k = dims[0].max(1) as f64;
    let weights = match batch.weights {
        Some(w) if w.size() != [dims[0]] => {
            return Err(LossError::Shape(format!(
                "weights {:?} vs K = {}",
                w.size(),
                dims[0]
            )));
        }
        Some(w) => w.f_to_kind(Kind::Double)?,
        None => Tensor::f_ones([dims[0]], (Kind::Double, lp.device()))?,
    };
    let mask = batch.mask.f_to_kind(lp.kind())?;
    let adv = batch.advantages.f_to_kind(Kind::Double)?;
    let tokens = mask.f_sum(Kind::Double)?.double_value(&[]);
    let mean_over_tokens = |x: &Tensor| -> Result<f64, tch::TchError> {
        Ok(if tokens > 0.0 {
            x.f_to_kind(Kind::Double)?
                .f_mul(&mask.f_to_kind(Kind::Double)?)?
                .f_sum(Kind::Double)?
                .double_value(&[])
                / tokens
        } else {
            0.0
        })
    };
    let old = match batch.old_logprobs {
        Some(old) if old.size() != dims => {
            return Err(LossError::Shape(format!(
                "old_logprobs {:?} vs logprobs {dims:?}",
                old.size()
            )));
        }
        Some(old) => Some(old.detach()),
        None => None,
    };
    let logprob_gap = match &old {
        Some(old) => mean_over_tokens(&lp.detach().f_sub(old)?.f_abs()?)?,
        None => 0.0,
    };
    let proximal = match batch.proximal_logprobs {
        Some(p) if p.size() != dims => {
            return Err(LossError::Shape(format!(
                "proximal_logprobs {:?} vs logprobs {dims:?}",
                p.size()
            )));
        }
        Some(p) => Some(p.detach()),
        None => None,
    };
    // Truncated importance weights (no gradient), 1 without correction: min(π/μ, cap), with π the
    // proximal policy when there is one (decoupled PPO), else the current one.
    let (is_weights, is_weight_mean, is_truncated_fraction) = match opts.truncated_is {
        None => (None, 0.0, 0.0),
        Some(cap) => {
            let old = old.as_ref().ok_or(LossError::MissingOldLogprobs)?;
            let raw = proximal
                .as_ref()
                .unwrap_or(&lp.detach())
                .f_sub(old)?
                .f_exp()?;
            let cut = raw.f_gt(cap)?.f_to_kind(lp.kind())?;
            let w = raw.f_clamp_max(cap)?;
            let (mean, frac) = (mean_over_tokens(&w)?, mean_over_tokens(&cut)?);
            (Some(w), mean, frac)
        }
    };
    let weighted = |x: Tensor| -> Result<Tensor, tch::TchError> {
        match &is_weights {
            Some(w) => x.f_mul(w),
            None => Ok(x),
        }
    };

    let (per_sample, clip_fraction) = match opts.clip {
        None => {
            let s = reduce(&weighted(lp.shallow_clone())?, &mask, opts.normalization)?;
            (adv.f_neg()?.f_mul(&s)?, 0.0)
        }
        Some((low, high)) => {
            // The ratio's anchor: the proximal policy (decoupled PPO), else the behaviour policy.
            let anchor = proximal
                .as_ref()
                .or(old.as_ref())
                .ok_or(LossError::MissingOldLogprobs)?;
            let ratio = lp.f_sub(anchor)?.f_exp()?;
            let a = adv.f_unsqueeze(1)?.f_to_kind(lp.kind())?;
            let unclipped = ratio.f_mul(&a)?;
            let clipped = ratio.f_clamp(1.0 - low, 1.0 + high)?.f_mul(&a)?;
            let per_token = weighted(unclipped.f_minimum(&clipped)?.f_neg()?)?;
            let was_clipped = unclipped
                .f_gt_tensor(&clipped)?
                .f_to_kind(Kind::Double)?
                .f_mul(&mask.f_to_kind(Kind::Double)?)?;
            let frac = if tokens > 0.0 {
                was_clipped.f_sum(Kind::Double)?.double_value(&[]) / tokens
            } else {
                0.0
            };
            (reduce(&per_token, &mask, opts.normalization)?, frac)
        }
    };
    let policy = per_sample
        .f_mul(&weights)?
        .f_sum(Kind::Double)?
        .f_div_scalar(k)?;
    let policy_value = policy.double_value(&[]);

    let (total, kl_value) = match opts.kl {
        None => (policy, 0.0),
        Some((coef, estimator)) => {
            let lr = batch.ref_logprobs.ok_or(LossError::MissingRefLogprobs)?;
            if lr.size() != dims {
                return Err(LossError::Shape(format!(
                    "ref_logprobs {:?} vs logprobs {dims:?}",
                    lr.size()
                )));
            }
            // Per token, d = log π_ref − log π_θ.
            let d = lr.detach().f_sub(lp)?;
            let (kl, penalty) = match estimator {
                // k1 = log π_θ − log π_ref. Its own gradient is ∇log π, whose expectation under π is
                // zero, so adding k1 to the loss would regularise nothing. The gradient of
                // KL(π_θ‖π_ref) is E_π[(Σ_t k1_t) · ∇Σ_t log π_t] (score function), so the
                // penalty term is kl_coef · (1/K) Σ_k sg(KL1_k) · reduce_t(log π_k,t): exactly the
                // original REINFORCE loss with the reward shaped as r − kl_coef·KL1 (as later CoMLRL
                // releases shape it, without the group baseline on the KL part).
                KlEstimator::K1 => {
                    let kl_k = reduce(&d.f_neg()?, &mask, opts.normalization)?.detach();
                    let pen = kl_k
                        .f_mul(&reduce(lp, &mask, opts.normalization)?)?
                        .f_mul(&weights)?
                        .f_sum(Kind::Double)?
                        .f_div_scalar(k)?;
                    (kl_k.f_sum(Kind::Double)?.f_div_scalar(k)?, pen)
                }
                // k3 = exp(d) − d − 1 (unbiased, always ≥ 0, low variance): differentiated directly,
                // its expected gradient is that of KL(π_ref‖π_θ), as in GRPO (Shao et al. 2024,
                // arXiv 2402.03300).
                KlEstimator::K3 => {
                    let per_token = d.f_exp()?.f_sub(&d)?.f_sub_scalar(1.0)?;
                    let per_sample_kl = reduce(&per_token, &mask, opts.normalization)?;
                    let kl = per_sample_kl.f_sum(Kind::Double)?.f_div_scalar(k)?;
                    let pen = per_sample_kl
                        .f_mul(&weights)?
                        .f_sum(Kind::Double)?
                        .f_div_scalar(k)?;
                    (kl, pen)
                }
            };
            let kl_value = kl.double_value(&[]);
            let loss = policy + penalty * coef;
            (loss, kl_value)
        }
    };
    let loss = total.f_mul_scalar(opts.scale)?;
    Ok(LossTerms {
        loss,
        policy_loss: policy_value,
        kl: kl_value,
        clip_fraction,
        tokens,
        logprob_gap,
        is_weight_mean,
        is_truncated_fraction,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t2(rows: &[&[f64]]) -> Tensor {
        let k = rows.len() as i64;
        let t = rows[0].len() as i64;
        let flat: Vec<f64> = rows.iter().flat_map(|r| r.iter().cloned()).collect();
        Tensor::from_slice(&flat).reshape([k, t])
    }

    #[test]
    fn original_loss_sums_token_logprobs_and_averages_over_samples() {
        // Sample 0: log-probs −1, −2 (sum −3); sample 1: −0.5, then padding (sum −0.5).
        // A = [1, −2]: L = (1/2)·(−1·(−3) + 2·(−0.5)) = (3 − 1)/2 = 1.
        let lp = t2(&[&[-1.0, -2.0], &[-0.5, -9.0]]);
        let mask = t2(&[&[1.0, 1.0], &[1.0, 0.0]]);
        let adv = Tensor::from_slice(&[1.0, -2.0]);
        let b = PolicyBatch {
            logprobs: &lp,
            mask: &mask,
            advantages: &adv,
            old_logprobs: None,
            proximal_logprobs: None,
            ref_logprobs: None,
            weights: None,
        };
        let out = policy_loss(&b, &LossOptions::original()).unwrap();
        assert!((out.loss.double_value(&[]) - 1.0).abs() < 1e-12);
        assert_eq!(out.tokens, 3.0);
        // token-mean: sample 0 −3/2 = −1.5, sample 1 −0.5: L = (1.5 − 1)/2 = 0.25
        let tm = LossOptions {
            normalization: LossNormalization::TokenMean,
            ..LossOptions::original()
        };
        assert!((policy_loss(&b, &tm).unwrap().loss.double_value(&[]) - 0.25).abs() < 1e-12);
        // Weights 1.2 and 0.8 (turn weights): L = (1/2)·(1.2·3 + 0.8·(−1)) = 1.4.
        let w = Tensor::from_slice(&[1.2, 0.8]);
        let wb = PolicyBatch {
            weights: Some(&w),
            ..b
        };
        assert!(
            (policy_loss(&wb, &LossOptions::original())
                .unwrap()
                .loss
                .double_value(&[])
                - 1.4)
                .abs()
                < 1e-12
        );
    }

    #[test]
    fn truncated_importance_weights_scale_each_token_up_to_the_cap() {
        // Sample 0: log π = −1, −2 against behaviour −1.5, −1 → ratios e^0.5 = 1.6487, e^−1 = 0.3679;
        // sample 1: −0.5 against −2.5 → e^2 = 7.389, cut to the cap 2; its second token is padding.
        let lp = t2(&[&[-1.0, -2.0], &[-0.5, -9.0]]);
        let old = t2(&[&[-1.5, -1.0], &[-2.5, 0.0]]);
        let mask = t2(&[&[1.0, 1.0], &[1.0, 0.0]]);
        let adv = Tensor::from_slice(&[1.0, -2.0]);
        let b = PolicyBatch {
            logprobs: &lp,
            mask: &mask,
            advantages: &adv,
            old_logprobs: Some(&old),
            proximal_logprobs: None,
            ref_logprobs: None,
            weights: None,
        };
        let opts = LossOptions {
            truncated_is: Some(2.0),
            ..LossOptions::original()
        };
        let out = policy_loss(&b, &opts).unwrap();
        let (w0, w1) = (0.5f64.exp(), (-1.0f64).exp());
        // L = (1/2)·(−1·(w0·(−1) + w1·(−2)) + 2·(2·(−0.5))) = (w0 + 2·w1 − 2)/2.
        let want = (w0 + 2.0 * w1 - 2.0) / 2.0;
        assert!(
            (out.loss.double_value(&[]) - want).abs() < 1e-12,
            "{} vs {want}",
            out.loss.double_value(&[])
        );
        assert!((out.is_weight_mean - (w0 + w1 + 2.0) / 3.0).abs() < 1e-12);
        assert!((out.is_truncated_fraction - 1.0 / 3.0).abs() < 1e-12);
        assert!((out.logprob_gap - (0.5 + 1.0 + 2.0) / 3.0).abs() < 1e-12);
        // The weights carry no gradient: d L / d log π_t = −A·w_t.
        let lpg = lp.detach().set_requires_grad(true);
        let b = PolicyBatch {
            logprobs: &lpg,
            ..b
        };
        policy_loss(&b, &opts).unwrap().loss.backward();
        let g = lpg.grad();
        assert!((g.double_value(&[0, 0]) - (-w0 / 2.0)).abs() < 1e-12);
        assert!((g.double_value(&[1, 0]) - (2.0 * 2.0 / 2.0)).abs() < 1e-12);
        // Without behaviour log-probs there is nothing to correct against.
        let nb = PolicyBatch {
            old_logprobs: None,
            ..b
        };
        assert!(matches!(
            policy_loss(&nb, &opts),
            Err(LossError::MissingOldLogprobs)
        ));
    }
}
