//! The client side of cotrain's rollout workers, for learners and other trainers:
//!
//! - [`pool`]: many workers as one (static endpoints, DNS, registered workers), load-balanced and
//!   retried, kept at the current policy by replaying weight updates to workers that fall behind;
//! - [`wire`]: the element types and tensors of a weight update;
//! - [`shm`]: the writer of shared-memory weight updates for workers on the same host.
//!
//! The crate does not link libtorch: a trainer hands it tensors as bytes ([`wire::UpdatedTensor`]).
//! The types the worker shares with it (the wire types, the shared-memory naming rules) are defined
//! in `cotrain-proto`, which both depend on; the worker does not depend on this crate.

pub mod pool;
pub mod shm;

/// The wire types of a weight update, defined in `cotrain-proto` (shared with the worker, free of
/// libtorch) and re-exported so that users of the client import everything from this crate.
pub use cotrain_proto::wire;

pub use pool::{PoolConfig, PoolError, RolloutPool};
