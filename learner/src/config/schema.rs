//! The YAML schema: one serde struct per section, `deny_unknown_fields` everywhere, and the originals'
//! defaults (algorithms.md). Values that fall back to another section (sampling parameters of the
//! trainer section fall back to `model`) stay `Option` here and are resolved in [`super::CheckedConfig`].

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The whole file as written (after overrides and legacy flags are merged in).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    /// The base model(s) and default sampling parameters.
    pub model: ModelConfig,
    /// Which task and which rows to train and evaluate on.
    pub dataset: DatasetConfig,
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
    /// Multi-agent trainer section (MAGRPO); exactly one of `magrpo` / `grpo` / `maporl` must be present.
    #[serde(default)]
    pub magrpo: Option<TrainerSection>,
    /// Single-agent trainer section (GRPO = MAGRPO with one agent).
    #[serde(default)]
    pub grpo: Option<TrainerSection>,
    /// MaPoRL's multi-agent PPO with a critic and LoRA adapters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub maporl: Option<super::MaporlSection>,
    /// MaPoRL's learned verifier: data generation and training (`learner verifier`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verifier: Option<super::VerifierSection>,
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

fn default_seed() -> u64 {
    42
}

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
    /// One model name per agent, for agents on different base models; `name` is used when absent.
    #[serde(default)]
    pub agents: Option<Vec<String>>,
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

fn default_model_temperature() -> f64 {
    0.7
}
fn default_model_top_p() -> f64 {
    0.9
}
fn default_max_length() -> usize {
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

/// `dataset`: which task and which rows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DatasetConfig {
    /// A dataset name (`humaneval`, `openai/openai_humaneval`, `OpenMLRL/CoopHumanEval`, ...) or a local
    /// file / directory.
    pub name: String,
    /// The task type (`humaneval`, `coophumaneval`, `mbpp`, `arxiv`, `tldr`, `gsm8k`, `anli`); inferred
    /// from `name` when absent.
    #[serde(default, rename = "type")]
    pub kind: Option<String>,
    /// The rows trained on: a split name with an optional slice (`train`, `test[16:20]`).
    #[serde(default = "default_train_split")]
    pub train_split: String,
    /// The rows evaluated on, written like `train_split`; no evaluation when unset.
    #[serde(default)]
    pub eval_split: Option<String>,
    /// Directory with the shipped datasets; overrides `COTRAIN_DATA_DIR` and the repo's `data/`.
    #[serde(default)]
    pub data_dir: Option<String>,
    /// Beside the original: a fresh seeded order of the train rows every epoch. The original keeps
    /// the dataset's order (the default).
    #[serde(default)]
    pub shuffle: bool,
}

fn default_train_split() -> String {
    "train".to_string()
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
        Self { base_dir: default_base_dir(), save_final_model: true, verbose: false, save_total_limit: None }
    }
}

fn default_base_dir() -> String {
    "output".to_string()
}
fn default_true() -> bool {
    true
}

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
    /// Tokens the expert may write.
    #[serde(default = "default_expert_max_tokens")]
    pub expert_max_tokens: u32,
}

fn default_expert_api_key_env() -> String {
    "OPENAI_API_KEY".to_string()
}
fn default_expert_timeout_secs() -> u64 {
    120
}
fn default_expert_max_tokens() -> u32 {
    512
}

impl Default for ExternalConfig {
    fn default() -> Self {
        Self {
            mode: ExternalMode::default(),
            sandbox_slice: default_sandbox_slice(),
            original_prompt: false,
            previous_response: true,
            history: false,
            expert_model: None,
            expert_base_url: None,
            expert_api_key_env: default_expert_api_key_env(),
            expert_timeout_secs: default_expert_timeout_secs(),
            expert_max_tokens: default_expert_max_tokens(),
        }
    }
}

fn default_sandbox_slice() -> Option<SandboxSlice> {
    Some(SandboxSlice::Count(1))
}

impl ExternalConfig {
    /// The indices of the tests shown in feedback out of `total` (`null` = all).
    pub fn feedback_tests(&self, total: usize) -> std::ops::Range<usize> {
        self.sandbox_slice.map_or(0..total, |s| s.select(total))
    }
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
            SandboxSlice::Count(n) if n < 0 => total.saturating_sub(n.unsigned_abs() as usize)..total,
            _ => 0..total,
        }
    }
}

/// `magrpo` / `grpo`: every key of the original trainer config plus cotrain's options.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TrainerSection {
    /// Defaults to 2 under `magrpo` and 1 under `grpo`.
    #[serde(default)]
    pub num_agents: Option<usize>,
    /// Turns per episode; above 1 trains multi-turn on the code tasks (see `rollout`).
    #[serde(default = "default_num_turns")]
    pub num_turns: usize,
    /// Passes over the train split.
    #[serde(default = "default_num_train_epochs")]
    pub num_train_epochs: usize,
    /// AdamW learning rate of every policy.
    #[serde(default = "default_learning_rate")]
    pub learning_rate: f64,
    /// G: completions sampled per agent for each prompt (the group advantages are computed over).
    #[serde(default = "default_num_generations")]
    pub num_generations: usize,
    /// Most tokens sampled per completion.
    #[serde(default = "default_max_new_tokens")]
    pub max_new_tokens: usize,
    /// Falls back to `model.temperature`.
    #[serde(default)]
    pub temperature: Option<f64>,
    /// Falls back to `model.top_p`.
    #[serde(default)]
    pub top_p: Option<f64>,
    /// Falls back to `model.top_k`, then to 50 (the original's generation default).
    #[serde(default)]
    pub top_k: Option<u32>,
    /// How joint actions are formed from the agents' G completions.
    #[serde(default)]
    pub joint_mode: JointMode,
    /// γ of the tree rollout's returns: R_j = r_j + γ·mean(returns of child j).
    #[serde(default = "default_discount")]
    pub discount: f64,
    /// Tree rollout: a node whose (processed) mean reward is above this is a leaf.
    #[serde(default)]
    pub termination_threshold: Option<f64>,
    /// Nodes per agent buffered before one optimiser step.
    #[serde(default = "default_rollout_buffer_size")]
    pub rollout_buffer_size: usize,
    /// Mini-batch size in samples; the whole buffer when absent.
    #[serde(default)]
    pub train_batch_size: Option<usize>,
    /// Evaluate before items 0, n, 2n, ... of each epoch (n = this value; 0: never).
    #[serde(default = "default_eval_interval")]
    pub eval_interval: usize,
    /// How many eval items (the first ones of the eval split) each evaluation scores, one sampled joint
    /// completion each.
    #[serde(default = "default_eval_num_samples")]
    pub eval_num_samples: usize,
    /// Without a progress bar, log a `learner step done` line every this many steps (and at the last).
    #[serde(default = "default_logging_steps")]
    pub logging_steps: usize,
    /// Write a checkpoint every this many steps (0: only at the end).
    #[serde(default = "default_save_steps")]
    pub save_steps: usize,
    /// Multi-turn variant: tree rollout with returns (current) or handoff (September 2025 release).
    /// `multi_turn` is accepted as an older spelling.
    #[serde(default, alias = "multi_turn")]
    pub rollout: MultiTurnMode,
    /// Tree rollout: the most nodes one item may grow (G^T aligned, G^(N·T) cross without early stops).
    #[serde(default = "default_max_nodes_per_item")]
    pub max_nodes_per_item: usize,
    /// Handoff rollout: which completion of each agent is handed on to the next turn.
    #[serde(default)]
    pub handoff: Handoff,
    /// Per-turn loss weights; length must equal `num_turns` (all 1.0 when absent).
    #[serde(default)]
    pub turn_gradient_weights: Option<Vec<f64>>,
    /// Handoff rollout: stop an episode early when a turn's mean reward reaches this; never when unset.
    #[serde(default)]
    pub early_termination_threshold: Option<f64>,
    /// Handoff rollout: extra loss weight of the last turn of an episode that stopped early.
    #[serde(default = "default_early_termination_weight")]
    pub early_termination_weight: f64,
    /// Baseline of the advantage over the G siblings of a node.
    #[serde(default)]
    pub advantage_mode: AdvantageMode,
    /// Divide each group's advantages by (std + 1e-8), std over the G siblings with divisor G − 1.
    #[serde(default)]
    pub advantage_normalization: bool,
    /// The oldest release clamps advantages to [-10, 10]; off by default.
    #[serde(default)]
    pub advantage_clamp: Option<f64>,
    /// Beside the original: every agent shares one policy; each agent's loss is scaled by 1/N and one
    /// optimiser step is taken per round.
    #[serde(default)]
    pub shared_parameters: bool,
    /// Beside the original: how per-token log-probs are reduced per sample.
    #[serde(default)]
    pub loss_normalization: LossNormalization,
    /// Beside the original: PPO-style ratio clipping over several epochs.
    #[serde(default)]
    pub ppo_clip: PpoClipConfig,
    /// Beside the original: KL penalty to a frozen reference policy.
    #[serde(default)]
    pub reference_kl: ReferenceKlConfig,
    /// Gradient-norm clipping; off (as in the original) when absent.
    #[serde(default)]
    pub max_grad_norm: Option<f64>,
    /// AdamW weight decay.
    #[serde(default)]
    pub weight_decay: f64,
}

fn default_num_turns() -> usize {
    1
}
fn default_num_train_epochs() -> usize {
    20
}
fn default_learning_rate() -> f64 {
    5e-6
}
fn default_num_generations() -> usize {
    4
}
fn default_max_new_tokens() -> usize {
    256
}
fn default_discount() -> f64 {
    0.9
}
/// The version the seed README documents steps once per item (later releases buffer 2 or 4).
fn default_rollout_buffer_size() -> usize {
    1
}
/// The September 2025 trainer evaluates every 4 items, on 4 eval items.
fn default_eval_interval() -> usize {
    4
}
fn default_eval_num_samples() -> usize {
    4
}
fn default_logging_steps() -> usize {
    50
}
fn default_save_steps() -> usize {
    200
}
fn default_max_nodes_per_item() -> usize {
    1024
}
fn default_early_termination_weight() -> f64 {
    2.0
}

/// How joint actions are formed from the agents' G completions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum JointMode {
    /// Completion j of every agent forms joint action j (G rewards).
    #[default]
    Aligned,
    /// Cartesian product (G^N rewards); a completion is credited with the sum over its joint actions.
    Cross,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum MultiTurnMode {
    #[default]
    Tree,
    Handoff,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Handoff {
    /// Each agent hands on one of its own completions at random.
    #[default]
    Random,
    /// The joint action with the highest reward is handed on.
    Best,
}

/// Baseline of the advantage over the G siblings of a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum AdvantageMode {
    /// A = R − mean(R)
    #[default]
    Mean,
    /// A = (G·R − ΣR)/(G − 1)
    Rloo,
    /// A = R − max(R)
    Max,
    /// A = R
    Raw,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum LossNormalization {
    /// Σ_t log π per sample (the original).
    #[default]
    Sum,
    /// Mean over the sample's tokens.
    TokenMean,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PpoClipConfig {
    /// Turn ratio clipping on.
    #[serde(default)]
    pub enabled: bool,
    /// Passes over the same samples per optimiser round.
    #[serde(default = "default_ppo_epochs")]
    pub epochs: usize,
    /// Ratio lower bound 1 − clip_low.
    #[serde(default = "default_clip")]
    pub clip_low: f64,
    /// Ratio upper bound 1 + clip_high ("clip-higher" when larger than clip_low).
    #[serde(default = "default_clip")]
    pub clip_high: f64,
}

impl Default for PpoClipConfig {
    fn default() -> Self {
        Self { enabled: false, epochs: default_ppo_epochs(), clip_low: default_clip(), clip_high: default_clip() }
    }
}

fn default_ppo_epochs() -> usize {
    1
}
fn default_clip() -> f64 {
    0.2
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReferenceKlConfig {
    /// Turn the KL penalty on.
    #[serde(default)]
    pub enabled: bool,
    /// Weight of the KL term in the loss.
    #[serde(default = "default_kl_coef")]
    pub coef: f64,
    /// The per-token KL estimator: `k3` differentiated in the loss, or `k1` in score-function form
    /// (REINFORCE with the reward shaped by −coef·KL).
    #[serde(default)]
    pub estimator: KlEstimator,
}

impl Default for ReferenceKlConfig {
    fn default() -> Self {
        Self { enabled: false, coef: default_kl_coef(), estimator: KlEstimator::default() }
    }
}

fn default_kl_coef() -> f64 {
    0.1
}

/// Per-token KL estimators (Schulman, "Approximating KL divergence", 2020).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum KlEstimator {
    /// lp − lr
    K1,
    /// exp(lr − lp) − (lr − lp) − 1
    #[default]
    K3,
}

/// `reward_processor`: r ← scale_factor·r + shift when enabled.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RewardProcessorConfig {
    /// Apply r ← scale_factor·r + shift.
    #[serde(default)]
    pub enabled: bool,
    /// Multiplier of every reward.
    #[serde(default = "default_scale")]
    pub scale_factor: f64,
    /// Added to every reward after scaling (the original's `reward_shift`).
    #[serde(default)]
    pub shift: f64,
}

impl Default for RewardProcessorConfig {
    fn default() -> Self {
        Self { enabled: false, scale_factor: 1.0, shift: 0.0 }
    }
}

fn default_scale() -> f64 {
    1.0
}

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
        Self { run_name: None, tensorboard: true, plots: true, progress: ProgressMode::Auto, rollouts: false }
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

/// `rollout`: where generation happens; embedded worker when nothing is configured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RolloutConfig {
    /// Static list of `http://host:port` worker endpoints.
    #[serde(default)]
    pub endpoints: Vec<String>,
    /// DNS name resolved to many addresses (e.g. a Kubernetes headless service), `host:port`.
    #[serde(default)]
    pub dns_name: Option<String>,
    /// How often `dns_name` is resolved again, in seconds (A and AAAA records; addresses that leave the
    /// name are dropped).
    #[serde(default = "default_dns_refresh_secs")]
    pub dns_refresh_secs: u64,
    /// Deadline of one generate request to a worker, in seconds.
    #[serde(default = "default_request_timeout_secs")]
    pub request_timeout_secs: u64,
    /// Times a failed generate request is retried on another worker.
    #[serde(default = "default_max_retries")]
    pub max_retries: usize,
    /// 0 = synchronous on-policy (the original); k > 0: the next step's rollout is drawn while a
    /// step trains, and samples more than k policy versions older than the trained policy are
    /// dropped and redrawn.
    #[serde(default)]
    pub max_off_policy_steps: usize,
    /// With max_off_policy_steps > 0: the cap of the truncated importance weights that correct the
    /// loss for the behaviour policy (`null`: no correction).
    #[serde(default = "default_importance_weight_cap")]
    pub importance_weight_cap: Option<f64>,
    /// How weights reach the workers after each step; see [`WeightTransport`].
    #[serde(default)]
    pub weight_transport: WeightTransport,
    /// The element type of pushed weights: `f32` (the workers' policy is bit-identical to the
    /// learner's) or `bf16` (half the bytes; the workers convert to their own dtype).
    #[serde(default)]
    pub weight_dtype: WeightDtype,
    /// The precision rollouts are drawn in: `auto` (the policy's `model.dtype`), `f32` or `bf16`.
    /// The embedded worker loads its models in it; remote workers are started with the matching
    /// `rollout-worker serve --dtype`. When it differs from the training precision, the loss
    /// takes the workers' log-probs as the behaviour policy: `logprob_gap` (mean |Δ log-prob| per
    /// token) is reported and `importance_weight_cap` corrects for the mismatch.
    #[serde(default)]
    pub dtype: Precision,
    /// With bf16 rollouts on a CPU with AVX512_BF16: the embedded worker rounds each product's
    /// input rows to bf16 and multiplies with bf16 dot products (`rollout-worker serve
    /// --bf16-dot-products` for remote workers). Off by default: the rows then stay f32.
    #[serde(default)]
    pub bf16_dot_products: bool,
    /// Start no embedded worker and wait for workers to register with `learner.control_addr`
    /// (`rollout-worker serve --register URL`), next to any `endpoints`/`dns_name`.
    #[serde(default)]
    pub wait_for_registration: bool,
    /// With wait_for_registration: how many workers must be in rotation before training starts.
    #[serde(default = "default_min_workers")]
    pub min_workers: usize,
    /// With wait_for_registration: how long to wait for them before giving up.
    #[serde(default = "default_registration_timeout_secs")]
    pub registration_timeout_secs: u64,
}

fn default_min_workers() -> usize {
    1
}

fn default_registration_timeout_secs() -> u64 {
    600
}

/// `rollout.dtype` and `model.matmul_dtype`: a precision, or `auto` for the parameters' own.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// The parameters' own dtype (`model.dtype`).
    #[default]
    Auto,
    #[serde(alias = "float32", alias = "fp32")]
    F32,
    #[serde(alias = "bfloat16")]
    Bf16,
}

impl Precision {
    /// The libtorch dtype, `auto` being `params` (the parameters' dtype).
    pub fn kind(self, params: tch::Kind) -> tch::Kind {
        match self {
            Precision::Auto => params,
            Precision::F32 => tch::Kind::Float,
            Precision::Bf16 => tch::Kind::BFloat16,
        }
    }
}

/// `rollout.weight_dtype`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum WeightDtype {
    #[default]
    F32,
    Bf16,
}

/// `learner`: the learner's ranks (learner/src/dist). One process is one rank; the launcher
/// (`learner launch`, `mpirun`, `srun --mpi=pmix`, torchrun for the NCCL backend) says how many.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LearnerConfig {
    /// The collective library the ranks reduce gradients with.
    #[serde(default)]
    pub backend: DistBackend,
    /// With several ranks: a collective still waiting after this many seconds stops its rank with
    /// a message naming it (a dead or hung peer, or a network the ranks cannot cross); 0 (the
    /// default): wait for ever. Off by default because ranks also wait in collectives while rank 0
    /// alone works (waiting for workers to register, loading, evaluating, writing a checkpoint), for
    /// as long as that takes: set it above the longest such phase.
    #[serde(default = "default_collective_timeout_secs")]
    pub collective_timeout_secs: u64,
    /// What the ranks split: the step's items (`data`) or the agents' policies (`agent`).
    #[serde(default)]
    pub placement: Placement,
    /// Every this many steps the ranks compare a checksum of their weights (0: never).
    #[serde(default = "default_checksum_steps")]
    pub checksum_steps: u64,
    /// `host:port` of the control plane (gRPC and HTTP: status, checkpoint, stop, worker
    /// registration, /metrics); none by default. Bind loopback unless other hosts must reach it,
    /// and then set a cluster token.
    #[serde(default)]
    pub control_addr: Option<String>,
    /// On one CPU rank with several policies, update them at the same time, one thread each with
    /// its share of the cores (`learner::trainer::rounds`); `false` updates them in turn. The MaPoRL
    /// trainer runs its adapters' and critics' PPO epochs the same way (`learner::maporl::update`).
    #[serde(default = "default_true")]
    pub concurrent_policies: bool,
}

impl Default for LearnerConfig {
    fn default() -> Self {
        Self {
            backend: DistBackend::default(),
            placement: Placement::default(),
            checksum_steps: default_checksum_steps(),
            control_addr: None,
            concurrent_policies: true,
            collective_timeout_secs: default_collective_timeout_secs(),
        }
    }
}

fn default_collective_timeout_secs() -> u64 {
    0
}

fn default_checksum_steps() -> u64 {
    10
}

/// `learner.backend`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum DistBackend {
    /// NCCL when the learner's device is CUDA, MPI otherwise.
    #[default]
    Auto,
    /// Open MPI (or any MPI the `mpi` crate links): CPU tensors.
    Mpi,
    /// NCCL through cudarc: CUDA tensors (the `cuda` build feature).
    Nccl,
}

/// `learner.placement`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Placement {
    /// Every rank holds every policy and trains on its share of each step's items.
    #[default]
    Data,
    /// Each agent's policy on its own group of ranks.
    Agent,
}

/// `rollout.weight_transport`: how the learner sends weights to the rollout workers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum WeightTransport {
    /// `shm` when every worker is on a loopback address and accepts it (`--allow-shm-weights`;
    /// the embedded worker does), else `grpc`; falls back to `grpc` with a warning if `shm` fails.
    #[default]
    Auto,
    /// Always gRPC chunks.
    Grpc,
    /// Always a file in /dev/shm named in the update stream; an error if a worker refuses it.
    Shm,
}

impl Default for RolloutConfig {
    fn default() -> Self {
        Self {
            endpoints: Vec::new(),
            dns_name: None,
            dns_refresh_secs: default_dns_refresh_secs(),
            request_timeout_secs: default_request_timeout_secs(),
            max_retries: default_max_retries(),
            max_off_policy_steps: 0,
            importance_weight_cap: default_importance_weight_cap(),
            weight_transport: WeightTransport::Auto,
            weight_dtype: WeightDtype::F32,
            dtype: Precision::Auto,
            bf16_dot_products: false,
            wait_for_registration: false,
            min_workers: default_min_workers(),
            registration_timeout_secs: default_registration_timeout_secs(),
        }
    }
}

fn default_importance_weight_cap() -> Option<f64> {
    Some(2.0)
}

fn default_dns_refresh_secs() -> u64 {
    30
}
fn default_reward_retries() -> u32 {
    5
}

fn default_request_timeout_secs() -> u64 {
    600
}
fn default_max_retries() -> usize {
    3
}

/// `reward`: the reward server (embedded when `endpoint` is absent) and the options every scoring
/// call carries.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RewardConfig {
    /// The reward server's gRPC address (`http://host:port`, `https://` with TLS); unset: a reward server
    /// embedded in the learner on a loopback port.
    #[serde(default)]
    pub endpoint: Option<String>,
    /// Deadline of one call to the reward server, in seconds.
    #[serde(default = "default_request_timeout_secs")]
    pub request_timeout_secs: u64,
    /// Retries of a call that failed because the reward server is down, overloaded or late
    /// (0.5 s, then twice as long each time, at most 8 s); then the step fails with a checkpoint.
    #[serde(default = "default_reward_retries")]
    pub max_retries: u32,
    /// Writing reward: `newest` (from 2025-12-31) or `earlier` length-ratio bands; the same as
    /// `options.arxiv_ratio`, kept under the name earlier configs used.
    #[serde(default)]
    pub writing_ratio_version: Option<cotrain_proto::reward_options::ArxivRatioVersion>,
    /// The reward server's scoring options (the original's behaviour by default; each correction
    /// beside it is a named option, documented in the README). `split_seed` defaults to `seed`.
    #[serde(default)]
    pub options: cotrain_proto::reward_options::ScoreOptions,
}

impl Default for RewardConfig {
    fn default() -> Self {
        Self {
            endpoint: None,
            request_timeout_secs: default_request_timeout_secs(),
            max_retries: default_reward_retries(),
            writing_ratio_version: None,
            options: Default::default(),
        }
    }
}
