//! Services started inside the learner's process (the embedded default: no `reward.endpoint`, no
//! `rollout.endpoints`): they bind loopback ephemeral ports and are used over the same gRPC as
//! remote ones, so the embedded default exercises the real protocol.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use cotrain_reward_server::config::{Overrides, ServerConfig};
use tokio::runtime::Runtime;
use tokio::sync::oneshot;
use tracing::warn;

use crate::error::TrainError;

/// A reward server running on this process's runtime; stopped when dropped.
pub struct EmbeddedReward {
    /// Its gRPC address.
    pub grpc: SocketAddr,
    /// Its HTTP address.
    pub http: SocketAddr,
    shutdown: Option<oneshot::Sender<()>>,
    rt: Arc<Runtime>,
    task: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl EmbeddedReward {
    /// Starts the reward server (strict sandbox, as the binary's default) on 127.0.0.1:0.
    pub fn start(rt: Arc<Runtime>) -> Result<Self, TrainError> {
        let loopback: SocketAddr = "127.0.0.1:0".parse().expect("valid address");
        let cfg = ServerConfig::resolve(
            None,
            Overrides {
                grpc_addr: Some(loopback),
                http_addr: Some(loopback),
                ..Overrides::default()
            },
        )
        .map_err(|e| TrainError::Reward(format!("embedded reward server: {e}")))?;
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let (bound_tx, bound_rx) = oneshot::channel();
        let task = rt.spawn(async move {
            cotrain_reward_server::server::serve(
                cfg,
                async move {
                    let _ = stop_rx.await;
                },
                move |b| {
                    let _ = bound_tx.send(b);
                },
            )
            .await
        });
        match rt.block_on(async { tokio::time::timeout(Duration::from_secs(60), bound_rx).await }) {
            Ok(Ok(b)) => Ok(Self {
                grpc: b.grpc,
                http: b.http,
                shutdown: Some(stop_tx),
                rt,
                task: Some(task),
            }),
            _ => {
                // It never bound: its error says why (no working sandbox, ...).
                let why = match rt.block_on(task) {
                    Ok(Err(e)) => format!("{e:#}"),
                    Ok(Ok(())) => "it stopped before binding".into(),
                    Err(e) => e.to_string(),
                };
                Err(TrainError::Reward(format!(
                    "the embedded reward server did not start: {why}"
                )))
            }
        }
    }
}

impl Drop for EmbeddedReward {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            let rt = self.rt.clone();
            match rt.block_on(async { tokio::time::timeout(Duration::from_secs(10), task).await }) {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(e))) => {
                    warn!(error = %format!("{e:#}"), "embedded reward server stopped with an error")
                }
                _ => warn!("embedded reward server did not stop within 10 s"),
            }
        }
    }
}

/// A rollout worker running on this process's runtime (the real gRPC service of
/// `cotrain-rollout-worker`); stopped when dropped.
pub struct EmbeddedRollout {
    /// Its gRPC address.
    pub grpc: SocketAddr,
    server: Option<cotrain_rollout_worker::server::RunningServer>,
    rt: Arc<Runtime>,
}

impl EmbeddedRollout {
    /// Starts a worker serving `agents` (`(name, model spec)`, one model copy per agent) on
    /// 127.0.0.1:0.
    pub fn start(
        rt: Arc<Runtime>,
        agents: &[(String, String)],
        device: tch::Device,
        kind: tch::Kind,
    ) -> Result<Self, TrainError> {
        Self::start_with_verifiers(rt, agents, device, kind, Vec::new())
    }

    /// As [`EmbeddedRollout::start`], also serving learned verifiers (`(name, directory)`).
    pub fn start_with_verifiers(
        rt: Arc<Runtime>,
        agents: &[(String, String)],
        device: tch::Device,
        kind: tch::Kind,
        verifiers: Vec<(String, std::path::PathBuf)>,
    ) -> Result<Self, TrainError> {
        Self::start_full(
            rt,
            agents,
            device,
            kind,
            verifiers,
            Vec::new(),
            crate::config::RolloutEngine::Cotrain,
        )
    }

    /// As [`EmbeddedRollout::start_with_verifiers`], serving each group of `adapter_groups` as
    /// unmerged adapters on one base (`rollout-worker serve --adapters`).
    pub fn start_full(
        rt: Arc<Runtime>,
        agents: &[(String, String)],
        device: tch::Device,
        kind: tch::Kind,
        verifiers: Vec<(String, std::path::PathBuf)>,
        adapter_groups: Vec<Vec<String>>,
        engine: crate::config::RolloutEngine,
    ) -> Result<Self, TrainError> {
        let engine = embedded_engine(engine)?;
        let agents = agents.to_vec();
        // The agents' engines (one per agent: no sharing) may decode at the same time: on the CPU,
        // each gets an even, fixed share of the cores. Not `EngineThreads::Shared` (the cores of
        // the engines busy at each step): its counts follow timing, the products' sums follow the
        // counts, and a seeded run then did not repeat (a MaPoRL test learned in one run of two).
        // An adapter group is one engine.
        let engines = agents.len()
            - adapter_groups
                .iter()
                .map(|g| g.len().saturating_sub(1))
                .sum::<usize>();
        let engine_threads = if device == tch::Device::Cpu && engines > 1 {
            cotrain_rollout_worker::worker::EngineThreads::Fixed(
                (tch::get_num_threads().max(1) as usize / engines).max(1),
            )
        } else {
            cotrain_rollout_worker::worker::EngineThreads::Default
        };
        let config = cotrain_rollout_worker::worker::WorkerConfig {
            agents,
            // One model copy per policy: the learner trains each separately.
            share: Vec::new(),
            adapters: adapter_groups,
            device,
            kind,
            max_batch_size: 64,
            max_queued_requests: 1024,
            engine_threads,
            // Adaptive: the learner's own work shares these cores; the samples do not depend on it.
            decode_threads: cotrain_model::engine::DecodeThreads::Adaptive,
            verifiers,
            lora_modules: Vec::new(),
            engine,
            agent_devices: Vec::new(),
        };
        let loopback: SocketAddr = "127.0.0.1:0".parse().expect("valid address");
        // Same process, same host: the learner may hand weights over through /dev/shm.
        let options = cotrain_rollout_worker::server::ServeOptions {
            allow_shm_weights: true,
            cluster_token: Some(super::process_token()),
            tls: None,
            insecure: false,
        };
        let server = rt
            .block_on(cotrain_rollout_worker::server::start_with(
                config, loopback, loopback, options,
            ))
            .map_err(|e| {
                TrainError::Rollout(format!("the embedded rollout worker did not start: {e:#}"))
            })?;
        Ok(Self {
            grpc: server.grpc_addr,
            server: Some(server),
            rt,
        })
    }
}

impl Drop for EmbeddedRollout {
    fn drop(&mut self) {
        if let Some(server) = self.server.take()
            && let Err(e) = self.rt.block_on(server.shutdown())
        {
            warn!(error = %format!("{e:#}"), "embedded rollout worker stopped with an error");
        }
    }
}

/// The embedded worker's engine for `rollout.engine`: vLLM with the defaults of `rollout-worker
/// serve --engine vllm`, from the interpreter `make setup` recorded (or COTRAIN_VLLM_PYTHON).
fn embedded_engine(
    engine: crate::config::RolloutEngine,
) -> Result<cotrain_rollout_worker::worker::EngineKind, TrainError> {
    use cotrain_rollout_worker::vllm;
    match engine {
        crate::config::RolloutEngine::Cotrain => {
            Ok(cotrain_rollout_worker::worker::EngineKind::Cotrain)
        }
        crate::config::RolloutEngine::Vllm => {
            let (python, _) = vllm::VllmOptions::discover(None)
                .map_err(|e| TrainError::Config(format!("rollout.engine: vllm: {e}")))?;
            Ok(cotrain_rollout_worker::worker::EngineKind::Vllm(
                vllm::VllmOptions::defaults(python),
            ))
        }
    }
}
