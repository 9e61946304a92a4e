//! What can go wrong using the pool: [`PoolError`].

use std::time::Duration;

use tonic::Status;

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
    #[error(
        "worker {worker} serves version {served} of `{agent}`, newer than the pushed version {version}: another learner or pool is pushing to it"
    )]
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
