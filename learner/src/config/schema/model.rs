//! `model`, `dataset` and `output`: what is trained on what, and where the run is written.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{Precision, default_true};
// The `dataset` section lives with the loader that reads it, so that `data` does not import `config`.
pub use crate::data::DatasetConfig;

/// `model`: the base model(s) and default sampling parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// HF repo id (from the local HF cache), a local directory, a `.gguf` file, or `default`
    /// (the embedded SmolLM2-135M-Instruct).
    pub name: String,
    /// The original's model family tag (`qwen`, `llama`, ...); informational.
    #[serde(default, rename = "type")]
    pub kind: Option<String>,
    /// Parameter dtype of the trained policies: `auto` is bf16 on a GPU and f32 on the CPU.
    #[serde(default)]
    pub dtype: Dtype,
    /// Where the learner's policies live: `auto` (this rank's GPU when one is usable, else the
    /// CPU, logged), `cpu`, `cuda` (`cuda:(local rank)` under a launcher; `cuda:0` when the
    /// launcher leaves each rank one visible GPU) or `cuda:N`. A CUDA device that cannot be used is
    /// an error that says why, never a silent CPU run. The embedded rollout worker uses it too.
    #[serde(default)]
    #[schemars(with = "String")]
    pub device: cotrain_model::cuda::DeviceRequest,
    /// The dtype of the trained policies' matrix products: `auto` (`dtype`'s own), `f32`, or
    /// `bf16` (mixed precision: f32 parameters as master weights, f32 AdamW state, bf16 products;
    /// the log-probs are computed from them, so training's precision is what the loss sees).
    #[serde(default)]
    pub matmul_dtype: Precision,
    /// Sampling temperature; the trainer section's `temperature` overrides it.
    #[serde(default = "default_model_temperature")]
    pub temperature: f64,
    /// Nucleus-sampling threshold; the trainer section's `top_p` overrides it.
    #[serde(default = "default_model_top_p")]
    pub top_p: f64,
    /// Top-k sampling; the trainer section's `top_k` overrides it, and 50 (the original's generation
    /// default) applies when neither is set.
    #[serde(default)]
    pub top_k: Option<u32>,
    /// Maximum prompt + completion length in tokens.
    #[serde(default = "default_max_length")]
    pub max_length: usize,
    /// One entry per agent: a model name (agents on different base models), or a mapping of that
    /// agent's own settings (`model.agents[i]`); every setting left out is the shared one.
    #[serde(default)]
    pub agents: Option<Vec<AgentSettings>>,
    /// Train LoRA adapters on the frozen base instead of every weight (GRPO/MAGRPO): the agents
    /// on one base model share one copy of it in the learner, each with its own adapter (one for
    /// `shared_parameters`); AdamW holds state for the adapters only; the KL reference is the base
    /// itself; weight pushes and checkpoints carry the adapters only. Unset: full fine-tuning.
    /// `model.agents[i].lora` replaces it for one agent. (MaPoRL reads `maporl.lora`.)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<super::LoraSection>,
    /// Render prompts with the model's chat template. The original tokenises the raw prompt text
    /// (`false`, the default); `true` wraps each prompt as one user message of the chat template.
    #[serde(default)]
    pub chat_template: bool,
    /// Qwen3 chat templates: `false` asks for no thinking block (the writing seeds use no thinking).
    #[serde(default)]
    pub enable_thinking: Option<bool>,
    /// The original's `tokenizer_kwargs` (e.g. `trust_remote_code`); accepted, not needed in Rust.
    #[serde(default)]
    #[schemars(with = "BTreeMap<String, serde_json::Value>")]
    pub tokenizer_kwargs: BTreeMap<String, serde_yaml_ng::Value>,
    /// The original's `model_kwargs` (e.g. `torch_dtype`); accepted, `dtype` is what cotrain reads.
    #[serde(default)]
    #[schemars(with = "BTreeMap<String, serde_json::Value>")]
    pub model_kwargs: BTreeMap<String, serde_yaml_ng::Value>,
}

/// `model.agents[i]`: one agent's own settings. An entry written as a plain string is its `name`.
/// Each key left out takes the shared value (the trainer section's, else `model`'s).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AgentSettings {
    /// This agent's base model (`model.name` when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Sampling temperature of this agent's rollouts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    /// Nucleus-sampling threshold of this agent's rollouts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f64>,
    /// Top-k of this agent's rollouts (0 disables it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<u32>,
    /// Completion length limit of this agent's rollouts, in tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_new_tokens: Option<usize>,
    /// Strings that end this agent's completions (as vLLM's `stop`: the text is cut before the
    /// string, the token ids keep the token that completed it). None by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<Vec<String>>,
    /// AdamW learning rate of this agent's policy (agents that share parameters share one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub learning_rate: Option<f64>,
    /// This agent's LoRA adapter shape, replacing `model.lora` as a whole (keys left out take
    /// their defaults, not `model.lora`'s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<super::LoraSection>,
}

impl AgentSettings {
    /// True when the entry sets anything besides the model name.
    pub fn has_overrides(&self) -> bool {
        let Self {
            name: _,
            temperature,
            top_p,
            top_k,
            max_new_tokens,
            stop,
            learning_rate,
            lora,
        } = self;
        temperature.is_some()
            || top_p.is_some()
            || top_k.is_some()
            || max_new_tokens.is_some()
            || stop.is_some()
            || learning_rate.is_some()
            || lora.is_some()
    }
}

pub(super) fn default_model_temperature() -> f64 {
    0.7
}
pub(super) fn default_model_top_p() -> f64 {
    0.9
}
pub(super) fn default_max_length() -> usize {
    2048
}

/// Parameter dtype of the trained policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// bf16 on GPU, f32 on CPU.
    #[default]
    Auto,
    #[serde(alias = "float32", alias = "fp32")]
    F32,
    #[serde(alias = "bfloat16")]
    Bf16,
    #[serde(alias = "float16", alias = "fp16")]
    F16,
}

/// `output`: where runs go.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct OutputConfig {
    /// Directory under which each run gets its own directory (`RUN_DIR`).
    #[serde(default = "default_base_dir")]
    pub base_dir: String,
    /// Write `RUN_DIR/final_model/agent-{i}` (shared parameters: `final_model/shared`) at the end: Hugging
    /// Face directories that transformers, vLLM and `rollout-worker generate --model DIR` load.
    #[serde(default = "default_true")]
    pub save_final_model: bool,
    /// The original's flag; accepted and not read (cotrain's log level comes from `RUST_LOG`).
    #[serde(default)]
    pub verbose: bool,
    /// Keep at most this many checkpoints (the newest; Hugging Face's `save_total_limit`);
    /// unset keeps them all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub save_total_limit: Option<usize>,
}

impl Default for OutputConfig {
    fn default() -> Self {
        Self {
            base_dir: default_base_dir(),
            save_final_model: true,
            verbose: false,
            save_total_limit: None,
        }
    }
}

pub(super) fn default_base_dir() -> String {
    "output".to_string()
}
