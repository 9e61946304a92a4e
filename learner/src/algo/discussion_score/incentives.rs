//! The incentive bonuses weighted by α0..α3: answer changes and influence on the other agents.

pub use crate::config::IncentiveRule;
use serde::{Deserialize, Serialize};

use super::{MaporlError, agents_of};

/// How an agent's answer changed from one turn to the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Transition {
    /// Right, then wrong.
    CorrectToWrong,
    /// Wrong, then right.
    WrongToCorrect,
    /// Right both times.
    StayedCorrect,
    /// Wrong both times.
    StayedWrong,
}

/// The transition from `prev_correct` to `now_correct` (used by the incentives and by metrics).
pub fn answer_changes(prev_correct: bool, now_correct: bool) -> Transition {
    match (prev_correct, now_correct) {
        (true, false) => Transition::CorrectToWrong,
        (false, true) => Transition::WrongToCorrect,
        (true, true) => Transition::StayedCorrect,
        (false, false) => Transition::StayedWrong,
    }
}

/// The incentive weights; all 0 (off) by default, as released.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Incentives {
    /// Four weights, see [`incentive_bonus`].
    pub alpha: [f64; 4],
    /// Which rule reads them.
    pub rule: IncentiveRule,
}

/// Where the others stand: "right" when more than half of them are, "wrong" when fewer than half are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Others {
    Right,
    Wrong,
    Split,
}

fn others(row: &[bool], me: usize) -> Others {
    let n_others = row.len() - 1;
    let right = row
        .iter()
        .enumerate()
        .filter(|(a, c)| *a != me && **c)
        .count();
    match (2 * right).cmp(&n_others) {
        std::cmp::Ordering::Greater => Others::Right,
        std::cmp::Ordering::Less => Others::Wrong,
        std::cmp::Ordering::Equal => Others::Split,
    }
}

/// Incentive bonus of every agent at every turn of one question, from `correct[t][a]` (is agent a's
/// answer at turn t right). "The others" are the other agents, right or wrong by majority (a tie gives
/// no bonus). `alpha` = [w0, w1, w2, w3]; summed per (t, i):
///
/// **Answer change** (t ≥ 1, at least two agents), from the agent's own answer at t − 1 to t, and
/// the others at t − 1:
///
/// | change | others at t − 1 | [`IncentiveRule::Paper`] (Table 1) | [`IncentiveRule::ReleasedCode`] |
/// | --- | --- | --- | --- |
/// | right → wrong | right | −w1 | −w1 |
/// | right → wrong | wrong | −w0 | −w0 |
/// | wrong → right | wrong | +w0 (α0: reasoning past wrong answers) | +w1 |
/// | wrong → right | right | +w1 (α1: persuaded by right ones) | +w0 |
///
/// A single agent has no others: both rules give wrong → right +w1, right → wrong −w1 (the
/// released code's; the paper's table needs a majority).
///
/// **Influence** (at least two agents, turn t + 1 played), on the agent's answer at t from the
/// others at t and t + 1:
///
/// | others t → t + 1 | agent at t | Paper (Table 2) | ReleasedCode |
/// | --- | --- | --- | --- |
/// | wrong → right | right | +w3 (β1) | −w3 |
/// | wrong → right | wrong | +w2 (β0) | −w2 |
/// | right → wrong | right | −w3 (β1) | +w2 |
/// | right → wrong | wrong | −w2 (β0) | +w3 |
///
/// The released `bonus_rule` gives no bonus at turn 0 at all, influence included; the paper's
/// tables hold from turn 0, so `Paper` gives turn 0 its influence term (turn 0 has no change).
pub fn incentive_bonus(
    correct: &[Vec<bool>],
    inc: &Incentives,
) -> Result<Vec<Vec<f64>>, MaporlError> {
    let n = agents_of(correct)?;
    let [w0, w1, w2, w3] = inc.alpha;
    let paper = inc.rule == IncentiveRule::Paper;
    let bonus = (0..correct.len())
        .map(|t| {
            (0..n)
                .map(|i| {
                    let me = correct[t][i];
                    let mut b = 0.0;
                    if t >= 1 {
                        // With one agent there are no others: every change is its own (w1).
                        let before = (n > 1).then(|| others(&correct[t - 1], i));
                        b += match (answer_changes(correct[t - 1][i], me), before) {
                            (Transition::CorrectToWrong, Some(Others::Right) | None) => -w1,
                            (Transition::CorrectToWrong, Some(Others::Wrong)) => -w0,
                            (Transition::WrongToCorrect, None) => w1,
                            (Transition::WrongToCorrect, Some(Others::Wrong)) => {
                                if paper {
                                    w0
                                } else {
                                    w1
                                }
                            }
                            (Transition::WrongToCorrect, Some(Others::Right)) => {
                                if paper {
                                    w1
                                } else {
                                    w0
                                }
                            }
                            _ => 0.0,
                        };
                    }
                    let influence_turn = if paper { true } else { t >= 1 };
                    if n > 1 && influence_turn && t + 1 < correct.len() {
                        b += match (
                            others(&correct[t], i),
                            others(&correct[t + 1], i),
                            me,
                            paper,
                        ) {
                            (Others::Wrong, Others::Right, true, true) => w3,
                            (Others::Wrong, Others::Right, false, true) => w2,
                            (Others::Right, Others::Wrong, true, true) => -w3,
                            (Others::Right, Others::Wrong, false, true) => -w2,
                            (Others::Wrong, Others::Right, true, false) => -w3,
                            (Others::Wrong, Others::Right, false, false) => -w2,
                            (Others::Right, Others::Wrong, true, false) => w2,
                            (Others::Right, Others::Wrong, false, false) => w3,
                            _ => 0.0,
                        };
                    }
                    b
                })
                .collect()
        })
        .collect();
    Ok(bonus)
}
