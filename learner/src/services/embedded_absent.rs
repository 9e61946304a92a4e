//! A learner built without the `embedded` feature: no rollout worker or reward server inside this
//! process. A run that would start them (no `rollout.endpoints`/`rollout.dns_name`, or no
//! `reward.endpoint`) stops with an error that says so and names the keys; runs against remote
//! services are unchanged.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::runtime::Runtime;

use crate::error::TrainError;

fn not_built(what: &str, key: &str) -> TrainError {
    TrainError::Config(format!(
        "this learner was built without the `embedded` feature, so it cannot start {what} in its own process: \
         set {key}, or build the learner with `--features embedded` (on by default)"
    ))
}

/// Never made: see the module docs.
pub struct EmbeddedReward {
    /// Its gRPC address.
    pub grpc: SocketAddr,
    /// Its HTTP address.
    pub http: SocketAddr,
}

impl EmbeddedReward {
    /// Refuses: see the module docs.
    pub fn start(_rt: Arc<Runtime>) -> Result<Self, TrainError> {
        Err(not_built("a reward server", "reward.endpoint"))
    }
}

/// Never made: see the module docs.
pub struct EmbeddedRollout {
    /// Its gRPC address.
    pub grpc: SocketAddr,
}

impl EmbeddedRollout {
    /// Refuses: see the module docs.
    pub fn start_with_verifiers(
        _rt: Arc<Runtime>,
        _agents: &[(String, String)],
        _device: tch::Device,
        _kind: tch::Kind,
        _verifiers: Vec<(String, std::path::PathBuf)>,
    ) -> Result<Self, TrainError> {
        Err(not_built(
            "a rollout worker",
            "rollout.endpoints (or rollout.dns_name)",
        ))
    }

    /// Refuses: see the module docs.
    pub fn start_full(
        _rt: Arc<Runtime>,
        _agents: &[(String, String)],
        _device: tch::Device,
        _kind: tch::Kind,
        _verifiers: Vec<(String, std::path::PathBuf)>,
        _adapter_groups: Vec<Vec<String>>,
        _engine: crate::config::RolloutEngine,
    ) -> Result<Self, TrainError> {
        Err(not_built(
            "a rollout worker",
            "rollout.endpoints (or rollout.dns_name)",
        ))
    }
}
