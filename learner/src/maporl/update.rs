//! MaPoRL's PPO update of one step (TRL's PPO, as `crate::algo::ppo` spells out), per adapter:
//!
//! 1. without grad: behaviour log-probs under the sampling temperature (the adapter set), reference
//!    log-probs (the base alone) and the critic's values at the positions predicting each response
//!    token;
//! 2. per-token rewards −kl_coef·(log π − log π_ref) with the training score R(t, i) on the last
//!    token; GAE (γ, λ); returns = advantages + values; advantages whitened over the adapter's tokens;
//! 3. `num_ppo_epochs` passes over shuffled mini-batches: the clipped policy loss steps the policy
//!    adapter, vf_coef · the clipped value loss steps the critic (adapter and head). The two share no
//!    parameter, so stepping them apart is the same as stepping their sum.
//!
//! Dropout stays off in every forward of the update, as TRL's PPO trainers disable it: the ratio of
//! the first epoch must be exactly 1.

use std::collections::BTreeMap;

use cotrain_model::logprobs::{LogProbOptions, Sequence, completion_logprobs};
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use tch::{Kind, Tensor};
use tracing::warn;

use super::agents::{Adapters, Bases, Critic};
use crate::dist::Collective;
use crate::algo::ppo::{clipped_policy_loss, clipped_value_loss, explained_variance, gae, kl_per_token, token_rewards, whiten};
use crate::trainer::policy::padded_rows as pad_f32;
use crate::config::MaporlSection;
use crate::trainer::TrainError;

/// One answer to train on.
#[derive(Debug, Clone)]
pub struct PpoSample {
    pub policy: String,
    pub critic: String,
    pub prompt: Vec<u32>,
    pub value_prompt: Vec<u32>,
    pub response: Vec<u32>,
    /// R(t, i) (with incentives and penalties).
    pub score: f64,
}

/// The PPO inputs of one sample, as `rollouts.jsonl` records them.
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

fn model_err(what: &str) -> impl Fn(cotrain_model::ModelError) -> TrainError + '_ {
    move |e| TrainError::Model(format!("{what}: {e}"))
}

/// Right-padded (B, L) ids of prompt + response rows, and each row's prompt length.
fn padded_rows(rows: &[(&[u32], &[u32])]) -> (Tensor, Vec<usize>) {
    let l = rows.iter().map(|(p, r)| p.len() + r.len()).max().unwrap_or(1);
    let mut ids = vec![0i64; rows.len() * l];
    for (b, (p, r)) in rows.iter().enumerate() {
        for (j, t) in p.iter().chain(r.iter()).enumerate() {
            ids[b * l + j] = *t as i64;
        }
    }
    (Tensor::from_slice(&ids).view([rows.len() as i64, l as i64]), rows.iter().map(|(p, _)| p.len()).collect())
}

/// Values (B, Cmax) at the positions predicting each response token (prompt_len − 1 + t), zero
/// beyond each response.
fn response_values(critic: &Critic, bases: &Bases, rows: &[(&[u32], &[u32])], with_grad: bool) -> Result<Tensor, TrainError> {
    let (ids, prompt_lens) = padded_rows(rows);
    let base = &bases.models[critic.base];
    let v = critic.values(base, &ids.to_device(base.model.device()), with_grad)?;
    let l = v.size()[1];
    let cmax = rows.iter().map(|(_, r)| r.len()).max().unwrap_or(0) as i64;
    let (mut src, mut dst) = (Vec::new(), Vec::new());
    for (b, (_, r)) in rows.iter().enumerate() {
        for t in 0..r.len() {
            src.push(b as i64 * l + (prompt_lens[b] + t - 1) as i64);
            dst.push(b as i64 * cmax + t as i64);
        }
    }
    let device = v.device();
    let flat = v.reshape([-1]).index_select(0, &Tensor::from_slice(&src).to_device(device));
    let out = Tensor::zeros([rows.len() as i64 * cmax], (Kind::Float, device));
    Ok(out.index_put(&[Some(Tensor::from_slice(&dst).to_device(device))], &flat, false).view([rows.len() as i64, cmax]))
}

/// Per-sample vectors padded into (B, Cmax) f32.
fn pad(rows: &[&[f64]], cmax: usize) -> Tensor {
    let mut out = vec![0f32; rows.len() * cmax];
    for (b, r) in rows.iter().enumerate() {
        for (j, x) in r.iter().enumerate() {
            out[b * cmax + j] = *x as f32;
        }
    }
    Tensor::from_slice(&out).view([rows.len() as i64, cmax as i64])
}

fn split(flat: &Tensor, offsets: &[usize]) -> Vec<Vec<f32>> {
    let all: Vec<f32> = Vec::try_from(flat.to_kind(Kind::Float).to_device(tch::Device::Cpu)).unwrap_or_default();
    offsets.windows(2).map(|w| all[w[0]..w[1]].to_vec()).collect()
}

/// Runs the update of one step over `samples`; returns each sample's record (in order) and the
/// step's training scalars.
///
/// As one of the data-parallel ranks of `dist`, every rank holds all of the step's samples (in the
/// same order) and the same `rng`: each computes the behaviour/reference log-probs and old values of
/// every world-th sample and they exchange them; GAE and whitening run on every rank alike; and in
/// every mini-batch each rank back-propagates every world-th of its samples with the loss scaled by
/// its share of the mini-batch's tokens, so that the gradients summed over the ranks (before each
/// AdamW step) and the statistics are those of the whole mini-batch.
pub fn ppo_update(
    m: &MaporlSection,
    bases: &Bases,
    adapters: &mut Adapters,
    samples: &[PpoSample],
    rng: &mut ChaCha8Rng,
    dist: &dyn Collective,
) -> Result<(Vec<PpoRecord>, BTreeMap<String, f64>), TrainError> {
    let (rank, world) = (dist.rank(), dist.world());
    let mine = |k: usize| k % world == rank;
    let mut records = vec![PpoRecord::default(); samples.len()];
    let mut stats: BTreeMap<String, f64> = BTreeMap::new();
    let acc = |k: &str, v: f64, stats: &mut BTreeMap<String, f64>| *stats.entry(k.to_string()).or_insert(0.0) += v;
    let chunk = cotrain_model::logprobs::TRAINING_CHUNK;
    let lp_opts = |with_grad| LogProbOptions { chunk_size: chunk, with_grad, temperature: m.temperature };

    // 1. Old log-probs, reference log-probs, old values.
    let t_prep = std::time::Instant::now();
    let mut by_policy: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    let mut by_critic: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for (k, s) in samples.iter().enumerate() {
        by_policy.entry(&s.policy).or_default().push(k);
        by_critic.entry(&s.critic).or_default().push(k);
    }
    for (key, idx) in &by_policy {
        let p = adapters.policies.get(*key).ok_or_else(|| TrainError::Config(format!("no adapter `{key}`")))?;
        let idx: Vec<usize> = idx.iter().copied().filter(|&k| mine(k)).collect();
        if idx.is_empty() {
            continue;
        }
        let seqs: Vec<Sequence> = idx.iter().map(|&k| Sequence { prompt: samples[k].prompt.clone(), completion: samples[k].response.clone() }).collect();
        let old = p.with_model(bases, |model| completion_logprobs(model, &seqs, &lp_opts(false)))?.map_err(model_err("behaviour log-probs"))?;
        // The reference policy is the frozen base itself.
        let reference = completion_logprobs(&bases.models[p.base].model, &seqs, &lp_opts(false)).map_err(model_err("reference log-probs"))?;
        for ((&k, lp), lr) in idx.iter().zip(split(&old.logprobs, &old.offsets)).zip(split(&reference.logprobs, &reference.offsets)) {
            records[k].logprobs = lp;
            records[k].ref_logprobs = lr;
        }
    }
    for (key, idx) in &by_critic {
        let c = &adapters.critics[*key];
        let idx: Vec<usize> = idx.iter().copied().filter(|&k| mine(k)).collect();
        for part in idx.chunks(16) {
            let rows: Vec<(&[u32], &[u32])> = part.iter().map(|&k| (samples[k].value_prompt.as_slice(), samples[k].response.as_slice())).collect();
            let v = response_values(c, bases, &rows, false)?;
            let v: Vec<f32> = Vec::try_from(v.to_device(tch::Device::Cpu).reshape([-1])).unwrap_or_default();
            let cmax = rows.iter().map(|(_, r)| r.len()).max().unwrap_or(0);
            for (b, &k) in part.iter().enumerate() {
                records[k].values = v[b * cmax..b * cmax + samples[k].response.len()].to_vec();
            }
        }
    }

    if world > 1 {
        // Every rank gets every sample's inputs.
        let own: Vec<(usize, &PpoRecord)> = records.iter().enumerate().filter(|&(k, _)| mine(k)).collect();
        let bytes = serde_json::to_vec(&own).map_err(|e| TrainError::Dist(format!("serialising PPO inputs: {e}")))?;
        for (r, part) in dist.all_gather_bytes(&bytes)?.iter().enumerate() {
            let theirs: Vec<(usize, PpoRecord)> = serde_json::from_slice(part).map_err(|e| TrainError::Dist(format!("rank {r}'s PPO inputs: {e}")))?;
            for (k, rec) in theirs {
                records[k] = rec;
            }
        }
    }
    stats.insert("time/ppo_prepare".into(), t_prep.elapsed().as_secs_f64());
    // 2. Rewards, GAE, whitening (per adapter, over its tokens).
    let mut whitened: Vec<Vec<f64>> = vec![Vec::new(); samples.len()];
    let (mut all_values, mut all_returns) = (Vec::new(), Vec::new());
    for idx in by_policy.values() {
        let mut rewards: Vec<Vec<f64>> =
            idx.iter().map(|&k| token_rewards(&records[k].logprobs, &records[k].ref_logprobs, samples[k].score, m.kl_coef)).collect();
        for &k in idx {
            let kl: f64 = kl_per_token(&records[k].logprobs, &records[k].ref_logprobs).iter().sum();
            acc("objective/kl", kl / samples.len() as f64, &mut stats);
            acc("objective/rlhf_reward", (samples[k].score - m.kl_coef * kl) / samples.len() as f64, &mut stats);
        }
        if m.whiten_rewards {
            let flat: Vec<f64> = rewards.iter().flatten().copied().collect();
            let w = whiten(&flat, false);
            let mut at = 0;
            for r in rewards.iter_mut() {
                let n = r.len();
                r.copy_from_slice(&w[at..at + n]);
                at += n;
            }
        }
        let mut flat_adv = Vec::new();
        for (&k, r) in idx.iter().zip(rewards) {
            let values: Vec<f64> = records[k].values.iter().map(|v| f64::from(*v)).collect();
            let (adv, ret) = gae(&r, &values, m.gamma, m.lam);
            all_values.extend(values);
            all_returns.extend(ret.iter().copied());
            flat_adv.extend(adv.iter().copied());
            records[k].rewards = r;
            records[k].advantages = adv;
            records[k].returns = ret;
        }
        let w = whiten(&flat_adv, true);
        let mut at = 0;
        for &k in idx {
            let n = records[k].advantages.len();
            whitened[k] = w[at..at + n].to_vec();
            at += n;
        }
    }
    stats.insert("val/explained_variance".into(), explained_variance(&all_values, &all_returns));

    // 3. PPO epochs over shuffled mini-batches.
    let (mut pg_n, mut vf_n) = (0.0f64, 0.0f64);
    let (mut t_policy, mut t_value) = (0.0, 0.0);
    for _epoch in 0..m.num_ppo_epochs {
        let t = std::time::Instant::now();
        for (key, idx) in &by_policy {
            let mut order = idx.clone();
            order.shuffle(rng);
            let parts = m.num_mini_batches.min(order.len()).max(1);
            let size = order.len().div_ceil(parts);
            for mb in order.chunks(size) {
                let p = adapters.policies.get_mut(*key).expect("checked above");
                // This rank's share of the mini-batch and its share of the mini-batch's tokens.
                let all_tokens: usize = mb.iter().map(|&k| samples[k].response.len()).sum();
                let part: Vec<usize> = mb.iter().enumerate().filter(|&(j, _)| j % world == rank).map(|(_, &k)| k).collect();
                let share = part.iter().map(|&k| samples[k].response.len()).sum::<usize>() as f64 / all_tokens.max(1) as f64;
                p.optimizer.zero_grad();
                let mut local = [0.0f64; 6]; // loss, clip fraction, approx kl, entropy, ratio, non-finite
                if !part.is_empty() {
                    let seqs: Vec<Sequence> =
                        part.iter().map(|&k| Sequence { prompt: samples[k].prompt.clone(), completion: samples[k].response.clone() }).collect();
                    let cmax = part.iter().map(|&k| samples[k].response.len()).max().unwrap_or(0);
                    let old = pad_f32(part.iter().map(|&k| records[k].logprobs.as_slice()), cmax);
                    let adv = pad(&part.iter().map(|&k| whitened[k].as_slice()).collect::<Vec<_>>(), cmax);
                    let tlp = p.with_model(bases, |model| completion_logprobs(model, &seqs, &lp_opts(true)))?.map_err(model_err("policy log-probs"))?;
                    let (lp, mask) = tlp.padded();
                    let mask = mask.to_kind(Kind::Float);
                    let device = lp.device();
                    let terms = clipped_policy_loss(&lp, &old.to_device(device), &adv.to_device(device), &mask, m.cliprange)
                        .map_err(|e| TrainError::Model(format!("policy loss: {e}")))?;
                    let loss = terms.loss.double_value(&[]);
                    tlp.backward(&(&terms.loss * share)).map_err(model_err("policy backward"))?;
                    let entropy = tlp.entropy.mean(Kind::Float).double_value(&[]);
                    local = [loss * share, terms.clip_fraction * share, terms.approx_kl * share, entropy * share, terms.ratio_mean * share, !loss.is_finite() as u8 as f64];
                }
                let [loss, clipfrac, approxkl, entropy, ratio, bad] = dist.sum_f64(&local)?[..] else { unreachable!("six values") };
                if world > 1 {
                    crate::dist::all_reduce_grads(dist, &p.optimizer.parameters())?;
                }
                if bad == 0.0 && p.optimizer.grads_finite() {
                    p.optimizer.step();
                } else {
                    warn!(adapter = %key, loss, "non-finite policy loss or gradient: mini-batch skipped");
                    acc("policy/skipped", 1.0, &mut stats);
                }
                p.optimizer.zero_grad();
                acc("loss/policy_avg", loss, &mut stats);
                acc("policy/clipfrac_avg", clipfrac, &mut stats);
                acc("policy/approxkl_avg", approxkl, &mut stats);
                acc("policy/entropy_avg", entropy, &mut stats);
                acc("val/ratio", ratio, &mut stats);
                pg_n += 1.0;
            }
        }
        t_policy += t.elapsed().as_secs_f64();
        let t = std::time::Instant::now();
        for (key, idx) in &by_critic {
            let mut order = idx.clone();
            order.shuffle(rng);
            let parts = m.num_mini_batches.min(order.len()).max(1);
            let size = order.len().div_ceil(parts);
            for mb in order.chunks(size) {
                let c = adapters.critics.get_mut(*key).expect("keys come from the adapters");
                let all_tokens: usize = mb.iter().map(|&k| samples[k].response.len()).sum();
                let part: Vec<usize> = mb.iter().enumerate().filter(|&(j, _)| j % world == rank).map(|(_, &k)| k).collect();
                let share = part.iter().map(|&k| samples[k].response.len()).sum::<usize>() as f64 / all_tokens.max(1) as f64;
                c.adapter_opt.zero_grad();
                c.head_opt.zero_grad();
                let mut local = [0.0f64; 3]; // loss, clip fraction, non-finite
                if !part.is_empty() {
                    let rows: Vec<(&[u32], &[u32])> = part.iter().map(|&k| (samples[k].value_prompt.as_slice(), samples[k].response.as_slice())).collect();
                    let cmax = rows.iter().map(|(_, r)| r.len()).max().unwrap_or(0);
                    let mask_rows: Vec<Vec<f64>> = part.iter().map(|&k| vec![1.0; samples[k].response.len()]).collect();
                    let mask = pad(&mask_rows.iter().map(Vec::as_slice).collect::<Vec<_>>(), cmax);
                    let old = pad_f32(part.iter().map(|&k| records[k].values.as_slice()), cmax);
                    let ret = pad(&part.iter().map(|&k| records[k].returns.as_slice()).collect::<Vec<_>>(), cmax);
                    let v = response_values(c, bases, &rows, true)?;
                    let device = v.device();
                    let terms = clipped_value_loss(&v, &old.to_device(device), &ret.to_device(device), &mask.to_device(device), m.cliprange_value)
                        .map_err(|e| TrainError::Model(format!("value loss: {e}")))?;
                    let loss = terms.loss.double_value(&[]);
                    (&terms.loss * (m.vf_coef * share)).backward();
                    local = [loss * share, terms.clip_fraction * share, !loss.is_finite() as u8 as f64];
                }
                let [loss, clipfrac, bad] = dist.sum_f64(&local)?[..] else { unreachable!("three values") };
                if world > 1 {
                    let mut params = c.adapter_opt.parameters();
                    params.extend(c.head_opt.parameters());
                    crate::dist::all_reduce_grads(dist, &params)?;
                }
                if bad == 0.0 && c.adapter_opt.grads_finite() && c.head_opt.grads_finite() {
                    c.adapter_opt.step();
                    c.head_opt.step();
                } else {
                    warn!(critic = %key, loss, "non-finite value loss or gradient: mini-batch skipped");
                    acc("val/skipped", 1.0, &mut stats);
                }
                c.adapter_opt.zero_grad();
                c.head_opt.zero_grad();
                acc("loss/value_avg", loss, &mut stats);
                acc("val/clipfrac_avg", clipfrac, &mut stats);
                vf_n += 1.0;
            }
        }
        t_value += t.elapsed().as_secs_f64();
    }
    stats.insert("time/ppo_policy".into(), t_policy);
    stats.insert("time/ppo_value".into(), t_value);
    for (k, v) in stats.iter_mut() {
        if k.starts_with("loss/policy") || k.starts_with("policy/") && !k.ends_with("skipped") || k == "val/ratio" {
            *v /= pg_n.max(1.0);
        } else if k.starts_with("loss/value") || k == "val/clipfrac_avg" {
            *v /= vf_n.max(1.0);
        }
    }
    let tokens: usize = samples.iter().map(|s| s.response.len()).sum();
    stats.insert("train/response_tokens".into(), tokens as f64);
    stats.insert("train/samples".into(), samples.len() as f64);
    Ok((records, stats))
}
