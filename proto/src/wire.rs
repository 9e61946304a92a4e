//! The wire types of a weight update: the element types tensors travel in, one tensor as a client
//! serialises it (and a worker assembles it), and the HTTP/2 windows both sides set for uploads.
//!
//! They live in the protocol crate rather than in `cotrain-rollout-client` or the worker because
//! both sides need them and neither should pull in the other: the client (which other trainers
//! link) stays free of libtorch, and the worker does not depend on the client. The libtorch kind of a
//! wire type ([`WireDType::kind`]) is behind the `tch` feature, which only the learner and the worker
//! enable; tensor conversions live where tensors are made (`cotrain_rollout_worker::weights`).

use crate::rollout::Dtype;

/// HTTP/2 receive windows. The 64 KiB default makes a weight upload wait for a window update
/// every 64 KiB, which on a loaded machine caps it at tens of MB/s; workers and clients both use these.
pub const STREAM_WINDOW_BYTES: u32 = 16 << 20;
/// Connection-level HTTP/2 receive window (several streams share it).
pub const CONNECTION_WINDOW_BYTES: u32 = 64 << 20;

/// Element type of the bytes of an updated tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WireDType {
    /// IEEE float32, little-endian.
    F32,
    /// bfloat16, little-endian.
    Bf16,
}

impl WireDType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::Bf16 => 2,
        }
    }

    /// The libtorch kind of the bytes.
    #[cfg(feature = "tch")]
    pub fn kind(self) -> tch::Kind {
        match self {
            Self::F32 => tch::Kind::Float,
            Self::Bf16 => tch::Kind::BFloat16,
        }
    }

    /// The protocol's enum value.
    pub fn to_proto(self) -> Dtype {
        match self {
            Self::F32 => Dtype::F32,
            Self::Bf16 => Dtype::Bf16,
        }
    }

    /// From the protocol's enum value; `None` for an unknown or unspecified one.
    pub fn from_proto(raw: i32) -> Option<Self> {
        match Dtype::try_from(raw).ok()? {
            Dtype::F32 => Some(Self::F32),
            Dtype::Bf16 => Some(Self::Bf16),
            Dtype::Unspecified => None,
        }
    }
}

/// One fully received tensor.
#[derive(Clone, Debug)]
pub struct UpdatedTensor {
    /// Parameter name as the model knows it.
    pub name: String,
    /// Element type of `data`.
    pub dtype: WireDType,
    /// Shape, equal to the parameter's.
    pub shape: Vec<i64>,
    /// Row-major little-endian bytes.
    pub data: Vec<u8>,
}

/// A rollout worker's `--max-batch-size` unless set: the most sequences one model decodes together,
/// and so the largest `n` one generate request may ask for. Here because clients that split large
/// asks fall back on it when a worker does not say its own.
pub const DEFAULT_MAX_BATCH_SIZE: usize = 64;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtypes_round_trip_through_the_protocol_enum() {
        for d in [WireDType::F32, WireDType::Bf16] {
            assert_eq!(WireDType::from_proto(d.to_proto() as i32), Some(d));
        }
        assert_eq!(WireDType::from_proto(Dtype::Unspecified as i32), None);
        assert_eq!(WireDType::from_proto(99), None);
        assert_eq!((WireDType::F32.size(), WireDType::Bf16.size()), (4, 2));
    }
}
