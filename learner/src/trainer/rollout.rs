//! Rolling out one step's forest ([`super::tree`]) depth by depth, batched like a serving system:
//! every node of one depth (across the step's items) asks the rollout workers in one concurrent
//! batch, is scored in one reward call, and its children's feedback comes from one analysis call
//! (or one batch of expert requests).

use std::time::Instant;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::batch::{RolloutPlan, RolloutTimes};
use super::setup::Trainer;
use super::transition::{TransitionInput, extend_history, feedback_texts, fit_prompt};
use super::tree::{AgentPrompt, Forest, Node, expand, node_actions};
use crate::algo::RewardProcessor;
use crate::error::TrainError;
use crate::prompts::items::TrainItem;
use crate::prompts::multiturn::{AgentTurn, NextTurn};
use crate::seeds::derive_seed;
use crate::sources::{GenRequest, GenSample, Score, ScoreAction};

const TAG_HANDOFF: u64 = 5;

impl Trainer {
    /// Rolls out `items` to the end of every branch; see the module docs.
    pub(super) fn roll_out(
        &mut self,
        items: &[&TrainItem],
        plan: &RolloutPlan,
    ) -> Result<(Forest, RolloutTimes), TrainError> {
        let n = self.s.cfg.num_agents;
        let turns = self.s.cfg.trainer.num_turns;
        let processor = RewardProcessor::from_config(&self.s.cfg.raw.reward_processor);
        let mut times = RolloutTimes::default();
        let mut forest = Forest::default();
        for (i, item) in items.iter().enumerate() {
            let prompts = (0..n)
                .map(|a| AgentPrompt {
                    text: item.texts.get(a).cloned().unwrap_or_default(),
                    ids: item.prompts[a].clone(),
                })
                .collect();
            forest
                .nodes
                .push(Node::new(i, i, 0, 0, plan.g, prompts, vec![Vec::new(); n]));
        }
        let sampling: Vec<_> = (0..n)
            .map(|a| {
                if plan.greedy {
                    self.sampling(a).greedy()
                } else {
                    self.sampling(a)
                }
            })
            .collect();
        let mut locals = vec![1usize; items.len()];
        let mut frontier: Vec<usize> = (0..items.len()).collect();
        while !frontier.is_empty() {
            // 1. generate: every (node, agent) of this depth in one batch.
            let t = Instant::now();
            let mut reqs = Vec::new();
            let mut agents = Vec::new();
            for &id in &frontier {
                let node = &forest.nodes[id];
                let item = items[node.item];
                for (a, agent_sampling) in sampling.iter().enumerate() {
                    let (worker_agent, version) = self.target(a);
                    // Roots keep the single-turn seed (so single-turn runs draw what they always drew).
                    let seed = if node.parent.is_none() {
                        derive_seed(&[
                            self.s.cfg.raw.seed,
                            plan.seed_tag,
                            plan.seed_step,
                            a as u64,
                            item.index as u64,
                        ])
                    } else {
                        derive_seed(&[
                            self.s.cfg.raw.seed,
                            plan.seed_tag,
                            plan.seed_step,
                            a as u64,
                            item.index as u64,
                            node.turn as u64,
                            node.local as u64,
                        ])
                    };
                    reqs.push(GenRequest {
                        agent: worker_agent,
                        prompt: node.prompts[a].ids.clone(),
                        n: node.g,
                        sampling: agent_sampling.clone(),
                        seed,
                        min_policy_version: version,
                    });
                    agents.push(a);
                }
            }
            let mut drawn = self.draw_samples(&reqs, &agents)?.into_iter();
            for &id in &frontier {
                let g = forest.nodes[id].g;
                let per_agent: Vec<Vec<GenSample>> =
                    (0..n).map(|_| drawn.next().unwrap_or_default()).collect();
                if let Some((a, s)) = per_agent.iter().enumerate().find(|(_, s)| s.len() != g) {
                    return Err(TrainError::Rollout(format!(
                        "asked agent {a} for {g} samples, got {}",
                        s.len()
                    )));
                }
                forest.nodes[id].samples = per_agent;
            }
            times.generate += t.elapsed().as_secs_f64();

            // 2. score: every joint action of this depth in one call.
            let t = Instant::now();
            let mut batch = Vec::new();
            for &id in &frontier {
                let node = &mut forest.nodes[id];
                // Evaluation paths pair sample j of every agent; training follows joint_mode.
                node.actions = node_actions(plan.joint_mode, n, node.g);
                let item = items[node.item];
                for action in &node.actions {
                    let picks: Vec<&GenSample> = action
                        .iter()
                        .enumerate()
                        .map(|(a, &k)| &node.samples[a][k])
                        .collect();
                    batch.push(ScoreAction {
                        completions: picks.iter().map(|s| s.text.clone()).collect(),
                        completion_ids: picks.iter().map(|s| s.token_ids.clone()).collect(),
                        item: item.item.clone(),
                    });
                }
            }
            let mut scores = self.score_actions(&batch)?.into_iter();
            for &id in &frontier {
                let node = &mut forest.nodes[id];
                node.scores = (0..node.actions.len())
                    .map(|_| scores.next().unwrap_or_default())
                    .collect();
                node.rewards = node
                    .scores
                    .iter()
                    .map(|s| processor.apply(s.reward))
                    .collect();
            }
            times.reward += t.elapsed().as_secs_f64();

            // 3. grow: leaves and children, their feedback in one call, their prompts.
            let t = Instant::now();
            let mut specs = Vec::new();
            for &id in &frontier {
                let node = &mut forest.nodes[id];
                let item = items[node.item];
                let mut rng = ChaCha8Rng::seed_from_u64(derive_seed(&[
                    self.s.cfg.raw.seed,
                    TAG_HANDOFF,
                    plan.seed_step,
                    item.index as u64,
                    node.turn as u64,
                    node.local as u64,
                ]));
                specs.extend(expand(node, turns, plan.expansion, &mut rng));
            }
            let inputs: Vec<TransitionInput<'_>> = specs
                .iter()
                .map(|c| {
                    let parent = &forest.nodes[c.parent];
                    TransitionInput {
                        item: &items[parent.item].item,
                        completions: c
                            .picks
                            .iter()
                            .enumerate()
                            .map(|(a, &k)| parent.samples[a][k].text.clone())
                            .collect(),
                        completion_ids: c
                            .picks
                            .iter()
                            .enumerate()
                            .map(|(a, &k)| parent.samples[a][k].token_ids.clone())
                            .collect(),
                    }
                })
                .collect();
            let feedback = feedback_texts(
                self.s.reward.as_mut(),
                self.expert.as_ref(),
                &self.s.task,
                &self.s.cfg.raw.external,
                &inputs,
            )?;
            drop(inputs);
            let encoding = self.s.cfg.prompt_encoding();
            let mut next = Vec::with_capacity(specs.len());
            for (((spec, feedback), expert_failure), report) in specs
                .iter()
                .zip(&feedback.texts)
                .zip(feedback.expert_failures)
                .zip(&feedback.reports)
            {
                let parent = &forest.nodes[spec.parent];
                let item = items[parent.item];
                let mut prompts = Vec::with_capacity(n);
                let mut history = Vec::with_capacity(n);
                let mut truncated = 0;
                for (a, agent_feedback) in feedback.iter().enumerate().take(n) {
                    let h = extend_history(
                        &parent.history[a],
                        &parent.prompts[a].text,
                        &parent.samples[a][spec.picks[a]].text,
                    );
                    let original = item.texts.get(a).map(String::as_str).unwrap_or_default();
                    let turn = AgentTurn {
                        next: NextTurn {
                            original_prompt: original,
                            history: &h,
                            feedback: agent_feedback,
                        },
                        agent: a,
                        item: &item.item,
                        row: item.index,
                        report: report.as_ref(),
                    };
                    let model = &self.s.policies[self.s.agent_policy[a]].model;
                    let (prompt, dropped) = fit_prompt(
                        &turn,
                        &self.next_turn,
                        model,
                        &encoding,
                        self.s.cfg.max_prompt_tokens(a),
                    )
                    .map_err(|e| {
                        TrainError::Data(format!(
                            "row {} turn {}: agent {a}: {e}",
                            item.index,
                            parent.turn + 2
                        ))
                    })?;
                    truncated += dropped;
                    prompts.push(prompt);
                    history.push(h);
                }
                let id = forest.nodes.len() + next.len();
                let local = locals[parent.item];
                locals[parent.item] += 1;
                let mut child = Node::new(
                    id,
                    parent.item,
                    local,
                    parent.turn + 1,
                    spec.g,
                    prompts,
                    history,
                );
                child.parent = Some(spec.parent);
                child.parent_joint = spec.parent_joint;
                child.handoff = spec.parent_joint.is_none().then(|| spec.picks.clone());
                child.truncated = truncated;
                child.expert_failure = expert_failure;
                next.push(child);
            }
            frontier = next.iter().map(|c| c.id).collect();
            for child in next {
                let parent = child.parent.unwrap_or_default();
                forest.nodes[parent].children.push(child.id);
                forest.nodes.push(child);
            }
            let limit = self.s.cfg.trainer.max_nodes_per_item;
            if let Some(i) = (0..items.len()).find(|&i| locals[i] > limit) {
                return Err(TrainError::Config(format!(
                    "row {}: the rollout tree grew past {}.max_nodes_per_item = {limit} nodes; a tree has up to G^T leaves (aligned) or \
                     G^(N*T) (cross) without early stops: lower num_generations or num_turns, use joint_mode: aligned or rollout: handoff, \
                     or raise max_nodes_per_item",
                    items[i].index,
                    self.s.cfg.algorithm.section()
                )));
            }
            times.transition += t.elapsed().as_secs_f64();
        }
        Ok((forest, times))
    }

    /// Scores joint actions in one batch. Tasks scored per answer (GSM8K, ANLI) score each agent's
    /// completion alone and take the mean over the agents (levels likewise).
    pub(super) fn score_actions(
        &mut self,
        batch: &[ScoreAction],
    ) -> Result<Vec<Score>, TrainError> {
        let n = self.s.cfg.num_agents;
        let scores = if n > 1 && per_agent_task(&self.s.task) {
            let singles: Vec<ScoreAction> = batch
                .iter()
                .flat_map(|a| {
                    (0..n).map(move |i| ScoreAction {
                        completions: vec![a.completions[i].clone()],
                        completion_ids: vec![a.completion_ids[i].clone()],
                        item: a.item.clone(),
                    })
                })
                .collect();
            let s = self.s.reward.score(&self.s.task, &singles)?;
            if s.len() != singles.len() {
                return Err(TrainError::Reward(format!(
                    "{} scores for {} completions",
                    s.len(),
                    singles.len()
                )));
            }
            s.chunks(n).map(mean_score).collect()
        } else {
            self.s.reward.score(&self.s.task, batch)?
        };
        if scores.len() != batch.len() {
            return Err(TrainError::Reward(format!(
                "{} scores for {} joint actions",
                scores.len(),
                batch.len()
            )));
        }
        Ok(scores)
    }
}

/// Tasks whose reward scores one answer at a time.
pub(super) fn per_agent_task(task: &str) -> bool {
    matches!(task, "gsm8k" | "anli")
}

/// The mean of several scores (reward and every level); details of each kept in a list.
pub(super) fn mean_score(scores: &[Score]) -> Score {
    let k = scores.len().max(1) as f64;
    let mut levels = std::collections::BTreeMap::new();
    for s in scores {
        for (l, v) in &s.levels {
            *levels.entry(l.clone()).or_insert(0.0) += v / k;
        }
    }
    Score {
        reward: scores.iter().map(|s| s.reward).sum::<f64>() / k,
        levels,
        details: serde_json::Value::Array(scores.iter().map(|s| s.details.clone()).collect()),
        code: None,
    }
}
