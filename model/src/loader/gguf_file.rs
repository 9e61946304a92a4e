//! Loading a `.gguf` file: the model config from its metadata, its tensors (dequantised) under
//! their Hugging Face names, and the tokenizer and chat template it embeds.

use std::path::Path;

use tch::Tensor;

use super::{
    Filler, GenerationDefaults, LoadOptions, LoadedModel, ModelSource, new_store, optional_template,
};
use crate::chat_template::ChatTemplate;
use crate::config::{Family, ModelConfig, RopeScaling};
use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;
use crate::tokenizer::Tokenizer;

pub(super) fn gguf_err(path: &Path, e: impl std::fmt::Display) -> ModelError {
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
        sliding_window: None,
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

pub(super) fn load_gguf(
    path: &Path,
    opts: &LoadOptions,
    source: ModelSource,
) -> Result<LoadedModel> {
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
