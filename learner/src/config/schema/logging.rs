//! `wandb` (accepted for compatibility) and `logging`: cotrain's own run outputs.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::default_true;

/// The original's `wandb` keys; kept so its configs load. Nothing is sent anywhere.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WandbConfig {
    /// Accepted for compatibility; nothing is sent.
    #[serde(default)]
    pub enabled: Option<bool>,
    /// Accepted for compatibility; nothing is sent.
    #[serde(default)]
    pub project: Option<String>,
    /// Accepted for compatibility; nothing is sent.
    #[serde(default)]
    pub entity: Option<String>,
    /// Accepted for compatibility; nothing is sent.
    #[serde(default)]
    pub name: Option<String>,
    /// Accepted for compatibility; nothing is sent.
    #[serde(default)]
    pub dir: Option<String>,
    /// Accepted for compatibility; nothing is sent.
    #[serde(default)]
    pub tags: Vec<String>,
    /// Accepted for compatibility; nothing is sent.
    #[serde(default)]
    pub mode: Option<String>,
}

/// `logging`: cotrain's own run outputs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LoggingConfig {
    /// Run name; a timestamped name when absent.
    #[serde(default)]
    pub run_name: Option<String>,
    /// Write TensorBoard event files into the run directory.
    #[serde(default = "default_true")]
    pub tensorboard: bool,
    /// Draw `RUN_DIR/plots/*.png` at the end of the run.
    #[serde(default = "default_true")]
    pub plots: bool,
    /// Progress bar: `auto` (when stderr is a terminal), `always`, `never`.
    #[serde(default)]
    pub progress: ProgressMode,
    /// Write `RUN_DIR/rollouts.jsonl`: one line per node (prompts, completions, rewards, returns,
    /// advantages) of every step.
    #[serde(default)]
    pub rollouts: bool,
}

impl Default for LoggingConfig {
    fn default() -> Self {
        Self {
            run_name: None,
            tensorboard: true,
            plots: true,
            progress: ProgressMode::Auto,
            rollouts: false,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ProgressMode {
    #[default]
    Auto,
    Always,
    Never,
}
