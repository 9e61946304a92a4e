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
//!
//! Where each part lives: `rows` builds a sample's model inputs (prompt, then response) by
//! question, `inputs` is phase 1, `epochs` cuts phase 3 into jobs of mini-batches and folds
//! their statistics, `minibatch` runs one mini-batch's micro-batches and optimiser step, and
//! `threads` runs the jobs at the same time on one CPU rank.

mod epochs;
mod inputs;
mod minibatch;
mod rows;
#[cfg(test)]
mod tests;
mod threads;

use std::collections::BTreeMap;

use cotrain_model::families::CausalLm;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

use super::agents::{Adapters, Bases};
pub use super::targets::{PpoRecord, PpoSample, ppo_targets, training_response};
use crate::config::MaporlSection;
use crate::dist::Collective;
use crate::error::TrainError;
use epochs::JobAdapter;
use minibatch::EpochData;
use rows::{POLICY_POSITIONS, VALUE_POSITIONS};
use threads::{concurrently, thread_shares};

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
/// time where `threads::thread_shares` finds it possible (one rank, CPU, several jobs and cores); they
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
    let mut stats: BTreeMap<String, f64> = BTreeMap::new();
    let mut by_policy: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    let mut by_critic: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for (k, s) in samples.iter().enumerate() {
        by_policy.entry(&s.policy).or_default().push(k);
        by_critic.entry(&s.critic).or_default().push(k);
    }

    // 1. Old log-probs, reference log-probs, old values.
    let t_prep = std::time::Instant::now();
    let mut records =
        inputs::ppo_inputs(m, bases, adapters, samples, &by_policy, &by_critic, dist)?;
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
    let jobs = epochs::epoch_jobs(adapters, &by_policy, &by_critic, samples, &permutations, m);
    let data = EpochData {
        m,
        samples,
        records: &records,
        whitened: &whitened,
    };
    for (name, policy) in [
        ("train/policy_positions_run", true),
        ("train/value_positions_run", false),
    ] {
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
    stats.extend(epochs::epoch_stats(&done, m.num_ppo_epochs));
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
    let tokens: usize = samples.iter().map(|s| s.response.len()).sum();
    stats.insert("train/response_tokens".into(), tokens as f64);
    // The positions one pass over the samples reads (prompt and response), for arithmetic rates;
    // `*_positions_run` above: what the forwards run once common prompt prefixes are shared.
    let positions = |f: rows::Positions| samples.iter().map(f).sum::<usize>() as f64;
    stats.insert("train/policy_positions".into(), positions(POLICY_POSITIONS));
    stats.insert("train/value_positions".into(), positions(VALUE_POSITIONS));
    stats.insert("train/samples".into(), samples.len() as f64);
    Ok((records, stats))
}
