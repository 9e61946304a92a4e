//! The trainer's connections to the services, behind the [`crate::sources::RolloutSource`] and
//! [`crate::sources::RewardSource`] traits:
//!
//! - [`PoolRollout`]: rollout workers over gRPC through the client pool (static endpoints or a DNS
//!   name; load balancing, retries on another worker, workers joining and leaving);
//! - [`GrpcReward`]: the reward server's `Score` over gRPC;
//! - [`embedded`]: a reward server started inside this process on a loopback port (the embedded
//!   default), talked to over the same gRPC;
//! - [`embedded`] also starts a rollout worker (the real gRPC service of `cotrain-rollout-worker`)
//!   inside this process, driven through the same pool as remote workers;
//! - [`EngineRollout`]: the generation engine in this process without a network hop, behind the same
//!   trait (the learning and resume tests use it to test the algorithm in seconds).

pub mod connect;
#[cfg(feature = "embedded")]
pub mod embedded;
#[cfg(not(feature = "embedded"))]
#[path = "embedded_absent.rs"]
pub mod embedded;
mod engine;
mod pool_source;
mod reward_grpc;

pub use engine::EngineRollout;
pub use pool_source::PoolRollout;
pub use reward_grpc::GrpcReward;

/// The name the embedded rollout worker serves `maporl.verifier_path` under.
pub const EMBEDDED_VERIFIER: &str = "maporl";

pub use crate::security::{
    client_tls, cluster_token, insecure, process_token, server_tls, set_cluster_token,
    set_insecure, set_tls,
};

/// A multi-threaded tokio runtime for the gRPC clients and embedded servers; the trainer's own
/// thread blocks on it and keeps the tensor work off it.
pub fn runtime() -> std::io::Result<std::sync::Arc<tokio::runtime::Runtime>> {
    Ok(std::sync::Arc::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("cotrain-io")
            .enable_all()
            .build()?,
    ))
}
