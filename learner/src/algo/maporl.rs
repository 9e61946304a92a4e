//! MaPoRL's per-answer training score (algorithms.md, "MaPoRL"; Park et al. 2025, arXiv 2502.18439):
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
//! is added after the discount, undiscounted. α0 and α1 (answer changes) are used as in the released
//! code, whose signs agree with the paper's stated aim (incentives "to encourage corrective and
//! persuasive discussions"): a change to the right answer earns +α, a change to a wrong one costs −α;
//! α0 when the agent moved with the others (persuaded by them), α1 when it moved against them.
//! The influence weights α2 and α3 have the OPPOSITE sign in the released code: an agent that is right
//! while the others are wrong, and whose others are right at the next turn (it persuaded them), gets
//! −α3 there, and one that is wrong while the others go from right to wrong (it misled them) gets +α3.
//! That penalises exactly the persuasion the paper sets out to reward, so cotrain's default
//! ([`InfluenceSigns::Paper`]) gives the bonus the sign of the others' change (+ when they become right,
//! − when they become wrong), α3 when the agent's own answer was on the side the others moved to, α2
//! when it was not; [`InfluenceSigns::ReleasedCode`] reproduces the released signs. (Only the paper's
//! abstract and summaries of it could be consulted here, not its section on shaping; the decision rests
//! on that stated aim.)
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

use cotrain_reward_server::rewards::gsm8k::last_boxed;
use serde::{Deserialize, Serialize};

/// Why a table of scores or correctness cannot be scored.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MaporlError {
    /// A turn lists a different number of agents than turn 0.
    #[error("turn {turn} has {got} agents, turn 0 has {expected}")]
    RaggedTable { turn: usize, expected: usize, got: usize },
    /// The table has turns but no agents.
    #[error("the table has turns but no agents")]
    NoAgents,
    /// The scores and correctness tables disagree in shape.
    #[error("the scores table is {scores_turns}×{scores_agents} but the correctness table is {correct_turns}×{correct_agents}")]
    ShapeMismatch { scores_turns: usize, scores_agents: usize, correct_turns: usize, correct_agents: usize },
    /// The discount must be a finite number ≥ 0.
    #[error("gamma must be finite and non-negative, got {0}")]
    InvalidGamma(f64),
}

/// Number of agents of a turns × agents table, checking that every turn has the same.
fn agents_of<T>(table: &[Vec<T>]) -> Result<usize, MaporlError> {
    let Some(first) = table.first() else { return Ok(0) };
    let n = first.len();
    if n == 0 {
        return Err(MaporlError::NoAgents);
    }
    for (turn, row) in table.iter().enumerate() {
        if row.len() != n {
            return Err(MaporlError::RaggedTable { turn, expected: n, got: row.len() });
        }
    }
    Ok(n)
}

// ---------------------------------------------------------------------------------------------------
// Score rule
// ---------------------------------------------------------------------------------------------------

/// Which turns enter R(t, i); the released flag `rule_horizon`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Horizon {
    /// Turn t only.
    Current,
    /// Turns t..=last, weighted γ^(t'−t) and normalised by the sum of the weights.
    #[default]
    DiscountedSum,
    /// The last turn only, whatever t is.
    Last,
}

/// Whose scores enter R(t, i); the released flag `rule_agent_share`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AgentShare {
    /// The agent's own score at turn t, the mean over all agents (itself included) at other turns
    /// (`current` and `last` use the mean at their one turn).
    #[default]
    All,
    /// The agent's own scores only.
    Individual,
}

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
        Self { horizon: Horizon::DiscountedSum, agent_share: AgentShare::All, gamma: 0.3, lookahead: None }
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
    let mean: Vec<f64> = s.iter().map(|row| row.iter().sum::<f64>() / n as f64).collect();
    let pick = |t: usize, i: usize| match rule.agent_share {
        AgentShare::All => mean[t],
        AgentShare::Individual => s[t][i],
    };
    let scores = (0..s.len())
        .map(|t| {
            let x = rule.lookahead.map_or(last, |k| last.min(t.saturating_add(k)));
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

// ---------------------------------------------------------------------------------------------------
// Incentives
// ---------------------------------------------------------------------------------------------------

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
/// Influence, t + 1 played and at least two agents, from the others at t and t + 1 and the agent's
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
                    if n > 1 && t + 1 < correct.len() {
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
    Ok(r.iter().zip(&b).map(|(rr, bb)| rr.iter().zip(bb).map(|(x, y)| x + y).collect()).collect())
}

// ---------------------------------------------------------------------------------------------------
// Invalid outputs
// ---------------------------------------------------------------------------------------------------

/// Why an answer is invalid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InvalidReason {
    /// Fewer response tokens than [`InvalidOutputRule::min_tokens`].
    TooShort,
    /// A phrase or a line repeated more than [`InvalidOutputRule::max_repeats`] times in a row.
    Repetition,
    /// No closed `\boxed{...}` although the turn requires one.
    NoBoxed,
}

impl std::fmt::Display for InvalidReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            InvalidReason::TooShort => "too short",
            InvalidReason::Repetition => "repetition",
            InvalidReason::NoBoxed => "no boxed answer",
        })
    }
}

/// When an answer is invalid, and what it then scores.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct InvalidOutputRule {
    /// Fewer response tokens (end token not counted) is [`InvalidReason::TooShort`]; released 50.
    pub min_tokens: usize,
    /// More consecutive copies of a phrase is [`InvalidReason::Repetition`]; released 3.
    pub max_repeats: usize,
    /// Longest phrase, in words, that the repetition check looks for; released 20 (tokens there).
    pub max_phrase_words: usize,
    /// Whether a closed `\boxed{...}` is required (see [`boxed_required`]).
    pub require_boxed: bool,
    /// The score that replaces an invalid answer's; released −10.
    pub penalty: f64,
}

impl Default for InvalidOutputRule {
    fn default() -> Self {
        Self { min_tokens: 50, max_repeats: 3, max_phrase_words: 20, require_boxed: true, penalty: -10.0 }
    }
}

/// Whether turn `turn` requires a boxed answer: every turn after the first, and the first only when it
/// is trained (the released `task_training`).
pub fn boxed_required(turn: usize, first_turn_trained: bool) -> bool {
    turn >= 1 || first_turn_trained
}

/// Why `text` (a response of `num_tokens` tokens, end token not counted) is invalid, checked in the
/// order TooShort, Repetition, NoBoxed; `None` if it is valid.
///
/// Repetition, precisely: with words = the text split on whitespace, some run of n consecutive words
/// (1 ≤ n ≤ `max_phrase_words`) occurs more than `max_repeats` times back to back, or some non-empty
/// line (trimmed) occurs more than `max_repeats` times on consecutive lines. Only phrases and lines
/// containing a prose word count: a word with at least two letters that is not a LaTeX command
/// (`\times`). That extends the released exemption of digit-only runs to all arithmetic — `1 + 1 + 1 +
/// 1 + 1`, `1, 2, 3, 4`, `2 \times 2 \times 2 \times 2 \times 2`, `x + x + x + x + x` — while loops of
/// words ("the answer is the answer is …") are still caught.
///
/// A box counts when the last `\boxed{` closes (even empty: the released regex accepts `\boxed{}`).
pub fn invalid_reason(text: &str, num_tokens: usize, rule: &InvalidOutputRule) -> Option<InvalidReason> {
    if num_tokens < rule.min_tokens {
        return Some(InvalidReason::TooShort);
    }
    if has_repetition(text, rule.max_repeats, rule.max_phrase_words) {
        return Some(InvalidReason::Repetition);
    }
    if rule.require_boxed && !has_closed_box(text) {
        return Some(InvalidReason::NoBoxed);
    }
    None
}

/// The score to train on: `rule.penalty` in place of `score` when the answer is invalid.
pub fn apply_invalid_penalty(score: f64, reason: Option<InvalidReason>, rule: &InvalidOutputRule) -> f64 {
    if reason.is_some() { rule.penalty } else { score }
}

fn has_closed_box(text: &str) -> bool {
    // `last_boxed` runs an unclosed box to the end of the text; a closed one is followed by its `}`.
    match (text.rfind("\\boxed{"), last_boxed(text)) {
        (Some(at), Some(content)) => at + "\\boxed{".len() + content.len() < text.len(),
        _ => false,
    }
}

fn is_prose(word: &str) -> bool {
    !word.starts_with('\\') && word.chars().filter(|c| c.is_alphabetic()).count() >= 2
}

fn has_repetition(text: &str, max_repeats: usize, max_phrase_words: usize) -> bool {
    let copies = max_repeats.saturating_add(1);
    let words: Vec<&str> = text.split_whitespace().collect();
    // A phrase of n words repeated `copies` times is a stretch of copies·n words with period n, i.e.
    // max_repeats·n consecutive positions k where words[k] == words[k + n]. Every window of n words in
    // that stretch is a rotation of the same phrase, so whether it holds a prose word is the same for all.
    let longest = max_phrase_words.min(words.len() / copies);
    for n in 1..=longest {
        let need = max_repeats * n;
        let mut run = 0;
        for (k, (a, b)) in words.iter().zip(&words[n..]).enumerate() {
            if a == b {
                run += 1;
                if run >= need && words[k + 1 - need..k + 1 - need + n].iter().any(|w| is_prose(w)) {
                    return true;
                }
            } else {
                run = 0;
            }
        }
    }
    let mut run: Option<(&str, usize)> = None;
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let count = match run {
            Some((prev, c)) if prev == line => c + 1,
            _ => 1,
        };
        if count >= copies && line.split_whitespace().any(is_prose) {
            return true;
        }
        run = Some((line, count));
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: &[Vec<f64>], b: &[Vec<f64>]) {
        assert_eq!(a.len(), b.len(), "{a:?} vs {b:?}");
        for (x, y) in a.iter().zip(b) {
            assert_eq!(x.len(), y.len(), "{a:?} vs {b:?}");
            for (p, q) in x.iter().zip(y) {
                assert!((p - q).abs() < 1e-12, "{a:?} vs {b:?}");
            }
        }
    }

    // 3 turns × 2 agents. Means over agents: m(0) = 0.5, m(1) = 0.5, m(2) = 1.
    fn table() -> Vec<Vec<f64>> {
        vec![vec![1.0, 0.0], vec![0.0, 1.0], vec![1.0, 1.0]]
    }

    #[test]
    fn discounted_sum_over_all_agents_matches_hand_computed_values() {
        // Denominators: turn 0: 1 + 0.3 + 0.09 = 1.39; turn 1: 1 + 0.3 = 1.3; turn 2: 1.
        // R(0,0) = (1 + 0.3·0.5 + 0.09·1) / 1.39 = 1.24 / 1.39
        // R(0,1) = (0 + 0.15 + 0.09) / 1.39 = 0.24 / 1.39
        // R(1,0) = (0 + 0.3·1) / 1.3 = 0.3 / 1.3;  R(1,1) = (1 + 0.3) / 1.3 = 1
        // R(2,i) = s(2,i) = 1
        let r = training_scores(&table(), &ScoreRule::default()).unwrap();
        close(&r, &[vec![1.24 / 1.39, 0.24 / 1.39], vec![0.3 / 1.3, 1.0], vec![1.0, 1.0]]);
    }

    #[test]
    fn individual_share_uses_only_the_agents_own_future() {
        // R(0,0) = (1 + 0.3·0 + 0.09·1) / 1.39 = 1.09 / 1.39;  R(0,1) = (0 + 0.3·1 + 0.09·1) / 1.39
        // R(1,0) = (0 + 0.3·1) / 1.3;  R(1,1) = (1 + 0.3·1) / 1.3 = 1
        let rule = ScoreRule { agent_share: AgentShare::Individual, ..ScoreRule::default() };
        let r = training_scores(&table(), &rule).unwrap();
        close(&r, &[vec![1.09 / 1.39, 0.39 / 1.39], vec![0.3 / 1.3, 1.0], vec![1.0, 1.0]]);
    }

    #[test]
    fn lookahead_limits_the_window() {
        // k = 1: turn 0 sees turns 0..=1 only, denominator 1.3.
        // R(0,0) = (1 + 0.3·0.5) / 1.3 = 1.15 / 1.3;  R(0,1) = 0.15 / 1.3; later turns as before.
        let rule = ScoreRule { lookahead: Some(1), ..ScoreRule::default() };
        let r = training_scores(&table(), &rule).unwrap();
        close(&r, &[vec![1.15 / 1.3, 0.15 / 1.3], vec![0.3 / 1.3, 1.0], vec![1.0, 1.0]]);
        // k = 0 is the agent's own score.
        let rule = ScoreRule { lookahead: Some(0), ..ScoreRule::default() };
        close(&training_scores(&table(), &rule).unwrap(), &table());
    }

    #[test]
    fn a_question_that_stopped_early_sums_to_its_last_played_turn() {
        // Two played turns: turn 0's denominator is 1.3. R(0,0) = (1 + 0.3·0.5) / 1.3.
        let r = training_scores(&table()[..2], &ScoreRule::default()).unwrap();
        close(&r, &[vec![1.15 / 1.3, 0.15 / 1.3], vec![0.0, 1.0]]);
    }

    #[test]
    fn current_and_last_horizons() {
        let rule = |horizon, agent_share| ScoreRule { horizon, agent_share, ..ScoreRule::default() };
        let s = table();
        close(&training_scores(&s, &rule(Horizon::Current, AgentShare::Individual)).unwrap(), &s);
        close(
            &training_scores(&s, &rule(Horizon::Current, AgentShare::All)).unwrap(),
            &[vec![0.5, 0.5], vec![0.5, 0.5], vec![1.0, 1.0]],
        );
        let s = vec![vec![1.0, 0.0], vec![0.0, 1.0], vec![0.2, 0.6]];
        close(&training_scores(&s, &rule(Horizon::Last, AgentShare::Individual)).unwrap(), &vec![vec![0.2, 0.6]; 3]);
        close(&training_scores(&s, &rule(Horizon::Last, AgentShare::All)).unwrap(), &vec![vec![0.4, 0.4]; 3]);
    }

    #[test]
    fn malformed_tables_and_gamma_are_errors() {
        let ragged = vec![vec![1.0, 0.0], vec![1.0]];
        assert_eq!(
            training_scores(&ragged, &ScoreRule::default()).unwrap_err(),
            MaporlError::RaggedTable { turn: 1, expected: 2, got: 1 }
        );
        assert_eq!(training_scores(&[vec![]], &ScoreRule::default()).unwrap_err(), MaporlError::NoAgents);
        let rule = ScoreRule { gamma: -0.1, ..ScoreRule::default() };
        assert!(matches!(training_scores(&table(), &rule), Err(MaporlError::InvalidGamma(_))));
        assert!(training_scores(&[], &ScoreRule::default()).unwrap().is_empty());
    }

    #[test]
    fn answer_changes_covers_the_four_transitions() {
        assert_eq!(answer_changes(true, false), Transition::CorrectToWrong);
        assert_eq!(answer_changes(false, true), Transition::WrongToCorrect);
        assert_eq!(answer_changes(true, true), Transition::StayedCorrect);
        assert_eq!(answer_changes(false, false), Transition::StayedWrong);
    }

    fn only(k: usize, signs: InfluenceSigns) -> Incentives {
        let mut alpha = [0.0; 4];
        alpha[k] = 1.0;
        Incentives { alpha, influence_signs: signs }
    }
    const P: InfluenceSigns = InfluenceSigns::Paper;
    const R: InfluenceSigns = InfluenceSigns::ReleasedCode;

    // Tables are correct[turn][agent]; with two agents "the others" is the other agent.
    fn bonus(c: &[&[bool]], inc: Incentives) -> Vec<Vec<f64>> {
        let c: Vec<Vec<bool>> = c.iter().map(|r| r.to_vec()).collect();
        incentive_bonus(&c, &inc).unwrap()
    }

    #[test]
    fn alpha0_rewards_following_right_others_and_penalises_following_wrong_ones() {
        // Agent 0 wrong → right while agent 1 was right: +α0 at turn 1.
        assert_eq!(bonus(&[&[false, true], &[true, true]], only(0, P)), [[0.0, 0.0], [1.0, 0.0]]);
        // Agent 0 right → wrong while agent 1 was wrong: −α0 at turn 1.
        assert_eq!(bonus(&[&[true, false], &[false, false]], only(0, P)), [[0.0, 0.0], [-1.0, 0.0]]);
    }

    #[test]
    fn alpha1_rewards_correcting_against_the_others_and_penalises_leaving_a_shared_right_answer() {
        // Agent 0 wrong → right while agent 1 was wrong: +α1.
        assert_eq!(bonus(&[&[false, false], &[true, false]], only(1, P)), [[0.0, 0.0], [1.0, 0.0]]);
        // Agent 0 right → wrong while agent 1 was right: −α1.
        assert_eq!(bonus(&[&[true, true], &[false, true]], only(1, P)), [[0.0, 0.0], [-1.0, 0.0]]);
        // A single agent: every change is its own.
        assert_eq!(bonus(&[&[false], &[true], &[false]], only(1, P)), [[0.0], [1.0], [-1.0]]);
        assert_eq!(bonus(&[&[false], &[true], &[false]], only(0, P)), [[0.0], [0.0], [0.0]]);
    }

    #[test]
    fn alpha3_rewards_persuading_the_others_and_penalises_misleading_them() {
        // Agent 0 right at turn 0, agent 1 wrong → right: +α3 to agent 0 at turn 0 (paper signs).
        assert_eq!(bonus(&[&[true, false], &[true, true]], only(3, P)), [[1.0, 0.0], [0.0, 0.0]]);
        // Agent 0 wrong at turn 0, agent 1 right → wrong: −α3.
        assert_eq!(bonus(&[&[false, true], &[false, false]], only(3, P)), [[-1.0, 0.0], [0.0, 0.0]]);
        // The released code's signs are the opposite.
        assert_eq!(bonus(&[&[true, false], &[true, true]], only(3, R)), [[-1.0, 0.0], [0.0, 0.0]]);
        assert_eq!(bonus(&[&[false, true], &[false, false]], only(3, R)), [[1.0, 0.0], [0.0, 0.0]]);
    }

    #[test]
    fn alpha2_follows_the_others_change_when_the_agent_was_not_on_its_side() {
        // Agent 0 wrong at turn 0 and stays wrong, agent 1 wrong → right: +α2 (paper), −α2 (released).
        assert_eq!(bonus(&[&[false, false], &[false, true]], only(2, P)), [[1.0, 0.0], [0.0, 0.0]]);
        assert_eq!(bonus(&[&[false, false], &[false, true]], only(2, R)), [[-1.0, 0.0], [0.0, 0.0]]);
        // Agent 0 right, agent 1 right → wrong: −α2 (paper), +α2 (released).
        assert_eq!(bonus(&[&[true, true], &[true, false]], only(2, P)), [[-1.0, 0.0], [0.0, 0.0]]);
        assert_eq!(bonus(&[&[true, true], &[true, false]], only(2, R)), [[1.0, 0.0], [0.0, 0.0]]);
    }

    #[test]
    fn bonuses_add_up_and_vanish_without_weights_or_on_a_tie() {
        // Agent 1 wrong → right after agent 0 was right: +α0 for agent 1 at turn 1, +α3 for agent 0 at 0.
        let inc = Incentives { alpha: [0.5, 0.0, 0.0, 2.0], influence_signs: P };
        assert_eq!(bonus(&[&[true, false], &[true, true]], inc), [[2.0, 0.0], [0.0, 0.5]]);
        assert_eq!(bonus(&[&[true, false], &[true, true]], Incentives::default()), [[0.0, 0.0], [0.0, 0.0]]);
        // Three agents: agent 0 wrong → right while the others were split (one right, one wrong).
        let all = Incentives { alpha: [1.0; 4], influence_signs: P };
        let b = bonus(&[&[false, true, false], &[true, true, false]], all);
        assert_eq!(b[1][0], 0.0);
    }

    #[test]
    fn shaped_scores_add_the_bonus_after_the_discount() {
        let s = vec![vec![1.0, 0.0], vec![1.0, 1.0]];
        let c = vec![vec![true, false], vec![true, true]];
        let inc = Incentives { alpha: [0.5, 0.0, 0.0, 2.0], influence_signs: P };
        // R(0,0) = (1 + 0.3·1) / 1.3 = 1, + α3 = 3; R(0,1) = 0.3 / 1.3; R(1,1) = 1, + α0 = 1.5.
        let r = shaped_training_scores(&s, &c, &ScoreRule::default(), &inc).unwrap();
        close(&r, &[vec![3.0, 0.3 / 1.3], vec![1.0, 1.5]]);
        let err = shaped_training_scores(&s, &c[..1], &ScoreRule::default(), &inc).unwrap_err();
        assert!(matches!(err, MaporlError::ShapeMismatch { .. }));
    }

    const SOLUTION: &str = "Natalia sold 48 clips in April. In May she sold half as many, which is 48 / 2 = 24 \
clips. Altogether she sold 48 + 24 = 72 clips in April and May. Checking: 24 is half of 48, and \
48 + 24 = 72.\nAnswer: \\boxed{72}";

    fn reason(text: &str, tokens: usize) -> Option<InvalidReason> {
        invalid_reason(text, tokens, &InvalidOutputRule::default())
    }

    #[test]
    fn a_normal_gsm8k_solution_is_valid() {
        assert_eq!(reason(SOLUTION, 60), None);
        assert_eq!(reason("The total is 6 * 7 = 42 apples, so the answer is \\boxed{42}.", 50), None);
    }

    #[test]
    fn too_short_is_fewer_than_min_tokens() {
        assert_eq!(reason(SOLUTION, 49), Some(InvalidReason::TooShort));
        assert_eq!(reason(SOLUTION, 50), None);
    }

    #[test]
    fn a_phrase_repeated_more_than_three_times_in_a_row_is_invalid() {
        let four = "so the answer is the answer is the answer is the answer is \\boxed{5}";
        assert_eq!(reason(four, 60), Some(InvalidReason::Repetition));
        let three = "so the answer is the answer is the answer is \\boxed{5}";
        assert_eq!(reason(three, 60), None);
        assert_eq!(reason("wait wait wait wait \\boxed{5}", 60), Some(InvalidReason::Repetition));
        // Four times, but not in a row.
        assert_eq!(reason("wait wait, ok wait wait \\boxed{5}", 60), None);
        // A sentence longer than 20 words repeated on consecutive lines.
        let line = "Let me carefully reconsider every single step of this long problem once more because I am \
not entirely sure the previous reasoning was right";
        assert!(line.split_whitespace().count() > 20);
        let text = format!("{line}\n{line}\n{line}\n{line}\n\\boxed{{5}}");
        assert_eq!(reason(&text, 200), Some(InvalidReason::Repetition));
        let text = format!("{line}\n{line}\n{line}\n\\boxed{{5}}");
        assert_eq!(reason(&text, 200), None);
    }

    #[test]
    fn repeated_arithmetic_is_not_repetition() {
        for text in [
            "Counting: 1, 2, 3, 4, 5, 6, 7, 8. So \\boxed{8}",
            "1 + 1 + 1 + 1 + 1 + 1 = 6, \\boxed{6}",
            "$5 + $5 + $5 + $5 + $5 = $25 \\boxed{25}",
            "2 \\times 2 \\times 2 \\times 2 \\times 2 = 32 \\boxed{32}",
            "x + x + x + x + x = 5x \\boxed{5}",
            "= 5\n= 5\n= 5\n= 5\n\\boxed{5}",
            "0 0 0 0 0 0 \\boxed{0}",
        ] {
            assert_eq!(reason(text, 60), None, "{text}");
        }
    }

    #[test]
    fn no_boxed_answer_where_one_is_required() {
        let plain = SOLUTION.replace("\\boxed{72}", "72");
        assert_eq!(reason(&plain, 60), Some(InvalidReason::NoBoxed));
        assert_eq!(reason(&SOLUTION.replace("\\boxed{72}", "\\boxed{72"), 60), Some(InvalidReason::NoBoxed));
        // An empty box is a box (its answer scores 0 elsewhere).
        assert_eq!(reason(&SOLUTION.replace("\\boxed{72}", "\\boxed{}"), 60), None);
        let lenient = InvalidOutputRule { require_boxed: false, ..InvalidOutputRule::default() };
        assert_eq!(invalid_reason(&plain, 60, &lenient), None);
        assert!(!boxed_required(0, false));
        assert!(boxed_required(0, true));
        assert!(boxed_required(1, false));
    }

    #[test]
    fn the_penalty_replaces_the_score() {
        let rule = InvalidOutputRule::default();
        assert_eq!(apply_invalid_penalty(0.9, Some(InvalidReason::TooShort), &rule), -10.0);
        assert_eq!(apply_invalid_penalty(0.9, None, &rule), 0.9);
    }
}
