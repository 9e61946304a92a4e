//! The GRPO / MAGRPO loop (algorithms.md), single- and multi-turn.
//!
//! One *step* consumes `rollout_buffer_size` items of the epoch's seeded order (fewer at the end of an
//! epoch):
//!
//! 1. roll out ([`super::rollout`]): the step's forest of nodes, depth by depth; each depth's
//!    (node, agent) pairs ask the rollout source for G samples in one concurrent batch (seeds derived
//!    from run seed, step, agent, item and node; `min_policy_version` = the version last pushed), every
//!    sample is checked to come from exactly that version ([`Trainer::generate_checked`]), the joint
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
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Instant;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use tracing::{info, warn};

use super::policy::{AgentBatches, Policy, TrainSample, UpdateStats};
use super::rounds::{Round, run_rounds};
use super::rollout::{RolloutPlan, RolloutTimes};
use super::sources::{CodeOutcome, GenRequest, GenSample, RewardSource, RolloutSource, SamplingSpec, Score, WeightPush};
use super::tree::{Expansion, Forest};
use super::{TrainError, TrainItem};
use crate::algo::{AdvantageOptions, LossOptions, RolloutBuffer};
use crate::checkpoint::{TrainState, latest_checkpoint, load_checkpoint, read_weights, save_checkpoint};
use crate::config::{CheckedConfig, JointMode, MultiTurnMode, ProgressMode};
use crate::dist::{Collective, SingleRank};
use crate::external::expert::ExpertClient;
use crate::metrics::MetricsWriter;

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

/// What a finished (or stopped) run leaves behind.
#[derive(Debug, Clone, PartialEq)]
pub struct RunSummary {
    pub run_dir: PathBuf,
    pub steps: u64,
    pub metrics_path: PathBuf,
    pub checkpoint: Option<PathBuf>,
    /// The Hugging Face model directories written at the end (`output.save_final_model`).
    pub final_models: Vec<PathBuf>,
    pub plots: Vec<PathBuf>,
    /// Every logged step's scalars, in order (what `metrics.jsonl` got).
    pub history: Vec<BTreeMap<String, f64>>,
    /// Stopped on a request (SIGTERM, the control plane) after a checkpoint, before the end.
    pub stopped: bool,
}

/// The trainer; see the module docs.
pub struct Trainer {
    pub(super) s: TrainerSetup,
    /// The expert model of `external.mode: expert_edits`.
    pub(super) expert: Option<ExpertClient>,
    step: u64,
    epoch: u64,
    position: u64,
    rng: ChaCha8Rng,
    rng_seed: u64,
    /// `None` on ranks other than 0: rank 0 alone writes the run's files.
    metrics: Option<MetricsWriter>,
    /// The learner's ranks (one rank: [`crate::dist::SingleRank`]).
    dist: Box<dyn Collective>,
    history: Vec<BTreeMap<String, f64>>,
    last_checkpoint: Option<PathBuf>,
    /// Stop (as if killed) after this many steps; for resume tests.
    pub stop_after_steps: Option<u64>,
    /// Sample exactly `max_new_tokens` per completion, ignoring EOS (benchmarks).
    pub ignore_eos: bool,
    /// Asynchronous rollouts: the next step's rollout, drawn while this step trained.
    pending: Option<StepRollout>,
    /// While the policies train on another thread: each policy's (worker agent, served version),
    /// what rollouts read instead of the policies.
    lent: Option<Vec<(String, u64)>>,
}

/// One step's rollout on this rank: its rows, this rank's share of their items, the forest.
struct StepRollout {
    rows: Vec<usize>,
    items: Vec<TrainItem>,
    forest: Forest,
    times: RolloutTimes,
}

/// Where a rank's work lies. Data placement: the step's items are split into one shard per rank and
/// every rank trains every policy on its shard. Agent placement (`learner.placement: agent`, P
/// policies on P·D ranks): rank r computes only policy r / D's gradients, on shard r mod D of D; every
/// rank still holds every policy and applies every policy's summed gradients, so all ranks stay
/// identical.
#[derive(Debug, Clone, Copy)]
struct Layout {
    shards: usize,
    shard: usize,
    /// Agent placement: the one policy this rank computes gradients for.
    own: Option<usize>,
}

/// What an asynchronous step reports beside the usual metrics.
#[derive(Debug, Default)]
struct AsyncReport {
    staleness: Vec<f64>,
    dropped: usize,
    redrawn: usize,
    overlap_secs: f64,
    lookahead_generate_secs: f64,
}

/// Mixes values into one seed (SplitMix64 finaliser over a running hash).
pub fn derive_seed(parts: &[u64]) -> u64 {
    let mut h: u64 = 0x9E37_79B9_7F4A_7C15;
    for &p in parts {
        h ^= p.wrapping_add(0x9E37_79B9_7F4A_7C15).wrapping_add(h << 6).wrapping_add(h >> 2);
        let mut z = h;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        h = z ^ (z >> 31);
    }
    h
}

const TAG_ORDER: u64 = 1;
const TAG_SAMPLE: u64 = 2;
const TAG_BUFFER: u64 = 3;
const TAG_EVAL: u64 = 4;

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
        if let Some(kind) = matmul_kind
            && s.policies.first().is_some_and(|p| p.model.model.device() == tch::Device::Cpu)
        {
            // Some CPUs with avx512_bf16 (no AMX) run libtorch's bf16 products slower than f32:
            // say so rather than train slower and less precisely than asked for.
            let (ours, f32_rate) = (cotrain_model::kernels::dispatch::product_gflops(kind), cotrain_model::kernels::dispatch::product_gflops(tch::Kind::Float));
            if ours < f32_rate {
                warn!("model.matmul_dtype: {kind:?} products run at {ours:.0} GFLOP/s on this CPU against {f32_rate:.0} for f32: training will be slower, not faster");
            } else {
                info!("model.matmul_dtype: {kind:?} products at {ours:.0} GFLOP/s on this CPU, f32 at {f32_rate:.0}");
            }
        }
        if s.agent_policy.len() != s.cfg.num_agents || s.agent_policy.iter().any(|&p| p >= s.policies.len()) {
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
        if s.train_items.iter().chain(&s.eval_items).any(|it| it.prompts.len() != s.cfg.num_agents) {
            return Err(TrainError::Data("every item needs one prompt per agent".into()));
        }
        let metrics = if dist.is_root() {
            std::fs::create_dir_all(&s.run_dir).map_err(|e| TrainError::Io(format!("{}: {e}", s.run_dir.display())))?;
            // A process killed mid-checkpoint left a partial copy of the policies behind.
            for stale in crate::checkpoint::remove_stale_temporaries(&s.run_dir).map_err(|e| TrainError::Checkpoint(e.to_string()))? {
                warn!(path = %stale.display(), "removed a partial checkpoint left by an interrupted run");
            }
            Some(MetricsWriter::create(&s.run_dir, s.cfg.raw.logging.tensorboard).map_err(|e| TrainError::Io(format!("{}: {e}", s.run_dir.display())))?)
        } else {
            None
        };
        let rng_seed = derive_seed(&[s.cfg.raw.seed, TAG_BUFFER]);
        Ok(Self {
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

    fn b(&self) -> usize {
        self.s.cfg.trainer.rollout_buffer_size
    }

    /// Steps per epoch and in the whole run.
    pub fn total_steps(&self) -> u64 {
        let n = self.s.train_items.len();
        (n.div_ceil(self.b()) * self.s.cfg.trainer.num_train_epochs) as u64
    }

    /// Loads the latest checkpoint of `run_dir` (weights, optimiser moments, step, data position,
    /// RNG) so that the run continues as if it had never stopped.
    pub fn resume(&mut self, run_dir: &Path) -> Result<PathBuf, TrainError> {
        let dir = latest_checkpoint(run_dir)
            .ok_or_else(|| TrainError::Checkpoint(format!("{}: no complete checkpoint to resume from", run_dir.display())))?;
        self.restore(&dir)?;
        if let Some(m) = &mut self.metrics {
            let dropped = m.truncate_after(self.step).map_err(|e| TrainError::Io(format!("{}: {e}", m.path().display())))?;
            if dropped > 0 {
                info!(dropped, step = self.step, "metrics of steps after the checkpoint dropped; they are logged again");
            }
            let rollouts = self.s.run_dir.join("rollouts.jsonl");
            let dropped = crate::metrics::truncate_jsonl_after(&rollouts, self.step).map_err(|e| TrainError::Io(format!("{}: {e}", rollouts.display())))?;
            if dropped > 0 {
                info!(dropped, step = self.step, "rollouts of steps after the checkpoint dropped; they are logged again");
            }
        }
        Ok(dir)
    }

    /// Loads one checkpoint directory (`RUN_DIR/checkpoints/step-N`) into this trainer.
    pub fn restore(&mut self, dir: &Path) -> Result<(), TrainError> {
        let dir = dir.to_path_buf();
        let mut pairs: Vec<(&mut tch::nn::VarStore, &mut crate::algo::AdamW)> =
            self.s.policies.iter_mut().map(|p| (&mut p.model.vs, &mut p.optimizer)).collect();
        let st = load_checkpoint(&dir, &mut pairs).map_err(|e| TrainError::Checkpoint(e.to_string()))?;
        self.step = st.step;
        self.epoch = st.epoch;
        self.position = st.data_position;
        let word: u128 = st
            .rng_word_pos
            .parse()
            .map_err(|_| TrainError::Checkpoint(format!("{}: bad rng_word_pos `{}`", dir.display(), st.rng_word_pos)))?;
        self.rng_seed = st.rng_seed;
        self.rng = ChaCha8Rng::seed_from_u64(st.rng_seed);
        self.rng.set_word_pos(word);
        info!(checkpoint = %dir.display(), step = st.step, epoch = st.epoch, position = st.data_position, "resumed");
        self.last_checkpoint = Some(dir);
        Ok(())
    }

    /// Loads only the weights of a checkpoint (`agent-{i}/model.safetensors`) into the policies, for
    /// evaluation: optimiser state is neither read nor allocated.
    pub fn restore_weights(&mut self, dir: &Path) -> Result<(), TrainError> {
        for (i, p) in self.s.policies.iter().enumerate() {
            let tensors: std::collections::HashMap<String, tch::Tensor> =
                read_weights(dir, i).map_err(|e| TrainError::Checkpoint(e.to_string()))?.into_iter().collect();
            p.model.load_named_tensors(&tensors).map_err(|e| TrainError::Checkpoint(format!("{} policy {i}: {e}", dir.display())))?;
        }
        info!(checkpoint = %dir.display(), "weights loaded");
        Ok(())
    }

    /// Pushes every policy's current weights to the rollout workers, as a version above anything
    /// they serve (a remote worker may hold an older run's weights). With several ranks, rank 0
    /// pushes and every rank learns the version.
    pub fn sync_all_weights(&mut self) -> Result<f64, TrainError> {
        let t = Instant::now();
        let mut versions = vec![0; self.s.policies.len()];
        if self.dist.is_root() {
            for (p, v) in self.s.policies.iter().zip(&mut versions) {
                let served = self.s.rollout.policy_version(&p.worker_agent)?;
                *v = served.max(p.wire_version) + 1;
            }
            let params: Vec<_> = self.s.policies.iter().map(|p| p.parameters()).collect();
            let updates: Vec<WeightPush> = self
                .s
                .policies
                .iter()
                .zip(&versions)
                .zip(&params)
                .map(|((p, &version), params)| WeightPush { agent: &p.worker_agent, version, params })
                .collect();
            self.s.rollout.push_weights_all(&updates)?;
        }
        for (pi, v) in versions.into_iter().enumerate() {
            self.s.policies[pi].wire_version = self.dist.broadcast_u64(v, 0)?;
        }
        Ok(t.elapsed().as_secs_f64())
    }

    /// The learner's ranks.
    pub fn collective(&self) -> &dyn Collective {
        self.dist.as_ref()
    }

    /// Gives every rank rank 0's weights, optimiser moments (when rank 0 has them: after a resume)
    /// and train state, so that all ranks start identical.
    pub fn sync_ranks(&mut self) -> Result<(), TrainError> {
        if self.dist.world() == 1 {
            return Ok(());
        }
        let d = self.dist.as_ref();
        let mut state = serde_json::to_vec(&serde_json::json!({
            "step": self.step, "epoch": self.epoch, "position": self.position,
            "rng_seed": self.rng_seed, "rng_word_pos": self.rng.get_word_pos().to_string(),
            "moments": self.s.policies.iter().map(|p| p.optimizer.has_state() && p.optimizer.step > 0).collect::<Vec<_>>(),
            "optimizer_steps": self.s.policies.iter().map(|p| p.optimizer.step).collect::<Vec<_>>(),
        }))
        .map_err(|e| TrainError::Dist(e.to_string()))?;
        d.broadcast_bytes(&mut state, 0)?;
        let st: serde_json::Value = serde_json::from_slice(&state).map_err(|e| TrainError::Dist(format!("rank 0's train state: {e}")))?;
        let num = |k: &str| st[k].as_u64().ok_or_else(|| TrainError::Dist(format!("rank 0's train state lacks {k}")));
        self.step = num("step")?;
        self.epoch = num("epoch")?;
        self.position = num("position")?;
        self.rng_seed = num("rng_seed")?;
        self.rng = ChaCha8Rng::seed_from_u64(self.rng_seed);
        self.rng.set_word_pos(st["rng_word_pos"].as_str().and_then(|w| w.parse().ok()).unwrap_or(0));
        for (pi, p) in self.s.policies.iter_mut().enumerate() {
            crate::dist::broadcast_tensors(d, &p.optimizer.parameters(), 0)?;
            if st["moments"][pi].as_bool() == Some(true) {
                crate::dist::broadcast_tensors(d, &p.optimizer.moments_mut(), 0)?;
                p.optimizer.step = st["optimizer_steps"][pi].as_u64().unwrap_or(p.optimizer.step);
            }
        }
        info!(rank = d.rank(), world = d.world(), backend = d.backend(), step = self.step, "ranks start from rank 0's state");
        Ok(())
    }

    /// Compares the policies' weights over the ranks (see [`crate::dist::check_same`]).
    fn check_ranks_agree(&self) -> Result<(), TrainError> {
        for p in &self.s.policies {
            crate::dist::check_same(self.dist.as_ref(), &format!("policy `{}` after step {}", p.worker_agent, self.step), &p.optimizer.parameters())
                ?;
        }
        Ok(())
    }

    /// Sets the expert client `external.mode: expert_edits` asks for edits.
    pub fn with_expert(mut self, expert: ExpertClient) -> Self {
        self.expert = Some(expert);
        self
    }

    pub(super) fn sampling(&self) -> SamplingSpec {
        let s = self.s.cfg.sampling;
        SamplingSpec { temperature: s.temperature, top_p: s.top_p, top_k: s.top_k, max_new_tokens: s.max_new_tokens, ignore_eos: self.ignore_eos }
    }

    /// The worker agent and the policy version agent `a` samples from.
    pub(super) fn target(&self, a: usize) -> (String, u64) {
        let pi = self.s.agent_policy[a];
        match &self.lent {
            Some(view) => view[pi].clone(),
            None => (self.s.policies[pi].worker_agent.clone(), self.s.policies[pi].wire_version),
        }
    }

    /// Generates and checks that every sample comes from the version the learner last pushed.
    ///
    /// On-policy means on-policy: a sample from any other version is never trained on. A stale
    /// sample (a worker that lost or missed an update, e.g. one that joined the pool after the last
    /// push) makes the learner push the current weights to every worker again and redraw the whole
    /// batch once with the same seeds; a second stale sample stops the run with an error naming the
    /// agent and both versions.
    /// Asynchronous rollouts (`rollout.max_off_policy_steps` > 0) bound staleness at training time
    /// instead (see [`Trainer::train_step_async`]).
    pub fn generate_checked(&mut self, requests: &[GenRequest], agents: &[usize]) -> Result<Vec<Vec<GenSample>>, TrainError> {
        if self.s.cfg.raw.rollout.max_off_policy_steps > 0 {
            return self.s.rollout.generate(requests);
        }
        for attempt in 0..2 {
            let out = self.s.rollout.generate(requests)?;
            let stale = requests.iter().zip(&out).zip(agents).find_map(|((r, samples), &a)| {
                samples.iter().find(|s| s.policy_version != r.min_policy_version).map(|s| (a, r.min_policy_version, s.policy_version))
            });
            match stale {
                None => return Ok(out),
                Some((agent, expected, got)) if attempt == 0 => {
                    warn!(agent, expected, got, "stale sample: re-pushing weights and redrawing");
                    for p in &self.s.policies {
                        self.s.rollout.push_weights(&p.worker_agent, p.wire_version, &p.parameters())?;
                    }
                }
                Some((agent, expected, got)) => return Err(TrainError::StaleSample { agent, expected, got }),
            }
        }
        unreachable!("the loop returns on its second attempt")
    }

    /// The rollout plan of training: G per node, the configured variant (single-turn: the forest of
    /// roots only).
    fn train_plan(&self, step: u64) -> RolloutPlan {
        let t = &self.s.cfg.trainer;
        let expansion = match t.rollout {
            MultiTurnMode::Tree => Expansion::Tree { termination_threshold: t.termination_threshold },
            MultiTurnMode::Handoff => Expansion::Handoff { handoff: t.handoff, early_termination_threshold: t.early_termination_threshold },
        };
        RolloutPlan { expansion, joint_mode: t.joint_mode, g: t.num_generations, seed_tag: TAG_SAMPLE, seed_step: step }
    }

    /// One step on the given rows of the train split (see the module docs); returns its scalars.
    pub fn train_step(&mut self, rows: &[usize]) -> Result<BTreeMap<String, f64>, TrainError> {
        let t_step = Instant::now();
        let batch = self.roll_out_rows(rows, self.step)?;
        self.update_and_report(batch, t_step, None, AsyncReport::default())
    }

    /// This rank's share of `rows` rolled out as step `step` (its seeds).
    fn roll_out_rows(&mut self, rows: &[usize], step: u64) -> Result<StepRollout, TrainError> {
        let layout = self.layout();
        // This rank's shard of the step's items: every shards-th, from its shard on.
        let items: Vec<TrainItem> = rank_share(rows, layout.shard, layout.shards).iter().map(|&r| self.s.train_items[r].clone()).collect();
        let plan = self.train_plan(step);
        if layout.own.is_none() {
            let refs: Vec<&TrainItem> = items.iter().collect();
            let (forest, times) = self.roll_out(&refs, &plan)?;
            return Ok(StepRollout { rows: rows.to_vec(), items, forest, times });
        }
        // Agent placement: the ranks of policy 0 (ranks 0..shards) roll their shards out for every
        // agent; every other rank receives its shard's rollout from them.
        let (mut forest, mut times) = (Forest::default(), RolloutTimes::default());
        if self.dist.rank() < layout.shards {
            let refs: Vec<&TrainItem> = items.iter().collect();
            (forest, times) = self.roll_out(&refs, &plan)?;
        }
        let bytes = serde_json::to_vec(&forest).map_err(|e| TrainError::Dist(format!("serialising the step's rollouts: {e}")))?;
        let all = self.dist.all_gather_bytes(&bytes)?;
        let forest = serde_json::from_slice(&all[layout.shard]).map_err(|e| TrainError::Dist(format!("rank {}'s rollouts: {e}", layout.shard)))?;
        Ok(StepRollout { rows: rows.to_vec(), items, forest, times })
    }

    /// How this rank's work is placed (see [`Layout`]).
    fn layout(&self) -> Layout {
        let (rank, world) = (self.dist.rank(), self.dist.world());
        match self.s.cfg.raw.learner.placement {
            crate::config::Placement::Agent if world > 1 => {
                let shards = (world / self.s.policies.len().max(1)).max(1);
                Layout { shards, shard: rank % shards, own: Some(rank / shards) }
            }
            _ => Layout { shards: world, shard: rank, own: None },
        }
    }

    /// One step with asynchronous rollouts (`rollout.max_off_policy_steps` = k > 0): trains on the
    /// rollout drawn while the previous step trained (or draws it now), after redrawing every item
    /// with a sample more than k policy versions older than the policy it trains; while it trains
    /// (on another thread), the rollout of `next` is drawn from the weights the workers serve now.
    /// The loss corrects for the behaviour policy with truncated importance weights
    /// (`rollout.importance_weight_cap`). A checkpoint holds no rollout: a resumed run draws the
    /// rollout of its next step anew, from the restored policy.
    pub fn train_step_async(&mut self, rows: &[usize], next: Option<&[usize]>) -> Result<BTreeMap<String, f64>, TrainError> {
        let t_step = Instant::now();
        let k = self.s.cfg.raw.rollout.max_off_policy_steps as u64;
        let mut batch = match self.pending.take() {
            Some(b) if b.rows == rows => b,
            _ => self.roll_out_rows(rows, self.step)?,
        };
        let mut report = AsyncReport::default();
        let current: Vec<u64> = (0..self.s.cfg.num_agents).map(|a| self.target(a).1).collect();
        let stale = stale_items(&batch.forest, &current, k);
        if !stale.is_empty() {
            let t = Instant::now();
            report.dropped = stale.iter().map(|&(_, n)| n).sum();
            let redo_rows: Vec<usize> = stale.iter().map(|&(i, _)| batch.items[i].index).collect();
            warn!(items = stale.len(), samples = report.dropped, bound = k, "samples staler than max_off_policy_steps: redrawing their items");
            let refs: Vec<&TrainItem> = stale.iter().map(|&(i, _)| &batch.items[i]).collect();
            let plan = self.train_plan(self.step);
            let (fresh, _) = self.roll_out(&refs, &plan)?;
            for (j, mut node) in fresh.nodes.into_iter().enumerate() {
                let (i, _) = stale[j];
                report.redrawn += node.samples.iter().map(Vec::len).sum::<usize>();
                node.id = i;
                node.item = i;
                batch.forest.nodes[i] = node;
            }
            debug_assert_eq!(redo_rows.len(), stale.len());
            batch.times.generate += t.elapsed().as_secs_f64();
        }
        for node in &batch.forest.nodes {
            for (a, samples) in node.samples.iter().enumerate() {
                report.staleness.extend(samples.iter().map(|s| current[a].saturating_sub(s.policy_version) as f64));
            }
        }
        self.update_and_report(batch, t_step, next, report)
    }

    /// Advantages, the optimiser rounds (on another thread while `lookahead`'s rollout is drawn
    /// here, for asynchronous rollouts), the weight push and the step's metrics.
    fn update_and_report(
        &mut self,
        batch: StepRollout,
        t_step: Instant,
        lookahead: Option<&[usize]>,
        mut report: AsyncReport,
    ) -> Result<BTreeMap<String, f64>, TrainError> {
        let cfg = self.s.cfg.clone();
        let n = cfg.num_agents;
        let world = self.dist.world();
        let StepRollout { rows, items, mut forest, times } = batch;
        let handoff = cfg.trainer.rollout == MultiTurnMode::Handoff;
        forest.compute_returns(cfg.trainer.discount, !handoff);
        forest.compute_advantages(n, &AdvantageOptions::from_section(&cfg.trainer));
        forest.assign_turn_weights(&cfg.turn_gradient_weights, cfg.trainer.early_termination_weight, handoff);

        // 4–5. updates: the groups of nodes the original updates on, one optimiser round per policy each.
        let t = Instant::now();
        let mut loss_opts = LossOptions::from_section(&cfg.trainer);
        loss_opts.scale = 1.0;
        if cfg.raw.rollout.max_off_policy_steps > 0 || super::rollout_precision_differs(&cfg) {
            // Off-policy samples, or samples drawn in another precision (bf16 rollouts of an f32
            // policy): the workers' log-probs are the behaviour policy.
            loss_opts.truncated_is = cfg.raw.rollout.importance_weight_cap;
            loss_opts.measure_gap = true;
        }
        let epochs = if cfg.trainer.ppo_clip.enabled { cfg.trainer.ppo_clip.epochs } else { 1 };
        let plans = self.plan_rounds(&forest, items.len(), handoff)?;
        let concurrent = cfg.raw.learner.concurrent_policies;
        let done = match lookahead {
            None => run_rounds(&mut self.s.policies, &plans, &loss_opts, epochs, self.dist.as_ref(), concurrent)?,
            Some(next) => {
                // The policies train on another thread; rollouts meanwhile read the served versions.
                let mut policies = std::mem::take(&mut self.s.policies);
                self.lent = Some(policies.iter().map(|p| (p.worker_agent.clone(), p.wire_version)).collect());
                let (trained, drawn) = std::thread::scope(|scope| {
                    let worker = scope.spawn(|| {
                        let t = Instant::now();
                        // In turn: the rollout below already has the other cores.
                        (run_rounds(&mut policies, &plans, &loss_opts, epochs, &SingleRank, false), t.elapsed().as_secs_f64())
                    });
                    let t = Instant::now();
                    let drawn = self.roll_out_rows(next, self.step + 1);
                    let gen_secs = t.elapsed().as_secs_f64();
                    (worker.join(), (drawn, gen_secs))
                });
                self.s.policies = policies;
                self.lent = None;
                let (trained, train_secs) = trained.map_err(|_| TrainError::Model("the update thread panicked".into()))?;
                let (drawn, gen_secs) = drawn;
                self.pending = Some(drawn?);
                report.overlap_secs = train_secs.min(gen_secs);
                report.lookahead_generate_secs = gen_secs;
                trained?
            }
        };
        let t_train = t.elapsed().as_secs_f64();
        let (rounds, updated) = (done.stats, done.updated);

        // 6. the new weights reach every worker before anything else is sampled (rank 0 pushes; the
        // other ranks wait for it).
        let t = Instant::now();
        let (mut push_bytes, mut push_workers) = (0u64, 0usize);
        let changed: Vec<usize> = updated.iter().enumerate().filter(|(_, c)| **c).map(|(pi, _)| pi).collect();
        if self.dist.is_root() && !changed.is_empty() {
            // Every changed policy at once: the pushes overlap where the source can.
            let params: Vec<_> = changed.iter().map(|&pi| self.s.policies[pi].parameters()).collect();
            let updates: Vec<WeightPush> = changed
                .iter()
                .zip(&params)
                .map(|(&pi, params)| {
                    let p = &self.s.policies[pi];
                    WeightPush { agent: &p.worker_agent, version: p.wire_version + 1, params }
                })
                .collect();
            self.s.rollout.push_weights_all(&updates)?;
            if let Some(push) = self.s.rollout.last_push() {
                push_bytes += push.bytes;
                push_workers = push_workers.max(push.workers);
            }
        }
        for &pi in &changed {
            self.s.policies[pi].wire_version += 1;
        }
        if world > 1 {
            self.dist.barrier()?;
        }
        let t_sync = t.elapsed().as_secs_f64();

        // Rank 0 reports the whole step: every rank's nodes, its items in the same order.
        let (forest, items) = if world > 1 { self.gather_step(forest, &rows)? } else { (forest, items) };
        if forest.nodes.is_empty() && !self.dist.is_root() {
            return Ok(BTreeMap::new());
        }
        let item_refs: Vec<&TrainItem> = items.iter().collect();

        if cfg.raw.logging.rollouts {
            let path = self.s.run_dir.join("rollouts.jsonl");
            crate::trainer::rollout_log::append(&path, self.step + 1, &forest, &item_refs)
                .map_err(|e| TrainError::Io(format!("{}: {e}", path.display())))?;
        }

        // Metrics.
        let mut m = BTreeMap::new();
        let all: Vec<&Score> = forest.nodes.iter().flat_map(|n| &n.scores).collect();
        reward_metrics(&mut m, "", &all);
        if cfg.is_multi_turn() {
            turn_metrics(&mut m, &forest, cfg.trainer.num_turns, items.len());
        }
        let samples: Vec<&GenSample> = forest.nodes.iter().flat_map(|n| n.samples.iter().flatten()).collect();
        let lens: Vec<f64> = samples.iter().map(|s| s.token_ids.len() as f64).collect();
        let gen_tokens: f64 = lens.iter().sum();
        m.insert("completion_len/mean".into(), mean(&lens));
        m.insert("completion_len/max".into(), lens.iter().cloned().fold(0.0, f64::max));
        m.insert("completion/stopped_frac".into(), mean(&samples.iter().map(|s| s.stopped as u8 as f64).collect::<Vec<_>>()));
        let trained: Vec<&UpdateStats> = rounds.iter().filter(|s| s.skipped.is_none() && s.steps > 0).collect();
        let avg = |f: fn(&UpdateStats) -> f64| if trained.is_empty() { f64::NAN } else { trained.iter().map(|s| f(s)).sum::<f64>() / trained.len() as f64 };
        m.insert("loss".into(), avg(|s| s.loss));
        m.insert("kl".into(), avg(|s| s.kl));
        m.insert("entropy".into(), avg(|s| s.entropy));
        m.insert("grad_norm".into(), avg(|s| s.grad_norm));
        if cfg.trainer.ppo_clip.enabled {
            m.insert("clip_fraction".into(), avg(|s| s.clip_fraction));
        }
        let policies = self.s.policies.len();
        if policies > 1 {
            for pi in 0..policies {
                let own: Vec<f64> = rounds.iter().skip(pi).step_by(policies).filter(|s| s.skipped.is_none()).map(|s| s.loss).collect();
                m.insert(format!("policy{pi}/loss"), if own.is_empty() { f64::NAN } else { mean(&own) });
            }
        }
        m.insert("skipped_updates".into(), rounds.iter().filter(|s| s.skipped.is_some()).count() as f64);
        m.insert("optimizer_steps".into(), rounds.iter().map(|s| s.steps as f64).sum::<f64>());
        m.insert("concurrent_policies".into(), done.concurrent as f64);
        let train_tokens: f64 = rounds.iter().map(|s| s.tokens).sum();
        m.insert("tokens_per_s".into(), if times.generate > 0.0 { gen_tokens / times.generate } else { 0.0 });
        m.insert("train_tokens_per_s".into(), if t_train > 0.0 { train_tokens / t_train } else { 0.0 });
        m.insert("time/generate".into(), times.generate);
        m.insert("time/reward".into(), times.reward);
        if cfg.is_multi_turn() {
            m.insert("time/transition".into(), times.transition);
        }
        m.insert("time/train".into(), t_train);
        m.insert("time/train_forward".into(), rounds.iter().map(|s| s.secs_forward).sum::<f64>());
        m.insert("time/train_backward".into(), rounds.iter().map(|s| s.secs_backward).sum::<f64>());
        m.insert("time/train_optimizer".into(), rounds.iter().map(|s| s.secs_optimizer).sum::<f64>());
        m.insert("train/minibatches_without_gradient".into(), rounds.iter().map(|s| s.minibatches_without_gradient as f64).sum::<f64>());
        if world > 1 {
            m.insert("time/train_allreduce".into(), rounds.iter().map(|s| s.secs_allreduce).sum::<f64>());
            m.insert("ranks".into(), world as f64);
        }
        m.insert("time/weight_sync".into(), t_sync);
        if cfg.raw.rollout.max_off_policy_steps > 0 {
            m.insert("async/staleness_mean".into(), mean(&report.staleness));
            m.insert("async/staleness_max".into(), report.staleness.iter().cloned().fold(0.0, f64::max));
            m.insert("async/dropped_samples".into(), report.dropped as f64);
            m.insert("async/redrawn_samples".into(), report.redrawn as f64);
            m.insert("async/overlap_secs".into(), report.overlap_secs);
            m.insert("time/generate_next".into(), report.lookahead_generate_secs);
        }
        if cfg.raw.rollout.max_off_policy_steps > 0 || super::rollout_precision_differs(&cfg) {
            m.insert("is/weight_mean".into(), avg(|s| s.is_weight_mean));
            m.insert("is/truncated_frac".into(), avg(|s| s.is_truncated_fraction));
        }
        if trained.iter().any(|s| s.logprob_gap > 0.0) {
            m.insert("logprob_gap".into(), avg(|s| s.logprob_gap));
        }
        if push_workers > 0 {
            m.insert("weight_sync/bytes".into(), push_bytes as f64);
            m.insert("weight_sync/workers".into(), push_workers as f64);
        }
        if let Some(pool) = self.s.rollout.pool_stats() {
            m.insert("pool/workers".into(), pool.workers as f64);
            m.insert("pool/in_rotation".into(), pool.in_rotation as f64);
            m.insert("pool/failed_attempts".into(), pool.failed_attempts as f64);
            m.insert("pool/catch_ups".into(), pool.catch_ups as f64);
        }
        m.insert("time/step".into(), t_step.elapsed().as_secs_f64());
        m.insert("epoch".into(), self.epoch as f64);
        m.insert("policy_version".into(), self.s.policies.iter().map(|p| p.wire_version).max().unwrap_or(0) as f64);
        Ok(m)
    }

    /// The optimiser rounds of a step: per update group (see [`Forest::update_groups`]; with several
    /// ranks one group per turn, so that every rank runs the same rounds) and policy, the policy's
    /// agents' samples in mini-batches and their counts over all ranks. Groups no rank has samples
    /// in are left out.
    fn plan_rounds(&mut self, forest: &Forest, items: usize, handoff: bool) -> Result<Vec<Round>, TrainError> {
        let cfg = &self.s.cfg;
        let n = cfg.num_agents;
        let groups = if self.dist.world() > 1 {
            forest.groups_by_turn(items, cfg.trainer.num_turns)
        } else {
            forest.update_groups(items, cfg.trainer.rollout_buffer_size, handoff)
        };
        let mut rounds = Vec::new();
        for group in &groups {
            let mut buffers: Vec<RolloutBuffer<TrainSample>> = (0..n).map(|_| RolloutBuffer::new(group.len())).collect();
            for &id in group {
                let node = &forest.nodes[id];
                for (a, buffer) in buffers.iter_mut().enumerate() {
                    buffer.push_node(
                        node.samples[a]
                            .iter()
                            .enumerate()
                            .map(|(k, s)| TrainSample {
                                prompt: node.prompts[a].ids.clone(),
                                completion: s.token_ids.clone(),
                                advantage: node.advantages[a][k],
                                weight: node.turn_weight,
                                old_logprobs: s.logprobs.clone(),
                            })
                            .collect(),
                    );
                }
            }
            let own = self.layout().own;
            for policy in 0..self.s.policies.len() {
                let members: Vec<usize> = (0..n).filter(|&a| self.s.agent_policy[a] == policy).collect();
                let scale = 1.0 / members.len().max(1) as f64;
                // Agent placement: another rank computes this policy's gradients (this one adds zeros).
                let mine = own.is_none_or(|o| o == policy);
                let batches: Vec<AgentBatches> = members
                    .iter()
                    .map(|&a| AgentBatches {
                        minibatches: if mine { buffers[a].drain_minibatches(&mut self.rng, cfg.trainer.train_batch_size) } else { Vec::new() },
                        scale,
                    })
                    .collect();
                let local: Vec<f64> = batches.iter().map(|b| b.minibatches.iter().map(Vec::len).sum::<usize>() as f64).collect();
                let totals: Vec<usize> = self.dist.sum_f64(&local)?.iter().map(|&c| c as usize).collect();
                if totals.iter().any(|&c| c > 0) {
                    rounds.push(Round { policy, batches, totals });
                }
            }
        }
        Ok(rounds)
    }

    /// Rank 0 receives every rank's forest of this step (merged in rank order, with the items of
    /// [`rank_share`] in the same order); other ranks get an empty forest back.
    fn gather_step(&self, forest: Forest, rows: &[usize]) -> Result<(Forest, Vec<TrainItem>), TrainError> {
        let bytes = serde_json::to_vec(&forest).map_err(|e| TrainError::Dist(format!("serialising the step's rollouts: {e}")))?;
        let all = self.dist.all_gather_bytes(&bytes)?;
        if !self.dist.is_root() {
            return Ok((Forest::default(), Vec::new()));
        }
        let shards = self.layout().shards;
        let (mut merged, mut items) = (Forest::default(), Vec::new());
        // Ranks 0..shards hold one shard each (under agent placement the others hold copies).
        for (rank, b) in all.iter().enumerate().take(shards) {
            let part: Forest = serde_json::from_slice(b).map_err(|e| TrainError::Dist(format!("rank {rank}'s rollouts: {e}")))?;
            merged.absorb(part, items.len());
            items.extend(rank_share(rows, rank, shards).iter().map(|&r| self.s.train_items[r].clone()));
        }
        Ok((merged, items))
    }

    /// Evaluates on the first `eval_num_samples` eval items with `samples` joint samples per item
    /// (fixed seeds, so evaluations at different steps are comparable). Multi-turn: every joint sample
    /// is one path through the turns (one sample per agent per turn, the next prompt built from the
    /// path's previous joint action) that stops at the variant's stopping rule; the path's last turn
    /// is what the reward and @k metrics read, and each turn's reward is logged. The metrics: the mean
    /// of the reward and of each level over the paths' last turns and, for code, PassOrNot@k,
    /// Accuracy@k and MaxCoop@k for each k in `ks` that is at most `samples`. During training the
    /// original draws one joint sample per item (`samples` = 1); `learner eval --k 1,5,10` draws the
    /// largest k.
    pub fn evaluate(&mut self, samples: usize, ks: &[usize]) -> Result<BTreeMap<String, f64>, TrainError> {
        let count = self.s.cfg.trainer.eval_num_samples.min(self.s.eval_items.len());
        let items: Vec<TrainItem> = self.s.eval_items[..count].to_vec();
        let mut m = BTreeMap::new();
        if items.is_empty() || samples == 0 {
            return Ok(m);
        }
        let t = Instant::now();
        let refs: Vec<&TrainItem> = items.iter().collect();
        let tr = &self.s.cfg.trainer;
        let expansion = match tr.rollout {
            MultiTurnMode::Tree => Expansion::Paths { stop_above: tr.termination_threshold, inclusive: false },
            MultiTurnMode::Handoff => Expansion::Paths { stop_above: tr.early_termination_threshold, inclusive: true },
        };
        let plan = RolloutPlan { expansion, joint_mode: JointMode::Aligned, g: samples, seed_tag: TAG_EVAL, seed_step: 0 };
        let (forest, _) = self.roll_out(&refs, &plan)?;
        let finals: Vec<Vec<Score>> = (0..items.len()).map(|i| path_final_scores(&forest, i)).collect();
        let all: Vec<&Score> = finals.iter().flatten().collect();
        reward_metrics(&mut m, "eval/", &all);
        if self.s.cfg.is_multi_turn() {
            for turn in 0..self.s.cfg.trainer.num_turns {
                let at: Vec<&Score> = forest.nodes.iter().filter(|n| n.turn == turn).flat_map(|n| &n.scores).collect();
                if !at.is_empty() {
                    reward_metrics(&mut m, &format!("eval/turn_{}/", turn + 1), &at);
                }
            }
            let stopped = forest.nodes.iter().filter(|n| n.early_stop).count() as f64;
            m.insert("eval/early_terminations".into(), stopped);
        }
        if self.s.is_code {
            let outcomes: Vec<Vec<CodeOutcome>> =
                finals.iter().map(|node| node.iter().map(|s| s.code.unwrap_or_default()).collect()).collect();
            for &k in ks.iter().filter(|&&k| k >= 1 && k <= samples) {
                let at = code_at_k(&outcomes, k);
                m.insert(format!("eval/pass@{k}"), at.pass);
                m.insert(format!("eval/accuracy@{k}"), at.accuracy);
                m.insert(format!("eval/maxcoop@{k}"), at.max_coop);
            }
        }
        m.insert("eval/items".into(), count as f64);
        m.insert("eval/time".into(), t.elapsed().as_secs_f64());
        Ok(m)
    }

    /// Writes a checkpoint of the current state (atomically; see [`crate::checkpoint`]).
    pub fn save_checkpoint(&mut self) -> Result<PathBuf, TrainError> {
        let state = TrainState {
            step: self.step,
            epoch: self.epoch,
            data_position: self.position,
            rng_seed: self.rng_seed,
            rng_word_pos: self.rng.get_word_pos().to_string(),
            optimizer_steps: self.s.policies.iter().map(|p| p.optimizer.step).collect(),
            policy_version: self.step,
            extra: serde_json::json!({
                "agent_policy": self.s.agent_policy,
                "policies": self.s.policies.iter().map(|p| serde_json::json!({"worker_agent": p.worker_agent, "model": p.model_spec})).collect::<Vec<_>>(),
            }),
        };
        let pairs: Vec<(&tch::nn::VarStore, &crate::algo::AdamW)> = self.s.policies.iter().map(|p| (&p.model.vs, &p.optimizer)).collect();
        let dir = save_checkpoint(&self.s.run_dir, &pairs, &state).map_err(|e| TrainError::Checkpoint(e.to_string()))?;
        self.last_checkpoint = Some(dir.clone());
        crate::checkpoint::apply_save_total_limit(&self.s.run_dir, self.s.cfg.raw.output.save_total_limit);
        Ok(dir)
    }

    /// Writes every policy as a Hugging Face model directory (see [`cotrain_model::export`]):
    /// `RUN_DIR/final_model/agent-{i}`, or one `final_model/shared` for shared parameters.
    pub fn save_final_models(&self) -> Result<Vec<PathBuf>, TrainError> {
        let root = self.s.run_dir.join("final_model");
        self.s
            .policies
            .iter()
            .enumerate()
            .map(|(pi, p)| {
                let dir = root.join(crate::export::policy_dir_name(&self.s.agent_policy, pi));
                cotrain_model::export::save_pretrained(&p.model, &dir).map_err(|e| TrainError::Checkpoint(format!("final model: {e}")))
            })
            .collect()
    }

    /// The rows of one epoch in training order: the dataset's order (as the original), or with
    /// `dataset.shuffle` a seeded permutation that is a pure function of (seed, epoch).
    pub fn epoch_order(&self, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.s.train_items.len()).collect();
        if self.s.cfg.raw.dataset.shuffle {
            order.shuffle(&mut ChaCha8Rng::seed_from_u64(derive_seed(&[self.s.cfg.raw.seed, TAG_ORDER, epoch])));
        }
        order
    }

    /// The rows of the step after the one ending at `end` of the current epoch's order (the next
    /// epoch's first step at the end of an epoch), or `None` after the last step of the run.
    fn rows_after(&self, end: u64) -> Option<Vec<usize>> {
        let (n, b) = (self.s.train_items.len() as u64, self.b() as u64);
        if self.stop_after_steps.is_some_and(|s| self.step + 1 >= s) {
            return None;
        }
        let (epoch, start) = if end >= n { (self.epoch + 1, 0) } else { (self.epoch, end) };
        if epoch >= self.s.cfg.trainer.num_train_epochs as u64 {
            return None;
        }
        let order = self.epoch_order(epoch);
        Some(order[start as usize..(start + b).min(n) as usize].to_vec())
    }

    fn log(&mut self, values: &BTreeMap<String, f64>) -> Result<(), TrainError> {
        if let Some(metrics) = &mut self.metrics {
            metrics.log(self.step, values).map_err(|e| TrainError::Io(format!("{}: {e}", metrics.path().display())))?;
        }
        self.history.push(values.clone());
        Ok(())
    }

    /// Runs to the end of the last epoch (or `stop_after_steps`): steps, metrics, checkpoints every
    /// `save_steps` and at the end, evaluation every `eval_interval`, plots at the end.
    pub fn run(&mut self) -> Result<RunSummary, TrainError> {
        let cfg = self.s.cfg.clone();
        let total = self.total_steps();
        let root = self.dist.is_root();
        self.sync_ranks()?;
        let t_sync = self.sync_all_weights()?;
        info!(run_dir = %self.s.run_dir.display(), rollout = %self.s.rollout.describe(), reward = %self.s.reward.describe(),
            steps = total, start_step = self.step, sync_secs = t_sync, rank = self.dist.rank(), ranks = self.dist.world(), "training");
        let bar = if root { progress_bar(cfg.raw.logging.progress, total, self.step) } else { None };
        let mut stopped_early = false;
        // The control plane (rank 0): status after every step, checkpoints and stops between steps.
        // Every rank's process listens (a SIGTERM does not kill it at once): the other ranks stop
        // when rank 0 says so after the step.
        let installed = crate::control::current();
        if let Some(c) = &installed {
            c.set_run_dir(self.s.run_dir.clone());
            c.trainer_started();
        }
        let control = if root { installed.clone() } else { None };
        let result = self.run_steps(&cfg, total, control.as_deref(), bar.as_ref(), &mut stopped_early);
        if let Some(c) = &installed {
            c.trainer_done(match &result {
                Err(_) => "failed",
                Ok(true) => "stopped",
                Ok(false) => "finishing",
            });
        }
        let stopped_by_request = result?;
        if let Some(pb) = &bar {
            pb.finish();
        }
        if stopped_by_request {
            info!(step = self.step, reason = control.as_ref().and_then(|c| c.stop_reason()).unwrap_or_default(), run_dir = %self.s.run_dir.display(),
                "stopped on request after a checkpoint; continue with `learner train --config ... --resume RUN_DIR`");
            return Ok(self.summary(Vec::new(), Vec::new(), true));
        }
        let mut plots = Vec::new();
        let mut final_models = Vec::new();
        if self.dist.world() > 1 && !stopped_early {
            // The ranks end agreeing, or the run says they did not.
            self.check_ranks_agree()?;
        }
        if !stopped_early && root {
            let saved_now = self.last_checkpoint.as_ref().is_some_and(|d| d.ends_with(format!("step-{}", self.step)));
            if cfg.raw.output.save_final_model {
                // The checkpoint (for resuming) and the models users load, as the original's save_pretrained.
                if !saved_now {
                    self.save_checkpoint()?;
                }
                final_models = self.save_final_models()?;
                for dir in &final_models {
                    info!(model = %dir.display(), "final model saved");
                }
            }
            if cfg.raw.logging.plots {
                match crate::plot::plot_run(&self.s.run_dir) {
                    Ok(p) => plots = p,
                    Err(e) => warn!(error = %e, "plots not drawn"),
                }
            }
        }
        if let Some(c) = &control {
            c.set_state("finished");
        }
        Ok(self.summary(final_models, plots, false))
    }

    fn summary(&self, final_models: Vec<PathBuf>, plots: Vec<PathBuf>, stopped: bool) -> RunSummary {
        RunSummary {
            run_dir: self.s.run_dir.clone(),
            steps: self.step,
            metrics_path: self.s.run_dir.join(crate::metrics::METRICS_FILE),
            checkpoint: self.last_checkpoint.clone(),
            final_models,
            plots,
            history: self.history.clone(),
            stopped,
        }
    }

    /// The step loop of [`Self::run`]; returns whether it stopped on a request (after a checkpoint).
    fn run_steps(
        &mut self,
        cfg: &CheckedConfig,
        total: u64,
        control: Option<&crate::control::ControlState>,
        bar: Option<&indicatif::ProgressBar>,
        stopped_early: &mut bool,
    ) -> Result<bool, TrainError> {
        let root = self.dist.is_root();
        let checksum_steps = cfg.raw.learner.checksum_steps;
        let n_items = self.s.train_items.len() as u64;
        let b = self.b() as u64;
        while self.epoch < cfg.trainer.num_train_epochs as u64 {
            if self.stop_after_steps.is_some_and(|s| self.step >= s) {
                *stopped_early = true;
                break;
            }
            let step_started = Instant::now();
            // The epoch's order is a pure function of (seed, epoch): a resumed run sees the same one.
            let order = self.epoch_order(self.epoch);
            let end = (self.position + b).min(n_items);
            let rows: Vec<usize> = order[self.position as usize..end as usize].to_vec();
            // The original evaluates before training on item i of an epoch when i is a multiple of
            // eval_interval (so also before the first item); a step of several items evaluates once
            // when its items contain such an i.
            // Rank 0 evaluates; the other ranks go on to their share of the step.
            let step = (|| {
                let eval = if root && eval_due(cfg.trainer.eval_interval as u64, self.position, end) { Some(self.evaluate(1, &[1])?) } else { None };
                let mut values = if cfg.raw.rollout.max_off_policy_steps > 0 {
                    let next = self.rows_after(end);
                    self.train_step_async(&rows, next.as_deref())?
                } else {
                    self.train_step(&rows)?
                };
                values.extend(eval.unwrap_or_default());
                Ok(values)
            })();
            let values = match step {
                Ok(v) => v,
                // The reward server fails before the step updates anything (rewards come before the
                // update), so the state is still the previous step's: keep it in a checkpoint.
                Err(e @ TrainError::Reward(_)) if self.dist.world() == 1 && cfg.raw.rollout.max_off_policy_steps == 0 => {
                    return Err(self.checkpoint_before_failing(e));
                }
                Err(e) => return Err(e),
            };
            self.position = end;
            self.step += 1;
            if self.position >= n_items {
                self.epoch += 1;
                self.position = 0;
            }
            if checksum_steps > 0 && self.step.is_multiple_of(checksum_steps) {
                self.check_ranks_agree()?;
            }
            // Rank 0 logs, reports and checkpoints, then tells every rank whether the job goes
            // on, stops on request, or stops because rank 0 failed (so that no rank waits in a
            // collective for a rank that has left).
            let finished = if root { self.finish_step_on_root(cfg, total, control, bar, &values, step_started) } else { Ok(false) };
            let code = match &finished {
                Ok(false) => 0,
                Ok(true) => 1,
                Err(_) => 2,
            };
            match (self.dist.broadcast_u64(code, 0)?, finished) {
                (_, Err(e)) => return Err(e),
                (0, _) => {}
                (1, _) => return Ok(true),
                (_, _) => return Err(TrainError::Dist(format!("rank 0 failed after step {}; its log says why", self.step))),
            }
        }
        Ok(false)
    }

    /// The error of a step that failed before it changed the trainer's state, with a checkpoint of
    /// that state (unless the last one already is) named in the message.
    fn checkpoint_before_failing(&mut self, e: TrainError) -> TrainError {
        let saved = match &self.last_checkpoint {
            Some(d) if d.ends_with(format!("step-{}", self.step)) => Ok(d.clone()),
            _ if self.step == 0 => return e,
            _ => self.save_checkpoint(),
        };
        match saved {
            Ok(dir) => TrainError::Reward(format!(
                "{e}\nthe run stopped at step {}; its checkpoint is {}: resume with `learner train --config ... --resume {}`",
                self.step,
                dir.display(),
                self.s.run_dir.display()
            )),
            Err(c) => TrainError::Reward(format!("{e}\n(and no checkpoint could be written: {c})")),
        }
    }

    /// Rank 0's end of a step: metrics, progress, the control plane's report and requests,
    /// checkpoints; returns whether a stop was asked.
    fn finish_step_on_root(
        &mut self,
        cfg: &CheckedConfig,
        total: u64,
        control: Option<&crate::control::ControlState>,
        bar: Option<&indicatif::ProgressBar>,
        values: &BTreeMap<String, f64>,
        step_started: Instant,
    ) -> Result<bool, TrainError> {
        self.log(values)?;
        let reward = values.get("reward/mean").copied().unwrap_or(f64::NAN);
        let loss = values.get("loss").copied().unwrap_or(f64::NAN);
        match bar {
            Some(pb) => {
                pb.set_position(self.step);
                pb.set_message(format!("reward {reward:.3} loss {loss:.3}"));
            }
            None => {
                if self.step.is_multiple_of(cfg.trainer.logging_steps.max(1) as u64) || self.step == total {
                    info!(step = self.step, total, reward, loss, secs = values.get("time/step").copied().unwrap_or(0.0), "learner step done");
                }
            }
        }
        let scheduled = cfg.trainer.save_steps > 0 && self.step.is_multiple_of(cfg.trainer.save_steps as u64);
        let asked = match control {
            Some(c) => c.between_steps(crate::control::StepReport {
                step: self.step,
                total_steps: total,
                epoch: self.epoch,
                total_epochs: cfg.trainer.num_train_epochs as u64,
                reward: reward.is_finite().then_some(reward),
                step_secs: step_started.elapsed().as_secs_f64(),
                policy_versions: self.s.policies.iter().map(|p| (p.worker_agent.clone(), p.wire_version)).collect(),
            }),
            None => Default::default(),
        };
        if scheduled || asked.checkpoint || asked.stop {
            match self.save_checkpoint() {
                Ok(dir) => {
                    info!(step = self.step, checkpoint = %dir.display(), requested = asked.checkpoint || asked.stop, "checkpoint saved");
                    if let Some(c) = control {
                        c.checkpoint_written(self.step, &dir);
                    }
                }
                Err(e) => {
                    if let Some(c) = control {
                        c.checkpoint_failed(&e.to_string());
                    }
                    return Err(e);
                }
            }
        }
        Ok(asked.stop)
    }
}

/// The items of a single-turn forest with a sample more than `k` versions older than the version
/// its agent trains now (`current[agent]`), or newer than it, with how many such samples each has.
pub(super) fn stale_items(forest: &Forest, current: &[u64], k: u64) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    for node in forest.nodes.iter().filter(|n| n.parent.is_none()) {
        let stale: usize = node
            .samples
            .iter()
            .enumerate()
            // A sample from a version newer than the learner's is from weights it never pushed.
            .map(|(a, samples)| samples.iter().filter(|s| s.policy_version > current[a] || current[a] - s.policy_version > k).count())
            .sum();
        if stale > 0 {
            out.push((node.item, stale));
        }
    }
    out
}

/// The rows of a step that rank `rank` of `world` rolls out and trains on: every world-th.
pub fn rank_share(rows: &[usize], rank: usize, world: usize) -> Vec<usize> {
    rows.iter().copied().skip(rank).step_by(world.max(1)).collect()
}

/// Whether a step over the epoch's items `[start, end)` contains an item whose index is a multiple of
/// `interval` (0: never).
pub fn eval_due(interval: u64, start: u64, end: u64) -> bool {
    interval > 0 && (start..end).any(|i| i.is_multiple_of(interval))
}

/// The offline code metrics over items, each with its joint samples in drawing order.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AtK {
    /// PassOrNot@k: the fraction of items where one of the first k samples passes every test.
    pub pass: f64,
    /// Accuracy@k: the mean over items of the best fraction of tests passed among the first k.
    pub accuracy: f64,
    /// MaxCoop@k: the mean over items of the best cooperation bonus among the first k.
    pub max_coop: f64,
}

/// PassOrNot@k, Accuracy@k and MaxCoop@k (algorithms.md, "Evaluation") over `items`, each holding at
/// least k outcomes (fewer: all it has).
pub fn code_at_k(items: &[Vec<CodeOutcome>], k: usize) -> AtK {
    let c = items.len().max(1) as f64;
    let (mut pass, mut accuracy, mut max_coop) = (0.0, 0.0, 0.0);
    for node in items {
        let first = &node[..k.min(node.len())];
        pass += first.iter().any(CodeOutcome::all_passed) as u8 as f64;
        accuracy += first.iter().map(CodeOutcome::pass_rate).fold(0.0, f64::max);
        let best_coop = first.iter().map(|o| o.cooperation_bonus).fold(f64::NEG_INFINITY, f64::max);
        max_coop += if first.is_empty() { 0.0 } else { best_coop };
    }
    AtK { pass: pass / c, accuracy: accuracy / c, max_coop: max_coop / c }
}

/// Per turn (from 1): the reward and each level over the turn's joint actions, the mean return, nodes
/// and early stops; and over the step: nodes per item, early terminations, history truncations.
fn turn_metrics(m: &mut BTreeMap<String, f64>, forest: &Forest, turns: usize, items: usize) {
    for turn in 0..turns {
        let nodes: Vec<&super::tree::Node> = forest.nodes.iter().filter(|n| n.turn == turn).collect();
        let scores: Vec<&Score> = nodes.iter().flat_map(|n| &n.scores).collect();
        let prefix = format!("turn_{}/", turn + 1);
        m.insert(format!("{prefix}nodes"), nodes.len() as f64);
        if scores.is_empty() {
            continue;
        }
        reward_metrics(m, &prefix, &scores);
        let returns: Vec<f64> = nodes.iter().flat_map(|n| n.returns.iter().copied()).collect();
        m.insert(format!("{prefix}return/mean"), mean(&returns));
        m.insert(format!("{prefix}early_terminations"), nodes.iter().filter(|n| n.early_stop).count() as f64);
    }
    m.insert("nodes_per_item".into(), forest.nodes.len() as f64 / items.max(1) as f64);
    m.insert("early_terminations".into(), forest.nodes.iter().filter(|n| n.early_stop).count() as f64);
    m.insert("prompt_truncations".into(), forest.nodes.iter().map(|n| n.truncated as f64).sum());
    // Nodes whose prompts carry no expert edits because the expert failed (`expert_edits`; 0 otherwise).
    m.insert("expert_failures".into(), forest.nodes.iter().filter(|n| n.expert_failure.is_some()).count() as f64);
}

/// The scores of the last turn of each path of an evaluation forest's item, in joint-sample order:
/// path j starts at the root's joint action j and follows its child (one joint action each) down.
fn path_final_scores(forest: &Forest, item: usize) -> Vec<Score> {
    let Some(root) = forest.nodes.iter().find(|n| n.item == item && n.parent.is_none()) else {
        return Vec::new();
    };
    (0..root.scores.len())
        .map(|j| {
            let (mut node, mut joint) = (root, j);
            while let Some(&c) = node.children.iter().find(|&&c| forest.nodes[c].parent_joint == Some(joint)) {
                node = &forest.nodes[c];
                joint = 0;
            }
            node.scores[joint].clone()
        })
        .collect()
}

/// Tasks whose reward scores one answer at a time.
pub(super) fn per_agent_task(task: &str) -> bool {
    matches!(task, "gsm8k" | "anli")
}

/// The mean of several scores (reward and every level); details of each kept in a list.
pub(super) fn mean_score(scores: &[Score]) -> Score {
    let k = scores.len().max(1) as f64;
    let mut levels = BTreeMap::new();
    for s in scores {
        for (l, v) in &s.levels {
            *levels.entry(l.clone()).or_insert(0.0) += v / k;
        }
    }
    Score {
        reward: scores.iter().map(|s| s.reward).sum::<f64>() / k,
        levels,
        details: serde_json::Value::Array(scores.iter().map(|s| s.details.clone()).collect()),
        code: None,
    }
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() { 0.0 } else { v.iter().sum::<f64>() / v.len() as f64 }
}

/// reward/mean, reward/std (unbiased), reward/max and the mean of every level.
fn reward_metrics(m: &mut BTreeMap<String, f64>, prefix: &str, scores: &[&Score]) {
    let r: Vec<f64> = scores.iter().map(|s| s.reward).collect();
    let mu = mean(&r);
    let std = if r.len() > 1 { (r.iter().map(|x| (x - mu).powi(2)).sum::<f64>() / (r.len() - 1) as f64).sqrt() } else { 0.0 };
    m.insert(format!("{prefix}reward/mean"), mu);
    m.insert(format!("{prefix}reward/std"), std);
    m.insert(format!("{prefix}reward/max"), r.iter().cloned().fold(f64::NEG_INFINITY, f64::max));
    let mut levels: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for s in scores {
        for (k, v) in &s.levels {
            levels.entry(k.as_str()).or_default().push(*v);
        }
    }
    for (k, v) in levels {
        m.insert(format!("{prefix}reward/{k}"), mean(&v));
    }
}

pub(crate) fn progress_bar(mode: ProgressMode, total: u64, start: u64) -> Option<indicatif::ProgressBar> {
    let show = match mode {
        ProgressMode::Always => true,
        ProgressMode::Never => false,
        ProgressMode::Auto => std::io::stderr().is_terminal(),
    };
    if !show {
        return None;
    }
    let pb = indicatif::ProgressBar::new(total);
    pb.set_style(
        indicatif::ProgressStyle::with_template("{spinner} step {pos}/{len} [{bar:30}] {elapsed_precise} eta {eta_precise} {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    pb.set_position(start);
    Some(pb)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_seeds_are_stable_and_distinct() {
        assert_eq!(derive_seed(&[42, TAG_SAMPLE, 3, 1, 7]), derive_seed(&[42, TAG_SAMPLE, 3, 1, 7]));
        let seeds: std::collections::HashSet<u64> =
            (0..4).flat_map(|step| (0..2).flat_map(move |a| (0..8).map(move |i| derive_seed(&[42, TAG_SAMPLE, step, a, i])))).collect();
        assert_eq!(seeds.len(), 64, "every (step, agent, item) gets its own seed");
        assert_ne!(derive_seed(&[1, 2]), derive_seed(&[2, 1]));
    }

    /// Staleness for asynchronous rollouts: a sample more than k versions old is stale, and so is
    /// one from a version newer than the learner's (weights it never pushed), which used to count
    /// as fresh.
    #[test]
    fn samples_too_old_or_from_the_future_make_their_item_stale() {
        let sample = |v: u64| GenSample { token_ids: vec![1], text: String::new(), logprobs: vec![0.0], stopped: true, policy_version: v };
        let node = |item: usize, versions: [u64; 2]| {
            let mut n = crate::trainer::tree::Node::new(item, item, 0, 0, 1, vec![crate::trainer::tree::AgentPrompt { text: String::new(), ids: vec![1] }; 2], vec![Vec::new(); 2]);
            n.samples = versions.iter().map(|&v| vec![sample(v)]).collect();
            n
        };
        let forest = Forest { nodes: vec![node(0, [5, 5]), node(1, [3, 5]), node(2, [4, 6]), node(3, [2, 9])] };
        // The learner trains version 5 of both agents; k = 1.
        assert_eq!(stale_items(&forest, &[5, 5], 1), vec![(1, 1), (2, 1), (3, 2)]);
    }

    #[test]
    fn evaluation_rhythm_follows_the_items_of_an_epoch() {
        // One item per step (the original): items 0, 4, 8.
        let due: Vec<u64> = (0..10).filter(|&i| eval_due(4, i, i + 1)).collect();
        assert_eq!(due, vec![0, 4, 8]);
        // Three items per step: steps [0,3) [3,6) [6,9) [9,10) → the first three contain 0, 4, 8.
        let steps: Vec<bool> = [(0, 3), (3, 6), (6, 9), (9, 10)].iter().map(|&(a, b)| eval_due(4, a, b)).collect();
        assert_eq!(steps, vec![true, true, true, false]);
        assert!(!eval_due(0, 0, 10));
    }

    #[test]
    fn at_k_metrics_on_known_outcomes() {
        let o = |p: u64, t: u64, coop: f64| CodeOutcome { passed_tests: p, total_tests: t, cooperation_bonus: coop };
        // Item A: samples pass 1/4, 4/4, 2/4 with bonuses 0, 1.5, 0.5; item B: 0/3, 3/3 (bonus −0.5
        // then 1.0), 0/3; item C has no tests (never a pass).
        let items = vec![
            vec![o(1, 4, 0.0), o(4, 4, 1.5), o(2, 4, 0.5)],
            vec![o(0, 3, -0.5), o(0, 3, 0.0), o(3, 3, 1.0)],
            vec![o(0, 0, 0.0), o(0, 0, 0.0), o(0, 0, 0.0)],
        ];
        // k = 1: A 1/4 (no pass, coop 0), B 0 (coop −0.5), C 0.
        let a1 = code_at_k(&items, 1);
        assert_eq!(a1.pass, 0.0);
        assert!((a1.accuracy - 0.25 / 3.0).abs() < 1e-12);
        assert!((a1.max_coop - (0.0 - 0.5 + 0.0) / 3.0).abs() < 1e-12);
        // k = 2: A passes (coop 1.5), B best 0/3 (coop 0.0).
        let a2 = code_at_k(&items, 2);
        assert!((a2.pass - 1.0 / 3.0).abs() < 1e-12);
        assert!((a2.accuracy - 1.0 / 3.0).abs() < 1e-12);
        assert!((a2.max_coop - 1.5 / 3.0).abs() < 1e-12);
        // k = 3 (and any larger k): both A and B pass.
        let a3 = code_at_k(&items, 10);
        assert!((a3.pass - 2.0 / 3.0).abs() < 1e-12);
        assert!((a3.accuracy - 2.0 / 3.0).abs() < 1e-12);
        assert!((a3.max_coop - 2.5 / 3.0).abs() < 1e-12);
    }

    #[test]
    fn per_agent_scores_average_reward_and_levels() {
        let s = |r: f64| Score { reward: r, levels: [("level_1".to_string(), r)].into_iter().collect(), ..Default::default() };
        let m = mean_score(&[s(1.0), s(0.0)]);
        assert_eq!(m.reward, 0.5);
        assert_eq!(m.levels["level_1"], 0.5);
    }
}
