//! `external`: how the next turn's prompts are built in multi-turn training, and the code sandbox's slice.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{Era, default_true};

/// `external`: how the next turn's prompts are built in multi-turn training (rewards.md).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExternalConfig {
    /// How the next turn's prompt is made from the handed-on joint action: from the reward server's
    /// sandboxed analysis (`level_feedback`, `level_passed`, `passed`, `plain`) or by an OpenAI-compatible
    /// expert model (`expert_edits`).
    #[serde(default)]
    pub mode: ExternalMode,
    /// Tests shown in feedback: n > 0 the first n, n < 0 the last |n|, 0 / null / "all" all of them.
    #[serde(default = "default_sandbox_slice")]
    pub sandbox_slice: Option<SandboxSlice>,
    /// Include the first-turn problem and instructions in later turns.
    #[serde(default)]
    pub original_prompt: bool,
    /// Include the agent's previous answer in later turns.
    #[serde(default = "default_true")]
    pub previous_response: bool,
    /// Include the agent's full history of prompts and responses.
    #[serde(default)]
    pub history: bool,
    /// The wording of later turns' prompts: `cotrain` (the three flags above around the reward
    /// server's feedback), `comlrl_2026` (the original's full history, then its "Static and
    /// execution diagnostics"), `comlrl_2025_09` (the September 2025 original: problem block,
    /// previous function, diagnostics; honours `original_prompt` and `previous_response`). Default:
    /// the original's of `comlrl_era` for code tasks with `mode: level_feedback`, else `cotrain`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_turn_prompt: Option<NextTurnPrompt>,
    /// With a `comlrl_*` wording: give the model the next-turn text as it is (true), or wrap it in
    /// the agent's first-turn template with the text in place of the problem, as the original's
    /// formatters did (false, the default). The original's `external_prompt_passthrough`.
    #[serde(
        default,
        alias = "external_prompt_passthrough",
        skip_serializing_if = "Option::is_none"
    )]
    pub prompt_passthrough: Option<bool>,
    /// Model for `expert_edits` (OpenAI-compatible chat API).
    #[serde(default)]
    pub expert_model: Option<String>,
    /// Base URL of the OpenAI-compatible endpoint for `expert_edits` (`http://host:port/v1`).
    #[serde(default)]
    pub expert_base_url: Option<String>,
    /// The environment variable holding the expert endpoint's API key (unset variable: no key sent).
    #[serde(default = "default_expert_api_key_env")]
    pub expert_api_key_env: String,
    /// Seconds one expert request may take.
    #[serde(default = "default_expert_timeout_secs")]
    pub expert_timeout_secs: u64,
    /// Tokens the expert may write (2048, the original's `max_tokens` in both eras).
    #[serde(default = "default_expert_max_tokens")]
    pub expert_max_tokens: u32,
}

pub(super) fn default_expert_api_key_env() -> String {
    "OPENAI_API_KEY".to_string()
}
pub(super) fn default_expert_timeout_secs() -> u64 {
    120
}
pub(super) fn default_expert_max_tokens() -> u32 {
    2048
}

impl Default for ExternalConfig {
    fn default() -> Self {
        Self {
            mode: ExternalMode::default(),
            sandbox_slice: default_sandbox_slice(),
            original_prompt: false,
            previous_response: true,
            history: false,
            next_turn_prompt: None,
            prompt_passthrough: None,
            expert_model: None,
            expert_base_url: None,
            expert_api_key_env: default_expert_api_key_env(),
            expert_timeout_secs: default_expert_timeout_secs(),
            expert_max_tokens: default_expert_max_tokens(),
        }
    }
}

pub(super) fn default_sandbox_slice() -> Option<SandboxSlice> {
    Some(SandboxSlice::Count(1))
}

impl ExternalConfig {
    /// The indices of the tests shown in feedback out of `total` (`null` = all).
    pub fn feedback_tests(&self, total: usize) -> std::ops::Range<usize> {
        self.sandbox_slice.map_or(0..total, |s| s.select(total))
    }

    /// `next_turn_prompt` as set, else the original's wording of `era` where the original has one (a
    /// code task in `level_feedback` mode), else cotrain's.
    pub fn resolved_next_turn_prompt(&self, era: Era, code_task: bool) -> NextTurnPrompt {
        self.next_turn_prompt.unwrap_or(match era {
            _ if !code_task || self.mode != ExternalMode::LevelFeedback => NextTurnPrompt::Cotrain,
            Era::September2025 => NextTurnPrompt::ComlrlSeptember2025,
            Era::Comlrl2026 => NextTurnPrompt::Comlrl2026,
        })
    }

    /// `prompt_passthrough` as set; false (the original's formatters wrap the text) by default.
    pub fn resolved_prompt_passthrough(&self) -> bool {
        self.prompt_passthrough.unwrap_or(false)
    }
}

/// `external.next_turn_prompt`: whose wording later turns' prompts use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum NextTurnPrompt {
    /// cotrain's composer: `original_prompt`, `previous_response`, `history` around the feedback.
    #[serde(rename = "cotrain")]
    Cotrain,
    /// CoMLRL 2026 (LLM_Collab_Code_Generation e5b008e `level_feedback`): every earlier prompt and
    /// response of the agent, then the diagnostics.
    #[serde(rename = "comlrl_2026")]
    Comlrl2026,
    /// September 2025 (9a8608d `level_feedback`): the original problem block, the previous function
    /// as extracted, then the diagnostics.
    #[serde(rename = "comlrl_2025_09")]
    ComlrlSeptember2025,
}

/// Feedback mode of the external transition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ExternalMode {
    #[default]
    LevelFeedback,
    LevelPassed,
    Passed,
    Plain,
    ExpertEdits,
}

/// `external.sandbox_slice`: a test count (negative = from the end) or all tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum SandboxSlice {
    Count(i64),
    Keyword(AllKeyword),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum AllKeyword {
    All,
}

impl SandboxSlice {
    /// The indices of the tests to show out of `total`: n > 0 the first n, n < 0 the last |n|, 0 all.
    pub fn select(self, total: usize) -> std::ops::Range<usize> {
        match self {
            SandboxSlice::Count(n) if n > 0 => 0..(n as usize).min(total),
            SandboxSlice::Count(n) if n < 0 => {
                total.saturating_sub(n.unsigned_abs() as usize)..total
            }
            _ => 0..total,
        }
    }
}
