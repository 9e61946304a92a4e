//! Prompts: each agent's first-turn prompt is a template ([`template`]) rendered from the dataset
//! row; the model's chat template is applied afterwards only when the config asks for it
//! (`model.chat_template`). Also the multi-turn and discussion composition helpers, which take the
//! feedback text as an input so they stay pure.

mod code;
pub mod comlrl;
mod discussion;
pub mod items;
pub mod multiturn;
pub mod template;
mod turns;

use serde::{Deserialize, Serialize};

pub use code::signature_params;
pub use discussion::{Followup, Shown, reading_band, verifier_reading};
pub use multiturn::{
    AgentTurn, NextTurn, NextTurnError, NextTurnPrompter, NextTurnText, TurnRecord,
    compose_next_turn, droppable_entries,
};
pub use template::{Prompter, TemplateError, default_template_name};

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn user(content: impl Into<String>) -> Self {
        Self {
            role: "user".into(),
            content: content.into(),
        }
    }
    pub fn assistant(content: impl Into<String>) -> Self {
        Self {
            role: "assistant".into(),
            content: content.into(),
        }
    }
    pub fn system(content: impl Into<String>) -> Self {
        Self {
            role: "system".into(),
            content: content.into(),
        }
    }
}
