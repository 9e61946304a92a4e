//! Next-turn prompt composition for multi-turn MAGRPO: the feedback text (from the reward server's
//! `Analyze`, or the expert's edits) plus, per the `external` flags, the original problem, the
//! agent's previous response or its full history — as one user message.
//!
//! Truncation policy (prompts must fit `model.max_length − max_new_tokens`): the history is dropped
//! oldest first (the previous response is the newest history entry, dropped last); the original
//! problem and the feedback's request are never dropped. [`compose_next_turn`] takes how many entries
//! to leave out so that the caller can count tokens with the agent's tokenizer.

use crate::config::ExternalConfig;

/// One earlier turn of one agent.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TurnRecord {
    /// The user text the agent saw.
    pub prompt: String,
    /// What it answered.
    pub response: String,
}

/// What a next-turn prompt is built from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NextTurn<'a> {
    /// The first-turn user text (problem plus instructions).
    pub original_prompt: &'a str,
    /// The agent's turns so far, oldest first; the last one is the previous turn.
    pub history: &'a [TurnRecord],
    /// The feedback for this agent, ending with the request to revise.
    pub feedback: &'a str,
}

/// How many history entries the prompt holds that truncation may leave out: every earlier turn with
/// `external.history`, else the previous response (when included).
pub fn droppable_entries(next: &NextTurn<'_>, flags: &ExternalConfig) -> usize {
    if flags.history {
        next.history.len()
    } else {
        usize::from(flags.previous_response && !next.history.is_empty())
    }
}

/// The next turn's user text, leaving out the `drop` oldest history entries. The original's default:
/// the previous response and the feedback, without the original problem.
pub fn compose_next_turn(next: &NextTurn<'_>, flags: &ExternalConfig, drop: usize) -> String {
    let mut text = String::new();
    if flags.original_prompt {
        text.push_str(&format!("Original problem and instructions:\n{}\n\n", next.original_prompt.trim_end()));
    }
    if flags.history {
        let kept: Vec<(usize, &TurnRecord)> = next.history.iter().enumerate().skip(drop).collect();
        if !kept.is_empty() {
            text.push_str("Your earlier turns:\n");
            for (i, turn) in kept {
                // The first turn's prompt is the original problem: shown above when asked for.
                if i > 0 {
                    text.push_str(&format!("Turn {} prompt:\n{}\n\n", i + 1, turn.prompt.trim_end()));
                }
                text.push_str(&format!("Turn {} response:\n{}\n\n", i + 1, turn.response.trim_end()));
            }
        }
    } else if flags.previous_response
        && drop == 0
        && let Some(prev) = next.history.last()
    {
        text.push_str(&format!("Your previous response:\n{}\n\n", prev.response.trim_end()));
    }
    text.push_str(next.feedback.trim_end());
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags(original_prompt: bool, previous_response: bool, history: bool) -> ExternalConfig {
        ExternalConfig { original_prompt, previous_response, history, ..ExternalConfig::default() }
    }

    #[test]
    fn default_flags_include_previous_response_but_not_the_problem() {
        let hist = [TurnRecord { prompt: "PROBLEM".into(), response: "def aux(): return 1".into() }];
        let next = NextTurn { original_prompt: "PROBLEM", history: &hist, feedback: "Tests: 0/1 passed\nRevise." };
        let d = compose_next_turn(&next, &ExternalConfig::default(), 0);
        assert_eq!(d, "Your previous response:\ndef aux(): return 1\n\nTests: 0/1 passed\nRevise.");
        let both = compose_next_turn(&next, &flags(true, true, false), 0);
        assert!(both.starts_with("Original problem and instructions:\nPROBLEM\n\nYour previous response:"));
        let neither = compose_next_turn(&next, &flags(false, false, false), 0);
        assert_eq!(neither, "Tests: 0/1 passed\nRevise.");
        assert_eq!(droppable_entries(&next, &ExternalConfig::default()), 1);
        // Truncation drops the previous response, never the problem or the feedback.
        let cut = compose_next_turn(&next, &flags(true, true, false), 1);
        assert!(cut.contains("PROBLEM") && !cut.contains("def aux") && cut.ends_with("Revise."));
    }

    #[test]
    fn history_keeps_every_turn_and_drops_the_oldest_first() {
        let hist = [
            TurnRecord { prompt: "P0".into(), response: "R0".into() },
            TurnRecord { prompt: "P1".into(), response: "R1".into() },
        ];
        let next = NextTurn { original_prompt: "P0", history: &hist, feedback: "F" };
        let f = flags(true, true, true);
        let all = compose_next_turn(&next, &f, 0);
        assert_eq!(
            all,
            "Original problem and instructions:\nP0\n\nYour earlier turns:\nTurn 1 response:\nR0\n\nTurn 2 prompt:\nP1\n\nTurn 2 response:\nR1\n\nF"
        );
        assert_eq!(droppable_entries(&next, &f), 2);
        let one = compose_next_turn(&next, &f, 1);
        assert!(!one.contains("R0") && one.contains("R1") && one.contains("P0"));
        let none = compose_next_turn(&next, &f, 2);
        assert_eq!(none, "Original problem and instructions:\nP0\n\nF");
    }
}
