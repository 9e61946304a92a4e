//! Discovery: which workers the pool knows, from static endpoints, DNS names (re-resolved: new
//! addresses join, those that left are dropped) and workers that register themselves.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use tracing::{info, warn};

use super::member::{Origin, Worker};
use super::resolve;
use super::{Inner, PoolError, RolloutPool};

/// A worker address with its scheme (`http://` when it has none).
pub(super) fn normalise(endpoint: &str) -> String {
    if endpoint.contains("://") {
        endpoint.to_string()
    } else {
        format!("http://{endpoint}")
    }
}

impl RolloutPool {
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
        match self
            .inner
            .workers
            .write()
            .expect("pool lock")
            .remove(&normalise(endpoint))
        {
            Some(w) => {
                w.removed.store(true, Ordering::SeqCst);
                true
            }
            None => false,
        }
    }
}

impl Inner {
    pub(super) fn add(&self, address: &str, origin: Origin) -> Result<Arc<Worker>, PoolError> {
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
        info!(
            worker = address,
            ?origin,
            "rollout worker added to the pool"
        );
        Ok(self
            .workers
            .write()
            .expect("pool lock")
            .entry(address.to_string())
            .or_insert(w)
            .clone())
    }

    /// Re-resolves the DNS names: new addresses join, addresses that left are dropped.
    pub(super) async fn resolve(&self) {
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
                    info!(
                        worker = addr,
                        "rollout worker left dns, dropped from the pool"
                    );
                    w.removed.store(true, Ordering::SeqCst);
                }
                keep
            });
        }
    }
}
