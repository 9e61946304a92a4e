//! Loading a policy model from a spec string: a Hugging Face model directory, a `.gguf` file, a
//! Hugging Face repo id found in the local hub cache, or `default` (the embedded SmolLM2).
//!
//! The result bundles the model (its parameters in a trainable `VarStore`, named as in Hugging
//! Face checkpoints), the tokenizer, the chat template source and the generation defaults.
//! Parameters can be replaced by name afterwards ([`load_named_tensors`]) — the rollout worker
//! swaps weights that way — and enumerated by name for saving ([`LoadedModel::named_parameters`]).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use serde::Deserialize;
use tch::{Device, Kind, Tensor, nn::VarStore};

use crate::chat_template::{ChatTemplate, ChatTemplateError};
use crate::config::{Family, ModelConfig, OneOrMany, RopeScaling};
use crate::error::{ModelError, Result};
use crate::families::{CausalLm, WeightInit};
use crate::gguf::GgufFile;
use crate::tokenizer::Tokenizer;

/// The environment variable naming the embedded default model file.
pub const DEFAULT_MODEL_ENV: &str = "COTRAIN_DEFAULT_MODEL";

/// Where the setup step puts the embedded default model, relative to the home directory.
pub const DEFAULT_MODEL_RELATIVE: &str = ".cache/cotrain/models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// dtype and device of the loaded parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadOptions {
    /// Where the parameters live.
    pub device: Device,
    /// Parameter dtype (f32, bf16 or f16).
    pub kind: Kind,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            device: Device::Cpu,
            kind: Kind::Float,
        }
    }
}

/// A model spec resolved to files on disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    /// A Hugging Face model directory (config.json, safetensors, tokenizer files).
    HfDir(PathBuf),
    /// A single GGUF file carrying its own metadata and tokenizer.
    Gguf(PathBuf),
}

/// Generation settings that come with a checkpoint (`generation_config.json`, GGUF metadata).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationDefaults {
    /// Tokens that end a completion (eos and friends), unless a request ignores them.
    pub eos_token_ids: Vec<u32>,
    /// The beginning-of-sequence token, if any.
    pub bos_token_id: Option<u32>,
    /// Suggested temperature, if the checkpoint has one.
    pub temperature: Option<f64>,
    /// Suggested top-p, if the checkpoint has one.
    pub top_p: Option<f64>,
    /// Suggested top-k, if the checkpoint has one.
    pub top_k: Option<i64>,
}

/// A loaded model with everything needed to prompt it.
pub struct LoadedModel {
    /// The network.
    pub model: CausalLm,
    /// Its parameters, trainable, named as in Hugging Face checkpoints.
    pub vs: VarStore,
    /// The tokenizer.
    pub tokenizer: Tokenizer,
    /// The chat template, if the checkpoint carries one.
    pub chat_template: Option<ChatTemplate>,
    /// Generation defaults (eos ids, ...).
    pub generation: GenerationDefaults,
    /// Where it came from.
    pub source: ModelSource,
}

impl std::fmt::Debug for LoadedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedModel")
            .field("config", self.model.config())
            .field("source", &self.source)
            .field("generation", &self.generation)
            .finish_non_exhaustive()
    }
}

impl LoadedModel {
    /// The parameters by Hugging Face name (shallow handles sharing storage with the model).
    pub fn named_parameters(&self) -> BTreeMap<String, Tensor> {
        self.vs.variables().into_iter().collect()
    }

    /// A second handle on this model that shares its parameters' storage (no copy): a network of
    /// its own ([`CausalLm::share_weights`], so an adapter set on it leaves this one alone) and a
    /// `VarStore` holding the same tensors, frozen. For LoRA training on one base: each policy's
    /// view and the KL reference are such handles.
    pub fn share_frozen(&self) -> LoadedModel {
        let vs = VarStore::new(self.vs.device());
        for (name, tensor) in self.vs.variables() {
            // `Path::add` takes one segment: walk the dotted name's path first.
            let mut parts: Vec<&str> = name.split('.').collect();
            let leaf = parts.pop().expect("split gives at least one part");
            let path = parts.iter().fold(vs.root(), |p, part| p / *part);
            let _ = path.add(leaf, tensor.detach(), false);
        }
        LoadedModel {
            model: self.model.share_weights(),
            vs,
            tokenizer: self.tokenizer.clone(),
            chat_template: self.chat_template.clone(),
            generation: self.generation.clone(),
            source: self.source.clone(),
        }
    }

    /// Replaces parameters by name; see [`load_named_tensors`].
    pub fn load_named_tensors(&self, tensors: &HashMap<String, Tensor>) -> Result<()> {
        load_named_tensors(&self.vs, tensors)
    }

    /// Stop tokens: the generation defaults' eos ids plus the tokenizer's stop tokens.
    pub fn stop_token_ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = self.generation.eos_token_ids.clone();
        ids.extend(self.tokenizer.stop_token_ids().iter().copied());
        ids.sort_unstable();
        ids.dedup();
        ids
    }
}

/// Copies `tensors` into the parameters of the same names, all or nothing: every name must
/// exist and every shape match before anything is written. Float dtypes are converted to the
/// parameter's dtype (weights may be streamed in bf16); devices are converted too.
pub fn load_named_tensors(vs: &VarStore, tensors: &HashMap<String, Tensor>) -> Result<()> {
    let vars = vs.variables();
    for (name, t) in tensors {
        let var = vars.get(name).ok_or_else(|| ModelError::Weight {
            name: name.clone(),
            message: "no parameter of that name".into(),
        })?;
        if var.size() != t.size() {
            return Err(ModelError::Weight {
                name: name.clone(),
                message: format!("shape {:?}, the parameter has {:?}", t.size(), var.size()),
            });
        }
        if !t.is_floating_point() {
            return Err(ModelError::Weight {
                name: name.clone(),
                message: format!("dtype {:?} is not a float", t.kind()),
            });
        }
    }
    let _guard = tch::no_grad_guard();
    for (name, t) in tensors {
        let mut var = vars[name].shallow_clone();
        var.f_copy_(&t.to_device(var.device()).to_kind(var.kind()))?;
    }
    Ok(())
}

/// Resolves a spec (`default`, a path to a directory or `.gguf` file, or an `org/name` repo id
/// in the local Hugging Face cache) to files.
pub fn resolve(spec: &str) -> Result<ModelSource> {
    if spec == "default" {
        return resolve_default();
    }
    let path = Path::new(spec);
    if path.exists() {
        return source_for_path(spec, path);
    }
    if spec.ends_with(".gguf") || spec.starts_with('/') || spec.starts_with('.') {
        return Err(ModelError::MissingFile {
            path: path.to_path_buf(),
            what: "model".into(),
        });
    }
    let parts: Vec<&str> = spec.split('/').collect();
    if parts.len() == 2 && parts.iter().all(|p| !p.is_empty()) {
        return resolve_hf_cache(spec);
    }
    Err(ModelError::Resolve {
        spec: spec.into(),
        message: "not a file, a directory, `default`, or an `org/name` repo id".into(),
    })
}

fn source_for_path(spec: &str, path: &Path) -> Result<ModelSource> {
    if path.is_dir() {
        let ggufs: Vec<PathBuf> = std::fs::read_dir(path)
            .map_err(|source| ModelError::Io {
                path: path.into(),
                source,
            })?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
            .collect();
        if !path.join("config.json").exists() && ggufs.len() == 1 {
            return Ok(ModelSource::Gguf(ggufs[0].clone()));
        }
        if !path.join("config.json").exists() {
            return Err(ModelError::MissingFile {
                path: path.join("config.json"),
                what: format!("`{spec}` is a directory without a Hugging Face config.json"),
            });
        }
        Ok(ModelSource::HfDir(path.to_path_buf()))
    } else {
        Ok(ModelSource::Gguf(path.to_path_buf()))
    }
}

fn resolve_default() -> Result<ModelSource> {
    let path = match std::env::var_os(DEFAULT_MODEL_ENV) {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => home_dir().join(DEFAULT_MODEL_RELATIVE),
    };
    if !path.exists() {
        return Err(ModelError::Resolve {
            spec: "default".into(),
            message: format!(
                "the embedded default model is missing at {}; run `make setup` to fetch it",
                path.display()
            ),
        });
    }
    Ok(ModelSource::Gguf(path))
}

fn home_dir() -> PathBuf {
    std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/"))
}

/// The hub cache directory, in the order `huggingface_hub` uses: `HF_HUB_CACHE`,
/// `HUGGINGFACE_HUB_CACHE`, `$HF_HOME/hub`, `$XDG_CACHE_HOME/huggingface/hub`,
/// `~/.cache/huggingface/hub`.
pub fn hf_hub_cache_dir() -> PathBuf {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(p) = var("HF_HUB_CACHE").or_else(|| var("HUGGINGFACE_HUB_CACHE")) {
        return p;
    }
    if let Some(home) = var("HF_HOME") {
        return home.join("hub");
    }
    if let Some(xdg) = var("XDG_CACHE_HOME") {
        return xdg.join("huggingface").join("hub");
    }
    home_dir().join(".cache").join("huggingface").join("hub")
}

/// Finds `org/name` in the local hub cache: `models--org--name/snapshots/<rev>/`, where `<rev>`
/// is the commit `refs/main` points to, or the only/most recent snapshot. No network access.
fn resolve_hf_cache(repo_id: &str) -> Result<ModelSource> {
    let cache = hf_hub_cache_dir();
    let repo_dir = cache.join(format!("models--{}", repo_id.replace('/', "--")));
    let err = |message: String| ModelError::Resolve {
        spec: repo_id.into(),
        message,
    };
    if !repo_dir.is_dir() {
        return Err(err(format!(
            "not in the local Hugging Face cache ({} does not exist); download it first, \
             e.g. `huggingface-cli download {repo_id}`",
            repo_dir.display()
        )));
    }
    let snapshots = repo_dir.join("snapshots");
    let from_ref = std::fs::read_to_string(repo_dir.join("refs").join("main"))
        .ok()
        .map(|h| snapshots.join(h.trim()))
        .filter(|p| p.is_dir());
    let snapshot = match from_ref {
        Some(p) => p,
        None => {
            let mut dirs: Vec<(std::time::SystemTime, PathBuf)> = std::fs::read_dir(&snapshots)
                .map_err(|e| err(format!("cannot list {}: {e}", snapshots.display())))?
                .filter_map(|e| e.ok())
                .filter(|e| e.path().is_dir())
                .map(|e| {
                    let t = e
                        .metadata()
                        .and_then(|m| m.modified())
                        .unwrap_or(std::time::UNIX_EPOCH);
                    (t, e.path())
                })
                .collect();
            dirs.sort();
            dirs.pop()
                .map(|(_, p)| p)
                .ok_or_else(|| err(format!("no snapshot under {}", snapshots.display())))?
        }
    };
    source_for_path(repo_id, &snapshot)
}

/// Resolves `spec` and loads it with `opts`.
pub fn load(spec: &str, opts: &LoadOptions) -> Result<LoadedModel> {
    let source = resolve(spec)?;
    load_source(source, opts)
}

/// Loads an already resolved source.
pub fn load_source(source: ModelSource, opts: &LoadOptions) -> Result<LoadedModel> {
    if !matches!(opts.kind, Kind::Float | Kind::BFloat16 | Kind::Half) {
        return Err(ModelError::UnknownDtype(format!("{:?}", opts.kind)));
    }
    if let Device::Cuda(i) = opts.device
        && let Some(reason) = crate::cuda::unavailable_reason(i)
    {
        return Err(ModelError::CudaUnavailable { device: format!("cuda:{i}"), reason });
    }
    match &source {
        ModelSource::HfDir(dir) => load_hf_dir(dir, opts, source.clone()),
        ModelSource::Gguf(path) => load_gguf(path, opts, source.clone()),
    }
}

fn new_store(cfg: &ModelConfig, opts: &LoadOptions) -> Result<(VarStore, CausalLm)> {
    let mut vs = VarStore::new(opts.device);
    vs.set_kind(opts.kind);
    let model = CausalLm::new_with_init(cfg, vs.root(), WeightInit::Zeros)?;
    Ok((vs, model))
}

/// Names a checkpoint may carry that the model does not use.
fn ignorable(name: &str, cfg: &ModelConfig) -> bool {
    name.ends_with("rotary_emb.inv_freq") || (cfg.tie_word_embeddings && name == "lm_head.weight")
}

/// Copies checkpoint tensors into the store, checking that every parameter gets exactly one.
struct Filler<'a> {
    vars: HashMap<String, Tensor>,
    cfg: &'a ModelConfig,
    filled: std::collections::HashSet<String>,
}

impl<'a> Filler<'a> {
    fn new(vs: &VarStore, cfg: &'a ModelConfig) -> Self {
        Filler {
            vars: vs.variables(),
            cfg,
            filled: Default::default(),
        }
    }

    fn put(&mut self, name: &str, t: &Tensor) -> Result<()> {
        let Some(var) = self.vars.get(name) else {
            if ignorable(name, self.cfg) {
                return Ok(());
            }
            return Err(ModelError::Weight {
                name: name.into(),
                message: "unexpected tensor in checkpoint (not a parameter of this architecture)"
                    .into(),
            });
        };
        if var.size() != t.size() {
            return Err(ModelError::Weight {
                name: name.into(),
                message: format!(
                    "checkpoint shape {:?}, config implies {:?}",
                    t.size(),
                    var.size()
                ),
            });
        }
        let mut var = var.shallow_clone();
        let _guard = tch::no_grad_guard();
        // `copy_` converts dtype and device itself, without a converted temporary of the tensor.
        var.f_copy_(t)?;
        self.filled.insert(name.to_string());
        Ok(())
    }

    fn finish(self) -> Result<()> {
        let mut missing: Vec<&String> = self
            .vars
            .keys()
            .filter(|k| !self.filled.contains(*k))
            .collect();
        missing.sort();
        if let Some(first) = missing.first() {
            return Err(ModelError::Weight {
                name: (*first).clone(),
                message: format!(
                    "missing from the checkpoint ({} parameters missing)",
                    missing.len()
                ),
            });
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Hugging Face directories

fn read_text(path: &Path, what: &str) -> Result<String> {
    if !path.exists() {
        return Err(ModelError::MissingFile {
            path: path.into(),
            what: what.into(),
        });
    }
    std::fs::read_to_string(path).map_err(|source| ModelError::Io {
        path: path.into(),
        source,
    })
}

fn read_json(path: &Path, what: &str) -> Result<serde_json::Value> {
    let text = read_text(path, what)?;
    serde_json::from_str(&text).map_err(|e| ModelError::InvalidFile {
        path: path.into(),
        message: e.to_string(),
    })
}

/// The safetensors files of a directory: the shards named by `model.safetensors.index.json`,
/// or `model.safetensors`.
fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let json = read_json(&index, "shard index")?;
        let map = json["weight_map"]
            .as_object()
            .ok_or_else(|| ModelError::InvalidFile {
                path: index.clone(),
                message: "no `weight_map` object".into(),
            })?;
        let mut files: Vec<String> = map
            .values()
            .filter_map(|v| v.as_str().map(str::to_string))
            .collect();
        files.sort();
        files.dedup();
        return files
            .into_iter()
            .map(|f| {
                let p = dir.join(&f);
                if p.exists() {
                    Ok(p)
                } else {
                    Err(ModelError::MissingFile {
                        path: p,
                        what: "weight shard named by the index".into(),
                    })
                }
            })
            .collect();
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    Err(ModelError::MissingFile {
        path: single,
        what: "weights (neither model.safetensors nor model.safetensors.index.json)".into(),
    })
}

#[derive(Deserialize, Default)]
struct GenerationConfigJson {
    eos_token_id: Option<OneOrMany>,
    bos_token_id: Option<u32>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
}

/// A chat template, or `None` when the checkpoint has none.
fn optional_template(
    t: std::result::Result<ChatTemplate, ChatTemplateError>,
) -> Result<Option<ChatTemplate>> {
    match t {
        Ok(t) => Ok(Some(t)),
        Err(ChatTemplateError::Missing(_)) => Ok(None),
        Err(e) => Err(ModelError::Tokenizer(format!("chat template: {e}"))),
    }
}

/// Loads only the network of a Hugging Face directory (config.json and safetensors; no
/// tokenizer needed): the parameters' store and the model built on it.
pub fn load_hf_weights(dir: &Path, opts: &LoadOptions) -> Result<(VarStore, CausalLm)> {
    let cfg_path = dir.join("config.json");
    read_text(&cfg_path, "model config")?;
    let cfg = ModelConfig::from_file(&cfg_path)?;
    let (vs, model) = new_store(&cfg, opts)?;
    let mut filler = Filler::new(&vs, &cfg);
    for file in safetensors_files(dir)? {
        for_each_safetensor(&file, |name, t| filler.put(name, &t))?;
    }
    filler.finish()?;
    Ok((vs, model))
}

/// Calls `f` with each tensor of a safetensors file, one at a time: the file is mapped, not read,
/// and each tensor is copied out of the mapping only for its call. Reading the whole file first
/// (`Tensor::read_safetensors`) held the file's bytes, every tensor in its stored dtype and the
/// parameters at once, and the process keeps its peak ([`crate::allocator`]): a bf16 1.7B
/// checkpoint loaded in f32 stayed at twice the parameters' size.
fn for_each_safetensor(file: &Path, mut f: impl FnMut(&str, Tensor) -> Result<()>) -> Result<()> {
    let bad = |message: String| ModelError::InvalidFile { path: file.to_path_buf(), message };
    let handle = std::fs::File::open(file).map_err(|source| ModelError::Io { path: file.to_path_buf(), source })?;
    // SAFETY: the mapping is read-only and lives until the end of this function. Another process
    // rewriting the file meanwhile could give wrong bytes, as reading it could, and truncating it
    // would stop this process (SIGBUS): model files are not written while a model loads from them.
    let map = unsafe { memmap2::Mmap::map(&handle) }.map_err(|source| ModelError::Io { path: file.to_path_buf(), source })?;
    if map.len() < 8 {
        return Err(bad("not a readable safetensors file: shorter than its 8-byte header length".into()));
    }
    let header_len = u64::from_le_bytes(map[..8].try_into().expect("8 bytes")) as usize;
    let body = 8usize.checked_add(header_len).filter(|&b| b <= map.len()).ok_or_else(|| bad(format!("not a readable safetensors file: header of {header_len} bytes past the end")))?;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&map[8..body]).map_err(|e| bad(format!("not a readable safetensors file: header: {e}")))?;
    for (name, entry) in &header {
        if name == "__metadata__" {
            continue;
        }
        let kind = match entry["dtype"].as_str() {
            Some("F32") => Kind::Float,
            Some("BF16") => Kind::BFloat16,
            Some("F16") => Kind::Half,
            Some("F64") => Kind::Double,
            Some("I64") => Kind::Int64,
            Some("I32") => Kind::Int,
            Some("I16") => Kind::Int16,
            Some("I8") => Kind::Int8,
            Some("U8") => Kind::Uint8,
            Some("BOOL") => Kind::Bool,
            other => return Err(bad(format!("tensor `{name}`: unsupported dtype {other:?}"))),
        };
        let dims = entry["shape"].as_array().ok_or_else(|| bad(format!("tensor `{name}`: no shape")))?;
        let shape: Vec<i64> = dims.iter().map(|v| v.as_u64().and_then(|d| i64::try_from(d).ok())).collect::<Option<_>>()
            .ok_or_else(|| bad(format!("tensor `{name}`: shape {dims:?} is not a list of sizes")))?;
        let offsets: Vec<u64> = entry["data_offsets"].as_array().map(|a| a.iter().filter_map(|v| v.as_u64()).collect()).unwrap_or_default();
        let [start, end] = offsets[..] else {
            return Err(bad(format!("tensor `{name}`: no data_offsets")));
        };
        // The byte count the shape implies, and the data's place in the file, without overflow.
        let want = shape.iter().try_fold(kind.elt_size_in_bytes() as u64, |n, &d| n.checked_mul(d as u64));
        let range = (body as u64).checked_add(start).zip((body as u64).checked_add(end));
        let (from, to) = match (want, range) {
            (Some(want), Some((from, to))) if start <= end && to <= map.len() as u64 && end - start == want => (from as usize, to as usize),
            _ => return Err(bad(format!("tensor `{name}`: data_offsets [{start}, {end}] do not hold its {shape:?} {kind:?}"))),
        };
        let t = Tensor::f_from_data_size(&map[from..to], &shape, kind)?;
        f(name, t)?;
    }
    Ok(())
}

/// The generation defaults of a Hugging Face directory (`generation_config.json`, config.json).
pub fn hf_generation_defaults(dir: &Path, cfg: &ModelConfig) -> Result<GenerationDefaults> {
    let gen_path = dir.join("generation_config.json");
    let gen_cfg: GenerationConfigJson = if gen_path.exists() {
        serde_json::from_str(&read_text(&gen_path, "generation config")?).map_err(|e| {
            ModelError::InvalidFile {
                path: gen_path.clone(),
                message: e.to_string(),
            }
        })?
    } else {
        GenerationConfigJson::default()
    };
    let mut eos = gen_cfg
        .eos_token_id
        .map(OneOrMany::into_vec)
        .unwrap_or_default();
    eos.extend(&cfg.eos_token_ids);
    eos.sort_unstable();
    eos.dedup();
    Ok(GenerationDefaults {
        eos_token_ids: eos,
        bos_token_id: gen_cfg.bos_token_id.or(cfg.bos_token_id),
        temperature: gen_cfg.temperature,
        top_p: gen_cfg.top_p,
        top_k: gen_cfg.top_k,
    })
}

fn load_hf_dir(dir: &Path, opts: &LoadOptions, source: ModelSource) -> Result<LoadedModel> {
    let tok_path = dir.join("tokenizer.json");
    if !tok_path.exists() {
        return Err(ModelError::MissingFile {
            path: tok_path,
            what: "tokenizer".into(),
        });
    }
    let (vs, model) = load_hf_weights(dir, opts)?;
    let tokenizer =
        Tokenizer::from_hf_dir(dir).map_err(|e| ModelError::Tokenizer(e.to_string()))?;
    let mut generation = hf_generation_defaults(dir, model.config())?;
    generation.eos_token_ids.extend(tokenizer.eos_id());
    generation.eos_token_ids.sort_unstable();
    generation.eos_token_ids.dedup();
    Ok(LoadedModel {
        model,
        vs,
        tokenizer,
        chat_template: optional_template(ChatTemplate::from_hf_dir(dir, None))?,
        generation,
        source,
    })
}

/// The tokenizer and chat template of a model spec, without loading its weights (for tools that
/// only render and count prompts).
pub fn load_text_side(spec: &str) -> Result<(Tokenizer, Option<ChatTemplate>)> {
    match resolve(spec)? {
        ModelSource::HfDir(dir) => {
            let tokenizer = Tokenizer::from_hf_dir(&dir).map_err(|e| ModelError::Tokenizer(e.to_string()))?;
            Ok((tokenizer, optional_template(ChatTemplate::from_hf_dir(&dir, None))?))
        }
        ModelSource::Gguf(path) => {
            let gguf = GgufFile::open(&path).map_err(|e| gguf_err(&path, e))?;
            let tokenizer = Tokenizer::from_gguf(&gguf).map_err(|e| ModelError::Tokenizer(e.to_string()))?;
            Ok((tokenizer, optional_template(ChatTemplate::from_gguf(&gguf))?))
        }
    }
}

// ---------------------------------------------------------------------------------------------
// GGUF files

fn gguf_err(path: &Path, e: impl std::fmt::Display) -> ModelError {
    ModelError::Gguf {
        path: path.into(),
        message: e.to_string(),
    }
}

/// Builds the model config from a GGUF file's `<arch>.*` metadata.
pub fn gguf_config(gguf: &GgufFile, path: &Path) -> Result<ModelConfig> {
    let arch = gguf
        .architecture()
        .map_err(|e| gguf_err(path, e))?
        .to_string();
    let family = match arch.as_str() {
        "llama" => Family::Llama,
        "qwen2" => Family::Qwen2,
        "qwen3" => Family::Qwen3,
        other => {
            return Err(ModelError::UnsupportedArchitecture(format!(
                "{other} (gguf)"
            )));
        }
    };
    let key = |s: &str| format!("{arch}.{s}");
    let req = |s: &str| -> Result<usize> {
        Ok(gguf.get_u64(&key(s)).map_err(|e| gguf_err(path, e))? as usize)
    };
    let opt = |s: &str| {
        gguf.get(&key(s))
            .and_then(|v| v.as_i128())
            .map(|v| v as usize)
    };
    let hidden = req("embedding_length")?;
    let heads = req("attention.head_count")?;
    let kv_heads = opt("attention.head_count_kv").unwrap_or(heads);
    let head_dim = opt("attention.key_length").unwrap_or(hidden / heads.max(1));
    let vocab = match opt("vocab_size") {
        Some(v) => v,
        None => gguf
            .get_array("tokenizer.ggml.tokens")
            .map_err(|e| gguf_err(path, e))?
            .len(),
    };
    let rope_theta = gguf
        .get(&key("rope.freq_base"))
        .and_then(|v| v.as_f64())
        .unwrap_or(if family == Family::Llama {
            10000.0
        } else {
            1_000_000.0
        });
    let eps = gguf
        .get(&key("attention.layer_norm_rms_epsilon"))
        .and_then(|v| v.as_f64())
        .unwrap_or(1e-6);
    let max_pos = opt("context_length").unwrap_or(2048);
    let rope_scaling = match gguf.get(&key("rope.scaling.type")).and_then(|v| v.as_str()) {
        None | Some("none") => RopeScaling::None,
        Some("linear") => RopeScaling::Linear {
            factor: gguf
                .get(&key("rope.scaling.factor"))
                .and_then(|v| v.as_f64())
                .ok_or_else(|| gguf_err(path, "rope.scaling.type linear without a factor"))?,
        },
        Some(other) => return Err(ModelError::UnsupportedRopeScaling(other.to_string())),
    };
    if gguf.tensor_info("rope_freqs.weight").is_some() {
        return Err(ModelError::UnsupportedRopeScaling(
            "gguf rope_freqs (llama3-style frequency factors)".into(),
        ));
    }
    let tie = gguf.tensor_info("output.weight").is_none();
    let eos = gguf
        .get("tokenizer.ggml.eos_token_id")
        .and_then(|v| v.as_i128())
        .map(|v| v as u32);
    let bos = gguf
        .get("tokenizer.ggml.bos_token_id")
        .and_then(|v| v.as_i128())
        .map(|v| v as u32);
    let cfg = ModelConfig {
        family,
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: req("feed_forward_length")?,
        num_hidden_layers: req("block_count")?,
        num_attention_heads: heads,
        num_key_value_heads: kv_heads,
        head_dim,
        rms_norm_eps: eps,
        rope_theta,
        rope_scaling,
        max_position_embeddings: max_pos,
        tie_word_embeddings: tie,
        attention_bias: family == Family::Qwen2,
        qk_norm: family == Family::Qwen3,
        bos_token_id: bos,
        eos_token_ids: eos.into_iter().collect(),
    };
    cfg.validate()?;
    Ok(cfg)
}

/// Maps a GGUF tensor name to its Hugging Face name.
pub fn gguf_to_hf_name(name: &str) -> Option<String> {
    let fixed = match name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_string());
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (module, param) = rest.rsplit_once('.')?;
    let hf = match module {
        "attn_norm" => "input_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "ffn_norm" => "post_attention_layernorm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}.{param}"))
}

fn load_gguf(path: &Path, opts: &LoadOptions, source: ModelSource) -> Result<LoadedModel> {
    if !path.exists() {
        return Err(ModelError::MissingFile {
            path: path.into(),
            what: "gguf model".into(),
        });
    }
    let gguf = GgufFile::open(path).map_err(|e| gguf_err(path, e))?;
    let cfg = gguf_config(&gguf, path)?;
    let (vs, model) = new_store(&cfg, opts)?;
    let mut filler = Filler::new(&vs, &cfg);
    let unpermute = cfg.family == Family::Llama;
    for info in gguf.tensors() {
        let Some(hf) = gguf_to_hf_name(&info.name) else {
            return Err(ModelError::Weight {
                name: info.name.clone(),
                message: "gguf tensor with no Hugging Face counterpart".into(),
            });
        };
        let mut data = gguf.dequantize(&info.name).map_err(|e| gguf_err(path, e))?;
        let shape: Vec<i64> = info.shape.iter().map(|&d| d as i64).collect();
        if unpermute && (info.name.contains(".attn_q.") || info.name.contains(".attn_k.")) {
            let n_head = if info.name.contains(".attn_q.") {
                cfg.num_attention_heads
            } else {
                cfg.num_key_value_heads
            };
            let rows = info.shape[0];
            let cols = info.shape.get(1).copied().unwrap_or(1);
            data = crate::gguf::unpermute_qk_rows(&data, n_head, rows, cols)
                .map_err(|e| gguf_err(path, e))?;
        }
        let t = Tensor::from_slice(&data).view(shape.as_slice());
        drop(data);
        filler.put(&hf, &t)?;
    }
    filler.finish()?;
    let tokenizer =
        Tokenizer::from_gguf(&gguf).map_err(|e| ModelError::Tokenizer(e.to_string()))?;
    let chat_template = optional_template(ChatTemplate::from_gguf(&gguf))?;
    let mut eos = cfg.eos_token_ids.clone();
    eos.extend(tokenizer.eos_id());
    eos.sort_unstable();
    eos.dedup();
    let generation = GenerationDefaults {
        eos_token_ids: eos,
        bos_token_id: cfg.bos_token_id,
        ..Default::default()
    };
    Ok(LoadedModel {
        model,
        vs,
        tokenizer,
        chat_template,
        generation,
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_gguf_names_to_hf_names() {
        assert_eq!(
            gguf_to_hf_name("token_embd.weight").unwrap(),
            "model.embed_tokens.weight"
        );
        assert_eq!(
            gguf_to_hf_name("blk.12.attn_q.bias").unwrap(),
            "model.layers.12.self_attn.q_proj.bias"
        );
        assert_eq!(
            gguf_to_hf_name("blk.0.ffn_norm.weight").unwrap(),
            "model.layers.0.post_attention_layernorm.weight"
        );
        assert!(gguf_to_hf_name("blk.x.attn_q.weight").is_none());
        assert!(gguf_to_hf_name("rope_freqs.weight").is_none());
    }

    #[test]
    fn missing_default_model_says_to_run_setup() {
        // Only the resolution logic is exercised: a path that does not exist.
        let e = ModelError::Resolve {
            spec: "default".into(),
            message: "x".into(),
        };
        assert!(e.to_string().contains("default"));
        let e = resolve("/nonexistent/model.gguf").unwrap_err().to_string();
        assert!(e.contains("missing file"), "{e}");
        let e = resolve("no-such-org/no-such-model-xyz")
            .unwrap_err()
            .to_string();
        assert!(e.contains("local Hugging Face cache"), "{e}");
    }
}
