//! A policy's update: the optimiser rounds over its agents' mini-batches through the chunked
//! log-prob kernel, with the gradient sum between learner ranks and one AdamW step.

use super::*;

impl Policy {
    /// One optimiser round (per PPO epoch when clipping is on): every agent's mini-batches are
    /// back-propagated through the chunked log-prob kernel with their loss scaled by
    /// `agent.scale · |batch| / |agent's samples|` (so each agent's loss is the mean over its
    /// samples, as the original's (1/K) Σ_k), then one AdamW step. A non-finite loss or gradient
    /// skips the step with a warning and drops the gradients.
    pub fn update(
        &mut self,
        agents: &[AgentBatches],
        loss_opts: &LossOptions,
        epochs: usize,
    ) -> Result<UpdateStats, TrainError> {
        let totals: Vec<usize> = agents
            .iter()
            .map(|a| a.minibatches.iter().map(Vec::len).sum())
            .collect();
        self.update_ranked(agents, &totals, loss_opts, epochs, &crate::dist::SingleRank)
    }

    /// [`Policy::update`] as one of the data-parallel ranks of `dist`: `totals[i]` is agent i's
    /// sample count over all ranks, so that each rank's losses are scaled by the global count; the
    /// gradients and the statistics are summed over the ranks before the AdamW step, and the decision
    /// to skip (a non-finite loss on any rank, a non-finite summed gradient) is the same everywhere.
    /// Every rank calls this for the same rounds, also with no samples of its own.
    pub fn update_ranked(
        &mut self,
        agents: &[AgentBatches],
        totals: &[usize],
        loss_opts: &LossOptions,
        epochs: usize,
        dist: &dyn crate::dist::Collective,
    ) -> Result<UpdateStats, TrainError> {
        // LoRA's dropout acts in the training forwards only, as PEFT's in train mode. Its masks come
        // from libtorch's one generator, seeded here from the policy's seed and optimiser step (a
        // checkpoint restores the step), so seeded runs repeat and resume exactly; the policies'
        // updates then run in turn (`rounds`), never drawing from it at the same time.
        if self.draws_dropout() {
            tch::manual_seed(
                crate::seeds::derive_seed(&[self.dropout_seed, self.optimizer.step]) as i64,
            );
        }
        self.set_adapter_training(true)?;
        let out = self.run_update(agents, totals, loss_opts, epochs, dist, None);
        self.set_adapter_training(false)?;
        out
    }

    /// [`Policy::update_ranked`] for one epoch, with `extra` adding its own gradient to the
    /// policy's before the gradients are summed over the ranks and the optimiser steps: it gets the
    /// policy's network (adapter set) after the policy loss's backward, back-propagates its loss
    /// (scaled by this rank's share, as the policy loss is) and returns its value (a non-finite one
    /// skips the step on every rank). IAC's value head on the actor trains this way, one step over
    /// both losses; what `extra` trains outside the policy's optimiser its caller sums over the ranks.
    pub fn update_with(
        &mut self,
        agents: &[AgentBatches],
        totals: &[usize],
        loss_opts: &LossOptions,
        dist: &dyn crate::dist::Collective,
        extra: &mut dyn FnMut(&cotrain_model::families::CausalLm) -> Result<f64, TrainError>,
    ) -> Result<UpdateStats, TrainError> {
        if self.draws_dropout() {
            tch::manual_seed(
                crate::seeds::derive_seed(&[self.dropout_seed, self.optimizer.step]) as i64,
            );
        }
        self.set_adapter_training(true)?;
        let out = self.run_update(agents, totals, loss_opts, 1, dist, Some(extra));
        self.set_adapter_training(false)?;
        out
    }

    /// Sets the policy's adapter (if any) on its network with or without its dropout.
    fn set_adapter_training(&self, training: bool) -> Result<(), TrainError> {
        match &self.adapter {
            Some(a) if a.config.dropout > 0.0 => self
                .model
                .model
                .set_adapter(Some(a), training)
                .map_err(|e| TrainError::Model(format!("lora of `{}`: {e}", self.worker_agent))),
            _ => Ok(()),
        }
    }

    /// [`Policy::update_ranked`]'s body.
    fn run_update(
        &mut self,
        agents: &[AgentBatches],
        totals: &[usize],
        loss_opts: &LossOptions,
        epochs: usize,
        dist: &dyn crate::dist::Collective,
        mut extra: Option<ExtraLoss<'_>>,
    ) -> Result<UpdateStats, TrainError> {
        let mut stats = UpdateStats::default();
        let behaviour =
            loss_opts.clip.is_some() || loss_opts.truncated_is.is_some() || loss_opts.measure_gap;
        if behaviour {
            // A ratio against padded zeros would be silently wrong: every token needs its log-prob.
            let short = agents
                .iter()
                .flat_map(|a| a.minibatches.iter().flatten())
                .find(|s| s.old_logprobs.len() != s.completion.len());
            if let Some(s) = short {
                return Err(TrainError::Rollout(format!(
                    "a sample has {} behaviour log-probs for its {} completion tokens (the rollout worker must return one per token)",
                    s.old_logprobs.len(),
                    s.completion.len()
                )));
            }
        }
        // Decoupled PPO (clipping against behaviour log-probs that are not the learner's own): the
        // proximal policy is this step's starting point, whose log-probs are the first epoch's
        // (the optimiser steps once per epoch), kept per mini-batch for the later epochs.
        let decoupled = loss_opts.clip.is_some() && loss_opts.truncated_is.is_some();
        let mut proximal: Vec<Vec<Option<Tensor>>> = agents
            .iter()
            .map(|a| a.minibatches.iter().map(|_| None).collect())
            .collect();
        for _ in 0..epochs.max(1) {
            self.optimizer.zero_grad();
            let (mut loss, mut kl, mut clip_tok, mut ent_sum, mut tokens) =
                (0.0, 0.0, 0.0, 0.0, 0.0);
            let (mut gap_tok, mut isw_tok, mut cut_tok) = (0.0, 0.0, 0.0);
            let mut bad_loss: Option<f64> = None;
            let (mut backpropagated, mut without_gradient) = (0u64, 0u64);
            'agents: for (ai, (agent, &total)) in agents.iter().zip(totals).enumerate() {
                for (mi, mb) in agent.minibatches.iter().enumerate() {
                    if mb.is_empty() {
                        continue;
                    }
                    let seqs: Vec<Sequence> = mb
                        .iter()
                        .map(|s| Sequence {
                            prompt: s.prompt.clone(),
                            completion: s.completion.clone(),
                        })
                        .collect();
                    let t_fwd = std::time::Instant::now();
                    let with_grad = has_gradient(mb, loss_opts);
                    let tlp = completion_logprobs(
                        &self.model.model,
                        &seqs,
                        &LogProbOptions {
                            chunk_size: self.chunk_size,
                            with_grad,
                            temperature: 1.0,
                        },
                    )
                    .map_err(|e| TrainError::Update(format!("log-probs: {e}")))?;
                    let (lp, mask) = tlp.padded();
                    let mask = mask.to_kind(Kind::Float);
                    let width = lp.size()[1] as usize;
                    // The per-sample inputs are built on the host and go where the log-probs are.
                    let device = lp.device();
                    let adv =
                        Tensor::from_slice(&mb.iter().map(|s| s.advantage).collect::<Vec<f64>>())
                            .to_device(device);
                    let weights =
                        Tensor::from_slice(&mb.iter().map(|s| s.weight).collect::<Vec<f64>>())
                            .to_device(device);
                    let old = behaviour.then(|| {
                        pad_values(mb.iter().map(|s| s.old_logprobs.as_slice()), width)
                            .to_device(device)
                    });
                    if decoupled && proximal[ai][mi].is_none() {
                        proximal[ai][mi] = Some(lp.detach().copy());
                    }
                    let reference = match (&self.reference, loss_opts.kl) {
                        (Some(r), Some(_)) => {
                            let t = completion_logprobs(
                                &r.model,
                                &seqs,
                                &LogProbOptions {
                                    chunk_size: self.chunk_size,
                                    with_grad: false,
                                    temperature: 1.0,
                                },
                            )
                            .map_err(|e| TrainError::Update(format!("reference log-probs: {e}")))?;
                            Some(t.padded().0)
                        }
                        _ => None,
                    };
                    let mut opts = *loss_opts;
                    opts.scale =
                        loss_opts.scale * agent.scale * mb.len() as f64 / total.max(1) as f64;
                    let batch = PolicyBatch {
                        logprobs: &lp,
                        mask: &mask,
                        advantages: &adv,
                        old_logprobs: old.as_ref(),
                        proximal_logprobs: proximal[ai][mi].as_ref(),
                        ref_logprobs: reference.as_ref(),
                        weights: Some(&weights),
                    };
                    let terms = policy_loss(&batch, &opts)
                        .map_err(|e| TrainError::Update(format!("loss: {e}")))?;
                    let value = terms.loss.double_value(&[]);
                    if !value.is_finite() {
                        bad_loss = Some(value);
                        break 'agents;
                    }
                    stats.secs_forward += t_fwd.elapsed().as_secs_f64();
                    let t_bwd = std::time::Instant::now();
                    if with_grad {
                        terms
                            .loss
                            .f_backward()
                            .map_err(|e| TrainError::Update(format!("backward: {e}")))?;
                        tlp.propagate()
                            .map_err(|e| TrainError::Update(format!("backward: {e}")))?;
                        backpropagated += 1;
                    } else {
                        without_gradient += 1;
                    }
                    stats.secs_backward += t_bwd.elapsed().as_secs_f64();
                    tracing::debug!(
                        policy = %self.worker_agent,
                        sequences = mb.len(),
                        tokens = seqs.iter().map(|s| s.prompt.len() + s.completion.len()).sum::<usize>(),
                        forward_secs = t_bwd.duration_since(t_fwd).as_secs_f64(),
                        backward_secs = t_bwd.elapsed().as_secs_f64(),
                        "mini-batch trained"
                    );
                    let w = mb.len() as f64 / total.max(1) as f64;
                    loss += value;
                    kl += terms.kl * w * agent.scale;
                    clip_tok += terms.clip_fraction * terms.tokens;
                    gap_tok += terms.logprob_gap * terms.tokens;
                    isw_tok += terms.is_weight_mean * terms.tokens;
                    cut_tok += terms.is_truncated_fraction * terms.tokens;
                    ent_sum += tlp.entropy.detach().sum(Kind::Double).double_value(&[]);
                    tokens += terms.tokens;
                }
            }
            if bad_loss.is_none()
                && let Some(extra) = extra.as_mut()
            {
                let value = extra(&self.model.model)?;
                if !value.is_finite() {
                    bad_loss = Some(value);
                }
            }
            // Every rank takes part in the same reductions, whatever its own samples did.
            let summed = dist.sum_f64(&[
                loss,
                kl,
                clip_tok,
                ent_sum,
                tokens,
                gap_tok,
                isw_tok,
                cut_tok,
                bad_loss.is_some() as u8 as f64,
            ])?;
            let [
                loss,
                kl,
                clip_tok,
                ent_sum,
                tokens,
                gap_tok,
                isw_tok,
                cut_tok,
                bad,
            ] = summed[..]
            else {
                unreachable!("nine values were summed")
            };
            if bad > 0.0 {
                self.optimizer.zero_grad();
                let why = match bad_loss {
                    Some(v) => format!("non-finite loss {v}"),
                    None => "non-finite loss on another rank".to_string(),
                };
                warn!(policy = %self.worker_agent, reason = %why, "skipping this update");
                stats.skipped = Some(why);
                return Ok(stats);
            }
            if backpropagated == 0 && without_gradient > 0 {
                // The original back-propagates the zero loss and steps AdamW with zero gradients.
                self.optimizer.zero_gradients_where_missing();
            }
            if dist.world() > 1 {
                let t_comm = std::time::Instant::now();
                crate::dist::all_reduce_grads(dist, &self.optimizer.parameters())?;
                stats.secs_allreduce += t_comm.elapsed().as_secs_f64();
            }
            let norm = self.optimizer.grad_norm();
            if !norm.is_finite() {
                self.optimizer.zero_grad();
                warn!(policy = %self.worker_agent, "non-finite gradient, skipping this update");
                stats.skipped = Some("non-finite gradient".into());
                return Ok(stats);
            }
            let t_opt = std::time::Instant::now();
            stats.grad_norm = self.optimizer.step_with_norm(norm);
            stats.secs_optimizer += t_opt.elapsed().as_secs_f64();
            self.optimizer.zero_grad();
            stats.steps += 1;
            // The figures of the last epoch are reported.
            stats.loss = loss;
            stats.kl = kl;
            stats.entropy = if tokens > 0.0 { ent_sum / tokens } else { 0.0 };
            let per_token = |x: f64| if tokens > 0.0 { x / tokens } else { 0.0 };
            stats.clip_fraction = per_token(clip_tok);
            stats.logprob_gap = per_token(gap_tok);
            stats.is_weight_mean = per_token(isw_tok);
            stats.is_truncated_fraction = per_token(cut_tok);
            stats.tokens = tokens;
            stats.minibatches_without_gradient = without_gradient;
        }
        Ok(stats)
    }
}

/// Whether a mini-batch's loss has a gradient. Every term of [`policy_loss`] is a sample's
/// advantage times its weight times a function of its log-probs, except the KL penalty (weight
/// times a function of the log-probs): with every `A·w` zero and no KL, or every weight zero, the
/// loss is 0 whatever the weights, and so is its gradient, exactly. Such a mini-batch (a GRPO group
/// whose samples all got the same reward) needs its log-probs only for the statistics, so they run
/// without autograd and nothing is back-propagated: two thirds of its cost saved.
fn has_gradient(mb: &[TrainSample], loss_opts: &LossOptions) -> bool {
    !mb.iter()
        .all(|s| s.weight == 0.0 || (s.advantage == 0.0 && loss_opts.kl.is_none()))
}
