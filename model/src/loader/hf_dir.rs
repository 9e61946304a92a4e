//! Loading a Hugging Face model directory: `config.json`, safetensors shards (one tensor at a
//! time, straight into the parameters), the tokenizer, the chat template and
//! `generation_config.json`.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use tch::{Kind, Tensor, nn::VarStore};

use super::{
    Filler, GenerationDefaults, LoadOptions, LoadedModel, ModelSource, new_store, optional_template,
};
use crate::chat_template::ChatTemplate;
use crate::config::{ModelConfig, OneOrMany};
use crate::error::{ModelError, Result};
use crate::families::CausalLm;
use crate::tokenizer::Tokenizer;

pub(super) fn read_text(path: &Path, what: &str) -> Result<String> {
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

pub(super) fn read_json(path: &Path, what: &str) -> Result<serde_json::Value> {
    let text = read_text(path, what)?;
    serde_json::from_str(&text).map_err(|e| ModelError::InvalidFile {
        path: path.into(),
        message: e.to_string(),
    })
}

/// The safetensors files of a directory: the shards named by `model.safetensors.index.json`,
/// or `model.safetensors`.
pub(super) fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>> {
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
pub(super) struct GenerationConfigJson {
    eos_token_id: Option<OneOrMany>,
    bos_token_id: Option<u32>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
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
pub(super) fn for_each_safetensor(
    file: &Path,
    mut f: impl FnMut(&str, Tensor) -> Result<()>,
) -> Result<()> {
    let bad = |message: String| ModelError::InvalidFile {
        path: file.to_path_buf(),
        message,
    };
    let handle = std::fs::File::open(file).map_err(|source| ModelError::Io {
        path: file.to_path_buf(),
        source,
    })?;
    // SAFETY: the mapping is read-only and lives until the end of this function. Another process
    // rewriting the file meanwhile could give wrong bytes, as reading it could, and truncating it
    // would stop this process (SIGBUS): model files are not written while a model loads from them.
    let map = unsafe { memmap2::Mmap::map(&handle) }.map_err(|source| ModelError::Io {
        path: file.to_path_buf(),
        source,
    })?;
    if map.len() < 8 {
        return Err(bad(
            "not a readable safetensors file: shorter than its 8-byte header length".into(),
        ));
    }
    let header_len = u64::from_le_bytes(map[..8].try_into().expect("8 bytes")) as usize;
    let body = 8usize
        .checked_add(header_len)
        .filter(|&b| b <= map.len())
        .ok_or_else(|| {
            bad(format!(
                "not a readable safetensors file: header of {header_len} bytes past the end"
            ))
        })?;
    let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&map[8..body])
        .map_err(|e| bad(format!("not a readable safetensors file: header: {e}")))?;
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
        let dims = entry["shape"]
            .as_array()
            .ok_or_else(|| bad(format!("tensor `{name}`: no shape")))?;
        let shape: Vec<i64> = dims
            .iter()
            .map(|v| v.as_u64().and_then(|d| i64::try_from(d).ok()))
            .collect::<Option<_>>()
            .ok_or_else(|| {
                bad(format!(
                    "tensor `{name}`: shape {dims:?} is not a list of sizes"
                ))
            })?;
        let offsets: Vec<u64> = entry["data_offsets"]
            .as_array()
            .map(|a| a.iter().filter_map(|v| v.as_u64()).collect())
            .unwrap_or_default();
        let [start, end] = offsets[..] else {
            return Err(bad(format!("tensor `{name}`: no data_offsets")));
        };
        // The byte count the shape implies, and the data's place in the file, without overflow.
        let want = shape
            .iter()
            .try_fold(kind.elt_size_in_bytes() as u64, |n, &d| {
                n.checked_mul(d as u64)
            });
        let range = (body as u64)
            .checked_add(start)
            .zip((body as u64).checked_add(end));
        let (from, to) = match (want, range) {
            (Some(want), Some((from, to)))
                if start <= end && to <= map.len() as u64 && end - start == want =>
            {
                (from as usize, to as usize)
            }
            _ => {
                return Err(bad(format!(
                    "tensor `{name}`: data_offsets [{start}, {end}] do not hold its {shape:?} {kind:?}"
                )));
            }
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

pub(super) fn load_hf_dir(
    dir: &Path,
    opts: &LoadOptions,
    source: ModelSource,
) -> Result<LoadedModel> {
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
