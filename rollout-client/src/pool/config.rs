//! How the pool finds and talks to workers: [`PoolConfig`] and its defaults.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use super::resolve::{Resolve, SystemResolver};

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
    /// Start with no worker: they are added later with
    /// [`RolloutPool::add_endpoint`](super::RolloutPool::add_endpoint) (workers that register
    /// themselves).
    pub allow_empty: bool,
    /// The longest wait between attempts to bring back a failed worker (the first waits
    /// `refresh_interval`, each next one twice as long).
    pub max_backoff: Duration,
    /// Where the latest update of every agent is kept for workers that join later (a directory
    /// of its own is made inside and removed with the pool); the system's temporary directory
    /// when `None`. It holds one copy of each agent's weights.
    pub replay_dir: Option<PathBuf>,
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
