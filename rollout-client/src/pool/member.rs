//! One worker as the pool sees it: its clients, its health, whether it is in rotation (at the
//! pool's current policy versions), its load and its retry schedule.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cotrain_proto::rollout::rollout_client::RolloutClient;
use tonic::transport::Channel;
use tonic_health::pb::health_client::HealthClient;

/// Where a worker came from; only DNS workers are dropped when their name stops resolving to them,
/// only registered ones when they deregister or stop heartbeating.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// `PoolConfig::endpoints`.
    Static,
    /// An address of one of `PoolConfig::dns_names`.
    Dns,
    /// Added by [`super::RolloutPool::add_endpoint`] (a worker that registered itself).
    Registered,
}

/// A worker as the pool sees it, for status pages and tests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerSnapshot {
    /// `http://host:port`.
    pub address: String,
    /// Passed its last health check and has not failed since.
    pub healthy: bool,
    /// Healthy and at the pool's current version of every agent it serves: only such workers get
    /// generate requests.
    pub in_rotation: bool,
    /// Requests this pool has in flight on it.
    pub in_flight: usize,
    /// Requests it answered for this pool.
    pub completed: u64,
    /// Attempts on it that failed.
    pub failed: u64,
    /// Requests it refused because its policy was older than the request needed.
    pub stale_refusals: u64,
    /// Times the pool brought it to the current policy versions by replaying the latest updates.
    pub catch_ups: u64,
    /// Why the last attempt to bring it to the current policy failed (cleared when one succeeds).
    pub catch_up_error: Option<String>,
    /// Where it came from.
    pub origin: Origin,
}

/// Exponential backoff between attempts to bring a failed or stale worker back.
#[derive(Debug)]
pub(super) struct Backoff {
    failures: u32,
    retry_at: Option<Instant>,
}

impl Backoff {
    const fn new() -> Self {
        Self {
            failures: 0,
            retry_at: None,
        }
    }

    /// Records a failure; the next attempt waits `base · 2^(failures-1)`, at most `max`.
    pub(super) fn fail(&mut self, base: Duration, max: Duration) -> Duration {
        self.failures = self.failures.saturating_add(1);
        let wait = base
            .saturating_mul(1u32 << (self.failures - 1).min(16))
            .min(max);
        self.retry_at = Some(Instant::now() + wait);
        wait
    }

    pub(super) fn reset(&mut self) {
        *self = Self::new();
    }

    /// Whether an attempt may be made now.
    pub(super) fn due(&self) -> bool {
        self.retry_at.is_none_or(|t| Instant::now() >= t)
    }
}

pub(super) struct Worker {
    pub(super) address: String,
    pub(super) client: RolloutClient<Channel>,
    pub(super) health: HealthClient<Channel>,
    pub(super) origin: Origin,
    pub(super) healthy: AtomicBool,
    /// Health checks failed in a row.
    pub(super) missed_checks: std::sync::atomic::AtomicU32,
    /// Dropped from the pool (left DNS, deregistered): calls still in flight on it are abandoned.
    pub(super) removed: AtomicBool,
    pub(super) in_rotation: AtomicBool,
    /// A catch-up is running; a second one would only repeat it.
    pub(super) catching_up: AtomicBool,
    pub(super) in_flight: AtomicUsize,
    pub(super) completed: AtomicU64,
    pub(super) failed: AtomicU64,
    pub(super) stale_refusals: AtomicU64,
    pub(super) catch_ups: AtomicU64,
    pub(super) catch_up_error: std::sync::Mutex<Option<String>>,
    /// The agents it serves, as its last `Info` said (None: not asked yet). A worker that serves
    /// only a verifier, or other agents, gets no generate request or push for an agent it lacks.
    pub(super) agents: std::sync::Mutex<Option<std::collections::HashSet<String>>>,
    pub(super) backoff: Mutex<Backoff>,
}

impl Worker {
    pub(super) fn new(address: &str, channel: Channel, origin: Origin) -> Self {
        Self {
            address: address.to_string(),
            client: RolloutClient::new(channel.clone())
                .max_decoding_message_size(usize::MAX)
                .max_encoding_message_size(usize::MAX),
            health: HealthClient::new(channel),
            origin,
            healthy: AtomicBool::new(false),
            missed_checks: Default::default(),
            removed: AtomicBool::new(false),
            in_rotation: AtomicBool::new(false),
            catching_up: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
            completed: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            stale_refusals: AtomicU64::new(0),
            catch_ups: AtomicU64::new(0),
            catch_up_error: std::sync::Mutex::new(None),
            agents: std::sync::Mutex::new(None),
            backoff: Mutex::new(Backoff::new()),
        }
    }

    pub(super) fn snapshot(&self) -> WorkerSnapshot {
        WorkerSnapshot {
            address: self.address.clone(),
            healthy: self.healthy.load(Ordering::SeqCst),
            in_rotation: self.serving(),
            in_flight: self.in_flight.load(Ordering::SeqCst),
            completed: self.completed.load(Ordering::SeqCst),
            failed: self.failed.load(Ordering::SeqCst),
            stale_refusals: self.stale_refusals.load(Ordering::SeqCst),
            catch_ups: self.catch_ups.load(Ordering::SeqCst),
            catch_up_error: self.catch_up_error.lock().expect("worker lock").clone(),
            origin: self.origin,
        }
    }

    /// Whether it serves `agent` (true while not known).
    pub(super) fn serves(&self, agent: &str) -> bool {
        self.agents
            .lock()
            .expect("worker lock")
            .as_ref()
            .is_none_or(|a| a.contains(agent))
    }

    /// Healthy and in rotation: may get generate requests.
    pub(super) fn serving(&self) -> bool {
        self.healthy.load(Ordering::SeqCst) && self.in_rotation.load(Ordering::SeqCst)
    }

    /// Takes the worker out of rotation until a catch-up brings it back.
    pub(super) fn bench(&self) {
        self.in_rotation.store(false, Ordering::SeqCst);
    }

    /// Runs `call` unless the worker is lost first (fails a health check or leaves the pool): a
    /// frozen or partitioned worker must not hold a request or a push until its deadline.
    pub(super) async fn unless_lost<T>(
        &self,
        call: impl std::future::Future<Output = Result<T, tonic::Status>>,
    ) -> Result<T, tonic::Status> {
        let lost = async {
            loop {
                if !self.healthy.load(Ordering::SeqCst) || self.removed.load(Ordering::SeqCst) {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        };
        tokio::select! {
            r = call => r,
            () = lost => Err(tonic::Status::unavailable(format!("worker {} was lost (failed a health check or left the pool) during the call", self.address))),
        }
    }

    pub(super) fn backoff_due(&self) -> bool {
        self.backoff.lock().expect("backoff lock").due()
    }
}

/// Counts a request in flight on a worker for as long as it lives.
pub(super) struct InFlight(Arc<Worker>);

impl InFlight {
    pub(super) fn new(w: Arc<Worker>) -> Self {
        w.in_flight.fetch_add(1, Ordering::SeqCst);
        Self(w)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_its_cap_and_resets() {
        let mut b = Backoff::new();
        assert!(b.due());
        let base = Duration::from_millis(100);
        let max = Duration::from_millis(350);
        assert_eq!(b.fail(base, max), Duration::from_millis(100));
        assert!(!b.due());
        assert_eq!(b.fail(base, max), Duration::from_millis(200));
        assert_eq!(b.fail(base, max), Duration::from_millis(350));
        assert_eq!(b.fail(base, max), Duration::from_millis(350));
        b.reset();
        assert!(b.due());
        assert_eq!(b.fail(base, max), Duration::from_millis(100));
    }
}
