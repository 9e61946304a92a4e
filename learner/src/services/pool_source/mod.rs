//! Rollout workers over gRPC through the client pool of `cotrain-rollout-worker`.
//!
//! Weights go to the workers as gRPC chunks or, for workers on this host that accept it, through
//! one file in /dev/shm per push (`rollout.weight_transport`, see [`WeightTransport`]). A LoRA
//! adapter ([`RolloutSource::push_adapter`]) takes the same paths, as a partial update whose header
//! carries its scaling; the workers merge it into their base weights. The pushes live in `push`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use cotrain_proto::rollout::{self as pb, GenerateRequest, Prompt, prompt::Kind as PromptKind};
use cotrain_rollout_client::pool::{PoolConfig, RolloutPool};
use cotrain_rollout_client::shm::ShmFile;
use cotrain_rollout_client::wire::WireDType;
use tch::Tensor;
use tokio::runtime::Runtime;
use tracing::info;

use crate::config::{WeightDtype, WeightTransport};
use crate::error::TrainError;
use crate::sources::{GenRequest, GenSample, RolloutSource, WeightPush};
use crate::sources::{PoolStats, PushStats};

mod push;

/// See the module docs.
pub struct PoolRollout {
    rt: Arc<Runtime>,
    pool: Arc<RolloutPool>,
    label: String,
    version_timeout: Duration,
    next_request: u64,
    transport: WeightTransport,
    /// Set once `auto` saw the shared-memory transport fail: gRPC from then on.
    shm_failed: bool,
    /// One shared-memory file per agent, overwritten by each push (allocating and freeing 0.5 GB
    /// of tmpfs every step cost 0.2–0.9 s per agent, depending on the kernel's free memory after a
    /// training step). Deleted when this is dropped, or after a failed push.
    shm_files: HashMap<String, ShmFile>,
    /// Pushes that went through shared memory.
    shm_pushes: u64,
    /// The element type weights travel in (`rollout.weight_dtype`).
    wire: WireDType,
    last_push: Option<PushStats>,
    /// Each agent's probe of the weights being pushed (`WeightPush::probe`), for its headers.
    probes: HashMap<String, pb::WeightProbe>,
}

impl PoolRollout {
    /// [`RolloutSource::push_adapter`] with whatever probe `push_weights_all` stored for the agent.
    fn push_adapter_with_probe(
        &mut self,
        agent: &str,
        version: u64,
        adapter: &BTreeMap<String, Tensor>,
        scaling: f64,
    ) -> Result<(), TrainError> {
        // 0 would make the header an ordinary update; the workers refuse NaN, ∞ and negatives.
        if scaling == 0.0 {
            return Err(TrainError::Rollout(format!(
                "adapter update of `{agent}` to v{version}: lora scaling is 0"
            )));
        }
        self.push(agent, version, adapter, Some(scaling))
    }

    /// Connects to `endpoints` and/or `dns_names` and waits (up to `wait`) for one worker in rotation.
    pub fn connect(
        rt: Arc<Runtime>,
        endpoints: Vec<String>,
        dns_names: Vec<String>,
        request_timeout: Duration,
        max_attempts: usize,
        refresh: Duration,
        wait: Duration,
    ) -> Result<Self, TrainError> {
        let cfg = PoolConfig {
            endpoints,
            dns_names,
            refresh_interval: refresh,
            request_timeout: Some(request_timeout),
            max_attempts: max_attempts.max(1),
            wait_for_worker: wait,
            cluster_token: Some(super::process_token()),
            ..PoolConfig::default()
        };
        Self::connect_with(rt, cfg, None, 1, wait)
    }

    /// As [`Self::connect`] from a pool config; with `control`, workers that register with the
    /// learner's control plane join the pool (which may then start empty), and the connection
    /// waits up to `wait` for `min_workers` workers in rotation, saying what it waits for.
    pub fn connect_with(
        rt: Arc<Runtime>,
        cfg: PoolConfig,
        control: Option<(&crate::control::ControlState, String)>,
        min_workers: usize,
        wait: Duration,
    ) -> Result<Self, TrainError> {
        let label = format!(
            "rollout pool {:?}",
            cfg.endpoints
                .iter()
                .chain(&cfg.dns_names)
                .collect::<Vec<_>>()
        );
        let pool = rt.block_on(async {
            let pool = Arc::new(RolloutPool::new(cfg).await?);
            if let Some((state, _)) = &control {
                state.attach_pool(pool.clone()).await;
            }
            let started = std::time::Instant::now();
            loop {
                let chunk = wait.saturating_sub(started.elapsed()).min(Duration::from_secs(10));
                match pool.wait_for_healthy(min_workers, chunk).await {
                    Ok(()) => break,
                    Err(_) if started.elapsed() >= wait => {
                        let serving = pool.workers().iter().filter(|w| w.in_rotation).count();
                        return Err(cotrain_rollout_client::PoolError::Config(format!(
                            "{serving} of the {min_workers} rollout workers needed are in rotation after {wait:?}"
                        )));
                    }
                    Err(_) => {
                        let serving = pool.workers().iter().filter(|w| w.in_rotation).count();
                        match &control {
                            Some((_, addr)) => info!(
                                "waiting for rollout workers: {serving} of {min_workers} in rotation; start them with \
                                 `rollout-worker serve --register http://{addr} ...` ({:.0} s left)",
                                wait.saturating_sub(started.elapsed()).as_secs_f64()
                            ),
                            None => info!("waiting for rollout workers: {serving} of {min_workers} in rotation"),
                        }
                    }
                }
            }
            Ok::<_, cotrain_rollout_client::pool::PoolError>(pool)
        });
        let pool = pool.map_err(|e| TrainError::Rollout(format!("{label}: {e}")))?;
        Ok(Self {
            rt,
            pool,
            label,
            version_timeout: Duration::from_secs(120),
            next_request: 0,
            transport: WeightTransport::Auto,
            shm_failed: false,
            shm_files: HashMap::new(),
            shm_pushes: 0,
            wire: WireDType::F32,
            last_push: None,
            probes: HashMap::new(),
        })
    }

    /// Chooses how weights reach the workers (`rollout.weight_transport`; `auto` by default).
    pub fn with_weight_transport(mut self, transport: WeightTransport) -> Self {
        self.transport = transport;
        self
    }

    /// Chooses the element type of pushed weights (`rollout.weight_dtype`; f32 by default).
    pub fn with_weight_dtype(mut self, dtype: WeightDtype) -> Self {
        self.wire = match dtype {
            WeightDtype::F32 => WireDType::F32,
            WeightDtype::Bf16 => WireDType::Bf16,
        };
        self
    }

    /// How many pushes went through shared memory (the rest went as gRPC chunks).
    pub fn shm_pushes(&self) -> u64 {
        self.shm_pushes
    }

    pub fn pool(&self) -> &Arc<RolloutPool> {
        &self.pool
    }

    /// Refuses workers that serve two of the learner's separately trained policies (`worker_agents`)
    /// from one shared model: each weight push would overwrite the other policy, and the worker
    /// rejects the second push of a version. Checked on the workers healthy at start.
    pub fn check_separate_models(&self, worker_agents: &[String]) -> Result<(), TrainError> {
        for (addr, info) in self.rt.block_on(self.pool.info_all()) {
            let info = info.map_err(|s| {
                TrainError::Rollout(format!("{addr}: Info failed: {}", s.message()))
            })?;
            // An adapter group's agents each have their own adapter and version.
            for model in info.models.iter().filter(|m| !m.unmerged_adapters) {
                let trained: Vec<&String> = model
                    .agents
                    .iter()
                    .filter(|a| worker_agents.contains(a))
                    .collect();
                if trained.len() > 1 {
                    return Err(TrainError::Rollout(format!(
                        "rollout worker {addr} serves agents {trained:?} from one shared copy of `{}`, but the learner \
                         trains them as separate policies: start the worker without --share for them \
                         (or train with shared_parameters: true)",
                        model.id
                    )));
                }
            }
        }
        Ok(())
    }
}

impl RolloutSource for PoolRollout {
    fn max_samples_per_request(&mut self, agent: &str) -> Option<usize> {
        let infos = self.rt.block_on(self.pool.info_all());
        infos
            .iter()
            .filter_map(|(_, info)| info.as_ref().ok())
            .flat_map(|info| {
                info.models
                    .iter()
                    .filter(|m| m.agents.iter().any(|a| a == agent))
                    .map(|m| m.max_batch_size as usize)
            })
            .filter(|&m| m > 0)
            .min()
    }

    fn generate(&mut self, requests: &[GenRequest]) -> Result<Vec<Vec<GenSample>>, TrainError> {
        let base = self.next_request;
        self.next_request += requests.len() as u64;
        let calls = requests.iter().enumerate().map(|(i, r)| {
            let req = GenerateRequest {
                agent: r.agent.clone(),
                prompts: vec![Prompt {
                    kind: Some(PromptKind::TokenIds(pb::TokenIds {
                        ids: r.prompt.clone(),
                    })),
                }],
                n: r.n as u32,
                sampling: Some(pb::SamplingParams {
                    temperature: Some(r.sampling.temperature as f32),
                    top_p: Some(r.sampling.top_p as f32),
                    top_k: r.sampling.top_k,
                    max_new_tokens: r.sampling.max_new_tokens as u32,
                    min_p: None,
                    sampling_logprobs: r.sampling.sampling_logprobs,
                }),
                seed: r.seed,
                stop: (r.sampling.ignore_eos || !r.sampling.stop.is_empty()).then(|| {
                    pb::StopConditions {
                        ignore_eos: r.sampling.ignore_eos,
                        stop_strings: r.sampling.stop.clone(),
                        ..Default::default()
                    }
                }),
                min_policy_version: Some(r.min_policy_version),
                request_id: format!("learner-{}-{}", std::process::id(), base + i as u64),
            };
            self.pool.generate(req)
        });
        let results = self.rt.block_on(futures::future::join_all(calls));
        results
            .into_iter()
            .zip(requests)
            .map(|(res, r)| {
                let resp =
                    res.map_err(|e| TrainError::Rollout(format!("agent `{}`: {e}", r.agent)))?;
                let completion = resp.completions.into_iter().next().ok_or_else(|| {
                    TrainError::Rollout(format!("agent `{}`: empty generate response", r.agent))
                })?;
                Ok(completion
                    .samples
                    .into_iter()
                    .map(|s| GenSample {
                        stopped: s.finish_reason == pb::FinishReason::Stop as i32,
                        token_ids: s.token_ids,
                        text: s.text,
                        logprobs: s.logprobs,
                        policy_version: s.policy_version,
                    })
                    .collect())
            })
            .collect()
    }

    fn score_verifier(
        &mut self,
        name: &str,
        conversations: &[(String, String)],
    ) -> Result<Vec<f32>, TrainError> {
        let req = pb::ScoreVerifierRequest {
            verifier: name.to_string(),
            conversations: conversations
                .iter()
                .map(|(user, assistant)| pb::Conversation {
                    user: user.clone(),
                    assistant: assistant.clone(),
                })
                .collect(),
        };
        let resp = self
            .rt
            .block_on(self.pool.score_verifier(req))
            .map_err(|e| TrainError::Rollout(format!("verifier `{name}`: {e}")))?;
        if resp.scores.len() != conversations.len() {
            return Err(TrainError::Rollout(format!(
                "verifier `{name}`: {} scores for {} conversations",
                resp.scores.len(),
                conversations.len()
            )));
        }
        Ok(resp.scores)
    }

    fn policy_version(&mut self, agent: &str) -> Result<u64, TrainError> {
        let infos = self.rt.block_on(self.pool.info_all());
        let mut best = 0;
        for (_, info) in infos {
            if let Ok(info) = info
                && let Some(a) = info.agents.iter().find(|a| a.name == agent)
            {
                best = best.max(a.policy_version);
            }
        }
        Ok(best)
    }

    fn push_weights(
        &mut self,
        agent: &str,
        version: u64,
        params: &BTreeMap<String, Tensor>,
    ) -> Result<(), TrainError> {
        // A push without a probe: a probe of earlier weights must not go with it.
        self.probes.remove(agent);
        self.push(agent, version, params, None)
    }

    /// Several agents through shared memory at the same time (see `push_all_shm`); over gRPC, or
    /// for one agent, one push after another.
    fn push_weights_all(&mut self, updates: &[WeightPush<'_>]) -> Result<(), TrainError> {
        let started = std::time::Instant::now();
        for u in updates {
            match u.probe {
                Some(p) => self.probes.insert(u.agent.to_string(), p.clone()),
                None => self.probes.remove(u.agent),
            };
        }
        let distinct = updates
            .iter()
            .map(|u| u.agent)
            .collect::<HashSet<_>>()
            .len()
            == updates.len();
        let adapters = updates.iter().any(|u| u.lora_scaling.is_some());
        if updates.len() > 1 && distinct && !adapters && self.shm_transport() {
            self.push_all_shm(updates)?;
        } else {
            // Adapters are small: one after another, each by the path `push` picks.
            for u in updates {
                match u.lora_scaling {
                    Some(scaling) => {
                        self.push_adapter_with_probe(u.agent, u.version, u.params, scaling)?
                    }
                    None => self.push(u.agent, u.version, u.params, None)?,
                }
            }
        }
        let bytes: u64 = updates
            .iter()
            .flat_map(|u| u.params.values())
            .map(|t| (t.numel() * self.wire.size()) as u64)
            .sum();
        let workers = self.pool.workers().iter().filter(|w| w.healthy).count();
        self.last_push = Some(PushStats {
            bytes,
            workers,
            secs: started.elapsed().as_secs_f64(),
        });
        Ok(())
    }

    fn push_adapter(
        &mut self,
        agent: &str,
        version: u64,
        adapter: &BTreeMap<String, Tensor>,
        scaling: f64,
    ) -> Result<(), TrainError> {
        // A push without a probe: a probe of earlier weights must not go with it.
        self.probes.remove(agent);
        self.push_adapter_with_probe(agent, version, adapter, scaling)
    }

    fn describe(&self) -> String {
        self.label.clone()
    }

    fn last_push(&self) -> Option<PushStats> {
        self.last_push
    }

    fn pool_stats(&self) -> Option<PoolStats> {
        let workers = self.pool.workers();
        Some(PoolStats {
            workers: workers.len(),
            in_rotation: workers.iter().filter(|w| w.in_rotation).count(),
            failed_attempts: self.pool.failed_attempts(),
            catch_ups: self.pool.catch_ups(),
        })
    }
}
