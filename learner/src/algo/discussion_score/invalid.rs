//! Invalid outputs (too short, repeated phrases, no box) and the penalty that replaces their score.

use cotrain_reward_server::rewards::gsm8k::last_boxed;
use serde::{Deserialize, Serialize};

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
        Self {
            min_tokens: 50,
            max_repeats: 3,
            max_phrase_words: 20,
            require_boxed: true,
            penalty: -10.0,
        }
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
pub fn invalid_reason(
    text: &str,
    num_tokens: usize,
    rule: &InvalidOutputRule,
) -> Option<InvalidReason> {
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
pub fn apply_invalid_penalty(
    score: f64,
    reason: Option<InvalidReason>,
    rule: &InvalidOutputRule,
) -> f64 {
    if reason.is_some() {
        rule.penalty
    } else {
        score
    }
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
                if run >= need
                    && words[k + 1 - need..k + 1 - need + n]
                        .iter()
                        .any(|w| is_prose(w))
                {
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
