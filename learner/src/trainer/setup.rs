//! The GRPO / MAGRPO loop (docs/src/trainers/magrpo.md), single- and multi-turn.
//!
//! One *step* consumes `rollout_buffer_size` items of the epoch's seeded order (fewer at the end of an
//! epoch):
//!
//! 1. roll out ([`super::rollout`]): the step's forest of nodes, depth by depth; each depth's
//!    (node, agent) pairs ask the rollout source for G samples in one concurrent batch (seeds derived
//!    from run seed, step, agent, item and node; `min_policy_version` = the version last pushed), every
//!    sample is checked to come from exactly that version ([`Trainer::draw_samples`]), the joint
//!    actions (`aligned` or `cross`) are scored in one batch, and non-leaf nodes get children whose
//!    prompts the external transition builds ([`super::transition`]). Single-turn: one root per item;
//! 2. returns, advantages and turn weights over the forest ([`super::tree`]);
//! 3. update: the nodes in the groups the original updates on ([`Forest::update_groups`]), per group
//!    and policy one optimiser round: the summed-log-prob loss (or the configured options) through the
//!    chunked log-prob kernel, each sample weighted by its node's turn weight (shared parameters: every
//!    agent's loss scaled by 1/N, one step after the last agent); non-finite → skipped with a warning;
//! 4. sync: the new weights are pushed to every rollout worker as version v + 1 before anything else
//!    is sampled; with `logging.rollouts` every node goes to `rollouts.jsonl`.
//!
//! With `rollout.max_off_policy_steps` > 0, [`Trainer::train_step_async`] replaces the strict version
//! check by a bound on staleness and draws the next step's rollout while this one trains.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use tracing::warn;

use super::batch::StepRollout;
use super::policy::Policy;
use crate::config::CheckedConfig;
use crate::dist::{Collective, SingleRank};
use crate::error::TrainError;
use crate::external::expert::ExpertClient;
use crate::metrics::MetricsWriter;
use crate::prompts::NextTurnPrompter;
use crate::prompts::items::TrainItem;
use crate::seeds::derive_seed;
use crate::sources::{GenRequest, GenSample, RewardSource, RolloutSource, SamplingSpec};

/// Everything a [`Trainer`] runs with; [`super::build`] makes one from a config, tests assemble their
/// own (tiny models, in-process sources).
pub struct TrainerSetup {
    pub cfg: CheckedConfig,
    pub run_dir: PathBuf,
    /// The reward source's task name (`code`, ...).
    pub task: String,
    /// Code tasks get PassOrNot@k / Accuracy@k / MaxCoop@k at evaluation.
    pub is_code: bool,
    pub policies: Vec<Policy>,
    /// `agent_policy[i]` is the index of the policy agent `i` samples from and trains.
    pub agent_policy: Vec<usize>,
    pub rollout: Box<dyn RolloutSource>,
    pub reward: Box<dyn RewardSource>,
    pub train_items: Vec<TrainItem>,
    pub eval_items: Vec<TrainItem>,
}

/// The trainer; see the module docs.
pub struct Trainer {
    pub(super) s: TrainerSetup,
    /// The expert model of `external.mode: expert_edits`.
    pub(super) expert: Option<ExpertClient>,
    /// How later turns' prompts are written (`external.next_turn_prompt`).
    pub(super) next_turn: NextTurnPrompter,
    pub(super) step: u64,
    pub(super) epoch: u64,
    pub(super) position: u64,
    pub(super) rng: ChaCha8Rng,
    pub(super) rng_seed: u64,
    /// `None` on ranks other than 0: rank 0 alone writes the run's files.
    pub(super) metrics: Option<MetricsWriter>,
    /// The learner's ranks (one rank: [`crate::dist::SingleRank`]).
    pub(super) dist: Box<dyn Collective>,
    pub(super) history: Vec<BTreeMap<String, f64>>,
    pub(super) last_checkpoint: Option<PathBuf>,
    /// Stop (as if killed) after this many steps; for resume tests.
    pub stop_after_steps: Option<u64>,
    /// Sample exactly `max_new_tokens` per completion, ignoring EOS (benchmarks).
    pub ignore_eos: bool,
    /// Asynchronous rollouts: the next step's rollout, drawn while this step trained.
    pub(super) pending: Option<StepRollout>,
    /// `train_between_items`: the nodes of earlier items not yet trained (a partial buffer, carried
    /// across steps and kept in checkpoints).
    pub(super) buffered: Vec<super::batch::BufferedNode>,
    /// `train_between_items`: the step under way has updated the policies already (a failure now
    /// leaves no state a checkpoint could resume the step from).
    pub(super) updated_mid_step: bool,
    /// While the policies train on another thread: each policy's (worker agent, served version),
    /// what rollouts read instead of the policies.
    pub(super) lent: Option<Vec<(String, u64)>>,
    /// `iac` / `maac`: the critics (one per agent, or one), and each agent's samples not yet
    /// trained on (kept in checkpoints).
    pub(super) critics: Vec<super::critic::Critic>,
    /// `iac` with `use_separate_critic: false`: a value head on each policy.
    pub(super) heads: Vec<super::critic::ValueHead>,
    pub(super) ac_buffer: Vec<super::batch::AcSample>,
}

pub(super) const TAG_ORDER: u64 = 1;
pub(super) const TAG_SAMPLE: u64 = 2;
pub(super) const TAG_BUFFER: u64 = 3;
pub(super) const TAG_EVAL: u64 = 4;

impl Trainer {
    /// Validates the setup and opens the run directory's metrics.
    pub fn new(s: TrainerSetup) -> Result<Self, TrainError> {
        Self::new_ranked(s, Box::new(SingleRank))
    }

    /// A trainer that is one of the data-parallel ranks of `dist` (see [`crate::dist`]): it trains
    /// on its share of each step's items; rank 0 alone pushes weights and writes the run's files.
    pub fn new_ranked(s: TrainerSetup, dist: Box<dyn Collective>) -> Result<Self, TrainError> {
        super::check_supported(&s.cfg)?;
        super::check_ranks(&s.cfg, dist.world())?;
        let matmul_kind = super::matmul_kind(&s.cfg);
        for p in &s.policies {
            p.model.model.set_matmul_kind(matmul_kind);
        }
        if let (Some(kind), Some(p)) = (matmul_kind, s.policies.first()) {
            crate::model_options::announce_matmul_rate(kind, p.model.model.device());
        }
        if s.agent_policy.len() != s.cfg.num_agents
            || s.agent_policy.iter().any(|&p| p >= s.policies.len())
        {
            return Err(TrainError::Config(format!(
                "{} agents mapped onto {} policies: {:?}",
                s.cfg.num_agents,
                s.policies.len(),
                s.agent_policy
            )));
        }
        if s.train_items.is_empty() {
            return Err(TrainError::Data("the train split selects no rows".into()));
        }
        if s.train_items
            .iter()
            .chain(&s.eval_items)
            .any(|it| it.prompts.len() != s.cfg.num_agents)
        {
            return Err(TrainError::Data(
                "every item needs one prompt per agent".into(),
            ));
        }
        let metrics = if dist.is_root() {
            std::fs::create_dir_all(&s.run_dir)
                .map_err(|e| TrainError::Io(format!("{}: {e}", s.run_dir.display())))?;
            // A process killed mid-checkpoint left a partial copy of the policies behind.
            for stale in crate::checkpoint::remove_stale_temporaries(&s.run_dir)
                .map_err(|e| TrainError::Checkpoint(e.to_string()))?
            {
                warn!(path = %stale.display(), "removed a partial checkpoint left by an interrupted run");
            }
            Some(
                MetricsWriter::create(&s.run_dir, s.cfg.raw.logging.tensorboard)
                    .map_err(|e| TrainError::Io(format!("{}: {e}", s.run_dir.display())))?,
            )
        } else {
            None
        };
        let next_turn = NextTurnPrompter::from_config(&s.cfg, s.is_code)
            .map_err(|e| TrainError::Config(format!("{}: {e}", s.cfg.source.display())))?;
        let rng_seed = derive_seed(&[s.cfg.raw.seed, TAG_BUFFER]);
        let critics = super::critic::load_critics(&s.cfg, &s.policies, &s.agent_policy)?;
        let heads = super::critic::load_heads(&s.cfg, &s.policies);
        for c in &critics {
            c.model.model.set_matmul_kind(matmul_kind);
        }
        Ok(Self {
            critics,
            heads,
            ac_buffer: Vec::new(),
            next_turn,
            step: 0,
            epoch: 0,
            position: 0,
            rng: ChaCha8Rng::seed_from_u64(rng_seed),
            rng_seed,
            metrics,
            dist,
            history: Vec::new(),
            last_checkpoint: None,
            stop_after_steps: None,
            ignore_eos: false,
            pending: None,
            buffered: Vec::new(),
            updated_mid_step: false,
            lent: None,
            expert: None,
            s,
        })
    }

    pub fn run_dir(&self) -> &Path {
        &self.s.run_dir
    }

    pub fn step(&self) -> u64 {
        self.step
    }

    pub fn policies(&self) -> &[Policy] {
        &self.s.policies
    }

    pub(super) fn b(&self) -> usize {
        self.s.cfg.trainer.rollout_buffer_size
    }

    /// Steps per epoch and in the whole run.
    pub fn total_steps(&self) -> u64 {
        let n = self.s.train_items.len();
        (n.div_ceil(self.b()) * self.s.cfg.trainer.num_train_epochs) as u64
    }

    /// Sets the expert client `external.mode: expert_edits` asks for edits.
    pub fn with_expert(mut self, expert: ExpertClient) -> Self {
        self.expert = Some(expert);
        self
    }

    /// Agent `a`'s sampling parameters (`model.agents[a]` over the shared ones).
    pub(super) fn sampling(&self, a: usize) -> SamplingSpec {
        let agent = &self.s.cfg.agents[a];
        let s = agent.sampling;
        SamplingSpec {
            temperature: s.temperature,
            top_p: s.top_p,
            top_k: s.top_k,
            max_new_tokens: s.max_new_tokens,
            ignore_eos: self.ignore_eos,
            stop: agent.stop.clone(),
            sampling_logprobs: false,
        }
    }

    /// The worker agent and the policy version agent `a` samples from.
    pub(super) fn target(&self, a: usize) -> (String, u64) {
        let pi = self.s.agent_policy[a];
        match &self.lent {
            Some(view) => view[pi].clone(),
            None => (
                self.s.policies[pi].worker_agent.clone(),
                self.s.policies[pi].wire_version,
            ),
        }
    }

    /// Generates `requests`. On-policy runs check that every sample comes from the version the learner
    /// last pushed; asynchronous ones return the samples as drawn (the pipeline bounds their staleness).
    ///
    /// On-policy means on-policy: a sample from any other version is never trained on. A stale
    /// sample (a worker that lost or missed an update, e.g. one that joined the pool after the last
    /// push) makes the learner push the current weights to every worker again and redraw the whole
    /// batch once with the same seeds; a second stale sample stops the run with an error naming the
    /// agent and both versions.
    /// Asynchronous rollouts (`rollout.max_off_policy_steps` > 0) bound staleness at training time
    /// instead (see [`Trainer::train_step_async`]).
    pub fn draw_samples(
        &mut self,
        requests: &[GenRequest],
        agents: &[usize],
    ) -> Result<Vec<Vec<GenSample>>, TrainError> {
        if self.s.cfg.raw.rollout.max_off_policy_steps > 0 {
            return self.s.rollout.generate(requests);
        }
        for attempt in 0..2 {
            let out = self.s.rollout.generate(requests)?;
            let stale = requests
                .iter()
                .zip(&out)
                .zip(agents)
                .find_map(|((r, samples), &a)| {
                    samples
                        .iter()
                        .find(|s| s.policy_version != r.min_policy_version)
                        .map(|s| (a, r.min_policy_version, s.policy_version))
                });
            match stale {
                None => return Ok(out),
                Some((agent, expected, got)) if attempt == 0 => {
                    warn!(
                        agent,
                        expected, got, "stale sample: re-pushing weights and redrawing"
                    );
                    for p in &self.s.policies {
                        let params = p.parameters();
                        let probe = p.weight_probe()?;
                        let push = crate::sources::WeightPush {
                            agent: &p.worker_agent,
                            version: p.wire_version,
                            params: &params,
                            lora_scaling: p.lora_scaling(),
                            probe: Some(&probe),
                        };
                        self.s.rollout.push_weights_all(&[push])?;
                    }
                }
                Some((agent, expected, got)) => {
                    return Err(TrainError::StaleSample {
                        agent,
                        expected,
                        got,
                    });
                }
            }
        }
        unreachable!("the loop returns on its second attempt")
    }
}
