//! The update's first phase, without gradient: each sample's behaviour log-probs (under the
//! sampling temperature, or as the rollout workers sampled them), reference log-probs (the base
//! alone) and the critic's old values. Each rank computes every world-th question's, and the ranks
//! exchange them.

use std::collections::BTreeMap;

use cotrain_model::logprobs::{LogProbOptions, completion_logprobs_within};
use tch::{Kind, Tensor};

use super::super::agents::{Adapters, Bases};
use super::rows::{
    POLICY_POSITIONS, POLICY_PROMPT, VALUE_POSITIONS, model_err, question_units, response_values,
    rows_of,
};
use super::{PpoRecord, PpoSample};
use crate::config::MaporlSection;
use crate::dist::Collective;
use crate::error::TrainError;

/// Rows per forward of the update's first phase (no gradient): bounds the activations it holds.
const PREPARE_ROWS: usize = 16;

/// Each sample's PPO inputs (`logprobs`, `ref_logprobs`, `values`; the rest of each record is
/// left at its default for [`super::ppo_targets`]). `by_policy` and `by_critic` list the samples
/// of each policy adapter and critic.
pub(super) fn ppo_inputs(
    m: &MaporlSection,
    bases: &Bases,
    adapters: &Adapters,
    samples: &[PpoSample],
    by_policy: &BTreeMap<&str, Vec<usize>>,
    by_critic: &BTreeMap<&str, Vec<usize>>,
    dist: &dyn Collective,
) -> Result<Vec<PpoRecord>, TrainError> {
    let (rank, world) = (dist.rank(), dist.world());
    let mine = |k: usize| samples[k].question % world == rank;
    let mut records = vec![PpoRecord::default(); samples.len()];
    let lp_opts = LogProbOptions {
        chunk_size: cotrain_model::logprobs::TRAINING_CHUNK,
        with_grad: false,
        temperature: m.temperature,
    };
    for (key, idx) in by_policy {
        let p = adapters
            .policies
            .get(*key)
            .ok_or_else(|| TrainError::Config(format!("no adapter `{key}`")))?;
        let mine_idx: Vec<usize> = idx.iter().copied().filter(|&k| mine(k)).collect();
        let units = question_units(&mine_idx, samples);
        for idx in length_batches(&units, |k| POLICY_POSITIONS(&samples[k]), PREPARE_ROWS) {
            let (seqs, questions) = rows_of(samples, &idx, POLICY_PROMPT);
            // The behaviour log-probs: as sampled (`old_logprobs: generation`), else one forward.
            let sampled: Option<Vec<Vec<f32>>> = idx
                .iter()
                .map(|&k| samples[k].behaviour_logprobs.clone())
                .collect();
            let old = match sampled {
                Some(lps) => lps,
                None => {
                    let old = p
                        .with_model(&bases.models[p.base].model, |model| {
                            completion_logprobs_within(model, &seqs, &questions, &lp_opts)
                        })?
                        .map_err(model_err("behaviour log-probs"))?;
                    split(&old.logprobs, &old.offsets)
                }
            };
            // The reference policy is the frozen base itself.
            let reference = completion_logprobs_within(
                &bases.models[p.base].model,
                &seqs,
                &questions,
                &lp_opts,
            )
            .map_err(model_err("reference log-probs"))?;
            for ((&k, lp), lr) in idx
                .iter()
                .zip(old)
                .zip(split(&reference.logprobs, &reference.offsets))
            {
                if lp.len() != samples[k].response.len() {
                    return Err(TrainError::Update(format!(
                        "sample {k}: {} behaviour log-probs for {} response tokens",
                        lp.len(),
                        samples[k].response.len()
                    )));
                }
                records[k].logprobs = lp;
                records[k].ref_logprobs = lr;
            }
        }
    }
    for (key, idx) in by_critic {
        let c = &adapters.critics[*key];
        let idx: Vec<usize> = idx.iter().copied().filter(|&k| mine(k)).collect();
        let units = question_units(&idx, samples);
        for part in &length_batches(&units, |k| VALUE_POSITIONS(&samples[k]), PREPARE_ROWS) {
            let (v, counts) =
                response_values(c, &bases.models[c.base].model, samples, part, false)?;
            let v: Vec<f32> =
                Vec::try_from(v.to_device(tch::Device::Cpu).reshape([-1])).unwrap_or_default();
            let cmax = counts.iter().copied().max().unwrap_or(0);
            for (b, &k) in part.iter().enumerate() {
                records[k].values = v[b * cmax..b * cmax + counts[b]].to_vec();
            }
        }
    }

    if world > 1 {
        // Every rank gets every sample's inputs.
        let own: Vec<(usize, &PpoRecord)> = records
            .iter()
            .enumerate()
            .filter(|&(k, _)| mine(k))
            .collect();
        let bytes = serde_json::to_vec(&own)
            .map_err(|e| TrainError::Dist(format!("serialising PPO inputs: {e}")))?;
        for (r, part) in dist.all_gather_bytes(&bytes)?.iter().enumerate() {
            let theirs: Vec<(usize, PpoRecord)> = serde_json::from_slice(part)
                .map_err(|e| TrainError::Dist(format!("rank {r}'s PPO inputs: {e}")))?;
            for (k, rec) in theirs {
                records[k] = rec;
            }
        }
    }
    Ok(records)
}

/// A flat tensor of every row's values cut at `offsets` into one vector per row.
fn split(flat: &Tensor, offsets: &[usize]) -> Vec<Vec<f32>> {
    let all: Vec<f32> =
        Vec::try_from(flat.to_kind(Kind::Float).to_device(tch::Device::Cpu)).unwrap_or_default();
    offsets
        .windows(2)
        .map(|w| all[w[0]..w[1]].to_vec())
        .collect()
}

/// `units` (each a question's samples) packed into batches of similar lengths (`len` of each
/// sample: the positions its forward runs), each of at most `max_rows` rows (a larger unit runs
/// alone). A unit joins a batch when padding its rows to the batch's longest costs at most 1/16 of
/// the batch's real positions in all. Padding is arithmetic spent on nothing: the first phase
/// forwarded each policy's answers as one batch padded to the longest and the critic's in chunks
/// of 16 in sample order; in length-sorted batches it took 118.9 s instead of 145.8 s at 32
/// questions (`maporl_step_bench`, Zen 4). The order inside and across batches carries no
/// meaning: every result is written back by sample.
pub(super) fn length_batches(
    units: &[Vec<usize>],
    len: impl Fn(usize) -> usize,
    max_rows: usize,
) -> Vec<Vec<usize>> {
    struct Batch {
        rows: Vec<usize>,
        longest: usize,
        real: usize,
        /// Padding added by merging units: each row's gap to the batch's longest beyond its
        /// own unit's.
        added: usize,
    }
    let longest = |u: &[usize]| u.iter().map(|&k| len(k)).max().unwrap_or(0);
    let mut sorted: Vec<&Vec<usize>> = units.iter().filter(|u| !u.is_empty()).collect();
    sorted.sort_by_key(|u| (std::cmp::Reverse(longest(u)), u[0]));
    let mut out: Vec<Batch> = Vec::new();
    for u in sorted {
        let (l, real) = (longest(u), u.iter().map(|&k| len(k)).sum::<usize>());
        // Sorted longest first: the batch's first unit holds its longest row.
        let joins = out.last().is_some_and(|b| {
            b.rows.len() + u.len() <= max_rows.max(1)
                && (b.added + u.len() * (b.longest - l)) * 16 <= b.real + real
        });
        match out.last_mut() {
            Some(b) if joins => {
                b.rows.extend(u);
                b.added += u.len() * (b.longest - l);
                b.real += real;
            }
            _ => out.push(Batch {
                rows: u.clone(),
                longest: l,
                real,
                added: 0,
            }),
        }
    }
    out.into_iter().map(|b| b.rows).collect()
}
