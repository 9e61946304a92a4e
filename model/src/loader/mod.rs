//! Loading a policy model from a spec string: a Hugging Face model directory, a `.gguf` file, a
//! Hugging Face repo id found in the local hub cache, or `default` (the embedded SmolLM2).
//!
//! The result bundles the model (its parameters in a trainable `VarStore`, named as in Hugging
//! Face checkpoints), the tokenizer, the chat template source and the generation defaults.
//! Parameters can be replaced by name afterwards ([`load_named_tensors`]) — the rollout worker
//! swaps weights that way — and enumerated by name for saving ([`LoadedModel::named_parameters`]).
//!
//! Files: `resolve` (spec to files), `hf_dir` (Hugging Face directories), `gguf_file` (GGUF);
//! this file holds the result types and the checks every format shares.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

use tch::{Device, Kind, Tensor, nn::VarStore};

use crate::chat_template::{ChatTemplate, ChatTemplateError};
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::families::{CausalLm, WeightInit};
use crate::gguf::GgufFile;
use crate::tokenizer::Tokenizer;

mod gguf_file;
mod hf_dir;
mod resolve;

pub use gguf_file::{gguf_config, gguf_to_hf_name};
use gguf_file::{gguf_err, load_gguf};
use hf_dir::load_hf_dir;
pub use hf_dir::{hf_generation_defaults, load_hf_weights};
pub use resolve::{hf_hub_cache_dir, resolve};

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
        return Err(ModelError::CudaUnavailable {
            device: format!("cuda:{i}"),
            reason,
        });
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

    /// Copies one checkpoint tensor in; a fused Phi-3 projection is split into the parameters
    /// it holds first.
    fn put(&mut self, name: &str, t: &Tensor) -> Result<()> {
        if self.cfg.family == crate::config::Family::Phi3
            && let Some(parts) = crate::families::phi3::split_fused(self.cfg, name, t)
        {
            for (part, piece) in parts? {
                self.put_one(&part, &piece)?;
            }
            return Ok(());
        }
        self.put_one(name, t)
    }

    fn put_one(&mut self, name: &str, t: &Tensor) -> Result<()> {
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

/// The tokenizer and chat template of a model spec, without loading its weights (for tools that
/// only render and count prompts).
pub fn load_text_side(spec: &str) -> Result<(Tokenizer, Option<ChatTemplate>)> {
    match resolve(spec)? {
        ModelSource::HfDir(dir) => {
            let tokenizer =
                Tokenizer::from_hf_dir(&dir).map_err(|e| ModelError::Tokenizer(e.to_string()))?;
            Ok((
                tokenizer,
                optional_template(ChatTemplate::from_hf_dir(&dir, None))?,
            ))
        }
        ModelSource::Gguf(path) => {
            let gguf = GgufFile::open(&path).map_err(|e| gguf_err(&path, e))?;
            let tokenizer =
                Tokenizer::from_gguf(&gguf).map_err(|e| ModelError::Tokenizer(e.to_string()))?;
            Ok((
                tokenizer,
                optional_template(ChatTemplate::from_gguf(&gguf))?,
            ))
        }
    }
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
