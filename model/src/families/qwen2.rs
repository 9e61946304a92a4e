//! Qwen2 / Qwen2.5: the Llama layout plus biases on the q, k and v projections.
//!
//! The layers are shared in [`super::transformer`]; this file owns the `config.json` schema.

use serde::Deserialize;

use crate::config::{Family, ModelConfig, OneOrMany, RopeParams, check_act, resolve_rope};
use crate::error::{ModelError, Result};

/// `config.json` of a `Qwen2ForCausalLM` checkpoint (defaults as in transformers' `Qwen2Config`).
#[derive(Debug, Clone, Deserialize)]
pub struct Qwen2Config {
    #[serde(default = "default_vocab")]
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
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
    use_sliding_window: bool,
    bos_token_id: Option<u32>,
    eos_token_id: Option<OneOrMany>,
}

fn default_vocab() -> usize {
    151936
}
fn default_act() -> String {
    "silu".into()
}
fn default_max_pos() -> usize {
    32768
}
fn default_eps() -> f64 {
    1e-6
}

impl Qwen2Config {
    /// Converts to the checked, family-independent config.
    pub fn into_model_config(self) -> Result<ModelConfig> {
        check_act(&self.hidden_act)?;
        if self.use_sliding_window {
            return Err(ModelError::InvalidConfig(
                "`use_sliding_window: true` is not supported".into(),
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
            family: Family::Qwen2,
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_hidden_layers: self.num_hidden_layers,
            num_attention_heads: self.num_attention_heads,
            num_key_value_heads: self.num_key_value_heads.unwrap_or(self.num_attention_heads),
            head_dim: self.hidden_size / self.num_attention_heads.max(1),
            rms_norm_eps: self.rms_norm_eps,
            rope_theta,
            rope_scaling,
            max_position_embeddings: self.max_position_embeddings,
            tie_word_embeddings: self.tie_word_embeddings,
            attention_bias: true,
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
