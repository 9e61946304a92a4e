//! The error type of the model layer (families, loading, generation, log-probs).

use std::path::PathBuf;

/// What can go wrong when building, loading or running a policy model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file the model needs does not exist.
    #[error("missing file {path}: {what}")]
    MissingFile {
        /// The path that was looked for.
        path: PathBuf,
        /// What the file was needed for.
        what: String,
    },
    /// A file exists but could not be read.
    #[error("cannot read {path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A JSON file (config.json, generation_config.json, an index) does not parse.
    #[error("invalid {path}: {message}")]
    InvalidFile {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// A model config is well-formed but its values are inconsistent or unsupported.
    #[error("invalid model config: {0}")]
    InvalidConfig(String),
    /// The architecture named by the checkpoint is not one this crate implements.
    #[error(
        "unsupported architecture `{0}` (supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM; GGUF: llama, qwen2, qwen3)"
    )]
    UnsupportedArchitecture(String),
    /// A `rope_scaling` type this crate does not implement.
    #[error("unsupported rope_scaling type `{0}` (supported: default, linear, llama3)")]
    UnsupportedRopeScaling(String),
    /// A dtype string other than f32/bf16/f16.
    #[error("unknown dtype `{0}` (expected f32, bf16 or f16)")]
    UnknownDtype(String),
    /// A device string other than auto/cpu/cuda/cuda:N.
    #[error("unknown device `{0}` (expected auto, cpu, cuda or cuda:N)")]
    UnknownDevice(String),
    /// A CUDA device was asked for but cannot be used; `reason` says why (no CUDA library, no
    /// driver, no such device).
    #[error("CUDA is unavailable for device {device}: {reason}")]
    CudaUnavailable {
        /// The device as asked for.
        device: String,
        /// Why it cannot be used.
        reason: String,
    },
    /// The checkpoint lacks a weight the architecture needs, or has one of the wrong shape.
    #[error("weight `{name}`: {message}")]
    Weight {
        /// The Hugging Face tensor name.
        name: String,
        /// What is wrong.
        message: String,
    },
    /// A model spec could not be resolved to files.
    #[error("cannot resolve model `{spec}`: {message}")]
    Resolve {
        /// The spec the user gave.
        spec: String,
        /// Why it failed.
        message: String,
    },
    /// A GGUF file could not be read or converted.
    #[error("gguf {path}: {message}")]
    Gguf {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The tokenizer or chat template could not be built.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A generation request is invalid (empty prompt, prompt too long, bad sampling params).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// A log-prob batch is invalid (empty completion, lengths beyond the context).
    #[error("invalid log-prob batch: {0}")]
    InvalidBatch(String),
    /// An error from libtorch.
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
}

/// Shorthand for results of this crate's model layer.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;
