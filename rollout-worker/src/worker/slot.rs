//! One loaded model: its engine loop on a thread of its own, what the worker keeps about it outside
//! that loop, and the pristine base weights that adapter updates are merged into.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use cotrain_model::chat_template::ChatTemplate;
use cotrain_model::engine::{Engine, EngineConfig};
use cotrain_model::loader::{self, LoadOptions};
use cotrain_model::tokenizer::Tokenizer;
use tch::{Device, Kind, Tensor};
use tokio::sync::mpsc;
use tracing::info;

use super::WorkerConfig;
use crate::batcher::{Command, EngineLoop, LoopState};
use crate::error::{Result, WorkerError};
use crate::metrics::Metrics;
use crate::weights::Staging;

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
    pub(super) thread: Option<std::thread::JoinHandle<()>>,
}

impl ModelSlot {
    /// `agent`'s adapter id in an adapter slot (its position), `None` elsewhere.
    pub(super) fn adapter_id(&self, agent: &str) -> Option<u32> {
        if !self.adapters {
            return None;
        }
        self.agents
            .iter()
            .position(|a| a == agent)
            .map(|i| i as u32)
    }

    /// The policy version serving `agent`: its own in an adapter slot, the model's elsewhere.
    pub(super) fn version_of(&self, agent: &str) -> u64 {
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
    pub(super) fn new(spec: &str, opts: LoadOptions) -> Self {
        Self {
            spec: spec.to_string(),
            opts,
            weights: Mutex::new(None),
        }
    }

    /// `W0 + scaling·B·A` for every pair of `adapter`, by base parameter name, in the model's dtype
    /// and on its device; loads the base first if needed. Blocking: call it off the async runtime.
    pub(super) fn merge(
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

/// The base weights for adapter merges of the model at `spec`, one copy per file: slots that
/// hold separate copies of the same model (`--separate-weights`, one per MaPoRL adapter key)
/// merge into the same pristine base instead of each loading their own.
pub(super) fn shared_base(
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
pub(super) fn start_model(
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
            ChatTemplate::new(t.source().to_string(), t.bos_token(), t.eos_token())
                .map_err(|e| WorkerError::Internal(format!("chat template of `{spec}`: {e}")))?,
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
            decode_threads: config.decode_threads,
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

/// A model served by a vLLM engine (`serve --engine vllm`): the worker loads it only to read its
/// tokenizer, chat template and parameter shapes (and to write a Hugging Face directory when the
/// spec is a GGUF file or the embedded default), then hands generation to the engine. An adapter
/// group (`adapters`) is one engine serving each agent as a LoRA adapter of the base.
#[allow(clippy::too_many_arguments)]
pub(super) fn start_vllm_model(
    spec: &str,
    id: &str,
    agents: Vec<String>,
    adapters: bool,
    device: Device,
    config: &WorkerConfig,
    options: &crate::vllm::VllmOptions,
    metrics: &Metrics,
    base: Arc<BaseWeights>,
) -> Result<ModelSlot> {
    let started = std::time::Instant::now();
    // On the CPU, in the worker's dtype: the weights are dropped once the directory exists.
    let opts = LoadOptions {
        device: Device::Cpu,
        kind: config.kind,
    };
    let loaded = loader::load(spec, &opts)?;
    let cfg = loaded.model.config().clone();
    let named = loaded.named_parameters();
    let params: HashMap<String, Vec<i64>> =
        named.iter().map(|(k, t)| (k.clone(), t.size())).collect();
    let parameter_count = named.values().map(|t| t.numel() as u64).sum();
    drop(named);
    let chat_template = match &loaded.chat_template {
        Some(t) => Some(
            ChatTemplate::new(t.source().to_string(), t.bos_token(), t.eos_token())
                .map_err(|e| WorkerError::Internal(format!("chat template of `{spec}`: {e}")))?,
        ),
        None => None,
    };
    let tokenizer = loaded.tokenizer.clone();
    let model_dir = crate::vllm::model_dir(spec, &loaded)?;
    drop(loaded);
    let mut launch = crate::vllm::LaunchSpec::new(
        options,
        model_dir,
        config.kind,
        device,
        &cfg,
        config.max_batch_size,
    )?;
    if adapters {
        launch = launch.with_adapters(agents.len());
    }
    let context_length = launch.max_model_len;
    let (tx, rx) = mpsc::unbounded_channel();
    let state = Arc::new(if adapters {
        LoopState::for_adapters(agents.len())
    } else {
        LoopState::default()
    });
    // `--lora-module` adapters of this group's agents, by adapter id.
    let lora_modules: Vec<(u32, std::path::PathBuf)> = config
        .lora_modules
        .iter()
        .filter_map(|(agent, dir)| {
            agents
                .iter()
                .position(|a| a == agent)
                .filter(|_| adapters)
                .map(|id| (id as u32, dir.clone()))
        })
        .collect();
    for a in &agents {
        metrics
            .policy_version
            .with_label_values(&[a.as_str()])
            .set(0);
    }
    let thread = crate::vllm::engine_loop::VllmLoop::start(
        launch,
        id.to_string(),
        agents.clone(),
        cfg.clone(),
        rx,
        state.clone(),
        metrics.clone(),
        lora_modules,
    )?;
    info!(
        model = id,
        ?agents,
        parameters = parameter_count,
        engine = "vllm",
        start_ms = started.elapsed().as_millis() as u64,
        "model loaded"
    );
    Ok(ModelSlot {
        id: id.to_string(),
        agents,
        tokenizer,
        chat_template,
        context_length,
        vocab_size: cfg.vocab_size,
        parameter_count,
        params,
        kind: config.kind,
        // Updates are staged in host memory: the engine reads them from a file.
        device: Device::Cpu,
        tx,
        state,
        adapters,
        base,
        staging: Staging::default(),
        thread: Some(thread),
    })
}
