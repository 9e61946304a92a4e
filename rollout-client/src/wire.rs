//! The wire types of a weight update: the element types tensors travel in, and one tensor as the
//! client serialises it (and the worker assembles it).

use cotrain_proto::rollout::Dtype;

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

impl UpdatedTensor {
    /// The tensor as a CPU libtorch tensor of its wire dtype.
    pub fn to_tensor(&self) -> tch::Tensor {
        let shape: Vec<i64> = self.shape.clone();
        tch::Tensor::f_from_data_size(&self.data, &shape, self.dtype.kind())
            .expect("byte length checked against the shape during assembly")
    }
}
