//! The rollout service: batched multi-agent generation over gRPC, versioned weight updates and an
//! OpenAI-compatible HTTP API. Its clients (the worker pool, the shared-memory writer) live in
//! `cotrain-rollout-client`; the types both sides share (the weight-update wire types, the
//! shared-memory naming rules) live in `cotrain-proto`, so the worker does not depend on the client
//! (only its tests do, to drive workers through the pool).
//!
//! - [`worker`]: the business logic (agents on models, validation, admission, hand-off).
//! - `batcher`: one engine loop per model on its own thread (continuous batching, weight swaps).
//! - [`weights`]: assembling and validating streamed weight updates.
//! - [`shm`]: reading shared-memory weight updates from clients on the worker's host.
//! - [`service`], [`http`]: the gRPC and OpenAI-compatible HTTP adapters.
//! - [`server`]: `rollout-worker serve`, in a process or embedded in another one.
//! - [`register`]: `serve --register`, the worker's registration with a learner.
//! - [`error`], [`metrics`]: the error enum with its status mapping, Prometheus metrics.

mod batcher;
pub mod error;
pub mod http;
pub mod metrics;
pub mod register;
pub mod server;
pub mod service;
pub mod shm;
pub mod verifier;
pub mod weights;
pub mod worker;

pub use error::WorkerError;
pub use server::{RunningServer, ServeArgs};
pub use worker::{GenerateJob, PromptInput, Worker, WorkerConfig};
