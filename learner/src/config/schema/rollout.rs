//! `rollout`, `learner` and `reward`: where generation happens, how the ranks work together, and the
//! reward server with the options every scoring call carries.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::default_true;

/// `rollout`: where generation happens; embedded worker when nothing is configured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RolloutConfig {
    /// Static list of `http://host:port` worker endpoints.
    #[serde(default)]
    pub endpoints: Vec<String>,
    /// DNS name resolved to many addresses (e.g. a Kubernetes headless service), `host:port`.
    #[serde(default)]
    pub dns_name: Option<String>,
    /// How often `dns_name` is resolved again, in seconds (A and AAAA records; addresses that leave the
    /// name are dropped).
    #[serde(default = "default_dns_refresh_secs")]
    pub dns_refresh_secs: u64,
    /// Deadline of one generate request to a worker, in seconds.
    #[serde(default = "default_request_timeout_secs")]
    pub request_timeout_secs: u64,
    /// Times a failed generate request is retried on another worker.
    #[serde(default = "default_max_retries")]
    pub max_retries: usize,
    /// 0 = synchronous on-policy (the original); k > 0: the next step's rollout is drawn while a
    /// step trains, and samples more than k policy versions older than the trained policy are
    /// dropped and redrawn.
    #[serde(default)]
    pub max_off_policy_steps: usize,
    /// With max_off_policy_steps > 0: the cap of the truncated importance weights that correct the
    /// loss for the behaviour policy (`null`: no correction).
    #[serde(default = "default_importance_weight_cap")]
    pub importance_weight_cap: Option<f64>,
    /// How weights reach the workers after each step; see [`WeightTransport`].
    #[serde(default)]
    pub weight_transport: WeightTransport,
    /// The element type of pushed weights: `f32` (the workers' policy is bit-identical to the
    /// learner's) or `bf16` (half the bytes; the workers convert to their own dtype).
    #[serde(default)]
    pub weight_dtype: WeightDtype,
    /// How the embedded worker serves LoRA policies (`model.lora`, MaPoRL's adapters): `merged`
    /// (each agent its own copy of the base with its adapter merged in, its own engine) or
    /// `unmerged` (the agents on one base share one copy and one engine whose batches mix them,
    /// each adapter's low-rank product added to its own rows: one base of memory plus the
    /// adapters). Remote workers serve adapters unmerged when started with `rollout-worker serve
    /// --adapters a,b`.
    #[serde(default)]
    pub lora_serving: LoraServing,
    /// What the embedded worker generates with: `cotrain` (its own engine, in this process) or
    /// `vllm` (a vLLM engine per agent, each its own process, as `rollout-worker serve --engine
    /// vllm`; needs `COTRAIN_VLLM=cpu|system make setup` or COTRAIN_VLLM_PYTHON). Remote workers
    /// choose with their own `--engine`.
    #[serde(default)]
    pub engine: RolloutEngine,
    /// The precision rollouts are drawn in: `auto` (the policy's `model.dtype`), `f32` or `bf16`.
    /// The embedded worker loads its models in it; remote workers are started with the matching
    /// `rollout-worker serve --dtype`. When it differs from the training precision, the loss
    /// takes the workers' log-probs as the behaviour policy: `logprob_gap` (mean |Δ log-prob| per
    /// token) is reported and `importance_weight_cap` corrects for the mismatch.
    #[serde(default)]
    pub dtype: Precision,
    /// With bf16 rollouts on a CPU with AVX512_BF16: the embedded worker rounds each product's
    /// input rows to bf16 and multiplies with bf16 dot products (`rollout-worker serve
    /// --bf16-dot-products` for remote workers). Off by default: the rows then stay f32.
    #[serde(default)]
    pub bf16_dot_products: bool,
    /// Start no embedded worker and wait for workers to register with `learner.control_addr`
    /// (`rollout-worker serve --register URL`), next to any `endpoints`/`dns_name`.
    #[serde(default)]
    pub wait_for_registration: bool,
    /// With wait_for_registration: how many workers must be in rotation before training starts.
    #[serde(default = "default_min_workers")]
    pub min_workers: usize,
    /// With wait_for_registration: how long to wait for them before giving up.
    #[serde(default = "default_registration_timeout_secs")]
    pub registration_timeout_secs: u64,
}

pub(super) fn default_min_workers() -> usize {
    1
}

pub(super) fn default_registration_timeout_secs() -> u64 {
    600
}

/// `rollout.dtype` and `model.matmul_dtype`: a precision, or `auto` for the parameters' own.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// The parameters' own dtype (`model.dtype`).
    #[default]
    Auto,
    #[serde(alias = "float32", alias = "fp32")]
    F32,
    #[serde(alias = "bfloat16")]
    Bf16,
}

impl Precision {
    /// The libtorch dtype, `auto` being `params` (the parameters' dtype).
    pub fn kind(self, params: tch::Kind) -> tch::Kind {
        match self {
            Precision::Auto => params,
            Precision::F32 => tch::Kind::Float,
            Precision::Bf16 => tch::Kind::BFloat16,
        }
    }
}

/// `rollout.lora_serving`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum LoraServing {
    /// One merged copy of the base per agent.
    #[default]
    Merged,
    /// One base per model for all its LoRA agents, adapters applied unmerged.
    Unmerged,
}

/// `rollout.engine`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum RolloutEngine {
    /// cotrain's engine (no Python; the fastest on CPUs).
    #[default]
    Cotrain,
    /// vLLM, one engine process per agent.
    Vllm,
}

/// `rollout.weight_dtype`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum WeightDtype {
    #[default]
    F32,
    Bf16,
}

/// `learner`: the learner's ranks (learner/src/dist). One process is one rank; the launcher
/// (`learner launch`, `mpirun`, `srun --mpi=pmix`, torchrun for the NCCL backend) says how many.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LearnerConfig {
    /// The collective library the ranks reduce gradients with.
    #[serde(default)]
    pub backend: DistBackend,
    /// With several ranks: a collective still waiting after this many seconds stops its rank with
    /// a message naming it (a dead or hung peer, or a network the ranks cannot cross); 0 (the
    /// default): wait for ever. Off by default because ranks also wait in collectives while rank 0
    /// alone works (waiting for workers to register, loading, evaluating, writing a checkpoint), for
    /// as long as that takes: set it above the longest such phase.
    #[serde(default = "default_collective_timeout_secs")]
    pub collective_timeout_secs: u64,
    /// What the ranks split: the step's items (`data`) or the agents' policies (`agent`).
    #[serde(default)]
    pub placement: Placement,
    /// Every this many steps the ranks compare a checksum of their weights (0: never).
    #[serde(default = "default_checksum_steps")]
    pub checksum_steps: u64,
    /// `host:port` of the control plane (gRPC and HTTP: status, checkpoint, stop, worker
    /// registration, /metrics); none by default. Bind loopback unless other hosts must reach it,
    /// and then set a cluster token.
    #[serde(default)]
    pub control_addr: Option<String>,
    /// On one CPU rank with several policies, update them at the same time, one thread each with
    /// its share of the cores (`learner::trainer::rounds`); `false` updates them in turn. The MaPoRL
    /// trainer runs its adapters' and critics' PPO epochs the same way (`learner::maporl::update`).
    #[serde(default = "default_true")]
    pub concurrent_policies: bool,
}

impl Default for LearnerConfig {
    fn default() -> Self {
        Self {
            backend: DistBackend::default(),
            placement: Placement::default(),
            checksum_steps: default_checksum_steps(),
            control_addr: None,
            concurrent_policies: true,
            collective_timeout_secs: default_collective_timeout_secs(),
        }
    }
}

pub(super) fn default_collective_timeout_secs() -> u64 {
    0
}

pub(super) fn default_checksum_steps() -> u64 {
    10
}

/// `learner.backend`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum DistBackend {
    /// NCCL when the learner's device is CUDA, MPI otherwise.
    #[default]
    Auto,
    /// Open MPI (or any MPI the `mpi` crate links): CPU tensors.
    Mpi,
    /// NCCL through cudarc: CUDA tensors (the `cuda` build feature).
    Nccl,
}

/// `learner.placement`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Placement {
    /// Every rank holds every policy and trains on its share of each step's items.
    #[default]
    Data,
    /// Each agent's policy on its own group of ranks.
    Agent,
}

/// `rollout.weight_transport`: how the learner sends weights to the rollout workers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum WeightTransport {
    /// `shm` when every worker is on a loopback address and accepts it (`--allow-shm-weights`;
    /// the embedded worker does), else `grpc`; falls back to `grpc` with a warning if `shm` fails.
    #[default]
    Auto,
    /// Always gRPC chunks.
    Grpc,
    /// Always a file in /dev/shm named in the update stream; an error if a worker refuses it.
    Shm,
}

impl Default for RolloutConfig {
    fn default() -> Self {
        Self {
            endpoints: Vec::new(),
            dns_name: None,
            dns_refresh_secs: default_dns_refresh_secs(),
            request_timeout_secs: default_request_timeout_secs(),
            max_retries: default_max_retries(),
            max_off_policy_steps: 0,
            importance_weight_cap: default_importance_weight_cap(),
            weight_transport: WeightTransport::Auto,
            weight_dtype: WeightDtype::F32,
            lora_serving: LoraServing::Merged,
            engine: RolloutEngine::Cotrain,
            dtype: Precision::Auto,
            bf16_dot_products: false,
            wait_for_registration: false,
            min_workers: default_min_workers(),
            registration_timeout_secs: default_registration_timeout_secs(),
        }
    }
}

pub(super) fn default_importance_weight_cap() -> Option<f64> {
    Some(2.0)
}

pub(super) fn default_dns_refresh_secs() -> u64 {
    30
}
pub(super) fn default_reward_outage_timeout() -> f64 {
    300.0
}
pub(super) fn default_reward_retries() -> u32 {
    5
}

pub(super) fn default_request_timeout_secs() -> u64 {
    600
}
pub(super) fn default_max_retries() -> usize {
    3
}

/// `reward`: the reward server (embedded when `endpoint` is absent) and the options every scoring
/// call carries.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RewardConfig {
    /// The reward server's gRPC address (`http://host:port`, `https://` with TLS); unset: a reward server
    /// embedded in the learner on a loopback port.
    #[serde(default)]
    pub endpoint: Option<String>,
    /// Deadline of one call to the reward server, in seconds.
    #[serde(default = "default_request_timeout_secs")]
    pub request_timeout_secs: u64,
    /// Retries of a call that failed because the reward server is overloaded or late (0.5 s,
    /// then twice as long each time, at most 8 s); then the step fails with a checkpoint.
    #[serde(default = "default_reward_retries")]
    pub max_retries: u32,
    /// Seconds the learner waits out a reward server it cannot reach (down, restarting), retrying
    /// every few seconds, before the step fails with a checkpoint and a message naming the
    /// endpoint. The wait is reported per step as `reward/outage_secs`.
    #[serde(default = "default_reward_outage_timeout")]
    pub outage_timeout: f64,
    /// Writing reward: `newest` (from 2025-12-31) or `earlier` length-ratio bands; the same as
    /// `options.arxiv_ratio`, kept under the name earlier configs used.
    #[serde(default)]
    pub writing_ratio_version: Option<cotrain_proto::reward_options::ArxivRatioVersion>,
    /// The reward server's scoring options (the original's behaviour by default; each correction
    /// beside it is a named option, listed on the book's "MAGRPO and GRPO" page). `split_seed` defaults to `seed`.
    #[serde(default)]
    pub options: cotrain_proto::reward_options::ScoreOptions,
}

impl Default for RewardConfig {
    fn default() -> Self {
        Self {
            endpoint: None,
            request_timeout_secs: default_request_timeout_secs(),
            max_retries: default_reward_retries(),
            outage_timeout: default_reward_outage_timeout(),
            writing_ratio_version: None,
            options: Default::default(),
        }
    }
}
