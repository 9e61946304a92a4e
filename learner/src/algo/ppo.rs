//! The PPO update math of MaPoRL (Park et al., arXiv 2502.18439), whose trainer is TRL's classic
//! `PPOTrainer` (trl 0.7: `compute_rewards`, `compute_advantages`, `loss`, `masked_whiten`), as pure
//! functions: per-token rewards with the KL penalty ([`token_rewards`]), GAE ([`gae`]), whitening
//! ([`whiten`]), the clipped policy and value losses ([`clipped_policy_loss`],
//! [`clipped_value_loss`]) and the value head's diagnostic ([`explained_variance`]).
//!
//! The trainer composes them as TRL's `step` does (MaPoRL's settings in the comments):
//!
//! ```text
//! // Once per batch, from the rollout: behaviour log-probs lp_old, reference log-probs lp_ref and
//! // value estimates v_old of each response token, and one score per response.
//! for each response i:
//!     r_i          = token_rewards(&lp_old_i, &lp_ref_i, score_i, kl_coef)    // kl_coef 0.002
//!     (a_i, ret_i) = gae(&r_i, &v_old_i, gamma, lambda)                         // γ 1, λ 0.95
//! a = whiten(&concat(a_1, …, a_K), true)   // over every response token of the batch, AFTER the
//!                                          // returns were formed from the raw advantages
//! // Then, per PPO epoch and mini-batch, padded to (K, T) with a 1/0 mask:
//! let pg = clipped_policy_loss(&lp, &lp_old, &a, &mask, clip)?;                  // clip 0.2
//! let vf = clipped_value_loss(&v, &v_old, &ret, &mask, clip_value)?;            // clip_value 0.2
//! let loss = pg.loss + vf.loss * vf_coef;                                       // vf_coef 0.1
//! ```
//!
//! TRL can also whiten the rewards before GAE (`whiten_rewards`, off by default):
//! `whiten(&rewards, false)`.

use tch::{Kind, Tensor};

use super::loss::LossError;

/// Per-token KL estimate of the behaviour policy from the reference: kl_t = log π(y_t) − log π_ref(y_t)
/// (TRL `_kl_penalty`, `kl_penalty="kl"`).
///
/// # Panics
/// If the two slices differ in length.
pub fn kl_per_token(logprobs: &[f32], ref_logprobs: &[f32]) -> Vec<f64> {
    assert_eq!(
        logprobs.len(),
        ref_logprobs.len(),
        "logprobs and ref_logprobs must have one entry per token"
    );
    logprobs
        .iter()
        .zip(ref_logprobs)
        .map(|(lp, lr)| f64::from(*lp) - f64::from(*lr))
        .collect()
}

/// Rewards of one response's tokens: r_t = −kl_coef·(log π(y_t) − log π_ref(y_t)), plus the sequence
/// score on the last token (TRL `compute_rewards`).
///
/// An empty response has no token to carry the score and gets an empty `Vec`: the caller must keep at
/// least one token (the EOS) of every scored response.
///
/// # Panics
/// If the two slices differ in length.
pub fn token_rewards(logprobs: &[f32], ref_logprobs: &[f32], score: f64, kl_coef: f64) -> Vec<f64> {
    let mut rewards: Vec<f64> = kl_per_token(logprobs, ref_logprobs)
        .into_iter()
        .map(|kl| -kl_coef * kl)
        .collect();
    if let Some(last) = rewards.last_mut() {
        *last += score;
    }
    rewards
}

/// Generalised advantage estimation over one response (Schulman et al. 2016, arXiv 1506.02438; TRL
/// `compute_advantages`): δ_t = r_t + γ·V_{t+1} − V_t with V_T = 0, A_t = δ_t + γλ·A_{t+1}, and the
/// value targets R_t = A_t + V_t. Returns `(advantages, returns)`.
///
/// The bootstrap after the last token is 0 because the response ends the episode (EOS or truncation
/// alike, as in TRL, where the masked padding after it holds V = 0).
///
/// # Panics
/// If `rewards` and `values` differ in length.
pub fn gae(rewards: &[f64], values: &[f64], gamma: f64, lambda: f64) -> (Vec<f64>, Vec<f64>) {
    assert_eq!(
        rewards.len(),
        values.len(),
        "rewards and values must have one entry per token"
    );
    let n = rewards.len();
    let mut advantages = vec![0.0; n];
    let mut last_gae_lam = 0.0;
    for t in (0..n).rev() {
        let next_value = if t + 1 < n { values[t + 1] } else { 0.0 };
        let delta = rewards[t] + gamma * next_value - values[t];
        last_gae_lam = delta + gamma * lambda * last_gae_lam;
        advantages[t] = last_gae_lam;
    }
    let returns = advantages.iter().zip(values).map(|(a, v)| a + v).collect();
    (advantages, returns)
}

/// Whitening over every value given (TRL `masked_whiten`): (x − mean) / sqrt(var + 1e-8) with the
/// UNBIASED variance Σ(x − mean)²/(n − 1) (TRL `masked_var(unbiased=True)`); with `shift_mean` false
/// the mean is added back, so only the scale changes.
///
/// Empty input gives an empty `Vec`. A single value has no spread: its variance is taken as 0 (TRL's
/// Bessel factor n/(n − 1) would be infinite and the result NaN), so it whitens to 0, or to itself
/// when `shift_mean` is false.
pub fn whiten(values: &[f64], shift_mean: bool) -> Vec<f64> {
    let n = values.len();
    if n == 0 {
        return Vec::new();
    }
    let mean = values.iter().sum::<f64>() / n as f64;
    let var = if n > 1 {
        values.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64
    } else {
        0.0
    };
    let inv_std = 1.0 / (var + 1e-8).sqrt();
    let shift = if shift_mean { 0.0 } else { mean };
    values
        .iter()
        .map(|x| (x - mean) * inv_std + shift)
        .collect()
}

/// The clipped policy loss of a batch and its diagnostics.
#[derive(Debug)]
pub struct PolicyLossTerms {
    /// Scalar (f64) tensor to call `backward` on: masked_mean(max(−A·ρ, −A·clip(ρ, 1 − ε, 1 + ε))).
    pub loss: Tensor,
    /// Fraction of tokens where the clipped term is the larger one (TRL `policy/clipfrac`).
    pub clip_fraction: f64,
    /// 0.5·masked_mean((log π − log π_old)²) (TRL `policy/approxkl`).
    pub approx_kl: f64,
    /// masked_mean(log π_old − log π) (TRL `policy/policykl`).
    pub policy_kl: f64,
    /// masked_mean(ρ); TRL skips a mini-batch whose mean ratio exceeds `ratio_threshold` (10).
    pub ratio_mean: f64,
}

/// The clipped value loss of a batch and its diagnostic.
#[derive(Debug)]
pub struct ValueLossTerms {
    /// Scalar (f64) tensor to call `backward` on: 0.5·masked_mean(max((V − R)², (V_clip − R)²)).
    pub loss: Tensor,
    /// Fraction of tokens where the clipped term is the larger one (TRL `val/clipfrac`).
    pub clip_fraction: f64,
}

/// Σ(x·mask)/Σmask over the whole batch (TRL `masked_mean`), in f64. An all-padding batch gives 0
/// instead of TRL's NaN. Masked entries must be finite: 0·inf is NaN.
fn masked_mean(x: &Tensor, mask: &Tensor) -> Result<Tensor, tch::TchError> {
    let tokens = mask.f_sum(Kind::Double)?.f_clamp_min(1.0)?;
    x.f_mul(mask)?.f_sum(Kind::Double)?.f_div(&tokens)
}

fn check_shape(name: &str, t: &Tensor, dims: &[i64]) -> Result<(), LossError> {
    if t.size() != dims {
        return Err(LossError::Shape(format!(
            "{name} {:?} vs logprobs {dims:?}",
            t.size()
        )));
    }
    Ok(())
}

/// PPO's clipped surrogate (Schulman et al. 2017, arXiv 1707.06347; TRL `PPOTrainer.loss`), all tensors
/// (K, T) with a 1.0/0.0 `mask`, per-token advantages:
/// ρ = exp(log π − log π_old), loss = masked_mean(max(−A·ρ, −A·clip(ρ, 1 − ε, 1 + ε))).
///
/// Only `logprobs` carries a gradient; the behaviour log-probs and advantages are detached. Where the
/// clipped term wins, the gradient is zero.
pub fn clipped_policy_loss(
    logprobs: &Tensor,
    old_logprobs: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    clip: f64,
) -> Result<PolicyLossTerms, LossError> {
    let dims = logprobs.size();
    check_shape("old_logprobs", old_logprobs, &dims)?;
    check_shape("advantages", advantages, &dims)?;
    check_shape("mask", mask, &dims)?;
    let kind = logprobs.kind();
    let mask = mask.f_to_kind(kind)?;
    let adv = advantages.detach().f_to_kind(kind)?;
    let log_ratio = logprobs.f_sub(&old_logprobs.detach().f_to_kind(kind)?)?;
    let ratio = log_ratio.f_exp()?;
    let pg1 = adv.f_neg()?.f_mul(&ratio)?;
    let pg2 = adv
        .f_neg()?
        .f_mul(&ratio.f_clamp(1.0 - clip, 1.0 + clip)?)?;
    // The larger (pessimistic) loss: the ratio gains nothing by leaving [1 − ε, 1 + ε] in the
    // direction the advantage rewards.
    let loss = masked_mean(&pg1.f_maximum(&pg2)?, &mask)?;

    let no_grad = tch::no_grad_guard();
    let clip_fraction =
        masked_mean(&pg2.f_gt_tensor(&pg1)?.f_to_kind(kind)?, &mask)?.double_value(&[]);
    let approx_kl = 0.5 * masked_mean(&log_ratio.f_square()?, &mask)?.double_value(&[]);
    let policy_kl = masked_mean(&log_ratio.f_neg()?, &mask)?.double_value(&[]);
    let ratio_mean = masked_mean(&ratio, &mask)?.double_value(&[]);
    drop(no_grad);
    Ok(PolicyLossTerms {
        loss,
        clip_fraction,
        approx_kl,
        policy_kl,
        ratio_mean,
    })
}

/// PPO's clipped value loss (TRL `PPOTrainer.loss`), all tensors (K, T) with a 1.0/0.0 `mask`:
/// V_clip = clip(V, V_old − ε_v, V_old + ε_v), loss = 0.5·masked_mean(max((V − R)², (V_clip − R)²)).
///
/// Only `values` carries a gradient; the old values and returns are detached.
pub fn clipped_value_loss(
    values: &Tensor,
    old_values: &Tensor,
    returns: &Tensor,
    mask: &Tensor,
    clip_value: f64,
) -> Result<ValueLossTerms, LossError> {
    let dims = values.size();
    check_shape("old_values", old_values, &dims)?;
    check_shape("returns", returns, &dims)?;
    check_shape("mask", mask, &dims)?;
    let kind = values.kind();
    let mask = mask.f_to_kind(kind)?;
    let old = old_values.detach().f_to_kind(kind)?;
    let returns = returns.detach().f_to_kind(kind)?;
    let low = old.f_sub_scalar(clip_value)?;
    let high = old.f_add_scalar(clip_value)?;
    let v_clipped = values.f_clamp_tensor(Some(&low), Some(&high))?;
    let vf1 = values.f_sub(&returns)?.f_square()?;
    let vf2 = v_clipped.f_sub(&returns)?.f_square()?;
    let loss = masked_mean(&vf1.f_maximum(&vf2)?, &mask)?.f_mul_scalar(0.5)?;

    let no_grad = tch::no_grad_guard();
    let clip_fraction =
        masked_mean(&vf2.f_gt_tensor(&vf1)?.f_to_kind(kind)?, &mask)?.double_value(&[]);
    drop(no_grad);
    Ok(ValueLossTerms {
        loss,
        clip_fraction,
    })
}

/// Population variance; 0 for an empty slice.
fn population_var(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n
}

/// How much of the returns' variance the value head explains: 1 − Var(R − V)/Var(R), population
/// variances (CleanRL's `losses/explained_variance`). 1 is perfect, 0 is no better than
/// a constant, negative is worse than one.
///
/// Returns 0.0 when Var(R) is 0 (constant or empty returns), where the ratio is undefined (CleanRL logs
/// NaN there).
///
/// # Panics
/// If `values` and `returns` differ in length.
pub fn explained_variance(values: &[f64], returns: &[f64]) -> f64 {
    assert_eq!(
        values.len(),
        returns.len(),
        "values and returns must have one entry per token"
    );
    let var_returns = population_var(returns);
    if var_returns == 0.0 {
        return 0.0;
    }
    let residuals: Vec<f64> = returns.iter().zip(values).map(|(r, v)| r - v).collect();
    1.0 - population_var(&residuals) / var_returns
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_close(got: &[f64], want: &[f64], tol: f64) {
        assert_eq!(got.len(), want.len(), "got {got:?}, want {want:?}");
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < tol, "got {got:?}, want {want:?}");
        }
    }

    /// A (K, T) f32 tensor from rows.
    fn t2(rows: &[&[f32]]) -> Tensor {
        let k = rows.len() as i64;
        let t = rows[0].len() as i64;
        let flat: Vec<f32> = rows.iter().flat_map(|r| r.iter().copied()).collect();
        Tensor::from_slice(&flat).view([k, t])
    }

    fn to_vec(t: &Tensor) -> Vec<f64> {
        Vec::<f64>::try_from(t.to_kind(Kind::Double).flatten(0, -1)).unwrap()
    }

    #[test]
    fn token_rewards_penalise_kl_and_put_the_score_on_the_last_token() {
        // logprobs −1, −0.5, −2 vs reference −1.5, −0.5, −1: kl = 0.5, 0, −1.
        // kl_coef 0.1: −0.05, 0, +0.1; score 1 on the last token: 0.1 + 1 = 1.1.
        let lp = [-1.0, -0.5, -2.0];
        let lr = [-1.5, -0.5, -1.0];
        assert_close(&kl_per_token(&lp, &lr), &[0.5, 0.0, -1.0], 1e-12);
        assert_close(
            &token_rewards(&lp, &lr, 1.0, 0.1),
            &[-0.05, 0.0, 1.1],
            1e-12,
        );
        // One token carries both its penalty and the score: −0.1·0.5 + 2 = 1.95.
        assert_close(&token_rewards(&[-1.0], &[-1.5], 2.0, 0.1), &[1.95], 1e-12);
        assert!(token_rewards(&[], &[], 1.0, 0.1).is_empty());
    }

    #[test]
    fn gae_with_gamma_one_and_lambda_095() {
        // r = [0, 0, 1], V = [0.2, 0.4, 0.6], γ = 1, λ = 0.95.
        // t=2: δ = 1 + 0 − 0.6 = 0.4;       A = 0.4
        // t=1: δ = 0 + 0.6 − 0.4 = 0.2;     A = 0.2 + 0.95·0.4 = 0.58
        // t=0: δ = 0 + 0.4 − 0.2 = 0.2;     A = 0.2 + 0.95·0.58 = 0.751
        // R = A + V = [0.951, 0.98, 1.0]
        let (a, r) = gae(&[0.0, 0.0, 1.0], &[0.2, 0.4, 0.6], 1.0, 0.95);
        assert_close(&a, &[0.751, 0.58, 0.4], 1e-12);
        assert_close(&r, &[0.951, 0.98, 1.0], 1e-12);
    }

    #[test]
    fn gae_with_gamma_and_lambda_one_half() {
        // r = [1, 0, 2], V = [1, 2, 4], γ = λ = 0.5 (γλ = 0.25).
        // t=2: δ = 2 + 0.5·0 − 4 = −2;      A = −2
        // t=1: δ = 0 + 0.5·4 − 2 = 0;       A = 0 + 0.25·(−2) = −0.5
        // t=0: δ = 1 + 0.5·2 − 1 = 1;       A = 1 + 0.25·(−0.5) = 0.875
        // R = A + V = [1.875, 1.5, 2.0]
        let (a, r) = gae(&[1.0, 0.0, 2.0], &[1.0, 2.0, 4.0], 0.5, 0.5);
        assert_close(&a, &[0.875, -0.5, -2.0], 1e-12);
        assert_close(&r, &[1.875, 1.5, 2.0], 1e-12);
    }

    #[test]
    fn gae_limits_are_monte_carlo_and_one_step_td() {
        // γ = λ = 1: A_t = Σ_{s≥t} r_s − V_t = [1 − 0.2, 1 − 0.4, 1 − 0.6], and R_t = 1 everywhere.
        let (a, r) = gae(&[0.0, 0.0, 1.0], &[0.2, 0.4, 0.6], 1.0, 1.0);
        assert_close(&a, &[0.8, 0.6, 0.4], 1e-12);
        assert_close(&r, &[1.0, 1.0, 1.0], 1e-12);
        // λ = 0: A_t = δ_t = [0 + 0.4 − 0.2, 0 + 0.6 − 0.4, 1 − 0.6].
        let (a, _) = gae(&[0.0, 0.0, 1.0], &[0.2, 0.4, 0.6], 1.0, 0.0);
        assert_close(&a, &[0.2, 0.2, 0.4], 1e-12);
        assert_eq!(gae(&[], &[], 1.0, 0.95), (vec![], vec![]));
    }

    #[test]
    fn whiten_uses_the_unbiased_variance() {
        // [1, 3, 5]: mean 3, Σ(x − 3)² = 8, unbiased var 8/2 = 4, std 2 → [−1, 0, 1]
        // (the population var 8/3 would give ±1.2247). 1/sqrt(4 + 1e-8) differs from 0.5 by ~6e-10.
        let w = whiten(&[1.0, 3.0, 5.0], true);
        assert_close(&w, &[-1.0, 0.0, 1.0], 1e-8);
        // Mean 0, unbiased std 1: (1 + 0 + 1)/2 = 1.
        assert!(w.iter().sum::<f64>().abs() < 1e-12);
        assert!((w.iter().map(|x| x * x).sum::<f64>() / 2.0 - 1.0).abs() < 1e-8);
        // shift_mean = false adds the mean 3 back: [2, 3, 4].
        assert_close(&whiten(&[1.0, 3.0, 5.0], false), &[2.0, 3.0, 4.0], 1e-8);
        // [2, 2, 2, 6]: mean 3, Σ(x − 3)² = 1 + 1 + 1 + 9 = 12, var 12/3 = 4, std 2 →
        // [−0.5, −0.5, −0.5, 1.5].
        assert_close(
            &whiten(&[2.0, 2.0, 2.0, 6.0], true),
            &[-0.5, -0.5, -0.5, 1.5],
            1e-8,
        );
    }

    #[test]
    fn whiten_degenerate_inputs_give_no_nan() {
        assert!(whiten(&[], true).is_empty());
        // One value: variance 0, so x − mean = 0 → 0; without shifting, the value itself.
        assert_eq!(whiten(&[7.0], true), vec![0.0]);
        assert_eq!(whiten(&[7.0], false), vec![7.0]);
        // Constant values: x − mean = 0 everywhere.
        assert_close(&whiten(&[2.0, 2.0, 2.0], true), &[0.0, 0.0, 0.0], 1e-12);
    }

    /// The policy-loss batch of the clipping tests, ε = 0.2, old log-probs all −1 so that
    /// log π = −1 + ln ρ. Per token (A, ρ) → pg1 = −A·ρ, pg2 = −A·clip(ρ, 0.8, 1.2), max:
    ///   (0,0) A = +1, ρ = 1.5: pg1 = −1.5, pg2 = −1.2 → −1.2  clipped (above 1 + ε, A > 0)
    ///   (0,1) A = +1, ρ = 1.1: pg1 = pg2 = −1.1        → −1.1  inside the range
    ///   (0,2) A = −1, ρ = 1.5: pg1 = 1.5,  pg2 = 1.2  →  1.5  not clipped (above 1 + ε, A < 0)
    ///   (1,0) A = −1, ρ = 0.5: pg1 = 0.5,  pg2 = 0.8  →  0.8  clipped (below 1 − ε, A < 0)
    ///   (1,1) A = +2, ρ = 0.5: pg1 = −1.0, pg2 = −1.6 → −1.0  not clipped (below 1 − ε, A > 0)
    ///   (1,2) A = +5, ρ = 3.0: masked (max would be −6, clipped)
    fn policy_batch() -> (Tensor, Tensor, Tensor, Tensor) {
        let ratios: [[f32; 3]; 2] = [[1.5, 1.1, 1.5], [0.5, 0.5, 3.0]];
        let lp: Vec<f32> = ratios.iter().flatten().map(|r| -1.0 + r.ln()).collect();
        let lp = Tensor::from_slice(&lp).view([2, 3]).set_requires_grad(true);
        let old = t2(&[&[-1.0, -1.0, -1.0], &[-1.0, -1.0, -1.0]]);
        let adv = t2(&[&[1.0, 1.0, -1.0], &[-1.0, 2.0, 5.0]]);
        let mask = t2(&[&[1.0, 1.0, 1.0], &[1.0, 1.0, 0.0]]);
        (lp, old, adv, mask)
    }

    #[test]
    fn policy_loss_clips_on_each_side_and_ignores_masked_tokens() {
        let (lp, old, adv, mask) = policy_batch();
        let out = clipped_policy_loss(&lp, &old, &adv, &mask, 0.2).unwrap();
        // (−1.2 − 1.1 + 1.5 + 0.8 − 1.0)/5 = −1.0/5 = −0.2
        assert!(
            (out.loss.double_value(&[]) + 0.2).abs() < 1e-5,
            "{}",
            out.loss.double_value(&[])
        );
        // Clipped: (0,0) and (1,0) of 5 unmasked tokens → 0.4 (the masked (1,2) would make it 3/6).
        assert!((out.clip_fraction - 0.4).abs() < 1e-12);
        // Mean ratio (1.5 + 1.1 + 1.5 + 0.5 + 0.5)/5 = 5.1/5 = 1.02.
        assert!((out.ratio_mean - 1.02).abs() < 1e-5);
    }

    #[test]
    fn policy_loss_gradient_is_zero_where_the_clipped_term_is_active() {
        let (lp, old, adv, mask) = policy_batch();
        let out = clipped_policy_loss(&lp, &old, &adv, &mask, 0.2).unwrap();
        out.loss.backward();
        // d(−A·ρ)/d log π = −A·ρ, divided by the 5 tokens where the unclipped term is active;
        // 0 where the clipped (constant) term is active, and on the masked token:
        //   (0,0) 0   (0,1) −1·1.1/5 = −0.22   (0,2) 1·1.5/5 = 0.3
        //   (1,0) 0   (1,1) −2·0.5/5 = −0.2    (1,2) 0
        assert_close(
            &to_vec(&lp.grad()),
            &[0.0, -0.22, 0.3, 0.0, -0.2, 0.0],
            1e-6,
        );
    }

    #[test]
    fn policy_loss_diagnostics() {
        // log π − log π_old = [0.1, −0.3] with A = 0 (so the loss is 0):
        // approx_kl = 0.5·(0.01 + 0.09)/2 = 0.025; policy_kl = (−0.1 + 0.3)/2 = 0.1.
        let lp = t2(&[&[-0.9, -1.3]]);
        let old = t2(&[&[-1.0, -1.0]]);
        let zero = t2(&[&[0.0, 0.0]]);
        let mask = t2(&[&[1.0, 1.0]]);
        let out = clipped_policy_loss(&lp, &old, &zero, &mask, 0.2).unwrap();
        assert!(out.loss.double_value(&[]).abs() < 1e-12);
        assert!((out.approx_kl - 0.025).abs() < 1e-6, "{}", out.approx_kl);
        assert!((out.policy_kl - 0.1).abs() < 1e-6, "{}", out.policy_kl);
        // pg1 = pg2 = 0 everywhere: nothing counts as clipped.
        assert_eq!(out.clip_fraction, 0.0);
    }

    #[test]
    fn policy_loss_of_an_all_padding_batch_is_zero_not_nan() {
        let x = t2(&[&[-1.0, -2.0]]);
        let mask = t2(&[&[0.0, 0.0]]);
        let out = clipped_policy_loss(&x, &x, &x, &mask, 0.2).unwrap();
        assert_eq!(out.loss.double_value(&[]), 0.0);
        assert_eq!(out.clip_fraction, 0.0);
    }

    #[test]
    fn policy_loss_rejects_mismatched_shapes() {
        let a = t2(&[&[0.0, 0.0]]);
        let b = t2(&[&[0.0], &[0.0]]);
        assert!(matches!(
            clipped_policy_loss(&a, &b, &a, &a, 0.2),
            Err(LossError::Shape(_))
        ));
        assert!(matches!(
            clipped_value_loss(&a, &a, &a, &b, 0.2),
            Err(LossError::Shape(_))
        ));
    }

    #[test]
    fn value_loss_clips_around_the_old_values() {
        // ε_v = 0.2, V_clip = clip(V, V_old − 0.2, V_old + 0.2). Per token (V, V_old, R):
        //   (0,0) 1.5, 1.0, 2.0: V_clip 1.2; vf1 = 0.25, vf2 = 0.64 → 0.64  clipped (above)
        //   (0,1) 1.5, 1.0, 1.0: V_clip 1.2; vf1 = 0.25, vf2 = 0.04 → 0.25
        //   (0,2) 0.5, 1.0, 0.0: V_clip 0.8; vf1 = 0.25, vf2 = 0.64 → 0.64  clipped (below)
        //   (1,0) 1.1, 1.0, 0.0: V_clip 1.1; vf1 = vf2 = 1.21      → 1.21  inside the range
        //   (1,1) 0.5, 1.0, 1.0: V_clip 0.8; vf1 = 0.25, vf2 = 0.04 → 0.25
        //   (1,2) 10,  0.0, 0.0: masked (max would be 100)
        // loss = 0.5·(0.64 + 0.25 + 0.64 + 1.21 + 0.25)/5 = 0.5·2.99/5 = 0.299; clipped 2/5 = 0.4.
        let v = t2(&[&[1.5, 1.5, 0.5], &[1.1, 0.5, 10.0]]).set_requires_grad(true);
        let old = t2(&[&[1.0, 1.0, 1.0], &[1.0, 1.0, 0.0]]);
        let ret = t2(&[&[2.0, 1.0, 0.0], &[0.0, 1.0, 0.0]]);
        let mask = t2(&[&[1.0, 1.0, 1.0], &[1.0, 1.0, 0.0]]);
        let out = clipped_value_loss(&v, &old, &ret, &mask, 0.2).unwrap();
        assert!(
            (out.loss.double_value(&[]) - 0.299).abs() < 1e-5,
            "{}",
            out.loss.double_value(&[])
        );
        assert!((out.clip_fraction - 0.4).abs() < 1e-12);
        // d(0.5·(V − R)²/5)/dV = (V − R)/5 where the unclipped term is active, 0 where V_clip is
        // clamped (constant in V) and on the masked token:
        //   (0,0) 0   (0,1) 0.5/5 = 0.1   (0,2) 0
        //   (1,0) 1.1/5 = 0.22   (1,1) −0.5/5 = −0.1   (1,2) 0
        out.loss.backward();
        assert_close(&to_vec(&v.grad()), &[0.0, 0.1, 0.0, 0.22, -0.1, 0.0], 1e-6);
    }

    #[test]
    fn explained_variance_by_hand() {
        // R = [1, 3, 5]: mean 3, Var = (4 + 0 + 4)/3 = 8/3.
        // V = [1, 2, 3]: R − V = [0, 1, 2], mean 1, Var = 2/3 → 1 − (2/3)/(8/3) = 0.75.
        assert!((explained_variance(&[1.0, 2.0, 3.0], &[1.0, 3.0, 5.0]) - 0.75).abs() < 1e-12);
        // Perfect values → 1; a constant at the mean → R − V has Var(R) → 0.
        assert!((explained_variance(&[1.0, 3.0, 5.0], &[1.0, 3.0, 5.0]) - 1.0).abs() < 1e-12);
        assert!(explained_variance(&[3.0, 3.0, 3.0], &[1.0, 3.0, 5.0]).abs() < 1e-12);
        // V = [5, 3, 1]: R − V = [−4, 0, 4], Var = 32/3 → 1 − 4 = −3 (worse than a constant).
        assert!((explained_variance(&[5.0, 3.0, 1.0], &[1.0, 3.0, 5.0]) + 3.0).abs() < 1e-12);
        // Constant or empty returns: undefined, reported as 0.
        assert_eq!(explained_variance(&[0.0, 1.0], &[2.0, 2.0]), 0.0);
        assert_eq!(explained_variance(&[], &[]), 0.0);
    }
}
