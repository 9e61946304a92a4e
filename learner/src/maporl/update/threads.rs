//! Running the step's epoch jobs at the same time on one CPU rank (`learner.concurrent_policies`):
//! one scoped thread per share of the cores, each with its own handle on the frozen bases, when the
//! jobs' loads are even enough for that to beat running them in turn on every core.

use cotrain_model::families::CausalLm;

use super::super::agents::{Bases, PolicyWeights};
use super::PpoSample;
use super::epochs::{EpochJob, JobAdapter, JobDone};
use super::minibatch::EpochData;
use crate::dist::{Collective, SingleRank};
use crate::error::TrainError;

/// How many threads run the jobs and which jobs each runs (indices into `jobs`, with the thread's
/// share of OpenMP threads), or `None` to run them in turn: with one job, several ranks (their
/// collectives must keep one order), a base off the CPU, one OpenMP thread, or (on up to 4
/// threads) loads too uneven to gain ([`balanced`]). Jobs go to the least loaded thread by estimated cost, largest first.
pub(super) fn thread_shares(
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
                PolicyWeights::Full(m) => m.model.device() == tch::Device::Cpu,
                PolicyWeights::Lora(_) => true,
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
pub(super) fn concurrently(
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
mod tests {
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
