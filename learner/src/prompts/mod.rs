//! Per-task, per-agent prompt formatters (rewards.md): each returns chat messages; the model's chat
//! template is applied later by the rollout side. Also the multi-turn composition helpers, which take
//! the feedback text as an input so they stay pure.

mod code;
mod discussion;
mod multiturn;
mod writing;

use serde::{Deserialize, Serialize};

pub use code::{CodeRole, code_prompt, signature_params};
pub use discussion::{discussion_followup, discussion_first_turn, verifier_reading};
pub use multiturn::{NextTurn, TurnRecord, compose_next_turn};
pub use writing::{PARAGRAPH_SPLIT, WritingRole, arxiv_prompt, tldr_prompt};

use crate::data::TaskItem;

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn user(content: impl Into<String>) -> Self {
        Self { role: "user".into(), content: content.into() }
    }
    pub fn assistant(content: impl Into<String>) -> Self {
        Self { role: "assistant".into(), content: content.into() }
    }
    pub fn system(content: impl Into<String>) -> Self {
        Self { role: "system".into(), content: content.into() }
    }
}

/// Why a prompt cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PromptError {
    /// The task has no prompt for this many agents.
    #[error("task `{task}` has prompts for {supported} agents, not {num_agents}")]
    AgentCount { task: &'static str, num_agents: usize, supported: &'static str },
    /// The agent index is out of range.
    #[error("agent {agent} out of range for {num_agents} agents")]
    AgentIndex { agent: usize, num_agents: usize },
}

/// The first-turn prompt of `agent` (0-based) out of `num_agents` for `item`.
pub fn first_turn_prompt(item: &TaskItem, agent: usize, num_agents: usize) -> Result<Vec<ChatMessage>, PromptError> {
    if agent >= num_agents {
        return Err(PromptError::AgentIndex { agent, num_agents });
    }
    Ok(match item {
        TaskItem::Code(c) => {
            let role = match (num_agents, agent) {
                (1, _) => CodeRole::Single,
                (2, 0) => CodeRole::Helper,
                (2, _) => CodeRole::Main,
                _ => return Err(PromptError::AgentCount { task: "code", num_agents, supported: "1 or 2" }),
            };
            code_prompt(c, role)
        }
        TaskItem::Arxiv(a) => arxiv_prompt(a, writing_role("arxiv", agent, num_agents)?),
        TaskItem::Tldr(t) => tldr_prompt(t, writing_role("tldr", agent, num_agents)?),
        TaskItem::Gsm8k(_) | TaskItem::Anli(_) => discussion_first_turn(item),
    })
}

fn writing_role(task: &'static str, agent: usize, num_agents: usize) -> Result<WritingRole, PromptError> {
    match (num_agents, agent) {
        (1, _) => Ok(WritingRole::Single),
        (2, 0) => Ok(WritingRole::First),
        (2, _) => Ok(WritingRole::Second),
        _ => Err(PromptError::AgentCount { task, num_agents, supported: "1 or 2" }),
    }
}
