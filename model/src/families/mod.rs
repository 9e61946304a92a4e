//! Model families on libtorch. One file per family owns its `config.json` schema; the layers
//! they share (RMSNorm, RoPE, SwiGLU MLP, grouped-query attention with optional q/k/v biases and
//! q/k norm) live in [`transformer`], so a fix to attention reaches every family at once.

pub mod llama;
pub mod qwen2;
pub mod qwen3;
pub mod transformer;

pub use transformer::{CausalLm, KvCache, WeightInit};
