//! Phi-3 (Phi-3-mini and -medium, 4k and 128k; MaPoRL's model): the Llama layout, except that the
//! checkpoint fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, the 128k models use
//! LongRoPE, and the 4k models attend through a sliding window.
//!
//! The layers are shared in [`super::transformer`]; this file owns the `config.json` schema. The
//! fused tensors are split as they load ([`split_fused`]) and fused again on export, so the rest
//! of the crate sees the Llama projections.

use serde::Deserialize;
use tch::Tensor;

use crate::config::{Family, ModelConfig, OneOrMany, RopeParams, RopeScaling, check_act};
use crate::error::{ModelError, Result};

/// `config.json` of a `Phi3ForCausalLM` checkpoint (defaults as in transformers' `Phi3Config`).
#[derive(Debug, Clone, Deserialize)]
pub struct Phi3Config {
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
    original_max_position_embeddings: Option<usize>,
    #[serde(default = "default_eps")]
    rms_norm_eps: f64,
    rope_theta: Option<f64>,
    rope_scaling: Option<RopeParams>,
    rope_parameters: Option<RopeParams>,
    partial_rotary_factor: Option<f64>,
    sliding_window: Option<usize>,
    #[serde(default)]
    resid_pdrop: f64,
    #[serde(default)]
    embd_pdrop: f64,
    #[serde(default)]
    attention_dropout: f64,
    #[serde(default)]
    tie_word_embeddings: bool,
    #[serde(default = "default_bos")]
    bos_token_id: Option<u32>,
    eos_token_id: Option<OneOrMany>,
}

fn default_vocab() -> usize {
    32064
}
fn default_act() -> String {
    "silu".into()
}
fn default_max_pos() -> usize {
    4096
}
fn default_eps() -> f64 {
    1e-5
}
fn default_bos() -> Option<u32> {
    Some(1)
}

impl Phi3Config {
    /// Converts to the checked, family-independent config.
    pub fn into_model_config(self) -> Result<ModelConfig> {
        check_act(&self.hidden_act)?;
        for (name, p) in [
            ("resid_pdrop", self.resid_pdrop),
            ("embd_pdrop", self.embd_pdrop),
            ("attention_dropout", self.attention_dropout),
        ] {
            if p != 0.0 {
                return Err(ModelError::InvalidConfig(format!(
                    "`{name}: {p}`: dropout inside the base model is not built (Phi-3's released configs use 0)"
                )));
            }
        }
        let head_dim = self
            .head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1));
        // transformers 5 moves everything RoPE into `rope_parameters`; Hub checkpoints keep
        // `rope_theta`, `rope_scaling` and the top-level `original_max_position_embeddings`.
        let params = self.rope_parameters.as_ref().or(self.rope_scaling.as_ref());
        let partial = params
            .and_then(|p| p.partial_rotary_factor)
            .or(self.partial_rotary_factor)
            .unwrap_or(1.0);
        if partial != 1.0 {
            return Err(ModelError::InvalidConfig(format!(
                "`partial_rotary_factor: {partial}` (RoPE on part of each head) is not built"
            )));
        }
        let rope_theta = self
            .rope_parameters
            .as_ref()
            .and_then(|p| p.rope_theta)
            .or(self.rope_theta)
            .unwrap_or(10000.0);
        let rope_scaling = match params {
            None => RopeScaling::None,
            Some(p) => match p.rope_type.as_deref().unwrap_or("default") {
                "default" | "none" => RopeScaling::None,
                // transformers reads Phi-3's older `su` (and `yarn`) as LongRoPE.
                "longrope" | "su" | "yarn" => {
                    let original = p
                        .original_max_position_embeddings
                        .map(|v| v as usize)
                        .or(self.original_max_position_embeddings)
                        .unwrap_or(self.max_position_embeddings);
                    let needs = |f: &Option<Vec<f64>>, name: &str| {
                        f.clone().ok_or_else(|| {
                            ModelError::InvalidConfig(format!(
                                "rope_scaling `longrope` needs `{name}`"
                            ))
                        })
                    };
                    let factor = p
                        .factor
                        .unwrap_or(self.max_position_embeddings as f64 / original.max(1) as f64);
                    let attention_factor = p
                        .attention_factor
                        .unwrap_or_else(|| default_attention_factor(factor, original));
                    RopeScaling::LongRope {
                        short_factor: needs(&p.short_factor, "short_factor")?,
                        long_factor: needs(&p.long_factor, "long_factor")?,
                        original_max_position_embeddings: original,
                        attention_factor,
                    }
                }
                other => return Err(ModelError::UnsupportedRopeScaling(other.to_string())),
            },
        };
        Ok(ModelConfig {
            family: Family::Phi3,
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_hidden_layers: self.num_hidden_layers,
            num_attention_heads: self.num_attention_heads,
            num_key_value_heads: self.num_key_value_heads.unwrap_or(self.num_attention_heads),
            head_dim,
            rms_norm_eps: self.rms_norm_eps,
            rope_theta,
            rope_scaling,
            max_position_embeddings: self.max_position_embeddings,
            tie_word_embeddings: self.tie_word_embeddings,
            attention_bias: false,
            qk_norm: false,
            sliding_window: self.sliding_window,
            bos_token_id: self.bos_token_id,
            eos_token_ids: self
                .eos_token_id
                .map(OneOrMany::into_vec)
                .unwrap_or_default(),
        })
    }
}

/// LongRoPE's cos/sin multiplier when the config gives none (transformers' rule): `sqrt(1 +
/// ln(factor) / ln(original))` for a context extended `factor` times beyond `original` positions.
pub(crate) fn default_attention_factor(factor: f64, original: usize) -> f64 {
    if factor <= 1.0 {
        1.0
    } else {
        (1.0 + factor.ln() / (original as f64).ln()).sqrt()
    }
}

/// The checkpoint's fused projections of one layer and what they split into, in order.
pub(crate) const FUSED: [(&str, &[&str]); 2] = [
    (
        "self_attn.qkv_proj.weight",
        &[
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
        ],
    ),
    (
        "mlp.gate_up_proj.weight",
        &["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    ),
];

/// The rows each part of a fused projection takes: q, k, v heads, or gate and up halves.
fn part_rows(cfg: &ModelConfig, fused: &str) -> Vec<i64> {
    let d = cfg.head_dim as i64;
    if fused.starts_with("self_attn") {
        let (q, kv) = (
            cfg.num_attention_heads as i64 * d,
            cfg.num_key_value_heads as i64 * d,
        );
        vec![q, kv, kv]
    } else {
        vec![cfg.intermediate_size as i64; 2]
    }
}

/// Splits a checkpoint tensor named `name` into the parameters it holds: `Some([(name, rows)])`
/// for a fused Phi-3 projection (`model.layers.{i}.self_attn.qkv_proj.weight` into q, k, v as
/// transformers slices it; `mlp.gate_up_proj.weight` into gate, then up), `None` for any other.
pub(crate) fn split_fused(
    cfg: &ModelConfig,
    name: &str,
    t: &Tensor,
) -> Option<Result<Vec<(String, Tensor)>>> {
    let (fused, parts) = FUSED
        .iter()
        .find(|(f, _)| name.ends_with(&format!(".{f}")))?;
    let prefix = &name[..name.len() - fused.len()];
    let rows = part_rows(cfg, fused);
    let total: i64 = rows.iter().sum();
    if t.dim() != 2 || t.size()[0] != total {
        return Some(Err(ModelError::Weight {
            name: name.into(),
            message: format!(
                "checkpoint shape {:?}, config implies [{total}, {}]",
                t.size(),
                cfg.hidden_size
            ),
        }));
    }
    let pieces = t.split_with_sizes(rows.as_slice(), 0);
    Some(Ok(parts
        .iter()
        .zip(pieces)
        .map(|(p, piece)| (format!("{prefix}{p}"), piece))
        .collect()))
}

/// The fused checkpoint tensors of one layer's parameters, the inverse of [`split_fused`]:
/// `(fused name, part names)` for every layer, to concatenate in this order on export.
pub(crate) fn fused_names(layers: usize) -> Vec<(String, Vec<String>)> {
    let mut out = Vec::new();
    for i in 0..layers {
        for (fused, parts) in FUSED {
            let p = format!("model.layers.{i}.");
            out.push((
                format!("{p}{fused}"),
                parts.iter().map(|x| format!("{p}{x}")).collect(),
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use crate::config::{ModelConfig, RopeScaling};

    const BASE: &str = r#""architectures": ["Phi3ForCausalLM"], "vocab_size": 10, "hidden_size": 8,
        "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2"#;

    #[test]
    fn reads_a_128k_style_longrope_config() {
        let cfg = ModelConfig::from_hf_json(&format!(
            r#"{{{BASE}, "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
                "rope_scaling": {{"type": "longrope", "short_factor": [1.0, 1.5], "long_factor": [2.0, 3.0]}},
                "sliding_window": 262144}}"#
        ))
        .unwrap();
        let RopeScaling::LongRope {
            original_max_position_embeddings,
            attention_factor,
            ..
        } = cfg.rope_scaling
        else {
            panic!("{:?}", cfg.rope_scaling)
        };
        assert_eq!(original_max_position_embeddings, 4096);
        // Phi-3-mini-128k: factor 32 over 4096 positions.
        assert!((attention_factor - (1.0f64 + 32f64.ln() / 4096f64.ln()).sqrt()).abs() < 1e-12);
        assert_eq!(cfg.sliding_window, Some(262144));
        assert_eq!(cfg.num_key_value_heads, 2);
    }

    #[test]
    fn refuses_what_is_not_built_by_name() {
        for (extra, says) in [
            (r#""partial_rotary_factor": 0.75"#, "partial_rotary_factor"),
            (r#""resid_pdrop": 0.1"#, "resid_pdrop"),
            (
                r#""rope_scaling": {"type": "dynamic", "factor": 2.0}"#,
                "dynamic",
            ),
            (
                r#""rope_scaling": {"type": "longrope", "short_factor": [1.0]}"#,
                "long_factor",
            ),
            (
                r#""rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}"#,
                "head_dim / 2",
            ),
            (r#""hidden_act": "gelu""#, "gelu"),
        ] {
            let e = ModelConfig::from_hf_json(&format!("{{{BASE}, {extra}}}"))
                .unwrap_err()
                .to_string();
            assert!(e.contains(says), "{extra}: {e}");
        }
    }
}
