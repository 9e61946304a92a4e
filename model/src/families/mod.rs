//! Model families on libtorch (Llama, Qwen2, Qwen3, Phi-3). One file per family owns its `config.json` schema; the layers
//! they share (RMSNorm, RoPE, SwiGLU MLP, grouped-query attention with optional q/k/v biases and
//! q/k norm) live in [`transformer`], so a fix to attention reaches every family at once.
//!
//! Reading a `config.json` ([`ModelConfig::from_hf_json`]) is implemented here rather than in
//! [`crate::config`]: it picks the family's schema, so it needs the families, while they need
//! the config; keeping it here lets the dependency run one way (families → config).

pub mod llama;
pub mod phi3;
pub mod qwen2;
pub mod qwen3;
pub mod transformer;

use std::path::Path;

use serde::Deserialize;

pub use transformer::{CausalLm, KvCache, WeightInit};

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};

impl ModelConfig {
    /// Parses a Hugging Face `config.json` text, dispatching on `architectures` / `model_type`.
    pub fn from_hf_json(text: &str) -> Result<Self> {
        #[derive(Deserialize)]
        struct Probe {
            architectures: Option<Vec<String>>,
            model_type: Option<String>,
        }
        let bad = |e: serde_json::Error| ModelError::InvalidConfig(e.to_string());
        let probe: Probe = serde_json::from_str(text).map_err(bad)?;
        let arch = probe
            .architectures
            .as_ref()
            .and_then(|a| a.first().cloned())
            .or(probe.model_type.clone())
            .ok_or_else(|| {
                ModelError::InvalidConfig(
                    "config has neither `architectures` nor `model_type`".into(),
                )
            })?;
        let cfg = match arch.as_str() {
            "LlamaForCausalLM" | "llama" => serde_json::from_str::<llama::LlamaConfig>(text)
                .map_err(bad)?
                .into_model_config()?,
            "Qwen2ForCausalLM" | "qwen2" => serde_json::from_str::<qwen2::Qwen2Config>(text)
                .map_err(bad)?
                .into_model_config()?,
            "Qwen3ForCausalLM" | "qwen3" => serde_json::from_str::<qwen3::Qwen3Config>(text)
                .map_err(bad)?
                .into_model_config()?,
            "Phi3ForCausalLM" | "phi3" => serde_json::from_str::<phi3::Phi3Config>(text)
                .map_err(bad)?
                .into_model_config()?,
            other => return Err(ModelError::UnsupportedArchitecture(other.to_string())),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads and parses a `config.json` file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_hf_json(&text).map_err(|e| match e {
            ModelError::InvalidConfig(message) => ModelError::InvalidFile {
                path: path.to_path_buf(),
                message,
            },
            other => other,
        })
    }
}

#[cfg(test)]
mod tests {
    use crate::config::{ModelConfig, RopeScaling};

    #[test]
    fn unsupported_architecture_is_named() {
        let e = ModelConfig::from_hf_json(r#"{"architectures": ["MambaForCausalLM"]}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("MambaForCausalLM"), "{e}");
    }

    #[test]
    fn reads_rope_parameters_of_transformers_5() {
        let cfg = ModelConfig::from_hf_json(
            r#"{"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
                "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}}"#,
        )
        .unwrap();
        assert_eq!(cfg.rope_theta, 500000.0);
        assert_eq!(cfg.num_key_value_heads, 2);
        assert_eq!(cfg.head_dim, 4);
        assert!(matches!(cfg.rope_scaling, RopeScaling::Llama3 { factor, .. } if factor == 8.0));
    }
}
