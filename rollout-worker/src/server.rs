//! `rollout-worker serve`: loads the agents' models, binds the gRPC and HTTP ports, serves until
//! SIGINT/SIGTERM (or [`RunningServer::shutdown`] in process), then drains and stops.
//!
//! Once both ports are bound the binary prints one line to stdout,
//! `listening grpc=HOST:PORT http=HOST:PORT`, so callers can ask for port 0 and read the ports.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;
use cotrain_proto::rollout::rollout_server::RolloutServer;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tracing::info;

use crate::metrics::Metrics;
use crate::service::RolloutService;
use crate::worker::{EngineKind, EngineThreads, Worker, WorkerConfig};

/// Largest gRPC message accepted or sent (weight chunks, big generate batches).
pub const MAX_MESSAGE_BYTES: usize = 256 << 20;

pub use cotrain_proto::wire::{CONNECTION_WINDOW_BYTES, STREAM_WINDOW_BYTES};

pub use cotrain_proto::wire::DEFAULT_MAX_BATCH_SIZE;

/// Arguments of `serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// gRPC listen address; port 0 picks a free port (printed on stdout).
    #[arg(long, default_value = "127.0.0.1:50061")]
    pub grpc_addr: SocketAddr,
    /// HTTP listen address (OpenAI-compatible API, /metrics, /health); port 0 picks a free port.
    #[arg(long, default_value = "127.0.0.1:8061")]
    pub http_addr: SocketAddr,
    /// An agent as NAME=MODEL (repeatable); MODEL is a HF directory, a .gguf file, a cached repo
    /// id or `default`. Every agent has its own copy of the parameters unless `--share` groups it.
    /// None with `--verifier`: a worker that only scores (generate requests are refused).
    #[arg(long = "agent", value_name = "NAME=MODEL", required_unless_present = "verifiers", value_parser = parse_agent)]
    pub agents: Vec<(String, String)>,
    /// Device of the agents' models: cpu, cuda (cuda:0), cuda:N or auto (a GPU if one is usable).
    /// A CUDA device that cannot be used stops the worker with the reason.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// One agent's device instead of --device, as NAME=DEVICE (repeatable), e.g. one GPU per
    /// agent: `--agent-device agent0=cuda:0 --agent-device agent1=cuda:1`.
    #[arg(long = "agent-device", value_name = "NAME=DEVICE", value_parser = parse_agent)]
    pub agent_devices: Vec<(String, String)>,
    /// Parameter dtype: f32 or bf16 (f16 also loads).
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// With --dtype bf16 on a CPU with AVX512_BF16: round each product's input rows to bf16 and
    /// multiply with bf16 dot products (faster from 8 sequences on; not the f32 rows of the default).
    #[arg(long)]
    pub bf16_dot_products: bool,
    /// Most sequences one model decodes together.
    #[arg(long, default_value_t = DEFAULT_MAX_BATCH_SIZE)]
    pub max_batch_size: usize,
    /// Most generate requests admitted and not answered; more get RESOURCE_EXHAUSTED.
    #[arg(long, default_value_t = 1024)]
    pub max_queued_requests: usize,
    /// libtorch intra-op threads (default: libtorch's choice).
    #[arg(long)]
    pub threads: Option<i32>,
    /// Agents that share one copy of the parameters, e.g. `--share agent0,agent1` (repeatable; the
    /// agents of a group name the same MODEL). A weight update of one of them changes them all, so a
    /// learner training them as separate policies refuses such a worker.
    #[arg(long = "share", value_name = "A,B,...", value_parser = parse_share)]
    pub share: Vec<Vec<String>>,
    /// Agents served as LoRA adapters on one loaded base, unmerged, e.g. `--adapters
    /// agent0,agent1` (repeatable; the agents of a group name the same MODEL): one engine whose
    /// batches mix the agents, each with its own adapter and policy version, for one base's memory
    /// plus the adapters'. Each agent is the base until its first adapter update, and takes
    /// adapter updates only. On the OpenAI endpoint an agent is also `MODEL:AGENT`.
    #[arg(long = "adapters", value_name = "A,B,...", value_parser = parse_adapters)]
    pub adapters: Vec<Vec<String>>,
    /// A PEFT LoRA adapter directory served as agent NAME (repeatable; vLLM's `--lora-modules`):
    /// its base is the directory's `base_model_name_or_path` (a `learner export` of a
    /// `model.lora` run names its base spec); the adapters of one base are served unmerged on one
    /// copy of it, with the agents of an `--adapters` group on that base if there is one. Each
    /// starts at policy version 1 and can be replaced by adapter updates.
    #[arg(long = "lora-module", value_name = "NAME=DIR", value_parser = parse_verifier)]
    pub lora_modules: Vec<(String, std::path::PathBuf)>,
    /// Accepted for older command lines: every agent has its own copy of the weights unless `--share`.
    #[arg(long, hide = true)]
    pub separate_weights: bool,
    /// Accept weight updates through files in /dev/shm (`cotrain-weights-*`, regular files only)
    /// from clients on this host, instead of only as gRPC chunks; much faster for a co-located
    /// learner. Anyone who can reach the gRPC port and write /dev/shm can then update the weights
    /// (as anyone who can reach the port already can with chunks).
    #[arg(long)]
    pub allow_shm_weights: bool,
    /// CPU threads each model's engine uses (default: every core). With several models on few
    /// cores, cores / models is usually faster: their engines then do not compete for the cores.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub threads_per_engine: Option<u32>,
    /// Thread count of cotrain's decode steps: `adaptive` (measured while decoding; drops threads
    /// when the cores are shared with other busy processes, with the same tokens and log-probs bit
    /// for bit), `fixed` (always the engine's count above), or a count.
    #[arg(long, default_value = "adaptive")]
    pub decode_threads: cotrain_model::engine::DecodeThreads,
    /// A learned verifier to serve on `ScoreVerifier` (and, through a reward server started with
    /// `--verifier-endpoint`, on MaPoRL's `/predict`): a directory written by `learner verifier
    /// train`. Repeatable.
    #[arg(long = "verifier", value_name = "NAME=DIR", value_parser = parse_verifier)]
    pub verifiers: Vec<(String, std::path::PathBuf)>,
    /// A file holding the cluster token: weight and adapter updates must then carry it (the learner
    /// reads the same file). Without one, anyone who can reach the gRPC port can replace the weights.
    #[arg(long, env = cotrain_proto::auth::TOKEN_FILE_ENV, value_name = "PATH")]
    pub cluster_token_file: Option<std::path::PathBuf>,
    /// Serve gRPC on a non-loopback address without a cluster token (anyone who reaches the port
    /// could then replace the weights). Without this flag such a start is refused.
    #[arg(long)]
    pub insecure: bool,
    /// Register with a learner's control plane (`learner.control_addr`, e.g.
    /// http://learner-0:7070): the learner brings this worker to its current policy and sends it
    /// requests; the worker heartbeats, and on SIGTERM drains its requests and deregisters.
    #[arg(long, value_name = "URL")]
    pub register: Option<String>,
    /// Serve gRPC and HTTP over TLS with this PEM certificate chain (with --tls-key).
    #[arg(long, value_name = "PATH", requires = "tls_key")]
    pub tls_cert: Option<std::path::PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, value_name = "PATH", requires = "tls_cert")]
    pub tls_key: Option<std::path::PathBuf>,
    /// With --register over https: the PEM certificates that sign the learner's (default:
    /// COTRAIN_TLS_CA).
    #[arg(long, value_name = "PATH")]
    pub tls_ca: Option<std::path::PathBuf>,
    /// The name the learner's certificate is checked against (default: COTRAIN_TLS_DOMAIN, else
    /// the host of the URL).
    #[arg(long, value_name = "NAME")]
    pub tls_domain: Option<String>,
    /// What generates: `cotrain` (its own engine, in this process; the default and the fastest on
    /// CPUs) or `vllm` (a vLLM engine per model, its own process, supervised by the worker; the
    /// engine for GPUs). vLLM comes from COTRAIN_VLLM_PYTHON or `COTRAIN_VLLM=cpu|system make setup`.
    #[arg(long, default_value = "cotrain", value_parser = ["cotrain", "vllm"])]
    pub engine: String,
    /// With --engine vllm: the Python interpreter that has vLLM (default: COTRAIN_VLLM_PYTHON, else
    /// the one `make setup` recorded).
    #[arg(long, value_name = "PATH")]
    pub vllm_python: Option<std::path::PathBuf>,
    /// With --engine vllm on GPUs: the fraction of its GPU's memory each engine may take.
    #[arg(long, value_name = "FRACTION")]
    pub gpu_memory_utilization: Option<f64>,
    /// With --engine vllm on GPUs: GPUs per engine (tensor parallelism; the engine takes its
    /// agent's GPU and the ones after it).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub tensor_parallel_size: Option<u32>,
    /// With --engine vllm: the longest sequence (prompt and completion) an engine serves (default:
    /// the model's context, at most 8192).
    #[arg(long, value_name = "TOKENS")]
    pub max_model_len: Option<usize>,
    /// With --engine vllm on a CPU: GiB of KV cache per engine.
    #[arg(long, default_value_t = 2, value_name = "GIB")]
    pub vllm_kv_cache_gib: u32,
    /// With --engine vllm: one more argument for every engine, as vLLM's CLI spells it
    /// (repeatable, e.g. `--vllm-arg=--enable-prefix-caching`).
    #[arg(long = "vllm-arg", value_name = "ARG", allow_hyphen_values = true)]
    pub vllm_args: Vec<String>,
    /// With --engine vllm: how long an engine may take to start.
    #[arg(long, default_value_t = 900, value_name = "SECS")]
    pub vllm_start_timeout_secs: u64,
    /// With --engine vllm: the largest difference of a probe log-prob from the learner's that a
    /// weight update may show (default: 0.01 for f32 engines, 0.25 for bf16/f16).
    #[arg(long, value_name = "NATS")]
    pub probe_tolerance: Option<f32>,
    /// With --engine vllm and --adapters: the largest LoRA rank the engine accepts (vLLM's
    /// --max-lora-rank: 1, 8, 16, 32, 64, 128, 256, 320 or 512).
    #[arg(long, default_value_t = 64, value_name = "R")]
    pub vllm_max_lora_rank: usize,
    /// With --register: the gRPC address the learner should dial (default: the bound address, with
    /// 0.0.0.0 replaced by this host's address on the route to the learner).
    #[arg(long, value_name = "HOST:PORT", requires = "register")]
    pub advertise_addr: Option<String>,
}

/// In-process server options beyond the worker's configuration.
#[derive(Clone, Debug, Default)]
pub struct ServeOptions {
    /// Accept shared-memory weight updates (`--allow-shm-weights`).
    pub allow_shm_weights: bool,
    /// Weight updates must carry this token (`--cluster-token-file`).
    pub cluster_token: Option<cotrain_proto::auth::ClusterToken>,
    /// Serve gRPC and HTTP over TLS (`--tls-cert`, `--tls-key`).
    pub tls: Option<cotrain_proto::tls::ServerTls>,
    /// Allow a non-loopback gRPC address without a cluster token (`--insecure`).
    pub insecure: bool,
}

fn parse_verifier(s: &str) -> Result<(String, std::path::PathBuf), String> {
    match s.split_once('=') {
        Some((name, dir)) if !name.is_empty() && !dir.is_empty() => {
            Ok((name.to_string(), dir.into()))
        }
        _ => Err(format!("expected NAME=DIR, got `{s}`")),
    }
}

fn parse_share(s: &str) -> Result<Vec<String>, String> {
    let names: Vec<String> = s.split(',').map(|n| n.trim().to_string()).collect();
    if names.len() < 2 || names.iter().any(String::is_empty) {
        return Err(format!(
            "expected two or more agent names separated by commas, got `{s}`"
        ));
    }
    Ok(names)
}

fn parse_adapters(s: &str) -> Result<Vec<String>, String> {
    let names: Vec<String> = s.split(',').map(|n| n.trim().to_string()).collect();
    if names.iter().any(String::is_empty) {
        return Err(format!(
            "expected agent names separated by commas, got `{s}`"
        ));
    }
    Ok(names)
}

fn parse_agent(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((name, model)) if !name.is_empty() && !model.is_empty() => {
            Ok((name.to_string(), model.to_string()))
        }
        _ => Err(format!("expected NAME=MODEL, got `{s}`")),
    }
}

impl ServeArgs {
    /// The checked worker configuration.
    pub fn worker_config(&self) -> anyhow::Result<WorkerConfig> {
        let (mut agents, mut adapters) = (self.agents.clone(), self.adapters.clone());
        for (name, dir) in &self.lora_modules {
            let path = dir.join("adapter_config.json");
            let text = std::fs::read_to_string(&path).with_context(|| {
                format!(
                    "--lora-module {name}={}: reading {}",
                    dir.display(),
                    path.display()
                )
            })?;
            let config: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("--lora-module {name}: {}", path.display()))?;
            let Some(base) = config["base_model_name_or_path"].as_str() else {
                anyhow::bail!(
                    "--lora-module {name}: {} names no base_model_name_or_path",
                    path.display()
                );
            };
            if agents.iter().any(|(a, _)| a == name) {
                anyhow::bail!("--lora-module {name}: `{name}` is also an --agent");
            }
            agents.push((name.clone(), base.to_string()));
            // With the other adapters of that base, else in a group of its own.
            let spec_of = |a: &String| agents.iter().find(|(n, _)| n == a).map(|(_, s)| s.clone());
            match adapters
                .iter_mut()
                .find(|g| g.first().and_then(spec_of).as_deref() == Some(base))
            {
                Some(g) => g.push(name.clone()),
                None => adapters.push(vec![name.clone()]),
            }
        }
        Ok(WorkerConfig {
            agents,
            share: self.share.clone(),
            adapters,
            lora_modules: self.lora_modules.clone(),
            device: cotrain_model::config::parse_device(&self.device).context("--device")?,
            agent_devices: self
                .agent_devices
                .iter()
                .map(|(a, d)| {
                    Ok((
                        a.clone(),
                        cotrain_model::config::parse_device(d)
                            .with_context(|| format!("--agent-device {a}={d}"))?,
                    ))
                })
                .collect::<anyhow::Result<_>>()?,
            kind: cotrain_model::config::parse_dtype(&self.dtype).context("--dtype")?,
            max_batch_size: self.max_batch_size,
            max_queued_requests: self.max_queued_requests,
            engine_threads: self
                .threads_per_engine
                .map_or(EngineThreads::Default, |n| EngineThreads::Fixed(n as usize)),
            decode_threads: self.decode_threads,
            verifiers: self.verifiers.clone(),
            engine: self.engine_kind()?,
        })
    }

    /// `--engine` with its options; a vLLM that cannot be used stops here, naming what to set.
    fn engine_kind(&self) -> anyhow::Result<EngineKind> {
        if self.engine != "vllm" {
            return Ok(EngineKind::Cotrain);
        }
        let (python, _) = crate::vllm::VllmOptions::discover(self.vllm_python.clone())?;
        Ok(EngineKind::Vllm(crate::vllm::VllmOptions {
            python,
            gpu_memory_utilization: self.gpu_memory_utilization,
            tensor_parallel_size: self.tensor_parallel_size,
            max_model_len: self.max_model_len,
            cpu_kv_cache_gib: self.vllm_kv_cache_gib,
            extra_args: self.vllm_args.clone(),
            start_timeout: std::time::Duration::from_secs(self.vllm_start_timeout_secs),
            probe_tolerance: self.probe_tolerance,
            max_lora_rank: self.vllm_max_lora_rank,
        }))
    }
}

/// A worker serving in this process.
pub struct RunningServer {
    /// The bound gRPC address.
    pub grpc_addr: SocketAddr,
    /// The bound HTTP address.
    pub http_addr: SocketAddr,
    worker: Arc<Worker>,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl RunningServer {
    /// The worker behind the servers.
    pub fn worker(&self) -> &Arc<Worker> {
        &self.worker
    }

    /// Stops accepting, lets answered requests finish, stops the engine loops.
    pub async fn shutdown(mut self) -> anyhow::Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let result = (&mut self.task).await.context("server task panicked")?;
        if let Ok(worker) = Arc::try_unwrap(self.worker) {
            tokio::task::spawn_blocking(move || worker.shutdown())
                .await
                .ok();
        }
        result
    }

    /// Serves until the process gets SIGINT or SIGTERM, then shuts down.
    pub async fn run_until_signal(self) -> anyhow::Result<()> {
        wait_for_signal().await?;
        self.shutdown().await
    }
}

/// Returns on SIGINT or SIGTERM.
async fn wait_for_signal() -> anyhow::Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => info!("sigint, shutting down"),
        _ = term.recv() => info!("sigterm, shutting down"),
    }
    Ok(())
}

/// Loads the models and starts both servers on this runtime (shared-memory weight updates off).
pub async fn start(
    config: WorkerConfig,
    grpc_addr: SocketAddr,
    http_addr: SocketAddr,
) -> anyhow::Result<RunningServer> {
    start_with(config, grpc_addr, http_addr, ServeOptions::default()).await
}

/// As [`start`], with options.
pub async fn start_with(
    config: WorkerConfig,
    grpc_addr: SocketAddr,
    http_addr: SocketAddr,
    options: ServeOptions,
) -> anyhow::Result<RunningServer> {
    if options.cluster_token.is_none() && !grpc_addr.ip().is_loopback() && !options.insecure {
        anyhow::bail!(
            "refusing to serve gRPC on {grpc_addr} without a cluster token: anyone who reaches it could replace the weights. \
             Give --cluster-token-file (or COTRAIN_CLUSTER_TOKEN_FILE), bind a loopback address, or pass --insecure"
        );
    }
    let metrics = Metrics::new();
    let worker = tokio::task::spawn_blocking(move || Worker::start(config, metrics))
        .await
        .context("model loading panicked")?
        .context("starting the worker")?;
    let worker = Arc::new(worker);
    let grpc = TcpListener::bind(grpc_addr)
        .await
        .with_context(|| format!("binding gRPC on {grpc_addr}"))?;
    let http = TcpListener::bind(http_addr)
        .await
        .with_context(|| format!("binding HTTP on {http_addr}"))?;
    let (grpc_addr, http_addr) = (grpc.local_addr()?, http.local_addr()?);

    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<RolloutServer<RolloutService>>().await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(cotrain_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .context("building gRPC reflection")?;
    if options.cluster_token.is_none() && !grpc_addr.ip().is_loopback() {
        tracing::warn!(%grpc_addr, "--insecure: serving on a non-loopback address without a cluster token: anyone who reaches this port can replace the weights");
    }
    let rollout = RolloutServer::new(
        RolloutService::new(worker.clone())
            .with_shm_weights(options.allow_shm_weights)
            .with_cluster_token(options.cluster_token.clone()),
    )
    .max_decoding_message_size(MAX_MESSAGE_BYTES)
    .max_encoding_message_size(MAX_MESSAGE_BYTES);

    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let (grpc_stop_tx, grpc_stop_rx) = oneshot::channel::<()>();
    let (http_stop_tx, http_stop_rx) = oneshot::channel::<()>();
    let router = crate::http::router(worker.clone());
    let mut builder = tonic::transport::Server::builder();
    let (http_plain, http_tls) = match &options.tls {
        Some(tls) => {
            builder = builder.tls_config(tls.tonic()).context("gRPC TLS")?;
            (
                None,
                Some(
                    tls.listener(http)
                        .map_err(anyhow::Error::msg)
                        .context("HTTP TLS")?,
                ),
            )
        }
        None => (Some(http), None),
    };
    let task = tokio::spawn(async move {
        let grpc_server = builder
            .initial_stream_window_size(STREAM_WINDOW_BYTES)
            .initial_connection_window_size(CONNECTION_WINDOW_BYTES)
            .add_service(health_service)
            .add_service(reflection)
            .add_service(rollout)
            .serve_with_incoming_shutdown(
                tonic::transport::server::TcpIncoming::from(grpc).with_nodelay(Some(true)),
                async {
                    let _ = grpc_stop_rx.await;
                },
            );
        let http_stopped = async {
            let _ = http_stop_rx.await;
        };
        let http_task = match (http_plain, http_tls) {
            (Some(l), _) => tokio::spawn(async move {
                axum::serve(l, router)
                    .with_graceful_shutdown(http_stopped)
                    .await
            }),
            (None, Some(l)) => tokio::spawn(async move {
                axum::serve(l, router)
                    .with_graceful_shutdown(http_stopped)
                    .await
            }),
            (None, None) => unreachable!("one HTTP listener"),
        };
        let grpc_task = tokio::spawn(grpc_server);
        let _ = stop_rx.await;
        // Tell load balancers first, then stop accepting; in-flight requests finish.
        health
            .set_not_serving::<RolloutServer<RolloutService>>()
            .await;
        health
            .set_service_status("", tonic_health::ServingStatus::NotServing)
            .await;
        let _ = grpc_stop_tx.send(());
        let _ = http_stop_tx.send(());
        grpc_task.await?.context("gRPC server")?;
        http_task.await?.context("HTTP server")?;
        info!("servers stopped");
        Ok(())
    });
    info!(%grpc_addr, %http_addr, worker_id = worker.id(), shm_weights = options.allow_shm_weights,
        cluster_token = options.cluster_token.is_some(), "rollout worker serving");
    Ok(RunningServer {
        grpc_addr,
        http_addr,
        worker,
        stop: Some(stop_tx),
        task,
    })
}

/// `rollout-worker serve`: runs until SIGINT/SIGTERM.
pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    cotrain_proto::logging::init("info");
    if let Some(t) = args.threads {
        tch::set_num_threads(t);
    }
    let config = args.worker_config()?;
    if args.bf16_dot_products {
        cotrain_model::kernels::gemm_bf16dot::enable_for(
            config.kind,
            config.device,
            "--bf16-dot-products",
        )
        .map_err(anyhow::Error::msg)?;
    }
    let cluster_token =
        cotrain_proto::auth::ClusterToken::from_flag_or_env(args.cluster_token_file.as_deref())
            .map_err(anyhow::Error::msg)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("tokio runtime")?;
    runtime.block_on(async move {
        let tls = cotrain_proto::tls::ServerTls::from_flags(
            args.tls_cert.as_deref(),
            args.tls_key.as_deref(),
        )
        .map_err(anyhow::Error::msg)?;
        let client_tls = cotrain_proto::tls::ClientTls::from_flag_or_env(
            args.tls_ca.as_deref(),
            args.tls_domain.as_deref(),
        )
        .map_err(anyhow::Error::msg)?;
        let options = ServeOptions {
            allow_shm_weights: args.allow_shm_weights,
            cluster_token: cluster_token.clone(),
            tls,
            insecure: args.insecure,
        };
        let agents: Vec<String> = config.agents.iter().map(|(a, _)| a.clone()).collect();
        let server = start_with(config, args.grpc_addr, args.http_addr, options).await?;
        println!(
            "listening grpc={} http={}",
            server.grpc_addr, server.http_addr
        );
        use std::io::Write as _;
        std::io::stdout().flush()?;
        let registration = match &args.register {
            Some(url) => {
                let address = crate::register::advertised_address(
                    args.advertise_addr.as_deref(),
                    server.grpc_addr,
                    url,
                )?;
                Some(crate::register::Registration::start(
                    url,
                    address,
                    agents,
                    server.worker().id().to_string(),
                    cluster_token,
                    client_tls,
                ))
            }
            None => None,
        };
        wait_for_signal().await?;
        // Drain first (the learner's pool fails requests over while this worker refuses new ones),
        // then leave the learner's pool.
        let result = server.shutdown().await;
        if let Some(r) = registration {
            r.deregister().await;
        }
        result
    })
}
