//! The update math of GRPO / MAGRPO (docs/src/trainers/magrpo.md), as pure functions over rewards and per-token
//! log-prob tensors so that it is testable without a model:
//! joint actions and credit ([`joint`]), reward processing and advantages ([`advantage`]), the policy
//! loss with its options ([`loss`]), the reference KL as return shaping ([`reference_kl`]), rollout
//! buffers ([`buffer`]) and the optimiser side ([`optim`]).

pub mod actor_critic;
pub mod advantage;
pub mod buffer;
pub mod discussion_score;
pub mod joint;
pub mod loss;
pub mod optim;
pub mod padding;
pub mod ppo;
pub mod reference_kl;

pub use advantage::{RewardProcessor, advantages};
pub use buffer::RolloutBuffer;
pub use joint::{JointAction, credit_per_agent, joint_actions};
pub use loss::{LossOptions, LossTerms, PolicyBatch, policy_loss};
pub use optim::{AdamW, AdamWConfig};
pub use reference_kl::{kl_shaped_returns, sequence_kl};

use crate::config::{AdvantageMode, JointMode};

/// Advantage settings of a trainer section.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdvantageOptions {
    pub joint_mode: JointMode,
    pub mode: AdvantageMode,
    /// The normalisation form when `advantage_normalization` is on.
    pub normalize: Option<crate::config::NormalizationForm>,
    pub clamp: Option<f64>,
}

impl AdvantageOptions {
    pub fn from_section(s: &crate::config::TrainerSection) -> Self {
        // The form is filled in by config validation; a section typed by hand defaults to `uncentred`.
        let form = s
            .advantage_normalization_form
            .unwrap_or(crate::config::NormalizationForm::Uncentred);
        Self {
            joint_mode: s.joint_mode,
            mode: s.advantage_mode,
            normalize: s.advantage_normalization.then_some(form),
            clamp: s.advantage_clamp,
        }
    }
}

/// Per agent, per completion advantage of one single-turn node: raw joint rewards (one per joint action
/// of `joint_actions(joint_mode, N, g)`) → reward processor → credit per completion → advantage over
/// the agent's G siblings.
pub fn node_advantages(
    joint_rewards: &[f64],
    num_agents: usize,
    g: usize,
    processor: &RewardProcessor,
    opts: &AdvantageOptions,
) -> Vec<Vec<f64>> {
    let processed: Vec<f64> = joint_rewards.iter().map(|r| processor.apply(*r)).collect();
    credit_per_agent(opts.joint_mode, num_agents, g, &processed)
        .iter()
        .map(|credit| advantages(credit, opts.mode, opts.normalize, opts.clamp))
        .collect()
}
