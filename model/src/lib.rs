//! The policy model shared by the rollout worker and the learner: model families on libtorch,
//! weight loading (Hugging Face directories, GGUF files, the local HF cache, the embedded
//! default), tokenizers and chat templates, the generation engine and the log-prob kernel.

// Formats and text: no tensors needed.
pub mod chat_template;
pub mod gguf;
pub mod tokenizer;

// Models on libtorch.
pub mod config;
pub mod engine;
pub mod error;
pub mod families;
pub mod kernels;
pub mod loader;
pub mod logprobs;

// Process set-up for tensor workloads.
pub mod allocator;

pub use config::{Family, ModelConfig, RopeScaling};
pub use error::{ModelError, Result};
pub use families::{CausalLm, KvCache, WeightInit};
