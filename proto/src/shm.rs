//! The naming rules of shared-memory weight updates, which a client writing an update file
//! (`cotrain_rollout_client::shm::ShmFile`) and a worker reading it (`cotrain_rollout_worker::shm`)
//! must agree on. The file's layout is described by the [`ShmWeights`](crate::rollout::ShmWeights)
//! message (see `rollout.proto`): a regular file of exactly `size` bytes directly in [`SHM_DIR`],
//! named [`SHM_PREFIX`]`*`, holding each tensor's bytes ([`crate::wire`]'s dtypes, row-major,
//! little-endian) at its `offset`, without overlap.
//!
//! Only these constants live here, so that the worker need not depend on the client; the writer
//! stays in the client, the reader in the worker.

/// The only directory shared-memory updates are read from.
pub const SHM_DIR: &str = "/dev/shm";
/// The file-name prefix every shared-memory update file must carry.
pub const SHM_PREFIX: &str = "cotrain-weights-";
/// The `serve` flag that enables the transport, for error messages.
pub const SHM_FLAG: &str = "--allow-shm-weights";
