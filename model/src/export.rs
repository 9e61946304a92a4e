//! Writing a loaded (and possibly trained) model as a Hugging Face model directory, the form
//! transformers' `from_pretrained`, vLLM and [`crate::loader::load`] all read.
//!
//! A run's checkpoints hold only the learner's tensors; whatever the base model came from (a
//! Hugging Face directory, a GGUF file, the embedded default), [`save_pretrained`] writes a
//! self-contained directory: `config.json` (from the checked [`ModelConfig`]),
//! `model.safetensors` (the parameters in their own dtype, under their Hugging Face names),
//! `tokenizer.json`, `tokenizer_config.json` (special tokens, chat template),
//! `special_tokens_map.json` and `generation_config.json`.
//!
//! The directory is written next to its target under a temporary name and renamed into place,
//! so a crash leaves either the old directory or the complete new one.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde_json::{Map, Value, json};
use tch::{Device, Kind, Tensor};

use crate::config::{Family, ModelConfig, RopeScaling};
use crate::loader::{LoadedModel, ModelSource};

/// Why a model directory could not be written.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    /// A filesystem operation failed.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The target exists and holds something other than a model directory, which is never
    /// replaced.
    #[error("{0} exists and is not a model directory (no config.json); refusing to replace it")]
    NotAModelDir(PathBuf),
    /// A parameter cannot be written as Hugging Face expects it.
    #[error("parameter `{name}`: {message}")]
    Parameter {
        /// The parameter's name.
        name: String,
        /// What is wrong.
        message: String,
    },
    /// A side file of the source model (`tokenizer_config.json`, ...) does not parse.
    #[error("invalid {path}: {message}")]
    InvalidSource {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// The tokenizer could not be serialised.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// An error from libtorch while copying a tensor out.
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
}

/// Shorthand for results of this module.
pub type Result<T, E = ExportError> = std::result::Result<T, E>;

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ExportError + '_ {
    move |source| ExportError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Writes `model` (its current parameters, tokenizer, chat template and generation defaults)
/// as a Hugging Face model directory at `dir`, atomically. An existing model directory at `dir`
/// is replaced; any other existing non-empty directory is refused. Returns `dir`.
pub fn save_pretrained(model: &LoadedModel, dir: &Path) -> Result<PathBuf> {
    let parent = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = dir
        .file_name()
        .ok_or_else(|| ExportError::Io {
            path: dir.to_path_buf(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "no directory name"),
        })?
        .to_string_lossy()
        .into_owned();
    if dir.exists() && !replaceable(dir)? {
        return Err(ExportError::NotAModelDir(dir.to_path_buf()));
    }
    std::fs::create_dir_all(&parent).map_err(io(&parent))?;
    let tmp = parent.join(format!(".tmp-{name}-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
    }
    std::fs::create_dir_all(&tmp).map_err(io(&tmp))?;
    let written = write_files(model, &tmp);
    if let Err(e) = written {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    sync(&tmp)?;
    if dir.exists() {
        // Move the old directory aside first so that the rename into place stays atomic.
        let old = parent.join(format!(".old-{name}-{}", std::process::id()));
        std::fs::rename(dir, &old).map_err(io(dir))?;
        std::fs::rename(&tmp, dir).map_err(io(dir))?;
        std::fs::remove_dir_all(&old).map_err(io(&old))?;
    } else {
        std::fs::rename(&tmp, dir).map_err(io(dir))?;
    }
    sync(&parent)?;
    Ok(dir.to_path_buf())
}

/// Whether an existing path may be replaced: an empty directory or an earlier export.
fn replaceable(dir: &Path) -> Result<bool> {
    if !dir.is_dir() {
        return Ok(false);
    }
    if dir.join("config.json").is_file() {
        return Ok(true);
    }
    Ok(std::fs::read_dir(dir).map_err(io(dir))?.next().is_none())
}

fn sync(path: &Path) -> Result<()> {
    File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(io(path))
}

fn write_files(model: &LoadedModel, dir: &Path) -> Result<()> {
    let cfg = model.model.config();
    let mut params = model.named_parameters();
    if cfg.family == Family::Phi3 {
        fuse_phi3(&mut params, cfg)?;
    }
    let kind = parameter_kind(&params)?;
    let source_dir = match &model.source {
        ModelSource::HfDir(d) => Some(d.as_path()),
        ModelSource::Gguf(_) => None,
    };

    write_json(&dir.join("config.json"), &config_json(cfg, model, kind)?)?;
    write_safetensors(&dir.join("model.safetensors"), &params, cfg)?;

    let tok_path = dir.join("tokenizer.json");
    model
        .tokenizer
        .inner()
        .save(&tok_path, false)
        .map_err(|e| ExportError::Tokenizer(format!("{}: {e}", tok_path.display())))?;
    sync(&tok_path)?;

    let specials = SpecialTokens::of(model);
    let base = source_dir
        .map(|d| read_source_json(&d.join("tokenizer_config.json")))
        .transpose()?
        .flatten();
    write_json(
        &dir.join("tokenizer_config.json"),
        &tokenizer_config_json(model, &specials, base),
    )?;
    write_json(
        &dir.join("special_tokens_map.json"),
        &Value::Object(specials.map()),
    )?;
    let base = source_dir
        .map(|d| read_source_json(&d.join("generation_config.json")))
        .transpose()?
        .flatten();
    write_json(
        &dir.join("generation_config.json"),
        &generation_config_json(model, base),
    )?;
    Ok(())
}

/// Phi-3 checkpoints keep q/k/v and gate/up fused: concatenates the projections the loader split
/// ([`crate::families::phi3::split_fused`]) back into `qkv_proj` and `gate_up_proj`.
fn fuse_phi3(params: &mut BTreeMap<String, Tensor>, cfg: &ModelConfig) -> Result<()> {
    fuse_phi3_groups(params, cfg, true)
}

/// [`fuse_phi3`] for the groups present in `params`; with `require_all`, every group must be.
/// A group present in part is an error either way: its fused tensor cannot be written.
fn fuse_phi3_groups(
    params: &mut BTreeMap<String, Tensor>,
    cfg: &ModelConfig,
    require_all: bool,
) -> Result<()> {
    for (fused, parts) in crate::families::phi3::fused_names(cfg.num_hidden_layers) {
        if !require_all && parts.iter().all(|p| !params.contains_key(p)) {
            continue;
        }
        let pieces = parts
            .iter()
            .map(|p| {
                params.remove(p).ok_or_else(|| ExportError::Parameter {
                    name: p.clone(),
                    message: format!("missing: it is part of Phi-3's `{fused}`"),
                })
            })
            .collect::<Result<Vec<Tensor>>>()?;
        params.insert(fused, Tensor::f_cat(&pieces, 0)?);
    }
    Ok(())
}

/// Writes some or all of a model's parameters (under cotrain's names, as an update carries them)
/// as one safetensors file under Hugging Face's names, in their own dtype: the file an engine
/// that reads Hugging Face checkpoints (vLLM) loads an update from. Phi-3's split projections are
/// fused again. With tied embeddings the embedding is written under `lm_head.weight` too: vLLM's
/// in-place reload unties the two (its head becomes a tensor of its own at the first reload), so
/// a file that named only the embedding would leave the head at its old value.
pub fn write_weights_file(
    path: &Path,
    params: &BTreeMap<String, Tensor>,
    cfg: &ModelConfig,
) -> Result<()> {
    let mut params: BTreeMap<String, Tensor> = params
        .iter()
        .map(|(k, t)| (k.clone(), t.shallow_clone()))
        .collect();
    if cfg.family == Family::Phi3 {
        fuse_phi3_groups(&mut params, cfg, false)?;
    }
    let mut untied = cfg.clone();
    if cfg.tie_word_embeddings {
        if let Some(e) = params
            .get("model.embed_tokens.weight")
            .map(Tensor::shallow_clone)
        {
            params.insert("lm_head.weight".into(), e);
        }
        untied.tie_word_embeddings = false;
    }
    write_safetensors(path, &params, &untied)
}

/// The one float dtype all parameters share (the training dtype).
fn parameter_kind(params: &BTreeMap<String, Tensor>) -> Result<Kind> {
    let mut kind = None;
    for (name, t) in params {
        let k = t.kind();
        if !matches!(k, Kind::Float | Kind::BFloat16 | Kind::Half) {
            return Err(ExportError::Parameter {
                name: name.clone(),
                message: format!("dtype {k:?} (expected f32, bf16 or f16)"),
            });
        }
        match kind {
            None => kind = Some(k),
            Some(first) if first != k => {
                return Err(ExportError::Parameter {
                    name: name.clone(),
                    message: format!("dtype {k:?}, other parameters are {first:?}"),
                });
            }
            Some(_) => {}
        }
    }
    kind.ok_or_else(|| ExportError::Parameter {
        name: String::new(),
        message: "the model has no parameters".into(),
    })
}

/// transformers' name of a dtype (`torch_dtype` / `dtype` in config.json).
fn torch_dtype(kind: Kind) -> &'static str {
    match kind {
        Kind::BFloat16 => "bfloat16",
        Kind::Half => "float16",
        _ => "float32",
    }
}

/// One id as a number, several as a list (as transformers writes `eos_token_id`).
fn ids_json(ids: &[u32]) -> Value {
    match ids {
        [] => Value::Null,
        [one] => json!(one),
        many => json!(many),
    }
}

/// `config.json` in the form Hub checkpoints use (`rope_theta` + `rope_scaling`, `torch_dtype`),
/// which transformers 4 and 5, vLLM and [`ModelConfig::from_hf_json`] all read; `dtype` is the
/// transformers 5 spelling of `torch_dtype`.
fn config_json(cfg: &ModelConfig, model: &LoadedModel, kind: Kind) -> Result<Value> {
    let model_type = match cfg.family {
        Family::Llama => "llama",
        Family::Qwen2 => "qwen2",
        Family::Qwen3 => "qwen3",
        Family::Phi3 => "phi3",
    };
    let phi3 = cfg.family == Family::Phi3;
    let phi3_only = match (&cfg.rope_scaling, cfg.sliding_window) {
        (RopeScaling::LongRope { .. }, _) => Some("LongRoPE"),
        (_, Some(_)) => Some("a sliding window"),
        _ => None,
    };
    if let Some(what) = phi3_only.filter(|_| !phi3) {
        return Err(ExportError::Parameter {
            name: "model.layers.0.self_attn.q_proj.weight".into(),
            message: format!("{what} exists only in phi3 configs here, not {model_type}"),
        });
    }
    if cfg.family == Family::Qwen2 && !cfg.attention_bias {
        // transformers' Qwen2 always has q/k/v biases; there is no key to turn them off.
        return Err(ExportError::Parameter {
            name: "model.layers.0.self_attn.q_proj.bias".into(),
            message: "a qwen2 model without attention biases has no Hugging Face config".into(),
        });
    }
    if cfg.family != Family::Qwen3 && cfg.qk_norm {
        return Err(ExportError::Parameter {
            name: "model.layers.0.self_attn.q_norm.weight".into(),
            message: format!("q/k norms exist only in qwen3, not {model_type}"),
        });
    }
    let rope_scaling = match &cfg.rope_scaling {
        RopeScaling::None => Value::Null,
        RopeScaling::Linear { factor } => json!({"rope_type": "linear", "factor": factor}),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => json!({
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low_freq_factor,
            "high_freq_factor": high_freq_factor,
            "original_max_position_embeddings": original_max_position_embeddings.round() as u64,
        }),
        // The three fields transformers 4's Phi3Config insists on; the context lengths are
        // top-level keys, from which both versions derive the default attention factor.
        RopeScaling::LongRope {
            short_factor,
            long_factor,
            original_max_position_embeddings,
            attention_factor,
        } => {
            let mut r = json!({"type": "longrope", "short_factor": short_factor, "long_factor": long_factor});
            let factor =
                cfg.max_position_embeddings as f64 / *original_max_position_embeddings as f64;
            let derived = crate::families::phi3::default_attention_factor(
                factor,
                *original_max_position_embeddings,
            );
            if (attention_factor - derived).abs() > 1e-12 {
                r["attention_factor"] = json!(attention_factor);
            }
            r
        }
    };
    if phi3
        && matches!(
            cfg.rope_scaling,
            RopeScaling::Linear { .. } | RopeScaling::Llama3 { .. }
        )
    {
        return Err(ExportError::Parameter {
            name: "model.layers.0.self_attn.qkv_proj.weight".into(),
            message: "phi3 configs carry only LongRoPE scaling".into(),
        });
    }
    let mut c = Map::new();
    c.insert(
        "architectures".into(),
        json!([cfg.family.hf_architecture()]),
    );
    c.insert("model_type".into(), json!(model_type));
    c.insert("vocab_size".into(), json!(cfg.vocab_size));
    c.insert("hidden_size".into(), json!(cfg.hidden_size));
    c.insert("intermediate_size".into(), json!(cfg.intermediate_size));
    c.insert("num_hidden_layers".into(), json!(cfg.num_hidden_layers));
    c.insert("num_attention_heads".into(), json!(cfg.num_attention_heads));
    c.insert("num_key_value_heads".into(), json!(cfg.num_key_value_heads));
    c.insert("head_dim".into(), json!(cfg.head_dim));
    c.insert("hidden_act".into(), json!("silu"));
    c.insert(
        "max_position_embeddings".into(),
        json!(cfg.max_position_embeddings),
    );
    c.insert("rms_norm_eps".into(), json!(cfg.rms_norm_eps));
    c.insert("rope_theta".into(), json!(cfg.rope_theta));
    c.insert("rope_scaling".into(), rope_scaling);
    c.insert("tie_word_embeddings".into(), json!(cfg.tie_word_embeddings));
    match cfg.family {
        Family::Llama => {
            c.insert("attention_bias".into(), json!(cfg.attention_bias));
            c.insert("mlp_bias".into(), json!(false));
        }
        Family::Qwen2 => {
            c.insert("use_sliding_window".into(), json!(false));
        }
        Family::Qwen3 => {
            c.insert("attention_bias".into(), json!(cfg.attention_bias));
            c.insert("use_sliding_window".into(), json!(false));
        }
        Family::Phi3 => {
            if let RopeScaling::LongRope {
                original_max_position_embeddings,
                ..
            } = &cfg.rope_scaling
            {
                c.insert(
                    "original_max_position_embeddings".into(),
                    json!(original_max_position_embeddings),
                );
            }
            c.insert(
                "sliding_window".into(),
                cfg.sliding_window.map_or(Value::Null, |w| json!(w)),
            );
            for key in ["resid_pdrop", "embd_pdrop"] {
                c.insert(key.into(), json!(0.0));
            }
        }
    }
    c.insert("attention_dropout".into(), json!(0.0));
    c.insert("initializer_range".into(), json!(0.02));
    c.insert(
        "bos_token_id".into(),
        cfg.bos_token_id.map_or(Value::Null, |id| json!(id)),
    );
    c.insert("eos_token_id".into(), ids_json(&cfg.eos_token_ids));
    c.insert(
        "pad_token_id".into(),
        model.tokenizer.pad_id().map_or(Value::Null, |id| json!(id)),
    );
    c.insert("use_cache".into(), json!(true));
    c.insert("torch_dtype".into(), json!(torch_dtype(kind)));
    c.insert("dtype".into(), json!(torch_dtype(kind)));
    Ok(Value::Object(c))
}

/// The special-token strings the exported tokenizer files name.
struct SpecialTokens {
    bos: Option<String>,
    eos: Option<String>,
    pad: Option<String>,
}

impl SpecialTokens {
    /// The chat template's bos/eos strings come first: they are what the source's
    /// `tokenizer_config.json` (or GGUF metadata) said, and the reloaded template must see the
    /// same ones; the tokenizer's tokens fill in when there is no template.
    fn of(model: &LoadedModel) -> Self {
        let t = &model.tokenizer;
        let template = model.chat_template.as_ref();
        SpecialTokens {
            bos: template
                .and_then(|c| c.bos_token().map(str::to_string))
                .or_else(|| t.bos_token()),
            eos: template
                .and_then(|c| c.eos_token().map(str::to_string))
                .or_else(|| t.eos_token()),
            pad: t.pad_id().and_then(|id| t.id_to_token(id)),
        }
    }

    fn map(&self) -> Map<String, Value> {
        let mut m = Map::new();
        for (key, v) in [
            ("bos_token", &self.bos),
            ("eos_token", &self.eos),
            ("pad_token", &self.pad),
        ] {
            if let Some(s) = v {
                m.insert(key.into(), json!(s));
            }
        }
        m
    }
}

/// `tokenizer_config.json`: the source's own (for a Hugging Face source) with the special
/// tokens, `add_bos_token`/`add_eos_token`, the chat template and `model_max_length` set from
/// the loaded model. `PreTrainedTokenizerFast` (when the source names no class) runs
/// `tokenizer.json` as written, which is exactly the tokenizer cotrain used.
fn tokenizer_config_json(
    model: &LoadedModel,
    specials: &SpecialTokens,
    base: Option<Value>,
) -> Value {
    let mut c = match base {
        Some(Value::Object(m)) => m,
        _ => Map::new(),
    };
    c.entry("tokenizer_class")
        .or_insert_with(|| json!("PreTrainedTokenizerFast"));
    for (key, v) in [
        ("bos_token", &specials.bos),
        ("eos_token", &specials.eos),
        ("pad_token", &specials.pad),
    ] {
        c.insert(key.into(), v.as_ref().map_or(Value::Null, |s| json!(s)));
    }
    let (add_bos, add_eos) = added_specials(model);
    c.insert("add_bos_token".into(), json!(add_bos));
    c.insert("add_eos_token".into(), json!(add_eos));
    match &model.chat_template {
        // A list of named templates is kept whole: the loaded one is its `default`.
        Some(_) if c.get("chat_template").is_some_and(Value::is_array) => {}
        Some(t) => {
            c.insert("chat_template".into(), json!(t.source()));
        }
        None => {
            c.remove("chat_template");
        }
    }
    c.entry("model_max_length")
        .or_insert_with(|| json!(model.model.config().max_position_embeddings));
    // transformers 4 defaults this to true for some classes, which rewrites " ." to "." when
    // decoding; cotrain decodes without it.
    c.entry("clean_up_tokenization_spaces")
        .or_insert_with(|| json!(false));
    Value::Object(c)
}

/// Whether the tokenizer's post-processor adds bos / eos to an encoded text, found by encoding
/// a probe with and without special tokens (the GGUF flags and `tokenizer_config.json` keys
/// end up in that post-processor).
fn added_specials(model: &LoadedModel) -> (bool, bool) {
    let t = &model.tokenizer;
    let (Ok(with), Ok(without)) = (t.encode("a", true), t.encode("a", false)) else {
        return (false, false);
    };
    if with.len() <= without.len() {
        return (false, false);
    }
    let bos = t.bos_id().is_some() && with.first().copied() == t.bos_id();
    let eos = t.eos_id().is_some() && with.last().copied() == t.eos_id();
    (bos, eos)
}

/// `generation_config.json`: the source's own (for a Hugging Face source) with bos and the
/// stop ids set. `eos_token_id` lists every id cotrain stops at (eos, `<|im_end|>`, ...), so
/// that transformers and vLLM end a completion where cotrain does.
fn generation_config_json(model: &LoadedModel, base: Option<Value>) -> Value {
    let g = &model.generation;
    let mut c = match base {
        Some(Value::Object(m)) => m,
        _ => Map::new(),
    };
    if let Some(bos) = g.bos_token_id {
        c.insert("bos_token_id".into(), json!(bos));
    }
    c.insert("eos_token_id".into(), ids_json(&model.stop_token_ids()));
    if let Some(pad) = model.tokenizer.pad_id() {
        c.entry("pad_token_id").or_insert_with(|| json!(pad));
    }
    let mut sampled = false;
    for (key, v) in [
        ("temperature", g.temperature.map(|x| json!(x))),
        ("top_p", g.top_p.map(|x| json!(x))),
        ("top_k", g.top_k.map(|x| json!(x))),
    ] {
        if let Some(v) = v {
            c.insert(key.into(), v);
            sampled = true;
        }
    }
    if sampled {
        // transformers rejects sampling parameters on a greedy config when saving it again.
        c.entry("do_sample").or_insert_with(|| json!(true));
    }
    Value::Object(c)
}

fn read_source_json(path: &Path) -> Result<Option<Value>> {
    match std::fs::read(path) {
        Ok(bytes) => {
            serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| ExportError::InvalidSource {
                    path: path.to_path_buf(),
                    message: e.to_string(),
                })
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(ExportError::Io {
            path: path.to_path_buf(),
            source,
        }),
    }
}

fn write_json(path: &Path, value: &Value) -> Result<()> {
    let mut text = serde_json::to_string_pretty(value).map_err(|e| ExportError::Io {
        path: path.to_path_buf(),
        source: e.into(),
    })?;
    text.push('\n');
    let mut f = File::create(path).map_err(io(path))?;
    f.write_all(text.as_bytes())
        .and_then(|_| f.sync_all())
        .map_err(io(path))
}

/// safetensors' name of a dtype.
fn safetensors_dtype(kind: Kind) -> &'static str {
    match kind {
        Kind::BFloat16 => "BF16",
        Kind::Half => "F16",
        _ => "F32",
    }
}

/// Writes `model.safetensors` with `{"format": "pt"}` metadata (older transformers refuse a file
/// without it), one tensor at a time so that only one parameter is copied at once. A tied
/// `lm_head.weight` is left out, as transformers does.
fn write_safetensors(
    path: &Path,
    params: &BTreeMap<String, Tensor>,
    cfg: &ModelConfig,
) -> Result<()> {
    let tensors: Vec<(&String, &Tensor)> = params
        .iter()
        .filter(|(name, _)| !(cfg.tie_word_embeddings && name.as_str() == "lm_head.weight"))
        .collect();
    let mut header = Map::new();
    header.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut offset = 0usize;
    for (name, t) in &tensors {
        let bytes = t.numel() * t.kind().elt_size_in_bytes();
        header.insert(
            (*name).clone(),
            json!({
                "dtype": safetensors_dtype(t.kind()),
                "shape": t.size(),
                "data_offsets": [offset, offset + bytes],
            }),
        );
        offset += bytes;
    }
    let mut header =
        serde_json::to_string(&Value::Object(header)).map_err(|e| ExportError::Io {
            path: path.to_path_buf(),
            source: e.into(),
        })?;
    // The data starts 8-byte aligned.
    while header.len() % 8 != 0 {
        header.push(' ');
    }
    let file = File::create(path).map_err(io(path))?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    w.write_all(&(header.len() as u64).to_le_bytes())
        .and_then(|_| w.write_all(header.as_bytes()))
        .map_err(io(path))?;
    for (_, t) in tensors {
        let t = t.detach().to_device(Device::Cpu).contiguous();
        let numel = t.numel();
        let mut buf = vec![0u8; numel * t.kind().elt_size_in_bytes()];
        t.f_copy_data_u8(&mut buf, numel)?;
        w.write_all(&buf).map_err(io(path))?;
    }
    let file = w.into_inner().map_err(|e| ExportError::Io {
        path: path.to_path_buf(),
        source: e.into_error(),
    })?;
    file.sync_all().map_err(io(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_eos_id_is_a_number_and_several_a_list() {
        assert_eq!(ids_json(&[]), Value::Null);
        assert_eq!(ids_json(&[2]), json!(2));
        assert_eq!(ids_json(&[2, 7]), json!([2, 7]));
    }

    #[test]
    fn dtype_names_follow_transformers_and_safetensors() {
        assert_eq!(torch_dtype(Kind::BFloat16), "bfloat16");
        assert_eq!(torch_dtype(Kind::Float), "float32");
        assert_eq!(safetensors_dtype(Kind::Half), "F16");
    }
}
