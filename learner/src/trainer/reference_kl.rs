//! `reference_kl.placement: returns` (CoMLRL 2026): before the advantages, every completion of the
//! step gets KL_j = Σ_t k_t against its policy's frozen reference ([`crate::algo::sequence_kl`]), which
//! [`super::tree::Forest::compute_advantages`] then subtracts, times the coefficient, from its return.
//!
//! The policy's log-probs are the ones the rollout workers returned with each sample (raw logits,
//! temperature 1): the policy as it was when it sampled, as upstream measures it at generation, also
//! for asynchronous rollouts. Rollouts in another precision than the learner's reference (bf16
//! rollouts of an f32 policy) add their precision gap to the KL (`logprob_gap` measures it). The
//! reference's log-probs come from one no-grad forward here; upstream counts the tokens before the
//! first pad, so a completion's final stop token is left out of the sum.

use cotrain_model::logprobs::{LogProbOptions, Sequence, completion_logprobs};
use tch::{Device, Kind};

use super::setup::Trainer;
use super::tree::Forest;
use crate::algo::sequence_kl;
use crate::error::TrainError;

/// Completions per reference forward.
const SEQUENCES_PER_FORWARD: usize = 32;

impl Trainer {
    /// Fills every node's `reference_kl` (per agent, per completion) for this rank's forest.
    pub(super) fn measure_reference_kl(&self, forest: &mut Forest) -> Result<(), TrainError> {
        let estimator = self.s.cfg.trainer.reference_kl.estimator;
        for node in &mut forest.nodes {
            node.reference_kl = node.samples.iter().map(|s| vec![0.0; s.len()]).collect();
        }
        for (pi, policy) in self.s.policies.iter().enumerate() {
            let reference = policy.reference.as_ref().ok_or_else(|| {
                TrainError::Config(format!(
                    "reference_kl is on but policy `{}` has no frozen reference model",
                    policy.worker_agent
                ))
            })?;
            let stop_ids = policy.model.stop_token_ids();
            // (node, agent, completion) of every sample this policy drew, with the tokens its KL counts.
            let mut todo: Vec<(usize, usize, usize, usize)> = Vec::new();
            for (id, node) in forest.nodes.iter().enumerate() {
                for (a, samples) in node.samples.iter().enumerate() {
                    if self.s.agent_policy[a] != pi {
                        continue;
                    }
                    for (k, s) in samples.iter().enumerate() {
                        if s.logprobs.len() != s.token_ids.len() {
                            return Err(TrainError::Rollout(format!(
                                "a sample of agent {a} has {} log-probs for its {} completion tokens (reference_kl.placement: returns \
                                 needs the rollout worker's log-prob of every token)",
                                s.logprobs.len(),
                                s.token_ids.len()
                            )));
                        }
                        let ends_on_stop =
                            s.stopped && s.token_ids.last().is_some_and(|t| stop_ids.contains(t));
                        let counted = s.token_ids.len() - ends_on_stop as usize;
                        if counted > 0 {
                            todo.push((id, a, k, counted));
                        }
                    }
                }
            }
            for chunk in todo.chunks(SEQUENCES_PER_FORWARD) {
                let seqs: Vec<Sequence> = chunk
                    .iter()
                    .map(|&(id, a, k, _)| {
                        let node = &forest.nodes[id];
                        Sequence {
                            prompt: node.prompts[a].ids.clone(),
                            completion: node.samples[a][k].token_ids.clone(),
                        }
                    })
                    .collect();
                let opts = LogProbOptions {
                    chunk_size: policy.chunk_size,
                    with_grad: false,
                    temperature: 1.0,
                };
                let tlp = completion_logprobs(&reference.model, &seqs, &opts)
                    .map_err(|e| TrainError::Update(format!("reference log-probs: {e}")))?;
                let flat: Vec<f32> =
                    Vec::try_from(tlp.logprobs.to_device(Device::Cpu).to_kind(Kind::Float))
                        .map_err(|e| TrainError::Update(format!("reference log-probs: {e}")))?;
                for (b, &(id, a, k, counted)) in chunk.iter().enumerate() {
                    let start = tlp.offsets[b];
                    let behaviour = &forest.nodes[id].samples[a][k].logprobs[..counted];
                    forest.nodes[id].reference_kl[a][k] =
                        sequence_kl(behaviour, &flat[start..start + counted], estimator);
                }
            }
        }
        Ok(())
    }
}
