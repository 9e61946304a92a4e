//! Connecting a run to its services: the reward server and the rollout workers a config names, or
//! the embedded ones (started in this process on loopback), the control plane, and the worker pool;
//! with several ranks, rank 0 connects and hands the endpoints to the others.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tracing::info;

use crate::config::CheckedConfig;
use crate::error::TrainError;
use crate::model_options::{load_options, rollout_kind};
use crate::services::{
    self, GrpcReward, PoolRollout,
    embedded::{EmbeddedReward, EmbeddedRollout},
};
use crate::sources::{RewardSource, RolloutSource};

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

/// The services a config names, or the embedded default: a reward server and a rollout worker in
/// this process on loopback ports, used over gRPC. `agents` are the (worker agent, model spec) pairs
/// the learner trains; each must have weights of its own on the workers.
pub fn connect_services(
    cfg: &CheckedConfig,
    agents: &[(String, String)],
) -> Result<Services, TrainError> {
    let runtime = services::runtime().map_err(|e| TrainError::Io(format!("tokio runtime: {e}")))?;
    let r = &cfg.raw.reward;
    let (reward, embedded_reward): (Box<dyn RewardSource>, _) = match &r.endpoint {
        Some(ep) => (
            Box::new(
                GrpcReward::connect(
                    runtime.clone(),
                    ep,
                    Duration::from_secs(r.request_timeout_secs),
                    services::client_tls().as_ref(),
                )?
                .with_options(&cfg.score_options)
                .with_retries(r.max_retries)
                .with_outage_timeout(Duration::from_secs_f64(r.outage_timeout)),
            ),
            None,
        ),
        None => {
            let server = EmbeddedReward::start(runtime.clone())?;
            info!(grpc = %server.grpc, http = %server.http, "embedded reward server started");
            let client = GrpcReward::connect(
                runtime.clone(),
                &server.grpc.to_string(),
                Duration::from_secs(r.request_timeout_secs),
                None,
            )?
            .with_options(&cfg.score_options)
            .with_retries(r.max_retries);
            (Box::new(client), Some(server))
        }
    };
    let ro = &cfg.raw.rollout;
    // The control plane (rank 0 of a `learner train` that installed it): registered workers join
    // the pool, operators ask for status, checkpoints and stops.
    let control = match (crate::control::current(), &cfg.raw.learner.control_addr) {
        (Some(state), Some(addr)) => {
            let addr: std::net::SocketAddr = addr.parse().map_err(|_| {
                TrainError::Config(format!("learner.control_addr: `{addr}` is not IP:PORT"))
            })?;
            let server = runtime
                .block_on(crate::control::ControlServer::start(
                    addr,
                    state.clone(),
                    services::cluster_token(),
                    services::server_tls(),
                ))
                .map_err(|e| TrainError::Io(format!("learner.control_addr {addr}: {e}")))?;
            println!("control plane listening on {}", server.addr);
            Some((state, server))
        }
        _ => None,
    };
    let registration = control
        .as_ref()
        .map(|(state, server)| (state.as_ref(), server.addr.to_string()));
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
        PoolRollout::connect_with(
            runtime.clone(),
            pool_cfg,
            registration.clone(),
            min_workers,
            wait,
        )
        .map(|p| {
            p.with_weight_transport(ro.weight_transport)
                .with_weight_dtype(ro.weight_dtype)
        })
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
            .map(|dir| {
                vec![(
                    super::EMBEDDED_VERIFIER.to_string(),
                    std::path::PathBuf::from(dir),
                )]
            })
            .unwrap_or_default();
        if ro.bf16_dot_products {
            cotrain_model::kernels::gemm_bf16dot::enable_for(
                rollout_kind(cfg),
                opts.device,
                "rollout.bf16_dot_products",
            )
            .map_err(TrainError::Config)?;
        }
        // A training run's LoRA agents, of those this worker serves: other commands on the same
        // config (`verifier generate`, evaluation) start other agents.
        let adapter_groups: Vec<Vec<String>> = match ro.lora_serving {
            crate::config::LoraServing::Merged => Vec::new(),
            crate::config::LoraServing::Unmerged => crate::model_options::adapter_groups(cfg)
                .into_iter()
                .map(|g| {
                    g.into_iter()
                        .filter(|name| agents.iter().any(|(a, _)| a == name))
                        .collect::<Vec<_>>()
                })
                .filter(|g| !g.is_empty())
                .collect(),
        };
        if ro.engine == crate::config::RolloutEngine::Vllm && opts.device != tch::Device::Cpu {
            return Err(TrainError::Config(format!(
                "rollout.engine: vllm with the learner on {:?}: a vLLM engine beside the learner on one GPU needs \
                 colocation (sleep during the update), which is not built; start vLLM workers on their own GPUs \
                 (`rollout-worker serve --engine vllm --device cuda:N`) and give them as rollout.endpoints",
                opts.device
            )));
        }
        let worker = EmbeddedRollout::start_full(
            runtime.clone(),
            agents,
            opts.device,
            rollout_kind(cfg),
            verifiers,
            adapter_groups,
            ro.engine,
        )?;
        info!(grpc = %worker.grpc, "embedded rollout worker started");
        (
            Box::new(pool(
                vec![format!("http://{}", worker.grpc)],
                Vec::new(),
                1,
                Duration::from_secs(120),
                None,
                Some(services::process_token()),
            )?),
            Some(worker),
        )
    } else {
        if ro.bf16_dot_products {
            return Err(TrainError::Config(
                "rollout.bf16_dot_products applies to the embedded worker, and this config has remote workers only; \
                 start them with `rollout-worker serve --dtype bf16 --bf16-dot-products` instead"
                    .into(),
            ));
        }
        let (min, wait) = if ro.wait_for_registration {
            (
                ro.min_workers,
                Duration::from_secs(ro.registration_timeout_secs),
            )
        } else {
            (1, Duration::from_secs(120))
        };
        let remote = pool(
            ro.endpoints.clone(),
            ro.dns_name.iter().cloned().collect(),
            min,
            wait,
            services::client_tls(),
            services::cluster_token(),
        )?;
        remote.check_separate_models(&agents.iter().map(|(a, _)| a.clone()).collect::<Vec<_>>())?;
        (Box::new(remote), None)
    };
    let control = control.map(|(_, server)| server);
    Ok(Services {
        rollout,
        reward,
        guard: ServiceGuard {
            control,
            embedded_reward,
            embedded_rollout,
            runtime,
        },
    })
}

/// The run directory of a job: rank 0's (a run name made of the start time differs between ranks).
/// Rank 0 connects to the services (starting the embedded ones); the other ranks connect to the
/// same endpoints, which rank 0 sends them.
pub fn connect_services_ranked(
    cfg: &CheckedConfig,
    agents: &[(String, String)],
    dist: &dyn crate::dist::Collective,
) -> Result<Services, TrainError> {
    let (services, mut endpoints) = if dist.is_root() {
        let services = connect_services(cfg, agents)?;
        let g = &services.guard;
        let ro = &cfg.raw.rollout;
        let registered = g
            .control
            .as_ref()
            .and_then(|_| crate::control::current())
            .and_then(|c| c.pool().map(|p| p.workers()));
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
        (
            Some(services),
            serde_json::to_vec(&ep).map_err(|e| TrainError::Dist(e.to_string()))?,
        )
    } else {
        (None, Vec::new())
    };
    dist.broadcast_bytes(&mut endpoints, 0)?;
    if let Some(s) = services {
        return Ok(s);
    }
    let ep: serde_json::Value = serde_json::from_slice(&endpoints)
        .map_err(|e| TrainError::Dist(format!("rank 0's service endpoints: {e}")))?;
    let rollout_eps: Vec<String> = ep["rollout"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_str().map(String::from))
        .collect();
    let reward_ep = ep["reward"].as_str().map(String::from);
    unreachable_from_here(
        ep["host"].as_str().unwrap_or_default(),
        &host_name(),
        rollout_eps.iter().chain(&reward_ep),
    )
    .map_or(Ok(()), |e| {
        Err(TrainError::Config(format!("rank {}: {e}", dist.rank())))
    })?;
    let mut own = cfg.clone();
    own.raw.rollout.endpoints = ep["rollout"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_str().map(String::from))
        .collect();
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
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// Why a rank on `here` cannot use rank 0's service `endpoints` (rank 0 runs on `rank0`): a
/// loopback address names the rank's own machine, not rank 0's, as the embedded services (which
/// listen on loopback) are.
fn unreachable_from_here<'a>(
    rank0: &str,
    here: &str,
    endpoints: impl IntoIterator<Item = &'a String>,
) -> Option<String> {
    if rank0.is_empty() || here.is_empty() || rank0 == here {
        return None;
    }
    let local: Vec<&String> = endpoints
        .into_iter()
        .filter(|e| cotrain_rollout_client::pool::is_loopback(e))
        .collect();
    (!local.is_empty()).then(|| {
        format!(
            "this rank runs on `{here}` and rank 0 on `{rank0}`, whose services {local:?} listen on loopback: a job across \
             machines needs rollout.endpoints (or rollout.dns_name) and reward.endpoint that every machine can reach"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_services_of_another_machine_are_refused() {
        let eps = [
            "http://127.0.0.1:5000".to_string(),
            "http://reward-0:50051".to_string(),
        ];
        let e = unreachable_from_here("node-a", "node-b", &eps).expect("refused");
        assert!(
            e.contains("node-b")
                && e.contains("node-a")
                && e.contains("127.0.0.1:5000")
                && !e.contains("reward-0"),
            "{e}"
        );
        assert_eq!(
            unreachable_from_here("node-a", "node-a", &eps),
            None,
            "the same machine reaches its loopback"
        );
        assert_eq!(
            unreachable_from_here("node-a", "node-b", &eps[1..]),
            None,
            "routable names are fine"
        );
    }
}
