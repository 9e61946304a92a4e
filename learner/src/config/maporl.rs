//! `maporl`: the multi-agent PPO trainer's section (docs/src/trainers/maporl.md). Keys carry the names of
//! MaPoRL's config files (`config/ppo_config/*.py` of chanwoo-park-official/MAPoRL) where one exists:
//! `agent_num`, `round_num`, `kl_coef`, `vf_coef`, `num_ppo_epochs`, `num_mini_batches`,
//! `per_device_train_batch_size`, `gradient_accumulation_steps`, `max_output_length`,
//! `min_output_length`, `penalty_reward_value`, `rule_horizon`, `rule_agent_share`, `rule_discount`,
//! `task_training`, `reward_feedback`, `value_simplification`. The PPO constants MaPoRL inherits from
//! TRL's trainer (`cliprange`, `cliprange_value`, `gamma`, `lam`, `temperature`, `whiten_rewards`)
//! keep TRL's names.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::LoraSection;

/// Which turns enter R(t, i); the released flag `rule_horizon`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Horizon {
    /// Turn t only.
    Current,
    /// Turns t..=last, weighted γ^(t'−t) and normalised by the sum of the weights.
    #[default]
    DiscountedSum,
    /// The last turn only, whatever t is.
    Last,
}

/// Whose scores enter R(t, i); the released flag `rule_agent_share`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AgentShare {
    /// The agent's own score at turn t, the mean over all agents (itself included) at other turns
    /// (`current` and `last` use the mean at their one turn).
    #[default]
    All,
    /// The agent's own scores only.
    Individual,
}

/// Which table of incentives `alpha` weighs (see `algo::discussion_score::incentive_bonus`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IncentiveRule {
    /// The paper's Tables 1 and 2 (arXiv 2502.18439v2, §3.3), `alpha` = [α0, α1, β0, β1].
    #[default]
    Paper,
    /// The released code's `bonus_rule`: the influence terms' signs opposite to the paper's, and
    /// the weights grouped differently.
    ReleasedCode,
}

/// Which adapter serves which turn of an agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum AdapterLayout {
    /// One adapter for turn 0 and one for every later turn (MaPoRL's `collaboration_separation`,
    /// on in its shipped configs).
    #[default]
    FirstAndLater,
    /// One adapter per turn (MaPoRL's `turn_based_training`).
    PerTurn,
    /// One adapter for every turn and every agent (one model, as MaPoRL with
    /// `collaboration_separation: False` and shared policies).
    Shared,
    /// MaPoRL's own layout (its `policy_separation` and `collaboration_separation`, adapters `policy`
    /// and `col` of one PEFT model): one adapter for turn 0 and one for every later turn, each
    /// shared by all agents (`shared.turn0`, `shared.later`). With `task_training: false` the turn-0
    /// adapter is never trained, so turn 0 is the base model, as the original's zeroed and frozen
    /// `policy` adapter. With `critic_per_turn`, one critic per turn shared by the agents
    /// (`critic.turn1`, ...: the original's `value_0..value_{T−1}`).
    SharedByTurn,
}

impl AdapterLayout {
    /// The adapter key of agent `agent` at turn `turn`; also the rollout workers' agent name for it.
    pub fn adapter_key(self, agent: usize, turn: usize) -> String {
        match self {
            AdapterLayout::Shared => "shared".into(),
            AdapterLayout::SharedByTurn if turn == 0 => "shared.turn0".into(),
            AdapterLayout::SharedByTurn => "shared.later".into(),
            AdapterLayout::PerTurn => format!("agent{agent}.turn{turn}"),
            AdapterLayout::FirstAndLater if turn == 0 => format!("agent{agent}.turn0"),
            AdapterLayout::FirstAndLater => format!("agent{agent}.later"),
        }
    }
}

/// Where s(t, i) comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum MaporlScore {
    /// 0/1 correctness from the reward server (MaPoRL without a verifier).
    #[default]
    Correctness,
    /// The learned verifier's probability that the answer is correct, from a rollout worker that
    /// serves it (`maporl.verifier_path` for the embedded worker, `maporl.verifier_name` for
    /// remote ones).
    Verifier,
}

/// `maporl.critic_head`: what a critic's value head is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum CriticHead {
    /// MaPoRL's: `nn.Linear(hidden, 1, bias=False)` with PyTorch's default init U(−1/√hidden,
    /// 1/√hidden), drawn from the run's seed, and never trained (the original's
    /// `grad_requires_setting` leaves only LoRA weights trainable): only the critic's adapter learns.
    #[default]
    FrozenRandom,
    /// cotrain's earlier head: starts at zero and trains with the critic's adapter.
    Trained,
}

/// `maporl.whiten`: over which samples the advantages are whitened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum AdvantageWhitening {
    /// Per (turn, agent), over that turn's and agent's answers of the step (MaPoRL's
    /// `masked_whiten` over the response tokens of each (turn, agent) batch).
    #[default]
    PerTurnAgent,
    /// Per policy adapter, over all its answers of the step (cotrain's earlier grouping; with
    /// `first_and_later` the discussion turns of an agent are whitened together).
    PerAdapter,
}

/// `maporl.score_position`: which token positions of an answer the PPO update trains and where
/// the score lands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ScorePosition {
    /// MaPoRL's (TRL PPOv2's `sequence_lengths`/`actual_end`): with a stop token at k that is not the
    /// pad token, the policy trains on tokens 0..=k and the score lands on one more value position,
    /// the critic's value after the stop token (k + 1), when k + 1 < max_output_length (else on k);
    /// with the stop token equal to the pad token (eos-as-pad models), the policy trains on 0..k − 1
    /// and the score lands on k; without a stop token, on the last token.
    #[default]
    Trl,
    /// cotrain's earlier placement: the policy trains on every kept token, the stop token included
    /// even when it is the pad token (so the policy learns to end its answer), and the score lands
    /// on the last one.
    LastToken,
}

/// Where the PPO update's behaviour ("old") log-probs come from (`maporl.old_logprobs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum OldLogprobs {
    /// cotrain's: one forward of each answer by the learner before the epochs, in the precision the
    /// epochs train in, so the first epoch's ratio is exactly 1 whatever the rollouts' precision.
    #[default]
    Recompute,
    /// MaPoRL's (TRL PPOv2 reads them from `generate`'s scores): the rollout workers report each
    /// token's log-prob under the distribution it was sampled from (the logits over the
    /// temperature), and the learner saves that forward. With rollouts in another precision than
    /// training (`rollout.dtype`, `model.matmul_dtype`) the first ratio is off 1 by the gap.
    Generation,
}

/// The text of the discussion's next-turn prompt (`prompts::discussion`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum FollowupStyle {
    /// MaPoRL's own follow-up message, byte for byte (`configs/prompts/discussion_followup.j2`):
    /// the answers in triple backticks, scores with 3 decimals and the original's readings, its
    /// verifier explanation, the do-not-repeat paragraph and the restated question.
    #[default]
    Original,
    /// cotrain's shorter message (`configs/prompts/discussion_followup_cotrain.j2`): the answers,
    /// scores with 2 decimals and a short reading, no own score.
    Cotrain,
}

/// The user message the learned verifier reads with each answer (`score: verifier`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum VerifierUserMessage {
    /// The answering agent's own turn-0 question message, as MaPoRL's trainer sends it (the first
    /// message of the agent's conversation, at every turn).
    #[default]
    FirstTurn,
    /// `verifier.user_template` over the row's question: the message `learner verifier generate`
    /// samples and trains with.
    Template,
}

/// `maporl`: see the module docs; defaults are MaPoRL's shipped GSM8K config (2 agents, 3 turns).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MaporlSection {
    /// Agents N.
    #[serde(default = "default_agent_num")]
    pub agent_num: usize,
    /// Discussion turns T.
    #[serde(default = "default_round_num")]
    pub round_num: usize,
    /// Passes over the train split.
    #[serde(default = "default_epochs")]
    pub num_train_epochs: usize,
    /// Questions per step (one PPO update) = per_device_train_batch_size ×
    /// gradient_accumulation_steps × num_mini_batches, as TRL's PPOv2 trainer that MaPoRL runs counts
    /// its `local_batch_size` (1 × 4 × 8 = 32 in MaPoRL's configs); each PPO epoch splits them into
    /// `num_mini_batches` mini-batches of per_device_train_batch_size × gradient_accumulation_steps
    /// questions.
    #[serde(default = "default_one")]
    pub per_device_train_batch_size: usize,
    /// See `per_device_train_batch_size`. Each mini-batch is also forwarded in this many
    /// micro-batches of whole questions (as many as TRL's), their gradients accumulated with each
    /// micro-batch's loss weighted by its token share (TRL weights them equally): the update is the
    /// whole mini-batch's token mean, the memory one micro-batch's.
    #[serde(default = "default_grad_accum")]
    pub gradient_accumulation_steps: usize,
    /// Beside the original: forward each mini-batch in micro-batches of whole questions of up to
    /// this many positions each (prompts and answers, before prefix sharing; a longer question
    /// alone) instead of `gradient_accumulation_steps` parts. The update is the same either way
    /// (token-share weights); only peak memory and speed change: short rows, the critic's above
    /// all, run faster in larger products, in bf16 especially. `null` (default): TRL's count.
    #[serde(default)]
    pub micro_batch_positions: Option<usize>,
    /// Mini-batches per PPO epoch: each epoch's permutation of the step's questions is split into
    /// this many parts (at most one question each), the same for every adapter and critic, one
    /// AdamW step of each per part.
    #[serde(default = "default_mini_batches")]
    pub num_mini_batches: usize,
    /// PPO passes over each step's samples.
    #[serde(default = "default_ppo_epochs")]
    pub num_ppo_epochs: usize,
    /// AdamW learning rate at the start of the run.
    #[serde(default = "default_lr")]
    pub learning_rate: f64,
    /// The learning rate decays linearly from `learning_rate` to this fraction of it over the run.
    #[serde(default = "default_lr_end_factor")]
    pub lr_end_factor: f64,
    /// AdamW weight decay.
    #[serde(default)]
    pub weight_decay: f64,
    /// Gradient-norm clipping; off when unset.
    #[serde(default)]
    pub max_grad_norm: Option<f64>,
    /// New tokens sampled per answer: exactly this many (EOS ignored while sampling, the answer cut
    /// at the first EOS afterwards).
    #[serde(default = "default_max_output_length")]
    pub max_output_length: usize,
    /// Longest prompt (question + discussion) in tokens; longer prompts are an error naming the row.
    #[serde(default)]
    pub max_input_length: Option<usize>,
    /// Sampling temperature; log-probs are taken under it, as MaPoRL's TRL trainer does.
    #[serde(default = "default_temperature")]
    pub temperature: f64,
    /// Weight of the per-token KL penalty −kl_coef·(log π − log π_ref) in the reward.
    #[serde(default = "default_kl_coef")]
    pub kl_coef: f64,
    /// Weight of the value loss.
    #[serde(default = "default_vf_coef")]
    pub vf_coef: f64,
    /// ε of the policy ratio's clip 1 ± ε.
    #[serde(default = "default_clip")]
    pub cliprange: f64,
    /// ε_v of the value clip V_old ± ε_v.
    #[serde(default = "default_clip")]
    pub cliprange_value: f64,
    /// γ of GAE over tokens.
    #[serde(default = "default_gamma")]
    pub gamma: f64,
    /// λ of GAE over tokens.
    #[serde(default = "default_lam")]
    pub lam: f64,
    /// Whiten the rewards before GAE (TRL's option).
    #[serde(default)]
    pub whiten_rewards: bool,
    /// Score rule R(t, i).
    #[serde(default)]
    #[schemars(with = "super::reference::HorizonSchema")]
    pub rule_horizon: Horizon,
    /// Whose scores enter R(t, i).
    #[serde(default)]
    #[schemars(with = "super::reference::AgentShareSchema")]
    pub rule_agent_share: AgentShare,
    /// γ of the score rule's discounted sum.
    #[serde(default = "default_rule_discount")]
    pub rule_discount: f64,
    /// cotrain option: look at most this many turns ahead in the score rule.
    #[serde(default)]
    pub rule_lookahead: Option<usize>,
    /// Incentive weights (0 = off): the paper's [α0, α1, β0, β1] under `incentive_rule: paper`,
    /// the released code's alpha[0..4] under `released_code`.
    #[serde(default)]
    pub alpha: [f64; 4],
    /// Which incentive table reads `alpha` (`influence_signs` is its earlier name).
    #[serde(default, alias = "influence_signs")]
    #[schemars(with = "super::reference::IncentiveRuleSchema")]
    pub incentive_rule: IncentiveRule,
    /// Score that replaces an invalid answer's.
    #[serde(default = "default_penalty")]
    pub penalty_reward_value: f64,
    /// Fewer response tokens than this is invalid.
    #[serde(default = "default_min_output_length")]
    pub min_output_length: usize,
    /// Apply the invalid-output penalty at all.
    #[serde(default = "default_true")]
    pub invalid_penalty: bool,
    /// Train on turn-0 answers too (MaPoRL's shipped configs train the discussion turns only).
    #[serde(default)]
    pub task_training: bool,
    /// s(t, i): `correctness` or `verifier`.
    #[serde(default)]
    pub score: MaporlScore,
    /// A verifier directory (`learner verifier train`) the embedded rollout worker loads for
    /// `score: verifier`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verifier_path: Option<String>,
    /// The verifier's name on remote rollout workers (`serve --verifier NAME=DIR`); unset: the
    /// worker's only verifier.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verifier_name: Option<String>,
    /// Show each other agent's score and its verbal reading in the next turn's prompt. Only with
    /// `score: verifier` (the original shows the verifier's probability); refused with correctness.
    #[serde(default)]
    pub reward_feedback: bool,
    /// The critic values (question, response) without the discussion history.
    #[serde(default = "default_true")]
    pub value_simplification: bool,
    /// One critic per turn group of the adapter layout (otherwise one per agent); with
    /// `adapter_layout: shared_by_turn`, one per turn shared by the agents (MaPoRL's).
    #[serde(default)]
    pub critic_per_turn: bool,
    /// The critics' value heads: `frozen_random` (MaPoRL's) or `trained`.
    #[serde(default)]
    pub critic_head: CriticHead,
    /// Advantage whitening groups: `per_turn_agent` (MaPoRL's) or `per_adapter`.
    #[serde(default)]
    pub whiten: AdvantageWhitening,
    /// Which tokens the update trains and where the score lands: `trl` (MaPoRL's) or `last_token`.
    #[serde(default)]
    pub score_position: ScorePosition,
    /// Where the PPO update's behaviour log-probs come from: `recompute` (a learner forward) or
    /// `generation` (the rollout workers' sampling log-probs, as MaPoRL's trainer takes them).
    #[serde(default)]
    pub old_logprobs: OldLogprobs,
    /// Which adapter serves which turn of an agent.
    #[serde(default)]
    pub adapter_layout: AdapterLayout,
    /// Train every weight of each policy (a whole copy of the base per adapter key) instead of
    /// LoRA adapters; the base stays the reference policy, and critics keep their adapters.
    #[serde(default)]
    pub full_finetune: bool,
    /// The adapters' shape (PEFT's `LoraConfig`).
    #[serde(default)]
    pub lora: LoraSection,
    /// The next-turn prompt template (minijinja, see `prompts::discussion`); the `followup_style`'s
    /// default when absent.
    #[serde(default)]
    pub followup_template: Option<String>,
    /// The next-turn prompt: `original` (MaPoRL's text, with each agent's own verifier score
    /// merged in front under `reward_feedback`) or `cotrain` (cotrain's shorter text, no own score).
    #[serde(default)]
    pub followup_style: FollowupStyle,
    /// Rewrite each GSM8K/ANLI answer to end in `Answer: \boxed{x}` before it is shown, scored by
    /// the verifier and checked for correctness, as MaPoRL does (the invalid-answer check still reads
    /// the answer as sampled); false: every step reads the answer as sampled.
    #[serde(default = "default_true")]
    pub rewrite_answers: bool,
    /// With `score: verifier`, the user message paired with each answer: `first_turn` (the agent's
    /// own turn-0 question message, the original's) or `template` (`verifier.user_template`, what
    /// `learner verifier generate` trains on).
    #[serde(default)]
    pub verifier_user_message: VerifierUserMessage,
    /// Evaluate before steps 0, n, 2n, ... (n = this value; 0: never).
    #[serde(default = "default_eval_interval")]
    pub eval_interval: usize,
    /// How many eval questions (the first ones) each evaluation discusses.
    #[serde(default = "default_eval_num_samples")]
    pub eval_num_samples: usize,
    /// Without a progress bar, log a `MaPoRL step done` line every this many steps (and at the last).
    #[serde(default = "default_one")]
    pub logging_steps: usize,
    /// Write a checkpoint every this many steps (0: only at the end).
    #[serde(default = "default_save_steps")]
    pub save_steps: usize,
}

fn default_agent_num() -> usize {
    2
}
fn default_round_num() -> usize {
    3
}
fn default_epochs() -> usize {
    1
}
fn default_one() -> usize {
    1
}
fn default_grad_accum() -> usize {
    4
}
fn default_mini_batches() -> usize {
    8
}
fn default_ppo_epochs() -> usize {
    4
}
fn default_lr() -> f64 {
    1e-5
}
fn default_lr_end_factor() -> f64 {
    0.1
}
fn default_max_output_length() -> usize {
    300
}
/// TRL's PPO default sampling temperature, which MaPoRL does not change.
fn default_temperature() -> f64 {
    0.7
}
fn default_kl_coef() -> f64 {
    0.002
}
fn default_vf_coef() -> f64 {
    0.1
}
fn default_clip() -> f64 {
    0.2
}
fn default_gamma() -> f64 {
    1.0
}
fn default_lam() -> f64 {
    0.95
}
fn default_rule_discount() -> f64 {
    0.3
}
fn default_penalty() -> f64 {
    -10.0
}
fn default_min_output_length() -> usize {
    50
}
fn default_true() -> bool {
    true
}
fn default_eval_interval() -> usize {
    300
}
fn default_eval_num_samples() -> usize {
    100
}
fn default_save_steps() -> usize {
    100
}

impl MaporlSection {
    /// Questions per step: TRL PPOv2's `local_batch_size` (see `per_device_train_batch_size`).
    pub fn questions_per_step(&self) -> usize {
        self.per_device_train_batch_size * self.gradient_accumulation_steps * self.num_mini_batches
    }

    /// The keys the trainer-agnostic parts of the learner read (sampling, turns, schedule), as a
    /// [`super::TrainerSection`]: one sample per agent and turn, no MAGRPO options.
    pub fn trainer_view(&self) -> super::TrainerSection {
        let yaml = format!(
            "num_agents: {}\nnum_turns: {}\nnum_train_epochs: {}\nlearning_rate: {}\nnum_generations: 1\nmax_new_tokens: {}\n\
             temperature: {}\ntop_p: 1.0\ntop_k: 0\nrollout_buffer_size: {}\neval_interval: {}\neval_num_samples: {}\n\
             logging_steps: {}\nsave_steps: {}\nweight_decay: {}\n",
            self.agent_num,
            self.round_num,
            self.num_train_epochs,
            self.learning_rate,
            self.max_output_length,
            self.temperature,
            self.questions_per_step().max(1),
            self.eval_interval,
            self.eval_num_samples,
            self.logging_steps,
            self.save_steps,
            self.weight_decay,
        );
        let mut t: super::TrainerSection =
            serde_yaml_ng::from_str(&yaml).expect("the view's keys are the schema's");
        t.max_grad_norm = self.max_grad_norm;
        t
    }

    /// The checks of the section's own values, as (key, message).
    pub fn check(&self) -> Result<(), (String, String)> {
        let bad = |k: &str, m: String| Err((format!("maporl.{k}"), m));
        let positive = |v: f64| v.is_finite() && v > 0.0;
        if self.agent_num == 0 {
            return bad("agent_num", "must be at least 1".into());
        }
        if self.round_num == 0 {
            return bad("round_num", "must be at least 1".into());
        }
        if self.round_num == 1 && !self.task_training {
            return bad(
                "task_training",
                "is false but round_num is 1: no turn would be trained".into(),
            );
        }
        for (k, v) in [
            ("num_train_epochs", self.num_train_epochs),
            (
                "per_device_train_batch_size",
                self.per_device_train_batch_size,
            ),
            (
                "gradient_accumulation_steps",
                self.gradient_accumulation_steps,
            ),
            ("num_mini_batches", self.num_mini_batches),
            ("num_ppo_epochs", self.num_ppo_epochs),
            (
                "micro_batch_positions",
                self.micro_batch_positions.unwrap_or(1),
            ),
            ("max_output_length", self.max_output_length),
            ("logging_steps", self.logging_steps),
        ] {
            if v == 0 {
                return bad(k, "must be at least 1".into());
            }
        }
        if !positive(self.learning_rate) {
            return bad(
                "learning_rate",
                format!("must be positive, got {}", self.learning_rate),
            );
        }
        if !(self.lr_end_factor.is_finite() && (0.0..=1.0).contains(&self.lr_end_factor)) {
            return bad(
                "lr_end_factor",
                format!("must be in [0, 1], got {}", self.lr_end_factor),
            );
        }
        if !positive(self.temperature) {
            return bad(
                "temperature",
                format!("must be positive, got {}", self.temperature),
            );
        }
        for (k, v) in [
            ("kl_coef", self.kl_coef),
            ("vf_coef", self.vf_coef),
            ("weight_decay", self.weight_decay),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return bad(k, format!("must be >= 0, got {v}"));
            }
        }
        for (k, v) in [
            ("cliprange", self.cliprange),
            ("cliprange_value", self.cliprange_value),
        ] {
            if !positive(v) {
                return bad(k, format!("must be positive, got {v}"));
            }
        }
        for (k, v) in [
            ("gamma", self.gamma),
            ("lam", self.lam),
            ("rule_discount", self.rule_discount),
        ] {
            if !(v.is_finite() && (0.0..=1.0).contains(&v)) {
                return bad(k, format!("must be in [0, 1], got {v}"));
            }
        }
        if let Some(a) = self.alpha.iter().find(|a| !a.is_finite()) {
            return bad("alpha", format!("must be finite, got {a}"));
        }
        if !self.penalty_reward_value.is_finite() {
            return bad("penalty_reward_value", "must be finite".into());
        }
        if let Err(e) = self.lora.to_model().validate() {
            return bad("lora", e.to_string());
        }
        if self.reward_feedback && self.score != MaporlScore::Verifier {
            // The original shows a learned verifier's probability; with correctness scores the
            // prompts would show every other agent's ground-truth 0/1 label.
            return bad(
                "reward_feedback",
                "is true but maporl.score is correctness: the next turn's prompts would show the other agents' \
                 ground-truth correctness (a label leak). Use maporl.score: verifier (with maporl.verifier_path or \
                 maporl.verifier_name), or reward_feedback: false"
                    .into(),
            );
        }
        Ok(())
    }
}
