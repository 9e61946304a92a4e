//! Reader for GGUF files (the llama.cpp checkpoint format), versions 2 and 3.
//!
//! A [`GgufFile`] memory-maps the file, parses the header, the metadata key/value pairs and the
//! tensor directory up front, and checks every tensor's byte range against the file length, so a
//! truncated or corrupt file fails at [`GgufFile::open`] with a [`GgufError`] instead of panicking
//! later. Tensor data stays in the map until [`GgufFile::dequantize`] converts one tensor to `f32`.
//!
//! Shapes: GGUF stores dimensions innermost-first (`ne[0]` is the contiguous one); [`TensorInfo::shape`]
//! is reversed into PyTorch's row-major order, so a `[out, in]` linear weight reads `[out, in]` here.
//!
//! Llama-architecture checkpoints converted by llama.cpp have the rows of `attn_q`/`attn_k` permuted
//! for its interleaved RoPE layout; [`unpermute_qk_rows`] undoes that for rotate-half attention.

mod dequant;
mod types;
pub mod writer;

use std::collections::BTreeMap;
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};

pub use dequant::dequantize_into;
pub use types::GgmlType;

/// Alignment of the tensor data section when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
const MAGIC: &[u8; 4] = b"GGUF";

/// Errors from reading a GGUF file or converting its tensors.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The file could not be opened or mapped.
    #[error("cannot read gguf file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The first four bytes are not `GGUF`.
    #[error("not a gguf file (magic {found:02x?})")]
    BadMagic { found: [u8; 4] },
    /// A GGUF version this reader does not handle (only 2 and 3 are).
    #[error("unsupported gguf version {0} (supported: 2, 3)")]
    UnsupportedVersion(u32),
    /// The header or metadata ends before a value it announces.
    #[error("gguf file truncated: {what} needs {needed} bytes at offset {offset}, file has {len}")]
    Truncated {
        what: String,
        offset: u64,
        needed: u64,
        len: u64,
    },
    /// A structurally invalid header (bad value type, bad UTF-8, absurd counts, ...).
    #[error("corrupt gguf file: {0}")]
    Corrupt(String),
    /// A metadata key that is required but absent.
    #[error("gguf metadata key `{0}` is missing")]
    MissingKey(String),
    /// A metadata value of another type than the caller asked for.
    #[error("gguf metadata key `{key}` has type {found}, expected {expected}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: &'static str,
    },
    /// No tensor of that name.
    #[error("gguf tensor `{0}` not found")]
    TensorNotFound(String),
    /// The tensor directory points outside the file or is inconsistent with the tensor's type.
    #[error("gguf tensor `{tensor}` is invalid: {reason}")]
    BadTensor { tensor: String, reason: String },
    /// A tensor of a type that cannot be dequantised by this crate.
    #[error("gguf tensor `{tensor}` has unsupported type {ty}")]
    UnsupportedType { tensor: String, ty: GgmlType },
    /// A caller-provided buffer or argument of the wrong size.
    #[error("size mismatch: {0}")]
    SizeMismatch(String),
}

pub type Result<T, E = GgufError> = std::result::Result<T, E>;

/// One metadata value. Integer and float widths are kept as stored; the typed getters on
/// [`GgufFile`] convert between integer widths when the value fits.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<MetaValue>),
}

impl MetaValue {
    /// The GGUF name of this value's type, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            MetaValue::U8(_) => "u8",
            MetaValue::I8(_) => "i8",
            MetaValue::U16(_) => "u16",
            MetaValue::I16(_) => "i16",
            MetaValue::U32(_) => "u32",
            MetaValue::I32(_) => "i32",
            MetaValue::U64(_) => "u64",
            MetaValue::I64(_) => "i64",
            MetaValue::F32(_) => "f32",
            MetaValue::F64(_) => "f64",
            MetaValue::Bool(_) => "bool",
            MetaValue::String(_) => "string",
            MetaValue::Array(_) => "array",
        }
    }

    /// The value as a signed 128-bit integer if it is any integer type.
    pub fn as_i128(&self) -> Option<i128> {
        Some(match *self {
            MetaValue::U8(v) => v.into(),
            MetaValue::I8(v) => v.into(),
            MetaValue::U16(v) => v.into(),
            MetaValue::I16(v) => v.into(),
            MetaValue::U32(v) => v.into(),
            MetaValue::I32(v) => v.into(),
            MetaValue::U64(v) => v.into(),
            MetaValue::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// The value as `f64` if it is a float or an integer.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v.into()),
            MetaValue::F64(v) => Some(v),
            _ => self.as_i128().map(|v| v as f64),
        }
    }

    /// The string if this is a string value.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// The elements if this is an array value.
    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

impl fmt::Display for MetaValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MetaValue::String(s) => write!(f, "{s:?}"),
            MetaValue::Array(a) => write!(f, "[array of {}]", a.len()),
            MetaValue::Bool(b) => write!(f, "{b}"),
            MetaValue::F32(v) => write!(f, "{v}"),
            MetaValue::F64(v) => write!(f, "{v}"),
            other => write!(f, "{}", other.as_i128().unwrap_or_default()),
        }
    }
}

/// One entry of the tensor directory.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// The tensor's name as stored (`blk.0.attn_q.weight`).
    pub name: String,
    /// Row-major (PyTorch) shape: the reverse of GGUF's innermost-first dimensions.
    pub shape: Vec<usize>,
    /// Storage type.
    pub ggml_type: GgmlType,
    /// Absolute byte offset of the tensor's data in the file.
    pub offset: u64,
    /// Size of the tensor's data in bytes.
    pub n_bytes: u64,
}

impl TensorInfo {
    /// Number of elements.
    pub fn n_elements(&self) -> usize {
        self.shape.iter().product()
    }
}

enum Storage {
    Mmap(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mmap(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// A parsed GGUF file whose tensor data stays memory-mapped.
pub struct GgufFile {
    storage: Storage,
    path: Option<PathBuf>,
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: BTreeMap<String, MetaValue>,
    tensors: Vec<TensorInfo>,
    by_name: BTreeMap<String, usize>,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("n_metadata", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Memory-maps and parses the file at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let io = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        // SAFETY: the map is read-only; like every mmap reader we rely on the file not being
        // truncated by another process while it is open (the header is validated against its length).
        let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        let mut parsed = Self::parse(Storage::Mmap(mmap))?;
        parsed.path = Some(path.to_path_buf());
        Ok(parsed)
    }

    /// Parses a GGUF file held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self> {
        Self::parse(Storage::Owned(bytes))
    }

    fn parse(storage: Storage) -> Result<Self> {
        let bytes = storage.bytes();
        let mut r = Reader { buf: bytes, pos: 0 };
        let magic: [u8; 4] = r.take(4, "magic")?.try_into().expect("4 bytes");
        if &magic != MAGIC {
            return Err(GgufError::BadMagic { found: magic });
        }
        let version = r.u32("version")?;
        if version != 2 && version != 3 {
            return Err(GgufError::UnsupportedVersion(version));
        }
        let n_tensors = r.u64("tensor count")?;
        let n_kv = r.u64("metadata count")?;
        // Every KV pair and tensor entry takes at least 8 bytes, which bounds absurd counts.
        let remaining = (bytes.len() - r.pos) as u64;
        if n_kv > remaining / 8 || n_tensors > remaining / 8 {
            return Err(GgufError::Corrupt(format!(
                "{n_kv} metadata entries and {n_tensors} tensors cannot fit in {} bytes",
                bytes.len()
            )));
        }

        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = r.string("metadata key")?;
            let ty = r.u32("metadata value type")?;
            let value = r.value(ty, &key, 0)?;
            metadata.insert(key, value);
        }

        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_i128() {
                Some(a) if a > 0 && (a as u64).is_power_of_two() && a <= 1 << 30 => a as u64,
                _ => {
                    return Err(GgufError::Corrupt(format!(
                        "general.alignment must be a power of two, got {v}"
                    )));
                }
            },
        };

        let mut raw = Vec::with_capacity(n_tensors as usize);
        for _ in 0..n_tensors {
            let name = r.string("tensor name")?;
            let n_dims = r.u32("tensor dimension count")?;
            if n_dims > 8 {
                return Err(GgufError::BadTensor {
                    tensor: name,
                    reason: format!("{n_dims} dimensions (at most 8 supported)"),
                });
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(r.u64("tensor dimension")?);
            }
            let ty = GgmlType::from_u32(r.u32("tensor type")?);
            let rel_offset = r.u64("tensor offset")?;
            raw.push((name, dims, ty, rel_offset));
        }
        let data_offset = align_up(r.pos as u64, alignment);
        let file_len = bytes.len() as u64;

        let mut tensors = Vec::with_capacity(raw.len());
        let mut by_name = BTreeMap::new();
        for (name, dims, ty, rel_offset) in raw {
            let bad = |reason: String| GgufError::BadTensor {
                tensor: name.clone(),
                reason,
            };
            let n_elements = dims
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .ok_or_else(|| bad(format!("dimensions {dims:?} overflow")))?;
            let n_bytes = match ty.block_layout() {
                Some((block, size)) => {
                    let inner = dims.first().copied().unwrap_or(1);
                    if !inner.is_multiple_of(block as u64) {
                        return Err(bad(format!(
                            "innermost dimension {inner} is not a multiple of the {ty} block size {block}"
                        )));
                    }
                    n_elements / block as u64 * size as u64
                }
                // Unknown layout: the size cannot be checked, and the tensor can only be
                // reported as unsupported when it is converted.
                None => 0,
            };
            if !rel_offset.is_multiple_of(alignment) {
                return Err(bad(format!(
                    "offset {rel_offset} is not aligned to {alignment}"
                )));
            }
            let offset = data_offset
                .checked_add(rel_offset)
                .ok_or_else(|| bad("offset overflows".into()))?;
            let end = offset
                .checked_add(n_bytes)
                .ok_or_else(|| bad("size overflows".into()))?;
            if end > file_len {
                return Err(bad(format!(
                    "data [{offset}, {end}) extends past the end of the file ({file_len} bytes); the file is truncated"
                )));
            }
            let shape = dims
                .iter()
                .rev()
                .map(|&d| usize::try_from(d).map_err(|_| bad(format!("dimension {d} too large"))))
                .collect::<Result<Vec<_>>>()?;
            if by_name.insert(name.clone(), tensors.len()).is_some() {
                return Err(bad("duplicate tensor name".into()));
            }
            tensors.push(TensorInfo {
                name,
                shape,
                ggml_type: ty,
                offset,
                n_bytes,
            });
        }

        Ok(Self {
            storage,
            path: None,
            version,
            alignment,
            data_offset,
            metadata,
            tensors,
            by_name,
        })
    }

    /// Where the file was opened from (`None` for [`GgufFile::from_bytes`]).
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The GGUF format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The alignment of the data section (`general.alignment` or 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute offset of the tensor data section.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// All metadata, sorted by key.
    pub fn metadata(&self) -> &BTreeMap<String, MetaValue> {
        &self.metadata
    }

    /// The raw metadata value for `key`.
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    fn require(&self, key: &str) -> Result<&MetaValue> {
        self.get(key)
            .ok_or_else(|| GgufError::MissingKey(key.to_string()))
    }

    fn int_as<T: TryFrom<i128>>(&self, key: &str, expected: &'static str) -> Result<T> {
        let v = self.require(key)?;
        v.as_i128()
            .and_then(|i| T::try_from(i).ok())
            .ok_or_else(|| GgufError::WrongType {
                key: key.to_string(),
                expected,
                found: v.type_name(),
            })
    }

    /// An integer value that fits in `u32` (any stored integer width is accepted).
    pub fn get_u32(&self, key: &str) -> Result<u32> {
        self.int_as(key, "u32")
    }

    /// An integer value that fits in `u64`.
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        self.int_as(key, "u64")
    }

    /// An integer value that fits in `i64`.
    pub fn get_i64(&self, key: &str) -> Result<i64> {
        self.int_as(key, "i64")
    }

    /// A float value (`f32`, `f64`, or an integer) as `f32`.
    pub fn get_f32(&self, key: &str) -> Result<f32> {
        let v = self.require(key)?;
        v.as_f64()
            .map(|f| f as f32)
            .ok_or_else(|| GgufError::WrongType {
                key: key.to_string(),
                expected: "f32",
                found: v.type_name(),
            })
    }

    /// A boolean value.
    pub fn get_bool(&self, key: &str) -> Result<bool> {
        match self.require(key)? {
            MetaValue::Bool(b) => Ok(*b),
            v => Err(GgufError::WrongType {
                key: key.into(),
                expected: "bool",
                found: v.type_name(),
            }),
        }
    }

    /// A string value.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| GgufError::WrongType {
            key: key.to_string(),
            expected: "string",
            found: v.type_name(),
        })
    }

    /// An array value.
    pub fn get_array(&self, key: &str) -> Result<&[MetaValue]> {
        let v = self.require(key)?;
        v.as_array().ok_or_else(|| GgufError::WrongType {
            key: key.to_string(),
            expected: "array",
            found: v.type_name(),
        })
    }

    /// An array of strings.
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>> {
        self.get_array(key)?
            .iter()
            .map(|v| {
                v.as_str().ok_or_else(|| GgufError::WrongType {
                    key: key.to_string(),
                    expected: "array of string",
                    found: v.type_name(),
                })
            })
            .collect()
    }

    /// An array of integers, each of which must fit in `i64`.
    pub fn get_i64_array(&self, key: &str) -> Result<Vec<i64>> {
        self.get_array(key)?
            .iter()
            .map(|v| {
                v.as_i128()
                    .and_then(|i| i64::try_from(i).ok())
                    .ok_or_else(|| GgufError::WrongType {
                        key: key.to_string(),
                        expected: "array of integer",
                        found: v.type_name(),
                    })
            })
            .collect()
    }

    /// An array of numbers as `f32`.
    pub fn get_f32_array(&self, key: &str) -> Result<Vec<f32>> {
        self.get_array(key)?
            .iter()
            .map(|v| {
                v.as_f64()
                    .map(|f| f as f32)
                    .ok_or_else(|| GgufError::WrongType {
                        key: key.to_string(),
                        expected: "array of float",
                        found: v.type_name(),
                    })
            })
            .collect()
    }

    /// `general.architecture` (`llama`, `qwen2`, `qwen3`, ...).
    pub fn architecture(&self) -> Result<&str> {
        self.get_str("general.architecture")
    }

    /// An architecture-scoped key: `arch_key("block_count")` reads `llama.block_count` in a
    /// Llama file.
    pub fn arch_key(&self, suffix: &str) -> Result<String> {
        Ok(format!("{}.{suffix}", self.architecture()?))
    }

    /// The tensor directory in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The directory entry for `name`.
    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    fn info_or_err(&self, name: &str) -> Result<&TensorInfo> {
        self.tensor_info(name)
            .ok_or_else(|| GgufError::TensorNotFound(name.to_string()))
    }

    /// The raw stored bytes of a tensor (quantised blocks for quantised types).
    pub fn tensor_bytes(&self, name: &str) -> Result<&[u8]> {
        let info = self.info_or_err(name)?;
        if info.ggml_type.block_layout().is_none() {
            return Err(GgufError::UnsupportedType {
                tensor: name.into(),
                ty: info.ggml_type,
            });
        }
        // Bounds were checked in `parse`.
        Ok(&self.storage.bytes()[info.offset as usize..(info.offset + info.n_bytes) as usize])
    }

    /// Dequantises a tensor to `f32` in row-major order (length = product of its shape).
    pub fn dequantize(&self, name: &str) -> Result<Vec<f32>> {
        let info = self.info_or_err(name)?;
        let mut out = vec![0f32; info.n_elements()];
        self.dequantize_to(name, &mut out)?;
        Ok(out)
    }

    /// Dequantises a tensor into `out`, whose length must equal the tensor's element count.
    pub fn dequantize_to(&self, name: &str, out: &mut [f32]) -> Result<()> {
        let info = self.info_or_err(name)?;
        if out.len() != info.n_elements() {
            return Err(GgufError::SizeMismatch(format!(
                "tensor `{name}` has {} elements, output buffer has {}",
                info.n_elements(),
                out.len()
            )));
        }
        let data = self.tensor_bytes(name)?;
        dequantize_into(info.ggml_type, data, out).map_err(|e| match e {
            GgufError::UnsupportedType { ty, .. } => GgufError::UnsupportedType {
                tensor: name.into(),
                ty,
            },
            other => other,
        })
    }
}

fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

/// Bounds-checked little-endian cursor over the header.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8]> {
        let len = self.buf.len() as u64;
        let end = (self.pos as u64).checked_add(n).filter(|&e| e <= len);
        match end {
            Some(end) => {
                let s = &self.buf[self.pos..end as usize];
                self.pos = end as usize;
                Ok(s)
            }
            None => Err(GgufError::Truncated {
                what: what.to_string(),
                offset: self.pos as u64,
                needed: n,
                len,
            }),
        }
    }

    fn arr<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        Ok(self
            .take(N as u64, what)?
            .try_into()
            .expect("length checked"))
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.arr(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.arr(what)?))
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.u64(what)?;
        let bytes = self.take(n, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| {
            GgufError::Corrupt(format!(
                "{what} at offset {} is not valid utf-8",
                self.pos as u64 - n
            ))
        })
    }

    fn value(&mut self, ty: u32, key: &str, depth: u32) -> Result<MetaValue> {
        Ok(match ty {
            0 => MetaValue::U8(self.arr::<1>(key)?[0]),
            1 => MetaValue::I8(self.arr::<1>(key)?[0] as i8),
            2 => MetaValue::U16(u16::from_le_bytes(self.arr(key)?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.arr(key)?)),
            4 => MetaValue::U32(u32::from_le_bytes(self.arr(key)?)),
            5 => MetaValue::I32(i32::from_le_bytes(self.arr(key)?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.arr(key)?)),
            7 => match self.arr::<1>(key)?[0] {
                0 => MetaValue::Bool(false),
                1 => MetaValue::Bool(true),
                b => {
                    return Err(GgufError::Corrupt(format!(
                        "metadata `{key}`: invalid bool byte {b}"
                    )));
                }
            },
            8 => MetaValue::String(self.string(key)?),
            9 => {
                if depth > 4 {
                    return Err(GgufError::Corrupt(format!(
                        "metadata `{key}`: arrays nested too deeply"
                    )));
                }
                let elem_ty = self.u32(key)?;
                let n = self.u64(key)?;
                // Each element takes at least one byte: bound the allocation by what is left.
                let left = (self.buf.len() - self.pos) as u64;
                if n > left {
                    return Err(GgufError::Truncated {
                        what: format!("metadata `{key}` array of {n} elements"),
                        offset: self.pos as u64,
                        needed: n,
                        len: self.buf.len() as u64,
                    });
                }
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.value(elem_ty, key, depth + 1)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::U64(u64::from_le_bytes(self.arr(key)?)),
            11 => MetaValue::I64(i64::from_le_bytes(self.arr(key)?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.arr(key)?)),
            other => {
                return Err(GgufError::Corrupt(format!(
                    "metadata `{key}`: unknown value type {other}"
                )));
            }
        })
    }
}

/// Undoes llama.cpp's row permutation of a Llama-architecture `attn_q`/`attn_k` weight (or bias).
///
/// llama.cpp's converter stores the Hugging Face rows reordered as
/// `w.reshape(n_head, 2, head_dim/2, in).swapaxes(1, 2).reshape(out, in)`, which turns HF's
/// rotate-half RoPE pairing into llama.cpp's adjacent-pair layout. This returns the HF order.
/// `n_head` is the number of heads *of this tensor*: `n_head` for Q, `n_head_kv` for K.
/// `w` is row-major `[rows, cols]` (use `cols = 1` for a bias). Only `llama`-architecture files
/// converted by llama.cpp carry the permutation; Qwen2/Qwen3 files do not and must not be unpermuted.
pub fn unpermute_qk_rows(w: &[f32], n_head: usize, rows: usize, cols: usize) -> Result<Vec<f32>> {
    permute_rows(w, n_head, rows, cols, false)
}

/// The forward permutation llama.cpp applies (the inverse of [`unpermute_qk_rows`]).
pub fn permute_qk_rows(w: &[f32], n_head: usize, rows: usize, cols: usize) -> Result<Vec<f32>> {
    permute_rows(w, n_head, rows, cols, true)
}

fn permute_rows(
    w: &[f32],
    n_head: usize,
    rows: usize,
    cols: usize,
    forward: bool,
) -> Result<Vec<f32>> {
    if n_head == 0 || !rows.is_multiple_of(n_head) || !(rows / n_head).is_multiple_of(2) {
        return Err(GgufError::SizeMismatch(format!(
            "cannot split {rows} rows into {n_head} heads of even size"
        )));
    }
    if w.len() != rows * cols {
        return Err(GgufError::SizeMismatch(format!(
            "weight has {} elements, expected {rows} x {cols}",
            w.len()
        )));
    }
    let head_dim = rows / n_head;
    let half = head_dim / 2;
    let mut out = vec![0f32; w.len()];
    for h in 0..n_head {
        for i in 0..2 {
            for j in 0..half {
                // HF row (h, i, j) <-> llama.cpp row (h, j, i).
                let hf = h * head_dim + i * half + j;
                let gg = h * head_dim + j * 2 + i;
                let (dst, src) = if forward { (gg, hf) } else { (hf, gg) };
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    Ok(out)
}
