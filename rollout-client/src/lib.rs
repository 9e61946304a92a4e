//! The client side of cotrain's rollout workers, for learners and other trainers:
//!
//! - [`pool`]: many workers as one (static endpoints, DNS, registered workers), load-balanced and
//!   retried, kept at the current policy by replaying weight updates to workers that fall behind;
//! - [`wire`]: the element types and tensors of a weight update;
//! - [`shm`]: the writer of shared-memory weight updates for workers on the same host.
//!
//! The worker itself (`cotrain-rollout-worker`) depends on this crate for the wire types, not the
//! other way round.

pub mod pool;
pub mod shm;
pub mod wire;

pub use pool::{PoolConfig, PoolError, RolloutPool};

/// HTTP/2 receive windows. The 64 KiB default makes a weight upload wait for a window update
/// every 64 KiB, which on a loaded machine caps it at tens of MB/s; workers and clients both use these.
pub const STREAM_WINDOW_BYTES: u32 = 16 << 20;
/// Connection-level HTTP/2 receive window (several streams share it).
pub const CONNECTION_WINDOW_BYTES: u32 = 64 << 20;
