//! The checked model configuration shared by all families, and the family-independent pieces of
//! the Hugging Face `config.json` schema that every family's schema reuses (RoPE settings, one or
//! many EOS ids, the activation check).
//!
//! Each family file (`families/llama.rs`, ...) owns a serde struct matching that family's
//! `config.json`; they all convert into [`ModelConfig`], the one the transformer code reads.
//! Choosing the family from a `config.json` ([`ModelConfig::from_hf_json`]) lives in
//! [`crate::families`], which knows the families: this module depends on none of them, so that
//! they can build on it. Strings naming a dtype or device (`f32`, `cuda:1`) are parsed here as well.

use serde::Deserialize;
use tch::{Device, Kind};

use crate::error::{ModelError, Result};

/// The model families this crate implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// Llama 2/3, SmolLM2: no biases, rotate-half RoPE.
    Llama,
    /// Qwen2 / Qwen2.5: biases on the q/k/v projections.
    Qwen2,
    /// Qwen3: per-head RMSNorm on q and k, explicit `head_dim`, no biases.
    Qwen3,
    /// Phi-3 (MaPoRL's model): the Llama layout with q/k/v and gate/up fused in the checkpoint
    /// (split on load, fused again on export), LongRoPE and an optional sliding window.
    Phi3,
}

impl Family {
    /// The Hugging Face architecture name (`LlamaForCausalLM`, ...).
    pub fn hf_architecture(self) -> &'static str {
        match self {
            Family::Llama => "LlamaForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
            Family::Qwen3 => "Qwen3ForCausalLM",
            Family::Phi3 => "Phi3ForCausalLM",
        }
    }
}

/// How RoPE frequencies are rescaled for long contexts (`rope_scaling` / `rope_parameters`).
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Positions divided by `factor` (`rope_type: linear`).
    Linear {
        /// The divisor of positions.
        factor: f64,
    },
    /// Llama 3.1's frequency-dependent scaling (`rope_type: llama3`).
    Llama3 {
        /// Overall factor (8 for Llama 3.1).
        factor: f64,
        /// Wavelengths above `original_max / low_freq_factor` are divided by `factor`.
        low_freq_factor: f64,
        /// Wavelengths below `original_max / high_freq_factor` are kept.
        high_freq_factor: f64,
        /// The context length the model was pre-trained with.
        original_max_position_embeddings: f64,
    },
    /// Phi-3's LongRoPE (`rope_type: longrope`, formerly `su`): each frequency divided by its
    /// `short_factor` while the forward's longest position is within the pre-training context,
    /// by its `long_factor` beyond it (chosen per forward, as transformers does), and cos/sin
    /// multiplied by `attention_factor`.
    LongRope {
        /// Per-frequency divisors (head_dim / 2 of them) for contexts up to the original length.
        short_factor: Vec<f64>,
        /// Per-frequency divisors for longer contexts.
        long_factor: Vec<f64>,
        /// The context length the model was pre-trained with.
        original_max_position_embeddings: usize,
        /// The cos/sin multiplier: `sqrt(1 + ln(factor) / ln(original))` with `factor` the
        /// context extension, unless the config gives it.
        attention_factor: f64,
    },
}

/// RoPE settings as they appear in `config.json`, either as `rope_scaling` (transformers 4) or
/// as `rope_parameters` (transformers 5, which also moves `rope_theta` inside).
#[derive(Debug, Clone, Default, Deserialize)]
pub(crate) struct RopeParams {
    #[serde(alias = "type")]
    pub rope_type: Option<String>,
    pub rope_theta: Option<f64>,
    pub factor: Option<f64>,
    pub low_freq_factor: Option<f64>,
    pub high_freq_factor: Option<f64>,
    pub original_max_position_embeddings: Option<f64>,
    /// LongRoPE's per-frequency divisors (Phi-3).
    pub short_factor: Option<Vec<f64>>,
    pub long_factor: Option<Vec<f64>>,
    /// LongRoPE's cos/sin multiplier, when the config fixes it.
    pub attention_factor: Option<f64>,
    /// The fraction of each head RoPE rotates (transformers 5 keeps it here).
    pub partial_rotary_factor: Option<f64>,
}

impl RopeParams {
    /// Converts to a [`RopeScaling`], naming the unsupported type if there is one.
    pub(crate) fn scaling(&self, max_position_embeddings: usize) -> Result<RopeScaling> {
        let kind = self.rope_type.as_deref().unwrap_or("default");
        let factor = || {
            self.factor.ok_or_else(|| {
                ModelError::InvalidConfig(format!("rope_scaling `{kind}` needs `factor`"))
            })
        };
        Ok(match kind {
            "default" | "none" => RopeScaling::None,
            "linear" => RopeScaling::Linear { factor: factor()? },
            "llama3" => RopeScaling::Llama3 {
                factor: factor()?,
                low_freq_factor: self.low_freq_factor.unwrap_or(1.0),
                high_freq_factor: self.high_freq_factor.unwrap_or(4.0),
                original_max_position_embeddings: self
                    .original_max_position_embeddings
                    .unwrap_or(max_position_embeddings as f64),
            },
            other => return Err(ModelError::UnsupportedRopeScaling(other.to_string())),
        })
    }
}

/// Resolves `rope_theta` and the scaling from the two places transformers 4 and 5 put them.
pub(crate) fn resolve_rope(
    rope_theta: Option<f64>,
    rope_scaling: Option<&RopeParams>,
    rope_parameters: Option<&RopeParams>,
    default_theta: f64,
    max_position_embeddings: usize,
) -> Result<(f64, RopeScaling)> {
    let params = rope_parameters.or(rope_scaling);
    let theta = rope_parameters
        .and_then(|p| p.rope_theta)
        .or(rope_theta)
        .unwrap_or(default_theta);
    let scaling = match params {
        Some(p) => p.scaling(max_position_embeddings)?,
        None => RopeScaling::None,
    };
    Ok((theta, scaling))
}

/// `eos_token_id` may be one id or a list of ids.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub(crate) enum OneOrMany {
    One(u32),
    Many(Vec<u32>),
}

impl OneOrMany {
    pub(crate) fn into_vec(self) -> Vec<u32> {
        match self {
            OneOrMany::One(x) => vec![x],
            OneOrMany::Many(v) => v,
        }
    }
}

/// Every supported family uses SiLU in its gated MLP.
pub(crate) fn check_act(act: &str) -> Result<()> {
    if act != "silu" {
        return Err(ModelError::InvalidConfig(format!(
            "hidden_act `{act}` is not supported (only silu)"
        )));
    }
    Ok(())
}

/// The checked configuration of a decoder-only transformer, whatever its family.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Which family's quirks apply.
    pub family: Family,
    /// Vocabulary size (rows of the embedding and of the LM head).
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP's gate/up projections.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Number of query heads.
    pub num_attention_heads: usize,
    /// Number of key/value heads (grouped-query attention when fewer than query heads).
    pub num_key_value_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Epsilon of every RMSNorm.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// RoPE rescaling.
    pub rope_scaling: RopeScaling,
    /// The longest sequence (prompt + completion) the model accepts.
    pub max_position_embeddings: usize,
    /// Whether the LM head reuses the token embedding matrix.
    pub tie_word_embeddings: bool,
    /// Whether q/k/v projections carry a bias (Qwen2).
    pub attention_bias: bool,
    /// Whether q and k get a per-head RMSNorm (Qwen3).
    pub qk_norm: bool,
    /// Keys further back than this many positions are not attended to (Phi-3's
    /// `sliding_window`: a query at position i sees keys i - w + 1 ..= i); `None` for full causal
    /// attention.
    pub sliding_window: Option<usize>,
    /// Beginning-of-sequence token, if the config names one.
    pub bos_token_id: Option<u32>,
    /// End-of-sequence tokens from config.json (generation_config.json may add more).
    pub eos_token_ids: Vec<u32>,
}

impl ModelConfig {
    /// Checks the sizes fit together; every constructor calls it.
    pub fn validate(&self) -> Result<()> {
        let err = |m: String| Err(ModelError::InvalidConfig(m));
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if v == 0 {
                return err(format!("`{name}` must be positive"));
            }
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return err(format!(
                "num_attention_heads ({}) is not a multiple of num_key_value_heads ({})",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return err(format!(
                "head_dim ({}) must be even for RoPE",
                self.head_dim
            ));
        }
        if self.rope_theta.is_nan() || self.rope_theta <= 0.0 {
            return err(format!("rope_theta ({}) must be positive", self.rope_theta));
        }
        if self.sliding_window == Some(0) {
            return err("`sliding_window` must be positive".into());
        }
        if let RopeScaling::LongRope {
            short_factor,
            long_factor,
            original_max_position_embeddings,
            ..
        } = &self.rope_scaling
        {
            for (name, f) in [("short_factor", short_factor), ("long_factor", long_factor)] {
                if f.len() != self.head_dim / 2 {
                    return err(format!(
                        "rope_scaling `{name}` has {} entries, head_dim / 2 = {}",
                        f.len(),
                        self.head_dim / 2
                    ));
                }
                if f.iter().any(|x| !x.is_finite() || *x <= 0.0) {
                    return err(format!("rope_scaling `{name}` must hold positive numbers"));
                }
            }
            if *original_max_position_embeddings == 0 {
                return err("`original_max_position_embeddings` must be positive".into());
            }
        }
        Ok(())
    }

    /// Number of query heads sharing one key/value head.
    pub fn kv_groups(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }
}

/// Parses `f32`/`float32`, `bf16`/`bfloat16`, `f16`/`float16`/`half`.
pub fn parse_dtype(s: &str) -> Result<Kind> {
    match s.to_ascii_lowercase().as_str() {
        "f32" | "float32" | "float" => Ok(Kind::Float),
        "bf16" | "bfloat16" => Ok(Kind::BFloat16),
        "f16" | "float16" | "half" => Ok(Kind::Half),
        _ => Err(ModelError::UnknownDtype(s.to_string())),
    }
}

/// The short name of a float kind (`f32`, `bf16`, `f16`).
pub fn dtype_name(kind: Kind) -> &'static str {
    match kind {
        Kind::Float => "f32",
        Kind::BFloat16 => "bf16",
        Kind::Half => "f16",
        Kind::Double => "f64",
        _ => "non-float",
    }
}

/// Parses `auto`, `cpu`, `cuda` (device 0) or `cuda:N` and checks that a CUDA device can be used
/// (loading libtorch's CUDA backend first, see [`crate::cuda`]); the error says why it cannot.
pub fn parse_device(s: &str) -> Result<Device> {
    s.parse::<crate::cuda::DeviceRequest>()?.resolve(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_dtypes_and_rejects_unknown_ones() {
        assert_eq!(parse_dtype("bf16").unwrap(), Kind::BFloat16);
        assert_eq!(parse_dtype("F32").unwrap(), Kind::Float);
        let e = parse_dtype("int3").unwrap_err().to_string();
        assert!(e.contains("unknown dtype `int3`"), "{e}");
    }

    #[test]
    fn parses_devices_and_rejects_unknown_ones() {
        assert_eq!(parse_device("cpu").unwrap(), Device::Cpu);
        assert!(
            parse_device("tpu")
                .unwrap_err()
                .to_string()
                .contains("unknown device `tpu`")
        );
        assert!(parse_device("cuda:x").is_err());
        if crate::cuda::device_count() == 0 {
            let e = parse_device("cuda").unwrap_err().to_string();
            assert!(e.contains("CUDA is unavailable for device cuda"), "{e}");
        }
    }
}
