//! LoRA adapters' shape in configs (PEFT's `LoraConfig` keys), shared by the GRPO/MAGRPO trainer
//! (`model.lora`), MaPoRL (`maporl.lora`) and the learned verifier (`verifier.lora`).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A LoRA adapter's shape, with PEFT's `LoraConfig` names: `model.lora`, `model.agents[i].lora`,
/// `maporl.lora` and `verifier.lora`. The defaults (r 8, alpha 16, dropout 0.05, every attention
/// and MLP projection) are MaPoRL's; PEFT's own are alpha 8, dropout 0 and q/v only.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LoraSection {
    /// Rank of each adapter.
    #[serde(default = "default_lora_r")]
    pub r: usize,
    /// Scaling α: the adapter's product is multiplied by α / r.
    #[serde(default = "default_lora_alpha")]
    pub lora_alpha: f64,
    /// Dropout on the adapter's input while training.
    #[serde(default = "default_lora_dropout")]
    pub lora_dropout: f64,
    /// The projections adapted, by their module names.
    #[serde(default = "default_target_modules")]
    pub target_modules: Vec<String>,
}

impl Default for LoraSection {
    fn default() -> Self {
        Self {
            r: default_lora_r(),
            lora_alpha: default_lora_alpha(),
            lora_dropout: default_lora_dropout(),
            target_modules: default_target_modules(),
        }
    }
}

impl LoraSection {
    pub fn to_model(&self) -> cotrain_model::lora::LoraConfig {
        cotrain_model::lora::LoraConfig {
            r: self.r,
            alpha: self.lora_alpha,
            dropout: self.lora_dropout,
            target_modules: self.target_modules.clone(),
        }
    }
}

fn default_lora_r() -> usize {
    8
}
fn default_lora_alpha() -> f64 {
    16.0
}
fn default_lora_dropout() -> f64 {
    0.05
}
fn default_target_modules() -> Vec<String> {
    [
        "up_proj",
        "down_proj",
        "gate_proj",
        "k_proj",
        "q_proj",
        "v_proj",
        "o_proj",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}
