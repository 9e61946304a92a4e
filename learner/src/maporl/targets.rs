//! What MaPoRL's PPO trains on: the answers as samples ([`PpoSample`]), the part of each response
//! that is trained and where its score lands ([`training_response`]), and the per-token rewards, GAE
//! returns and whitened advantages ([`ppo_targets`]), with the record of each for the rollout log.

use std::collections::BTreeMap;

use crate::algo::ppo::{explained_variance, gae, kl_per_token, token_rewards, whiten};
use crate::config::{AdvantageWhitening, MaporlSection, ScorePosition};

/// One answer to train on.
#[derive(Debug, Clone)]
pub struct PpoSample {
    pub policy: String,
    pub critic: String,
    /// Turn t and agent i of the answer (the whitening groups of `whiten: per_turn_agent`).
    pub turn: usize,
    pub agent: usize,
    /// The step's question the answer belongs to: the unit MaPoRL's mini-batches are drawn over
    /// (every answer to a question goes into the same micro-batch).
    pub question: usize,
    pub prompt: Vec<u32>,
    pub value_prompt: Vec<u32>,
    /// The tokens the policy trains on ([`training_response`]).
    pub response: Vec<u32>,
    /// One more value position follows the response, the critic's value after its last token, and
    /// the score lands there (not on the last token); see [`training_response`].
    pub score_slot_after: bool,
    /// R(t, i) (with incentives and penalties).
    pub score: f64,
    /// The behaviour log-prob of each response token as the rollout worker sampled it
    /// (`maporl.old_logprobs: generation`); `None`: the update computes them.
    pub behaviour_logprobs: Option<Vec<f32>>,
}

impl PpoSample {
    /// Positions the critic values and the value loss reads: the response tokens, plus the score's
    /// slot after them.
    pub fn value_len(&self) -> usize {
        self.response.len() + usize::from(self.score_slot_after)
    }
}

/// The PPO inputs of one sample, as `rollouts.jsonl` records them: log-probs per response token,
/// the rest per value position ([`PpoSample::value_len`]).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PpoRecord {
    pub logprobs: Vec<f32>,
    pub ref_logprobs: Vec<f32>,
    pub values: Vec<f32>,
    pub rewards: Vec<f64>,
    /// Before whitening.
    pub advantages: Vec<f64>,
    pub returns: Vec<f64>,
}

/// The tokens an answer trains the policy on, and whether the score lands on one more value
/// position after them, from the answer as kept (`tokens`: sampled with EOS ignored, cut after the
/// first stop token, or all `sampled` tokens without one).
///
/// With `ScorePosition::Trl` (the default) as MaPoRL's TRL PPOv2 trainer places them
/// (`truncate_response` keeps the first stop token and pads after it; `sequence_length` = the first
/// pad − 1; the policy loss, the KL and the whitening read 0..=sequence_length, the value loss
/// 0..=sequence_length + 1; the score lands on `sequence_length + 1` if < L, else on
/// `sequence_length`):
/// - a stop token at k that is not the pad token (Phi-3's `<|end|>`, Qwen's `<|im_end|>`): the
///   policy trains on 0..=k, the stop token included, and the score lands on position k + 1 (the
///   critic's value after reading the stop token) when k + 1 < L, else on the stop token;
/// - the stop token is the pad token (tokenizers whose pad is their eos, or that have no pad and get
///   eos as one, as the original sets it): the pad search finds the stop token itself, so the
///   policy trains on 0..k − 1, never on the EOS, and the score lands on the EOS's position k (the
///   critic's value before it);
/// - no stop token: the policy trains on all L tokens and the score lands on the last.
///
/// Why it is not cotrain's earlier placement (`ScorePosition::LastToken`: every kept token trained,
/// the stop token included, the score on the last): MaPoRL's critic learns a value for the state
/// after the answer, trained toward the score, and the last trained token's advantage bootstraps
/// from it; and an eos-as-pad model gets no gradient on its EOS. `last_token` stays an option for
/// users who want the policy to learn to end its answer with any tokenizer.
pub fn training_response(
    tokens: &[u32],
    sampled: usize,
    stops: &[u32],
    pad: Option<u32>,
    position: ScorePosition,
) -> (Vec<u32>, bool) {
    let stop = tokens.last().copied().filter(|t| stops.contains(t));
    match (position, stop) {
        (ScorePosition::LastToken, _) | (ScorePosition::Trl, None) => (tokens.to_vec(), false),
        (ScorePosition::Trl, Some(s)) if Some(s) == pad => {
            (tokens[..tokens.len() - 1].to_vec(), true)
        }
        (ScorePosition::Trl, Some(_)) => (tokens.to_vec(), tokens.len() < sampled),
    }
}

/// Step 2 of the update ([`ppo_update`] calls it after gathering the records' log-probs, reference
/// log-probs and values): each sample's per-token rewards, advantages and returns, written into its
/// record, and its whitened advantages (returned, one per response token), with the step's
/// `objective/kl`, `objective/rlhf_reward` and `val/explained_variance`.
///
/// As MaPoRL's trainer does per (turn, agent) (ppov2_trainer_multi_different_model.py:1630-1691):
/// rewards −kl_coef·(log π − log π_ref) on the response tokens, 0 on the score's slot after them,
/// and the score added on the last value position; with `whiten_rewards` the rewards whitened
/// (scale only) per group over its value positions; GAE (γ, λ) over the value positions with a 0
/// bootstrap after the last; returns = advantages + values before whitening; the advantages of the
/// response tokens whitened per group (`masked_whiten`: unbiased variance, (A − μ)/√(var + 1e-8)),
/// the slot's advantage left out, as the policy loss never reads it.
///
/// The groups are `maporl.whiten`'s: per (turn, agent) over the step's questions, or per policy
/// adapter. With several ranks every rank holds every sample, so a group spans the whole step's
/// questions (MaPoRL whitens each process's local questions).
pub fn ppo_targets(
    m: &MaporlSection,
    samples: &[PpoSample],
    records: &mut [PpoRecord],
) -> (Vec<Vec<f64>>, BTreeMap<String, f64>) {
    let mut stats: BTreeMap<String, f64> = BTreeMap::new();
    let mut groups: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for (k, s) in samples.iter().enumerate() {
        let group = match m.whiten {
            AdvantageWhitening::PerTurnAgent => format!("turn{}.agent{}", s.turn, s.agent),
            AdvantageWhitening::PerAdapter => s.policy.clone(),
        };
        groups.entry(group).or_default().push(k);
    }
    let n = samples.len() as f64;
    let mut whitened: Vec<Vec<f64>> = vec![Vec::new(); samples.len()];
    let (mut all_values, mut all_returns) = (Vec::new(), Vec::new());
    for idx in groups.values() {
        let mut rewards: Vec<Vec<f64>> = Vec::with_capacity(idx.len());
        for &k in idx {
            let (s, rec) = (&samples[k], &records[k]);
            let kl: f64 = kl_per_token(&rec.logprobs, &rec.ref_logprobs).iter().sum();
            *stats.entry("objective/kl".into()).or_insert(0.0) += kl / n;
            *stats.entry("objective/rlhf_reward".into()).or_insert(0.0) +=
                (s.score - m.kl_coef * kl) / n;
            // The score goes on the last value position: the slot after the response, or its last token.
            let mut r = token_rewards(
                &rec.logprobs,
                &rec.ref_logprobs,
                if s.score_slot_after { 0.0 } else { s.score },
                m.kl_coef,
            );
            if s.score_slot_after {
                r.push(s.score);
            }
            rewards.push(r);
        }
        if m.whiten_rewards {
            let flat: Vec<f64> = rewards.iter().flatten().copied().collect();
            let w = whiten(&flat, false);
            let mut at = 0;
            for r in rewards.iter_mut() {
                let len = r.len();
                r.copy_from_slice(&w[at..at + len]);
                at += len;
            }
        }
        let mut policy_adv = Vec::new();
        for (&k, r) in idx.iter().zip(rewards) {
            let values: Vec<f64> = records[k].values.iter().map(|v| f64::from(*v)).collect();
            let (adv, ret) = gae(&r, &values, m.gamma, m.lam);
            policy_adv.extend_from_slice(&adv[..samples[k].response.len()]);
            all_values.extend(values);
            all_returns.extend(ret.iter().copied());
            records[k].rewards = r;
            records[k].advantages = adv;
            records[k].returns = ret;
        }
        let w = whiten(&policy_adv, true);
        let mut at = 0;
        for &k in idx {
            let len = samples[k].response.len();
            whitened[k] = w[at..at + len].to_vec();
            at += len;
        }
    }
    stats.insert(
        "val/explained_variance".into(),
        explained_variance(&all_values, &all_returns),
    );
    (whitened, stats)
}
