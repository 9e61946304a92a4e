//! The actor-critic trainers, IAC and MAAC (CoMLRL 1.4.3's `IACTrainer`/`MAACTrainer`), on the
//! MAGRPO trainer's rollouts: items are rolled out one at a time (a chain of turns with one sample
//! per agent, or `num_generations` samples of a single turn), the critics value every completion
//! when it is drawn, each completion joins its agent's buffer with its TD target
//! ([`crate::algo::actor_critic`]), and whenever the buffers hold `rollout_buffer_size` samples
//! (checked after each item, as upstream) they are drained: per agent, per turn (first turn
//! first), the advantages are normalised, shuffled into mini-batches of `train_batch_size`, and
//! each mini-batch takes one actor step (MAGRPO's summed-log-prob loss with the advantage) and one
//! critic step (value_loss_coef · mean squared error). The updated actors are pushed before the
//! next item is rolled out. The epoch's last step drains what is left.
//!
//! IAC: critic i reads agent i's own prompt (V) or prompt and completion (Q). MAAC: one critic reads
//! every agent's prompt as one text (`[Agent i] ...`), with the joint action for Q, tokenised with
//! agent 0's tokenizer; its value is every agent's baseline.

mod drain;

use std::collections::BTreeMap;
use std::time::Instant;

use rand::seq::SliceRandom;
use tracing::warn;

use super::batch::{AcSample, AsyncReport, RolloutTimes, StepRollout, StepUpdates};
use super::policy::{AgentBatches, TrainSample};
use super::setup::Trainer;
use super::tree::Forest;
use crate::algo::actor_critic::{
    critic_input, normalized_advantages, td_targets, undiscounted_returns,
};
use crate::config::{CriticType, KlPlacement};
use crate::dist::rank_share;
use crate::error::TrainError;
use crate::metrics::mean;
use crate::prompts::items::TrainItem;

/// What a step's drains did to the critics, for its metrics.
#[derive(Default)]
pub(super) struct CriticReport {
    value_losses: Vec<(usize, usize, f64)>,
    grad_norms: Vec<f64>,
    skipped: usize,
    drained: Vec<AcSample>,
}

impl Trainer {
    /// One step of the actor-critic trainers; see the module docs. A failure before the step's
    /// first drain leaves the buffers as the step found them, so that a checkpoint of that state
    /// resumes exactly; one after it cannot.
    pub(super) fn train_step_actor_critic(
        &mut self,
        rows: &[usize],
        t_step: Instant,
    ) -> Result<BTreeMap<String, f64>, TrainError> {
        let kept = self.ac_buffer.len();
        self.updated_mid_step = false;
        let result = self.actor_critic_items(rows, t_step);
        match &result {
            Err(_) if !self.updated_mid_step => self.ac_buffer.truncate(kept),
            Ok(_) => self.updated_mid_step = false,
            Err(_) => {}
        }
        result
    }

    fn actor_critic_items(
        &mut self,
        rows: &[usize],
        t_step: Instant,
    ) -> Result<BTreeMap<String, f64>, TrainError> {
        let size = self.s.cfg.trainer.rollout_buffer_size.max(1);
        let ends_epoch = self.position as usize + rows.len() >= self.s.train_items.len();
        let kl = &self.s.cfg.trainer.reference_kl;
        let kl_coef = (kl.enabled && kl.placement == KlPlacement::Returns).then_some(kl.coef);
        // With several ranks (data placement) the ranks go through their shares in lockstep: round
        // k rolls out item k of each rank's share at once, and every rank's samples join one
        // buffer that every rank holds (see `drain_buffers`).
        let layout = self.layout();
        let mine = rank_share(rows, layout.shard, layout.shards);
        let rounds = rows.len().div_ceil(layout.shards);
        let mut step = StepRollout {
            rows: rows.to_vec(),
            items: Vec::new(),
            forest: Forest::default(),
            times: RolloutTimes::default(),
        };
        let mut updates = StepUpdates::default();
        let mut report = CriticReport::default();
        for k in 0..rounds {
            let mut one = self.roll_out_item(mine.get(k).copied())?;
            let mut samples = Vec::new();
            if !one.forest.nodes.is_empty() {
                if kl_coef.is_some() {
                    self.measure_reference_kl(&mut one.forest)?;
                }
                samples = self.value_samples(&mut one.forest, kl_coef)?;
            }
            let samples = self.gather_samples(samples)?;
            self.ac_buffer.extend(samples);
            let fullest = (0..self.s.cfg.num_agents)
                .map(|a| self.ac_buffer.iter().filter(|s| s.agent == a).count())
                .max()
                .unwrap_or(0);
            let last = ends_epoch && k + 1 == rounds;
            if fullest >= size || (last && !self.ac_buffer.is_empty()) {
                self.updated_mid_step = true;
                updates.absorb(self.drain_buffers(&mut report)?);
            }
            step.forest.absorb(one.forest, step.items.len());
            step.items.extend(one.items);
            step.times.generate += one.times.generate;
            step.times.reward += one.times.reward;
            step.times.transition += one.times.transition;
        }
        let mut m = self.report_step(step, updates, kl_coef, t_step, AsyncReport::default())?;
        if self.dist.is_root() {
            drain::critic_metrics(&mut m, &report);
        }
        Ok(m)
    }

    /// Train row `row` rolled out alone (nothing when this rank has no item in this round).
    fn roll_out_item(&mut self, row: Option<usize>) -> Result<StepRollout, TrainError> {
        let items: Vec<TrainItem> = row
            .map(|r| self.s.train_items[r].clone())
            .into_iter()
            .collect();
        let (forest, times) = if items.is_empty() {
            (Forest::default(), RolloutTimes::default())
        } else {
            let plan = self.train_plan(self.step);
            let refs: Vec<&TrainItem> = items.iter().collect();
            self.roll_out(&refs, &plan)?
        };
        Ok(StepRollout {
            rows: row.into_iter().collect(),
            items,
            forest,
            times,
        })
    }

    /// Every rank's new buffer samples of this round, in rank order (one rank: its own).
    fn gather_samples(&self, mine: Vec<AcSample>) -> Result<Vec<AcSample>, TrainError> {
        if self.dist.world() == 1 {
            return Ok(mine);
        }
        let bytes = serde_json::to_vec(&mine)
            .map_err(|e| TrainError::Dist(format!("serialising the buffer's new samples: {e}")))?;
        let mut all = Vec::new();
        for (rank, b) in self.dist.all_gather_bytes(&bytes)?.iter().enumerate() {
            let part: Vec<AcSample> = serde_json::from_slice(b)
                .map_err(|e| TrainError::Dist(format!("rank {rank}'s buffer samples: {e}")))?;
            all.extend(part);
        }
        Ok(all)
    }

    /// The critics' rollout-time values of every completion of `forest` (one item), their TD
    /// targets and raw advantages (also written into the nodes, for the rollout log), as buffer
    /// samples.
    fn value_samples(
        &mut self,
        forest: &mut Forest,
        kl_coef: Option<f64>,
    ) -> Result<Vec<AcSample>, TrainError> {
        let ac = self
            .s
            .cfg
            .actor_critic
            .clone()
            .expect("an actor-critic config");
        let n = self.s.cfg.num_agents;
        // Each completion's critic input, per critic (separate critics, or the actors' heads).
        let mut inputs: Vec<Vec<Vec<u32>>> =
            vec![Vec::new(); self.critics.len().max(self.heads.len())];
        let mut slot: Vec<Vec<Vec<(usize, usize)>>> = Vec::new(); // [node][agent][k] = (critic, row)
        for node in &forest.nodes {
            let g = node.g;
            let mut per_agent: Vec<Vec<(usize, usize)>> = vec![Vec::with_capacity(g); n];
            if ac.centralised {
                let tokenizer = &self.s.policies[self.s.agent_policy[0]].model.tokenizer;
                let prompts: Vec<&str> = node.prompts.iter().map(|p| p.text.as_str()).collect();
                for k in 0..g {
                    let actions: Vec<&str> =
                        (0..n).map(|a| node.samples[a][k].text.as_str()).collect();
                    let text = match ac.critic_type {
                        CriticType::V => critic_input(&prompts, None),
                        CriticType::Q => critic_input(&prompts, Some(&actions)),
                    };
                    // V: one input for the node, its value every completion's baseline.
                    let row = if ac.critic_type == CriticType::V && k > 0 {
                        per_agent[0][0].1
                    } else {
                        // Upstream's tokenizer call truncates at the model's length.
                        let mut ids = crate::prompts::items::encode_text(tokenizer, &text)?;
                        ids.truncate(self.s.cfg.raw.model.max_length);
                        inputs[0].push(ids);
                        inputs[0].len() - 1
                    };
                    for a in per_agent.iter_mut() {
                        a.push((0, row));
                    }
                }
            } else {
                for (a, slots) in per_agent.iter_mut().enumerate() {
                    // IAC: agent a's critic, or the head on its policy.
                    let c = if ac.value_head_on_actor {
                        self.s.agent_policy[a]
                    } else {
                        a
                    };
                    for k in 0..g {
                        let mut ids = node.prompts[a].ids.clone();
                        if ac.critic_type == CriticType::Q {
                            ids.extend_from_slice(&node.samples[a][k].token_ids);
                        }
                        inputs[c].push(ids);
                        slots.push((c, inputs[c].len() - 1));
                    }
                }
            }
            slot.push(per_agent);
        }
        let values: Vec<Vec<f64>> = inputs
            .iter()
            .enumerate()
            .map(
                |(c, rows)| match (rows.is_empty(), ac.value_head_on_actor) {
                    (true, _) => Ok(Vec::new()),
                    (false, false) => self.critics[c].predict(rows),
                    (false, true) => self.heads[c].predict(&self.s.policies[c].model.model, rows),
                },
            )
            .collect::<Result<_, _>>()?;

        // Targets and returns, children before parents (a chain: the child continuing joint k).
        let discount = self.s.cfg.trainer.discount;
        let ids: Vec<usize> = forest.preorder(0);
        let mut samples = Vec::new();
        let (mut node_values, mut node_targets, mut node_adv, mut node_returns) = (
            vec![Vec::new(); forest.nodes.len()],
            vec![Vec::new(); forest.nodes.len()],
            vec![Vec::new(); forest.nodes.len()],
            vec![Vec::new(); forest.nodes.len()],
        );
        for &id in ids.iter().rev() {
            let node = &forest.nodes[id];
            let (mut vs, mut ys, mut adv, mut rets) = (
                vec![Vec::new(); n],
                vec![Vec::new(); n],
                vec![Vec::new(); n],
                vec![Vec::new(); n],
            );
            for a in 0..n {
                for (k, &(c, row)) in slot[id][a].iter().enumerate().take(node.g) {
                    let v = values[c][row];
                    let env_reward = node.rewards[k];
                    let mut r = env_reward;
                    if let Some(coef) = kl_coef {
                        r -= coef * node.reference_kl[a][k];
                    }
                    let child = node
                        .children
                        .iter()
                        .copied()
                        .find(|&ch| forest.nodes[ch].parent_joint == Some(k));
                    let (rewards, values_next) = match child {
                        Some(ch) => (
                            vec![r, 0.0],
                            vec![
                                v,
                                node_values[ch]
                                    .get(a)
                                    .and_then(|x: &Vec<f64>| x.first().copied())
                                    .unwrap_or(0.0),
                            ],
                        ),
                        None => (vec![r], vec![v]),
                    };
                    let y = td_targets(&rewards, &values_next, discount)[0];
                    // This turn's reward, then the child's return stands for the later turns'.
                    let mut chain = vec![r];
                    chain.extend(child.map(|ch| {
                        node_returns[ch]
                            .get(a)
                            .and_then(|x: &Vec<f64>| x.first().copied())
                            .unwrap_or(0.0)
                    }));
                    let ret = undiscounted_returns(&chain)[0];
                    let s = &node.samples[a][k];
                    samples.push(AcSample {
                        agent: a,
                        turn: node.turn,
                        train: TrainSample {
                            prompt: node.prompts[a].ids.clone(),
                            completion: s.token_ids.clone(),
                            advantage: y - v,
                            weight: 1.0,
                            old_logprobs: s.logprobs.clone(),
                        },
                        value_input: inputs[c][row].clone(),
                        old_value: v,
                        target: y,
                        reward: env_reward,
                        expected_return: ret,
                    });
                    vs[a].push(v);
                    ys[a].push(y);
                    adv[a].push(y - v);
                    rets[a].push(ret);
                }
            }
            node_values[id] = vs;
            node_targets[id] = ys;
            node_adv[id] = adv;
            node_returns[id] = rets;
        }
        for (id, node) in forest.nodes.iter_mut().enumerate() {
            // Per joint action (aligned: sample k of every agent), the agents' mean return from
            // this turn on (the same for every agent unless the reference KL shapes the rewards).
            node.returns = (0..node.g)
                .map(|k| node_returns[id].iter().map(|r| r[k]).sum::<f64>() / n as f64)
                .collect();
            node.values = std::mem::take(&mut node_values[id]);
            node.value_targets = std::mem::take(&mut node_targets[id]);
            node.advantages = std::mem::take(&mut node_adv[id]);
        }
        // Buffer order as upstream appends: turn by turn, agent by agent.
        samples.sort_by_key(|s| (s.turn, s.agent));
        Ok(samples)
    }
}
