//! What a step carries from one phase to the next: the rollout plan, the step's rollout on this
//! rank and its timings, and what the asynchronous pipeline reports. Plain data, so that the
//! modules of the step depend on it and not on each other.

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
