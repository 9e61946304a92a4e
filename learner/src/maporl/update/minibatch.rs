//! One PPO mini-batch of an adapter or a critic: this rank's share of it cut into micro-batches
//! of whole questions, the clipped loss of each weighted by its share of the mini-batch's tokens,
//! backward, the gradients summed over the ranks, and one AdamW step.

use cotrain_model::families::CausalLm;
use cotrain_model::logprobs::{LogProbOptions, completion_logprobs_within};
use tch::Kind;
use tracing::warn;

use super::super::agents::{Critic, PolicyAdapter};
use super::rows::{
    POLICY_LEN, POLICY_POSITIONS, POLICY_PROMPT, Positions, VALUE_POSITIONS, model_err, pad,
    response_values, rows_of,
};
use super::{PpoRecord, PpoSample};
use crate::algo::padding::pad_values;
use crate::algo::ppo::{clipped_policy_loss, clipped_value_loss};
use crate::config::MaporlSection;
use crate::dist::Collective;
use crate::error::TrainError;

/// What the PPO epochs read besides the adapters.
pub(super) struct EpochData<'a> {
    pub(super) m: &'a MaporlSection,
    pub(super) samples: &'a [PpoSample],
    pub(super) records: &'a [PpoRecord],
    /// Each sample's whitened advantages.
    pub(super) whitened: &'a [Vec<f64>],
}

/// One mini-batch's statistics (summed over ranks, each rank's part weighted by its token share).
pub(super) enum MinibatchStats {
    Policy {
        loss: f64,
        clipfrac: f64,
        approxkl: f64,
        entropy: f64,
        ratio: f64,
        skipped: bool,
    },
    Value {
        loss: f64,
        clipfrac: f64,
        skipped: bool,
    },
}

/// This rank's share of mini-batch `mb` (every world-th of its questions), cut into micro-batches
/// of whole questions, each with its share of the mini-batch's positions the loss averages over (`len` of each sample: response tokens for the
/// policy, value positions for the critic, which has one more where the score lands after the
/// response). The loss is a mean over those positions, so micro-batch losses weighted by their
/// shares and accumulated (over micro-batches and ranks) give the gradient of the whole mini-batch.
///
/// A rank's part is forwarded in `gradient_accumulation_steps` micro-batches, as many as TRL's PPOv2
/// trainer (that MaPoRL runs) cuts a mini-batch of per_device_train_batch_size ×
/// gradient_accumulation_steps questions into, every answer to a question in its micro-batch as
/// there: a micro-batch's activations at a time rather than the whole mini-batch's, and the
/// answers' common prompt prefix forwarded once. (TRL weights its micro-batches equally; the token-share weights here keep
/// the mini-batch's token mean, which one forward of it gave.) A micro-batch is not cut further
/// by length as the first phase's forwards are ([`super::inputs::length_batches`]): at 32 questions that cut the
/// policy epochs by 1% and slowed the critic's by 7% (its rows are short, and one row per product
/// ran below the pair's rate).
pub(super) fn rank_micro_batches(
    mb: &[Vec<usize>],
    samples: &[PpoSample],
    dist: &dyn Collective,
    split: MicroBatches,
    len: Positions,
) -> Vec<(Vec<usize>, f64)> {
    let (rank, world) = (dist.rank(), dist.world());
    let all_tokens = mb
        .iter()
        .flatten()
        .map(|&k| len(&samples[k]))
        .sum::<usize>()
        .max(1) as f64;
    let part: Vec<&Vec<usize>> = mb
        .iter()
        .enumerate()
        .filter(|&(j, _)| j % world == rank)
        .map(|(_, u)| u)
        .collect();
    if part.is_empty() {
        return Vec::new();
    }
    let groups: Vec<&[&Vec<usize>]> = match split {
        MicroBatches::Count(n) => part.chunks(part.len().div_ceil(n.max(1))).collect(),
        MicroBatches::Positions { most, positions } => {
            let mut groups = Vec::new();
            let (mut start, mut held) = (0, 0);
            for (j, u) in part.iter().enumerate() {
                let p: usize = u.iter().map(|&k| positions(&samples[k])).sum();
                if j > start && held + p > most {
                    groups.push(&part[start..j]);
                    (start, held) = (j, 0);
                }
                held += p;
            }
            groups.push(&part[start..]);
            groups
        }
    };
    groups
        .into_iter()
        .map(|micro| {
            let micro: Vec<usize> = micro.iter().flat_map(|u| u.iter().copied()).collect();
            let share = micro.iter().map(|&k| len(&samples[k])).sum::<usize>() as f64 / all_tokens;
            (micro, share)
        })
        .collect()
}

/// How a rank's share of a mini-batch is cut into micro-batches of whole questions.
#[derive(Clone, Copy)]
pub(super) enum MicroBatches {
    /// This many parts of (nearly) as many questions (TRL's `gradient_accumulation_steps`).
    Count(usize),
    /// Consecutive questions while their `positions` sum to at most `most`
    /// (`maporl.micro_batch_positions`).
    Positions { most: usize, positions: Positions },
}

impl MicroBatches {
    /// The split of `m` for forwards that run `positions` per sample.
    pub(super) fn of(m: &MaporlSection, positions: Positions) -> Self {
        match m.micro_batch_positions {
            Some(most) => MicroBatches::Positions { most, positions },
            None => MicroBatches::Count(m.gradient_accumulation_steps),
        }
    }
}

/// One policy mini-batch: the clipped policy loss, backward, and an AdamW step of the adapter
/// (skipped when the loss or a gradient is not finite on any rank).
pub(super) fn policy_minibatch(
    p: &mut PolicyAdapter,
    net: &CausalLm,
    mb: &[Vec<usize>],
    data: &EpochData,
    dist: &dyn Collective,
) -> Result<MinibatchStats, TrainError> {
    let EpochData {
        m,
        samples,
        records,
        whitened,
    } = *data;
    p.optimizer.zero_grad();
    let mut local = [0.0f64; 6]; // loss, clip fraction, approx kl, entropy, ratio, non-finite
    for (part, share) in rank_micro_batches(
        mb,
        samples,
        dist,
        MicroBatches::of(m, POLICY_POSITIONS),
        POLICY_LEN,
    ) {
        let (seqs, questions) = rows_of(samples, &part, POLICY_PROMPT);
        let cmax = part
            .iter()
            .map(|&k| samples[k].response.len())
            .max()
            .unwrap_or(0);
        let old = pad_values(part.iter().map(|&k| records[k].logprobs.as_slice()), cmax);
        let adv = pad(
            &part
                .iter()
                .map(|&k| whitened[k].as_slice())
                .collect::<Vec<_>>(),
            cmax,
        );
        let opts = LogProbOptions {
            chunk_size: cotrain_model::logprobs::TRAINING_CHUNK,
            with_grad: true,
            temperature: m.temperature,
        };
        let tlp = p
            .with_model(net, |model| {
                completion_logprobs_within(model, &seqs, &questions, &opts)
            })?
            .map_err(model_err("policy log-probs"))?;
        let (lp, mask) = tlp.padded();
        let mask = mask.to_kind(Kind::Float);
        let device = lp.device();
        let terms = clipped_policy_loss(
            &lp,
            &old.to_device(device),
            &adv.to_device(device),
            &mask,
            m.cliprange,
        )
        .map_err(|e| TrainError::Update(format!("policy loss: {e}")))?;
        let loss = terms.loss.double_value(&[]);
        tlp.backward(&(&terms.loss * share))
            .map_err(model_err("policy backward"))?;
        let entropy = tlp.entropy.mean(Kind::Float).double_value(&[]);
        let micro = [
            loss,
            terms.clip_fraction,
            terms.approx_kl,
            entropy,
            terms.ratio_mean,
        ];
        for (sum, x) in local.iter_mut().zip(micro) {
            *sum += x * share;
        }
        local[5] += !loss.is_finite() as u8 as f64;
    }
    let [loss, clipfrac, approxkl, entropy, ratio, bad] = dist.sum_f64(&local)?[..] else {
        unreachable!("six values")
    };
    if dist.world() > 1 {
        crate::dist::all_reduce_grads(dist, &p.optimizer.parameters())?;
    }
    let skipped = !(bad == 0.0 && p.optimizer.grads_finite());
    if skipped {
        warn!(adapter = %p.key, loss, "non-finite policy loss or gradient: mini-batch skipped");
    } else {
        p.optimizer.step();
    }
    p.optimizer.zero_grad();
    Ok(MinibatchStats::Policy {
        loss,
        clipfrac,
        approxkl,
        entropy,
        ratio,
        skipped,
    })
}

/// One critic mini-batch: vf_coef × the clipped value loss over the value positions, backward, and
/// AdamW steps of the critic's adapter and value head (a frozen head has no variable to step;
/// skipped when the loss or a gradient is not finite on any rank).
pub(super) fn value_minibatch(
    c: &mut Critic,
    net: &CausalLm,
    mb: &[Vec<usize>],
    data: &EpochData,
    dist: &dyn Collective,
) -> Result<MinibatchStats, TrainError> {
    let EpochData {
        m,
        samples,
        records,
        ..
    } = *data;
    c.adapter_opt.zero_grad();
    c.head_opt.zero_grad();
    let mut local = [0.0f64; 3]; // loss, clip fraction, non-finite
    for (part, share) in rank_micro_batches(
        mb,
        samples,
        dist,
        MicroBatches::of(m, VALUE_POSITIONS),
        PpoSample::value_len,
    ) {
        let (v, counts) = response_values(c, net, samples, &part, true)?;
        let cmax = counts.iter().copied().max().unwrap_or(0);
        let mask_rows: Vec<Vec<f64>> = counts.iter().map(|&n| vec![1.0; n]).collect();
        let mask = pad(
            &mask_rows.iter().map(Vec::as_slice).collect::<Vec<_>>(),
            cmax,
        );
        let old = pad_values(part.iter().map(|&k| records[k].values.as_slice()), cmax);
        let ret = pad(
            &part
                .iter()
                .map(|&k| records[k].returns.as_slice())
                .collect::<Vec<_>>(),
            cmax,
        );
        let device = v.device();
        let terms = clipped_value_loss(
            &v,
            &old.to_device(device),
            &ret.to_device(device),
            &mask.to_device(device),
            m.cliprange_value,
        )
        .map_err(|e| TrainError::Update(format!("value loss: {e}")))?;
        let loss = terms.loss.double_value(&[]);
        (&terms.loss * (m.vf_coef * share)).backward();
        local[0] += loss * share;
        local[1] += terms.clip_fraction * share;
        local[2] += !loss.is_finite() as u8 as f64;
    }
    let [loss, clipfrac, bad] = dist.sum_f64(&local)?[..] else {
        unreachable!("three values")
    };
    if dist.world() > 1 {
        let mut params = c.adapter_opt.parameters();
        params.extend(c.head_opt.parameters());
        crate::dist::all_reduce_grads(dist, &params)?;
    }
    let skipped = !(bad == 0.0 && c.adapter_opt.grads_finite() && c.head_opt.grads_finite());
    if skipped {
        warn!(critic = %c.key, loss, "non-finite value loss or gradient: mini-batch skipped");
    } else {
        c.adapter_opt.step();
        c.head_opt.step();
    }
    c.adapter_opt.zero_grad();
    c.head_opt.zero_grad();
    Ok(MinibatchStats::Value {
        loss,
        clipfrac,
        skipped,
    })
}
