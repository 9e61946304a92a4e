//! A client pool that treats many rollout workers as one, and keeps them at the learner's policy.
//!
//! Workers come from a static list of endpoints, from DNS names (`host:port`, A and AAAA records,
//! re-resolved every refresh: a Kubernetes headless service has one record per pod) and from
//! [`RolloutPool::add_endpoint`] (workers that registered themselves). A background task
//! health-checks every worker on the same schedule; addresses that leave DNS are dropped, new ones
//! are added.
//!
//! A worker gets generate requests only while it is *in rotation*: healthy and at the current
//! version of every agent. The pool keeps the latest weight update of every agent (see
//! [`replay`]); a worker that appears, comes back after failing, or refuses a request as stale is
//! first brought to the current versions by replaying those updates to it alone, then put in
//! rotation. Workers that fail are retried with exponential backoff.
//!
//! [`RolloutPool::generate`] sends a request to the in-rotation worker with the fewest requests in
//! flight. A request is an atomic unit carrying its seed, so when a worker fails the pool sends the
//! same request to another worker and returns exactly one answer, with the same samples the failed
//! worker would have produced at the same policy version.
//!
//! The pool pushes weight updates to every healthy worker ([`RolloutPool::push_weights`]); one that
//! refuses or fails is taken out of rotation, not waited on. [`RolloutPool::wait_for_version`]
//! waits on the workers in rotation.

mod member;
mod replay;
pub mod resolve;

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use cotrain_proto::refusal::{self, Refusal};
use cotrain_proto::rollout::{
    update_weights_request::Item, GenerateRequest, GenerateResponse, InfoRequest, InfoResponse, ScoreVerifierRequest,
    ScoreVerifierResponse, ShmWeights, UpdateHeader, UpdateWeightsRequest, UpdateWeightsResponse,
};
use tokio::sync::Notify;
use tonic::{Code, Status};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::HealthCheckRequest;
use tracing::{debug, info, warn};

use crate::wire::UpdatedTensor;
use member::{InFlight, Worker};
pub use member::{Origin, WorkerSnapshot};
use replay::{Body, Replay};
pub use resolve::{Resolve, SystemResolver};

/// How the pool finds and talks to workers.
#[derive(Clone, Debug)]
pub struct PoolConfig {
    /// Fixed endpoints, `host:port` or `http://host:port`.
    pub endpoints: Vec<String>,
    /// DNS names, `host:port`, re-resolved every `refresh_interval`; every address is a worker.
    pub dns_names: Vec<String>,
    /// How often DNS is re-resolved.
    pub refresh_interval: Duration,
    /// How often every worker is health-checked (at most `refresh_interval`). A worker that fails
    /// a check loses the requests and pushes it holds: they go to other workers.
    pub health_interval: Duration,
    /// Connection and health-check timeout.
    pub connect_timeout: Duration,
    /// Deadline of one generate attempt on one worker (None: no deadline).
    pub request_timeout: Option<Duration>,
    /// Attempts per request, on different workers while there are untried healthy ones.
    pub max_attempts: usize,
    /// How long a request waits for a healthy worker when there is none.
    pub wait_for_worker: Duration,
    /// Deadline of one weight push to one worker; a worker that misses it leaves rotation.
    pub push_timeout: Duration,
    /// Payload bytes per weight-update chunk message.
    pub weight_chunk_bytes: usize,
    /// Sent with every weight update (workers started with a cluster token refuse updates without it).
    pub cluster_token: Option<cotrain_proto::auth::ClusterToken>,
    /// Dial every worker over TLS, trusting these certificates (`https`, whatever the address says).
    pub tls: Option<cotrain_proto::tls::ClientTls>,
    /// Resolves `dns_names` (the system resolver by default).
    pub resolver: Arc<dyn Resolve>,
    /// Start with no worker: they are added later with [`RolloutPool::add_endpoint`] (workers
    /// that register themselves).
    pub allow_empty: bool,
    /// The longest wait between attempts to bring back a failed worker (the first waits
    /// `refresh_interval`, each next one twice as long).
    pub max_backoff: Duration,
    /// Where the latest update of every agent is kept for workers that join later (a directory
    /// of its own is made inside and removed with the pool); the system's temporary directory
    /// when `None`. It holds one copy of each agent's weights.
    pub replay_dir: Option<std::path::PathBuf>,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            endpoints: Vec::new(),
            dns_names: Vec::new(),
            refresh_interval: Duration::from_secs(2),
            health_interval: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(2),
            request_timeout: None,
            max_attempts: 5,
            wait_for_worker: Duration::from_secs(60),
            weight_chunk_bytes: 4 << 20,
            push_timeout: Duration::from_secs(600),
            cluster_token: None,
            tls: None,
            resolver: Arc::new(SystemResolver),
            max_backoff: Duration::from_secs(30),
            allow_empty: false,
            replay_dir: None,
        }
    }
}

/// What can go wrong using the pool.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// The configuration names no endpoint and no DNS name, or one that does not parse.
    #[error("invalid pool config: {0}")]
    Config(String),
    /// No healthy worker appeared within `wait_for_worker`.
    #[error("no healthy rollout worker within {0:?}")]
    NoWorker(Duration),
    /// A worker rejected the request for a reason another worker would share (bad input).
    #[error("worker {worker} rejected the request: {status}")]
    Rejected {
        /// The worker's address.
        worker: String,
        /// Its answer.
        status: Status,
    },
    /// Every attempt failed.
    #[error("request failed on {attempts} attempts, last on {worker}: {status}")]
    AttemptsExhausted {
        /// How many attempts were made.
        attempts: usize,
        /// The last worker tried.
        worker: String,
        /// Its answer.
        status: Status,
    },
    /// A worker serves a newer version of the agent than the one this pool pushed.
    #[error("worker {worker} serves version {served} of `{agent}`, newer than the pushed version {version}: another learner or pool is pushing to it")]
    VersionAhead {
        /// The agent.
        agent: String,
        /// The version pushed and waited for.
        version: u64,
        /// The worker.
        worker: String,
        /// The version it serves.
        served: u64,
    },
    /// Waiting for a policy version timed out.
    #[error("workers not at version {version} of `{agent}` after {waited:?}: {laggards:?}")]
    VersionTimeout {
        /// The agent.
        agent: String,
        /// The version waited for.
        version: u64,
        /// How long.
        waited: Duration,
        /// Workers and the version they report (None: unreachable).
        laggards: Vec<(String, Option<u64>)>,
    },
}

struct Inner {
    cfg: PoolConfig,
    workers: RwLock<HashMap<String, Arc<Worker>>>,
    /// Woken after every refresh and whenever workers are added.
    changed: Notify,
    /// Rotates ties between equally loaded workers.
    tie_breaker: AtomicUsize,
    /// The latest update of every agent, replayed to workers that fall behind.
    replay: Replay,
    failed_attempts: std::sync::atomic::AtomicU64,
    catch_ups: std::sync::atomic::AtomicU64,
    /// The highest `min_policy_version` requests asked of each agent.
    expected: std::sync::Mutex<HashMap<String, u64>>,
    /// When DNS was last resolved.
    resolved_at: std::sync::Mutex<Option<Instant>>,
}

/// A load-balancing, retrying client for many rollout workers; see the module docs.
pub struct RolloutPool {
    inner: Arc<Inner>,
    refresher: tokio::task::JoinHandle<()>,
}

impl Drop for RolloutPool {
    fn drop(&mut self) {
        self.refresher.abort();
    }
}

fn normalise(endpoint: &str) -> String {
    if endpoint.contains("://") { endpoint.to_string() } else { format!("http://{endpoint}") }
}

fn retryable(status: &Status) -> bool {
    matches!(
        status.code(),
        Code::Unavailable
            | Code::Unknown
            | Code::Internal
            | Code::Cancelled
            | Code::Aborted
            | Code::ResourceExhausted
            | Code::DeadlineExceeded
            | Code::FailedPrecondition
    )
}

/// Errors that say the worker itself is in trouble, not just busy or behind.
fn worker_failed(status: &Status) -> bool {
    // Not `Internal`: a worker answers it for a model error one request caused, and is fine.
    matches!(status.code(), Code::Unavailable | Code::Unknown | Code::Cancelled)
}

/// A refusal because the worker's policy is older than the request needs (typed by the worker:
/// see [`cotrain_proto::refusal`]).
fn stale_refusal(status: &Status) -> bool {
    Refusal::of(status) == Some(Refusal::StalePolicy)
}

/// A weight update of `version` refused because the worker already serves exactly that version
/// (a re-push). A worker that serves a *newer* one is not current: it has weights this pool never
/// sent, and leaves rotation.
fn already_current(status: &Status, version: u64) -> bool {
    Refusal::of(status) == Some(Refusal::VersionNotNewer) && refusal::current_version(status) == Some(version)
}

impl RolloutPool {
    /// Builds the pool, resolves and health-checks once, and starts the background refresh.
    pub async fn new(cfg: PoolConfig) -> Result<Self, PoolError> {
        if cfg.endpoints.is_empty() && cfg.dns_names.is_empty() && !cfg.allow_empty {
            return Err(PoolError::Config("no endpoints and no dns_names".into()));
        }
        if cfg.max_attempts == 0 {
            return Err(PoolError::Config("max_attempts must be at least 1".into()));
        }
        let replay = Replay::new(cfg.replay_dir.as_deref());
        let inner = Arc::new(Inner {
            cfg,
            workers: RwLock::new(HashMap::new()),
            changed: Notify::new(),
            tie_breaker: AtomicUsize::new(0),
            replay,
            failed_attempts: Default::default(),
            catch_ups: Default::default(),
            expected: Default::default(),
            resolved_at: Default::default(),
        });
        for e in inner.cfg.endpoints.clone() {
            inner.add(&normalise(&e), Origin::Static)?;
        }
        inner.refresh().await;
        let weak = Arc::downgrade(&inner);
        let every = inner.cfg.health_interval.min(inner.cfg.refresh_interval);
        let refresher = tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                let Some(inner) = weak.upgrade() else { return };
                inner.refresh().await;
            }
        });
        Ok(Self { inner, refresher })
    }

    /// Adds a worker by hand (a worker that registered itself; kept until removed), health-checks
    /// it, and starts bringing it to the current policy versions in the background (a replay of a
    /// large model takes a while; the caller, a registration call, must not wait for it). Returns
    /// whether it is already in rotation.
    pub async fn add_endpoint(&self, endpoint: &str) -> Result<bool, PoolError> {
        let address = normalise(endpoint);
        let w = self.inner.add(&address, Origin::Registered)?;
        if !w.serving() {
            self.inner.check(&w).await;
            if w.healthy.load(Ordering::SeqCst) {
                tokio::spawn(self.inner.clone().catch_up(w.clone()));
            }
        }
        self.inner.changed.notify_waiters();
        Ok(w.serving())
    }

    /// Removes a worker; requests in flight on it finish or fail over as usual.
    pub fn remove_endpoint(&self, endpoint: &str) -> bool {
        match self.inner.workers.write().expect("pool lock").remove(&normalise(endpoint)) {
            Some(w) => {
                w.removed.store(true, Ordering::SeqCst);
                true
            }
            None => false,
        }
    }

    /// Every known worker.
    pub fn workers(&self) -> Vec<WorkerSnapshot> {
        let mut v: Vec<_> = self.inner.workers.read().expect("pool lock").values().map(|w| w.snapshot()).collect();
        v.sort_by(|a, b| a.address.cmp(&b.address));
        v
    }

    /// Generate attempts that failed on a worker (and went to another), over the pool's life,
    /// including workers since removed.
    pub fn failed_attempts(&self) -> u64 {
        self.inner.failed_attempts.load(Ordering::SeqCst)
    }

    /// Catch-ups that replayed updates to a worker, over the pool's life.
    pub fn catch_ups(&self) -> u64 {
        self.inner.catch_ups.load(Ordering::SeqCst)
    }

    /// Re-resolves DNS and health-checks every worker now.
    pub async fn refresh(&self) {
        self.inner.refresh().await;
    }

    /// Waits until at least `n` workers are in rotation (healthy and current).
    pub async fn wait_for_healthy(&self, n: usize, timeout: Duration) -> Result<(), PoolError> {
        let deadline = Instant::now() + timeout;
        loop {
            let notified = self.inner.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.workers().iter().filter(|w| w.in_rotation).count() >= n {
                return Ok(());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || tokio::time::timeout(left, notified).await.is_err() {
                return Err(PoolError::NoWorker(timeout));
            }
        }
    }

    /// Runs one generate request on the least-loaded healthy worker, retrying on another worker
    /// when one fails; returns exactly one answer.
    #[tracing::instrument(skip_all, fields(agent = %req.agent, request_id = %req.request_id))]
    pub async fn generate(&self, req: GenerateRequest) -> Result<GenerateResponse, PoolError> {
        if let Some(v) = req.min_policy_version {
            let mut expected = self.inner.expected.lock().expect("pool lock");
            let e = expected.entry(req.agent.clone()).or_default();
            *e = (*e).max(v);
        }
        let mut tried = HashSet::new();
        let mut last: Option<(String, Status)> = None;
        for attempt in 1..=self.inner.cfg.max_attempts {
            let worker = self.inner.pick(&tried, Some(&req.agent)).await?;
            if !tried.insert(worker.address.clone()) {
                // Every healthy worker has failed this request once (all busy, say): back off
                // before asking one of them again.
                tokio::time::sleep(Duration::from_millis(50 << attempt.min(6))).await;
            }
            let guard = InFlight::new(worker.clone());
            let mut request = tonic::Request::new(req.clone());
            if let Some(t) = self.inner.cfg.request_timeout {
                request.set_timeout(t);
            }
            let mut client = worker.client.clone();
            let result = worker.unless_lost(client.generate(request)).await;
            drop(guard);
            match result {
                Ok(resp) => {
                    worker.completed.fetch_add(1, Ordering::SeqCst);
                    return Ok(resp.into_inner());
                }
                Err(status) if retryable(&status) => {
                    worker.failed.fetch_add(1, Ordering::SeqCst);
                    self.inner.failed_attempts.fetch_add(1, Ordering::SeqCst);
                    if worker_failed(&status) {
                        self.inner.mark_failed(&worker);
                    } else if stale_refusal(&status) {
                        // Restarted, or missed a push: out of rotation until it is caught up.
                        worker.stale_refusals.fetch_add(1, Ordering::SeqCst);
                        worker.bench();
                        tokio::spawn(self.inner.clone().catch_up(worker.clone()));
                    }
                    warn!(worker = %worker.address, attempt, code = ?status.code(), message = status.message(), "generate attempt failed, retrying elsewhere");
                    last = Some((worker.address.clone(), status));
                }
                Err(status) => return Err(PoolError::Rejected { worker: worker.address.clone(), status }),
            }
        }
        let (worker, status) = last.expect("at least one attempt");
        Err(PoolError::AttemptsExhausted { attempts: self.inner.cfg.max_attempts, worker, status })
    }

    /// Scores conversations with the learned verifier `name` on a healthy worker that serves it:
    /// workers are tried least-loaded first; one that does not serve it, or fails, passes the call on.
    pub async fn score_verifier(&self, req: ScoreVerifierRequest) -> Result<ScoreVerifierResponse, PoolError> {
        let mut tried = HashSet::new();
        let mut last: Option<(String, Status)> = None;
        while let Ok(worker) = self.inner.pick(&tried, None).await {
            if !tried.insert(worker.address.clone()) {
                break;
            }
            let guard = InFlight::new(worker.clone());
            let mut request = tonic::Request::new(req.clone());
            if let Some(t) = self.inner.cfg.request_timeout {
                request.set_timeout(t);
            }
            let mut client = worker.client.clone();
            let result = worker.unless_lost(client.score_verifier(request)).await;
            drop(guard);
            match result {
                Ok(resp) => return Ok(resp.into_inner()),
                Err(status) => {
                    let elsewhere = retryable(&status) || Refusal::of(&status) == Some(Refusal::UnknownVerifier);
                    if !elsewhere {
                        return Err(PoolError::Rejected { worker: worker.address.clone(), status });
                    }
                    if worker_failed(&status) {
                        self.inner.mark_failed(&worker);
                    }
                    last = Some((worker.address.clone(), status));
                }
            }
        }
        match last {
            Some((worker, status)) => Err(PoolError::AttemptsExhausted { attempts: tried.len(), worker, status }),
            None => Err(PoolError::NoWorker(self.inner.cfg.wait_for_worker)),
        }
    }

    /// `Info` from every healthy worker.
    pub async fn info_all(&self) -> Vec<(String, Result<InfoResponse, Status>)> {
        self.inner.info_of(self.inner.healthy()).await
    }

    /// Streams a weight update (all or some parameters of `agent`'s model, as `version`) to every
    /// healthy worker at once; returns each worker's answer.
    pub async fn push_weights(
        &self,
        agent: &str,
        version: u64,
        partial: bool,
        tensors: Arc<Vec<UpdatedTensor>>,
    ) -> Vec<(String, Result<UpdateWeightsResponse, Status>)> {
        self.push_weights_except(agent, version, partial, tensors, &HashSet::new()).await
    }

    /// As [`Self::push_weights`], to every healthy worker but those in `skip` (the ones that
    /// already took this version another way).
    pub async fn push_weights_except(
        &self,
        agent: &str,
        version: u64,
        partial: bool,
        tensors: Arc<Vec<UpdatedTensor>>,
        skip: &HashSet<String>,
    ) -> Vec<(String, Result<UpdateWeightsResponse, Status>)> {
        let header = UpdateHeader { agent: agent.to_string(), version, partial, ..UpdateHeader::default() };
        self.push_update_except(header, tensors, skip).await
    }

    /// Streams an update with the given header (agent, version, `partial`, `lora_scaling` for an
    /// adapter; its `tensor_count` is set here from `tensors`) to every healthy worker but those
    /// in `skip`; returns each worker's answer. The update is kept for workers that join later;
    /// workers that refuse it leave rotation until they are caught up.
    pub async fn push_update_except(
        &self,
        mut header: UpdateHeader,
        tensors: Arc<Vec<UpdatedTensor>>,
        skip: &HashSet<String>,
    ) -> Vec<(String, Result<UpdateWeightsResponse, Status>)> {
        header.tensor_count = tensors.len() as u32;
        self.inner.replay.announce(&header.agent, header.version);
        // The update is written to the replay directory while it streams to the workers.
        let keep = {
            let (inner, header, tensors) = (self.inner.clone(), header.clone(), tensors.clone());
            tokio::task::spawn_blocking(move || inner.replay.record_chunks(&header, &tensors))
        };
        let workers: Vec<Arc<Worker>> =
            self.inner.healthy().into_iter().filter(|w| !skip.contains(&w.address) && w.serves(&header.agent)).collect();
        let calls = workers.iter().map(|w| self.inner.send_chunks(w, &header, &tensors));
        let (answers, kept) = futures::future::join(futures::future::join_all(calls), keep).await;
        match kept {
            Ok(Ok(())) => {}
            Ok(Err(why)) => warn!(agent = %header.agent, version = header.version, why, "workers that join later cannot be caught up"),
            Err(e) => warn!(agent = %header.agent, version = header.version, error = %e, "keeping the update for workers that join later failed"),
        }
        self.inner.clone().settle_push(&workers, answers, header.version)
    }

    /// Sends a weight update whose tensors are in a shared-memory file (see [`crate::shm`]) to
    /// every healthy worker at once; returns each worker's answer. The caller keeps the file until
    /// this returns.
    pub async fn push_weights_shm(
        &self,
        agent: &str,
        version: u64,
        partial: bool,
        shm: &ShmWeights,
    ) -> Vec<(String, Result<UpdateWeightsResponse, Status>)> {
        let header = UpdateHeader { agent: agent.to_string(), version, partial, ..UpdateHeader::default() };
        let lock = self.shm_lock(agent);
        let _writing = lock.lock().await;
        self.push_update_shm(header, shm).await
    }

    /// As [`Self::push_weights_shm`], with the given header (as for [`Self::push_update_except`];
    /// its `tensor_count` is set here from `shm`). The caller holds [`Self::shm_lock`] from before
    /// it writes the file until this returns, and keeps the file (it is replayed to workers that
    /// fall behind) until it next writes it under the lock.
    pub async fn push_update_shm(
        &self,
        mut header: UpdateHeader,
        shm: &ShmWeights,
    ) -> Vec<(String, Result<UpdateWeightsResponse, Status>)> {
        header.tensor_count = shm.tensors.len() as u32;
        self.inner.replay.announce(&header.agent, header.version);
        self.inner.replay.record_shm(&header, shm);
        let workers: Vec<Arc<Worker>> = self.inner.healthy().into_iter().filter(|w| w.serves(&header.agent)).collect();
        let calls = workers.iter().map(|w| self.inner.send_shm(w, &header, shm));
        let answers = futures::future::join_all(calls).await;
        self.inner.clone().settle_push(&workers, answers, header.version)
    }

    /// The lock a writer of `agent`'s shared-memory weight file holds while it rewrites the file
    /// and pushes it (catch-ups replaying that file to a worker hold it too).
    pub fn shm_lock(&self, agent: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.inner.replay.lock(agent)
    }

    /// Whether every healthy worker (at least one) is on a loopback address and accepts
    /// shared-memory weight updates (`InfoResponse.shm_weights`); if not, why not.
    pub async fn shm_capable(&self) -> Result<(), String> {
        let infos = self.info_all().await;
        if infos.is_empty() {
            return Err("no healthy worker".into());
        }
        for (addr, info) in infos {
            if !is_loopback(&addr) {
                return Err(format!("worker {addr} is not on a loopback address"));
            }
            match info {
                Ok(i) if i.shm_weights => {}
                Ok(_) => return Err(format!("worker {addr} was not started with {}", crate::shm::SHM_FLAG)),
                Err(s) => return Err(format!("worker {addr}: Info failed: {}", s.message())),
            }
        }
        Ok(())
    }

    /// Waits until every worker in rotation reports at least `version` for `agent` (workers that
    /// refused the push are out of rotation and not waited on).
    pub async fn wait_for_version(&self, agent: &str, version: u64, timeout: Duration) -> Result<(), PoolError> {
        let start = Instant::now();
        loop {
            let mut laggards = Vec::new();
            let serving: Vec<Arc<Worker>> = self.inner.healthy().into_iter().filter(|w| w.serving() && w.serves(agent)).collect();
            for (addr, info) in self.inner.info_of(serving).await {
                // A worker that answers and does not serve the agent (a verifier-only worker) is not waited on.
                if info.as_ref().is_ok_and(|i| !i.agents.iter().any(|a| a.name == agent)) {
                    continue;
                }
                let v = info.ok().and_then(|i| i.agents.iter().find(|a| a.name == agent).map(|a| a.policy_version));
                match v {
                    // Weights this pool never sent (another learner, a stale pool): not this policy.
                    Some(v) if v > version => return Err(PoolError::VersionAhead { agent: agent.into(), version, worker: addr, served: v }),
                    Some(v) if v == version => {}
                    _ => laggards.push((addr, v)),
                }
            }
            if laggards.is_empty() {
                return Ok(());
            }
            if start.elapsed() >= timeout {
                return Err(PoolError::VersionTimeout { agent: agent.into(), version, waited: start.elapsed(), laggards });
            }
            // Polling: a worker exposes its version through Info only.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Whether a worker address (`http://host:port`) is a loopback IP or `localhost`.
pub fn is_loopback(address: &str) -> bool {
    let rest = address.split_once("://").map_or(address, |(_, r)| r);
    let host_port = rest.split('/').next().unwrap_or(rest);
    if let Ok(sa) = host_port.parse::<SocketAddr>() {
        return sa.ip().is_loopback();
    }
    let host = host_port.rsplit_once(':').map_or(host_port, |(h, _)| h);
    host.eq_ignore_ascii_case("localhost")
}

/// The messages of one weight-update stream: the header, then every tensor in chunks of at most
/// `chunk_bytes` payload bytes. Chunks are built as the stream is polled, so a large update is
/// never copied whole.
pub fn update_stream(
    header: UpdateHeader,
    tensors: Arc<Vec<UpdatedTensor>>,
    chunk_bytes: usize,
) -> impl futures::Stream<Item = UpdateWeightsRequest> + Send + 'static {
    let chunk_bytes = chunk_bytes.max(1);
    let plan: Vec<(usize, usize)> = tensors
        .iter()
        .enumerate()
        .flat_map(|(i, t)| (0..t.data.len().div_ceil(chunk_bytes)).map(move |c| (i, c * chunk_bytes)))
        .collect();
    let head = futures::stream::once(async move { UpdateWeightsRequest { item: Some(Item::Header(header)) } });
    let body = futures::stream::iter(plan).map(move |(i, start)| {
        let t = &tensors[i];
        let end = (start + chunk_bytes).min(t.data.len());
        UpdateWeightsRequest {
            item: Some(Item::Chunk(cotrain_proto::rollout::TensorChunk {
                name: t.name.clone(),
                dtype: t.dtype.to_proto() as i32,
                shape: t.shape.clone(),
                offset: start as u64,
                data: t.data[start..end].to_vec(),
            })),
        }
    });
    head.chain(body)
}

use futures::StreamExt as _;

impl Inner {
    fn add(&self, address: &str, origin: Origin) -> Result<Arc<Worker>, PoolError> {
        if let Some(w) = self.workers.read().expect("pool lock").get(address) {
            return Ok(w.clone());
        }
        let endpoint = cotrain_proto::tls::endpoint(address, self.cfg.tls.as_ref())
            .map_err(PoolError::Config)?
            .connect_timeout(self.cfg.connect_timeout)
            .initial_stream_window_size(crate::wire::STREAM_WINDOW_BYTES)
            .initial_connection_window_size(crate::wire::CONNECTION_WINDOW_BYTES)
            .tcp_nodelay(true);
        let w = Arc::new(Worker::new(address, endpoint.connect_lazy(), origin));
        info!(worker = address, ?origin, "rollout worker added to the pool");
        Ok(self.workers.write().expect("pool lock").entry(address.to_string()).or_insert(w).clone())
    }

    fn healthy(&self) -> Vec<Arc<Worker>> {
        self.workers.read().expect("pool lock").values().filter(|w| w.healthy.load(Ordering::SeqCst)).cloned().collect()
    }

    async fn info(&self, w: &Worker) -> (String, Result<InfoResponse, Status>) {
        let mut c = w.client.clone();
        let mut r = tonic::Request::new(InfoRequest {});
        r.set_timeout(self.cfg.connect_timeout);
        (w.address.clone(), c.info(r).await.map(|r| r.into_inner()))
    }

    async fn info_of(&self, workers: Vec<Arc<Worker>>) -> Vec<(String, Result<InfoResponse, Status>)> {
        futures::future::join_all(workers.iter().map(|w| self.info(w))).await
    }

    /// A weight-update request carrying the cluster token, when the pool has one.
    fn authorised<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        if let Some(token) = &self.cfg.cluster_token
            && let Ok(value) = token.bearer().parse()
        {
            request.metadata_mut().insert(cotrain_proto::auth::METADATA_KEY, value);
        }
        request
    }

    async fn send_chunks(
        &self,
        w: &Worker,
        header: &UpdateHeader,
        tensors: &Arc<Vec<UpdatedTensor>>,
    ) -> (String, Result<UpdateWeightsResponse, Status>) {
        let mut request = self.authorised(update_stream(header.clone(), tensors.clone(), self.cfg.weight_chunk_bytes));
        request.set_timeout(self.cfg.push_timeout);
        let mut c = w.client.clone();
        (w.address.clone(), w.unless_lost(c.update_weights(request)).await.map(|r| r.into_inner()))
    }

    async fn send_file(&self, w: &Worker, header: &UpdateHeader, file: Arc<replay::SpillFile>) -> (String, Result<UpdateWeightsResponse, Status>) {
        let mut request = self.authorised(replay::file_update_stream(header.clone(), file, self.cfg.weight_chunk_bytes));
        request.set_timeout(self.cfg.push_timeout);
        let mut c = w.client.clone();
        (w.address.clone(), w.unless_lost(c.update_weights(request)).await.map(|r| r.into_inner()))
    }

    async fn send_shm(&self, w: &Worker, header: &UpdateHeader, shm: &ShmWeights) -> (String, Result<UpdateWeightsResponse, Status>) {
        let msgs = vec![
            UpdateWeightsRequest { item: Some(Item::Header(header.clone())) },
            UpdateWeightsRequest { item: Some(Item::Shm(shm.clone())) },
        ];
        let mut request = self.authorised(futures::stream::iter(msgs));
        request.set_timeout(self.cfg.push_timeout);
        let mut c = w.client.clone();
        (w.address.clone(), w.unless_lost(c.update_weights(request)).await.map(|r| r.into_inner()))
    }

    /// After a push of `version`: a worker that already serves exactly that version (a re-push)
    /// counts as having taken it; workers that refused it leave rotation (failed ones also lose
    /// their health until a check passes); those that took it and were out of rotation are checked
    /// for rotation.
    fn settle_push(
        self: Arc<Self>,
        workers: &[Arc<Worker>],
        answers: Vec<(String, Result<UpdateWeightsResponse, Status>)>,
        version: u64,
    ) -> Vec<(String, Result<UpdateWeightsResponse, Status>)> {
        let answers: Vec<_> = answers
            .into_iter()
            .map(|(addr, answer)| match answer {
                Err(status) if already_current(&status, version) => (addr, Ok(UpdateWeightsResponse { version, ..Default::default() })),
                other => (addr, other),
            })
            .collect();
        for (w, (_, answer)) in workers.iter().zip(&answers) {
            match answer {
                Ok(_) if !w.serving() => {
                    tokio::spawn(self.clone().catch_up(w.clone()));
                }
                Ok(_) => {}
                Err(status) => {
                    warn!(worker = %w.address, code = ?status.code(), message = status.message(), "weight update refused, worker out of rotation");
                    if worker_failed(status) {
                        self.mark_failed(w);
                    } else {
                        w.bench();
                    }
                }
            }
        }
        answers
    }

    /// A worker failed a call: it is unhealthy and out of rotation until a health check (after its
    /// backoff) and a catch-up bring it back.
    fn mark_failed(&self, w: &Worker) {
        w.healthy.store(false, Ordering::SeqCst);
        w.bench();
        let wait = w.backoff.lock().expect("backoff lock").fail(self.cfg.health_interval, self.cfg.max_backoff);
        debug!(worker = %w.address, ?wait, "worker failed, next attempt after backoff");
    }

    /// Brings `w` to the latest version of every agent it serves and puts it in rotation; on
    /// failure it stays out and is retried after its backoff.
    async fn catch_up(self: Arc<Self>, w: Arc<Worker>) {
        if w.catching_up.swap(true, Ordering::SeqCst) {
            return;
        }
        // Cleared however this ends, a dropped future included.
        struct Running<'a>(&'a std::sync::atomic::AtomicBool);
        impl Drop for Running<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::SeqCst);
            }
        }
        let _running = Running(&w.catching_up);
        let result = self.replay_to(&w).await;
        match result {
            Ok(replayed) => {
                w.backoff.lock().expect("backoff lock").reset();
                *w.catch_up_error.lock().expect("worker lock") = None;
                if replayed > 0 {
                    w.catch_ups.fetch_add(1, Ordering::SeqCst);
                    self.catch_ups.fetch_add(1, Ordering::SeqCst);
                }
                if !w.in_rotation.swap(true, Ordering::SeqCst) {
                    info!(worker = %w.address, replayed, "rollout worker at the current policy, in rotation");
                }
                self.changed.notify_waiters();
            }
            Err(why) => {
                let wait = w.backoff.lock().expect("backoff lock").fail(self.cfg.health_interval, self.cfg.max_backoff);
                warn!(worker = %w.address, why, retry_in = ?wait, "cannot bring rollout worker to the current policy");
                *w.catch_up_error.lock().expect("worker lock") = Some(why);
            }
        }
    }

    /// Replays the kept updates `w` is behind on; returns how many. Goes round again when a push
    /// recorded a newer update meanwhile.
    async fn replay_to(&self, w: &Worker) -> Result<usize, String> {
        let mut replayed = 0;
        for _round in 0..5 {
            let generation = self.replay.generation();
            let latest = self.replay.all();
            let (_, info) = self.info(w).await;
            let info = info.map_err(|s| format!("Info failed: {}", s.message()))?;
            *w.agents.lock().expect("worker lock") = Some(info.agents.iter().map(|a| a.name.clone()).collect());
            if latest.is_empty() && self.expected.lock().expect("pool lock").is_empty() {
                return Ok(replayed);
            }
            // Agents the pool updates separately must have weights of their own on the worker: a
            // shared model would take the second agent's push as "not newer" and serve the first's.
            let pushed: HashSet<&str> = latest.iter().map(|l| l.header.agent.as_str()).collect();
            for m in &info.models {
                let shared: Vec<&String> = m.agents.iter().filter(|a| pushed.contains(a.as_str())).collect();
                if shared.len() > 1 {
                    return Err(format!("it serves {shared:?} from one shared model (--share), but they are updated separately"));
                }
            }
            // Versions requests have asked for that this pool has nothing to replay for (another
            // learner rank pushes them): the worker waits until it has them.
            for (agent, &want) in self.expected.lock().expect("pool lock").iter() {
                let served = info.agents.iter().find(|a| &a.name == agent).map(|a| a.policy_version);
                if !pushed.contains(agent.as_str()) && served.is_some_and(|v| v < want) {
                    return Err(format!("`{agent}` is at v{} and requests need v{want}, which this pool does not hold", served.unwrap_or(0)));
                }
            }
            for l in latest {
                let Some(served) = info.agents.iter().find(|a| a.name == l.header.agent).map(|a| a.policy_version) else {
                    continue;
                };
                // A worker with weights newer than any this pool pushed was updated by someone else:
                // it is not at this pool's policy.
                let pushed = self.replay.announced(&l.header.agent).unwrap_or(l.header.version).max(l.header.version);
                if served > pushed {
                    return Err(format!("it serves `{}` v{served}, newer than this pool's v{pushed}: another learner updates it", l.header.agent));
                }
                if served >= l.header.version {
                    continue;
                }
                let (_, answer) = match &l.body {
                    Body::File(file) => self.send_file(w, &l.header, file.clone()).await,
                    Body::Lost(why) => return Err(format!("`{}` v{} was not kept: {why}", l.header.agent, l.header.version)),
                    Body::Shm(shm) => {
                        let lock = self.replay.lock(&l.header.agent);
                        let _reading = lock.lock().await;
                        self.send_shm(w, &l.header, shm).await
                    }
                };
                match answer {
                    Ok(_) => replayed += 1,
                    // A push of a newer version reached the worker meanwhile: fine, go round again.
                    Err(s) if Refusal::of(&s) == Some(Refusal::VersionNotNewer)
                        && refusal::current_version(&s).is_some_and(|v| v >= l.header.version && v <= self.replay.announced(&l.header.agent).unwrap_or(v)) => {}
                    Err(s) => return Err(format!("replaying `{}` v{}: {}", l.header.agent, l.header.version, s.message())),
                }
            }
            if self.replay.generation() == generation {
                return Ok(replayed);
            }
        }
        Err("updates kept arriving while catching up".into())
    }

    /// Health-checks `w`; a worker that passes after being out of rotation is caught up.
    async fn check(&self, w: &Worker) {
        let mut h = w.health.clone();
        let mut req = tonic::Request::new(HealthCheckRequest { service: String::new() });
        req.set_timeout(self.cfg.connect_timeout);
        let ok = matches!(
            tokio::time::timeout(self.cfg.connect_timeout, h.check(req)).await,
            Ok(Ok(r)) if r.get_ref().status == ServingStatus::Serving as i32
        );
        // A worker that was healthy loses its health after two failed checks in a row (one can be a
        // busy moment); one that was not needs one passed check.
        let misses = if ok {
            w.missed_checks.store(0, Ordering::SeqCst);
            0
        } else {
            w.missed_checks.fetch_add(1, Ordering::SeqCst) + 1
        };
        let was = w.healthy.load(Ordering::SeqCst);
        let now = ok || (was && misses < 2);
        w.healthy.store(now, Ordering::SeqCst);
        if was != now {
            info!(worker = %w.address, healthy = now, "rollout worker health changed");
        }
        if !now {
            // It may come back restarted, at version 0.
            w.bench();
            w.backoff.lock().expect("backoff lock").fail(self.cfg.health_interval, self.cfg.max_backoff);
        }
    }

    async fn refresh(self: &Arc<Self>) {
        let resolve_now = {
            let mut at = self.resolved_at.lock().expect("pool lock");
            let due = at.is_none_or(|t| t.elapsed() + Duration::from_millis(10) >= self.cfg.refresh_interval);
            if due {
                *at = Some(Instant::now());
            }
            due
        };
        if resolve_now {
            self.resolve().await;
        }
        self.check_all().await;
    }

    /// Re-resolves the DNS names: new addresses join, addresses that left are dropped.
    async fn resolve(&self) {
        let mut resolved: HashSet<String> = HashSet::new();
        let mut dns_ok = true;
        for name in &self.cfg.dns_names {
            match self.cfg.resolver.resolve(name).await {
                Ok(addrs) => resolved.extend(addrs.iter().map(resolve::worker_address)),
                Err(e) => {
                    dns_ok = false;
                    warn!(name, error = %e, "dns resolution failed, keeping the known workers");
                }
            }
        }
        for a in &resolved {
            if let Err(e) = self.add(a, Origin::Dns) {
                warn!(address = a, error = %e, "cannot add resolved worker");
            }
        }
        if dns_ok {
            self.workers.write().expect("pool lock").retain(|addr, w| {
                let keep = w.origin != Origin::Dns || resolved.contains(addr);
                if !keep {
                    info!(worker = addr, "rollout worker left dns, dropped from the pool");
                    w.removed.store(true, Ordering::SeqCst);
                }
                keep
            });
        }
    }

    async fn check_all(self: &Arc<Self>) {
        // Workers in their backoff are left alone; the others are checked, and caught up when
        // they pass while out of rotation.
        let due: Vec<Arc<Worker>> =
            self.workers.read().expect("pool lock").values().filter(|w| w.serving() || w.backoff_due()).cloned().collect();
        futures::future::join_all(due.iter().map(|w| self.check(w))).await;
        let behind = due.into_iter().filter(|w| w.healthy.load(Ordering::SeqCst) && !w.serving());
        futures::future::join_all(behind.map(|w| self.clone().catch_up(w))).await;
        self.changed.notify_waiters();
    }

    /// The least-loaded worker in rotation that serves `agent` (any, for None), preferring ones
    /// not yet tried for this request.
    async fn pick(&self, tried: &HashSet<String>, agent: Option<&str>) -> Result<Arc<Worker>, PoolError> {
        let deadline = Instant::now() + self.cfg.wait_for_worker;
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let serving: Vec<Arc<Worker>> = self.healthy().into_iter().filter(|w| w.serving()).collect();
            // Workers that serve the agent; when none does, any (its refusal names the unknown agent).
            let with_agent: Vec<Arc<Worker>> = serving.iter().filter(|w| agent.is_none_or(|a| w.serves(a))).cloned().collect();
            let serving = if with_agent.is_empty() { serving } else { with_agent };
            let untried: Vec<_> = serving.iter().filter(|w| !tried.contains(&w.address)).cloned().collect();
            let candidates = if untried.is_empty() { serving } else { untried };
            if !candidates.is_empty() {
                let turn = self.tie_breaker.fetch_add(1, Ordering::Relaxed);
                let n = candidates.len();
                let best = (0..n)
                    .map(|k| &candidates[(turn + k) % n])
                    .min_by_key(|w| w.in_flight.load(Ordering::SeqCst))
                    .expect("non-empty");
                return Ok(best.clone());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            debug!(?left, "no rollout worker in rotation, waiting");
            if left.is_zero() || tokio::time::timeout(left, notified).await.is_err() {
                return Err(PoolError::NoWorker(self.cfg.wait_for_worker));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::WireDType;

    #[test]
    fn update_stream_chunks_every_tensor() {
        let tensors = Arc::new(vec![
            UpdatedTensor { name: "a".into(), dtype: WireDType::Bf16, shape: vec![5], data: vec![1; 10] },
            UpdatedTensor { name: "b".into(), dtype: WireDType::F32, shape: vec![1], data: vec![2; 4] },
        ]);
        let header = UpdateHeader { agent: "x".into(), version: 1, tensor_count: 2, partial: true, lora_scaling: 0.0 };
        let msgs: Vec<UpdateWeightsRequest> = futures::executor::block_on(update_stream(header, tensors, 4).collect());
        assert_eq!(msgs.len(), 1 + 3 + 1);
        assert!(matches!(msgs[0].item, Some(Item::Header(_))));
        let Some(Item::Chunk(c)) = &msgs[3].item else { panic!("expected a chunk") };
        assert_eq!((c.name.as_str(), c.offset, c.data.len()), ("a", 8, 2));
    }

    #[test]
    fn loopback_addresses() {
        assert!(is_loopback("http://127.0.0.1:50061"));
        assert!(is_loopback("http://127.3.2.1:1"));
        assert!(is_loopback("http://[::1]:50061"));
        assert!(is_loopback("http://localhost:50061"));
        assert!(!is_loopback("http://10.0.0.7:50061"));
        assert!(!is_loopback("http://worker-0.rollout:50061"));
        assert!(!is_loopback("http://[::2]:50061"));
    }

    #[tokio::test]
    async fn pool_without_endpoints_is_a_config_error() {
        assert!(matches!(RolloutPool::new(PoolConfig::default()).await, Err(PoolError::Config(_))));
    }

    #[tokio::test]
    async fn unreachable_worker_is_unhealthy_and_requests_time_out() {
        // Port 9 (discard) on loopback refuses connections.
        let cfg = PoolConfig {
            endpoints: vec!["127.0.0.1:9".into()],
            wait_for_worker: Duration::from_millis(200),
            connect_timeout: Duration::from_millis(200),
            ..PoolConfig::default()
        };
        let pool = RolloutPool::new(cfg).await.unwrap();
        assert_eq!(pool.workers().len(), 1);
        assert!(!pool.workers()[0].healthy);
        let e = pool.generate(GenerateRequest::default()).await.unwrap_err();
        assert!(matches!(e, PoolError::NoWorker(_)), "{e}");
    }
}
