//! The YAML schema: one serde struct per section, `deny_unknown_fields` everywhere, and the originals'
//! defaults (docs/src/trainers/magrpo.md). Values that fall back to another section (sampling parameters of the
//! trainer section fall back to `model`) stay `Option` here and are resolved in [`crate::config::CheckedConfig`].

mod actor_critic;
mod external;
mod logging;
mod lora;
mod model;
mod rollout;
mod trainer;

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub use actor_critic::{CriticModelConfig, CriticType};
pub use external::*;
pub use logging::*;
pub use lora::LoraSection;
pub use model::*;
pub use rollout::*;
pub use trainer::*;

/// The whole file as written (after overrides and legacy flags are merged in).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    /// The base model(s) and default sampling parameters.
    pub model: ModelConfig,
    /// Which task and which rows to train and evaluate on.
    pub dataset: DatasetConfig,
    /// Which CoMLRL release's semantics the `magrpo`/`grpo` keys carry where the two differ
    /// (`2025-09`: the September 2025 trainer cotrain first followed; `2026`: CoMLRL v1.3–1.4 and
    /// the 2026 configs of its code-generation scripts). Set to `2026` by the loader when the file has
    /// the 2026 layout (a top-level `agent_model`, `agents` list/null, `critic_model` or `critics`);
    /// `2025-09` otherwise. Each behaviour it decides has its own key, which wins when set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comlrl_era: Option<Era>,
    /// Seed of every random draw of the run (sampling, data order, splits); the same seed and config repeat
    /// a run.
    #[serde(default = "default_seed")]
    pub seed: u64,
    /// Where runs are written: checkpoints, final models.
    #[serde(default)]
    pub output: OutputConfig,
    /// How the next turn's prompts are built in multi-turn training.
    #[serde(default)]
    pub external: ExternalConfig,
    /// Multi-agent trainer section (MAGRPO); exactly one of `magrpo` / `grpo` / `maporl` / `iac` /
    /// `maac` must be present.
    #[serde(default)]
    pub magrpo: Option<TrainerSection>,
    /// Single-agent trainer section (GRPO = MAGRPO with one agent).
    #[serde(default)]
    pub grpo: Option<TrainerSection>,
    /// CoMLRL's independent actor-critic (IAC): MAGRPO's rollouts, each agent with its own critic.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iac: Option<TrainerSection>,
    /// CoMLRL's multi-agent actor-critic (MAAC): one centralised critic over every agent's prompt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub maac: Option<TrainerSection>,
    /// `iac`/`maac`: the model the critics start from (default: each agent's own model).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub critic_model: Option<CriticModelConfig>,
    /// `iac`/`maac`: one model per critic (one per agent under `iac`, one under `maac`), instead of
    /// `critic_model`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub critics: Option<Vec<String>>,
    /// MaPoRL's multi-agent PPO with a critic and LoRA adapters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub maporl: Option<crate::config::MaporlSection>,
    /// MaPoRL's learned verifier: data generation and training (`learner verifier`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verifier: Option<crate::config::VerifierSection>,
    /// An affine transform of every reward before advantages are computed.
    #[serde(default)]
    pub reward_processor: RewardProcessorConfig,
    /// The original's Weights & Biases section; accepted for compatibility, cotrain logs to files.
    #[serde(default)]
    pub wandb: Option<WandbConfig>,
    /// cotrain's own run outputs: run name, TensorBoard events, plots, progress bar, rollout log.
    #[serde(default)]
    pub logging: LoggingConfig,
    /// Where generation happens (the embedded worker when nothing is configured) and how weights reach the
    /// workers.
    #[serde(default)]
    pub rollout: RolloutConfig,
    /// The reward server (embedded when `endpoint` is absent) and the options every scoring call carries.
    #[serde(default)]
    pub reward: RewardConfig,
    /// How the learner's ranks work together (`learner launch`, torchrun/Slurm/MPI environments).
    #[serde(default)]
    pub learner: LearnerConfig,
    /// Per-agent prompt templates (`agent0`, `agent1`, ...); the task's defaults for agents not named.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub prompts: BTreeMap<String, PromptConfig>,
}

/// `prompts.agentN`: one agent's first-turn prompt template (minijinja; the variables are listed in
/// `crate::prompts::template`). Exactly one of the two keys.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PromptConfig {
    /// The template text itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    /// A file holding the template, relative to the config file's directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template_file: Option<String>,
}

pub(super) fn default_seed() -> u64 {
    42
}

fn default_true() -> bool {
    true
}

/// `comlrl_era`: which release's meaning the trainer keys carry where CoMLRL changed it.
///
/// Read from `"2025-09"` or `"2026"`, and from a bare `2026` (what `--override comlrl_era=2026` and
/// an unquoted YAML value give).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, JsonSchema)]
pub enum Era {
    /// The September 2025 trainer (MAGRPO's release with the handoff rollout).
    #[default]
    #[serde(rename = "2025-09")]
    September2025,
    /// CoMLRL v1.3–1.4 (2026): tree rollout with early termination, `train_batch_size` in nodes,
    /// re-centred advantage normalisation, full-history next-turn prompts.
    #[serde(rename = "2026")]
    Comlrl2026,
}

/// How a config may spell [`Era`].
#[derive(Deserialize)]
#[serde(untagged)]
enum EraText {
    Text(String),
    Year(u64),
}

impl<'de> Deserialize<'de> for Era {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Era::try_from(EraText::deserialize(d)?).map_err(serde::de::Error::custom)
    }
}

impl TryFrom<EraText> for Era {
    type Error = String;
    fn try_from(v: EraText) -> Result<Self, String> {
        match v {
            EraText::Text(t) if t == "2025-09" => Ok(Era::September2025),
            EraText::Text(t) if t == "2026" => Ok(Era::Comlrl2026),
            EraText::Year(2026) => Ok(Era::Comlrl2026),
            EraText::Text(t) => Err(format!(
                "unknown era `{t}`: expected \"2025-09\" or \"2026\""
            )),
            EraText::Year(y) => Err(format!(
                "unknown era `{y}`: expected \"2025-09\" or \"2026\""
            )),
        }
    }
}

impl RawConfig {
    /// The era the config's keys mean ([`Era`]; `2025-09` unless set or detected).
    pub fn era(&self) -> Era {
        self.comlrl_era.unwrap_or_default()
    }
}
