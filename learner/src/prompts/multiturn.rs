//! Next-turn prompt composition for multi-turn MAGRPO: the feedback text (from the reward server's
//! `Analyze`, or the expert's edits) plus, per the `external` flags, the original problem, the
//! agent's previous response or its full history — as one user message.
//!
//! Truncation policy (prompts must fit `model.max_length − max_new_tokens`): the history is dropped
//! oldest first (the previous response is the newest history entry, dropped last); the original
//! problem and the feedback's request are never dropped. [`compose_next_turn`] takes how many entries
//! to leave out so that the caller can count tokens with the agent's tokenizer.
//!
//! That is cotrain's wording (`external.next_turn_prompt: cotrain`). [`NextTurnPrompter`] picks
//! between it and the original's wordings of either era ([`super::comlrl`]), and wraps the
//! original's text in the agent's first-turn template unless `external.prompt_passthrough`.

use super::comlrl::{LevelReport, level_feedback_2025_09, level_feedback_2026};
use super::template::{Prompter, TemplateError};
use crate::config::{CheckedConfig, ExternalConfig, ExternalMode, NextTurnPrompt};
use crate::data::TaskItem;

pub use super::turns::TurnRecord;

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
        text.push_str(&format!(
            "Original problem and instructions:\n{}\n\n",
            next.original_prompt.trim_end()
        ));
    }
    if flags.history {
        let kept: Vec<(usize, &TurnRecord)> = next.history.iter().enumerate().skip(drop).collect();
        if !kept.is_empty() {
            text.push_str("Your earlier turns:\n");
            for (i, turn) in kept {
                // The first turn's prompt is the original problem: shown above when asked for.
                if i > 0 {
                    text.push_str(&format!(
                        "Turn {} prompt:\n{}\n\n",
                        i + 1,
                        turn.prompt.trim_end()
                    ));
                }
                text.push_str(&format!(
                    "Turn {} response:\n{}\n\n",
                    i + 1,
                    turn.response.trim_end()
                ));
            }
        }
    } else if flags.previous_response
        && drop == 0
        && let Some(prev) = next.history.last()
    {
        text.push_str(&format!(
            "Your previous response:\n{}\n\n",
            prev.response.trim_end()
        ));
    }
    text.push_str(next.feedback.trim_end());
    text
}

/// Why a later turn's prompt cannot be written.
#[derive(Debug, thiserror::Error)]
pub enum NextTurnError {
    /// The config asks for a wording its task or mode cannot have.
    #[error("{0}")]
    Config(String),
    /// A `comlrl_*` wording prints the reward server's code diagnostics, and there were none.
    #[error(
        "external.next_turn_prompt {0}: the reward source gave no code diagnostics (the reward server's analysis of a code joint action); set external.next_turn_prompt: cotrain"
    )]
    NoDiagnostics(&'static str),
    /// Wrapping the text in the agent's first-turn template failed.
    #[error(transparent)]
    Template(#[from] TemplateError),
    /// The row is not a code problem in the HumanEval schema.
    #[error("row {row}: not a code problem: {message}")]
    Item { row: usize, message: String },
}

/// One agent's later turn: [`NextTurn`] and what the original's wordings also read.
#[derive(Debug, Clone)]
pub struct AgentTurn<'a> {
    pub next: NextTurn<'a>,
    pub agent: usize,
    /// The dataset row as JSON (as the reward server gets it).
    pub item: &'a serde_json::Value,
    /// The row's index in its split (for messages).
    pub row: usize,
    /// The original's report of the joint action handed on (`comlrl_*` wordings).
    pub report: Option<&'a LevelReport>,
}

/// A composed later-turn prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NextTurnText {
    /// What the agent's history keeps: the original records its text unwrapped.
    pub recorded: String,
    /// What the model reads, before any chat template.
    pub user_text: String,
}

/// How later turns' prompts are written: the resolved `external.next_turn_prompt` and
/// `external.prompt_passthrough`, with the first-turn templates the original's text is wrapped in.
#[derive(Debug)]
pub struct NextTurnPrompter {
    format: NextTurnPrompt,
    passthrough: bool,
    flags: ExternalConfig,
    templates: Prompter,
    num_agents: usize,
}

impl NextTurnPrompter {
    /// The wording `cfg` resolves to (its era's default for code tasks in `level_feedback` mode).
    pub fn from_config(cfg: &CheckedConfig, code_task: bool) -> Result<Self, NextTurnError> {
        let ext = &cfg.raw.external;
        let format = ext.resolved_next_turn_prompt(cfg.raw.era(), code_task);
        if format != NextTurnPrompt::Cotrain {
            let name = format_name(format);
            if ext.mode != ExternalMode::LevelFeedback {
                return Err(NextTurnError::Config(format!(
                    "external.next_turn_prompt: {name} is the original's level_feedback text; with external.mode {:?} use next_turn_prompt: cotrain",
                    ext.mode
                )));
            }
            if !code_task {
                return Err(NextTurnError::Config(format!(
                    "external.next_turn_prompt: {name} is written for code tasks; use next_turn_prompt: cotrain"
                )));
            }
            if cfg.num_agents > 2 {
                return Err(NextTurnError::Config(format!(
                    "external.next_turn_prompt: {name} is written for 1 or 2 agents, not {}",
                    cfg.num_agents
                )));
            }
        }
        Ok(Self {
            format,
            passthrough: ext.resolved_prompt_passthrough(),
            flags: ext.clone(),
            templates: Prompter::from_config(cfg)?,
            num_agents: cfg.num_agents,
        })
    }

    /// The resolved `external.next_turn_prompt`.
    pub fn format(&self) -> NextTurnPrompt {
        self.format
    }

    /// How many history entries [`Self::compose`] may leave out to fit the context: cotrain's
    /// rule; the oldest turns of the 2026 history; none of the September text.
    pub fn droppable(&self, turn: &AgentTurn<'_>) -> usize {
        match self.format {
            NextTurnPrompt::Cotrain => droppable_entries(&turn.next, &self.flags),
            NextTurnPrompt::Comlrl2026 => turn.next.history.len(),
            NextTurnPrompt::ComlrlSeptember2025 => 0,
        }
    }

    /// The agent's next prompt, leaving out the `drop` oldest history entries.
    pub fn compose(
        &self,
        turn: &AgentTurn<'_>,
        drop: usize,
    ) -> Result<NextTurnText, NextTurnError> {
        if self.format == NextTurnPrompt::Cotrain {
            let text = compose_next_turn(&turn.next, &self.flags, drop);
            return Ok(NextTurnText {
                recorded: text.clone(),
                user_text: text,
            });
        }
        let report = turn
            .report
            .ok_or(NextTurnError::NoDiagnostics(format_name(self.format)))?;
        let field = |key: &str| {
            turn.item
                .get(key)
                .and_then(|v| v.as_str())
                .unwrap_or_default()
        };
        let (problem, entry_point) = (field("prompt"), field("entry_point"));
        let text = match self.format {
            NextTurnPrompt::Comlrl2026 => level_feedback_2026(
                report,
                turn.agent,
                self.num_agents,
                entry_point,
                turn.next.history,
                drop,
            ),
            _ => level_feedback_2025_09(
                report,
                turn.agent,
                self.num_agents,
                problem,
                entry_point,
                self.flags.original_prompt,
                self.flags.previous_response,
            ),
        };
        let user_text = if self.passthrough {
            text.clone()
        } else {
            let item: TaskItem =
                serde_json::from_value(turn.item.clone()).map_err(|e| NextTurnError::Item {
                    row: turn.row,
                    message: e.to_string(),
                })?;
            self.templates
                .render_next_turn(&item, turn.row, turn.agent, &text)?
        };
        Ok(NextTurnText {
            recorded: text,
            user_text,
        })
    }
}

/// The config spelling of a wording.
pub fn format_name(format: NextTurnPrompt) -> &'static str {
    match format {
        NextTurnPrompt::Cotrain => "cotrain",
        NextTurnPrompt::Comlrl2026 => "comlrl_2026",
        NextTurnPrompt::ComlrlSeptember2025 => "comlrl_2025_09",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags(original_prompt: bool, previous_response: bool, history: bool) -> ExternalConfig {
        ExternalConfig {
            original_prompt,
            previous_response,
            history,
            ..ExternalConfig::default()
        }
    }

    #[test]
    fn default_flags_include_previous_response_but_not_the_problem() {
        let hist = [TurnRecord {
            prompt: "PROBLEM".into(),
            response: "def aux(): return 1".into(),
        }];
        let next = NextTurn {
            original_prompt: "PROBLEM",
            history: &hist,
            feedback: "Tests: 0/1 passed\nRevise.",
        };
        let d = compose_next_turn(&next, &ExternalConfig::default(), 0);
        assert_eq!(
            d,
            "Your previous response:\ndef aux(): return 1\n\nTests: 0/1 passed\nRevise."
        );
        let both = compose_next_turn(&next, &flags(true, true, false), 0);
        assert!(
            both.starts_with(
                "Original problem and instructions:\nPROBLEM\n\nYour previous response:"
            )
        );
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
            TurnRecord {
                prompt: "P0".into(),
                response: "R0".into(),
            },
            TurnRecord {
                prompt: "P1".into(),
                response: "R1".into(),
            },
        ];
        let next = NextTurn {
            original_prompt: "P0",
            history: &hist,
            feedback: "F",
        };
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
