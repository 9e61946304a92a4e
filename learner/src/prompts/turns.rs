//! The record of an agent's earlier turns, which next-turn prompts (`multiturn`) and CoMLRL's
//! feedback texts (`comlrl`) both read.

/// One earlier turn of one agent.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TurnRecord {
    /// The user text the agent saw.
    pub prompt: String,
    /// What it answered.
    pub response: String,
}
