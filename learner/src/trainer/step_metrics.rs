//! The scalars a step reports: from its forest (rewards per turn and agent, returns, counts), its
//! updates, pushes and timings ([`Trainer::report_step`], which also writes the rollout log), and
//! writing them to the run's metrics.

use std::collections::BTreeMap;
use std::time::Instant;

use super::batch::{AsyncReport, StepRollout};
use super::batch::{PushReport, StepUpdates};
use super::policy::UpdateStats;
use super::setup::Trainer;
use super::tree::Forest;
use crate::error::TrainError;
use crate::metrics::mean;
use crate::prompts::items::TrainItem;
use crate::sources::GenSample;
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
    /// The step's scalars (rank 0 gathers every rank's nodes first) and its rollout log.
    pub(super) fn report_step(
        &mut self,
        step: StepRollout,
        updates: StepUpdates,
        return_kl_coef: Option<f64>,
        t_step: Instant,
        report: AsyncReport,
    ) -> Result<BTreeMap<String, f64>, TrainError> {
        let cfg = self.s.cfg.clone();
        let world = self.dist.world();
        let StepRollout {
            rows,
            items,
            forest,
            times,
        } = step;
        let StepUpdates {
            stats: rounds,
            concurrent,
            t_train,
            push,
        } = updates;
        let PushReport {
            bytes: push_bytes,
            workers: push_workers,
            secs: t_sync,
        } = push;
        // Rank 0 reports the whole step: every rank's nodes, its items in the same order.
        let (forest, items) = if world > 1 {
            self.gather_step(forest, &rows)?
        } else {
            (forest, items)
        };
        if forest.nodes.is_empty() && !self.dist.is_root() {
            return Ok(BTreeMap::new());
        }
        let item_refs: Vec<&TrainItem> = items.iter().collect();

        if cfg.raw.logging.rollouts {
            let path = self.s.run_dir.join("rollouts.jsonl");
            crate::trainer::rollout_log::append(&path, self.step + 1, &forest, &item_refs)
                .map_err(|e| TrainError::Io(format!("{}: {e}", path.display())))?;
        }

        // Metrics.
        let mut m = BTreeMap::new();
        let all: Vec<&Score> = forest.nodes.iter().flat_map(|n| &n.scores).collect();
        reward_metrics(&mut m, "", &all);
        if cfg.is_multi_turn() {
            turn_metrics(&mut m, &forest, cfg.trainer.num_turns, items.len());
        }
        let samples: Vec<&GenSample> = forest
            .nodes
            .iter()
            .flat_map(|n| n.samples.iter().flatten())
            .collect();
        let lens: Vec<f64> = samples.iter().map(|s| s.token_ids.len() as f64).collect();
        let gen_tokens: f64 = lens.iter().sum();
        m.insert("completion_len/mean".into(), mean(&lens));
        m.insert(
            "completion_len/max".into(),
            lens.iter().cloned().fold(0.0, f64::max),
        );
        m.insert(
            "completion/stopped_frac".into(),
            mean(
                &samples
                    .iter()
                    .map(|s| s.stopped as u8 as f64)
                    .collect::<Vec<_>>(),
            ),
        );
        if cfg.num_agents > 1 {
            // Per agent: its completions (each may sample with its own settings) and its policy's learning rate.
            for a in 0..cfg.num_agents {
                let own: Vec<f64> = forest
                    .nodes
                    .iter()
                    .filter_map(|n| n.samples.get(a))
                    .flatten()
                    .map(|s| s.token_ids.len() as f64)
                    .collect();
                m.insert(format!("agent{a}/completion_len/mean"), mean(&own));
                m.insert(
                    format!("agent{a}/learning_rate"),
                    self.s.policies[self.s.agent_policy[a]].optimizer.cfg.lr,
                );
            }
        }
        let trained: Vec<&UpdateStats> = rounds
            .iter()
            .map(|(_, s)| s)
            .filter(|s| s.skipped.is_none() && s.steps > 0)
            .collect();
        let avg = |f: fn(&UpdateStats) -> f64| {
            if trained.is_empty() {
                f64::NAN
            } else {
                trained.iter().map(|s| f(s)).sum::<f64>() / trained.len() as f64
            }
        };
        m.insert("loss".into(), avg(|s| s.loss));
        match return_kl_coef {
            // Return shaping: the mean KL per completion over the step (the loss holds no KL term),
            // and the mean amount taken off the returns.
            Some(coef) => {
                let kls: Vec<f64> = forest
                    .nodes
                    .iter()
                    .flat_map(|n| n.reference_kl.iter().flatten().copied())
                    .collect();
                m.insert("kl".into(), mean(&kls));
                m.insert("kl/return_penalty".into(), coef * mean(&kls));
            }
            None => {
                m.insert("kl".into(), avg(|s| s.kl));
            }
        }
        m.insert("entropy".into(), avg(|s| s.entropy));
        m.insert("grad_norm".into(), avg(|s| s.grad_norm));
        if cfg.trainer.ppo_clip.enabled {
            m.insert("clip_fraction".into(), avg(|s| s.clip_fraction));
        }
        let policies = self.s.policies.len();
        if policies > 1 {
            for pi in 0..policies {
                let own: Vec<f64> = rounds
                    .iter()
                    .filter(|(p, s)| *p == pi && s.skipped.is_none() && s.steps > 0)
                    .map(|(_, s)| s.loss)
                    .collect();
                m.insert(
                    format!("policy{pi}/loss"),
                    if own.is_empty() { f64::NAN } else { mean(&own) },
                );
            }
        }
        let rounds: Vec<&UpdateStats> = rounds.iter().map(|(_, s)| s).collect();
        m.insert(
            "skipped_updates".into(),
            rounds.iter().filter(|s| s.skipped.is_some()).count() as f64,
        );
        m.insert(
            "optimizer_steps".into(),
            rounds.iter().map(|s| s.steps as f64).sum::<f64>(),
        );
        m.insert("concurrent_policies".into(), concurrent as f64);
        let train_tokens: f64 = rounds.iter().map(|s| s.tokens).sum();
        m.insert(
            "tokens_per_s".into(),
            if times.generate > 0.0 {
                gen_tokens / times.generate
            } else {
                0.0
            },
        );
        m.insert(
            "train_tokens_per_s".into(),
            if t_train > 0.0 {
                train_tokens / t_train
            } else {
                0.0
            },
        );
        m.insert("time/generate".into(), times.generate);
        m.insert("time/reward".into(), times.reward);
        if cfg.is_multi_turn() {
            m.insert("time/transition".into(), times.transition);
        }
        m.insert("time/train".into(), t_train);
        m.insert(
            "time/train_forward".into(),
            rounds.iter().map(|s| s.secs_forward).sum::<f64>(),
        );
        m.insert(
            "time/train_backward".into(),
            rounds.iter().map(|s| s.secs_backward).sum::<f64>(),
        );
        m.insert(
            "time/train_optimizer".into(),
            rounds.iter().map(|s| s.secs_optimizer).sum::<f64>(),
        );
        m.insert(
            "train/minibatches_without_gradient".into(),
            rounds
                .iter()
                .map(|s| s.minibatches_without_gradient as f64)
                .sum::<f64>(),
        );
        if world > 1 {
            m.insert(
                "time/train_allreduce".into(),
                rounds.iter().map(|s| s.secs_allreduce).sum::<f64>(),
            );
            m.insert("ranks".into(), world as f64);
        }
        m.insert("time/weight_sync".into(), t_sync);
        if cfg.raw.rollout.max_off_policy_steps > 0 {
            m.insert("async/staleness_mean".into(), mean(&report.staleness));
            m.insert(
                "async/staleness_max".into(),
                report.staleness.iter().cloned().fold(0.0, f64::max),
            );
            m.insert("async/dropped_samples".into(), report.dropped as f64);
            m.insert("async/redrawn_samples".into(), report.redrawn as f64);
            m.insert("async/overlap_secs".into(), report.overlap_secs);
            m.insert("time/generate_next".into(), report.lookahead_generate_secs);
        }
        if cfg.raw.rollout.max_off_policy_steps > 0 || super::rollout_precision_differs(&cfg) {
            m.insert("is/weight_mean".into(), avg(|s| s.is_weight_mean));
            m.insert("is/truncated_frac".into(), avg(|s| s.is_truncated_fraction));
        }
        if trained.iter().any(|s| s.logprob_gap > 0.0) {
            m.insert("logprob_gap".into(), avg(|s| s.logprob_gap));
        }
        if push_workers > 0 {
            m.insert("weight_sync/bytes".into(), push_bytes as f64);
            m.insert("weight_sync/workers".into(), push_workers as f64);
        }
        if let Some(pool) = self.s.rollout.pool_stats() {
            m.insert("pool/workers".into(), pool.workers as f64);
            m.insert("pool/in_rotation".into(), pool.in_rotation as f64);
            m.insert("pool/failed_attempts".into(), pool.failed_attempts as f64);
            m.insert("pool/catch_ups".into(), pool.catch_ups as f64);
        }
        m.insert("time/step".into(), t_step.elapsed().as_secs_f64());
        m.insert(
            "reward/outage_secs".into(),
            self.s.reward.take_outage_secs(),
        );
        m.insert("epoch".into(), self.epoch as f64);
        m.insert(
            "policy_version".into(),
            self.s
                .policies
                .iter()
                .map(|p| p.wire_version)
                .max()
                .unwrap_or(0) as f64,
        );
        Ok(m)
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
