//! The score rule R(t, i): which turns and which agents enter an answer's training score.

use super::{MaporlError, agents_of};
pub use crate::config::{AgentShare, Horizon};

/// How a table of per-answer scores s(t, a) becomes training scores R(t, i).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScoreRule {
    /// `rule_horizon`.
    pub horizon: Horizon,
    /// `rule_agent_share`.
    pub agent_share: AgentShare,
    /// γ of the discounted sum (`rule_discount`).
    pub gamma: f64,
    /// cotrain option: only turns t..=t + k count (the window also decides which turn `last` reads);
    /// `None` runs to the last played turn, as released.
    pub lookahead: Option<usize>,
}

impl Default for ScoreRule {
    /// The released configs: `discounted_sum`, `all`, γ = 0.3, no window.
    fn default() -> Self {
        Self {
            horizon: Horizon::DiscountedSum,
            agent_share: AgentShare::All,
            gamma: 0.3,
            lookahead: None,
        }
    }
}

/// R(t, i) for every turn and agent of one question (MaPoRL's influence-aware score):
/// with x = the window's last turn and m(t') = mean_a s(t', a),
/// - `discounted_sum`, `all`: R = [s(t, i) + Σ_{t<t'≤x} γ^(t'−t)·m(t')] / Σ_{t≤t'≤x} γ^(t'−t);
/// - `discounted_sum`, `individual`: R = Σ_{t≤t'≤x} γ^(t'−t)·s(t', i) / Σ_{t≤t'≤x} γ^(t'−t);
/// - `current`: s(t, i) or m(t); `last`: s(x, i) or m(x).
///
/// `s[t][a]` is agent a's score at turn t (verifier probability or 0/1, already penalised), one row per
/// turn actually played.
pub fn training_scores(s: &[Vec<f64>], rule: &ScoreRule) -> Result<Vec<Vec<f64>>, MaporlError> {
    if !rule.gamma.is_finite() || rule.gamma < 0.0 {
        return Err(MaporlError::InvalidGamma(rule.gamma));
    }
    let n = agents_of(s)?;
    let last = s.len().saturating_sub(1);
    let mean: Vec<f64> = s
        .iter()
        .map(|row| row.iter().sum::<f64>() / n as f64)
        .collect();
    let pick = |t: usize, i: usize| match rule.agent_share {
        AgentShare::All => mean[t],
        AgentShare::Individual => s[t][i],
    };
    let scores = (0..s.len())
        .map(|t| {
            let x = rule
                .lookahead
                .map_or(last, |k| last.min(t.saturating_add(k)));
            (0..n)
                .map(|i| match rule.horizon {
                    Horizon::Current => pick(t, i),
                    Horizon::Last => pick(x, i),
                    Horizon::DiscountedSum => {
                        let (mut num, mut den) = (0.0, 0.0);
                        for tp in t..=x {
                            let w = rule.gamma.powi((tp - t) as i32);
                            // The agent's own answer at t is its own; only later turns are shared.
                            num += w * if tp == t { s[t][i] } else { pick(tp, i) };
                            den += w;
                        }
                        num / den
                    }
                })
                .collect()
        })
        .collect();
    Ok(scores)
}
