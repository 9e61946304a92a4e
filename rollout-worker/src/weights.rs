//! Assembling a streamed weight update.
//!
//! An update arrives as one header and any number of byte-range chunks per tensor. The
//! [`UpdateAssembler`] checks every chunk against the model's parameters as it arrives (known
//! name, same shape, a supported dtype, a range inside the tensor that overlaps no earlier chunk)
//! and, at the end of the stream, that every announced tensor is complete and, for a full update,
//! that every parameter came. Only a [`CompleteUpdate`] can be applied, so a broken or partial
//! stream never touches the model's weights.

use std::collections::{BTreeMap, HashMap};

use cotrain_proto::rollout::{Dtype, TensorChunk, UpdateHeader};

use crate::error::{Result, WorkerError};

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

    fn from_proto(raw: i32) -> Option<Self> {
        match Dtype::try_from(raw).ok()? {
            Dtype::F32 => Some(Self::F32),
            Dtype::Bf16 => Some(Self::Bf16),
            Dtype::Unspecified => None,
        }
    }
}

/// One fully received tensor.
#[derive(Debug)]
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

/// A validated update, ready to be swapped in.
#[derive(Debug)]
pub struct CompleteUpdate {
    /// The agent the update was sent for.
    pub agent: String,
    /// The policy version the weights become.
    pub version: u64,
    /// The updated tensors that came as chunks, in the order their first chunk arrived.
    pub tensors: Vec<UpdatedTensor>,
    /// The updated tensors that came whole (the shared-memory transport), read straight into
    /// CPU tensors of their wire dtype, in the order they came.
    pub loaded: Vec<(String, tch::Tensor)>,
    /// Payload bytes received.
    pub bytes_received: u64,
}

impl CompleteUpdate {
    /// How many tensors the update replaces.
    pub fn len(&self) -> usize {
        self.tensors.len() + self.loaded.len()
    }

    /// Whether it replaces none (never, once validated).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every tensor, converted to the model's dtype and device (blocking work: call it off the
    /// async runtime).
    pub fn into_tensors(self, kind: tch::Kind, device: tch::Device) -> HashMap<String, tch::Tensor> {
        let chunked = self.tensors.into_iter().map(|t| {
            let tensor = t.to_tensor();
            (t.name, tensor)
        });
        chunked.chain(self.loaded).map(|(name, t)| (name, t.to_kind(kind).to_device(device))).collect()
    }
}

struct PartialTensor {
    dtype: WireDType,
    shape: Vec<i64>,
    /// The bytes of a chunked tensor (empty for one that came whole).
    data: Vec<u8>,
    /// A tensor that came whole.
    whole: Option<tch::Tensor>,
    /// numel * dtype size.
    total: u64,
    /// Received byte ranges, start → end, non-overlapping.
    ranges: BTreeMap<u64, u64>,
    received: u64,
    order: usize,
}

/// Collects the chunks of one update stream; see the module docs.
pub struct UpdateAssembler {
    header: UpdateHeader,
    params: HashMap<String, Vec<i64>>,
    tensors: HashMap<String, PartialTensor>,
    bytes_received: u64,
}

impl UpdateAssembler {
    /// Starts an update against a model with the given parameters (name → shape), whose current
    /// policy version is `current_version`.
    pub fn new(header: UpdateHeader, params: HashMap<String, Vec<i64>>, current_version: u64) -> Result<Self> {
        if header.version <= current_version {
            return Err(WorkerError::VersionNotNewer { current: current_version, offered: header.version });
        }
        if header.tensor_count == 0 {
            return Err(WorkerError::BadUpdate("header.tensor_count is 0".into()));
        }
        if !header.partial && header.tensor_count as usize != params.len() {
            return Err(WorkerError::BadUpdate(format!(
                "a full update must carry all {} parameters, header.tensor_count is {}",
                params.len(),
                header.tensor_count
            )));
        }
        Ok(Self { header, params, tensors: HashMap::new(), bytes_received: 0 })
    }

    /// Checks a tensor's name, dtype and shape against the model and, for a tensor not seen
    /// before, against `header.tensor_count`; returns its dtype and byte size.
    fn check_tensor(&self, name: &str, raw_dtype: i32, shape: &[i64]) -> Result<(WireDType, u64)> {
        let bad = |msg: String| Err(WorkerError::BadUpdate(format!("tensor `{name}`: {msg}")));
        let Some(expected) = self.params.get(name) else {
            return bad("no parameter of that name in the model".into());
        };
        let Some(dtype) = WireDType::from_proto(raw_dtype) else {
            return bad(format!("unsupported dtype {raw_dtype} (expected DTYPE_F32 or DTYPE_BF16)"));
        };
        if shape != expected.as_slice() {
            return bad(format!("shape {shape:?} does not match the model's {expected:?}"));
        }
        if !self.tensors.contains_key(name) && self.tensors.len() >= self.header.tensor_count as usize {
            return bad(format!("more tensors than header.tensor_count ({})", self.header.tensor_count));
        }
        let numel: i64 = expected.iter().product();
        Ok((dtype, numel as u64 * dtype.size() as u64))
    }

    /// Adds one chunk, checking it against the model and against earlier chunks.
    pub fn push(&mut self, chunk: TensorChunk) -> Result<()> {
        let bad = |msg: String| Err(WorkerError::BadUpdate(format!("tensor `{}`: {msg}", chunk.name)));
        let (dtype, total) = self.check_tensor(&chunk.name, chunk.dtype, &chunk.shape)?;
        let order = self.tensors.len();
        let t = self.tensors.entry(chunk.name.clone()).or_insert_with(|| PartialTensor {
            dtype,
            shape: chunk.shape.clone(),
            data: vec![0; total as usize],
            whole: None,
            total,
            ranges: BTreeMap::new(),
            received: 0,
            order,
        });
        if t.dtype != dtype {
            return bad(format!("dtype changed between chunks ({:?} then {:?})", t.dtype, dtype));
        }
        let start = chunk.offset;
        let end = start.saturating_add(chunk.data.len() as u64);
        if chunk.data.is_empty() {
            return bad(format!("empty chunk at offset {start}"));
        }
        if end > total {
            return bad(format!("bytes {start}..{end} run past the tensor's {total} bytes"));
        }
        let overlaps_before = t.ranges.range(..=start).next_back().is_some_and(|(_, &e)| e > start);
        let overlaps_after = t.ranges.range(start..).next().is_some_and(|(&s, _)| s < end);
        if overlaps_before || overlaps_after {
            return bad(format!("bytes {start}..{end} overlap an earlier chunk"));
        }
        t.data[start as usize..end as usize].copy_from_slice(&chunk.data);
        t.ranges.insert(start, end);
        t.received += end - start;
        self.bytes_received += end - start;
        Ok(())
    }

    /// Adds a whole tensor at once (the shared-memory transport), with the same checks as
    /// [`Self::push`]: `fill` gets a buffer of exactly the tensor's byte size, once the name,
    /// dtype and shape have passed, so nothing is read for a tensor the model would refuse.
    pub fn push_whole(
        &mut self,
        name: &str,
        raw_dtype: i32,
        shape: &[i64],
        fill: impl FnOnce(&mut [u8]) -> Result<()>,
    ) -> Result<()> {
        let (dtype, total) = self.check_tensor(name, raw_dtype, shape)?;
        if self.tensors.contains_key(name) {
            return Err(WorkerError::BadUpdate(format!("tensor `{name}`: bytes 0..{total} overlap an earlier chunk")));
        }
        let tensor = tch::Tensor::f_empty(shape, (dtype.kind(), tch::Device::Cpu))
            .map_err(|e| WorkerError::Internal(format!("tensor `{name}`: allocating {total} bytes: {e}")))?;
        if total > 0 {
            // SAFETY: a fresh contiguous CPU tensor of `numel * dtype size` = `total` bytes, not
            // shared with anything; the slice ends before `tensor` is used again. Its bytes start
            // uninitialised, and `fill` must write them all (an error discards the tensor).
            let buf = unsafe { std::slice::from_raw_parts_mut(tensor.data_ptr() as *mut u8, total as usize) };
            fill(buf)?;
        }
        let order = self.tensors.len();
        let ranges = BTreeMap::from([(0, total)]);
        self.tensors.insert(
            name.to_string(),
            PartialTensor {
                dtype,
                shape: shape.to_vec(),
                data: Vec::new(),
                whole: Some(tensor),
                total,
                ranges,
                received: total,
                order,
            },
        );
        self.bytes_received += total;
        Ok(())
    }

    /// The header this update started with.
    pub fn header(&self) -> &UpdateHeader {
        &self.header
    }

    /// Payload bytes received so far.
    pub fn bytes_received(&self) -> u64 {
        self.bytes_received
    }

    /// Ends the stream: every announced tensor must be complete, and a full update must cover
    /// every parameter.
    pub fn finish(self) -> Result<CompleteUpdate> {
        if self.tensors.len() != self.header.tensor_count as usize {
            return Err(WorkerError::BadUpdate(format!(
                "stream ended after {} of header.tensor_count = {} tensors",
                self.tensors.len(),
                self.header.tensor_count
            )));
        }
        let mut tensors: Vec<(String, PartialTensor)> = self.tensors.into_iter().collect();
        tensors.sort_by_key(|(_, t)| t.order);
        let (mut out, mut loaded) = (Vec::with_capacity(tensors.len()), Vec::new());
        for (name, t) in tensors {
            if t.received != t.total {
                return Err(WorkerError::BadUpdate(format!(
                    "tensor `{name}` incomplete: {} of {} bytes received",
                    t.received, t.total
                )));
            }
            match t.whole {
                Some(tensor) => loaded.push((name, tensor)),
                None => out.push(UpdatedTensor { name, dtype: t.dtype, shape: t.shape, data: t.data }),
            }
        }
        Ok(CompleteUpdate {
            agent: self.header.agent,
            version: self.header.version,
            tensors: out,
            loaded,
            bytes_received: self.bytes_received,
        })
    }
}

/// Splits named tensors into the chunk messages of one update stream (the sending side, used by
/// the client pool and tests): `chunk_bytes` payload bytes per message at most.
pub fn chunk_tensors<'a>(
    tensors: &'a [UpdatedTensor],
    chunk_bytes: usize,
) -> impl Iterator<Item = TensorChunk> + 'a {
    let chunk_bytes = chunk_bytes.max(1);
    tensors.iter().flat_map(move |t| {
        let n = t.data.len().div_ceil(chunk_bytes);
        (0..n).map(move |i| {
            let start = i * chunk_bytes;
            let end = (start + chunk_bytes).min(t.data.len());
            TensorChunk {
                name: t.name.clone(),
                dtype: t.dtype.to_proto() as i32,
                shape: t.shape.clone(),
                offset: start as u64,
                data: t.data[start..end].to_vec(),
            }
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> HashMap<String, Vec<i64>> {
        HashMap::from([("a".to_string(), vec![2, 3]), ("b".to_string(), vec![4])])
    }

    fn header(version: u64, tensor_count: u32, partial: bool) -> UpdateHeader {
        UpdateHeader { agent: "x".into(), version, tensor_count, partial }
    }

    fn chunk(name: &str, shape: Vec<i64>, offset: u64, data: Vec<u8>) -> TensorChunk {
        TensorChunk { name: name.into(), dtype: Dtype::F32 as i32, shape, offset, data }
    }

    #[test]
    fn assembles_out_of_order_chunks() {
        let mut a = UpdateAssembler::new(header(1, 2, false), params(), 0).unwrap();
        let bytes: Vec<u8> = (0..24).collect();
        a.push(chunk("a", vec![2, 3], 12, bytes[12..].to_vec())).unwrap();
        a.push(chunk("b", vec![4], 0, vec![7; 16])).unwrap();
        a.push(chunk("a", vec![2, 3], 0, bytes[..12].to_vec())).unwrap();
        let done = a.finish().unwrap();
        assert_eq!(done.version, 1);
        assert_eq!(done.tensors[0].name, "a");
        assert_eq!(done.tensors[0].data, bytes);
        assert_eq!(done.bytes_received, 40);
    }

    #[test]
    fn rejects_unknown_name_wrong_shape_and_overlap() {
        let mut a = UpdateAssembler::new(header(1, 1, true), params(), 0).unwrap();
        let e = a.push(chunk("nope", vec![4], 0, vec![0; 16])).unwrap_err();
        assert!(e.to_string().contains("no parameter"), "{e}");
        let e = a.push(chunk("b", vec![2, 2], 0, vec![0; 16])).unwrap_err();
        assert!(e.to_string().contains("shape"), "{e}");
        a.push(chunk("b", vec![4], 0, vec![0; 8])).unwrap();
        let e = a.push(chunk("b", vec![4], 4, vec![0; 8])).unwrap_err();
        assert!(e.to_string().contains("overlap"), "{e}");
        let e = a.push(chunk("b", vec![4], 12, vec![0; 8])).unwrap_err();
        assert!(e.to_string().contains("run past"), "{e}");
    }

    #[test]
    fn incomplete_stream_is_rejected() {
        let mut a = UpdateAssembler::new(header(2, 1, true), params(), 1).unwrap();
        a.push(chunk("b", vec![4], 0, vec![0; 8])).unwrap();
        let e = a.finish().unwrap_err();
        assert!(e.to_string().contains("incomplete"), "{e}");
        let a = UpdateAssembler::new(header(2, 2, false), params(), 1).unwrap();
        assert!(a.finish().unwrap_err().to_string().contains("after 0 of"));
    }

    #[test]
    fn full_update_must_name_every_parameter_and_be_newer() {
        assert!(UpdateAssembler::new(header(1, 1, false), params(), 0).is_err());
        let e = UpdateAssembler::new(header(3, 2, false), params(), 3).err().unwrap();
        assert!(matches!(e, WorkerError::VersionNotNewer { current: 3, offered: 3 }));
    }

    #[test]
    fn chunking_round_trips() {
        let t = vec![UpdatedTensor { name: "b".into(), dtype: WireDType::F32, shape: vec![4], data: (0..16).collect() }];
        let mut a = UpdateAssembler::new(header(1, 1, true), params(), 0).unwrap();
        let chunks: Vec<_> = chunk_tensors(&t, 5).collect();
        assert_eq!(chunks.len(), 4);
        for c in chunks {
            a.push(c).unwrap();
        }
        assert_eq!(a.finish().unwrap().tensors[0].data, (0..16).collect::<Vec<u8>>());
    }
}
