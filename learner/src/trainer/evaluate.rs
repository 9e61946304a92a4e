//! Evaluation: k samples per item of the eval split, the rewards of each path's last turn, and the
//! code tasks' PassOrNot@k / Accuracy@k / MaxCoop@k.

use std::collections::BTreeMap;
use std::time::Instant;

use super::batch::RolloutPlan;
use super::setup::{TAG_EVAL, Trainer};
use super::step_metrics::reward_metrics;
use super::tree::{Expansion, Forest};
use crate::config::{EvalDecoding, JointMode, MultiTurnMode};
use crate::error::TrainError;
use crate::prompts::items::TrainItem;
use crate::sources::{CodeOutcome, Score};

/// The offline code metrics over items, each with its joint samples in drawing order.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AtK {
    /// PassOrNot@k: the fraction of items where one of the first k samples passes every test.
    pub pass: f64,
    /// Accuracy@k: the mean over items of the best fraction of tests passed among the first k.
    pub accuracy: f64,
    /// MaxCoop@k: the mean over items of the best cooperation bonus among the first k.
    pub max_coop: f64,
}

/// PassOrNot@k, Accuracy@k and MaxCoop@k (docs/src/trainers/magrpo.md) over `items`, each holding at
/// least k outcomes (fewer: all it has).
pub fn code_at_k(items: &[Vec<CodeOutcome>], k: usize) -> AtK {
    let c = items.len().max(1) as f64;
    let (mut pass, mut accuracy, mut max_coop) = (0.0, 0.0, 0.0);
    for node in items {
        let first = &node[..k.min(node.len())];
        pass += first.iter().any(CodeOutcome::all_passed) as u8 as f64;
        accuracy += first.iter().map(CodeOutcome::pass_rate).fold(0.0, f64::max);
        let best_coop = first
            .iter()
            .map(|o| o.cooperation_bonus)
            .fold(f64::NEG_INFINITY, f64::max);
        max_coop += if first.is_empty() { 0.0 } else { best_coop };
    }
    AtK {
        pass: pass / c,
        accuracy: accuracy / c,
        max_coop: max_coop / c,
    }
}

/// The scores of the last turn of each path of an evaluation forest's item, in joint-sample order:
/// path j starts at the root's joint action j and follows its child (one joint action each) down.
pub(super) fn path_final_scores(forest: &Forest, item: usize) -> Vec<Score> {
    let Some(root) = forest
        .nodes
        .iter()
        .find(|n| n.item == item && n.parent.is_none())
    else {
        return Vec::new();
    };
    (0..root.scores.len())
        .map(|j| {
            let (mut node, mut joint) = (root, j);
            while let Some(&c) = node
                .children
                .iter()
                .find(|&&c| forest.nodes[c].parent_joint == Some(joint))
            {
                node = &forest.nodes[c];
                joint = 0;
            }
            node.scores[joint].clone()
        })
        .collect()
}

impl Trainer {
    /// Evaluates on the first `eval_num_samples` eval items with `samples` joint samples per item
    /// (fixed seeds, so evaluations at different steps are comparable). Multi-turn: every joint sample
    /// is one path through the turns (one sample per agent per turn, the next prompt built from the
    /// path's previous joint action) that stops at the variant's stopping rule; the path's last turn
    /// is what the reward and @k metrics read, and each turn's reward is logged. The metrics: the mean
    /// of the reward and of each level over the paths' last turns and, for code, PassOrNot@k,
    /// Accuracy@k and MaxCoop@k for each k in `ks` that is at most `samples`. During training the
    /// original draws one joint sample per item (`samples` = 1); `learner eval --k 1,5,10` draws the
    /// largest k. With `eval_decoding: greedy` and `samples` = 1 every completion is the argmax one.
    pub fn evaluate(
        &mut self,
        samples: usize,
        ks: &[usize],
    ) -> Result<BTreeMap<String, f64>, TrainError> {
        let count = self
            .s
            .cfg
            .trainer
            .eval_num_samples
            .min(self.s.eval_items.len());
        let items: Vec<TrainItem> = self.s.eval_items[..count].to_vec();
        let mut m = BTreeMap::new();
        if items.is_empty() || samples == 0 {
            return Ok(m);
        }
        let t = Instant::now();
        let refs: Vec<&TrainItem> = items.iter().collect();
        let tr = &self.s.cfg.trainer;
        let expansion = match tr.rollout {
            // CoMLRL 2026 plays every turn of an eval path; the earlier trainer stopped it as training does.
            MultiTurnMode::Tree if tr.eval_all_turns == Some(true) => Expansion::Paths {
                stop_above: None,
                inclusive: false,
            },
            MultiTurnMode::Tree => Expansion::Paths {
                stop_above: tr.termination_threshold,
                inclusive: false,
            },
            MultiTurnMode::Handoff => Expansion::Paths {
                stop_above: tr.early_termination_threshold,
                inclusive: true,
            },
        };
        // The September 2025 trainer's eval generate followed the base model's generation_config
        // (greedy for its Qwen2.5-Coder models) with one return sequence, and sampled with more.
        let greedy = tr.eval_decoding == EvalDecoding::Greedy && samples == 1;
        let plan = RolloutPlan {
            expansion,
            joint_mode: JointMode::Aligned,
            g: samples,
            seed_tag: TAG_EVAL,
            seed_step: 0,
            greedy,
        };
        let (forest, _) = self.roll_out(&refs, &plan)?;
        let finals: Vec<Vec<Score>> = (0..items.len())
            .map(|i| path_final_scores(&forest, i))
            .collect();
        let all: Vec<&Score> = finals.iter().flatten().collect();
        reward_metrics(&mut m, "eval/", &all);
        if self.s.cfg.is_multi_turn() {
            for turn in 0..self.s.cfg.trainer.num_turns {
                let at: Vec<&Score> = forest
                    .nodes
                    .iter()
                    .filter(|n| n.turn == turn)
                    .flat_map(|n| &n.scores)
                    .collect();
                if !at.is_empty() {
                    reward_metrics(&mut m, &format!("eval/turn_{}/", turn + 1), &at);
                }
            }
            let stopped = forest.nodes.iter().filter(|n| n.early_stop).count() as f64;
            m.insert("eval/early_terminations".into(), stopped);
        }
        if self.s.is_code {
            let outcomes: Vec<Vec<CodeOutcome>> = finals
                .iter()
                .map(|node| node.iter().map(|s| s.code.unwrap_or_default()).collect())
                .collect();
            for &k in ks.iter().filter(|&&k| k >= 1 && k <= samples) {
                let at = code_at_k(&outcomes, k);
                m.insert(format!("eval/pass@{k}"), at.pass);
                m.insert(format!("eval/accuracy@{k}"), at.accuracy);
                m.insert(format!("eval/maxcoop@{k}"), at.max_coop);
            }
        }
        m.insert("eval/items".into(), count as f64);
        m.insert("eval/time".into(), t.elapsed().as_secs_f64());
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn at_k_metrics_on_known_outcomes() {
        let o = |p: u64, t: u64, coop: f64| CodeOutcome {
            passed_tests: p,
            total_tests: t,
            cooperation_bonus: coop,
        };
        // Item A: samples pass 1/4, 4/4, 2/4 with bonuses 0, 1.5, 0.5; item B: 0/3, 3/3 (bonus −0.5
        // then 1.0), 0/3; item C has no tests (never a pass).
        let items = vec![
            vec![o(1, 4, 0.0), o(4, 4, 1.5), o(2, 4, 0.5)],
            vec![o(0, 3, -0.5), o(0, 3, 0.0), o(3, 3, 1.0)],
            vec![o(0, 0, 0.0), o(0, 0, 0.0), o(0, 0, 0.0)],
        ];
        // k = 1: A 1/4 (no pass, coop 0), B 0 (coop −0.5), C 0.
        let a1 = code_at_k(&items, 1);
        assert_eq!(a1.pass, 0.0);
        assert!((a1.accuracy - 0.25 / 3.0).abs() < 1e-12);
        assert!((a1.max_coop - (0.0 - 0.5 + 0.0) / 3.0).abs() < 1e-12);
        // k = 2: A passes (coop 1.5), B best 0/3 (coop 0.0).
        let a2 = code_at_k(&items, 2);
        assert!((a2.pass - 1.0 / 3.0).abs() < 1e-12);
        assert!((a2.accuracy - 1.0 / 3.0).abs() < 1e-12);
        assert!((a2.max_coop - 1.5 / 3.0).abs() < 1e-12);
        // k = 3 (and any larger k): both A and B pass.
        let a3 = code_at_k(&items, 10);
        assert!((a3.pass - 2.0 / 3.0).abs() < 1e-12);
        assert!((a3.accuracy - 2.0 / 3.0).abs() < 1e-12);
        assert!((a3.max_coop - 2.5 / 3.0).abs() < 1e-12);
    }
}
