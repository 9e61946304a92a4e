//! MaPoRL's PPO update of one step (TRL's PPO, as `crate::algo::ppo` spells out), per adapter:
//!
//! 1. without grad: behaviour log-probs under the sampling temperature (the adapter set; or as the
//!    rollout workers sampled them, `maporl.old_logprobs: generation`), reference
//!    log-probs (the base alone) and the critic's values at the positions predicting each response
//!    token (and after the last one, where the score lands there);
//! 2. ([`super::targets::ppo_targets`]) per-token rewards −kl_coef·(log π − log π_ref) with the training score
//!    R(t, i) on the score's position ([`super::targets::training_response`]); GAE (γ, λ); returns = advantages +
//!    values; advantages whitened over the response tokens of each (turn, agent) or each adapter
//!    (`maporl.whiten`);
//! 3. `num_ppo_epochs` passes over mini-batches of questions (one permutation of the step's
//!    questions per epoch, shared by every adapter and critic; a question's answers share their
//!    micro-batch and their common prompt prefix's forward): the clipped policy loss steps the policy
//!    adapter, vf_coef · the clipped value loss steps the critic (its adapter, and its head with
//!    `critic_head: trained`). The two share no
//!    parameter, so stepping them apart is the same as stepping their sum. Each adapter's and each
//!    critic's epochs are one job; on one CPU rank the jobs run at the same time, one thread per
//!    share of the cores, each thread on its own [`CausalLm::share_weights`] handle of the bases.
//!
//! Dropout stays off in every forward of the update, as TRL's PPO trainers disable it: the ratio of
//! the first epoch must be exactly 1.

use std::collections::BTreeMap;

use cotrain_model::logprobs::{LogProbOptions, Sequence, completion_logprobs_within, trunk_positions};
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use tch::{Kind, Tensor};
use tracing::warn;

use cotrain_model::families::CausalLm;

use super::agents::{Adapters, Bases, Critic, PolicyAdapter};
pub use super::targets::{PpoRecord, PpoSample, ppo_targets, training_response};
use crate::algo::padding::pad_values;
use crate::algo::ppo::{clipped_policy_loss, clipped_value_loss};
use crate::config::MaporlSection;
use crate::dist::{Collective, SingleRank};
use crate::error::TrainError;

/// Rows per forward of the update's first phase (no gradient): bounds the activations it holds.
const PREPARE_ROWS: usize = 16;

fn model_err(what: &str) -> impl Fn(cotrain_model::ModelError) -> TrainError + '_ {
    move |e| TrainError::Update(format!("{what}: {e}"))
}

/// The policy's input: a sample's prompt.
const POLICY_PROMPT: fn(&PpoSample) -> &Vec<u32> = |s| &s.prompt;
/// The critic's input: a sample's value prompt.
const VALUE_PROMPT: fn(&PpoSample) -> &Vec<u32> = |s| &s.value_prompt;

/// Samples `part` as the model's rows (`prompt` then the response) and each row's question: the
/// kernels share prompt prefixes within a question only, so that a row's arithmetic is the same
/// whichever questions share its batch (one rank or several).
fn rows_of(
    samples: &[PpoSample],
    part: &[usize],
    prompt: fn(&PpoSample) -> &Vec<u32>,
) -> (Vec<Sequence>, Vec<usize>) {
    part.iter()
        .map(|&k| {
            let row = Sequence { prompt: prompt(&samples[k]).clone(), completion: samples[k].response.clone() };
            (row, samples[k].question)
        })
        .unzip()
}

/// Values (B, Cmax) of samples `part` at the first `value_len()` positions predicting each
/// response token (prompt_len − 1 + t; t = len(response) is the state after the response), zero
/// beyond, and those counts.
fn response_values(
    critic: &Critic,
    base: &CausalLm,
    samples: &[PpoSample],
    part: &[usize],
    with_grad: bool,
) -> Result<(Tensor, Vec<usize>), TrainError> {
    let (rows, questions) = rows_of(samples, part, VALUE_PROMPT);
    let counts: Vec<usize> = part.iter().map(|&k| samples[k].value_len()).collect();
    let v = critic.values(base, &rows, &questions, with_grad)?;
    let l = v.size()[1];
    let cmax = counts.iter().copied().max().unwrap_or(0) as i64;
    let (mut src, mut dst) = (Vec::new(), Vec::new());
    for (b, row) in rows.iter().enumerate() {
        assert!(
            counts[b] <= row.completion.len() + 1,
            "at most one value position past the response"
        );
        for t in 0..counts[b] {
            src.push(b as i64 * l + (row.prompt.len() + t - 1) as i64);
            dst.push(b as i64 * cmax + t as i64);
        }
    }
    let device = v.device();
    let flat = v
        .reshape([-1])
        .index_select(0, &Tensor::from_slice(&src).to_device(device));
    let out = Tensor::zeros([rows.len() as i64 * cmax], (Kind::Float, device));
    let values = out
        .index_put(
            &[Some(Tensor::from_slice(&dst).to_device(device))],
            &flat,
            false,
        )
        .view([rows.len() as i64, cmax]);
    Ok((values, counts))
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
    let all: Vec<f32> =
        Vec::try_from(flat.to_kind(Kind::Float).to_device(tch::Device::Cpu)).unwrap_or_default();
    offsets
        .windows(2)
        .map(|w| all[w[0]..w[1]].to_vec())
        .collect()
}

/// The samples `idx` grouped by question (in order of first appearance): the unit the update
/// batches, shuffles and splits. MaPoRL's trainer permutes the questions of a step and forwards
/// every (turn, agent) answer of a question in the same micro-batch, and those answers begin alike
/// (the question's message; for the critic the whole turn-0 prompt), so their forwards share that
/// prefix ([`completion_logprobs`], [`Critic::values`]).
fn question_units(idx: &[usize], samples: &[PpoSample]) -> Vec<Vec<usize>> {
    let mut units: Vec<Vec<usize>> = Vec::new();
    let mut unit_of: BTreeMap<usize, usize> = BTreeMap::new();
    for &k in idx {
        let u = *unit_of.entry(samples[k].question).or_insert_with(|| {
            units.push(Vec::new());
            units.len() - 1
        });
        units[u].push(k);
    }
    units
}

/// `units` (each a question's samples) packed into batches of similar lengths (`len` of each
/// sample: the positions its forward runs), each of at most `max_rows` rows (a larger unit runs
/// alone). A unit joins a batch when padding its rows to the batch's longest costs at most 1/16 of
/// the batch's real positions in all. Padding is arithmetic spent on nothing: the first phase
/// forwarded each policy's answers as one batch padded to the longest and the critic's in chunks
/// of 16 in sample order; in length-sorted batches it took 118.9 s instead of 145.8 s at 32
/// questions (`maporl_step_bench`, Zen 4). The order inside and across batches carries no
/// meaning: every result is written back by sample.
fn length_batches(
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

/// Runs the update of one step over `samples`; returns each sample's record (in order) and the
/// step's training scalars.
///
/// As one of the data-parallel ranks of `dist`, every rank holds all of the step's samples (in the
/// same order) and the same `rng`: each computes the behaviour/reference log-probs and old values of
/// every world-th sample and they exchange them; GAE and whitening run on every rank alike; and in
/// every mini-batch each rank back-propagates every world-th of its samples with the loss scaled by
/// its share of the mini-batch's tokens, so that the gradients summed over the ranks (before each
/// AdamW step) and the statistics are those of the whole mini-batch.
///
/// `concurrent` (`learner.concurrent_policies`) runs the adapters' and critics' epochs at the same
/// time where [`thread_shares`] finds it possible (one rank, CPU, several jobs and cores); they
/// compute what they compute in turn, up to the summation order inside products.
pub fn ppo_update(
    m: &MaporlSection,
    bases: &Bases,
    adapters: &mut Adapters,
    samples: &[PpoSample],
    rng: &mut ChaCha8Rng,
    dist: &dyn Collective,
    concurrent: bool,
) -> Result<(Vec<PpoRecord>, BTreeMap<String, f64>), TrainError> {
    let (rank, world) = (dist.rank(), dist.world());
    // In the first phase each rank computes the inputs of every world-th question.
    let mine = |k: usize| samples[k].question % world == rank;
    let mut records = vec![PpoRecord::default(); samples.len()];
    let mut stats: BTreeMap<String, f64> = BTreeMap::new();
    let acc = |k: &str, v: f64, stats: &mut BTreeMap<String, f64>| {
        *stats.entry(k.to_string()).or_insert(0.0) += v
    };
    let chunk = cotrain_model::logprobs::TRAINING_CHUNK;
    let lp_opts = |with_grad| LogProbOptions {
        chunk_size: chunk,
        with_grad,
        temperature: m.temperature,
    };

    // 1. Old log-probs, reference log-probs, old values.
    let t_prep = std::time::Instant::now();
    let mut by_policy: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    let mut by_critic: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for (k, s) in samples.iter().enumerate() {
        by_policy.entry(&s.policy).or_default().push(k);
        by_critic.entry(&s.critic).or_default().push(k);
    }
    for (key, idx) in &by_policy {
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
                            completion_logprobs_within(model, &seqs, &questions, &lp_opts(false))
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
                &lp_opts(false),
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
    for (key, idx) in &by_critic {
        let c = &adapters.critics[*key];
        let idx: Vec<usize> = idx.iter().copied().filter(|&k| mine(k)).collect();
        let units = question_units(&idx, samples);
        for part in &length_batches(&units, |k| VALUE_POSITIONS(&samples[k]), PREPARE_ROWS) {
            let (v, counts) = response_values(c, &bases.models[c.base].model, samples, part, false)?;
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
    stats.insert("time/ppo_prepare".into(), t_prep.elapsed().as_secs_f64());
    // 2. Rewards, GAE, returns, whitening.
    let (whitened, targets_stats) = ppo_targets(m, samples, &mut records);
    stats.extend(targets_stats);

    // 3. PPO epochs over mini-batches of questions, one permutation of the step's questions per
    // epoch for every adapter and critic (MaPoRL's `b_inds`). Each policy adapter and each critic
    // trains on its own samples and shares no parameter with the others (the base is frozen), so
    // their epochs are independent jobs. The permutations are drawn first, so running jobs at the
    // same time (`concurrently`) changes nothing but the summation order inside products.
    let t_epochs = std::time::Instant::now();
    let questions: Vec<usize> = samples
        .iter()
        .map(|s| s.question)
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    let permutations: Vec<Vec<usize>> = (0..m.num_ppo_epochs)
        .map(|_| {
            let mut order = questions.clone();
            order.shuffle(rng);
            order
        })
        .collect();
    let epochs_of = |idx: &Vec<usize>| epoch_mini_batches(&question_units(idx, samples), samples, &permutations, m);
    let policy_orders: Vec<Vec<Vec<MiniBatch>>> = by_policy.values().map(epochs_of).collect();
    let critic_orders: Vec<Vec<Vec<MiniBatch>>> = by_critic.values().map(epochs_of).collect();
    let mut jobs: Vec<EpochJob> = Vec::with_capacity(by_policy.len() + by_critic.len());
    let mut policies = adapters.policies.iter_mut();
    for (key, orders) in by_policy.keys().zip(policy_orders) {
        let (_, p) = policies
            .find(|(k, _)| k.as_str() == *key)
            .expect("checked above");
        jobs.push(EpochJob {
            adapter: JobAdapter::Policy(p),
            orders,
        });
    }
    let mut critics = adapters.critics.iter_mut();
    for (key, orders) in by_critic.keys().zip(critic_orders) {
        let (_, c) = critics
            .find(|(k, _)| k.as_str() == *key)
            .expect("keys come from the adapters");
        jobs.push(EpochJob {
            adapter: JobAdapter::Critic(c),
            orders,
        });
    }
    let data = EpochData {
        m,
        samples,
        records: &records,
        whitened: &whitened,
    };
    for (name, policy) in [("train/policy_positions_run", true), ("train/value_positions_run", false)] {
        let run: usize = jobs
            .iter()
            .filter(|j| matches!(j.adapter, JobAdapter::Policy(_)) == policy)
            .map(|j| j.positions_run(samples, m, dist))
            .sum();
        stats.insert(name.into(), run as f64);
    }
    let shares = if concurrent {
        thread_shares(&jobs, samples, bases, dist)
    } else {
        None
    };
    stats.insert(
        "ppo/concurrent_jobs".into(),
        shares.as_ref().map_or(1, Vec::len) as f64,
    );
    let done = match shares {
        Some(shares) => concurrently(jobs, &shares, bases, &data)?,
        None => {
            let nets: Vec<&CausalLm> = bases.models.iter().map(|b| &b.model).collect();
            jobs.into_iter()
                .map(|job| job.run(&nets, &data, dist))
                .collect::<Result<Vec<_>, _>>()?
        }
    };
    // The statistics in the order the epochs produce them one job after another.
    let (mut pg_n, mut vf_n) = (0.0f64, 0.0f64);
    for epoch in 0..m.num_ppo_epochs {
        for mb in done.iter().flat_map(|d| &d.epochs[epoch]) {
            match *mb {
                MinibatchStats::Policy {
                    loss,
                    clipfrac,
                    approxkl,
                    entropy,
                    ratio,
                    skipped,
                } => {
                    if skipped {
                        acc("policy/skipped", 1.0, &mut stats);
                    }
                    acc("loss/policy_avg", loss, &mut stats);
                    acc("policy/clipfrac_avg", clipfrac, &mut stats);
                    acc("policy/approxkl_avg", approxkl, &mut stats);
                    acc("policy/entropy_avg", entropy, &mut stats);
                    acc("val/ratio", ratio, &mut stats);
                    pg_n += 1.0;
                }
                MinibatchStats::Value {
                    loss,
                    clipfrac,
                    skipped,
                } => {
                    if skipped {
                        acc("val/skipped", 1.0, &mut stats);
                    }
                    acc("loss/value_avg", loss, &mut stats);
                    acc("val/clipfrac_avg", clipfrac, &mut stats);
                    vf_n += 1.0;
                }
            }
        }
    }
    let seconds = |policy: bool| {
        done.iter()
            .filter(|d| d.policy == policy)
            .map(|d| d.seconds)
            .sum::<f64>()
    };
    // Each job's own time, summed (with concurrent jobs more than the epochs' wall time).
    stats.insert("time/ppo_policy".into(), seconds(true));
    stats.insert("time/ppo_value".into(), seconds(false));
    stats.insert("time/ppo_epochs".into(), t_epochs.elapsed().as_secs_f64());
    for (k, v) in stats.iter_mut() {
        if k.starts_with("loss/policy")
            || k.starts_with("policy/") && !k.ends_with("skipped")
            || k == "val/ratio"
        {
            *v /= pg_n.max(1.0);
        } else if k.starts_with("loss/value") || k == "val/clipfrac_avg" {
            *v /= vf_n.max(1.0);
        }
    }
    let tokens: usize = samples.iter().map(|s| s.response.len()).sum();
    stats.insert("train/response_tokens".into(), tokens as f64);
    // The positions one pass over the samples reads (prompt and response), for arithmetic rates;
    // `*_positions_run` above: what the forwards run once common prompt prefixes are shared.
    let positions = |f: fn(&PpoSample) -> usize| samples.iter().map(f).sum::<usize>() as f64;
    stats.insert("train/policy_positions".into(), positions(POLICY_POSITIONS));
    stats.insert("train/value_positions".into(), positions(VALUE_POSITIONS));
    stats.insert("train/samples".into(), samples.len() as f64);
    Ok((records, stats))
}

/// What the PPO epochs read besides the adapters.
struct EpochData<'a> {
    m: &'a MaporlSection,
    samples: &'a [PpoSample],
    records: &'a [PpoRecord],
    /// Each sample's whitened advantages.
    whitened: &'a [Vec<f64>],
}

/// The adapter one job trains.
enum JobAdapter<'a> {
    Policy(&'a mut PolicyAdapter),
    Critic(&'a mut Critic),
}

/// A mini-batch of one job: its samples of each of the mini-batch's questions, one list per question.
type MiniBatch = Vec<Vec<usize>>;

/// One adapter's PPO epochs: each epoch's mini-batches.
struct EpochJob<'a> {
    adapter: JobAdapter<'a>,
    orders: Vec<Vec<MiniBatch>>,
}

/// A job's mini-batches of each epoch: each permutation of the step's questions cut into
/// `num_mini_batches` parts (as many questions each, the last fewer), each part holding the job's
/// `units` (its samples of a question) in the permutation's order. A part with none of the job's
/// questions is left out: the job takes no step there.
fn epoch_mini_batches(
    units: &[Vec<usize>],
    samples: &[PpoSample],
    permutations: &[Vec<usize>],
    m: &MaporlSection,
) -> Vec<Vec<MiniBatch>> {
    let unit_of: BTreeMap<usize, &Vec<usize>> = units.iter().map(|u| (samples[u[0]].question, u)).collect();
    permutations
        .iter()
        .map(|order| {
            let size = order.len().div_ceil(m.num_mini_batches.min(order.len()).max(1)).max(1);
            order
                .chunks(size)
                .map(|qs| qs.iter().filter_map(|q| unit_of.get(q).map(|u| (*u).clone())).collect::<MiniBatch>())
                .filter(|mb| !mb.is_empty())
                .collect()
        })
        .collect()
}

/// One mini-batch's statistics (summed over ranks, each rank's part weighted by its token share).
enum MinibatchStats {
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

/// What a job did: per epoch, its mini-batches' statistics in order.
struct JobDone {
    policy: bool,
    epochs: Vec<Vec<MinibatchStats>>,
    seconds: f64,
}

impl EpochJob<'_> {
    /// The job's rows: the positions a sample's row reads, and its prompt (the policy's or the
    /// critic's).
    fn rows(&self) -> (fn(&PpoSample) -> usize, fn(&PpoSample) -> &Vec<u32>) {
        match self.adapter {
            JobAdapter::Policy(_) => (POLICY_POSITIONS, POLICY_PROMPT),
            JobAdapter::Critic(_) => (VALUE_POSITIONS, VALUE_PROMPT),
        }
    }

    /// The positions this rank's forwards of one epoch run (its first), prompt prefixes shared
    /// within each micro-batch as the kernels share them: for arithmetic figures.
    fn positions_run(&self, samples: &[PpoSample], m: &MaporlSection, dist: &dyn Collective) -> usize {
        let Some(order) = self.orders.first() else {
            return 0;
        };
        let (positions, prompt) = self.rows();
        // The loss weights (the last argument) play no part here.
        let split = MicroBatches::of(m, positions);
        order
            .iter()
            .flat_map(|mb| rank_micro_batches(mb, samples, dist, split, POLICY_LEN))
            .map(|(micro, _)| {
                let (rows, questions) = rows_of(samples, &micro, prompt);
                trunk_positions(&rows, Some(&questions))
            })
            .sum()
    }

    /// The job's estimated cost: the positions its forwards read (its own rows: the policy's
    /// prompt or the critic's) over all epochs.
    fn cost(&self, samples: &[PpoSample]) -> usize {
        let (positions, _) = self.rows();
        let tokens: usize = self
            .orders
            .first()
            .map_or(0, |o| o.iter().flatten().flatten().map(|&k| positions(&samples[k])).sum());
        match &self.adapter {
            // A policy's update also runs the LM head: about twice a critic's cost per token.
            JobAdapter::Policy(_) => 2 * tokens * self.orders.len(),
            JobAdapter::Critic(_) => tokens * self.orders.len(),
        }
    }

    /// Runs every epoch's mini-batches on `nets` (the bases' networks, by index).
    fn run(
        self,
        nets: &[&CausalLm],
        data: &EpochData,
        dist: &dyn Collective,
    ) -> Result<JobDone, TrainError> {
        let t = std::time::Instant::now();
        let mut epochs = Vec::with_capacity(self.orders.len());
        let policy = matches!(self.adapter, JobAdapter::Policy(_));
        match self.adapter {
            JobAdapter::Policy(p) => {
                let net = nets[p.base];
                for order in &self.orders {
                    epochs.push(
                        order
                            .iter()
                            .map(|mb| policy_minibatch(p, net, mb, data, dist))
                            .collect::<Result<Vec<_>, _>>()?,
                    );
                }
            }
            JobAdapter::Critic(c) => {
                let net = nets[c.base];
                for order in &self.orders {
                    epochs.push(
                        order
                            .iter()
                            .map(|mb| value_minibatch(c, net, mb, data, dist))
                            .collect::<Result<Vec<_>, _>>()?,
                    );
                }
            }
        }
        Ok(JobDone {
            policy,
            epochs,
            seconds: t.elapsed().as_secs_f64(),
        })
    }
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
/// by length as the first phase's forwards are ([`length_batches`]): at 32 questions that cut the
/// policy epochs by 1% and slowed the critic's by 7% (its rows are short, and one row per product
/// ran below the pair's rate).
fn rank_micro_batches(
    mb: &[Vec<usize>],
    samples: &[PpoSample],
    dist: &dyn Collective,
    split: MicroBatches,
    len: fn(&PpoSample) -> usize,
) -> Vec<(Vec<usize>, f64)> {
    let (rank, world) = (dist.rank(), dist.world());
    let all_tokens = mb.iter().flatten().map(|&k| len(&samples[k])).sum::<usize>().max(1) as f64;
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
enum MicroBatches {
    /// This many parts of (nearly) as many questions (TRL's `gradient_accumulation_steps`).
    Count(usize),
    /// Consecutive questions while their `positions` sum to at most `most`
    /// (`maporl.micro_batch_positions`).
    Positions {
        most: usize,
        positions: fn(&PpoSample) -> usize,
    },
}

impl MicroBatches {
    /// The split of `m` for forwards that run `positions` per sample.
    fn of(m: &MaporlSection, positions: fn(&PpoSample) -> usize) -> Self {
        match m.micro_batch_positions {
            Some(most) => MicroBatches::Positions { most, positions },
            None => MicroBatches::Count(m.gradient_accumulation_steps),
        }
    }
}

/// The positions the policy loss averages over: the response tokens.
const POLICY_LEN: fn(&PpoSample) -> usize = |s| s.response.len();
/// The positions a policy forward runs: the prompt and the response.
const POLICY_POSITIONS: fn(&PpoSample) -> usize = |s| s.prompt.len() + s.response.len();
/// The positions a critic forward runs: the value prompt and the response.
const VALUE_POSITIONS: fn(&PpoSample) -> usize = |s| s.value_prompt.len() + s.response.len();

/// One policy mini-batch: the clipped policy loss, backward, and an AdamW step of the adapter
/// (skipped when the loss or a gradient is not finite on any rank).
fn policy_minibatch(
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
    for (part, share) in
        rank_micro_batches(mb, samples, dist, MicroBatches::of(m, POLICY_POSITIONS), POLICY_LEN)
    {
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
            .with_model(net, |model| completion_logprobs_within(model, &seqs, &questions, &opts))?
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
fn value_minibatch(
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

/// How many threads run the jobs and which jobs each runs (indices into `jobs`, with the thread's
/// share of OpenMP threads), or `None` to run them in turn: with one job, several ranks (their
/// collectives must keep one order), a base off the CPU, one OpenMP thread, or (on up to 4
/// threads) loads too uneven to gain ([`balanced`]). Jobs go to the least loaded thread by estimated cost, largest first.
fn thread_shares(
    jobs: &[EpochJob],
    samples: &[PpoSample],
    bases: &Bases,
    dist: &dyn Collective,
) -> Option<Vec<(Vec<usize>, usize)>> {
    let threads = tch::get_num_threads().max(1) as usize;
    let on_cpu = bases
        .models
        .iter()
        .all(|b| b.model.device() == tch::Device::Cpu)
        && jobs.iter().all(|j| match &j.adapter {
            JobAdapter::Policy(p) => match &p.weights {
                super::agents::PolicyWeights::Full(m) => m.model.device() == tch::Device::Cpu,
                super::agents::PolicyWeights::Lora(_) => true,
            },
            JobAdapter::Critic(_) => true,
        });
    let n = jobs.len().min(threads);
    if dist.world() > 1 || n < 2 || !on_cpu {
        return None;
    }
    let mut by_cost: Vec<(usize, usize)> = jobs
        .iter()
        .enumerate()
        .map(|(i, j)| (i, j.cost(samples)))
        .collect();
    by_cost.sort_by_key(|&(i, c)| (std::cmp::Reverse(c), i));
    let mut load = vec![0usize; n];
    let mut assigned: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (i, c) in by_cost {
        let t = (0..n).min_by_key(|&t| (load[t], t)).expect("n >= 2");
        load[t] += c;
        assigned[t].push(i);
    }
    // Measured on 2 cores; with many cores one job scales worse over all of them, so uneven jobs
    // still run at the same time there.
    if threads <= 4 && !balanced(&load) {
        return None;
    }
    Some(
        assigned
            .into_iter()
            .enumerate()
            .map(|(t, mut js)| {
                js.sort_unstable();
                (js, threads / n + usize::from(t < threads % n))
            })
            .collect(),
    )
}

/// Whether threads with these loads finish close enough together for running them at the same time
/// to beat running the jobs in turn on all the cores: the busiest at most 10% above the mean. A job
/// on both cores of a 2-core machine ran 1.8× faster than on one (Zen 4, MaPoRL's products), so
/// with MaPoRL's own layout (one policy, about twice a critic's cost, beside one critic: loads 2:1)
/// the pair would take 2 units at the same time against 3 / 1.8 = 1.67 in turn; per-agent adapters
/// (loads 3:3) still run at the same time.
fn balanced(load: &[usize]) -> bool {
    let total: usize = load.iter().sum();
    let max = load.iter().copied().max().unwrap_or(0);
    max * load.len() * 10 <= total * 11
}

/// Runs `jobs` on one scoped thread per share, each with its share of OpenMP threads and its own
/// [`CausalLm::share_weights`] copy of every base (an adapter is set on a network for each
/// forward, so two threads cannot use one). Returns the jobs' results in `jobs`' order; the first
/// failing job (in that order) is the error returned.
fn concurrently(
    jobs: Vec<EpochJob>,
    shares: &[(Vec<usize>, usize)],
    bases: &Bases,
    data: &EpochData,
) -> Result<Vec<JobDone>, TrainError> {
    /// One thread's jobs (with their indices), OpenMP threads and networks.
    struct ThreadWork<'a> {
        jobs: Vec<(usize, EpochJob<'a>)>,
        threads: usize,
        nets: Vec<CausalLm>,
    }
    let mut slots: Vec<Option<EpochJob>> = jobs.into_iter().map(Some).collect();
    let work: Vec<ThreadWork> = shares
        .iter()
        .map(|(js, threads)| ThreadWork {
            jobs: js
                .iter()
                .map(|&i| (i, slots[i].take().expect("each job on one thread")))
                .collect(),
            threads: *threads,
            nets: bases
                .models
                .iter()
                .map(|b| b.model.share_weights())
                .collect(),
        })
        .collect();
    let mut results: Vec<(usize, Result<JobDone, TrainError>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = work
            .into_iter()
            .map(|w| {
                scope.spawn(move || {
                    cotrain_model::kernels::set_threads_of_this_thread(w.threads);
                    let nets: Vec<&CausalLm> = w.nets.iter().collect();
                    w.jobs
                        .into_iter()
                        .map(|(i, job)| (i, job.run(&nets, data, &SingleRank)))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| {
                h.join().unwrap_or_else(|_| {
                    vec![(usize::MAX, Err(TrainError::Panicked("a PPO update thread")))]
                })
            })
            .collect()
    });
    results.sort_by_key(|(i, _)| *i);
    results.into_iter().map(|(_, r)| r).collect()
}

#[cfg(test)]
mod length_batch_tests {
    use super::{MicroBatches, PpoSample, epoch_mini_batches, length_batches, question_units, rank_micro_batches};
    use crate::config::MaporlSection;
    use crate::dist::SingleRank;

    fn sample(question: usize, agent: usize, response: usize) -> PpoSample {
        PpoSample {
            policy: "shared.later".into(),
            critic: "critic.turn1".into(),
            turn: 1,
            agent,
            question,
            prompt: vec![1; 10],
            value_prompt: vec![1; 5],
            response: vec![2; response],
            score_slot_after: true,
            score: 0.0,
            behaviour_logprobs: None,
        }
    }

    #[test]
    fn batches_cover_every_sample_once_and_pad_at_most_a_sixteenth() {
        let lens = [420usize, 95, 431, 300, 96, 410, 700, 99, 305, 100, 415, 298];
        let idx: Vec<usize> = (0..lens.len()).collect();
        let idx: Vec<Vec<usize>> = idx.iter().map(|&k| vec![k]).collect();
        let batches = length_batches(&idx, |k| lens[k], 3);
        let mut seen: Vec<usize> = batches.iter().flatten().copied().collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..lens.len()).collect::<Vec<_>>());
        for b in &batches {
            assert!(!b.is_empty() && b.len() <= 3, "{batches:?}");
            let real: usize = b.iter().map(|&k| lens[k]).sum();
            let longest = b.iter().map(|&k| lens[k]).max().unwrap();
            assert!(b.len() * longest * 16 <= real * 17, "{b:?} pads too much");
        }
        // Similar lengths share a batch; the 700-token outlier runs alone.
        assert!(batches.contains(&vec![6]), "{batches:?}");
        assert_eq!(batches.len(), 6, "{batches:?}");
        // One row per batch at most, or one batch of everything when lengths are equal.
        assert_eq!(length_batches(&idx, |_| 50, 1).len(), lens.len());
        assert_eq!(length_batches(&idx, |_| 50, usize::MAX).len(), 1);
    }

    #[test]
    fn a_questions_answers_stay_together_in_batches_and_micro_batches() {
        // Questions 0..4, both agents each, in rollout order (question-major) but listed agent
        // by agent, as a layout with per-turn keys may list them.
        let samples: Vec<PpoSample> = (0..2)
            .flat_map(|a| (0..4).map(move |q| sample(q, a, 3 + q + a)))
            .collect();
        let idx: Vec<usize> = (0..samples.len()).collect();
        let units = question_units(&idx, &samples);
        assert_eq!(units, vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]);
        let len = |k: usize| samples[k].prompt.len() + samples[k].response.len();
        for rows in [2, 3, 4, 16] {
            for b in length_batches(&units, len, rows) {
                assert!(b.len() <= rows.max(2), "{b:?}");
                for u in &units {
                    assert!(u.iter().all(|k| b.contains(k)) || !u.iter().any(|k| b.contains(k)), "{b:?} splits {u:?}");
                }
            }
        }
        // A mini-batch of all four questions in 2 micro-batches: two questions each, shares of
        // the response tokens summing to one.
        let micro = rank_micro_batches(&units, &samples, &SingleRank, MicroBatches::Count(2), |s| s.response.len());
        assert_eq!(micro.iter().map(|(m, _)| m.clone()).collect::<Vec<_>>(), vec![vec![0, 4, 1, 5], vec![2, 6, 3, 7]]);
        let total: usize = samples.iter().map(|s| s.response.len()).sum();
        assert!((micro[0].1 - (3 + 4 + 4 + 5) as f64 / total as f64).abs() < 1e-12);
        assert!((micro.iter().map(|m| m.1).sum::<f64>() - 1.0).abs() < 1e-12);
        // `micro_batch_positions`: consecutive questions up to 60 positions (27, 29, 31, 33 each),
        // and a budget below every question runs each alone.
        let positions = |most| MicroBatches::Positions { most, positions: |s: &PpoSample| s.prompt.len() + s.response.len() };
        let split = |most| {
            rank_micro_batches(&units, &samples, &SingleRank, positions(most), |s| s.response.len())
                .into_iter()
                .map(|(m, _)| m)
                .collect::<Vec<_>>()
        };
        assert_eq!(split(60), vec![vec![0, 4, 1, 5], vec![2, 6], vec![3, 7]]);
        assert_eq!(split(1).len(), 4);
        assert_eq!(split(1000).len(), 1);
    }

    #[test]
    fn every_job_follows_the_epochs_permutation_of_questions() {
        // Six questions; the policy has both agents' answers to each, the critic none of question 4.
        let samples: Vec<PpoSample> = (0..6)
            .flat_map(|q| (0..2).map(move |a| sample(q, a, 3)))
            .collect();
        let policy: Vec<usize> = (0..samples.len()).collect();
        let critic: Vec<usize> = policy.iter().copied().filter(|&k| samples[k].question != 4).collect();
        let mut m: MaporlSection = serde_json::from_str("{}").expect("defaults");
        m.num_mini_batches = 3;
        let perms = vec![vec![4, 1, 5, 0, 3, 2], vec![2, 3, 0, 1, 4, 5]];
        let p = epoch_mini_batches(&question_units(&policy, &samples), &samples, &perms, &m);
        let c = epoch_mini_batches(&question_units(&critic, &samples), &samples, &perms, &m);
        let questions = |mb: &Vec<Vec<usize>>| mb.iter().map(|u| samples[u[0]].question).collect::<Vec<_>>();
        let of = |epochs: &Vec<Vec<Vec<Vec<usize>>>>, e: usize| epochs[e].iter().map(questions).collect::<Vec<_>>();
        assert_eq!(of(&p, 0), vec![vec![4, 1], vec![5, 0], vec![3, 2]]);
        assert_eq!(of(&c, 0), vec![vec![1], vec![5, 0], vec![3, 2]]);
        assert_eq!(of(&p, 1), vec![vec![2, 3], vec![0, 1], vec![4, 5]]);
        assert_eq!(of(&c, 1), vec![vec![2, 3], vec![0, 1], vec![5]]);
        // Each question's unit holds both agents' answers.
        assert_eq!(p[0][0][0], vec![8, 9]);
    }
}

#[cfg(test)]
mod thread_share_tests {
    use super::balanced;

    #[test]
    fn uneven_loads_run_in_turn_and_even_ones_together() {
        // MaPoRL's layout: the shared policy (cost 2) beside one critic (cost 1).
        assert!(!balanced(&[2, 1]));
        // Per-agent adapters: a policy and a critic on each thread.
        assert!(balanced(&[3, 3]));
        assert!(balanced(&[105, 100]));
        assert!(!balanced(&[130, 100]));
    }
}
