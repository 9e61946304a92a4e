//! Draining the actor-critic buffers: normalised advantages, shuffled mini-batches, each actor's
//! and critic's update across the learner's ranks, and the critics' scalars of the step.

use super::*;

impl Trainer {
    /// Drains every agent's buffer: per agent, per turn, normalised advantages, shuffled
    /// mini-batches, one actor and one critic step each; then pushes the updated actors.
    ///
    /// With several ranks every rank holds the same buffer (every rank's samples, gathered after
    /// each round) and the same RNG, so every rank normalises, shuffles and cuts the same
    /// mini-batches; sample p of a mini-batch is rank p mod W's to back-propagate, each rank's
    /// losses are divided by the mini-batch's whole size, and the gradients are summed over the
    /// ranks before each step: every rank takes the step one rank would take on the mini-batch.
    pub(super) fn drain_buffers(
        &mut self,
        report: &mut CriticReport,
    ) -> Result<StepUpdates, TrainError> {
        let t = Instant::now();
        let cfg = self.s.cfg.clone();
        let ac = cfg.actor_critic.as_ref().expect("an actor-critic config");
        let batch = cfg
            .trainer
            .train_batch_size
            .unwrap_or(cfg.trainer.rollout_buffer_size)
            .max(1);
        let (loss_opts, _) = self.loss_setup();
        let (rank, world) = (self.dist.rank(), self.dist.world());
        let buffer = std::mem::take(&mut self.ac_buffer);
        let mut stats = Vec::new();
        let mut updated = vec![false; self.s.policies.len()];
        for a in 0..cfg.num_agents {
            let mut by_turn: BTreeMap<usize, Vec<AcSample>> = BTreeMap::new();
            for s in buffer.iter().filter(|s| s.agent == a) {
                by_turn.entry(s.turn).or_default().push(s.clone());
            }
            for (turn, mut group) in by_turn {
                let targets: Vec<f64> = group.iter().map(|s| s.target).collect();
                let old: Vec<f64> = group.iter().map(|s| s.old_value).collect();
                let (_, norm) =
                    normalized_advantages(&targets, &old, cfg.trainer.advantage_normalization);
                for (s, adv) in group.iter_mut().zip(norm) {
                    s.train.advantage = adv;
                }
                group.shuffle(&mut self.rng);
                let policy = self.s.agent_policy[a];
                let critic = if ac.centralised { 0 } else { a };
                for chunk in group.chunks(batch) {
                    let total = chunk.len();
                    let own: Vec<&AcSample> = chunk.iter().skip(rank).step_by(world).collect();
                    let samples: Vec<TrainSample> = own.iter().map(|s| s.train.clone()).collect();
                    let batches = [AgentBatches {
                        minibatches: vec![samples],
                        scale: 1.0,
                    }];
                    let rows: Vec<Vec<u32>> = own.iter().map(|s| s.value_input.clone()).collect();
                    let ys: Vec<f64> = own.iter().map(|s| s.target).collect();
                    if ac.value_head_on_actor {
                        // One step over L_pi + coef·L_v: the head's gradient joins the actor's.
                        let old: Vec<f64> = own.iter().map(|s| s.old_value).collect();
                        let head = &mut self.heads[policy];
                        head.optimizer.zero_grad();
                        let mut value_loss = 0.0;
                        let mut extra =
                            |model: &cotrain_model::families::CausalLm| -> Result<f64, TrainError> {
                                if rows.is_empty() {
                                    return Ok(0.0);
                                }
                                let v = head.values(model, &rows, true)?;
                                let y = tch::Tensor::from_slice(&ys).to_device(v.device());
                                let old = tch::Tensor::from_slice(&old).to_device(v.device());
                                let l = crate::algo::actor_critic::value_loss(
                                    &v,
                                    &y,
                                    ac.value_clip.map(|eps| (&old, eps)),
                                ) * (rows.len() as f64 / total as f64);
                                value_loss = l.double_value(&[]);
                                (l * ac.value_loss_coef).backward();
                                Ok(value_loss)
                            };
                        let s = self.s.policies[policy].update_with(
                            &batches,
                            &[total],
                            &loss_opts,
                            self.dist.as_ref(),
                            &mut extra,
                        )?;
                        // The same on every rank: the skip decision is the ranks' (see `update_with`).
                        if s.steps > 0 {
                            let value_loss = self.dist.sum_f64(&[value_loss])?[0];
                            crate::dist::all_reduce_grads(
                                self.dist.as_ref(),
                                &head.optimizer.parameters(),
                            )?;
                            let norm = head.optimizer.grad_norm();
                            head.optimizer.step_with_norm(norm);
                            report.value_losses.push((a, turn, value_loss));
                            report.grad_norms.push(s.grad_norm.hypot(norm));
                        } else {
                            report.skipped += 1;
                        }
                        head.optimizer.zero_grad();
                        updated[policy] |= s.steps > 0;
                        stats.push((policy, s));
                        continue;
                    }
                    let s = self.s.policies[policy].update_ranked(
                        &batches,
                        &[total],
                        &loss_opts,
                        1,
                        self.dist.as_ref(),
                    )?;
                    let skipped = s.skipped.is_some();
                    updated[policy] |= s.steps > 0;
                    stats.push((policy, s));
                    if skipped {
                        // Upstream stops on a non-finite loss; cotrain skips the mini-batch, both models.
                        report.skipped += 1;
                        continue;
                    }
                    match self.critics[critic].update(
                        &rows,
                        &ys,
                        ac.value_loss_coef,
                        total,
                        self.dist.as_ref(),
                    ) {
                        Ok(c) => {
                            report.value_losses.push((a, turn, c.value_loss));
                            report.grad_norms.push(c.grad_norm);
                        }
                        Err(TrainError::Update(m)) => {
                            warn!("{m}");
                            report.skipped += 1;
                        }
                        Err(e) => return Err(e),
                    }
                }
                report.drained.extend(group);
            }
        }
        let t_train = t.elapsed().as_secs_f64();
        let push = self.push_updated(&updated)?;
        Ok(StepUpdates {
            stats,
            concurrent: 1,
            t_train,
            push,
        })
    }
}

/// The critics' scalars of a step (none when no buffer was drained): value loss (before the
/// coefficient), explained variance of the targets by the rollout-time values, their means, the
/// raw advantages, and per turn the return and value loss.
pub(super) fn critic_metrics(m: &mut BTreeMap<String, f64>, r: &CriticReport) {
    m.insert("critic/skipped_updates".into(), r.skipped as f64);
    if r.drained.is_empty() {
        return;
    }
    let losses: Vec<f64> = r.value_losses.iter().map(|x| x.2).collect();
    if !losses.is_empty() {
        m.insert("critic/value_loss".into(), mean(&losses));
        m.insert("critic/grad_norm".into(), mean(&r.grad_norms));
    }
    let values: Vec<f64> = r.drained.iter().map(|s| s.old_value).collect();
    let targets: Vec<f64> = r.drained.iter().map(|s| s.target).collect();
    let adv: Vec<f64> = r.drained.iter().map(|s| s.target - s.old_value).collect();
    m.insert(
        "critic/explained_variance".into(),
        crate::algo::ppo::explained_variance(&values, &targets),
    );
    m.insert("critic/value_mean".into(), mean(&values));
    m.insert("critic/target_mean".into(), mean(&targets));
    m.insert("critic/advantage_mean".into(), mean(&adv));
    let adv_mean = mean(&adv);
    let var = adv.iter().map(|x| (x - adv_mean).powi(2)).sum::<f64>() / adv.len() as f64;
    m.insert("critic/advantage_std".into(), var.sqrt());
    let turns = r.drained.iter().map(|s| s.turn).max().unwrap_or(0) + 1;
    for t in 0..turns {
        let own: Vec<&AcSample> = r.drained.iter().filter(|s| s.turn == t).collect();
        if own.is_empty() {
            continue;
        }
        m.insert(
            format!("critic/turn{}/expected_return", t + 1),
            mean(&own.iter().map(|s| s.expected_return).collect::<Vec<_>>()),
        );
        m.insert(
            format!("critic/turn{}/reward_mean", t + 1),
            mean(&own.iter().map(|s| s.reward).collect::<Vec<_>>()),
        );
        let l: Vec<f64> = r
            .value_losses
            .iter()
            .filter(|x| x.1 == t)
            .map(|x| x.2)
            .collect();
        if !l.is_empty() {
            m.insert(format!("critic/turn{}/value_loss", t + 1), mean(&l));
        }
    }
    let agents = r
        .value_losses
        .iter()
        .map(|x| x.0)
        .max()
        .map_or(0, |a| a + 1);
    if agents > 1 {
        for a in 0..agents {
            let l: Vec<f64> = r
                .value_losses
                .iter()
                .filter(|x| x.0 == a)
                .map(|x| x.2)
                .collect();
            m.insert(format!("agent{a}/value_loss"), mean(&l));
        }
    }
}
