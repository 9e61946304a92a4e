//! `magrpo` / `grpo`: the trainer section, its enums and the sections it nests (PPO clip, reference KL),
//! and `reward_processor`.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// `magrpo` / `grpo` (and `iac` / `maac`, which add their critic's keys): every key of the original
/// trainer config plus cotrain's options.
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
    /// Tree rollout: a node whose (processed) mean reward is above this is a leaf. A 2026 config's
    /// `early_termination_threshold` is this key (the loader maps it).
    #[serde(default)]
    pub termination_threshold: Option<f64>,
    /// Nodes per agent buffered before one optimiser step.
    #[serde(default = "default_rollout_buffer_size")]
    pub rollout_buffer_size: usize,
    /// Mini-batch size (in the unit of `train_batch_unit`); the whole buffer when absent.
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
    /// Normalise each group's advantages over the G siblings (the form is
    /// `advantage_normalization_form`). On in every 2026 upstream config.
    #[serde(default)]
    pub advantage_normalization: bool,
    /// How `advantage_normalization` normalises: `centred` (CoMLRL 2026: (A − mean A) / max(population
    /// std of A, 1e-6)) or `uncentred` (the earlier form cotrain had: A / (sample std of R + 1e-8), not
    /// re-centred). Default by `comlrl_era`: `centred` for 2026, `uncentred` for 2025-09.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub advantage_normalization_form: Option<NormalizationForm>,
    /// What `train_batch_size` counts: `nodes` (CoMLRL 2026: tree nodes, G completions each; the
    /// buffer's nodes are shuffled whole) or `completions` (cotrain's earlier meaning). Default by
    /// `comlrl_era`: `nodes` for 2026, `completions` for 2025-09.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train_batch_unit: Option<BatchUnit>,
    /// Tree rollout evaluation: `true` plays every turn of each eval path (CoMLRL 2026), `false` stops a
    /// path at the termination threshold as training does. Default by `comlrl_era`: `true` for 2026,
    /// `false` for 2025-09.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_all_turns: Option<bool>,
    /// Tree rollout with several turns: `true` rolls a step's items out one at a time and trains
    /// each time a buffer fills, so later items sample from the updated weights, and a partial
    /// buffer waits for the next item (across steps; it is trained at the end of each epoch), as
    /// CoMLRL 2026 does; `false` rolls the step's items out together and trains the step's last
    /// partial buffer at its end (fewer, larger rollouts). (Multi-turn tree runs are one-rank and
    /// synchronous: several ranks and asynchronous rollouts refuse them.) Default by `comlrl_era`:
    /// `true` for 2026, `false` for 2025-09.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train_between_items: Option<bool>,
    /// How evaluation decodes: `sampled` (the training temperature, top_p and top_k; CoMLRL 2026) or
    /// `greedy` (argmax whenever an evaluation draws one joint sample per item, as the September 2025
    /// trainer did with its shipped base models, whose `generation_config` does not sample; `learner
    /// eval --k N` with N above 1 still samples). `sampled` in both eras.
    #[serde(default)]
    pub eval_decoding: EvalDecoding,
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
    /// `iac`/`maac`: the critics' AdamW learning rate (default: `learning_rate`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub critic_learning_rate: Option<f64>,
    /// `iac`/`maac`: weight of the critics' squared error (0.6 when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value_loss_coef: Option<f64>,
    /// `iac`: the value clip of a value head on the actor (0.2 when absent, `null`: off; upstream
    /// ignores it with a separate critic, as cotrain does).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value_clip_range: Option<f64>,
    /// `iac`: a separate critic model per agent (true, the default) or a value head on each actor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub use_separate_critic: Option<bool>,
    /// `iac`/`maac`: V(h) (`v`, the default) or Q(h, a) (`q`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub critic_type: Option<super::CriticType>,
    /// `iac`/`maac`: a hidden layer of this width in the critics' value head (Linear, Tanh, Linear);
    /// one Linear when absent or 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub critic_value_head_hidden_dim: Option<usize>,
    /// `iac`: the same for a value head on the actor (`use_separate_critic: false`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value_head_hidden_dim: Option<usize>,
}

pub(super) fn default_num_turns() -> usize {
    1
}
pub(super) fn default_num_train_epochs() -> usize {
    20
}
pub(super) fn default_learning_rate() -> f64 {
    5e-6
}
pub(super) fn default_num_generations() -> usize {
    4
}
pub(super) fn default_max_new_tokens() -> usize {
    256
}
pub(super) fn default_discount() -> f64 {
    0.9
}
/// The version the seed README documents steps once per item (later releases buffer 2 or 4).
pub(super) fn default_rollout_buffer_size() -> usize {
    1
}
/// The September 2025 trainer evaluates every 4 items, on 4 eval items.
pub(super) fn default_eval_interval() -> usize {
    4
}
pub(super) fn default_eval_num_samples() -> usize {
    4
}
pub(super) fn default_logging_steps() -> usize {
    50
}
pub(super) fn default_save_steps() -> usize {
    200
}
pub(super) fn default_max_nodes_per_item() -> usize {
    1024
}
pub(super) fn default_early_termination_weight() -> f64 {
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

/// `eval_decoding`: how evaluation draws its completions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum EvalDecoding {
    /// The training sampling parameters (temperature, top_p, top_k), as CoMLRL 2026 evaluates.
    #[default]
    Sampled,
    /// Argmax decoding when an evaluation draws one joint sample per item (every evaluation during
    /// training): the September 2025 trainer passed no sampling arguments to `generate`, so its
    /// Qwen2.5-Coder base models decoded greedily. Several samples per item are still sampled.
    Greedy,
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
        Self {
            enabled: false,
            epochs: default_ppo_epochs(),
            clip_low: default_clip(),
            clip_high: default_clip(),
        }
    }
}

pub(super) fn default_ppo_epochs() -> usize {
    1
}
pub(super) fn default_clip() -> f64 {
    0.2
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReferenceKlConfig {
    /// Turn the KL penalty on.
    #[serde(default)]
    pub enabled: bool,
    /// Weight of the KL term: in the loss (`placement: loss`) or of the KL subtracted from each
    /// completion's return (`placement: returns`).
    #[serde(default = "default_kl_coef")]
    pub coef: f64,
    /// The per-token KL estimator: with `placement: loss`, `k3` differentiated in the loss, or `k1` in
    /// score-function form (REINFORCE with the reward shaped by −coef·KL); with `placement: returns`,
    /// the estimator's per-token values summed over the completion (CoMLRL 2026 uses `k3`).
    #[serde(default)]
    pub estimator: KlEstimator,
    /// Where the penalty acts: `loss` (a term of the loss, with its gradient) or `returns` (CoMLRL
    /// 2026's `reference_kl_enabled`: R − coef·KL of each completion before the group baseline, no
    /// gradient). A 2026 config's `reference_kl_enabled: true` is `placement: returns` (the loader
    /// maps it).
    #[serde(default)]
    pub placement: KlPlacement,
}

impl Default for ReferenceKlConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            coef: default_kl_coef(),
            estimator: KlEstimator::default(),
            placement: KlPlacement::default(),
        }
    }
}

/// Where the reference KL penalty acts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum KlPlacement {
    /// A term of the loss, coef·KL, differentiated (GRPO, Shao et al. 2024; cotrain's earlier and
    /// only behaviour).
    #[default]
    Loss,
    /// Return shaping (CoMLRL 2026): each completion's return (its credit) less coef·Σ_t KL_t, where
    /// KL_t compares the policy that sampled it (the rollout workers' log-probs) with the frozen
    /// reference, the EOS token left out; a constant (no gradient), applied before the group baseline
    /// and the advantage normalisation, to the node's own completions only (a parent's return holds
    /// its children's returns without their KL).
    Returns,
}

pub(super) fn default_kl_coef() -> f64 {
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
        Self {
            enabled: false,
            scale_factor: 1.0,
            shift: 0.0,
        }
    }
}

pub(super) fn default_scale() -> f64 {
    1.0
}

/// `advantage_normalization_form`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum NormalizationForm {
    /// CoMLRL 2026: (A − mean A) / max(std_pop(A), 1e-6), after the baseline.
    Centred,
    /// A / (std(R) + 1e-8), std of the returns with divisor G − 1, not re-centred.
    Uncentred,
}

/// `train_batch_unit`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum BatchUnit {
    /// Tree nodes (G completions each), shuffled whole.
    Nodes,
    /// Single completions.
    Completions,
}
