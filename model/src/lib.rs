//! The policy model shared by the rollout worker and the learner: model families on libtorch (Llama,
//! Qwen2/Qwen2.5, Qwen3, Phi-3), weight loading (Hugging Face directories, GGUF files, the local HF cache, the embedded
//! default), tokenizers and chat templates, the generation engine and the log-prob kernel, and
//! writing a (trained) model back out as a Hugging Face directory.

// Formats and text: no tensors needed.
pub mod chat_template;
pub mod gguf;
pub mod tokenizer;

// Models on libtorch.
pub mod config;
pub mod cuda;
pub mod engine;
pub mod error;
pub mod export;
pub mod families;
pub mod kernels;
pub mod loader;
pub mod logprobs;
pub mod lora;
pub mod verifier;

// Process set-up for tensor workloads, each an explicit choice of a binary's `main`:
// `unsafe { mkl_dispatch::prefer_avx512() }` and `allocator::tune_for_tensors()`.
pub mod allocator;
pub mod cpu;
pub mod mkl_dispatch;

pub use config::{Family, ModelConfig, RopeScaling};
pub use error::{ModelError, Result};
pub use families::{CausalLm, KvCache, WeightInit};
pub use kernels::dispatch::cache_dir;
