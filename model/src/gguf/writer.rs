//! A small GGUF v3 writer: metadata plus tensors given as raw stored bytes or `f32` values.
//!
//! It exists so tests can build tiny GGUF checkpoints with known contents (and so tools can
//! export small models); it does not quantise.

use std::io::Write;
use std::path::Path;

use super::{DEFAULT_ALIGNMENT, GgmlType, GgufError, MetaValue, Result};

struct PendingTensor {
    name: String,
    /// Row-major shape.
    shape: Vec<usize>,
    ty: GgmlType,
    data: Vec<u8>,
}

/// Collects metadata and tensors, then serialises them as one GGUF v3 file.
#[derive(Default)]
pub struct GgufWriter {
    metadata: Vec<(String, MetaValue)>,
    tensors: Vec<PendingTensor>,
    alignment: Option<u64>,
}

impl GgufWriter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a metadata entry (entries are written in insertion order). GGUF arrays are
    /// homogeneous: the element type is taken from the first item, so all items of a
    /// [`MetaValue::Array`] must be of the same variant.
    pub fn metadata(&mut self, key: impl Into<String>, value: MetaValue) -> &mut Self {
        let key = key.into();
        if key == "general.alignment" {
            self.alignment = value.as_i128().map(|a| a as u64);
        }
        self.metadata.push((key, value));
        self
    }

    /// Adds a tensor from its stored bytes; `shape` is row-major (PyTorch order).
    pub fn tensor_bytes(
        &mut self,
        name: impl Into<String>,
        shape: &[usize],
        ty: GgmlType,
        data: Vec<u8>,
    ) -> Result<&mut Self> {
        let name = name.into();
        let (block, size) = ty
            .block_layout()
            .ok_or_else(|| GgufError::UnsupportedType {
                tensor: name.clone(),
                ty,
            })?;
        let n: usize = shape.iter().product();
        let inner = shape.last().copied().unwrap_or(1);
        if !inner.is_multiple_of(block) || data.len() != n / block * size {
            return Err(GgufError::SizeMismatch(format!(
                "tensor `{name}`: {} bytes do not hold {shape:?} of {ty}",
                data.len()
            )));
        }
        self.tensors.push(PendingTensor {
            name,
            shape: shape.to_vec(),
            ty,
            data,
        });
        Ok(self)
    }

    /// Adds an F32 tensor.
    pub fn tensor_f32(
        &mut self,
        name: impl Into<String>,
        shape: &[usize],
        values: &[f32],
    ) -> Result<&mut Self> {
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.tensor_bytes(name, shape, GgmlType::F32, data)
    }

    /// Adds an F16 tensor (values are rounded to half precision).
    pub fn tensor_f16(
        &mut self,
        name: impl Into<String>,
        shape: &[usize],
        values: &[f32],
    ) -> Result<&mut Self> {
        let data = values
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_bits().to_le_bytes())
            .collect();
        self.tensor_bytes(name, shape, GgmlType::F16, data)
    }

    /// Serialises the file.
    pub fn to_bytes(&self) -> Vec<u8> {
        let alignment = self
            .alignment
            .filter(|a| a.is_power_of_two())
            .unwrap_or(DEFAULT_ALIGNMENT) as usize;
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            put_string(&mut out, key);
            out.extend_from_slice(&value_type(value).to_le_bytes());
            put_value(&mut out, value);
        }
        let mut offset = 0usize;
        let mut offsets = Vec::with_capacity(self.tensors.len());
        for t in &self.tensors {
            put_string(&mut out, &t.name);
            out.extend_from_slice(&(t.shape.len() as u32).to_le_bytes());
            for &d in t.shape.iter().rev() {
                out.extend_from_slice(&(d as u64).to_le_bytes());
            }
            out.extend_from_slice(&t.ty.to_u32().to_le_bytes());
            out.extend_from_slice(&(offset as u64).to_le_bytes());
            offsets.push(offset);
            offset = (offset + t.data.len()).div_ceil(alignment) * alignment;
        }
        let data_start = out.len().div_ceil(alignment) * alignment;
        out.resize(data_start, 0);
        for (t, off) in self.tensors.iter().zip(offsets) {
            out.resize(data_start + off, 0);
            out.extend_from_slice(&t.data);
        }
        out
    }

    /// Writes the file to `path`.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let io = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut f = std::fs::File::create(path).map_err(io)?;
        f.write_all(&self.to_bytes()).map_err(io)
    }
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn value_type(v: &MetaValue) -> u32 {
    match v {
        MetaValue::U8(_) => 0,
        MetaValue::I8(_) => 1,
        MetaValue::U16(_) => 2,
        MetaValue::I16(_) => 3,
        MetaValue::U32(_) => 4,
        MetaValue::I32(_) => 5,
        MetaValue::F32(_) => 6,
        MetaValue::Bool(_) => 7,
        MetaValue::String(_) => 8,
        MetaValue::Array(_) => 9,
        MetaValue::U64(_) => 10,
        MetaValue::I64(_) => 11,
        MetaValue::F64(_) => 12,
    }
}

fn put_value(out: &mut Vec<u8>, v: &MetaValue) {
    match v {
        MetaValue::U8(x) => out.push(*x),
        MetaValue::I8(x) => out.push(*x as u8),
        MetaValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::Bool(x) => out.push(*x as u8),
        MetaValue::String(s) => put_string(out, s),
        MetaValue::Array(items) => {
            // An empty array is written with element type u8; readers accept any type for zero items.
            let elem = items.first().map_or(0, value_type);
            out.extend_from_slice(&elem.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                put_value(out, item);
            }
        }
    }
}
