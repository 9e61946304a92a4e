//! The PPO epochs of one step as jobs: each policy adapter's and each critic's epochs are one job
//! (its own samples and parameters), each epoch its mini-batches of questions in that epoch's
//! permutation. The jobs run in turn or at the same time ([`super::threads`]).

use std::collections::BTreeMap;

use cotrain_model::families::CausalLm;
use cotrain_model::logprobs::trunk_positions;

use super::super::agents::{Adapters, Critic, PolicyAdapter};
use super::PpoSample;
use super::minibatch::{
    EpochData, MicroBatches, MinibatchStats, policy_minibatch, rank_micro_batches, value_minibatch,
};
use super::rows::{
    POLICY_LEN, POLICY_POSITIONS, POLICY_PROMPT, Positions, Prompt, VALUE_POSITIONS, VALUE_PROMPT,
    question_units, rows_of,
};
use crate::config::MaporlSection;
use crate::dist::Collective;
use crate::error::TrainError;

/// The adapter one job trains.
pub(super) enum JobAdapter<'a> {
    Policy(&'a mut PolicyAdapter),
    Critic(&'a mut Critic),
}

/// A mini-batch of one job: its samples of each of the mini-batch's questions, one list per question.
pub(super) type MiniBatch = Vec<Vec<usize>>;

/// One adapter's PPO epochs: each epoch's mini-batches.
pub(super) struct EpochJob<'a> {
    pub(super) adapter: JobAdapter<'a>,
    pub(super) orders: Vec<Vec<MiniBatch>>,
}

/// A job's mini-batches of each epoch: each permutation of the step's questions cut into
/// `num_mini_batches` parts (as many questions each, the last fewer), each part holding the job's
/// `units` (its samples of a question) in the permutation's order. A part with none of the job's
/// questions is left out: the job takes no step there.
pub(super) fn epoch_mini_batches(
    units: &[Vec<usize>],
    samples: &[PpoSample],
    permutations: &[Vec<usize>],
    m: &MaporlSection,
) -> Vec<Vec<MiniBatch>> {
    let unit_of: BTreeMap<usize, &Vec<usize>> =
        units.iter().map(|u| (samples[u[0]].question, u)).collect();
    permutations
        .iter()
        .map(|order| {
            let size = order
                .len()
                .div_ceil(m.num_mini_batches.min(order.len()).max(1))
                .max(1);
            order
                .chunks(size)
                .map(|qs| {
                    qs.iter()
                        .filter_map(|q| unit_of.get(q).map(|u| (*u).clone()))
                        .collect::<MiniBatch>()
                })
                .filter(|mb| !mb.is_empty())
                .collect()
        })
        .collect()
}

/// What a job did: per epoch, its mini-batches' statistics in order.
pub(super) struct JobDone {
    pub(super) policy: bool,
    pub(super) epochs: Vec<Vec<MinibatchStats>>,
    pub(super) seconds: f64,
}

impl EpochJob<'_> {
    /// The job's rows: the positions a sample's row reads, and its prompt (the policy's or the
    /// critic's).
    fn rows(&self) -> (Positions, Prompt) {
        match self.adapter {
            JobAdapter::Policy(_) => (POLICY_POSITIONS, POLICY_PROMPT),
            JobAdapter::Critic(_) => (VALUE_POSITIONS, VALUE_PROMPT),
        }
    }

    /// The positions this rank's forwards of one epoch run (its first), prompt prefixes shared
    /// within each micro-batch as the kernels share them: for arithmetic figures.
    pub(super) fn positions_run(
        &self,
        samples: &[PpoSample],
        m: &MaporlSection,
        dist: &dyn Collective,
    ) -> usize {
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
    pub(super) fn cost(&self, samples: &[PpoSample]) -> usize {
        let (positions, _) = self.rows();
        let tokens: usize = self.orders.first().map_or(0, |o| {
            o.iter()
                .flatten()
                .flatten()
                .map(|&k| positions(&samples[k]))
                .sum()
        });
        match &self.adapter {
            // A policy's update also runs the LM head: about twice a critic's cost per token.
            JobAdapter::Policy(_) => 2 * tokens * self.orders.len(),
            JobAdapter::Critic(_) => tokens * self.orders.len(),
        }
    }

    /// Runs every epoch's mini-batches on `nets` (the bases' networks, by index).
    pub(super) fn run(
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

/// One job per policy adapter in `by_policy` and per critic in `by_critic` (their samples), each
/// with its mini-batches of every epoch (`permutations`: each epoch's order of the step's
/// questions).
pub(super) fn epoch_jobs<'a>(
    adapters: &'a mut Adapters,
    by_policy: &BTreeMap<&str, Vec<usize>>,
    by_critic: &BTreeMap<&str, Vec<usize>>,
    samples: &[PpoSample],
    permutations: &[Vec<usize>],
    m: &MaporlSection,
) -> Vec<EpochJob<'a>> {
    let epochs_of = |idx: &Vec<usize>| {
        epoch_mini_batches(&question_units(idx, samples), samples, permutations, m)
    };
    let policy_orders: Vec<Vec<Vec<MiniBatch>>> = by_policy.values().map(epochs_of).collect();
    let critic_orders: Vec<Vec<Vec<MiniBatch>>> = by_critic.values().map(epochs_of).collect();
    let mut jobs: Vec<EpochJob> = Vec::with_capacity(by_policy.len() + by_critic.len());
    let mut policies = adapters.policies.iter_mut();
    for (key, orders) in by_policy.keys().zip(policy_orders) {
        let (_, p) = policies
            .find(|(k, _)| k.as_str() == *key)
            .expect("ppo_inputs found every adapter");
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
    jobs
}

/// The epochs' training scalars: each policy statistic averaged over the policy mini-batches of
/// every job and epoch, each value statistic over the critics', and the counts of skipped
/// mini-batches (`policy/skipped`, `val/skipped`).
pub(super) fn epoch_stats(done: &[JobDone], num_ppo_epochs: usize) -> BTreeMap<String, f64> {
    let mut stats: BTreeMap<String, f64> = BTreeMap::new();
    let acc = |k: &str, v: f64, stats: &mut BTreeMap<String, f64>| {
        *stats.entry(k.to_string()).or_insert(0.0) += v
    };
    // The statistics in the order the epochs produce them one job after another.
    let (mut pg_n, mut vf_n) = (0.0f64, 0.0f64);
    for epoch in 0..num_ppo_epochs {
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
    stats
}
