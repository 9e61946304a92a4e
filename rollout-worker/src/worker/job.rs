//! A generate request and its answer as the worker sees them, whichever wire (gRPC or HTTP) they
//! came in on, and the model status `Info` reports.

use cotrain_model::chat_template::ChatMessage;
use cotrain_model::engine::{FinishReason, LogprobMode, SamplingParams, StopConditions};

/// A parameter's name and shape.
pub type ParameterShape = (String, Vec<i64>);

/// A prompt as a client gives it.
#[derive(Clone, Debug, PartialEq)]
pub enum PromptInput {
    /// Tokenised as is.
    Text(String),
    /// Rendered with the model's chat template, generation prompt appended.
    Chat(Vec<ChatMessage>),
    /// Used as is.
    Tokens(Vec<u32>),
}

/// A generate request, independent of the wire format it came in.
#[derive(Clone, Debug)]
pub struct GenerateJob {
    /// The agent.
    pub agent: String,
    /// One or more prompts.
    pub prompts: Vec<PromptInput>,
    /// Samples per prompt.
    pub n: usize,
    /// Sampling parameters.
    pub sampling: SamplingParams,
    /// Stop conditions, including `max_new_tokens`.
    pub stop: StopConditions,
    /// Seed; see [`crate::seeds::prompt_seed`].
    pub seed: u64,
    /// Refuse to sample from an older policy.
    pub min_policy_version: Option<u64>,
    /// Most likely tokens to report at each generated position (OpenAI's `top_logprobs`); 0: none.
    pub top_logprobs: usize,
    /// Which log-prob each sample reports per token (`SamplingParams.sampling_logprobs`).
    pub logprobs: LogprobMode,
}

/// One sample of a completion.
#[derive(Clone, Debug, PartialEq)]
pub struct SampleOutput {
    /// Generated token ids.
    pub token_ids: Vec<u32>,
    /// Decoded text.
    pub text: String,
    /// Raw-model log-prob of every generated token.
    pub logprobs: Vec<f32>,
    /// With [`GenerateJob::top_logprobs`] > 0, each position's most likely tokens and their raw
    /// log-probs, most likely first.
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// The version whose weights produced every token.
    pub policy_version: u64,
}

/// The samples of one prompt.
#[derive(Clone, Debug, PartialEq)]
pub struct CompletionOutput {
    /// The prompt as the model saw it.
    pub prompt_token_ids: Vec<u32>,
    /// `n` samples, by index.
    pub samples: Vec<SampleOutput>,
}

/// The answer to a [`GenerateJob`].
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateOutput {
    /// The model id that served it.
    pub model: String,
    /// One per prompt, in request order.
    pub completions: Vec<CompletionOutput>,
}

/// Agent/model status for `Info`.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelStatus {
    /// Model id (its spec).
    pub id: String,
    /// Agents served by it.
    pub agents: Vec<String>,
    /// Current policy version.
    pub policy_version: u64,
    /// Parameter count.
    pub parameter_count: u64,
    /// Context length in tokens.
    pub context_length: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Sequences decoding now.
    pub running_sequences: usize,
    /// Jobs waiting to decode.
    pub queued_requests: usize,
    /// Weight updates waiting for the running sequences to finish.
    pub pending_weight_updates: usize,
    /// Its agents are served as unmerged adapters, each with its own version.
    pub unmerged_adapters: bool,
}
