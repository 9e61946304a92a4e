//! The incentive bonuses weighted by α0..α3: answer changes and influence on the other agents.

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

/// Sign convention of the influence bonuses α2 and α3 (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InfluenceSigns {
    /// + when the others become right, − when they become wrong (the paper's aim).
    #[default]
    Paper,
    /// The released code's signs: the opposite.
    ReleasedCode,
}

/// The incentive weights; all 0 (off) by default, as released.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Incentives {
    /// [α0, α1, α2, α3], see [`incentive_bonus`].
    pub alpha: [f64; 4],
    /// Sign convention of α2 and α3.
    pub influence_signs: InfluenceSigns,
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
    let right = row.iter().enumerate().filter(|(a, c)| *a != me && **c).count();
    match (2 * right).cmp(&n_others) {
        std::cmp::Ordering::Greater => Others::Right,
        std::cmp::Ordering::Less => Others::Wrong,
        std::cmp::Ordering::Equal => Others::Split,
    }
}

/// Incentive bonus of every agent at every turn of one question, from `correct[t][a]` (is agent a's
/// answer at turn t right). "The others" are the other agents, right or wrong by majority (a tie gives
/// no bonus). Summed per (t, i):
///
/// Answer change, t ≥ 1, from the agent's own answer at t − 1 to t and the others at t − 1:
/// - wrong → right, the others were right: +α0 (persuaded to the right answer);
/// - right → wrong, the others were wrong: −α0 (persuaded to a wrong answer);
/// - wrong → right, the others were wrong: +α1 (corrected itself against them);
/// - right → wrong, the others were right: −α1 (left the right answer they shared);
/// - with a single agent: wrong → right +α1, right → wrong −α1.
///
/// Influence, t ≥ 1 with t + 1 played and at least two agents (the released `bonus_rule` returns no
/// bonus at all at turn 0), from the others at t and t + 1 and the agent's
/// answer at t (signs of [`InfluenceSigns::Paper`]; `ReleasedCode` negates all four):
/// - the others go wrong → right while the agent is right: +α3 (it persuaded them);
/// - the others go right → wrong while the agent is wrong: −α3 (it misled them);
/// - the others go wrong → right while the agent is wrong: +α2;
/// - the others go right → wrong while the agent is right: −α2.
pub fn incentive_bonus(correct: &[Vec<bool>], inc: &Incentives) -> Result<Vec<Vec<f64>>, MaporlError> {
    let n = agents_of(correct)?;
    let [a0, a1, a2, a3] = inc.alpha;
    let sign = match inc.influence_signs {
        InfluenceSigns::Paper => 1.0,
        InfluenceSigns::ReleasedCode => -1.0,
    };
    let bonus = (0..correct.len())
        .map(|t| {
            (0..n)
                .map(|i| {
                    let me = correct[t][i];
                    let mut b = 0.0;
                    if t >= 1 {
                        // With one agent there are no others: every change is its own (α1).
                        let before = (n > 1).then(|| others(&correct[t - 1], i));
                        b += match (answer_changes(correct[t - 1][i], me), before) {
                            (Transition::WrongToCorrect, Some(Others::Right)) => a0,
                            (Transition::CorrectToWrong, Some(Others::Wrong)) => -a0,
                            (Transition::WrongToCorrect, Some(Others::Wrong) | None) => a1,
                            (Transition::CorrectToWrong, Some(Others::Right) | None) => -a1,
                            _ => 0.0,
                        };
                    }
                    if n > 1 && t >= 1 && t + 1 < correct.len() {
                        b += sign
                            * match (others(&correct[t], i), others(&correct[t + 1], i), me) {
                                (Others::Wrong, Others::Right, true) => a3,
                                (Others::Right, Others::Wrong, false) => -a3,
                                (Others::Wrong, Others::Right, false) => a2,
                                (Others::Right, Others::Wrong, true) => -a2,
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
