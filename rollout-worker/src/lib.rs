//! The rollout service: batched multi-agent generation over gRPC, versioned weight updates, an
//! OpenAI-compatible HTTP API, and the client pool the learner uses to treat many workers as one.
//!
//! - [`worker`]: the business logic (agents on models, validation, admission, hand-off).
//! - `batcher`: one engine loop per model on its own thread (continuous batching, weight swaps).
//! - [`weights`]: assembling and validating streamed weight updates.
//! - [`shm`]: the shared-memory weight transport for clients on the worker's host.
//! - [`service`], [`http`]: the gRPC and OpenAI-compatible HTTP adapters.
//! - [`server`]: `rollout-worker serve`, in a process or embedded in another one.
//! - [`pool`]: the load-balancing, retrying client pool.
//! - [`error`], [`metrics`]: the error enum with its status mapping, Prometheus metrics.

mod batcher;
pub mod error;
pub mod http;
pub mod metrics;
pub mod pool;
pub mod register;
pub mod server;
pub mod service;
pub mod shm;
pub mod verifier;
pub mod weights;
pub mod worker;

pub use error::WorkerError;
pub use pool::{PoolConfig, PoolError, RolloutPool};
pub use server::{RunningServer, ServeArgs};
pub use worker::{GenerateJob, PromptInput, Worker, WorkerConfig};
