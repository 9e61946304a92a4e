//! Assembling a streamed weight update.
//!
//! An update arrives as one header and any number of byte-range chunks per tensor. The
//! [`UpdateAssembler`] checks every chunk against the model's parameters as it arrives (known
//! name, same shape, a supported dtype, a range inside the tensor that overlaps no earlier chunk)
//! and, at the end of the stream, that every announced tensor is complete and, for a full update,
//! that every parameter came. Only a [`CompleteUpdate`] can be applied, so a broken or partial
//! stream never touches the model's weights.
//!
//! An adapter update (`header.lora_scaling > 0`) carries LoRA pairs instead of parameters:
//! `X.lora_A.weight` (r × in) and `X.lora_B.weight` (out × r) for 2-D parameters `X.weight`
//! (out × in), optionally under PEFT's `base_model.model.` prefix. Their shapes follow from the
//! adapted weight and the update's one rank r, so they are checked as strictly as parameters, and
//! [`UpdateAssembler::finish`] checks that every `A` came with its `B`. The worker merges them into
//! its base weights (see [`crate::worker::Worker::apply_update`]).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};

use cotrain_model::lora::PEFT_PREFIX;

use cotrain_proto::rollout::{TensorChunk, UpdateHeader};
pub use cotrain_proto::wire::{UpdatedTensor, WireDType};

use crate::error::{Result, WorkerError};

/// An [`UpdatedTensor`] (a `cotrain-proto` type) as a libtorch tensor, converted here where updates
/// are assembled.
pub trait UpdatedTensorExt {
    /// The tensor as a CPU libtorch tensor of its wire dtype.
    fn to_tensor(&self) -> tch::Tensor;
}

impl UpdatedTensorExt for UpdatedTensor {
    fn to_tensor(&self) -> tch::Tensor {
        tch::Tensor::f_from_data_size(&self.data, &self.shape, self.dtype.kind())
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
    /// Set for an adapter update: the tensors are LoRA pairs, to be merged into the model's base
    /// weights with this scale (`UpdateHeader.lora_scaling`); `None` for parameters.
    pub lora_scaling: Option<f64>,
    /// The sender's probe of the weights (`UpdateHeader.probe`), for engines that check it.
    pub probe: Option<crate::probe::Probe>,
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
    pub fn into_tensors(
        self,
        kind: tch::Kind,
        device: tch::Device,
    ) -> HashMap<String, tch::Tensor> {
        let chunked = self.tensors.into_iter().map(|t| {
            let tensor = t.to_tensor();
            (t.name, tensor)
        });
        chunked
            .chain(self.loaded)
            .map(|(name, t)| (name, t.to_kind(kind).to_device(device)))
            .collect()
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

/// Suffix of a LoRA `A` tensor's name (r × in).
const LORA_A: &str = ".lora_A.weight";
/// Suffix of a LoRA `B` tensor's name (out × r); as long as [`LORA_A`].
const LORA_B: &str = ".lora_B.weight";

/// Which half of a LoRA pair a tensor is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum LoraHalf {
    A,
    B,
}

/// Splits an adapter tensor's name into the stem `X` of the parameter `X.weight` it adapts
/// (without PEFT's prefix) and its half; `None` for any other name.
fn parse_lora_name(name: &str) -> Option<(&str, LoraHalf)> {
    let key = name.strip_prefix(PEFT_PREFIX).unwrap_or(name);
    let (stem, half) = match (key.strip_suffix(LORA_A), key.strip_suffix(LORA_B)) {
        (Some(stem), _) => (stem, LoraHalf::A),
        (_, Some(stem)) => (stem, LoraHalf::B),
        _ => return None,
    };
    (!stem.is_empty()).then_some((stem, half))
}

/// The name of the other half of a LoRA pair, in the same form (prefixed or not).
fn lora_partner(name: &str, half: LoraHalf) -> String {
    let (from, to) = match half {
        LoraHalf::A => (LORA_A, LORA_B),
        LoraHalf::B => (LORA_B, LORA_A),
    };
    format!(
        "{}{to}",
        name.strip_suffix(from).expect("a parsed LoRA name")
    )
}

/// The header's LoRA scaling: `None` for an ordinary update (0), the scale of an adapter update
/// otherwise, which must be finite and positive (a NaN or infinite scale would poison every merged
/// weight, a negative one is never what a trainer means).
fn header_lora_scaling(header: &UpdateHeader) -> Result<Option<f64>> {
    let s = header.lora_scaling;
    if s == 0.0 {
        return Ok(None);
    }
    if s.is_finite() && s > 0.0 {
        Ok(Some(s))
    } else {
        Err(WorkerError::BadUpdate(format!(
            "header.lora_scaling is {s}: an adapter update needs a finite scaling > 0 (0 for an ordinary update)"
        )))
    }
}

/// Buffers a model slot reuses for the tensors of its next whole-tensor (shared-memory) update:
/// after a swap the staged tensors, whose bytes have been copied into the parameters, come back
/// here instead of being freed. Each update then reads into memory already mapped and touched,
/// rather than page-faulting a fresh model-sized allocation (0.2–0.8 s for SmolLM2's 538 MB, against
/// about 0.1 s warm). The cost is that the staging copy stays resident between updates.
#[derive(Clone, Default)]
pub struct Staging(Arc<Mutex<HashMap<String, tch::Tensor>>>);

impl Staging {
    /// A buffer for `name` of exactly this shape and dtype, contiguous on the CPU, if one is kept.
    fn take(&self, name: &str, shape: &[i64], kind: tch::Kind) -> Option<tch::Tensor> {
        let t = self
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(name)?;
        (t.size() == shape
            && t.kind() == kind
            && t.device() == tch::Device::Cpu
            && t.is_contiguous())
        .then_some(t)
    }

    /// Keeps `tensors` for the next update. The caller must hold no other reference to their
    /// storage (the next update overwrites it).
    pub(crate) fn keep(&self, tensors: HashMap<String, tch::Tensor>) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(tensors);
    }
}

/// Collects the chunks of one update stream; see the module docs.
pub struct UpdateAssembler {
    header: UpdateHeader,
    params: HashMap<String, Vec<i64>>,
    tensors: HashMap<String, PartialTensor>,
    bytes_received: u64,
    /// `Some` for an adapter update.
    lora_scaling: Option<f64>,
    /// An adapter update's rank, set by its first tensor; every pair must use it.
    lora_rank: Option<i64>,
    /// Where whole tensors take their buffers from, when the model slot keeps them.
    staging: Option<Staging>,
}

impl UpdateAssembler {
    /// Starts an update against a model with the given parameters (name → shape), whose current
    /// policy version is `current_version`.
    pub fn new(
        header: UpdateHeader,
        params: HashMap<String, Vec<i64>>,
        current_version: u64,
    ) -> Result<Self> {
        if header.version <= current_version {
            return Err(WorkerError::VersionNotNewer {
                current: current_version,
                offered: header.version,
            });
        }
        if header.tensor_count == 0 {
            return Err(WorkerError::BadUpdate("header.tensor_count is 0".into()));
        }
        let lora_scaling = header_lora_scaling(&header)?;
        // An adapter names only some projections whatever `partial` says.
        if lora_scaling.is_none() && !header.partial && header.tensor_count as usize != params.len()
        {
            return Err(WorkerError::BadUpdate(format!(
                "a full update must carry all {} parameters, header.tensor_count is {}",
                params.len(),
                header.tensor_count
            )));
        }
        Ok(Self {
            header,
            params,
            tensors: HashMap::new(),
            bytes_received: 0,
            lora_scaling,
            lora_rank: None,
            staging: None,
        })
    }

    /// Takes whole tensors' buffers from `staging` where it holds one of the right shape and dtype.
    pub fn with_staging(mut self, staging: Staging) -> Self {
        self.staging = Some(staging);
        self
    }

    /// Checks a tensor's name, dtype and shape against the model (or, for an adapter update,
    /// against the weight it adapts) and, for a tensor not seen before, against
    /// `header.tensor_count`; returns its dtype and byte size.
    fn check_tensor(
        &mut self,
        name: &str,
        raw_dtype: i32,
        shape: &[i64],
    ) -> Result<(WireDType, u64)> {
        let bad = |msg: String| Err(WorkerError::BadUpdate(format!("tensor `{name}`: {msg}")));
        let rank = match self.lora_scaling {
            None => {
                let Some(expected) = self.params.get(name) else {
                    return bad("no parameter of that name in the model".into());
                };
                if shape != expected.as_slice() {
                    return bad(format!(
                        "shape {shape:?} does not match the model's {expected:?}"
                    ));
                }
                None
            }
            Some(_) => Some(self.check_adapter_shape(name, shape)?),
        };
        let Some(dtype) = WireDType::from_proto(raw_dtype) else {
            return bad(format!(
                "unsupported dtype {raw_dtype} (expected DTYPE_F32 or DTYPE_BF16)"
            ));
        };
        if !self.tensors.contains_key(name)
            && self.tensors.len() >= self.header.tensor_count as usize
        {
            return bad(format!(
                "more tensors than header.tensor_count ({})",
                self.header.tensor_count
            ));
        }
        if rank.is_some() {
            self.lora_rank = rank;
        }
        let numel: i64 = shape.iter().product();
        Ok((dtype, numel as u64 * dtype.size() as u64))
    }

    /// Checks an adapter tensor against the weight `X.weight` (out × in) it adapts: `A` must be
    /// r × in and `B` out × r, with the update's one rank r in [1, min(out, in)] (a larger rank
    /// adds nothing, and the bound keeps an adapter tensor no larger than its weight). Returns r.
    fn check_adapter_shape(&self, name: &str, shape: &[i64]) -> Result<i64> {
        let bad = |msg: String| Err(WorkerError::BadUpdate(format!("tensor `{name}`: {msg}")));
        let Some((stem, half)) = parse_lora_name(name) else {
            return bad(format!(
                "not a LoRA tensor (an adapter update carries `X{LORA_A}` and `X{LORA_B}`)"
            ));
        };
        let weight = format!("{stem}.weight");
        let Some(w) = self.params.get(&weight) else {
            return bad(format!("adapts `{weight}`, which the model does not have"));
        };
        let &[out, inp] = w.as_slice() else {
            return bad(format!(
                "adapts `{weight}` of shape {w:?}, which is not a 2-D weight"
            ));
        };
        let (expected, what) = match (half, shape) {
            (LoraHalf::A, &[r, _]) => ([r, inp], "lora_A is r × in"),
            (LoraHalf::B, &[_, r]) => ([out, r], "lora_B is out × r"),
            _ => return bad(format!("shape {shape:?} is not 2-D")),
        };
        let r = if half == LoraHalf::A {
            expected[0]
        } else {
            expected[1]
        };
        if shape != expected {
            return bad(format!(
                "shape {shape:?} does not fit `{weight}` of shape {w:?} ({what})"
            ));
        }
        if r < 1 || r > out.min(inp) {
            return bad(format!(
                "rank {r} is not in [1, {}] for `{weight}` of shape {w:?}",
                out.min(inp)
            ));
        }
        if let Some(rank) = self.lora_rank
            && rank != r
        {
            return bad(format!(
                "rank {r} differs from the rank {rank} of the update's earlier tensors"
            ));
        }
        Ok(r)
    }

    /// Checks that every adapter tensor came with its partner (in the same name form), and that no
    /// tensor came twice, with and without PEFT's prefix.
    fn check_adapter_pairs<'a>(names: impl Iterator<Item = &'a str> + Clone) -> Result<()> {
        let all: HashSet<&str> = names.clone().collect();
        let mut seen: HashMap<(&str, LoraHalf), &str> = HashMap::new();
        for name in names {
            let (stem, half) = parse_lora_name(name).expect("checked on arrival");
            if let Some(other) = seen.insert((stem, half), name) {
                return Err(WorkerError::BadUpdate(format!(
                    "tensors `{other}` and `{name}` are the same adapter tensor (with and without `{PEFT_PREFIX}`)"
                )));
            }
            let partner = lora_partner(name, half);
            if !all.contains(partner.as_str()) {
                return Err(WorkerError::BadUpdate(format!(
                    "tensor `{name}` came without its partner `{partner}`"
                )));
            }
        }
        Ok(())
    }

    /// Adds one chunk, checking it against the model and against earlier chunks.
    pub fn push(&mut self, chunk: TensorChunk) -> Result<()> {
        let bad = |msg: String| {
            Err(WorkerError::BadUpdate(format!(
                "tensor `{}`: {msg}",
                chunk.name
            )))
        };
        let (dtype, total) = self.check_tensor(&chunk.name, chunk.dtype, &chunk.shape)?;
        let order = self.tensors.len();
        let t = self
            .tensors
            .entry(chunk.name.clone())
            .or_insert_with(|| PartialTensor {
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
            return bad(format!(
                "dtype changed between chunks ({:?} then {:?})",
                t.dtype, dtype
            ));
        }
        let start = chunk.offset;
        let end = start.saturating_add(chunk.data.len() as u64);
        if chunk.data.is_empty() {
            return bad(format!("empty chunk at offset {start}"));
        }
        if end > total {
            return bad(format!(
                "bytes {start}..{end} run past the tensor's {total} bytes"
            ));
        }
        let overlaps_before = t
            .ranges
            .range(..=start)
            .next_back()
            .is_some_and(|(_, &e)| e > start);
        let overlaps_after = t
            .ranges
            .range(start..)
            .next()
            .is_some_and(|(&s, _)| s < end);
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
            return Err(WorkerError::BadUpdate(format!(
                "tensor `{name}`: bytes 0..{total} overlap an earlier chunk"
            )));
        }
        let kept = self
            .staging
            .as_ref()
            .and_then(|s| s.take(name, shape, dtype.kind()));
        let tensor = match kept {
            Some(t) => t,
            None => tch::Tensor::f_empty(shape, (dtype.kind(), tch::Device::Cpu)).map_err(|e| {
                WorkerError::Internal(format!("tensor `{name}`: allocating {total} bytes: {e}"))
            })?,
        };
        if total > 0 {
            // SAFETY: a contiguous CPU tensor of `numel * dtype size` = `total` bytes, fresh or
            // kept by `staging` (whose contract is that nothing else references it), not shared; the slice ends before `tensor` is used again. Its bytes start
            // uninitialised, and `fill` must write them all (an error discards the tensor).
            let buf = unsafe {
                std::slice::from_raw_parts_mut(tensor.data_ptr() as *mut u8, total as usize)
            };
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

    /// Ends the stream: every announced tensor must be complete, a full update must cover every
    /// parameter, and an adapter update must pair every `A` with its `B`.
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
        if self.lora_scaling.is_some() {
            Self::check_adapter_pairs(tensors.iter().map(|(n, _)| n.as_str()))?;
        }
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
                None => out.push(UpdatedTensor {
                    name,
                    dtype: t.dtype,
                    shape: t.shape,
                    data: t.data,
                }),
            }
        }
        Ok(CompleteUpdate {
            agent: self.header.agent,
            version: self.header.version,
            tensors: out,
            loaded,
            bytes_received: self.bytes_received,
            lora_scaling: self.lora_scaling,
            probe: self.header.probe.map(|p| crate::probe::Probe {
                token_ids: p.token_ids,
                logprobs: p.logprobs,
                tolerance: p.tolerance,
            }),
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
    use cotrain_proto::rollout::Dtype;

    fn params() -> HashMap<String, Vec<i64>> {
        HashMap::from([("a".to_string(), vec![2, 3]), ("b".to_string(), vec![4])])
    }

    fn header(version: u64, tensor_count: u32, partial: bool) -> UpdateHeader {
        UpdateHeader {
            agent: "x".into(),
            version,
            tensor_count,
            partial,
            lora_scaling: 0.0,
            probe: None,
        }
    }

    fn chunk(name: &str, shape: Vec<i64>, offset: u64, data: Vec<u8>) -> TensorChunk {
        TensorChunk {
            name: name.into(),
            dtype: Dtype::F32 as i32,
            shape,
            offset,
            data,
        }
    }

    #[test]
    fn assembles_out_of_order_chunks() {
        let mut a = UpdateAssembler::new(header(1, 2, false), params(), 0).unwrap();
        let bytes: Vec<u8> = (0..24).collect();
        a.push(chunk("a", vec![2, 3], 12, bytes[12..].to_vec()))
            .unwrap();
        a.push(chunk("b", vec![4], 0, vec![7; 16])).unwrap();
        a.push(chunk("a", vec![2, 3], 0, bytes[..12].to_vec()))
            .unwrap();
        let done = a.finish().unwrap();
        assert_eq!(done.version, 1);
        assert_eq!(done.tensors[0].name, "a");
        assert_eq!(done.tensors[0].data, bytes);
        assert_eq!(done.bytes_received, 40);
    }

    /// The second whole-tensor update reads into the first one's buffers once the slot has kept
    /// them, and carries its own values, not the kept ones; a kept buffer of another shape is
    /// not used.
    #[test]
    fn whole_tensor_updates_reuse_kept_buffers_and_carry_their_own_values() {
        let staging = Staging::default();
        let update = |version: u64, fill: u8| {
            let mut a = UpdateAssembler::new(header(version, 2, false), params(), version - 1)
                .unwrap()
                .with_staging(staging.clone());
            a.push_whole("a", Dtype::F32 as i32, &[2, 3], |buf| {
                buf.fill(fill);
                Ok(())
            })
            .unwrap();
            a.push_whole("b", Dtype::F32 as i32, &[4], |buf| {
                buf.fill(fill);
                Ok(())
            })
            .unwrap();
            a.finish()
                .unwrap()
                .into_tensors(tch::Kind::Float, tch::Device::Cpu)
        };
        let first = update(1, 1);
        let ptr_a = first["a"].data_ptr();
        staging.keep(first);
        let second = update(2, 2);
        assert_eq!(second["a"].data_ptr(), ptr_a, "the kept buffer is reused");
        let mut bytes = vec![0u8; 24];
        second["a"].copy_data_u8(&mut bytes, 6);
        assert_eq!(
            bytes,
            vec![2u8; 24],
            "the second update's values, not the first's"
        );
        // A kept tensor of another shape is dropped, not written into.
        let odd = tch::Tensor::zeros([5], (tch::Kind::Float, tch::Device::Cpu));
        let odd_ptr = odd.data_ptr();
        staging.keep(HashMap::from([("b".to_string(), odd)]));
        let third = update(3, 3);
        assert_ne!(third["b"].data_ptr(), odd_ptr);
        assert_eq!(third["b"].size(), [4]);
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
        let e = UpdateAssembler::new(header(3, 2, false), params(), 3)
            .err()
            .unwrap();
        assert!(matches!(
            e,
            WorkerError::VersionNotNewer {
                current: 3,
                offered: 3
            }
        ));
    }

    /// A model with one 4 × 6 projection and one 1-D parameter.
    fn adapter_params() -> HashMap<String, Vec<i64>> {
        HashMap::from([
            ("l.q_proj.weight".to_string(), vec![4, 6]),
            ("l.norm.weight".to_string(), vec![4]),
        ])
    }

    fn adapter_header(tensor_count: u32, lora_scaling: f64) -> UpdateHeader {
        UpdateHeader {
            agent: "x".into(),
            version: 1,
            tensor_count,
            partial: false,
            lora_scaling,
            probe: None,
        }
    }

    fn zeros(name: &str, shape: Vec<i64>) -> TensorChunk {
        let bytes = shape.iter().product::<i64>() as usize * 4;
        chunk(name, shape, 0, vec![0; bytes])
    }

    #[test]
    fn adapter_update_accepts_a_valid_pair_with_or_without_peft_prefix() {
        for prefix in ["", "base_model.model."] {
            // `partial: false` with 2 of 2 parameters' worth of tensors: ignored for an adapter.
            let mut a = UpdateAssembler::new(adapter_header(2, 2.0), adapter_params(), 0).unwrap();
            a.push(zeros(
                &format!("{prefix}l.q_proj.lora_A.weight"),
                vec![2, 6],
            ))
            .unwrap();
            a.push(zeros(
                &format!("{prefix}l.q_proj.lora_B.weight"),
                vec![4, 2],
            ))
            .unwrap();
            let done = a.finish().unwrap();
            assert_eq!(done.lora_scaling, Some(2.0));
            assert_eq!(done.len(), 2);
            assert_eq!(done.bytes_received, (12 + 8) * 4);
        }
        // An ordinary update carries no scaling.
        let mut a = UpdateAssembler::new(header(1, 1, true), params(), 0).unwrap();
        a.push(chunk("b", vec![4], 0, vec![0; 16])).unwrap();
        assert_eq!(a.finish().unwrap().lora_scaling, None);
    }

    #[test]
    fn adapter_update_rejects_wrong_shapes_and_ranks() {
        let mut a = UpdateAssembler::new(adapter_header(2, 1.0), adapter_params(), 0).unwrap();
        let e = a
            .push(zeros("l.q_proj.lora_A.weight", vec![2, 5]))
            .unwrap_err();
        assert!(matches!(e, WorkerError::BadUpdate(_)));
        assert!(
            e.to_string().contains("`l.q_proj.lora_A.weight`")
                && e.to_string().contains("does not fit"),
            "{e}"
        );
        let e = a
            .push(zeros("l.q_proj.lora_B.weight", vec![5, 2]))
            .unwrap_err();
        assert!(
            e.to_string().contains("`l.q_proj.lora_B.weight`") && e.to_string().contains("out × r"),
            "{e}"
        );
        let e = a
            .push(zeros("l.q_proj.lora_A.weight", vec![2, 6, 1]))
            .unwrap_err();
        assert!(e.to_string().contains("not 2-D"), "{e}");
        let e = a
            .push(zeros("l.q_proj.lora_A.weight", vec![0, 6]))
            .unwrap_err();
        assert!(e.to_string().contains("rank 0"), "{e}");
        let e = a
            .push(zeros("l.q_proj.lora_A.weight", vec![5, 6]))
            .unwrap_err();
        assert!(e.to_string().contains("rank 5 is not in [1, 4]"), "{e}");
        // The pair's ranks must agree.
        a.push(zeros("l.q_proj.lora_A.weight", vec![2, 6])).unwrap();
        let e = a
            .push(zeros("l.q_proj.lora_B.weight", vec![4, 3]))
            .unwrap_err();
        assert!(
            e.to_string().contains("rank 3 differs from the rank 2"),
            "{e}"
        );
    }

    #[test]
    fn adapter_update_rejects_unknown_bases_and_non_lora_names() {
        let mut a = UpdateAssembler::new(adapter_header(2, 1.0), adapter_params(), 0).unwrap();
        let e = a
            .push(zeros("l.k_proj.lora_A.weight", vec![2, 6]))
            .unwrap_err();
        assert!(
            e.to_string().contains(
                "`l.k_proj.lora_A.weight`: adapts `l.k_proj.weight`, which the model does not have"
            ),
            "{e}"
        );
        let e = a
            .push(zeros("l.norm.lora_A.weight", vec![2, 4]))
            .unwrap_err();
        assert!(e.to_string().contains("not a 2-D weight"), "{e}");
        let e = a.push(zeros("l.q_proj.weight", vec![4, 6])).unwrap_err();
        assert!(
            e.to_string()
                .contains("`l.q_proj.weight`: not a LoRA tensor"),
            "{e}"
        );
    }

    #[test]
    fn adapter_update_rejects_unpaired_and_doubled_tensors() {
        let mut a = UpdateAssembler::new(adapter_header(1, 1.0), adapter_params(), 0).unwrap();
        a.push(zeros("l.q_proj.lora_A.weight", vec![2, 6])).unwrap();
        let e = a.finish().unwrap_err();
        assert!(
            e.to_string().contains(
                "`l.q_proj.lora_A.weight` came without its partner `l.q_proj.lora_B.weight`"
            ),
            "{e}"
        );
        let mut a = UpdateAssembler::new(adapter_header(1, 1.0), adapter_params(), 0).unwrap();
        a.push(zeros("l.q_proj.lora_B.weight", vec![4, 2])).unwrap();
        let e = a.finish().unwrap_err();
        assert!(
            e.to_string()
                .contains("without its partner `l.q_proj.lora_A.weight`"),
            "{e}"
        );
        // A prefixed A does not pair with an unprefixed B.
        let mut a = UpdateAssembler::new(adapter_header(2, 1.0), adapter_params(), 0).unwrap();
        a.push(zeros("base_model.model.l.q_proj.lora_A.weight", vec![2, 6]))
            .unwrap();
        a.push(zeros("l.q_proj.lora_B.weight", vec![4, 2])).unwrap();
        assert!(
            a.finish()
                .unwrap_err()
                .to_string()
                .contains("without its partner")
        );
        // The same tensor under both name forms.
        let mut a = UpdateAssembler::new(adapter_header(4, 1.0), adapter_params(), 0).unwrap();
        for prefix in ["", "base_model.model."] {
            a.push(zeros(
                &format!("{prefix}l.q_proj.lora_A.weight"),
                vec![2, 6],
            ))
            .unwrap();
            a.push(zeros(
                &format!("{prefix}l.q_proj.lora_B.weight"),
                vec![4, 2],
            ))
            .unwrap();
        }
        assert!(
            a.finish()
                .unwrap_err()
                .to_string()
                .contains("the same adapter tensor")
        );
    }

    #[test]
    fn adapter_update_rejects_bad_scaling() {
        for s in [f64::NAN, -1.0, f64::INFINITY, f64::NEG_INFINITY] {
            let e = UpdateAssembler::new(adapter_header(2, s), adapter_params(), 0)
                .err()
                .unwrap();
            assert!(matches!(e, WorkerError::BadUpdate(_)), "{e}");
            assert!(e.to_string().contains("header.lora_scaling"), "{e}");
        }
    }

    #[test]
    fn chunking_round_trips() {
        let t = vec![UpdatedTensor {
            name: "b".into(),
            dtype: WireDType::F32,
            shape: vec![4],
            data: (0..16).collect(),
        }];
        let mut a = UpdateAssembler::new(header(1, 1, true), params(), 0).unwrap();
        let chunks: Vec<_> = chunk_tensors(&t, 5).collect();
        assert_eq!(chunks.len(), 4);
        for c in chunks {
            a.push(c).unwrap();
        }
        assert_eq!(
            a.finish().unwrap().tensors[0].data,
            (0..16).collect::<Vec<u8>>()
        );
    }
}
