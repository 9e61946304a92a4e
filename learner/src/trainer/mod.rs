//! The trainer: GRPO / MAGRPO end to end, single- and multi-turn (algorithms.md), driving rollout
//! workers and a reward server.
//!
//! - [`sources`]: the [`RolloutSource`] and [`RewardSource`] traits the loop talks to (implemented
//!   over gRPC in [`crate::services`], and in process for tests);
//! - [`policy`]: a trainable [`Policy`] (weights, AdamW, optional frozen reference) and its update
//!   through the chunked log-prob kernel;
//! - [`items`]: dataset rows → per-agent prompt token ids;
//! - [`tree`]: the rollout forest (nodes, leaves, returns, advantages, turn weights, update order);
//! - [`rollout`]: rolling the forest out depth by depth; [`transition`]: next-turn prompts;
//!   [`rollout_log`]: `rollouts.jsonl`;
//! - [`run`]: the [`Trainer`] loop, evaluation, checkpoints, metrics;
//! - this module: building all of it from a config ([`build`]) and the `learner train` / `learner
//!   eval` entry points ([`train`], [`evaluate_checkpoint`]).
//!
//! Learner ranks: items split by rank in [`Trainer::train_step`], gradients summed over the ranks
//! between backward and AdamW in [`Policy::update_ranked`] (see [`crate::dist`]). Asynchronous
//! rollouts: [`Trainer::train_step_async`] with a staleness bound instead of
//! [`Trainer::generate_checked`]'s strict check.

pub mod items;
pub mod policy;
pub mod rollout;
pub mod rollout_log;
pub mod rounds;
pub mod run;
pub mod sources;
pub mod transition;
pub mod tree;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use cotrain_model::loader::LoadOptions;
use tch::{Device, Kind};
use tracing::info;

pub use items::{TrainItem, prepare_items};
pub use policy::{AgentBatches, Policy, TrainSample, UpdateStats};
pub use run::{RunSummary, Trainer, TrainerSetup, derive_seed};
pub use sources::{CodeOutcome, FeedbackSpec, GenRequest, GenSample, PoolStats, RewardSource, RolloutSource, SamplingSpec, Score, ScoreAction, WeightPush};

use crate::algo::AdamWConfig;
use crate::config::{CheckedConfig, Dtype};
use crate::data::{DatasetKind, load_split};
use crate::services::{self, GrpcReward, PoolRollout, embedded::{EmbeddedReward, EmbeddedRollout}};

/// Why training stopped.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The config asks for something inconsistent.
    #[error("config: {0}")]
    Config(String),
    /// A trainer that is not built yet (multi-turn, ...).
    #[error("{0}")]
    NotBuilt(String),
    /// Loading or running the model failed.
    #[error("model: {0}")]
    Model(String),
    /// Dataset or prompt preparation failed.
    #[error("data: {0}")]
    Data(String),
    /// The rollout workers failed.
    #[error("rollout: {0}")]
    Rollout(String),
    /// The reward server failed.
    #[error("reward: {0}")]
    Reward(String),
    /// A sample came from another policy version than the learner's, twice in a row.
    #[error("agent {agent}: a sample came from policy version {got}, the learner pushed {expected} (on-policy training refuses stale samples)")]
    StaleSample { agent: usize, expected: u64, got: u64 },
    /// The expert model of `expert_edits` refused requests or answered none.
    #[error("expert: {0}")]
    External(String),
    /// Writing or reading a checkpoint failed.
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    /// A filesystem error.
    #[error("io: {0}")]
    Io(String),
    /// The learner's ranks failed to work together (a collective, diverged weights).
    #[error("{0}")]
    Dist(String),
}

impl From<crate::dist::DistError> for TrainError {
    fn from(e: crate::dist::DistError) -> Self {
        TrainError::Dist(e.to_string())
    }
}

/// How `learner train` runs.
#[derive(Debug, Clone, Default)]
pub struct TrainOptions {
    /// Continue this run directory from its latest checkpoint.
    pub resume: Option<PathBuf>,
}

/// The rollout and reward sources a config names.
pub struct Services {
    pub rollout: Box<dyn RolloutSource>,
    pub reward: Box<dyn RewardSource>,
    pub guard: ServiceGuard,
}

/// Keeps embedded servers and the runtime alive for the run; dropping it stops them (drop it after
/// the trainer).
pub struct ServiceGuard {
    /// The control plane (`learner.control_addr`), stopped first.
    pub control: Option<crate::control::ControlServer>,
    pub embedded_reward: Option<EmbeddedReward>,
    pub embedded_rollout: Option<EmbeddedRollout>,
    pub runtime: Arc<tokio::runtime::Runtime>,
}

/// This process's device for `model.device`, resolved once per request (so `auto` logs its choice
/// once): `cuda` means this rank's GPU, by the launcher's local rank.
pub fn learner_device(cfg: &CheckedConfig) -> Result<Device, TrainError> {
    static RESOLVED: std::sync::Mutex<Vec<((cotrain_model::cuda::DeviceRequest, usize), Result<Device, String>)>> = std::sync::Mutex::new(Vec::new());
    let request = cfg.raw.model.device;
    // A broken launcher environment is reported by `dist::init`; the device then is rank 0's.
    let local_rank = crate::dist::RankEnv::from_env().map(|e| e.local_rank).unwrap_or(0);
    let mut resolved = RESOLVED.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, d)) = resolved.iter().find(|(k, _)| *k == (request, local_rank)) {
        return d.clone().map_err(TrainError::Config);
    }
    let d = request.resolve(local_rank).map_err(|e| format!("model.device: {e}"));
    resolved.push(((request, local_rank), d.clone()));
    d.map_err(TrainError::Config)
}

/// Device and dtype of the learner's models (`model.device`, `model.dtype`).
pub fn load_options(cfg: &CheckedConfig) -> Result<LoadOptions, TrainError> {
    let device = learner_device(cfg)?;
    Ok(LoadOptions { device, kind: param_kind(cfg.raw.model.dtype, device) })
}

fn param_kind(dtype: Dtype, device: Device) -> Kind {
    match (dtype, device) {
        (Dtype::F32, _) | (Dtype::Auto, Device::Cpu) => Kind::Float,
        (Dtype::Bf16, _) | (Dtype::Auto, _) => Kind::BFloat16,
        (Dtype::F16, _) => Kind::Half,
    }
}

/// The policies' parameter dtype. A device that cannot be resolved counts as the CPU here: such a
/// run stops at [`load_options`] before any of these kinds is used.
fn policy_kind(cfg: &CheckedConfig) -> Kind {
    param_kind(cfg.raw.model.dtype, learner_device(cfg).unwrap_or(Device::Cpu))
}

/// The precision rollouts are drawn in (`rollout.dtype`; `auto`: the policy's own).
pub fn rollout_kind(cfg: &CheckedConfig) -> Kind {
    cfg.raw.rollout.dtype.kind(policy_kind(cfg))
}

/// The dtype of the trained policies' products when it is not their parameters'
/// (`model.matmul_dtype`), for [`cotrain_model::CausalLm::set_matmul_kind`].
pub fn matmul_kind(cfg: &CheckedConfig) -> Option<Kind> {
    let params = policy_kind(cfg);
    let kind = cfg.raw.model.matmul_dtype.kind(params);
    (kind != params).then_some(kind)
}

/// Whether rollouts are drawn in another precision than the policy trains in: their dtype is not
/// the parameters', or training's products run in another dtype (then even bf16 rollouts are not
/// bit-identical: they keep f32 activations). The loss then measures the log-prob gap and corrects
/// for it (`rollout.importance_weight_cap`).
pub fn rollout_precision_differs(cfg: &CheckedConfig) -> bool {
    rollout_kind(cfg) != policy_kind(cfg) || matmul_kind(cfg).is_some()
}

/// The policies a config asks for and which agent uses which: one per agent (each fine-tunes its own
/// copy, on the same or different base models), or one for all with `shared_parameters`.
/// The rollout workers' agents a run of `cfg` trains, as `(agent name, model spec)`, each needing
/// weights of its own on every worker: `shared` with shared parameters, `agent{i}` otherwise, and
/// MaPoRL's adapter keys. `learner worker-args` prints them for the deploy scripts.
pub fn worker_agents(cfg: &CheckedConfig) -> Vec<(String, String)> {
    if let Some(m) = cfg.raw.maporl.as_ref().filter(|_| cfg.algorithm == crate::config::Algorithm::Maporl) {
        let mut agents: Vec<(String, String)> = Vec::new();
        for (agent, spec) in cfg.agent_models.iter().enumerate().take(cfg.num_agents) {
            for turn in 0..m.round_num {
                let key = crate::maporl::adapter_key(m.adapter_layout, agent, turn);
                if !agents.iter().any(|(k, _)| *k == key) {
                    agents.push((key, spec.clone()));
                }
            }
        }
        agents.sort();
        return agents;
    }
    if cfg.trainer.shared_parameters {
        return vec![("shared".into(), cfg.agent_models[0].clone())];
    }
    cfg.agent_models.iter().enumerate().map(|(i, spec)| (format!("agent{i}"), spec.clone())).collect()
}

pub fn load_policies(cfg: &CheckedConfig) -> Result<(Vec<Policy>, Vec<usize>), TrainError> {
    let opts = load_options(cfg)?;
    let t = &cfg.trainer;
    let adam = AdamWConfig::new(t.learning_rate, t.weight_decay, t.max_grad_norm);
    let with_ref = t.reference_kl.enabled;
    if t.shared_parameters {
        let first = &cfg.agent_models[0];
        if let Some(other) = cfg.agent_models.iter().find(|m| *m != first) {
            return Err(TrainError::Config(format!(
                "{}: shared_parameters needs one base model, but model.agents names `{first}` and `{other}`",
                cfg.source.display()
            )));
        }
    }
    let policies = worker_agents(cfg).iter().map(|(agent, spec)| Policy::load(agent, spec, &opts, adam, with_ref)).collect::<Result<Vec<_>, _>>()?;
    let agent_policy = if t.shared_parameters { vec![0; cfg.num_agents] } else { (0..cfg.num_agents).collect() };
    Ok((policies, agent_policy))
}

/// The services a config names, or the embedded default: a reward server and a rollout worker in
/// this process on loopback ports, used over gRPC. `agents` are the (worker agent, model spec) pairs
/// the learner trains; each must have weights of its own on the workers.
pub fn connect_services(cfg: &CheckedConfig, agents: &[(String, String)]) -> Result<Services, TrainError> {
    let runtime = services::runtime().map_err(|e| TrainError::Io(format!("tokio runtime: {e}")))?;
    let r = &cfg.raw.reward;
    let (reward, embedded_reward): (Box<dyn RewardSource>, _) = match &r.endpoint {
        Some(ep) => (
            Box::new(GrpcReward::connect(runtime.clone(), ep, Duration::from_secs(r.request_timeout_secs), services::client_tls().as_ref())?.with_options(&cfg.score_options).with_retries(r.max_retries)),
            None,
        ),
        None => {
            let server = EmbeddedReward::start(runtime.clone())?;
            info!(grpc = %server.grpc, http = %server.http, "embedded reward server started");
            let client = GrpcReward::connect(runtime.clone(), &server.grpc.to_string(), Duration::from_secs(r.request_timeout_secs), None)?
                .with_options(&cfg.score_options).with_retries(r.max_retries);
            (Box::new(client), Some(server))
        }
    };
    let ro = &cfg.raw.rollout;
    // The control plane (rank 0 of a `learner train` that installed it): registered workers join
    // the pool, operators ask for status, checkpoints and stops.
    let control = match (crate::control::current(), &cfg.raw.learner.control_addr) {
        (Some(state), Some(addr)) => {
            let addr: std::net::SocketAddr =
                addr.parse().map_err(|_| TrainError::Config(format!("learner.control_addr: `{addr}` is not IP:PORT")))?;
            let server = runtime
                .block_on(crate::control::ControlServer::start(addr, state.clone(), services::cluster_token(), services::server_tls()))
                .map_err(|e| TrainError::Io(format!("learner.control_addr {addr}: {e}")))?;
            println!("control plane listening on {}", server.addr);
            Some((state, server))
        }
        _ => None,
    };
    let registration = control.as_ref().map(|(state, server)| (state.as_ref(), server.addr.to_string()));
    // The embedded worker requires this process's token; remote workers get the cluster token only
    // (a worker without one ignores it, one with a token must be sent that very token).
    let pool = |endpoints: Vec<String>,
                dns: Vec<String>,
                min_workers: usize,
                wait: Duration,
                tls: Option<cotrain_proto::tls::ClientTls>,
                token: Option<cotrain_proto::auth::ClusterToken>| {
        let pool_cfg = cotrain_rollout_client::pool::PoolConfig {
            tls,
            allow_empty: registration.is_some(),
            endpoints,
            dns_names: dns,
            refresh_interval: Duration::from_secs(ro.dns_refresh_secs.max(1)),
            request_timeout: Some(Duration::from_secs(ro.request_timeout_secs)),
            max_attempts: ro.max_retries + 1,
            wait_for_worker: Duration::from_secs(120),
            cluster_token: token,
            // The latest weights, kept for workers that join later, go to disk beside the runs'
            // checkpoints rather than to a temporary directory that may be memory (tmpfs).
            replay_dir: Some(PathBuf::from(&cfg.raw.output.base_dir)),
            ..Default::default()
        };
        PoolRollout::connect_with(runtime.clone(), pool_cfg, registration.clone(), min_workers, wait)
            .map(|p| p.with_weight_transport(ro.weight_transport).with_weight_dtype(ro.weight_dtype))
    };
    let remote_only = !ro.endpoints.is_empty() || ro.dns_name.is_some() || ro.wait_for_registration;
    let (rollout, embedded_rollout): (Box<dyn RolloutSource>, _) = if !remote_only {
        // A rollout worker in this process (one model copy per policy), used over gRPC like a remote one.
        let opts = load_options(cfg)?;
        let verifiers = cfg
            .raw
            .maporl
            .as_ref()
            .and_then(|m| m.verifier_path.as_ref())
            .map(|dir| vec![(crate::maporl::EMBEDDED_VERIFIER.to_string(), std::path::PathBuf::from(dir))])
            .unwrap_or_default();
        if ro.bf16_dot_products {
            cotrain_model::kernels::gemm_bf16dot::enable_for(rollout_kind(cfg), opts.device, "rollout.bf16_dot_products").map_err(TrainError::Config)?;
        }
        let worker = EmbeddedRollout::start_with_verifiers(runtime.clone(), agents, opts.device, rollout_kind(cfg), verifiers)?;
        info!(grpc = %worker.grpc, "embedded rollout worker started");
        (Box::new(pool(vec![format!("http://{}", worker.grpc)], Vec::new(), 1, Duration::from_secs(120), None, Some(services::process_token()))?), Some(worker))
    } else {
        if ro.bf16_dot_products {
            return Err(TrainError::Config(
                "rollout.bf16_dot_products applies to the embedded worker, and this config has remote workers only; \
                 start them with `rollout-worker serve --dtype bf16 --bf16-dot-products` instead"
                    .into(),
            ));
        }
        let (min, wait) = if ro.wait_for_registration {
            (ro.min_workers, Duration::from_secs(ro.registration_timeout_secs))
        } else {
            (1, Duration::from_secs(120))
        };
        let remote = pool(ro.endpoints.clone(), ro.dns_name.iter().cloned().collect(), min, wait, services::client_tls(), services::cluster_token())?;
        remote.check_separate_models(&agents.iter().map(|(a, _)| a.clone()).collect::<Vec<_>>())?;
        (Box::new(remote), None)
    };
    let control = control.map(|(_, server)| server);
    Ok(Services { rollout, reward, guard: ServiceGuard { control, embedded_reward, embedded_rollout, runtime } })
}

/// The run directory of a job: rank 0's (a run name made of the start time differs between ranks).
pub(crate) fn shared_run_dir(dist: &dyn crate::dist::Collective, run_dir: PathBuf) -> Result<PathBuf, TrainError> {
    if dist.world() == 1 {
        return Ok(run_dir);
    }
    let mut name = run_dir.to_string_lossy().into_owned().into_bytes();
    dist.broadcast_bytes(&mut name, 0)?;
    let run_dir = PathBuf::from(String::from_utf8_lossy(&name).into_owned());
    info!(rank = dist.rank(), world = dist.world(), backend = dist.backend(), run_dir = %run_dir.display(), "learner rank started");
    Ok(run_dir)
}

/// Rank 0 connects to the services (starting the embedded ones); the other ranks connect to the
/// same endpoints, which rank 0 sends them.
pub(crate) fn connect_services_ranked(cfg: &CheckedConfig, agents: &[(String, String)], dist: &dyn crate::dist::Collective) -> Result<Services, TrainError> {
    let (services, mut endpoints) = if dist.is_root() {
        let services = connect_services(cfg, agents)?;
        let g = &services.guard;
        let ro = &cfg.raw.rollout;
        let registered = g.control.as_ref().and_then(|_| crate::control::current()).and_then(|c| c.pool().map(|p| p.workers()));
        let rollout = match (&g.embedded_rollout, registered) {
            (Some(w), _) => vec![format!("http://{}", w.grpc)],
            // Every worker rank 0's pool has now (static, resolved and registered ones).
            (None, Some(workers)) => workers.into_iter().map(|w| w.address).collect(),
            (None, None) => ro.endpoints.clone(),
        };
        let reward = match &g.embedded_reward {
            Some(r) => Some(format!("http://{}", r.grpc)),
            None => cfg.raw.reward.endpoint.clone(),
        };
        let ep = serde_json::json!({"rollout": rollout, "dns_name": ro.dns_name, "reward": reward, "host": host_name()});
        (Some(services), serde_json::to_vec(&ep).map_err(|e| TrainError::Dist(e.to_string()))?)
    } else {
        (None, Vec::new())
    };
    dist.broadcast_bytes(&mut endpoints, 0)?;
    if let Some(s) = services {
        return Ok(s);
    }
    let ep: serde_json::Value = serde_json::from_slice(&endpoints).map_err(|e| TrainError::Dist(format!("rank 0's service endpoints: {e}")))?;
    let rollout_eps: Vec<String> = ep["rollout"].as_array().into_iter().flatten().filter_map(|v| v.as_str().map(String::from)).collect();
    let reward_ep = ep["reward"].as_str().map(String::from);
    unreachable_from_here(ep["host"].as_str().unwrap_or_default(), &host_name(), rollout_eps.iter().chain(&reward_ep))
        .map_or(Ok(()), |e| Err(TrainError::Config(format!("rank {}: {e}", dist.rank()))))?;
    let mut own = cfg.clone();
    own.raw.rollout.endpoints = ep["rollout"].as_array().into_iter().flatten().filter_map(|v| v.as_str().map(String::from)).collect();
    own.raw.rollout.dns_name = ep["dns_name"].as_str().map(String::from);
    own.raw.reward.endpoint = ep["reward"].as_str().map(String::from);
    // Rank 0 alone serves the control plane; the workers that registered there are in the list.
    own.raw.learner.control_addr = None;
    own.raw.rollout.wait_for_registration = false;
    info!(rank = dist.rank(), rollout = ?own.raw.rollout.endpoints, reward = ?own.raw.reward.endpoint, "using rank 0's services");
    connect_services(&own, agents)
}

/// This machine's host name (`/proc/sys/kernel/hostname`), empty if unreadable.
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|s| s.trim().to_string()).unwrap_or_default()
}

/// Why a rank on `here` cannot use rank 0's service `endpoints` (rank 0 runs on `rank0`): a
/// loopback address names the rank's own machine, not rank 0's, as the embedded services (which
/// listen on loopback) are.
fn unreachable_from_here<'a>(rank0: &str, here: &str, endpoints: impl IntoIterator<Item = &'a String>) -> Option<String> {
    if rank0.is_empty() || here.is_empty() || rank0 == here {
        return None;
    }
    let local: Vec<&String> = endpoints.into_iter().filter(|e| cotrain_rollout_client::pool::is_loopback(e)).collect();
    (!local.is_empty()).then(|| {
        format!(
            "this rank runs on `{here}` and rank 0 on `{rank0}`, whose services {local:?} listen on loopback: a job across \
             machines needs rollout.endpoints (or rollout.dns_name) and reward.endpoint that every machine can reach"
        )
    })
}

pub fn run_dir_for(cfg: &CheckedConfig) -> PathBuf {
    let name = cfg.raw.logging.run_name.clone().unwrap_or_else(|| {
        let stem = cfg.source.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "run".into());
        let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        format!("{stem}-{secs}")
    });
    PathBuf::from(&cfg.raw.output.base_dir).join(name)
}

/// Refuses configs that ask for a trainer feature that is not built yet, or a run that cannot work
/// (a rollout tree too large for `max_nodes_per_item`, `expert_edits` without an expert), naming the
/// key, so that no run silently does something other than what its config says.
pub fn check_supported(cfg: &CheckedConfig) -> Result<(), TrainError> {
    let t = &cfg.trainer;
    let section = cfg.algorithm.section();
    if cfg.algorithm == crate::config::Algorithm::Maporl {
        if cfg.raw.rollout.max_off_policy_steps > 0 {
            return Err(TrainError::NotBuilt(format!(
                "{}: rollout.max_off_policy_steps is {}: the maporl trainer samples on-policy (asynchronous rollouts are built for \
                 the GRPO/MAGRPO trainer)",
                cfg.source.display(),
                cfg.raw.rollout.max_off_policy_steps
            )));
        }
        return match DatasetKind::resolve(&cfg.raw.dataset) {
            Ok(DatasetKind::Gsm8k | DatasetKind::Anli) => Ok(()),
            _ => Err(TrainError::NotBuilt(format!(
                "{}: the maporl trainer discusses GSM8K and ANLI questions (one answer per agent); dataset `{}` is not one",
                cfg.source.display(),
                cfg.raw.dataset.name
            ))),
        };
    }
    if cfg.is_multi_turn() && t.rollout == crate::config::MultiTurnMode::Tree {
        let nodes = tree::max_tree_nodes(t.joint_mode, cfg.num_agents, t.num_generations, t.num_turns);
        if nodes > t.max_nodes_per_item as u128 {
            let growth = match t.joint_mode {
                crate::config::JointMode::Aligned => format!("G^T = {}^{} leaves", t.num_generations, t.num_turns),
                crate::config::JointMode::Cross => format!("G^(N*T) = {}^({}*{}) leaves", t.num_generations, cfg.num_agents, t.num_turns),
            };
            return Err(TrainError::Config(format!(
                "{}: a {section} tree rollout grows up to {nodes} nodes per item ({growth} without early stops), more than \
                 {section}.max_nodes_per_item = {}: lower num_generations or num_turns, use joint_mode: aligned or rollout: handoff, \
                 or raise max_nodes_per_item",
                cfg.source.display(),
                t.max_nodes_per_item
            )));
        }
    }
    if cfg.is_multi_turn()
        && let Ok(kind) = DatasetKind::resolve(&cfg.raw.dataset)
        && !kind.is_code()
    {
        return Err(TrainError::NotBuilt(format!(
            "{}: {section}.num_turns is {}: the next-turn feedback (external.mode) exists for the code tasks only; \
             dataset `{}` is not one (discussions on GSM8K/ANLI are the MaPoRL trainer's: use a `maporl` section)",
            cfg.source.display(),
            t.num_turns,
            cfg.raw.dataset.name
        )));
    }
    let ext = &cfg.raw.external;
    if cfg.is_multi_turn() && ext.mode == crate::config::ExternalMode::ExpertEdits {
        for (key, value) in [("expert_model", &ext.expert_model), ("expert_base_url", &ext.expert_base_url)] {
            if value.is_none() {
                return Err(TrainError::Config(format!(
                    "{}: external.mode is expert_edits but external.{key} is not set (any OpenAI-compatible chat endpoint works, \
                     e.g. a rollout worker's http://HOST:PORT/v1)",
                    cfg.source.display()
                )));
            }
        }
    }
    let ro = &cfg.raw.rollout;
    if ro.max_off_policy_steps > 0 || rollout_precision_differs(cfg) {
        if cfg.is_multi_turn() && ro.max_off_policy_steps > 0 {
            return Err(TrainError::NotBuilt(format!(
                "{}: rollout.max_off_policy_steps is {} with {section}.num_turns {}: asynchronous rollouts are built for \
                 single-turn training so far (use 0, synchronous on-policy)",
                cfg.source.display(),
                ro.max_off_policy_steps,
                t.num_turns
            )));
        }
        if let Some(cap) = ro.importance_weight_cap
            && !(cap.is_finite() && cap > 0.0)
        {
            return Err(TrainError::Config(format!(
                "{}: rollout.importance_weight_cap must be a positive number (or null for no correction), got {cap}",
                cfg.source.display()
            )));
        }
    }
    Ok(())
}

/// Refuses what data-parallel ranks do not do yet, naming the key: with `world` > 1 ranks, the
/// multi-turn `tree` rollout (the original's update groups chunk nodes across items, which ranks
/// holding different items cannot reproduce) and agent placement.
pub fn check_ranks(cfg: &CheckedConfig, world: usize) -> Result<(), TrainError> {
    if world == 1 {
        return Ok(());
    }
    let section = cfg.algorithm.section();
    if cfg.raw.rollout.max_off_policy_steps > 0 {
        return Err(TrainError::NotBuilt(format!(
            "{}: {world} learner ranks with rollout.max_off_policy_steps > 0: asynchronous rollouts run on one rank so far",
            cfg.source.display()
        )));
    }
    if cfg.raw.learner.placement == crate::config::Placement::Agent {
        let policies = if cfg.trainer.shared_parameters { 1 } else { cfg.num_agents };
        if policies < 2 {
            return Err(TrainError::Config(format!(
                "{}: learner.placement: agent places each agent's policy on its own ranks, but this run trains one policy \
                 ({}); use learner.placement: data",
                cfg.source.display(),
                if cfg.trainer.shared_parameters { "shared_parameters: true" } else { "one agent" }
            )));
        }
        if !world.is_multiple_of(policies) {
            return Err(TrainError::Config(format!(
                "{}: learner.placement: agent with {policies} policies needs a multiple of {policies} ranks, got {world}",
                cfg.source.display()
            )));
        }
    }
    if cfg.is_multi_turn() && cfg.trainer.rollout == crate::config::MultiTurnMode::Tree {
        return Err(TrainError::NotBuilt(format!(
            "{}: {world} learner ranks with a multi-turn `tree` rollout are not built yet (its update groups span items that \
             different ranks hold); use {section}.rollout: handoff, or one rank",
            cfg.source.display()
        )));
    }
    Ok(())
}

/// Everything for a run of `cfg` in `run_dir`: policies, data, prompts, services.
pub fn build(cfg: &CheckedConfig, run_dir: PathBuf) -> Result<(Trainer, ServiceGuard), TrainError> {
    build_ranked(cfg, run_dir, Box::new(crate::dist::SingleRank))
}

/// [`build`] as one rank of `dist`: rank 0 connects to (or starts) the services and tells the other
/// ranks where they are, so that the embedded services are started once per job.
pub fn build_ranked(cfg: &CheckedConfig, run_dir: PathBuf, dist: Box<dyn crate::dist::Collective>) -> Result<(Trainer, ServiceGuard), TrainError> {
    check_supported(cfg)?;
    let kind = DatasetKind::resolve(&cfg.raw.dataset).map_err(|e| TrainError::Data(format!("{}: dataset: {e}", cfg.source.display())))?;
    let train = load_split(&cfg.raw.dataset, &cfg.train_split).map_err(|e| TrainError::Data(e.to_string()))?;
    let eval = match &cfg.eval_split {
        Some(s) => Some(load_split(&cfg.raw.dataset, s).map_err(|e| TrainError::Data(e.to_string()))?),
        None => None,
    };
    let (policies, agent_policy) = load_policies(cfg)?;
    let prompter = crate::prompts::Prompter::from_config(cfg).map_err(|e| TrainError::Config(format!("{}: {e}", cfg.source.display())))?;
    let encoding = items::PromptEncoding::from_config(cfg);
    let max_prompt = cfg.raw.model.max_length.saturating_sub(cfg.sampling.max_new_tokens);
    let models: Vec<&cotrain_model::loader::LoadedModel> = agent_policy.iter().map(|&p| &policies[p].model).collect();
    let train_items = prepare_items(&train, &models, &prompter, &encoding, max_prompt)?;
    let eval_items = match &eval {
        Some(d) => prepare_items(d, &models, &prompter, &encoding, max_prompt)?,
        None => Vec::new(),
    };
    let agents: Vec<(String, String)> = policies.iter().map(|p| (p.worker_agent.clone(), p.model_spec.clone())).collect();
    let services = if dist.world() == 1 { connect_services(cfg, &agents)? } else { connect_services_ranked(cfg, &agents, dist.as_ref())? };
    let Services { rollout, reward, guard } = services;
    let setup = TrainerSetup {
        cfg: cfg.clone(),
        run_dir,
        task: items::reward_task(kind).to_string(),
        is_code: kind.is_code(),
        policies,
        agent_policy,
        rollout,
        reward,
        train_items,
        eval_items,
    };
    let mut trainer = Trainer::new_ranked(setup, dist)?;
    if cfg.is_multi_turn() && cfg.raw.external.mode == crate::config::ExternalMode::ExpertEdits {
        let expert = crate::external::expert::ExpertClient::from_config(&cfg.raw.external, guard.runtime.clone())
            .map_err(|e| TrainError::Config(format!("{}: {e}", cfg.source.display())))?;
        trainer = trainer.with_expert(expert);
    }
    Ok((trainer, guard))
}

/// Refuses to resume `run_dir` with a config that would change the run (see
/// [`crate::config::resume`]), naming every key that differs from the run's `config.yaml`.
fn check_resume_config(cfg: &CheckedConfig, run_dir: &Path) -> Result<(), TrainError> {
    let path = run_dir.join("config.yaml");
    let text = std::fs::read_to_string(&path)
        .map_err(|e| TrainError::Checkpoint(format!("{}: cannot read the run's config to compare with: {e}", path.display())))?;
    // Through the schema, so that keys added since the run started compare as their defaults.
    let value = serde_yaml_ng::from_str(&text).map_err(|e| TrainError::Checkpoint(format!("{}: {e}", path.display())))?;
    let was = CheckedConfig::from_value(value, &path).map_err(|e| TrainError::Checkpoint(e.to_string()))?;
    let to_value = |c: &CheckedConfig| serde_yaml_ng::to_value(&c.raw).unwrap_or(serde_yaml_ng::Value::Null);
    let changes = crate::config::resume::forbidden_changes(&to_value(&was), &to_value(cfg));
    if changes.is_empty() {
        return Ok(());
    }
    let list: Vec<String> = changes.iter().map(|c| format!("  {}: {} (run) -> {} (given)", c.key, c.was, c.now)).collect();
    Err(TrainError::Config(format!(
        "--resume {}: the given config changes the run:\n{}\nresume with the run's own config ({}); keys that may change on resume: {}",
        run_dir.display(),
        list.join("\n"),
        path.display(),
        crate::config::resume::RESUMABLE_KEYS.join(", ")
    )))
}

/// `learner train`: builds the run (or reopens `opts.resume`), trains, and returns where things are.
///
/// Launched as one of several ranks (see [`crate::dist`]), this process trains its share of every
/// step; rank 0 names the run directory, writes it, and resumes from it (the other ranks receive
/// its state).
pub fn train(cfg: &CheckedConfig, opts: &TrainOptions) -> Result<RunSummary, TrainError> {
    let dist = crate::dist::init_with_timeout(cfg.raw.learner.backend, learner_device(cfg)?, cfg.collective_timeout())?;
    check_ranks(cfg, dist.world())?;
    let root = dist.is_root();
    let mut run_dir = match &opts.resume {
        Some(dir) => dir.clone(),
        None => run_dir_for(cfg),
    };
    run_dir = shared_run_dir(dist.as_ref(), run_dir)?;
    if root {
        std::fs::create_dir_all(&run_dir).map_err(|e| TrainError::Io(format!("{}: {e}", run_dir.display())))?;
        if opts.resume.is_some() {
            check_resume_config(cfg, &run_dir)?;
        }
        std::fs::write(run_dir.join("config.yaml"), cfg.to_yaml()).map_err(|e| TrainError::Io(format!("{}: {e}", run_dir.display())))?;
    }
    let (mut trainer, services) = build_ranked(cfg, run_dir.clone(), dist)?;
    if opts.resume.is_some() && root {
        trainer.resume(&run_dir)?;
    }
    let summary = trainer.run();
    drop(trainer);
    drop(services);
    summary
}

/// `learner eval`: loads a checkpoint's weights into fresh policies and evaluates them on the eval
/// split; the scalars are returned (and written to `eval.json` in the checkpoint directory).
/// `ks` are the k of the @k metrics; max(ks) joint samples are drawn per item. No optimiser state is
/// allocated or read.
pub fn evaluate_checkpoint(cfg: &CheckedConfig, checkpoint: &Path, ks: &[usize]) -> Result<std::collections::BTreeMap<String, f64>, TrainError> {
    if cfg.eval_split.is_none() {
        return Err(TrainError::Config(format!("{}: dataset.eval_split is not set", cfg.source.display())));
    }
    let samples = ks.iter().copied().max().unwrap_or(1).max(1);
    let tmp_run = std::env::temp_dir().join(format!("cotrain-eval-{}", std::process::id()));
    let (mut trainer, services) = build(cfg, tmp_run.clone())?;
    trainer.restore_weights(checkpoint)?;
    trainer.sync_all_weights()?;
    let m = trainer.evaluate(samples, ks)?;
    let path = checkpoint.join("eval.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&m).unwrap_or_default()).map_err(|e| TrainError::Io(format!("{}: {e}", path.display())))?;
    drop(trainer);
    drop(services);
    let _ = std::fs::remove_dir_all(&tmp_run);
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_services_of_another_machine_are_refused() {
        let eps = ["http://127.0.0.1:5000".to_string(), "http://reward-0:50051".to_string()];
        let e = unreachable_from_here("node-a", "node-b", &eps).expect("refused");
        assert!(e.contains("node-b") && e.contains("node-a") && e.contains("127.0.0.1:5000") && !e.contains("reward-0"), "{e}");
        assert_eq!(unreachable_from_here("node-a", "node-a", &eps), None, "the same machine reaches its loopback");
        assert_eq!(unreachable_from_here("node-a", "node-b", &eps[1..]), None, "routable names are fine");
    }
}
