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
//!
//! Files: `config` (how to build a worker), `job` (requests and answers), `slot` (one loaded model
//! and its engine thread), `requests` (generate), `updates` (weight updates); this file starts the
//! models and answers what the worker serves.

mod config;
mod job;
mod requests;
mod slot;
mod updates;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use cotrain_model::loader::LoadOptions;
use cotrain_model::tokenizer::Tokenizer;
use tch::Device;

pub use crate::batcher::{EngineThreads, StreamToken};
use crate::error::{Result, WorkerError};
use crate::metrics::Metrics;
pub use crate::seeds::prompt_seed;
pub use config::{EngineKind, MAX_TEMPERATURE, WorkerConfig};
pub use job::{
    CompletionOutput, GenerateJob, GenerateOutput, ModelStatus, ParameterShape, PromptInput,
    SampleOutput,
};
use slot::{BaseWeights, ModelSlot};

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
            // A vLLM slot merges adapters on the host (the engine holds the GPU's memory).
            let merge_device = match config.engine {
                EngineKind::Cotrain => device,
                EngineKind::Vllm(_) => Device::Cpu,
            };
            let base = slot::shared_base(&mut bases, spec, merge_device, &config);
            let slot = match &config.engine {
                EngineKind::Cotrain => slot::start_model(
                    spec,
                    &id,
                    names.clone(),
                    *adapters,
                    device,
                    &config,
                    &metrics,
                    base,
                )?,
                EngineKind::Vllm(options) => slot::start_vllm_model(
                    spec,
                    &id,
                    names.clone(),
                    *adapters,
                    device,
                    &config,
                    options,
                    &metrics,
                    base,
                )?,
            };
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
