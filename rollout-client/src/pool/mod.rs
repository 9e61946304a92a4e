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
//! `replay`); a worker that appears, comes back after failing, or refuses a request as stale is
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

mod catch_up;
mod config;
mod discovery;
mod error;
mod health;
mod member;
mod push;
mod replay;
pub mod resolve;
mod route;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use cotrain_proto::rollout::{InfoRequest, InfoResponse};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tonic::Status;

pub use config::PoolConfig;
use discovery::normalise;
pub use error::PoolError;
use member::Worker;
pub use member::{Origin, WorkerSnapshot};
pub use push::{is_loopback, update_stream};
use replay::Replay;
pub use resolve::{Resolve, SystemResolver};
pub use route::worker_failed;

struct Inner {
    cfg: PoolConfig,
    workers: RwLock<HashMap<String, Arc<Worker>>>,
    /// Woken after every refresh and whenever workers are added.
    changed: Notify,
    /// Rotates ties between equally loaded workers.
    tie_breaker: AtomicUsize,
    /// The latest update of every agent, replayed to workers that fall behind.
    replay: Replay,
    failed_attempts: AtomicU64,
    catch_ups: AtomicU64,
    /// The highest `min_policy_version` requests asked of each agent.
    expected: Mutex<HashMap<String, u64>>,
    /// When DNS was last resolved.
    resolved_at: Mutex<Option<Instant>>,
}

/// A load-balancing, retrying client for many rollout workers; see the module docs.
pub struct RolloutPool {
    inner: Arc<Inner>,
    refresher: JoinHandle<()>,
}

impl Drop for RolloutPool {
    fn drop(&mut self) {
        self.refresher.abort();
        // The aborted refresher (and any catch-up it spawned) still holds `inner` until the
        // runtime next polls it, so the kept weights are removed here rather than left to `inner`'s
        // drop: the policy copy on disk goes when the pool does, not some time after.
        self.inner.replay.remove_dir();
    }
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
        let refresher = inner.spawn_refresher();
        Ok(Self { inner, refresher })
    }

    /// Every known worker.
    pub fn workers(&self) -> Vec<WorkerSnapshot> {
        let mut v: Vec<_> = self
            .inner
            .workers
            .read()
            .expect("pool lock")
            .values()
            .map(|w| w.snapshot())
            .collect();
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

    /// `Info` from every healthy worker.
    pub async fn info_all(&self) -> Vec<(String, Result<InfoResponse, Status>)> {
        self.inner.info_of(self.inner.healthy()).await
    }
}

impl Inner {
    pub(super) async fn info(&self, w: &Worker) -> (String, Result<InfoResponse, Status>) {
        let mut c = w.client.clone();
        let mut r = tonic::Request::new(InfoRequest {});
        r.set_timeout(self.cfg.connect_timeout);
        (w.address.clone(), c.info(r).await.map(|r| r.into_inner()))
    }

    pub(super) async fn info_of(
        &self,
        workers: Vec<Arc<Worker>>,
    ) -> Vec<(String, Result<InfoResponse, Status>)> {
        futures::future::join_all(workers.iter().map(|w| self.info(w))).await
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use cotrain_proto::rollout::GenerateRequest;

    use super::*;

    #[tokio::test]
    async fn pool_without_endpoints_is_a_config_error() {
        assert!(matches!(
            RolloutPool::new(PoolConfig::default()).await,
            Err(PoolError::Config(_))
        ));
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
