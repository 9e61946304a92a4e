//! What CoMLRL's actor-critic trainers (`iac`, `maac`) add to the trainer section's keys: the
//! critic's kind and the top-level `critic_model` section of their configs.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// `critic_type`: what the critic estimates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
pub enum CriticType {
    /// V(h): the value of the prompt (IAC: the agent's own prompt; MAAC: every agent's), read at
    /// its last token.
    #[default]
    #[serde(rename = "v", alias = "V")]
    V,
    /// Q(h, a): the value of the prompt with the completion (MAAC: the joint action), read at the
    /// last token.
    #[serde(rename = "q", alias = "Q")]
    Q,
}

/// `critic_model`: the model every critic starts from (one copy per agent under `iac`, one shared
/// copy under `maac`); `critics` lists one per critic instead.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CriticModelConfig {
    /// A model name or directory, as `model.name`.
    pub name: String,
}
