//! The control server: `LearnerControl` over gRPC and the same operations over HTTP, on one port.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use cotrain_proto::auth::ClusterToken;
use cotrain_proto::control::learner_control_server::{LearnerControl, LearnerControlServer};
use cotrain_proto::control::*;
use cotrain_rollout_client::pool::Origin;
use prometheus::{Encoder, Gauge, GaugeVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder};
use tokio::sync::oneshot;
use tonic::{Request, Status};
use tracing::{info, warn};

use super::state::ControlState;

/// The running control server; stopped when dropped.
pub struct ControlServer {
    /// The bound address (a port 0 in `learner.control_addr` is resolved here).
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

#[derive(Clone)]
struct Control {
    state: Arc<ControlState>,
    token: Option<ClusterToken>,
    metrics: Arc<LearnerMetrics>,
}

impl ControlServer {
    /// Binds `addr` on the current runtime and serves until dropped; a non-loopback address without
    /// a cluster token is refused unless `--insecure` was given (then served with a warning).
    pub async fn start(
        addr: SocketAddr,
        state: Arc<ControlState>,
        token: Option<ClusterToken>,
        tls: Option<cotrain_proto::tls::ServerTls>,
    ) -> std::io::Result<Self> {
        if token.is_none() && !addr.ip().is_loopback() {
            if !crate::security::insecure() {
                return Err(std::io::Error::other(
                    "a control plane on a non-loopback address needs a cluster token: anyone who reaches it could register a \
                     worker (which then receives the weights) or stop the run. Give --cluster-token-file (or \
                     COTRAIN_CLUSTER_TOKEN_FILE), bind a loopback address, or pass --insecure",
                ));
            }
            warn!(%addr, "--insecure: control plane on a non-loopback address without a cluster token: anyone who reaches it can register workers or stop the run");
        }
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let control = Control {
            state: state.clone(),
            token,
            metrics: Arc::new(LearnerMetrics::new()),
        };
        let grpc = tonic::service::Routes::new(LearnerControlServer::new(control.clone()))
            .prepare()
            .into_axum_router();
        let http = axum::Router::new()
            .route("/healthz", get(|| async { "ok" }))
            .route("/metrics", get(metrics))
            .route("/status", get(http_status))
            .route("/checkpoint", post(http_checkpoint))
            .route("/stop", post(http_stop))
            .with_state(control);
        let app = grpc.merge(http);
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let stopped = async {
            let _ = stop_rx.await;
        };
        let (plain, secure) = match &tls {
            Some(t) => (
                None,
                Some(t.listener(listener).map_err(std::io::Error::other)?),
            ),
            None => (Some(listener), None),
        };
        tokio::spawn(async move {
            let served = match (plain, secure) {
                (Some(l), _) => axum::serve(l, app).with_graceful_shutdown(stopped).await,
                (None, Some(l)) => axum::serve(l, app).with_graceful_shutdown(stopped).await,
                (None, None) => unreachable!("one listener"),
            };
            if let Err(e) = served {
                warn!(error = %e, "control server stopped with an error");
            }
        });
        let reaper = Arc::downgrade(&state);
        let every = state.heartbeat;
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            loop {
                tick.tick().await;
                let Some(state) = reaper.upgrade() else {
                    return;
                };
                state.reap();
            }
        });
        info!(%addr, tls = tls.is_some(), "learner control plane listening (gRPC and HTTP)");
        Ok(Self {
            addr,
            stop: Some(stop_tx),
        })
    }
}

impl Control {
    fn authorised(&self, header: Option<&str>) -> Result<(), String> {
        match &self.token {
            None => Ok(()),
            Some(t) if t.verify(header) => Ok(()),
            Some(_) if header.is_none() => Err("this learner requires the cluster token (authorization: Bearer ...; --cluster-token-file)".into()),
            Some(_) => Err("wrong cluster token".into()),
        }
    }

    fn check<T>(&self, r: &Request<T>) -> Result<(), Status> {
        let header = r
            .metadata()
            .get(cotrain_proto::auth::METADATA_KEY)
            .and_then(|v| v.to_str().ok());
        self.authorised(header).map_err(Status::unauthenticated)
    }

    /// The 401 response for a request without the token, if it lacks it.
    fn refuse_http(&self, headers: &HeaderMap) -> Option<Response> {
        let header = headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        self.authorised(header)
            .err()
            .map(|e| (StatusCode::UNAUTHORIZED, e).into_response())
    }

    async fn status(&self) -> StatusResponse {
        let p = self.state.progress();
        let mut workers = Vec::new();
        if let Some(pool) = self.state.pool() {
            let infos: std::collections::HashMap<String, _> =
                pool.info_all().await.into_iter().collect();
            for w in pool.workers() {
                let versions = match infos.get(&w.address) {
                    Some(Ok(info)) => info
                        .agents
                        .iter()
                        .map(|a| AgentVersion {
                            agent: a.name.clone(),
                            version: a.policy_version,
                        })
                        .collect(),
                    _ => Vec::new(),
                };
                workers.push(WorkerStatus {
                    address: w.address,
                    origin: match w.origin {
                        Origin::Static => "static",
                        Origin::Dns => "dns",
                        Origin::Registered => "registered",
                    }
                    .into(),
                    healthy: w.healthy,
                    in_rotation: w.in_rotation,
                    in_flight: w.in_flight as u32,
                    completed: w.completed,
                    failed: w.failed,
                    catch_ups: w.catch_ups,
                    stale_refusals: w.stale_refusals,
                    versions,
                });
            }
        }
        StatusResponse {
            run_dir: p
                .run_dir
                .as_ref()
                .map(|d| d.display().to_string())
                .unwrap_or_default(),
            state: p.state.into(),
            step: p.last.step,
            total_steps: p.last.total_steps,
            epoch: p.last.epoch,
            total_epochs: p.last.total_epochs,
            reward: p.last.reward.filter(|r| r.is_finite()),
            eta_secs: p.eta_secs(),
            elapsed_secs: self.state.elapsed().as_secs_f64(),
            policy_versions: p
                .last
                .policy_versions
                .iter()
                .map(|(a, v)| AgentVersion {
                    agent: a.clone(),
                    version: *v,
                })
                .collect(),
            workers,
            last_checkpoint_step: p.last_checkpoint_step,
        }
    }

    async fn checkpoint(&self) -> Result<CheckpointResponse, String> {
        let rx = self.state.request_checkpoint()?;
        match rx.await {
            Ok(Ok((step, path))) => Ok(CheckpointResponse {
                step,
                path: path.display().to_string(),
            }),
            Ok(Err(e)) => Err(e),
            Err(_) => Err("the trainer went away before writing the checkpoint".into()),
        }
    }

    fn stop(&self) -> Result<StopResponse, String> {
        if !self.state.trainer_listening() {
            return Err(format!(
                "this run cannot stop gracefully now (state: {}): send SIGTERM to end it, and continue from its last checkpoint with --resume",
                self.state.progress().state
            ));
        }
        let step = self.state.progress().last.step;
        self.state.request_stop("control plane");
        Ok(StopResponse {
            message: format!(
                "stopping after the current step (step {step} done): a checkpoint, then exit"
            ),
        })
    }
}

#[tonic::async_trait]
impl LearnerControl for Control {
    async fn register(
        &self,
        r: Request<RegisterRequest>,
    ) -> Result<tonic::Response<RegisterResponse>, Status> {
        self.check(&r)?;
        let in_rotation = self
            .state
            .register(&r.get_ref().address)
            .await
            .map_err(Status::invalid_argument)?;
        Ok(tonic::Response::new(RegisterResponse {
            heartbeat_interval_ms: self.state.heartbeat.as_millis() as u32,
            in_rotation,
        }))
    }

    async fn heartbeat(
        &self,
        r: Request<HeartbeatRequest>,
    ) -> Result<tonic::Response<HeartbeatResponse>, Status> {
        self.check(&r)?;
        Ok(tonic::Response::new(HeartbeatResponse {
            known: self.state.heartbeat(&r.get_ref().address),
        }))
    }

    async fn deregister(
        &self,
        r: Request<DeregisterRequest>,
    ) -> Result<tonic::Response<DeregisterResponse>, Status> {
        self.check(&r)?;
        Ok(tonic::Response::new(DeregisterResponse {
            removed: self.state.deregister(&r.get_ref().address),
        }))
    }

    async fn status(
        &self,
        r: Request<StatusRequest>,
    ) -> Result<tonic::Response<StatusResponse>, Status> {
        self.check(&r)?;
        Ok(tonic::Response::new(Control::status(self).await))
    }

    async fn checkpoint(
        &self,
        r: Request<CheckpointRequest>,
    ) -> Result<tonic::Response<CheckpointResponse>, Status> {
        self.check(&r)?;
        Control::checkpoint(self)
            .await
            .map(tonic::Response::new)
            .map_err(Status::failed_precondition)
    }

    async fn stop(&self, r: Request<StopRequest>) -> Result<tonic::Response<StopResponse>, Status> {
        self.check(&r)?;
        Control::stop(self)
            .map(tonic::Response::new)
            .map_err(Status::failed_precondition)
    }
}

async fn http_status(
    axum::extract::State(c): axum::extract::State<Control>,
    headers: HeaderMap,
) -> Response {
    if let Some(r) = c.refuse_http(&headers) {
        return r;
    }
    axum::Json(status_json(&c.status().await)).into_response()
}

async fn http_checkpoint(
    axum::extract::State(c): axum::extract::State<Control>,
    headers: HeaderMap,
) -> Response {
    if let Some(r) = c.refuse_http(&headers) {
        return r;
    }
    match c.checkpoint().await {
        Ok(r) => axum::Json(serde_json::json!({"step": r.step, "path": r.path})).into_response(),
        Err(e) => (
            StatusCode::CONFLICT,
            axum::Json(serde_json::json!({"error": e})),
        )
            .into_response(),
    }
}

async fn http_stop(
    axum::extract::State(c): axum::extract::State<Control>,
    headers: HeaderMap,
) -> Response {
    if let Some(r) = c.refuse_http(&headers) {
        return r;
    }
    match c.stop() {
        Ok(r) => axum::Json(serde_json::json!({"message": r.message})).into_response(),
        Err(e) => (
            StatusCode::CONFLICT,
            axum::Json(serde_json::json!({"error": e})),
        )
            .into_response(),
    }
}

/// The status as JSON (the HTTP `/status` body and `learner status --json`).
pub fn status_json(s: &StatusResponse) -> serde_json::Value {
    let versions = |v: &[AgentVersion]| {
        v.iter()
            .map(|a| (a.agent.clone(), serde_json::json!(a.version)))
            .collect::<serde_json::Map<_, _>>()
    };
    serde_json::json!({
        "run_dir": s.run_dir, "state": s.state, "step": s.step, "total_steps": s.total_steps,
        "epoch": s.epoch, "total_epochs": s.total_epochs, "reward": s.reward, "eta_secs": s.eta_secs,
        "elapsed_secs": s.elapsed_secs, "last_checkpoint_step": s.last_checkpoint_step,
        "policy_versions": versions(&s.policy_versions),
        "workers": s.workers.iter().map(|w| serde_json::json!({
            "address": w.address, "origin": w.origin, "healthy": w.healthy, "in_rotation": w.in_rotation,
            "in_flight": w.in_flight, "completed": w.completed, "failed": w.failed, "catch_ups": w.catch_ups,
            "stale_refusals": w.stale_refusals, "versions": versions(&w.versions),
        })).collect::<Vec<_>>(),
    })
}

/// The learner's Prometheus metrics, set from the control state at every scrape.
struct LearnerMetrics {
    registry: Registry,
    step: IntGauge,
    total_steps: IntGauge,
    epoch: IntGauge,
    reward: Gauge,
    eta: Gauge,
    uptime: Gauge,
    workers: IntGaugeVec,
    policy_version: IntGaugeVec,
    worker_requests: GaugeVec,
}

impl LearnerMetrics {
    fn new() -> Self {
        let registry = Registry::new_custom(Some("cotrain_learner".into()), None)
            .expect("static prefix is valid");
        let int = |name: &str, help: &str| {
            let g = IntGauge::new(name, help).expect("valid metric");
            registry
                .register(Box::new(g.clone()))
                .expect("unique metric");
            g
        };
        let float = |name: &str, help: &str| {
            let g = Gauge::new(name, help).expect("valid metric");
            registry
                .register(Box::new(g.clone()))
                .expect("unique metric");
            g
        };
        let step = int("step", "Steps done");
        let total_steps = int("total_steps", "Steps in the whole run");
        let epoch = int("epoch", "Current epoch");
        let reward = float("reward", "Mean reward of the last step");
        let eta = float(
            "eta_seconds",
            "Seconds to the end of the run at the mean step time",
        );
        let uptime = float("uptime_seconds", "Seconds since the learner started");
        let workers = IntGaugeVec::new(
            Opts::new("rollout_workers", "Rollout workers in the pool by state"),
            &["state"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(workers.clone()))
            .expect("unique metric");
        let policy_version = IntGaugeVec::new(
            Opts::new("policy_version", "Policy version pushed, per agent"),
            &["agent"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(policy_version.clone()))
            .expect("unique metric");
        let worker_requests = GaugeVec::new(
            Opts::new("worker_requests", "Requests per rollout worker by outcome"),
            &["worker", "outcome"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(worker_requests.clone()))
            .expect("unique metric");
        Self {
            registry,
            step,
            total_steps,
            epoch,
            reward,
            eta,
            uptime,
            workers,
            policy_version,
            worker_requests,
        }
    }
}

async fn metrics(axum::extract::State(c): axum::extract::State<Control>) -> Response {
    let m = &c.metrics;
    let p = c.state.progress();
    m.step.set(p.last.step as i64);
    m.total_steps.set(p.last.total_steps as i64);
    m.epoch.set(p.last.epoch as i64);
    m.reward.set(p.last.reward.unwrap_or(f64::NAN));
    m.eta.set(p.eta_secs().unwrap_or(f64::NAN));
    m.uptime.set(c.state.elapsed().as_secs_f64());
    for (agent, v) in &p.last.policy_versions {
        m.policy_version
            .with_label_values(&[agent.as_str()])
            .set(*v as i64);
    }
    let workers = c.state.pool().map(|p| p.workers()).unwrap_or_default();
    m.workers
        .with_label_values(&["total"])
        .set(workers.len() as i64);
    m.workers
        .with_label_values(&["healthy"])
        .set(workers.iter().filter(|w| w.healthy).count() as i64);
    m.workers
        .with_label_values(&["in_rotation"])
        .set(workers.iter().filter(|w| w.in_rotation).count() as i64);
    m.workers
        .with_label_values(&["registered"])
        .set(c.state.registered().len() as i64);
    // One series per worker in the pool now: those of workers that left are dropped, so a pool
    // that churns does not grow the metrics without bound.
    m.worker_requests.reset();
    for w in &workers {
        m.worker_requests
            .with_label_values(&[w.address.as_str(), "completed"])
            .set(w.completed as f64);
        m.worker_requests
            .with_label_values(&[w.address.as_str(), "failed"])
            .set(w.failed as f64);
        m.worker_requests
            .with_label_values(&[w.address.as_str(), "stale"])
            .set(w.stale_refusals as f64);
    }
    let mut buf = Vec::new();
    if let Err(e) = TextEncoder::new().encode(&m.registry.gather(), &mut buf) {
        return (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response();
    }
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        buf,
    )
        .into_response()
}
