//! One on-policy step: roll out this rank's items, compute returns and advantages, update each
//! policy in its rounds, push the new weights, and report the step's scalars.

use std::collections::BTreeMap;
use std::time::Instant;

use super::batch::{
    AsyncReport, BufferedNode, PushReport, RolloutPlan, RolloutTimes, StepRollout, StepUpdates,
};
use super::policy::{AgentBatches, TrainSample};
use super::rounds::{Round, run_rounds};
use super::setup::{TAG_SAMPLE, Trainer};
use super::tree::{Expansion, Forest};
use crate::algo::{AdvantageOptions, LossOptions, RolloutBuffer};
use crate::config::{BatchUnit, KlPlacement, MultiTurnMode};
use crate::dist::SingleRank;
use crate::dist::rank_share;
use crate::error::TrainError;
use crate::prompts::items::TrainItem;
use crate::sources::WeightPush;

impl Trainer {
    /// The rollout plan of training: G per node, the configured variant (single-turn: the forest of
    /// roots only).
    pub(super) fn train_plan(&self, step: u64) -> RolloutPlan {
        let t = &self.s.cfg.trainer;
        let expansion = match t.rollout {
            MultiTurnMode::Tree => Expansion::Tree {
                termination_threshold: t.termination_threshold,
            },
            MultiTurnMode::Handoff => Expansion::Handoff {
                handoff: t.handoff,
                early_termination_threshold: t.early_termination_threshold,
            },
        };
        RolloutPlan {
            expansion,
            joint_mode: t.joint_mode,
            g: t.num_generations,
            seed_tag: TAG_SAMPLE,
            seed_step: step,
            greedy: false,
        }
    }

    /// One step on the given rows of the train split (see the module docs); returns its scalars.
    pub fn train_step(&mut self, rows: &[usize]) -> Result<BTreeMap<String, f64>, TrainError> {
        let t_step = Instant::now();
        if self.s.cfg.algorithm.is_actor_critic() {
            return self.train_step_actor_critic(rows, t_step);
        }
        if self.trains_between_items() {
            return self.train_step_item_by_item(rows, t_step);
        }
        let batch = self.roll_out_rows(rows, self.step)?;
        self.update_and_report(batch, t_step, None, AsyncReport::default())
    }

    /// Whether steps roll out and train item by item (`magrpo.train_between_items`, which applies
    /// to one-rank synchronous tree runs of several turns).
    pub(super) fn trains_between_items(&self) -> bool {
        let cfg = &self.s.cfg;
        cfg.trainer.train_between_items == Some(true)
            && cfg.trainer.rollout == MultiTurnMode::Tree
            && cfg.trainer.num_turns > 1
            && self.dist.world() == 1
            && cfg.raw.rollout.max_off_policy_steps == 0
    }

    /// A step as CoMLRL 2026 trains (`train_between_items`): each item is rolled out with the
    /// weights the previous items' updates left, its nodes join the buffer carried from earlier
    /// items (and steps), and every time the buffer holds `rollout_buffer_size` nodes they are
    /// trained (one update per turn among them, first turn first) and pushed. The step that ends
    /// an epoch trains what is left. The metrics are the whole step's.
    fn train_step_item_by_item(
        &mut self,
        rows: &[usize],
        t_step: Instant,
    ) -> Result<BTreeMap<String, f64>, TrainError> {
        // A failure before the step's first update leaves the state as the step found it (the
        // buffer as it was), so that a checkpoint of it resumes exactly; one after it cannot.
        let kept = self.buffered.len();
        self.updated_mid_step = false;
        let result = self.train_items_in_turn(rows, t_step);
        if result.is_err() && !self.updated_mid_step {
            self.buffered.truncate(kept);
        }
        if result.is_ok() {
            self.updated_mid_step = false;
        }
        result
    }

    fn train_items_in_turn(
        &mut self,
        rows: &[usize],
        t_step: Instant,
    ) -> Result<BTreeMap<String, f64>, TrainError> {
        let buffer_nodes = self.s.cfg.trainer.rollout_buffer_size.max(1);
        let ends_epoch = self.position as usize + rows.len() >= self.s.train_items.len();
        let mut step = StepRollout {
            rows: rows.to_vec(),
            items: Vec::new(),
            forest: Forest::default(),
            times: RolloutTimes::default(),
        };
        let mut updates = StepUpdates::default();
        let mut return_kl_coef = None;
        for (k, &row) in rows.iter().enumerate() {
            let mut one = self.roll_out_rows(&[row], self.step)?;
            return_kl_coef = self.prepare_forest(&mut one.forest)?;
            self.buffered.extend(
                one.forest
                    .preorder(0)
                    .into_iter()
                    .map(|id| buffered_node(&one.forest, id)),
            );
            let mut groups = Vec::new();
            while self.buffered.len() >= buffer_nodes {
                groups.extend(by_turn(self.buffered.drain(..buffer_nodes).collect()));
            }
            if ends_epoch && k + 1 == rows.len() {
                groups.extend(by_turn(std::mem::take(&mut self.buffered)));
            }
            if !groups.is_empty() {
                let t = Instant::now();
                let (loss_opts, epochs) = self.loss_setup();
                let rounds = self.rounds_of(groups)?;
                let concurrent = self.s.cfg.raw.learner.concurrent_policies;
                self.updated_mid_step = true;
                let done = run_rounds(
                    &mut self.s.policies,
                    &rounds,
                    &loss_opts,
                    epochs,
                    self.dist.as_ref(),
                    concurrent,
                )?;
                let t_train = t.elapsed().as_secs_f64();
                let policies: Vec<usize> = rounds.iter().map(|r| r.policy).collect();
                let push = self.push_updated(&done.updated)?;
                updates.absorb(StepUpdates {
                    stats: policies.into_iter().zip(done.stats).collect(),
                    concurrent: done.concurrent,
                    t_train,
                    push,
                });
            }
            step.forest.absorb(one.forest, step.items.len());
            step.items.extend(one.items);
            step.times.generate += one.times.generate;
            step.times.reward += one.times.reward;
            step.times.transition += one.times.transition;
        }
        self.report_step(
            step,
            updates,
            return_kl_coef,
            t_step,
            AsyncReport::default(),
        )
    }

    /// This rank's share of `rows` rolled out as step `step` (its seeds).
    pub(super) fn roll_out_rows(
        &mut self,
        rows: &[usize],
        step: u64,
    ) -> Result<StepRollout, TrainError> {
        let layout = self.layout();
        // This rank's shard of the step's items: every shards-th, from its shard on.
        let items: Vec<TrainItem> = rank_share(rows, layout.shard, layout.shards)
            .iter()
            .map(|&r| self.s.train_items[r].clone())
            .collect();
        let plan = self.train_plan(step);
        if layout.own.is_none() {
            let refs: Vec<&TrainItem> = items.iter().collect();
            let (forest, times) = self.roll_out(&refs, &plan)?;
            return Ok(StepRollout {
                rows: rows.to_vec(),
                items,
                forest,
                times,
            });
        }
        // Agent placement: the ranks of policy 0 (ranks 0..shards) roll their shards out for every
        // agent; every other rank receives its shard's rollout from them.
        let (mut forest, mut times) = (Forest::default(), RolloutTimes::default());
        if self.dist.rank() < layout.shards {
            let refs: Vec<&TrainItem> = items.iter().collect();
            (forest, times) = self.roll_out(&refs, &plan)?;
        }
        let bytes = serde_json::to_vec(&forest)
            .map_err(|e| TrainError::Dist(format!("serialising the step's rollouts: {e}")))?;
        let all = self.dist.all_gather_bytes(&bytes)?;
        let forest = serde_json::from_slice(&all[layout.shard])
            .map_err(|e| TrainError::Dist(format!("rank {}'s rollouts: {e}", layout.shard)))?;
        Ok(StepRollout {
            rows: rows.to_vec(),
            items,
            forest,
            times,
        })
    }

    /// Advantages, the optimiser rounds (on another thread while `lookahead`'s rollout is drawn
    /// here, for asynchronous rollouts), the weight push and the step's metrics.
    pub(super) fn update_and_report(
        &mut self,
        batch: StepRollout,
        t_step: Instant,
        lookahead: Option<&[usize]>,
        mut report: AsyncReport,
    ) -> Result<BTreeMap<String, f64>, TrainError> {
        let StepRollout {
            rows,
            items,
            mut forest,
            times,
        } = batch;
        let handoff = self.s.cfg.trainer.rollout == MultiTurnMode::Handoff;
        let return_kl_coef = self.prepare_forest(&mut forest)?;

        // 4–5. updates: the groups of nodes the original updates on, one optimiser round per policy each.
        let t = Instant::now();
        let (loss_opts, epochs) = self.loss_setup();
        let plans = self.plan_rounds(&forest, items.len(), handoff)?;
        let concurrent = self.s.cfg.raw.learner.concurrent_policies;
        let done = match lookahead {
            None => run_rounds(
                &mut self.s.policies,
                &plans,
                &loss_opts,
                epochs,
                self.dist.as_ref(),
                concurrent,
            )?,
            Some(next) => {
                // The policies train on another thread; rollouts meanwhile read the served versions.
                let mut policies = std::mem::take(&mut self.s.policies);
                self.lent = Some(
                    policies
                        .iter()
                        .map(|p| (p.worker_agent.clone(), p.wire_version))
                        .collect(),
                );
                let (trained, drawn) = std::thread::scope(|scope| {
                    let worker = scope.spawn(|| {
                        let t = Instant::now();
                        // In turn: the rollout below already has the other cores.
                        (
                            run_rounds(
                                &mut policies,
                                &plans,
                                &loss_opts,
                                epochs,
                                &SingleRank,
                                false,
                            ),
                            t.elapsed().as_secs_f64(),
                        )
                    });
                    let t = Instant::now();
                    let drawn = self.roll_out_rows(next, self.step + 1);
                    let gen_secs = t.elapsed().as_secs_f64();
                    (worker.join(), (drawn, gen_secs))
                });
                self.s.policies = policies;
                self.lent = None;
                let (trained, train_secs) =
                    trained.map_err(|_| TrainError::Panicked("the update thread"))?;
                let (drawn, gen_secs) = drawn;
                self.pending = Some(drawn?);
                report.overlap_secs = train_secs.min(gen_secs);
                report.lookahead_generate_secs = gen_secs;
                trained?
            }
        };
        let t_train = t.elapsed().as_secs_f64();
        let push = self.push_updated(&done.updated)?;
        let policies: Vec<usize> = plans.iter().map(|r| r.policy).collect();
        let updates = StepUpdates {
            stats: policies.into_iter().zip(done.stats).collect(),
            concurrent: done.concurrent,
            t_train,
            push,
        };
        self.report_step(
            StepRollout {
                rows,
                items,
                forest,
                times,
            },
            updates,
            return_kl_coef,
            t_step,
            report,
        )
    }

    /// Returns, the reference KL where it shapes them, advantages and turn weights of `forest`'s
    /// nodes; the KL coefficient when it shapes the returns.
    fn prepare_forest(&mut self, forest: &mut Forest) -> Result<Option<f64>, TrainError> {
        let cfg = self.s.cfg.clone();
        let handoff = cfg.trainer.rollout == MultiTurnMode::Handoff;
        forest.compute_returns(cfg.trainer.discount, !handoff);
        let kl = &cfg.trainer.reference_kl;
        let return_kl_coef =
            (kl.enabled && kl.placement == KlPlacement::Returns).then_some(kl.coef);
        if return_kl_coef.is_some() {
            self.measure_reference_kl(forest)?;
        }
        forest.compute_advantages(
            cfg.num_agents,
            &AdvantageOptions::from_section(&cfg.trainer),
            return_kl_coef,
        );
        forest.assign_turn_weights(
            &cfg.turn_gradient_weights,
            cfg.trainer.early_termination_weight,
            handoff,
        );
        Ok(return_kl_coef)
    }

    /// The loss options and epochs of every update.
    pub(super) fn loss_setup(&self) -> (LossOptions, usize) {
        let cfg = &self.s.cfg;
        let mut loss_opts = LossOptions::from_section(&cfg.trainer);
        loss_opts.scale = 1.0;
        if cfg.raw.rollout.max_off_policy_steps > 0 || super::rollout_precision_differs(cfg) {
            // Off-policy samples, or samples drawn in another precision (bf16 rollouts of an f32
            // policy): the workers' log-probs are the behaviour policy.
            loss_opts.truncated_is = cfg.raw.rollout.importance_weight_cap;
            loss_opts.measure_gap = true;
        }
        let epochs = if cfg.trainer.ppo_clip.enabled {
            cfg.trainer.ppo_clip.epochs
        } else {
            1
        };
        (loss_opts, epochs)
    }

    /// 6. The new weights of the `updated` policies reach every worker before anything else is
    ///    sampled (rank 0 pushes; the other ranks wait for it).
    pub(super) fn push_updated(&mut self, updated: &[bool]) -> Result<PushReport, TrainError> {
        let t = Instant::now();
        let mut push = PushReport::default();
        let changed: Vec<usize> = updated
            .iter()
            .enumerate()
            .filter(|(_, c)| **c)
            .map(|(pi, _)| pi)
            .collect();
        if self.dist.is_root() && !changed.is_empty() {
            // Every changed policy at once: the pushes overlap where the source can.
            let params: Vec<_> = changed
                .iter()
                .map(|&pi| self.s.policies[pi].parameters())
                .collect();
            let probes = changed
                .iter()
                .map(|&pi| self.s.policies[pi].weight_probe())
                .collect::<Result<Vec<_>, _>>()?;
            let updates: Vec<WeightPush> = changed
                .iter()
                .zip(&params)
                .zip(&probes)
                .map(|((&pi, params), probe)| {
                    let p = &self.s.policies[pi];
                    WeightPush {
                        agent: &p.worker_agent,
                        version: p.wire_version + 1,
                        params,
                        lora_scaling: p.lora_scaling(),
                        probe: Some(probe),
                    }
                })
                .collect();
            self.s.rollout.push_weights_all(&updates)?;
            if let Some(last) = self.s.rollout.last_push() {
                push.bytes += last.bytes;
                push.workers = push.workers.max(last.workers);
            }
        }
        for &pi in &changed {
            self.s.policies[pi].wire_version += 1;
        }
        if self.dist.world() > 1 {
            self.dist.barrier()?;
        }
        push.secs = t.elapsed().as_secs_f64();
        Ok(push)
    }

    /// The optimiser rounds of a step: per update group (see [`Forest::update_groups`]; with several
    /// ranks one group per turn, so that every rank runs the same rounds); see [`Self::rounds_of`].
    pub(super) fn plan_rounds(
        &mut self,
        forest: &Forest,
        items: usize,
        handoff: bool,
    ) -> Result<Vec<Round>, TrainError> {
        let cfg = &self.s.cfg;
        let groups = if self.dist.world() > 1 {
            forest.groups_by_turn(items, cfg.trainer.num_turns)
        } else {
            forest.update_groups(items, cfg.trainer.rollout_buffer_size, handoff)
        };
        let groups = groups
            .iter()
            .map(|g| g.iter().map(|&id| buffered_node(forest, id)).collect())
            .collect();
        self.rounds_of(groups)
    }

    /// The optimiser rounds of update groups of nodes: per group and policy, the policy's agents'
    /// samples in mini-batches and their counts over all ranks. With `train_batch_unit: nodes` on
    /// one rank, each mini-batch is a round of its own (CoMLRL 2026 steps the optimiser after
    /// each); otherwise a group's mini-batches make one optimiser step. Groups no rank has samples
    /// in are left out.
    pub(super) fn rounds_of(
        &mut self,
        groups: Vec<Vec<BufferedNode>>,
    ) -> Result<Vec<Round>, TrainError> {
        let cfg = &self.s.cfg;
        let n = cfg.num_agents;
        let step_per_minibatch =
            cfg.trainer.train_batch_unit == Some(BatchUnit::Nodes) && self.dist.world() == 1;
        let mut rounds = Vec::new();
        for group in groups {
            let mut buffers: Vec<RolloutBuffer<TrainSample>> =
                (0..n).map(|_| RolloutBuffer::new(group.len())).collect();
            for node in group {
                for (buffer, samples) in buffers.iter_mut().zip(node.samples) {
                    buffer.push_node(samples);
                }
            }
            let own = self.layout().own;
            for policy in 0..self.s.policies.len() {
                let members: Vec<usize> = (0..n)
                    .filter(|&a| self.s.agent_policy[a] == policy)
                    .collect();
                let scale = 1.0 / members.len().max(1) as f64;
                // Agent placement: another rank computes this policy's gradients (this one adds zeros).
                let mine = own.is_none_or(|o| o == policy);
                let minibatches: Vec<Vec<Vec<TrainSample>>> = members
                    .iter()
                    .map(|&a| match (mine, cfg.trainer.train_batch_unit) {
                        (false, _) => Vec::new(),
                        (true, Some(BatchUnit::Nodes)) => buffers[a]
                            .drain_node_minibatches(&mut self.rng, cfg.trainer.train_batch_size),
                        (true, _) => buffers[a]
                            .drain_minibatches(&mut self.rng, cfg.trainer.train_batch_size),
                    })
                    .collect();
                let parts: Vec<Vec<Vec<Vec<TrainSample>>>> = if step_per_minibatch {
                    // Round k: every member's k-th mini-batch.
                    let most = minibatches.iter().map(Vec::len).max().unwrap_or(0);
                    let mut per_member: Vec<std::vec::IntoIter<Vec<TrainSample>>> =
                        minibatches.into_iter().map(Vec::into_iter).collect();
                    (0..most)
                        .map(|_| {
                            per_member
                                .iter_mut()
                                .map(|it| it.next().into_iter().collect())
                                .collect()
                        })
                        .collect()
                } else {
                    vec![minibatches]
                };
                for part in parts {
                    let batches: Vec<AgentBatches> = part
                        .into_iter()
                        .map(|minibatches| AgentBatches { minibatches, scale })
                        .collect();
                    let local: Vec<f64> = batches
                        .iter()
                        .map(|b| b.minibatches.iter().map(Vec::len).sum::<usize>() as f64)
                        .collect();
                    let totals: Vec<usize> = self
                        .dist
                        .sum_f64(&local)?
                        .iter()
                        .map(|&c| c as usize)
                        .collect();
                    if totals.iter().any(|&c| c > 0) {
                        rounds.push(Round {
                            policy,
                            batches,
                            totals,
                        });
                    }
                }
            }
        }
        Ok(rounds)
    }
}

/// Node `id` of `forest` as its agents' training samples.
fn buffered_node(forest: &Forest, id: usize) -> BufferedNode {
    let node = &forest.nodes[id];
    let samples = (0..node.samples.len())
        .map(|a| {
            node.samples[a]
                .iter()
                .enumerate()
                .map(|(k, s)| TrainSample {
                    prompt: node.prompts[a].ids.clone(),
                    completion: s.token_ids.clone(),
                    advantage: node.advantages[a][k],
                    weight: node.turn_weight,
                    old_logprobs: s.logprobs.clone(),
                })
                .collect()
        })
        .collect();
    BufferedNode {
        turn: node.turn,
        samples,
    }
}

/// A processed buffer's update groups: its nodes by turn, first turn first, each in buffer order.
fn by_turn(nodes: Vec<BufferedNode>) -> Vec<Vec<BufferedNode>> {
    let mut groups: BTreeMap<usize, Vec<BufferedNode>> = BTreeMap::new();
    for node in nodes {
        groups.entry(node.turn).or_default().push(node);
    }
    groups.into_values().collect()
}
