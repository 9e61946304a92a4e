//! Health: checking every worker on a schedule (the background refresher), taking failed ones
//! out of rotation with a backoff, and waiting for enough workers in rotation.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::task::JoinHandle;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tracing::{debug, info};

use super::member::Worker;
use super::{Inner, PoolError, RolloutPool};

impl RolloutPool {
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
}

impl Inner {
    /// Starts the background task that re-resolves DNS and health-checks every worker on the pool's
    /// schedule; it holds the pool weakly and ends with it.
    pub(super) fn spawn_refresher(self: &Arc<Self>) -> JoinHandle<()> {
        let weak = Arc::downgrade(self);
        let every = self.cfg.health_interval.min(self.cfg.refresh_interval);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                let Some(inner) = weak.upgrade() else { return };
                inner.refresh().await;
            }
        })
    }

    pub(super) fn healthy(&self) -> Vec<Arc<Worker>> {
        self.workers
            .read()
            .expect("pool lock")
            .values()
            .filter(|w| w.healthy.load(Ordering::SeqCst))
            .cloned()
            .collect()
    }

    /// A worker failed a call: it is unhealthy and out of rotation until a health check (after its
    /// backoff) and a catch-up bring it back.
    pub(super) fn mark_failed(&self, w: &Worker) {
        w.healthy.store(false, Ordering::SeqCst);
        w.bench();
        let wait = w
            .backoff
            .lock()
            .expect("backoff lock")
            .fail(self.cfg.health_interval, self.cfg.max_backoff);
        debug!(worker = %w.address, ?wait, "worker failed, next attempt after backoff");
    }

    /// Health-checks `w`; a worker that passes after being out of rotation is caught up.
    pub(super) async fn check(&self, w: &Worker) {
        let mut h = w.health.clone();
        let mut req = tonic::Request::new(HealthCheckRequest {
            service: String::new(),
        });
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
            w.backoff
                .lock()
                .expect("backoff lock")
                .fail(self.cfg.health_interval, self.cfg.max_backoff);
        }
    }

    pub(super) async fn refresh(self: &Arc<Self>) {
        let resolve_now = {
            let mut at = self.resolved_at.lock().expect("pool lock");
            let due = at.is_none_or(|t| {
                t.elapsed() + Duration::from_millis(10) >= self.cfg.refresh_interval
            });
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

    async fn check_all(self: &Arc<Self>) {
        // Workers in their backoff are left alone; the others are checked, and caught up when
        // they pass while out of rotation.
        let due: Vec<Arc<Worker>> = self
            .workers
            .read()
            .expect("pool lock")
            .values()
            .filter(|w| w.serving() || w.backoff_due())
            .cloned()
            .collect();
        futures::future::join_all(due.iter().map(|w| self.check(w))).await;
        let behind = due
            .into_iter()
            .filter(|w| w.healthy.load(Ordering::SeqCst) && !w.serving());
        futures::future::join_all(behind.map(|w| self.clone().catch_up(w))).await;
        self.changed.notify_waiters();
    }
}
