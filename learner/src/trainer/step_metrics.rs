//! The scalars a step reports from its forest (rewards per turn and agent, returns, counts), and
//! writing them to the run's metrics.

use std::collections::BTreeMap;

use super::setup::Trainer;
use super::tree::Forest;
use crate::error::TrainError;
use crate::metrics::mean;
use crate::sources::Score;

/// Per turn (from 1): the reward and each level over the turn's joint actions, the mean return, nodes
/// and early stops; and over the step: nodes per item, early terminations, history truncations.
pub(super) fn turn_metrics(
    m: &mut BTreeMap<String, f64>,
    forest: &Forest,
    turns: usize,
    items: usize,
) {
    for turn in 0..turns {
        let nodes: Vec<&super::tree::Node> =
            forest.nodes.iter().filter(|n| n.turn == turn).collect();
        let scores: Vec<&Score> = nodes.iter().flat_map(|n| &n.scores).collect();
        let prefix = format!("turn_{}/", turn + 1);
        m.insert(format!("{prefix}nodes"), nodes.len() as f64);
        if scores.is_empty() {
            continue;
        }
        reward_metrics(m, &prefix, &scores);
        let returns: Vec<f64> = nodes
            .iter()
            .flat_map(|n| n.returns.iter().copied())
            .collect();
        m.insert(format!("{prefix}return/mean"), mean(&returns));
        m.insert(
            format!("{prefix}early_terminations"),
            nodes.iter().filter(|n| n.early_stop).count() as f64,
        );
    }
    m.insert(
        "nodes_per_item".into(),
        forest.nodes.len() as f64 / items.max(1) as f64,
    );
    m.insert(
        "early_terminations".into(),
        forest.nodes.iter().filter(|n| n.early_stop).count() as f64,
    );
    m.insert(
        "prompt_truncations".into(),
        forest.nodes.iter().map(|n| n.truncated as f64).sum(),
    );
    // Nodes whose prompts carry no expert edits because the expert failed (`expert_edits`; 0 otherwise).
    m.insert(
        "expert_failures".into(),
        forest
            .nodes
            .iter()
            .filter(|n| n.expert_failure.is_some())
            .count() as f64,
    );
}

/// reward/mean, reward/std (unbiased), reward/max and the mean of every level.
pub(super) fn reward_metrics(m: &mut BTreeMap<String, f64>, prefix: &str, scores: &[&Score]) {
    let r: Vec<f64> = scores.iter().map(|s| s.reward).collect();
    let mu = mean(&r);
    let std = if r.len() > 1 {
        (r.iter().map(|x| (x - mu).powi(2)).sum::<f64>() / (r.len() - 1) as f64).sqrt()
    } else {
        0.0
    };
    m.insert(format!("{prefix}reward/mean"), mu);
    m.insert(format!("{prefix}reward/std"), std);
    m.insert(
        format!("{prefix}reward/max"),
        r.iter().cloned().fold(f64::NEG_INFINITY, f64::max),
    );
    let mut levels: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for s in scores {
        for (k, v) in &s.levels {
            levels.entry(k.as_str()).or_default().push(*v);
        }
    }
    for (k, v) in levels {
        m.insert(format!("{prefix}reward/{k}"), mean(&v));
    }
}

impl Trainer {
    pub(super) fn log(&mut self, values: &BTreeMap<String, f64>) -> Result<(), TrainError> {
        if let Some(metrics) = &mut self.metrics {
            metrics
                .log(self.step, values)
                .map_err(|e| TrainError::Io(format!("{}: {e}", metrics.path().display())))?;
        }
        self.history.push(values.clone());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trainer::rollout::mean_score;

    #[test]
    fn per_agent_scores_average_reward_and_levels() {
        let s = |r: f64| Score {
            reward: r,
            levels: [("level_1".to_string(), r)].into_iter().collect(),
            ..Default::default()
        };
        let m = mean_score(&[s(1.0), s(0.0)]);
        assert_eq!(m.reward, 0.5);
        assert_eq!(m.levels["level_1"], 0.5);
    }
}
