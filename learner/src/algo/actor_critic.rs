//! The math of CoMLRL's actor-critic trainers (IAC and MAAC, comlrl 1.4.3
//! `comlrl/trainers/actor_critic/{ac_base,iac,maac}.py`), as pure functions:
//!
//! - [`td_targets`]: each turn's target y_t = r'_t + γ·V_old(h_{t+1}), r'_T−1 at the last played
//!   turn (early stop and the horizon alike), from the critic's rollout-time values (no gradient:
//!   TD(0) with a fixed bootstrap); single-turn, y = r';
//! - [`normalized_advantages`]: A = y − V_old, then (A − mean)/max(std_pop, 1e-6) over one
//!   (agent, turn) group of a buffer drain (not for a group of one);
//! - [`undiscounted_returns`]: Σ_{k≥t} r'_k, what upstream logs as `expected_return`;
//! - [`critic_input`]: the MAAC critic's joint text; [`value_loss`]: the critic's squared error.
//!
//! The actor's loss is MAGRPO's (−mean_k Â_k·Σ_t log π, no ratio, no clip: [`super::policy_loss`]
//! with the original options); the critic's is value_loss_coef·mean_k (y_k − V(h_k))². Unlike
//! MaPoRL's PPO ([`super::ppo`]: per-token GAE over a response, whitening over the batch, a clipped
//! surrogate) the unit here is a whole turn: one value, one target and one advantage per completion,
//! so the two share no code beyond the explained-variance diagnostic.

/// The TD targets of one agent's chain: `rewards[t]` (after the reward processor and any reference
/// KL shaping) and `values[t]` = V_old(h_t), both over the turns played.
///
/// # Panics
/// If the two slices differ in length.
pub fn td_targets(rewards: &[f64], values: &[f64], discount: f64) -> Vec<f64> {
    assert_eq!(
        rewards.len(),
        values.len(),
        "one reward and one value per turn"
    );
    (0..rewards.len())
        .map(|t| {
            if t + 1 < rewards.len() {
                rewards[t] + discount * values[t + 1]
            } else {
                rewards[t]
            }
        })
        .collect()
}

/// Σ_{k≥t} rewards[k] for every t (upstream's logged return; undiscounted in 1.4.3).
pub fn undiscounted_returns(rewards: &[f64]) -> Vec<f64> {
    let mut acc = 0.0;
    let mut out: Vec<f64> = rewards
        .iter()
        .rev()
        .map(|r| {
            acc += r;
            acc
        })
        .collect();
    out.reverse();
    out
}

/// The advantages y − V_old of one (agent, turn) group and, with `normalize` and more than one
/// of them, their normalised form (A − mean)/max(std, 1e-6) with the population std.
///
/// # Panics
/// If the two slices differ in length.
pub fn normalized_advantages(
    targets: &[f64],
    old_values: &[f64],
    normalize: bool,
) -> (Vec<f64>, Vec<f64>) {
    assert_eq!(
        targets.len(),
        old_values.len(),
        "one target and one value per sample"
    );
    let adv: Vec<f64> = targets.iter().zip(old_values).map(|(y, v)| y - v).collect();
    if !normalize || adv.len() < 2 {
        return (adv.clone(), adv);
    }
    let n = adv.len() as f64;
    let mean = adv.iter().sum::<f64>() / n;
    let std = (adv.iter().map(|a| (a - mean).powi(2)).sum::<f64>() / n)
        .sqrt()
        .max(1e-6);
    let norm = adv.iter().map(|a| (a - mean) / std).collect();
    (adv, norm)
}

/// The critic's loss before `value_loss_coef`, values (K,) with the gradient, targets and old
/// values detached: mean_k (y_k − V_k)², or with `clip` = (V_old, ε) (IAC's value head on the
/// actor) mean_k max((y_k − V_k)², (y_k − V_clip,k)²), V_clip = V_old + clamp(V − V_old, −ε, ε).
pub fn value_loss(
    values: &tch::Tensor,
    targets: &tch::Tensor,
    clip: Option<(&tch::Tensor, f64)>,
) -> tch::Tensor {
    let kind = values.kind();
    let y = targets.detach().to_kind(kind);
    let plain = (&y - values).square();
    let per_sample = match clip {
        None => plain,
        Some((old, eps)) => {
            let old = old.detach().to_kind(kind);
            let clipped = &old + (values - &old).clamp(-eps, eps);
            plain.maximum(&(&y - clipped).square())
        }
    };
    per_sample.mean(kind)
}

/// The MAAC critic's input: `[Agent i] <prompt i>` per agent, joined by blank lines; for Q(h, a) a
/// `[Joint Action]` block follows with `[Agent i action]` and each completion on the next line.
pub fn critic_input(prompts: &[&str], actions: Option<&[&str]>) -> String {
    let mut text = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| format!("[Agent {i}] {p}"))
        .collect::<Vec<_>>()
        .join("\n\n");
    if let Some(actions) = actions {
        let mut parts = vec!["[Joint Action]".to_string()];
        parts.extend(
            actions
                .iter()
                .enumerate()
                .map(|(i, a)| format!("[Agent {i} action]\n{a}")),
        );
        text.push_str("\n\n");
        text.push_str(&parts.join("\n\n"));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_bootstrap_from_the_next_turn_but_not_after_the_last() {
        assert_eq!(
            td_targets(&[1.0, 2.0, 3.0], &[0.5, 0.25, 4.0], 0.5),
            vec![1.125, 4.0, 3.0]
        );
        assert_eq!(td_targets(&[-1.0], &[9.0], 0.9), vec![-1.0]);
        assert_eq!(undiscounted_returns(&[1.0, 2.0, 3.0]), vec![6.0, 5.0, 3.0]);
    }

    #[test]
    fn a_group_of_one_or_of_equal_advantages_stays_finite() {
        assert_eq!(normalized_advantages(&[1.0], &[0.25], true).1, vec![0.75]);
        assert_eq!(
            normalized_advantages(&[1.0, 1.0], &[0.0, 0.0], true).1,
            vec![0.0, 0.0]
        );
        let (_, n) = normalized_advantages(&[1.0, 0.0], &[0.0, 0.0], true);
        assert_eq!(n, vec![1.0, -1.0]);
    }
}
