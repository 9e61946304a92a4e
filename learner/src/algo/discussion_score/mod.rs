//! MaPoRL's per-answer training score (docs/src/trainers/maporl.md; Park et al. 2025, arXiv 2502.18439):
//! the discounted, influence-aware score R(t, i) of agent i's answer at turn t, the incentive bonuses
//! weighted by α0..α3, and the −10 penalty for invalid outputs. All pure functions over one question's
//! table of turns × agents; the trainer composes them as
//! `R(t, i) + bonus(t, i)` with the penalty already applied to the per-answer scores
//! ([`shaped_training_scores`]).
//!
//! # What the released code does, and what cotrain decided
//!
//! Read in `chanwoo-park-official/MAPoRL` (commit c204c2c):
//! `trl/trl/trainer/utils_multi_unified.py` (`score_rule`, lines 1715–1797; `bonus_rule`, 1612–1713),
//! `trl/trl/trainer/ppov2_trainer_multi_different_model.py` (penalty, lines 1467–1503; composition,
//! 1605–1611), `utils/utils_cooperateLLM.py` (`check_repeated_sequences`, 425–469) and the configs in
//! `config/ppo_config/`.
//!
//! **Score rule.** Two flags: `rule_horizon` ∈ {`current`, `discounted_sum`, `last`} and
//! `rule_agent_share` ∈ {`all`, `individual`}; every shipped config uses `discounted_sum`, `all`,
//! `rule_discount = 0.3` (the trainer's own defaults, `individual` and 1.0, are never used), so these
//! are [`ScoreRule::default`]. The sum runs to the question's last played turn (a question that reached
//! consensus early stops there); here that is simply the table's last row. With `all` the future term
//! averages over ALL agents, the agent itself included. The released `last` rule reads turn T − 1 even
//! for a question that stopped early, which turns the sample into its "not reached" sentinel and drops
//! it; cotrain reads the last played turn. [`ScoreRule::lookahead`] (a window t..=t + k) is a cotrain
//! option, not in the released code.
//!
//! **Incentives.** `alpha` is a list of four weights (all 0 by default), read from correctness (the 0/1
//! answer check, not the verifier), an agent counting as right above 0.5 and the others' mean
//! correctness compared with 0.5 (exactly 0.5, e.g. one of two others right, gives no bonus). The bonus
//! is added after the discount, undiscounted. The paper (arXiv 2502.18439v2, §3.3, Tables 1 and 2;
//! its names are α0, α1 for an agent's own answer changes and β0, β1 for its influence on the
//! others) and the released `bonus_rule` differ:
//! - answer changes: the same signs; a change to the right answer is weighted by α1 in the paper
//!   when the others were right (persuaded by them) and α0 when they were wrong, the code swaps the
//!   two weights there (its penalties match the paper's);
//! - influence: the paper rewards the others going wrong → right and penalises right → wrong (β1
//!   when the agent was right at t, β0 when it was wrong); the released code has the OPPOSITE sign
//!   in all four cases and groups the weights by whether the others end on the agent's side (α3) or
//!   not (α2);
//! - the code gives no bonus at turn 0; the paper's influence table applies there too.
//!
//! cotrain's default is the paper ([`IncentiveRule::Paper`], `alpha` = [α0, α1, β0, β1]);
//! [`IncentiveRule::ReleasedCode`] reproduces the released code (checked against its fixture).
//! With the seed configs' `alpha` of zeros both give no bonus.
//!
//! **Invalid outputs.** The released trainer replaces (does not add to) the score of an invalid answer
//! by `penalty_reward_value = -10` BEFORE the score rule, so an invalid answer also drags down the other
//! agents' future term; [`apply_invalid_penalty`] is meant to be used the same way. Invalid means: fewer
//! than `min_output_length = 50` response tokens (it counts tokens before the end token); a run of token
//! subsequences of length 1..=20 repeated more than 3 times back to back, subsequences that decode to
//! digits only being exempt; no `\boxed{...}` in the decoded text where a box is required, which is at
//! every turn after the first and at turn 0 only when turn 0 is trained (`task_training`). The released
//! code gates all three on `non_eos_penalty` (its `non_box_penalty` flag is read but never used); the
//! turn-3 configs set `non_eos_penalty = False`, which leaves the penalty condition undefined, so that
//! path cannot run as published. cotrain checks text, not token ids (the repetition rule is stated on
//! words, see [`invalid_reason`]), and takes the token count from the caller.

mod incentives;
mod invalid;
mod rule;
#[cfg(test)]
mod tests;

pub use incentives::{IncentiveRule, Incentives, Transition, answer_changes, incentive_bonus};
pub use invalid::{
    InvalidOutputRule, InvalidReason, apply_invalid_penalty, boxed_required, invalid_reason,
};
pub use rule::{AgentShare, Horizon, ScoreRule, training_scores};

/// Why a table of scores or correctness cannot be scored.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MaporlError {
    /// A turn lists a different number of agents than turn 0.
    #[error("turn {turn} has {got} agents, turn 0 has {expected}")]
    RaggedTable {
        turn: usize,
        expected: usize,
        got: usize,
    },
    /// The table has turns but no agents.
    #[error("the table has turns but no agents")]
    NoAgents,
    /// The scores and correctness tables disagree in shape.
    #[error(
        "the scores table is {scores_turns}×{scores_agents} but the correctness table is {correct_turns}×{correct_agents}"
    )]
    ShapeMismatch {
        scores_turns: usize,
        scores_agents: usize,
        correct_turns: usize,
        correct_agents: usize,
    },
    /// The discount must be a finite number ≥ 0.
    #[error("gamma must be finite and non-negative, got {0}")]
    InvalidGamma(f64),
}

/// Number of agents of a turns × agents table, checking that every turn has the same.
fn agents_of<T>(table: &[Vec<T>]) -> Result<usize, MaporlError> {
    let Some(first) = table.first() else {
        return Ok(0);
    };
    let n = first.len();
    if n == 0 {
        return Err(MaporlError::NoAgents);
    }
    for (turn, row) in table.iter().enumerate() {
        if row.len() != n {
            return Err(MaporlError::RaggedTable {
                turn,
                expected: n,
                got: row.len(),
            });
        }
    }
    Ok(n)
}

/// The released trainer's final per-answer score: [`training_scores`] of the (penalised) scores plus
/// the undiscounted [`incentive_bonus`] from correctness.
pub fn shaped_training_scores(
    s: &[Vec<f64>],
    correct: &[Vec<bool>],
    rule: &ScoreRule,
    inc: &Incentives,
) -> Result<Vec<Vec<f64>>, MaporlError> {
    let (ns, nc) = (agents_of(s)?, agents_of(correct)?);
    if s.len() != correct.len() || ns != nc {
        return Err(MaporlError::ShapeMismatch {
            scores_turns: s.len(),
            scores_agents: ns,
            correct_turns: correct.len(),
            correct_agents: nc,
        });
    }
    let r = training_scores(s, rule)?;
    let b = incentive_bonus(correct, inc)?;
    Ok(r.iter()
        .zip(&b)
        .map(|(rr, bb)| rr.iter().zip(bb).map(|(x, y)| x + y).collect())
        .collect())
}
