//! Llama (Llama 2/3, SmolLM2): RMSNorm, rotate-half RoPE (with the `linear` and `llama3`
//! scalings), grouped-query attention without biases, a SwiGLU MLP.
//!
//! The layers themselves are shared with the Qwen families in [`super::transformer`]; this file
//! owns the family's `config.json` schema and its defaults.

use serde::Deserialize;

use crate::config::{Family, ModelConfig, OneOrMany, RopeParams, check_act, resolve_rope};
use crate::error::{ModelError, Result};

/// `config.json` of a `LlamaForCausalLM` checkpoint (defaults as in transformers' `LlamaConfig`).
#[derive(Debug, Clone, Deserialize)]
pub struct LlamaConfig {
    #[serde(default = "default_vocab")]
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    #[serde(default = "default_act")]
    hidden_act: String,
    #[serde(default = "default_max_pos")]
    max_position_embeddings: usize,
    #[serde(default = "default_eps")]
    rms_norm_eps: f64,
    rope_theta: Option<f64>,
    rope_scaling: Option<RopeParams>,
    rope_parameters: Option<RopeParams>,
    #[serde(default)]
    tie_word_embeddings: bool,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    mlp_bias: bool,
    bos_token_id: Option<u32>,
    eos_token_id: Option<OneOrMany>,
}

fn default_vocab() -> usize {
    32000
}
fn default_act() -> String {
    "silu".into()
}
fn default_max_pos() -> usize {
    2048
}
fn default_eps() -> f64 {
    1e-6
}

impl LlamaConfig {
    /// Converts to the checked, family-independent config.
    pub fn into_model_config(self) -> Result<ModelConfig> {
        check_act(&self.hidden_act)?;
        if self.mlp_bias {
            return Err(ModelError::InvalidConfig(
                "`mlp_bias: true` is not supported".into(),
            ));
        }
        let (rope_theta, rope_scaling) = resolve_rope(
            self.rope_theta,
            self.rope_scaling.as_ref(),
            self.rope_parameters.as_ref(),
            10000.0,
            self.max_position_embeddings,
        )?;
        Ok(ModelConfig {
            family: Family::Llama,
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_hidden_layers: self.num_hidden_layers,
            num_attention_heads: self.num_attention_heads,
            num_key_value_heads: self.num_key_value_heads.unwrap_or(self.num_attention_heads),
            head_dim: self
                .head_dim
                .unwrap_or(self.hidden_size / self.num_attention_heads.max(1)),
            rms_norm_eps: self.rms_norm_eps,
            rope_theta,
            rope_scaling,
            max_position_embeddings: self.max_position_embeddings,
            tie_word_embeddings: self.tie_word_embeddings,
            attention_bias: self.attention_bias,
            qk_norm: false,
            sliding_window: None,
            bos_token_id: self.bos_token_id,
            eos_token_ids: self
                .eos_token_id
                .map(OneOrMany::into_vec)
                .unwrap_or_default(),
        })
    }
}
