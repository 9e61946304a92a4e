//! cotrain's gRPC protocols. Each service's `.proto` lives in `proto/proto/`; the generated
//! code is included here and never committed.
//!
//! Beside the generated code, the plain types that both sides of a call need, kept here so that
//! neither side depends on the other and the crate stays free of libtorch (the `tch` feature adds one conversion for the sides that hold
//! tensors):
//!
//! - [`wire`]: the element types and tensors of a weight update (client and worker);
//! - [`shm`]: the naming rules of shared-memory weight updates (client and worker);
//! - [`reward_options`]: the reward service's scoring options (learner config and reward server);
//! - [`retry`]: which gRPC failures are worth another attempt (reward client and rollout pool).

pub mod auth;
#[cfg(feature = "logging")]
pub mod logging;
pub mod refusal;
pub mod retry;
pub mod reward_options;
pub mod shm;
pub mod tls;
pub mod wire;

/// Encoded `FileDescriptorSet` of every cotrain proto, for gRPC reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("cotrain_descriptor");

/// The reward service: scoring joint actions, code diagnostics, sandboxed execution.
pub mod reward {
    tonic::include_proto!("cotrain.reward.v1");
}

/// The rollout service: batched generation, versioned weight updates, worker info.
pub mod rollout {
    tonic::include_proto!("cotrain.rollout.v1");
}

/// The learner's control plane: worker registration, run status, checkpoint and stop.
pub mod control {
    tonic::include_proto!("cotrain.control.v1");
}
