//! What a step carries from one phase to the next: the rollout plan, the step's rollout on this
//! rank and its timings, what the asynchronous pipeline reports, the samples waiting in the
//! buffers (MAGRPO's nodes, the actor-critic trainers' completions) and what the updates did. Plain data, so that the
//! modules of the step depend on it and not on each other.

use super::policy::{TrainSample, UpdateStats};
use super::tree::{Expansion, Forest};
use crate::config::JointMode;
use crate::prompts::items::TrainItem;

/// What a rollout is for: training (G per node, the configured variant) or evaluation (k paths).
#[derive(Debug, Clone, Copy)]
pub struct RolloutPlan {
    pub expansion: Expansion,
    pub joint_mode: JointMode,
    /// Samples per agent at the roots.
    pub g: usize,
    /// Seed tag and step (training: the step; evaluation: 0, so evaluations are comparable).
    pub seed_tag: u64,
    pub seed_step: u64,
    /// Argmax decoding instead of the training sampling parameters (`eval_decoding: greedy`).
    pub greedy: bool,
}

/// Wall-clock seconds of a rollout's phases.
#[derive(Debug, Clone, Copy, Default)]
pub struct RolloutTimes {
    pub generate: f64,
    pub reward: f64,
    pub transition: f64,
}

/// One step's rollout on this rank: its rows, this rank's share of their items, the forest.
pub struct StepRollout {
    pub rows: Vec<usize>,
    pub items: Vec<TrainItem>,
    pub forest: Forest,
    pub times: RolloutTimes,
}

/// What an asynchronous step reports beside the usual metrics.
#[derive(Debug, Default)]
pub struct AsyncReport {
    pub staleness: Vec<f64>,
    pub dropped: usize,
    pub redrawn: usize,
    pub overlap_secs: f64,
    pub lookahead_generate_secs: f64,
}

/// One completion waiting in its agent's buffer.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub(super) struct AcSample {
    pub(super) agent: usize,
    pub(super) turn: usize,
    /// The actor's sample; `advantage` is y − V_old until the drain normalises it.
    pub(super) train: TrainSample,
    /// What the critic reads.
    pub(super) value_input: Vec<u32>,
    // (JSON, in checkpoints and between ranks, writes a non-finite value as `null`: read as NaN.)
    #[serde(deserialize_with = "super::policy::null_as_nan")]
    pub(super) old_value: f64,
    #[serde(deserialize_with = "super::policy::null_as_nan")]
    pub(super) target: f64,
    /// The reward after the processor (before any reference-KL shaping; upstream's `reward`).
    #[serde(deserialize_with = "super::policy::null_as_nan")]
    pub(super) reward: f64,
    /// Σ of this and the later turns' rewards (upstream's `expected_return`).
    #[serde(deserialize_with = "super::policy::null_as_nan")]
    pub(super) expected_return: f64,
}

/// One tree node's training samples, per agent, waiting in the rollout buffer.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub(super) struct BufferedNode {
    pub(super) turn: usize,
    pub(super) samples: Vec<Vec<TrainSample>>,
}

/// What a step's optimiser rounds did: each round's policy and statistics, and the pushes.
#[derive(Default)]
pub(super) struct StepUpdates {
    pub(super) stats: Vec<(usize, UpdateStats)>,
    /// How many policies were updated at the same time (the most of any batch of rounds).
    pub(super) concurrent: usize,
    pub(super) t_train: f64,
    pub(super) push: PushReport,
}

impl StepUpdates {
    pub(super) fn absorb(&mut self, other: StepUpdates) {
        self.stats.extend(other.stats);
        self.concurrent = self.concurrent.max(other.concurrent);
        self.t_train += other.t_train;
        self.push.bytes += other.push.bytes;
        self.push.workers = self.push.workers.max(other.push.workers);
        self.push.secs += other.push.secs;
    }
}

/// The weight pushes of a step.
#[derive(Default)]
pub(super) struct PushReport {
    pub(super) bytes: u64,
    pub(super) workers: usize,
    pub(super) secs: f64,
}
