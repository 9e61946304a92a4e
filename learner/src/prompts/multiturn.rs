//! Next-turn prompt composition for multi-turn MAGRPO: the feedback text (from the reward server's
//! `Analyze` and the `external.mode`) plus, per the `external` flags, the original problem, the agent's
//! previous response and its full history.

use super::ChatMessage;
use crate::config::ExternalConfig;

/// One earlier turn of one agent.
#[derive(Debug, Clone, PartialEq, Eq)]
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
    /// The feedback for this agent.
    pub feedback: &'a str,
}

/// Builds the next turn's messages. With `external.history` the earlier turns are replayed as chat
/// messages; otherwise one user message holds the parts selected by `original_prompt` and
/// `previous_response` (the original's default: previous response, no original prompt).
pub fn compose_next_turn(next: &NextTurn<'_>, flags: &ExternalConfig) -> Vec<ChatMessage> {
    let revise = "Revise your function based on the feedback above. Output ONLY the function code.";
    if flags.history {
        let mut messages = Vec::new();
        for (i, turn) in next.history.iter().enumerate() {
            // The first turn's prompt is the original problem; keep it only when asked to.
            if i > 0 || flags.original_prompt {
                messages.push(ChatMessage::user(turn.prompt.clone()));
            }
            messages.push(ChatMessage::assistant(turn.response.clone()));
        }
        if messages.first().is_some_and(|m| m.role == "assistant") {
            messages.insert(0, ChatMessage::user("Your earlier attempt:"));
        }
        messages.push(ChatMessage::user(format!("Feedback:\n{}\n\n{revise}", next.feedback.trim_end())));
        return messages;
    }
    let mut text = String::new();
    if flags.original_prompt {
        text.push_str(&format!("Original problem and instructions:\n{}\n\n", next.original_prompt.trim_end()));
    }
    if flags.previous_response
        && let Some(prev) = next.history.last()
    {
        text.push_str(&format!("Your previous response:\n{}\n\n", prev.response.trim_end()));
    }
    text.push_str(&format!("Feedback:\n{}\n\n{revise}", next.feedback.trim_end()));
    vec![ChatMessage::user(text)]
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
        let next = NextTurn { original_prompt: "PROBLEM", history: &hist, feedback: "Tests: 0/1 passed" };
        let d = compose_next_turn(&next, &ExternalConfig::default());
        assert_eq!(d.len(), 1);
        assert!(d[0].content.contains("def aux(): return 1") && d[0].content.contains("Tests: 0/1 passed"));
        assert!(!d[0].content.contains("PROBLEM"));
        let both = compose_next_turn(&next, &flags(true, true, false));
        assert!(both[0].content.starts_with("Original problem and instructions:\nPROBLEM"));
        let neither = compose_next_turn(&next, &flags(false, false, false));
        assert!(!neither[0].content.contains("def aux") && !neither[0].content.contains("PROBLEM"));
    }

    #[test]
    fn history_flag_replays_turns_as_messages() {
        let hist = [
            TurnRecord { prompt: "P0".into(), response: "R0".into() },
            TurnRecord { prompt: "P1".into(), response: "R1".into() },
        ];
        let next = NextTurn { original_prompt: "P0", history: &hist, feedback: "F" };
        let m = compose_next_turn(&next, &flags(true, true, true));
        let roles: Vec<&str> = m.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["user", "assistant", "user", "assistant", "user"]);
        assert_eq!(m[0].content, "P0");
        assert!(m[4].content.starts_with("Feedback:\nF"));
    }
}
