//! Asynchronous rollouts (`rollout.max_off_policy_steps` > 0): the next step's rollout is drawn
//! while this one trains, and samples too far from the learner's version are dropped or redrawn.

use std::collections::BTreeMap;
use std::time::Instant;

use tracing::warn;

use super::batch::AsyncReport;
use super::setup::Trainer;
use super::tree::Forest;
use crate::error::TrainError;
use crate::prompts::items::TrainItem;

/// The items of a single-turn forest with a sample more than `k` versions older than the version
/// its agent trains now (`current[agent]`), or newer than it, with how many such samples each has.
pub(super) fn stale_items(forest: &Forest, current: &[u64], k: u64) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    for node in forest.nodes.iter().filter(|n| n.parent.is_none()) {
        let stale: usize = node
            .samples
            .iter()
            .enumerate()
            // A sample from a version newer than the learner's is from weights it never pushed.
            .map(|(a, samples)| {
                samples
                    .iter()
                    .filter(|s| s.policy_version > current[a] || current[a] - s.policy_version > k)
                    .count()
            })
            .sum();
        if stale > 0 {
            out.push((node.item, stale));
        }
    }
    out
}

impl Trainer {
    /// One step with asynchronous rollouts (`rollout.max_off_policy_steps` = k > 0): trains on the
    /// rollout drawn while the previous step trained (or draws it now), after redrawing every item
    /// with a sample more than k policy versions older than the policy it trains; while it trains
    /// (on another thread), the rollout of `next` is drawn from the weights the workers serve now.
    /// The loss corrects for the behaviour policy with truncated importance weights
    /// (`rollout.importance_weight_cap`). A checkpoint holds no rollout: a resumed run draws the
    /// rollout of its next step anew, from the restored policy.
    pub fn train_step_async(
        &mut self,
        rows: &[usize],
        next: Option<&[usize]>,
    ) -> Result<BTreeMap<String, f64>, TrainError> {
        let t_step = Instant::now();
        let k = self.s.cfg.raw.rollout.max_off_policy_steps as u64;
        let mut batch = match self.pending.take() {
            Some(b) if b.rows == rows => b,
            _ => self.roll_out_rows(rows, self.step)?,
        };
        let mut report = AsyncReport::default();
        let current: Vec<u64> = (0..self.s.cfg.num_agents)
            .map(|a| self.target(a).1)
            .collect();
        let stale = stale_items(&batch.forest, &current, k);
        if !stale.is_empty() {
            let t = Instant::now();
            report.dropped = stale.iter().map(|&(_, n)| n).sum();
            let redo_rows: Vec<usize> = stale.iter().map(|&(i, _)| batch.items[i].index).collect();
            warn!(
                items = stale.len(),
                samples = report.dropped,
                bound = k,
                "samples staler than max_off_policy_steps: redrawing their items"
            );
            let refs: Vec<&TrainItem> = stale.iter().map(|&(i, _)| &batch.items[i]).collect();
            let plan = self.train_plan(self.step);
            let (fresh, _) = self.roll_out(&refs, &plan)?;
            for (j, mut node) in fresh.nodes.into_iter().enumerate() {
                let (i, _) = stale[j];
                report.redrawn += node.samples.iter().map(Vec::len).sum::<usize>();
                node.id = i;
                node.item = i;
                batch.forest.nodes[i] = node;
            }
            debug_assert_eq!(redo_rows.len(), stale.len());
            batch.times.generate += t.elapsed().as_secs_f64();
        }
        for node in &batch.forest.nodes {
            for (a, samples) in node.samples.iter().enumerate() {
                report.staleness.extend(
                    samples
                        .iter()
                        .map(|s| current[a].saturating_sub(s.policy_version) as f64),
                );
            }
        }
        self.update_and_report(batch, t_step, next, report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sources::GenSample;

    /// Staleness for asynchronous rollouts: a sample more than k versions old is stale, and so is
    /// one from a version newer than the learner's (weights it never pushed), which used to count
    /// as fresh.
    #[test]
    fn samples_too_old_or_from_the_future_make_their_item_stale() {
        let sample = |v: u64| GenSample {
            token_ids: vec![1],
            text: String::new(),
            logprobs: vec![0.0],
            stopped: true,
            policy_version: v,
        };
        let node = |item: usize, versions: [u64; 2]| {
            let mut n = crate::trainer::tree::Node::new(
                item,
                item,
                0,
                0,
                1,
                vec![
                    crate::trainer::tree::AgentPrompt {
                        text: String::new(),
                        ids: vec![1]
                    };
                    2
                ],
                vec![Vec::new(); 2],
            );
            n.samples = versions.iter().map(|&v| vec![sample(v)]).collect();
            n
        };
        let forest = Forest {
            nodes: vec![
                node(0, [5, 5]),
                node(1, [3, 5]),
                node(2, [4, 6]),
                node(3, [2, 9]),
            ],
        };
        // The learner trains version 5 of both agents; k = 1.
        assert_eq!(
            stale_items(&forest, &[5, 5], 1),
            vec![(1, 1), (2, 1), (3, 2)]
        );
    }
}
