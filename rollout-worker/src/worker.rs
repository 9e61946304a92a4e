//! The worker: agents mapped onto loaded models, request validation and prompt encoding,
//! admission control, and the hand-off to each model's engine loop.
//!
//! Every agent has a model of its own (one copy of the parameters and one engine loop) unless it is
//! in a sharing group (`serve --share a,b`, [`WorkerConfig::share`]): the agents of a group share
//! one loaded model. The policy version belongs to the model, so a weight update sent for one of
//! them changes the policy of all of them; `Info` and the update's answer list who shares.
//!
//! Adapter groups (`serve --adapters a,b`, [`WorkerConfig::adapters`]) serve their agents as LoRA
//! adapters on one loaded base, unmerged: one engine, batches mixing the agents, each agent with its
//! own adapter and policy version; such agents take adapter updates only, which replace the agent's
//! adapter. N agents cost one base plus N adapters of memory.
//!
//! Elsewhere, adapter updates (LoRA pairs, see [`crate::weights`]) are merged per adapter: the worker holds
//! one copy of the base weights per model slot, loaded from the model spec at the first adapter
//! update, merges each adapter into it (`W0 + scaling·B·A`) and swaps the merged projections in
//! like a partial update. Agents sharing a model slot share the merged weights too.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cotrain_model::chat_template::{ChatMessage, ChatTemplate};
use cotrain_model::engine::{
    Engine, EngineConfig, FinishReason, LogprobMode, Request, SamplingParams, StopConditions,
};
use cotrain_model::loader::{self, LoadOptions};
use cotrain_model::tokenizer::Tokenizer;
use tch::{Device, Kind, Tensor};
use tokio::sync::{mpsc, oneshot};
use tracing::info;

pub use crate::batcher::EngineThreads;
pub use crate::batcher::StreamToken;
use crate::batcher::{Command, EngineLoop, JobOutput, LoopState, StagedUpdate};
use crate::error::{Result, WorkerError};
use crate::metrics::Metrics;
use crate::weights::{CompleteUpdate, Staging};

/// A parameter's name and shape.
pub type ParameterShape = (String, Vec<i64>);

impl WorkerConfig {
    /// The device of the model copy serving `agents` (one slot's agents).
    fn device_for(&self, agents: &[String]) -> Result<Device> {
        let of = |a: &String| {
            self.agent_devices
                .iter()
                .find(|(n, _)| n == a)
                .map(|(_, d)| *d)
                .unwrap_or(self.device)
        };
        let device = of(&agents[0]);
        if let Some(other) = agents.iter().find(|a| of(a) != device) {
            return Err(WorkerError::invalid(
                "agent-device",
                format!(
                    "agents `{}` and `{other}` share one model copy but are placed on {device:?} and {:?}",
                    agents[0],
                    of(other)
                ),
            ));
        }
        Ok(device)
    }
}

/// Upper bound accepted for `temperature`.
pub const MAX_TEMPERATURE: f64 = 100.0;

/// How to build a worker.
#[derive(Clone, Debug)]
pub struct WorkerConfig {
    /// `(agent name, model spec)` pairs; a spec is a HF directory, a `.gguf`, a cached repo id or
    /// `default`. Each agent gets a model of its own, whatever the specs, unless `share` groups it.
    pub agents: Vec<(String, String)>,
    /// Groups of agents that share one model copy (all of a group name the same spec).
    pub share: Vec<Vec<String>>,
    /// Groups of agents served as LoRA adapters on one shared base, unmerged (all of a group
    /// name the same spec; `serve --adapters`).
    pub adapters: Vec<Vec<String>>,
    /// Where the parameters live, for agents `agent_devices` does not place.
    pub device: Device,
    /// `(agent, device)`: agents whose model lives elsewhere than `device` (`--agent-device`), e.g.
    /// one GPU per agent. Agents sharing a model copy must be placed together.
    pub agent_devices: Vec<(String, Device)>,
    /// Parameter dtype.
    pub kind: Kind,
    /// Most sequences one model decodes together.
    pub max_batch_size: usize,
    /// Most generate requests admitted and not answered, all models; beyond it RESOURCE_EXHAUSTED.
    pub max_queued_requests: usize,
    /// CPU threads each model's engine steps on (default: libtorch's, every core). With several
    /// models in one process on a few cores, their engines step at the same time, and one team of
    /// threads per engine spin-waiting on the same cores slows them all: one core each was faster
    /// (MAGRPO's two batch-4 decodes on 2 cores, alternating runs: 3.2–4.2 s, mostly 4.0–4.1,
    /// against 4.3–4.7 s). [`EngineThreads::Shared`] splits the cores between the engines busy at
    /// the time.
    pub engine_threads: EngineThreads,
    /// `(name, directory)` of each learned verifier to load (`serve --verifier NAME=DIR`).
    pub verifiers: Vec<(String, std::path::PathBuf)>,
    /// `(agent, directory)`: PEFT adapter directories loaded at start as those agents' adapters
    /// (agents of an adapter group; `serve --lora-module`), at version 1.
    pub lora_modules: Vec<(String, std::path::PathBuf)>,
}

/// A prompt as a client gives it.
#[derive(Clone, Debug, PartialEq)]
pub enum PromptInput {
    /// Tokenised as is.
    Text(String),
    /// Rendered with the model's chat template, generation prompt appended.
    Chat(Vec<ChatMessage>),
    /// Used as is.
    Tokens(Vec<u32>),
}

/// A generate request, independent of the wire format it came in.
#[derive(Clone, Debug)]
pub struct GenerateJob {
    /// The agent.
    pub agent: String,
    /// One or more prompts.
    pub prompts: Vec<PromptInput>,
    /// Samples per prompt.
    pub n: usize,
    /// Sampling parameters.
    pub sampling: SamplingParams,
    /// Stop conditions, including `max_new_tokens`.
    pub stop: StopConditions,
    /// Seed; see [`prompt_seed`].
    pub seed: u64,
    /// Refuse to sample from an older policy.
    pub min_policy_version: Option<u64>,
    /// Most likely tokens to report at each generated position (OpenAI's `top_logprobs`); 0: none.
    pub top_logprobs: usize,
    /// Which log-prob each sample reports per token (`SamplingParams.sampling_logprobs`).
    pub logprobs: LogprobMode,
}

/// One sample of a completion.
#[derive(Clone, Debug, PartialEq)]
pub struct SampleOutput {
    /// Generated token ids.
    pub token_ids: Vec<u32>,
    /// Decoded text.
    pub text: String,
    /// Raw-model log-prob of every generated token.
    pub logprobs: Vec<f32>,
    /// With [`GenerateJob::top_logprobs`] > 0, each position's most likely tokens and their raw
    /// log-probs, most likely first.
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// The version whose weights produced every token.
    pub policy_version: u64,
}

/// The samples of one prompt.
#[derive(Clone, Debug, PartialEq)]
pub struct CompletionOutput {
    /// The prompt as the model saw it.
    pub prompt_token_ids: Vec<u32>,
    /// `n` samples, by index.
    pub samples: Vec<SampleOutput>,
}

/// The answer to a [`GenerateJob`].
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateOutput {
    /// The model id that served it.
    pub model: String,
    /// One per prompt, in request order.
    pub completions: Vec<CompletionOutput>,
}

/// The seed of prompt `index` of a request with `seed`: the seed itself for the first prompt, a
/// SplitMix64 mix of both for the others. Sample `j` of that prompt then uses the engine's
/// stream `(prompt_seed, j)`; nothing depends on other requests in the batch.
pub fn prompt_seed(seed: u64, index: usize) -> u64 {
    if index == 0 {
        return seed;
    }
    let mut z = seed ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// What the worker knows about one loaded model outside its engine loop.
pub(crate) struct ModelSlot {
    pub id: String,
    pub agents: Vec<String>,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
    pub context_length: usize,
    pub vocab_size: usize,
    pub parameter_count: u64,
    /// Parameter name → shape, for validating updates.
    pub params: HashMap<String, Vec<i64>>,
    pub kind: Kind,
    pub device: Device,
    pub tx: mpsc::UnboundedSender<Command>,
    pub state: Arc<LoopState>,
    /// Whether its agents are served as unmerged adapters on its base (`serve --adapters`).
    pub adapters: bool,
    /// The pristine weights adapter updates are merged into.
    pub base: Arc<BaseWeights>,
    /// Buffers whole-tensor updates read into (see [`Staging`]).
    pub staging: Staging,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ModelSlot {
    /// `agent`'s adapter id in an adapter slot (its position), `None` elsewhere.
    fn adapter_id(&self, agent: &str) -> Option<u32> {
        if !self.adapters {
            return None;
        }
        self.agents
            .iter()
            .position(|a| a == agent)
            .map(|i| i as u32)
    }

    /// The policy version serving `agent`: its own in an adapter slot, the model's elsewhere.
    fn version_of(&self, agent: &str) -> u64 {
        match self.adapter_id(agent) {
            Some(id) => self.state.agent_versions[id as usize].load(Ordering::SeqCst),
            None => self.state.policy_version.load(Ordering::SeqCst),
        }
    }
}

/// A model's base weights as loaded from its spec, for merging adapter updates into: the engine's
/// own parameters cannot serve, since every update overwrites them, and an adapter is relative to
/// the base, not to the last update. Loaded at the first adapter update (a worker that only gets
/// ordinary updates never pays for the copy), then kept: one copy per model file, shared by the
/// slots that load that file.
pub(crate) struct BaseWeights {
    spec: String,
    opts: LoadOptions,
    /// The 2-D parameters (the only ones an adapter can target) by name, once loaded. A mutex,
    /// not a lock-free cell: `Tensor` is `Send` but not `Sync`, and merges run one at a time anyway.
    weights: Mutex<Option<BTreeMap<String, Tensor>>>,
}

impl BaseWeights {
    fn new(spec: &str, opts: LoadOptions) -> Self {
        Self {
            spec: spec.to_string(),
            opts,
            weights: Mutex::new(None),
        }
    }

    /// `W0 + scaling·B·A` for every pair of `adapter`, by base parameter name, in the model's dtype
    /// and on its device; loads the base first if needed. Blocking: call it off the async runtime.
    fn merge(
        &self,
        adapter: &BTreeMap<String, Tensor>,
        scaling: f64,
    ) -> Result<HashMap<String, Tensor>> {
        let mut weights = self.weights.lock().unwrap_or_else(|e| e.into_inner());
        if weights.is_none() {
            let started = std::time::Instant::now();
            let loaded = loader::load(&self.spec, &self.opts).map_err(|e| {
                WorkerError::Internal(format!(
                    "loading the base weights of `{}` to merge an adapter: {e}",
                    self.spec
                ))
            })?;
            let base: BTreeMap<String, Tensor> = loaded
                .named_parameters()
                .into_iter()
                .filter(|(_, t)| t.dim() == 2)
                .map(|(k, t)| (k, t.detach()))
                .collect();
            info!(model = %self.spec, tensors = base.len(), load_ms = started.elapsed().as_millis() as u64,
                "base weights loaded for adapter merges");
            *weights = Some(base);
        }
        let base = weights.as_ref().expect("loaded above");
        let merged = cotrain_model::lora::merge_into(
            |n| base.get(n).map(Tensor::shallow_clone),
            adapter,
            scaling,
        )
        .map_err(|e| WorkerError::BadUpdate(format!("merging the adapter: {e}")))?;
        Ok(merged.into_iter().collect())
    }
}

/// Agent/model status for `Info`.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelStatus {
    /// Model id (its spec).
    pub id: String,
    /// Agents served by it.
    pub agents: Vec<String>,
    /// Current policy version.
    pub policy_version: u64,
    /// Parameter count.
    pub parameter_count: u64,
    /// Context length in tokens.
    pub context_length: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Sequences decoding now.
    pub running_sequences: usize,
    /// Jobs waiting to decode.
    pub queued_requests: usize,
    /// Weight updates waiting for the running sequences to finish.
    pub pending_weight_updates: usize,
    /// Its agents are served as unmerged adapters, each with its own version.
    pub unmerged_adapters: bool,
}

/// The rollout worker's business logic; the gRPC and HTTP layers are thin adapters over it.
pub struct Worker {
    id: String,
    config: WorkerConfig,
    models: Vec<ModelSlot>,
    /// Agent name → index into `models`.
    agents: HashMap<String, usize>,
    agent_order: Vec<String>,
    in_flight: AtomicUsize,
    next_job: AtomicU64,
    metrics: Metrics,
    /// Learned verifiers by name.
    verifiers: std::collections::BTreeMap<String, crate::verifier::VerifierHost>,
}

impl Worker {
    /// The models to load: `(spec, agents, adapters)`, one per agent, sharing group or adapter
    /// group (`adapters`: its agents are served as unmerged adapters), in the agents' order.
    fn model_slots(config: &WorkerConfig) -> Result<Vec<(String, Vec<String>, bool)>> {
        let spec_of: HashMap<&str, &str> = config
            .agents
            .iter()
            .map(|(a, s)| (a.as_str(), s.as_str()))
            .collect();
        let mut group_of: HashMap<&str, usize> = HashMap::new();
        let groups: Vec<(&str, &Vec<String>)> = config
            .share
            .iter()
            .map(|g| ("share", g))
            .chain(config.adapters.iter().map(|g| ("adapters", g)))
            .collect();
        for (g, (flag, members)) in groups.iter().enumerate() {
            if *flag == "share" && members.len() < 2 {
                return Err(WorkerError::invalid(
                    "share",
                    format!("a sharing group needs at least two agents, got {members:?}"),
                ));
            }
            for a in members.iter() {
                let Some(spec) = spec_of.get(a.as_str()) else {
                    return Err(WorkerError::invalid(
                        *flag,
                        format!("`{a}` in --{flag} {} is not an agent", members.join(",")),
                    ));
                };
                if group_of.insert(a.as_str(), g).is_some() {
                    return Err(WorkerError::invalid(
                        *flag,
                        format!(
                            "agent `{a}` is in two groups (--share and --adapters groups may not overlap)"
                        ),
                    ));
                }
                if *spec != spec_of[members[0].as_str()] {
                    return Err(WorkerError::invalid(
                        *flag,
                        format!(
                            "agents of --{flag} {} name different models (`{}` and `{spec}`)",
                            members.join(","),
                            spec_of[members[0].as_str()]
                        ),
                    ));
                }
            }
        }
        let mut slots: Vec<(String, Vec<String>, bool)> = Vec::new();
        let mut slot_of_group: HashMap<usize, usize> = HashMap::new();
        for (name, spec) in &config.agents {
            match group_of
                .get(name.as_str())
                .and_then(|g| slot_of_group.get(g).copied())
            {
                Some(i) => slots[i].1.push(name.clone()),
                None => {
                    let group = group_of.get(name.as_str()).copied();
                    if let Some(g) = group {
                        slot_of_group.insert(g, slots.len());
                    }
                    let adapters = group.is_some_and(|g| groups[g].0 == "adapters");
                    slots.push((spec.clone(), vec![name.clone()], adapters));
                }
            }
        }
        Ok(slots)
    }

    /// Loads every model (one per agent or sharing group) and starts one engine loop each.
    pub fn start(config: WorkerConfig, metrics: Metrics) -> Result<Self> {
        if config.agents.is_empty() && config.verifiers.is_empty() {
            return Err(WorkerError::invalid(
                "agents",
                "at least one agent or verifier is needed",
            ));
        }
        if config.max_batch_size == 0 || config.max_queued_requests == 0 {
            return Err(WorkerError::invalid(
                "max_batch_size",
                "batch size and queue bound must be positive",
            ));
        }
        let mut models: Vec<ModelSlot> = Vec::new();
        let mut agents = HashMap::new();
        let mut agent_order = Vec::new();
        let mut bases: HashMap<(std::path::PathBuf, Device), Arc<BaseWeights>> = HashMap::new();
        for (name, _) in &config.agents {
            if name.is_empty() || agents.insert(name.clone(), usize::MAX).is_some() {
                return Err(WorkerError::invalid(
                    "agent",
                    format!("agent name `{name}` is empty or repeated"),
                ));
            }
            agent_order.push(name.clone());
        }
        let slots = Self::model_slots(&config)?;
        if let Some((a, _)) = config
            .agent_devices
            .iter()
            .find(|(a, _)| !agents.contains_key(a))
        {
            return Err(WorkerError::invalid(
                "agent-device",
                format!("`{a}` is not an agent of this worker"),
            ));
        }
        let mut copies: HashMap<&str, usize> = HashMap::new();
        for (spec, _, _) in &slots {
            *copies.entry(spec.as_str()).or_default() += 1;
        }
        for (spec, names, adapters) in &slots {
            // A model's id is its spec, or with several copies of it, the spec and its agents.
            let id = if copies[spec.as_str()] > 1 {
                format!("{spec}#{}", names.join("+"))
            } else {
                spec.clone()
            };
            let device = config.device_for(names)?;
            let base = Self::shared_base(&mut bases, spec, device, &config);
            let slot = Self::start_model(
                spec,
                &id,
                names.clone(),
                *adapters,
                device,
                &config,
                &metrics,
                base,
            )?;
            for n in names {
                agents.insert(n.clone(), models.len());
            }
            models.push(slot);
        }
        let mut verifiers = std::collections::BTreeMap::new();
        for (name, dir) in &config.verifiers {
            if name.is_empty() || verifiers.contains_key(name) {
                return Err(WorkerError::invalid(
                    "verifier",
                    format!("verifier name `{name}` is empty or repeated"),
                ));
            }
            let opts = LoadOptions {
                device: config.device,
                kind: config.kind,
            };
            let host = crate::verifier::VerifierHost::start(
                name,
                dir.clone(),
                opts,
                config.max_batch_size.min(16),
                metrics.clone(),
            )?;
            verifiers.insert(name.clone(), host);
        }
        Ok(Self {
            id: uuid::Uuid::new_v4().to_string(),
            config,
            models,
            agents,
            agent_order,
            in_flight: AtomicUsize::new(0),
            next_job: AtomicU64::new(0),
            metrics,
            verifiers,
        })
    }

    /// The learned verifiers' names.
    pub fn verifier_names(&self) -> Vec<String> {
        self.verifiers.keys().cloned().collect()
    }

    /// Scores (user, assistant) conversations with the verifier `name` (empty: the only one).
    pub async fn score_verifier(
        &self,
        name: &str,
        conversations: Vec<(String, String)>,
    ) -> Result<(String, Vec<f32>)> {
        if conversations.is_empty() {
            return Err(WorkerError::invalid(
                "conversations",
                "at least one conversation is needed",
            ));
        }
        let host = if name.is_empty() {
            match self.verifiers.len() {
                1 => self.verifiers.values().next().expect("one"),
                0 => {
                    return Err(WorkerError::invalid(
                        "verifier",
                        "this worker serves no verifier (start it with --verifier NAME=DIR)",
                    ));
                }
                _ => {
                    return Err(WorkerError::invalid(
                        "verifier",
                        format!("name one of {:?}", self.verifier_names()),
                    ));
                }
            }
        } else {
            self.verifiers.get(name).ok_or_else(|| {
                WorkerError::invalid(
                    "verifier",
                    format!(
                        "no verifier `{name}` here (serving {:?})",
                        self.verifier_names()
                    ),
                )
            })?
        };
        let rx = host.submit(conversations)?;
        let scores = rx
            .await
            .map_err(|_| WorkerError::Unavailable(format!("verifier `{}` stopped", host.name)))??;
        Ok((host.name.clone(), scores))
    }

    /// The base weights for adapter merges of the model at `spec`, one copy per file: slots that
    /// hold separate copies of the same model (`--separate-weights`, one per MaPoRL adapter key)
    /// merge into the same pristine base instead of each loading their own.
    fn shared_base(
        bases: &mut HashMap<(std::path::PathBuf, Device), Arc<BaseWeights>>,
        spec: &str,
        device: Device,
        config: &WorkerConfig,
    ) -> Arc<BaseWeights> {
        let opts = LoadOptions {
            device,
            kind: config.kind,
        };
        let file = loader::resolve(spec).ok().map(|s| match s {
            loader::ModelSource::Gguf(p) | loader::ModelSource::HfDir(p) => {
                std::fs::canonicalize(&p).unwrap_or(p)
            }
        });
        match file {
            Some(f) => bases
                .entry((f, device))
                .or_insert_with(|| Arc::new(BaseWeights::new(spec, opts)))
                .clone(),
            None => Arc::new(BaseWeights::new(spec, opts)),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn start_model(
        spec: &str,
        id: &str,
        agents: Vec<String>,
        adapters: bool,
        device: Device,
        config: &WorkerConfig,
        metrics: &Metrics,
        base: Arc<BaseWeights>,
    ) -> Result<ModelSlot> {
        let opts = LoadOptions {
            device,
            kind: config.kind,
        };
        let started = std::time::Instant::now();
        let loaded = loader::load(spec, &opts)?;
        let cfg = loaded.model.config().clone();
        let named = loaded.named_parameters();
        let params: HashMap<String, Vec<i64>> =
            named.iter().map(|(k, t)| (k.clone(), t.size())).collect();
        let parameter_count = named.values().map(|t| t.numel() as u64).sum();
        let chat_template = match &loaded.chat_template {
            Some(t) => Some(
                ChatTemplate::new(t.source().to_string(), t.bos_token(), t.eos_token()).map_err(
                    |e| WorkerError::Internal(format!("chat template of `{spec}`: {e}")),
                )?,
            ),
            None => None,
        };
        let tokenizer = loaded.tokenizer.clone();
        info!(
            model = id,
            ?agents,
            parameters = parameter_count,
            load_ms = started.elapsed().as_millis() as u64,
            "model loaded"
        );
        let mut engine = Engine::with_config(
            loaded,
            EngineConfig {
                max_batch_rows: config.max_batch_size,
            },
        );
        let (tx, rx) = mpsc::unbounded_channel();
        let state = Arc::new(if adapters {
            LoopState::for_adapters(agents.len())
        } else {
            LoopState::default()
        });
        for a in &agents {
            metrics
                .policy_version
                .with_label_values(&[a.as_str()])
                .set(0);
        }
        // `--lora-module` adapters, loaded before the first request, at version 1.
        let mut start_versions = vec![0; agents.len()];
        for (agent, dir) in &config.lora_modules {
            let Some(id) = agents.iter().position(|a| a == agent).filter(|_| adapters) else {
                continue;
            };
            let adapter = cotrain_model::lora::LoraAdapter::load_peft(dir, &engine.loaded().model)
                .map_err(|e| {
                    WorkerError::invalid("lora-module", format!("{agent}={}: {e}", dir.display()))
                })?;
            engine
                .set_adapter(id as u32, Some(adapter))
                .map_err(|e| WorkerError::invalid("lora-module", format!("{agent}: {e}")))?;
            start_versions[id] = 1;
            state.agent_versions[id].store(1, Ordering::SeqCst);
            state.policy_version.store(1, Ordering::SeqCst);
            metrics
                .policy_version
                .with_label_values(&[agent.as_str()])
                .set(1);
            info!(agent, dir = %dir.display(), "LoRA module loaded");
        }
        let mut engine_loop = EngineLoop::new(
            engine,
            id.to_string(),
            agents.clone(),
            config.max_batch_size,
            rx,
            state.clone(),
            metrics.clone(),
        )
        .with_threads(config.engine_threads.clone());
        if adapters {
            engine_loop = engine_loop.with_adapters(start_versions);
        }
        let thread = std::thread::Builder::new()
            .name(format!("engine-{}", agents[0]))
            .spawn(move || engine_loop.run())
            .map_err(|e| WorkerError::Internal(format!("cannot start the engine thread: {e}")))?;
        Ok(ModelSlot {
            id: id.to_string(),
            agents,
            tokenizer,
            chat_template,
            context_length: cfg.max_position_embeddings,
            vocab_size: cfg.vocab_size,
            parameter_count,
            params,
            kind: config.kind,
            device,
            tx,
            state,
            adapters,
            base,
            staging: Staging::default(),
            thread: Some(thread),
        })
    }

    /// This worker's random id (distinguishes restarts behind one address).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The worker's configuration.
    pub fn config(&self) -> &WorkerConfig {
        &self.config
    }

    /// The metrics it updates.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Agent names in the order they were configured.
    pub fn agent_names(&self) -> &[String] {
        &self.agent_order
    }

    /// Generate requests admitted and not answered.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }

    fn slot(&self, agent: &str) -> Result<&ModelSlot> {
        if self.agent_order.is_empty() {
            return Err(WorkerError::invalid(
                "agent",
                format!(
                    "this worker serves no agent, only the verifiers {:?} (start it with --agent NAME=MODEL to generate)",
                    self.verifier_names()
                ),
            ));
        }
        let known = || self.agent_order.join(", ");
        self.agents
            .get(agent)
            .map(|&i| &self.models[i])
            .ok_or_else(|| {
                WorkerError::invalid(
                    "agent",
                    format!("unknown agent `{agent}` (this worker serves: {})", known()),
                )
            })
    }

    /// The model serving `agent`.
    pub fn model_of(&self, agent: &str) -> Result<String> {
        Ok(self.slot(agent)?.id.clone())
    }

    /// The tokenizer of the model serving `agent`.
    pub fn tokenizer(&self, agent: &str) -> Result<&Tokenizer> {
        Ok(&self.slot(agent)?.tokenizer)
    }

    /// Context length of the model serving `agent`.
    pub fn context_length(&self, agent: &str) -> Result<usize> {
        Ok(self.slot(agent)?.context_length)
    }

    /// Whether `agent` is served as an unmerged adapter (`serve --adapters`).
    pub fn is_adapter(&self, agent: &str) -> bool {
        self.slot(agent)
            .is_ok_and(|s| s.adapter_id(agent).is_some())
    }

    /// The agent an OpenAI `model` names: an agent's own name, or `BASE:AGENT` for an agent
    /// served as an adapter on base model `BASE` (its model id, or the spec that id starts with
    /// when the worker holds several copies of it); anything else is returned as it is, for the
    /// usual unknown-agent error.
    pub fn resolve_agent(&self, model: &str) -> String {
        if self.agents.contains_key(model) {
            return model.to_string();
        }
        if let Some((base, agent)) = model.rsplit_once(':')
            && let Ok(slot) = self.slot(agent)
            && slot.adapter_id(agent).is_some()
            && (slot.id == base || slot.id.split('#').next() == Some(base))
        {
            return agent.to_string();
        }
        model.to_string()
    }

    /// The policy version of `agent`.
    pub fn policy_version(&self, agent: &str) -> Result<u64> {
        Ok(self.slot(agent)?.version_of(agent))
    }

    /// Parameter names and shapes of `agent`'s model, sorted by name.
    pub fn parameters(&self, agent: &str) -> Result<(String, Vec<ParameterShape>)> {
        let slot = self.slot(agent)?;
        let mut v: Vec<_> = slot
            .params
            .iter()
            .map(|(k, s)| (k.clone(), s.clone()))
            .collect();
        v.sort();
        Ok((slot.id.clone(), v))
    }

    /// Per model: agents, version, size and load.
    pub fn models(&self) -> Vec<ModelStatus> {
        self.models
            .iter()
            .map(|m| ModelStatus {
                id: m.id.clone(),
                agents: m.agents.clone(),
                policy_version: m.state.policy_version.load(Ordering::SeqCst),
                parameter_count: m.parameter_count,
                context_length: m.context_length,
                vocab_size: m.vocab_size,
                running_sequences: m.state.running_sequences.load(Ordering::SeqCst),
                queued_requests: m.state.queued_jobs.load(Ordering::SeqCst),
                pending_weight_updates: m.state.pending_updates.load(Ordering::SeqCst),
                unmerged_adapters: m.adapters,
            })
            .collect()
    }

    /// The token ids of every prompt of `job`, as generation encodes them, after the checks
    /// generation makes first (errors name the field as generation's do). A streamed answer reads
    /// them before the first token.
    pub fn encode_prompts(&self, job: &GenerateJob) -> Result<Vec<Vec<u32>>> {
        let slot = self.slot(&job.agent)?;
        self.validate(job)?;
        job.prompts
            .iter()
            .enumerate()
            .map(|(i, p)| self.encode(slot, p, &format!("prompts[{i}]")))
            .collect()
    }

    /// Renders and tokenises one prompt, checking it against the model. `field` names it in errors.
    fn encode(&self, slot: &ModelSlot, prompt: &PromptInput, field: &str) -> Result<Vec<u32>> {
        let ids = match prompt {
            PromptInput::Text(t) => {
                if t.is_empty() {
                    return Err(WorkerError::invalid(field, "empty prompt"));
                }
                slot.tokenizer
                    .encode(t, true)
                    .map_err(|e| WorkerError::invalid(field, e.to_string()))?
            }
            PromptInput::Chat(messages) => {
                if messages.is_empty() {
                    return Err(WorkerError::invalid(field, "no chat messages"));
                }
                let Some(template) = &slot.chat_template else {
                    return Err(WorkerError::invalid(
                        field,
                        format!("model `{}` has no chat template", slot.id),
                    ));
                };
                let text = template
                    .render(messages, true, &serde_json::Value::Null)
                    .map_err(|e| WorkerError::invalid(field, format!("chat template: {e}")))?;
                // The template writes any BOS it wants.
                slot.tokenizer
                    .encode(&text, false)
                    .map_err(|e| WorkerError::invalid(field, e.to_string()))?
            }
            PromptInput::Tokens(ids) => ids.clone(),
        };
        if ids.is_empty() {
            return Err(WorkerError::invalid(field, "empty prompt"));
        }
        if ids.len() >= slot.context_length {
            return Err(WorkerError::invalid(
                field,
                format!(
                    "prompt of {} tokens leaves no room in the model's context of {} tokens",
                    ids.len(),
                    slot.context_length
                ),
            ));
        }
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= slot.vocab_size) {
            return Err(WorkerError::invalid(
                field,
                format!(
                    "token id {bad} is outside the vocabulary of {}",
                    slot.vocab_size
                ),
            ));
        }
        Ok(ids)
    }

    fn validate(&self, job: &GenerateJob) -> Result<()> {
        let s = &job.sampling;
        if !(s.temperature.is_finite() && (0.0..=MAX_TEMPERATURE).contains(&s.temperature)) {
            return Err(WorkerError::invalid(
                "sampling.temperature",
                format!("{} is not in [0, {MAX_TEMPERATURE}]", s.temperature),
            ));
        }
        if !(s.top_p > 0.0 && s.top_p <= 1.0) {
            return Err(WorkerError::invalid(
                "sampling.top_p",
                format!("{} is not in (0, 1]", s.top_p),
            ));
        }
        if !(s.min_p >= 0.0 && s.min_p < 1.0) {
            return Err(WorkerError::invalid(
                "sampling.min_p",
                format!("{} is not in [0, 1)", s.min_p),
            ));
        }
        if job.stop.max_new_tokens == 0 {
            return Err(WorkerError::invalid(
                "sampling.max_new_tokens",
                "must be at least 1",
            ));
        }
        if job.n == 0 || job.n > self.config.max_batch_size {
            return Err(WorkerError::invalid(
                "n",
                format!(
                    "{} is not in [1, {}] (the batch size)",
                    job.n, self.config.max_batch_size
                ),
            ));
        }
        if job.prompts.is_empty() {
            return Err(WorkerError::invalid("prompts", "no prompts"));
        }
        if job.stop.stop_strings.iter().any(String::is_empty) {
            return Err(WorkerError::invalid(
                "stop.stop_strings",
                "empty stop string",
            ));
        }
        Ok(())
    }

    /// Samples `n` completions of every prompt of `job` on `job.agent`'s model. Dropping the
    /// returned future cancels the job's sequences.
    pub async fn generate(&self, job: GenerateJob) -> Result<GenerateOutput> {
        self.generate_streaming(job, None).await
    }

    /// [`Worker::generate`], sending each token to `stream` as the engine produces it (for
    /// server-sent events); the returned output is the same as without a stream.
    pub async fn generate_streaming(
        &self,
        job: GenerateJob,
        stream: Option<mpsc::UnboundedSender<StreamToken>>,
    ) -> Result<GenerateOutput> {
        let slot = self.slot(&job.agent)?;
        self.validate(&job)?;
        if let Some(&bad) = job
            .stop
            .stop_token_ids
            .iter()
            .find(|&&t| t as usize >= slot.vocab_size)
        {
            return Err(WorkerError::invalid(
                "stop.stop_token_ids",
                format!("token id {bad} is outside the vocabulary"),
            ));
        }
        let prompts: Vec<Vec<u32>> = job
            .prompts
            .iter()
            .enumerate()
            .map(|(i, p)| self.encode(slot, p, &format!("prompts[{i}]")))
            .collect::<Result<_>>()?;
        let rows = job.n * prompts.len();
        if rows > self.config.max_batch_size * 64 {
            return Err(WorkerError::invalid(
                "prompts",
                format!("{rows} sequences in one request is too many"),
            ));
        }
        if let Some(min) = job.min_policy_version {
            let current = slot.version_of(&job.agent);
            if current < min {
                return Err(WorkerError::StalePolicy {
                    agent: job.agent.clone(),
                    current,
                    required: min,
                });
            }
        }
        let _admitted = Admission::try_new(
            &self.in_flight,
            self.config.max_queued_requests,
            &self.metrics,
        )?;
        let requests: Vec<Request> = prompts
            .iter()
            .enumerate()
            .map(|(i, ids)| Request {
                prompt: ids.clone(),
                n: job.n,
                params: job.sampling,
                seed: prompt_seed(job.seed, i),
                stop: job.stop.clone(),
                logprobs: job.logprobs,
                top_logprobs: job.top_logprobs,
            })
            .collect();
        let id = self.next_job.fetch_add(1, Ordering::Relaxed);
        let (reply, rx) = oneshot::channel();
        slot.tx
            .send(Command::Submit {
                id,
                requests,
                adapter: slot.adapter_id(&job.agent),
                reply,
                stream,
            })
            .map_err(|_| WorkerError::Unavailable("engine loop stopped".into()))?;
        let cancel = CancelOnDrop {
            tx: &slot.tx,
            id,
            armed: true,
        };
        let out: JobOutput = rx
            .await
            .map_err(|_| WorkerError::Unavailable("engine loop stopped".into()))??;
        cancel.disarm();
        let completions = out
            .samples
            .into_iter()
            .zip(prompts)
            .map(|(samples, prompt_token_ids)| CompletionOutput {
                prompt_token_ids,
                samples: samples
                    .into_iter()
                    .map(|s| SampleOutput {
                        token_ids: s.token_ids,
                        text: s.text,
                        logprobs: s.logprobs,
                        top_logprobs: s.top_logprobs,
                        finish_reason: s.finish_reason,
                        policy_version: out.policy_version,
                    })
                    .collect(),
            })
            .collect();
        Ok(GenerateOutput {
            model: slot.id.clone(),
            completions,
        })
    }

    /// Parameter shapes, current version and staging buffers of `agent`'s model, to start
    /// assembling an update.
    pub fn update_target(&self, agent: &str) -> Result<(HashMap<String, Vec<i64>>, u64, Staging)> {
        let slot = self.slot(agent).map_err(|e| match e {
            WorkerError::InvalidArgument { message, .. } => {
                WorkerError::invalid("header.agent", message)
            }
            e => e,
        })?;
        Ok((
            slot.params.clone(),
            slot.version_of(agent),
            slot.staging.clone(),
        ))
    }

    /// Swaps in a validated update between decode steps (after the jobs in the engine finish on
    /// the old weights). Returns the model id, the new version and the agents it changed.
    ///
    /// An adapter update is merged per adapter: the worker holds one copy of the base per model
    /// slot for merging ([`BaseWeights`]), and the merged projections are swapped in like a
    /// partial update, so every parameter the adapter does not name keeps its current value.
    pub async fn apply_update(&self, update: CompleteUpdate) -> Result<(String, u64, Vec<String>)> {
        let slot = self.slot(&update.agent)?;
        let (kind, device) = (slot.kind, slot.device);
        let version = update.version;
        if let Some(id) = slot.adapter_id(&update.agent) {
            // An adapter slot keeps the adapter as sent (in the model's dtype) and serves it unmerged.
            let Some(scaling) = update.lora_scaling else {
                return Err(WorkerError::BadUpdate(format!(
                    "agent `{}` is served as a LoRA adapter on a shared base (serve --adapters): it takes adapter updates \
                     (header.lora_scaling > 0), not parameters",
                    update.agent
                )));
            };
            let agent = update.agent.clone();
            let tensors = tokio::task::spawn_blocking(move || update.into_tensors(kind, device))
                .await
                .map_err(|e| WorkerError::Internal(format!("tensor conversion panicked: {e}")))?;
            let (reply, rx) = oneshot::channel();
            slot.tx
                .send(Command::Update {
                    update: StagedUpdate {
                        version,
                        tensors,
                        keep: None,
                        adapter: Some((id, scaling)),
                    },
                    reply,
                })
                .map_err(|_| WorkerError::Unavailable("engine loop stopped".into()))?;
            let version = rx
                .await
                .map_err(|_| WorkerError::Unavailable("engine loop stopped".into()))??;
            return Ok((slot.id.clone(), version, vec![agent]));
        }
        // Conversion to the model's dtype and device (and any merge) happens here, off the engine
        // loop, so the loop pauses only for the copy into the parameters.
        // A plain update's tensors are the assembler's buffers (or their conversion): the slot keeps
        // them for the next update. A merged adapter's are not, they may share the base's storage.
        let keep = update.lora_scaling.is_none().then(|| slot.staging.clone());
        let tensors = match update.lora_scaling {
            None => tokio::task::spawn_blocking(move || update.into_tensors(kind, device))
                .await
                .map_err(|e| WorkerError::Internal(format!("tensor conversion panicked: {e}")))?,
            Some(scaling) => {
                let base = slot.base.clone();
                tokio::task::spawn_blocking(move || {
                    // f32 whatever the model's dtype: the merge computes in f32 and rounds once.
                    let adapter: BTreeMap<String, Tensor> = update
                        .into_tensors(Kind::Float, device)
                        .into_iter()
                        .collect();
                    base.merge(&adapter, scaling)
                })
                .await
                .map_err(|e| {
                    WorkerError::Internal(format!("merging the adapter panicked: {e}"))
                })??
            }
        };
        let (reply, rx) = oneshot::channel();
        slot.tx
            .send(Command::Update {
                update: StagedUpdate {
                    version,
                    tensors,
                    keep,
                    adapter: None,
                },
                reply,
            })
            .map_err(|_| WorkerError::Unavailable("engine loop stopped".into()))?;
        let version = rx
            .await
            .map_err(|_| WorkerError::Unavailable("engine loop stopped".into()))??;
        Ok((slot.id.clone(), version, slot.agents.clone()))
    }

    /// Stops every engine loop after its current jobs and waits for the threads.
    pub fn shutdown(mut self) {
        let threads: Vec<_> = self
            .models
            .iter_mut()
            .filter_map(|m| m.thread.take())
            .collect();
        drop(self);
        for t in threads {
            let _ = t.join();
        }
    }
}

/// Counts one admitted request; refuses beyond the bound.
struct Admission<'a> {
    count: &'a AtomicUsize,
    metrics: &'a Metrics,
}

impl<'a> Admission<'a> {
    fn try_new(count: &'a AtomicUsize, max: usize, metrics: &'a Metrics) -> Result<Self> {
        let prev = count.fetch_add(1, Ordering::SeqCst);
        if prev >= max {
            count.fetch_sub(1, Ordering::SeqCst);
            return Err(WorkerError::Overloaded { queued: prev, max });
        }
        metrics.in_flight_requests.set((prev + 1) as i64);
        Ok(Self { count, metrics })
    }
}

impl Drop for Admission<'_> {
    fn drop(&mut self) {
        let now = self.count.fetch_sub(1, Ordering::SeqCst) - 1;
        self.metrics.in_flight_requests.set(now as i64);
    }
}

/// Tells the engine loop to drop a job whose caller went away before the answer.
struct CancelOnDrop<'a> {
    tx: &'a mpsc::UnboundedSender<Command>,
    id: u64,
    armed: bool,
}

impl CancelOnDrop<'_> {
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for CancelOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.tx.send(Command::Cancel { id: self.id });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Agents that share one model copy cannot be placed on two devices; the others may be.
    #[test]
    fn a_model_copy_lives_on_its_agents_device() {
        let config = WorkerConfig {
            agents: vec![
                ("a".into(), "m".into()),
                ("b".into(), "m".into()),
                ("c".into(), "m".into()),
            ],
            share: vec![vec!["a".into(), "b".into()]],
            adapters: Vec::new(),
            device: Device::Cpu,
            agent_devices: vec![("b".into(), Device::Cuda(1)), ("c".into(), Device::Cuda(0))],
            kind: Kind::Float,
            max_batch_size: 1,
            max_queued_requests: 1,
            engine_threads: EngineThreads::Default,
            verifiers: Vec::new(),
            lora_modules: Vec::new(),
        };
        assert_eq!(config.device_for(&["c".into()]).unwrap(), Device::Cuda(0));
        let e = config
            .device_for(&["a".into(), "b".into()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("agents `a` and `b` share one model copy but are placed on Cpu and Cuda(1)"),
            "{e}"
        );
        let placed = WorkerConfig {
            agent_devices: vec![("a".into(), Device::Cuda(1)), ("b".into(), Device::Cuda(1))],
            ..config
        };
        assert_eq!(
            placed.device_for(&["a".into(), "b".into()]).unwrap(),
            Device::Cuda(1)
        );
    }

    #[test]
    fn first_prompt_keeps_the_seed_and_others_differ() {
        assert_eq!(prompt_seed(42, 0), 42);
        let seeds: std::collections::HashSet<u64> = (0..100).map(|i| prompt_seed(42, i)).collect();
        assert_eq!(seeds.len(), 100);
        assert_ne!(prompt_seed(42, 1), prompt_seed(43, 1));
    }
}
