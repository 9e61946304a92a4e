//! A step's optimiser rounds, run one after another or, on one CPU rank with several policies,
//! one thread per policy.
//!
//! Why concurrently: the policies' rounds share nothing (each has its own weights, optimiser and
//! samples), and a 576-wide model's training products run more efficiently on one core each than on
//! two cores in turn, where MKL splits every product and the OpenMP team spin-waits between them.
//! Within a policy the rounds keep their order, so each policy computes what it computes on its
//! own; only the floating-point summation order inside products changes with the thread count.
//! `learner.concurrent_policies: false` runs them in turn.

use super::policy::{AgentBatches, Policy, UpdateStats};
use crate::algo::LossOptions;
use crate::dist::{Collective, SingleRank};
use crate::error::TrainError;

/// One optimiser round of one policy: its agents' mini-batches and their sample counts over all ranks.
pub(super) struct Round {
    pub(super) policy: usize,
    pub(super) batches: Vec<AgentBatches>,
    pub(super) totals: Vec<usize>,
}

/// What [`run_rounds`] did.
pub(super) struct RoundsDone {
    /// Each round's statistics, in the rounds' order.
    pub(super) stats: Vec<UpdateStats>,
    /// Which policies took an optimiser step.
    pub(super) updated: Vec<bool>,
    /// How many policies were updated at the same time (1: in turn).
    pub(super) concurrent: usize,
}

/// Runs `rounds` in order per policy, the policies at the same time where `concurrent` allows and
/// [`threads_per_policy`] finds it possible.
pub(super) fn run_rounds(
    policies: &mut [Policy],
    rounds: &[Round],
    loss_opts: &LossOptions,
    epochs: usize,
    dist: &dyn Collective,
    concurrent: bool,
) -> Result<RoundsDone, TrainError> {
    let mut updated = vec![false; policies.len()];
    let threads = if concurrent {
        threads_per_policy(policies, rounds, dist)
    } else {
        None
    };
    let together = threads.as_ref().map_or(1, Vec::len);
    let stats = match threads {
        Some(shares) => concurrently(policies, rounds, loss_opts, epochs, &shares)?,
        None => rounds
            .iter()
            .map(|r| {
                policies[r.policy].update_ranked(&r.batches, &r.totals, loss_opts, epochs, dist)
            })
            .collect::<Result<Vec<_>, _>>()?,
    };
    for (r, s) in rounds.iter().zip(&stats) {
        updated[r.policy] |= s.steps > 0;
    }
    Ok(RoundsDone {
        stats,
        updated,
        concurrent: together,
    })
}

/// The policies that `rounds` update, each once, in index order.
fn involved(rounds: &[Round]) -> Vec<usize> {
    let mut p: Vec<usize> = rounds.iter().map(|r| r.policy).collect();
    p.sort_unstable();
    p.dedup();
    p
}

/// Each involved policy (index, OpenMP threads of its thread), this thread's threads shared out, or
/// `None` to run the rounds in turn: with one policy, several ranks (their collectives must keep
/// one order), a GPU, more policies than this thread's OpenMP threads, or LoRA dropout (its masks
/// come from libtorch's one generator, which concurrent updates would share in timing's order).
fn threads_per_policy(
    policies: &[Policy],
    rounds: &[Round],
    dist: &dyn Collective,
) -> Option<Vec<(usize, usize)>> {
    let involved = involved(rounds);
    let (n, threads) = (involved.len(), tch::get_num_threads().max(1) as usize);
    let on_cpu = involved
        .iter()
        .all(|&p| policies[p].model.model.device() == tch::Device::Cpu);
    let dropout = involved.iter().any(|&p| policies[p].draws_dropout());
    if dist.world() > 1 || n < 2 || n > threads || !on_cpu || dropout {
        return None;
    }
    Some(
        involved
            .into_iter()
            .enumerate()
            .map(|(i, p)| (p, threads / n + usize::from(i < threads % n)))
            .collect(),
    )
}

/// One scoped thread per policy of `shares`, each with its share of OpenMP threads, running that
/// policy's rounds in order. The first failing round (in `rounds`' order) is the error returned; the
/// other policies finish their rounds meanwhile.
fn concurrently(
    policies: &mut [Policy],
    rounds: &[Round],
    loss_opts: &LossOptions,
    epochs: usize,
    shares: &[(usize, usize)],
) -> Result<Vec<UpdateStats>, TrainError> {
    let results: Vec<Vec<(usize, Result<UpdateStats, TrainError>)>> = std::thread::scope(|scope| {
        let handles: Vec<_> = policies
            .iter_mut()
            .enumerate()
            .filter_map(|(pi, policy)| {
                shares
                    .iter()
                    .find(|(p, _)| *p == pi)
                    .map(|&(_, threads)| (pi, policy, threads))
            })
            .map(|(pi, policy, threads)| {
                scope.spawn(move || {
                    cotrain_model::kernels::set_threads_of_this_thread(threads);
                    let mut out = Vec::new();
                    for (ri, r) in rounds.iter().enumerate().filter(|(_, r)| r.policy == pi) {
                        let s = policy.update_ranked(
                            &r.batches,
                            &r.totals,
                            loss_opts,
                            epochs,
                            &SingleRank,
                        );
                        let failed = s.is_err();
                        out.push((ri, s));
                        if failed {
                            break;
                        }
                    }
                    out
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    vec![(0, Err(TrainError::Panicked("a policy's update thread")))]
                })
            })
            .collect()
    });
    let mut by_round: Vec<(usize, Result<UpdateStats, TrainError>)> =
        results.into_iter().flatten().collect();
    by_round.sort_by_key(|(ri, _)| *ri);
    by_round.into_iter().map(|(_, s)| s).collect()
}
