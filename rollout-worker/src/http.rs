//! The OpenAI-compatible HTTP API (`/v1/models`, `/v1/chat/completions`, `/v1/completions`),
//! plus `/metrics` (Prometheus) and `/health`. `model` names an agent. Streaming is not offered;
//! a request with `"stream": true` is refused with an OpenAI-shaped error.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use cotrain_model::chat_template::ChatMessage;
use cotrain_model::engine::{SamplingParams, StopConditions};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::WorkerError;
use crate::worker::{GenerateJob, GenerateOutput, PromptInput, Worker};

/// Completion tokens when a request gives no `max_tokens` (and the context allows).
pub const DEFAULT_MAX_TOKENS: usize = 512;

/// The router over a shared worker.
pub fn router(worker: Arc<Worker>) -> Router {
    Router::new()
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/metrics", get(metrics))
        .route("/health", get(|| async { "ok" }))
        .with_state(worker)
}

/// An error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
pub struct ApiError {
    status: http::StatusCode,
    kind: &'static str,
    message: String,
    param: Option<String>,
}

impl ApiError {
    fn invalid(param: &str, message: impl Into<String>) -> Self {
        Self { status: http::StatusCode::BAD_REQUEST, kind: "invalid_request_error", message: message.into(), param: Some(param.into()) }
    }
}

impl From<WorkerError> for ApiError {
    fn from(e: WorkerError) -> Self {
        let (status, kind) = e.http_status();
        let param = e.field().map(openai_field);
        Self { status, kind, message: e.to_string(), param }
    }
}

impl From<JsonRejection> for ApiError {
    fn from(e: JsonRejection) -> Self {
        Self { status: http::StatusCode::BAD_REQUEST, kind: "invalid_request_error", message: e.body_text(), param: None }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": Value::Null}});
        (self.status, Json(body)).into_response()
    }
}

/// Maps the worker's field paths to the OpenAI request's names.
fn openai_field(field: &str) -> String {
    let name = match field {
        "agent" => "model",
        "sampling.temperature" => "temperature",
        "sampling.top_p" => "top_p",
        "sampling.min_p" => "min_p",
        "sampling.max_new_tokens" => "max_tokens",
        "stop.stop_strings" => "stop",
        f if f.starts_with("prompts") => "prompt",
        f => f,
    };
    name.to_string()
}

#[derive(Deserialize)]
#[serde(untagged)]
enum StopField {
    One(String),
    Many(Vec<String>),
}

/// Fields shared by both completion endpoints. Unknown fields are ignored, as OpenAI-compatible
/// servers commonly do, so that clients sending extra options still work.
#[derive(Deserialize)]
struct Common {
    model: String,
    #[serde(default)]
    n: Option<usize>,
    #[serde(default)]
    seed: Option<u64>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    top_p: Option<f64>,
    #[serde(default)]
    top_k: Option<usize>,
    #[serde(default)]
    min_p: Option<f64>,
    #[serde(default)]
    max_tokens: Option<usize>,
    #[serde(default)]
    max_completion_tokens: Option<usize>,
    #[serde(default)]
    stop: Option<StopField>,
    #[serde(default)]
    stream: Option<bool>,
}

#[derive(Deserialize)]
struct ChatRequest {
    #[serde(flatten)]
    common: Common,
    messages: Vec<ChatMessageIn>,
}

#[derive(Deserialize)]
struct ChatMessageIn {
    role: String,
    #[serde(default)]
    content: Option<Value>,
}

#[derive(Deserialize)]
struct CompletionRequest {
    #[serde(flatten)]
    common: Common,
    prompt: Value,
}

fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

fn job(worker: &Worker, c: Common, prompts: Vec<PromptInput>) -> Result<GenerateJob, ApiError> {
    if c.stream == Some(true) {
        return Err(ApiError::invalid("stream", "streaming is not supported by this server"));
    }
    let context = worker.context_length(&c.model)?;
    let max_new_tokens = c.max_completion_tokens.or(c.max_tokens).unwrap_or(DEFAULT_MAX_TOKENS.min(context));
    let stop_strings = match c.stop {
        None => Vec::new(),
        Some(StopField::One(s)) => vec![s],
        Some(StopField::Many(v)) => v,
    };
    Ok(GenerateJob {
        agent: c.model,
        prompts,
        n: c.n.unwrap_or(1),
        sampling: SamplingParams {
            temperature: c.temperature.unwrap_or(1.0),
            top_k: c.top_k.unwrap_or(0),
            top_p: c.top_p.unwrap_or(1.0),
            min_p: c.min_p.unwrap_or(0.0),
        },
        stop: StopConditions { max_new_tokens, stop_token_ids: Vec::new(), stop_strings, ignore_eos: false },
        // Without a seed, every request samples differently, as OpenAI's API does.
        seed: c.seed.unwrap_or_else(|| uuid::Uuid::new_v4().as_u64_pair().0),
        min_policy_version: None,
    })
}

fn usage(out: &GenerateOutput) -> Value {
    let prompt: usize = out.completions.iter().map(|c| c.prompt_token_ids.len()).sum();
    let completion: usize = out.completions.iter().flat_map(|c| &c.samples).map(|s| s.token_ids.len()).sum();
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

fn policy_version(out: &GenerateOutput) -> u64 {
    out.completions.iter().flat_map(|c| &c.samples).map(|s| s.policy_version).max().unwrap_or(0)
}

async fn models(State(worker): State<Arc<Worker>>) -> Json<Value> {
    let data: Vec<Value> = worker
        .agent_names()
        .iter()
        .map(|a| {
            json!({
                "id": a, "object": "model", "created": 0, "owned_by": "cotrain",
                "root": worker.model_of(a).unwrap_or_default(),
                "policy_version": worker.policy_version(a).unwrap_or(0),
            })
        })
        .collect();
    Json(json!({"object": "list", "data": data}))
}

fn text_of(content: Option<Value>, index: usize) -> Result<String, ApiError> {
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s),
        // The content-parts form: concatenate the text parts.
        Some(Value::Array(parts)) => parts
            .iter()
            .map(|p| match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                (Some("text"), Some(t)) => Ok(t.to_string()),
                _ => Err(ApiError::invalid(&format!("messages[{index}].content"), "only text content parts are supported")),
            })
            .collect(),
        Some(_) => Err(ApiError::invalid(&format!("messages[{index}].content"), "must be a string or a list of parts")),
    }
}

async fn chat_completions(
    State(worker): State<Arc<Worker>>,
    body: Result<Json<ChatRequest>, JsonRejection>,
) -> Result<Json<Value>, ApiError> {
    let Json(req) = body?;
    if req.messages.is_empty() {
        return Err(ApiError::invalid("messages", "no messages"));
    }
    let messages = req
        .messages
        .into_iter()
        .enumerate()
        .map(|(i, m)| Ok(ChatMessage::new(m.role, text_of(m.content, i)?)))
        .collect::<Result<Vec<_>, ApiError>>()?;
    let agent = req.common.model.clone();
    let job = job(&worker, req.common, vec![PromptInput::Chat(messages)])?;
    let out = worker.generate(job).await.map_err(|e| match e {
        WorkerError::InvalidArgument { field, message } if field.starts_with("prompts") => ApiError::invalid("messages", message),
        e => e.into(),
    })?;
    let choices: Vec<Value> = out.completions[0]
        .samples
        .iter()
        .enumerate()
        .map(|(i, s)| {
            json!({
                "index": i,
                "message": {"role": "assistant", "content": s.text},
                "finish_reason": s.finish_reason.as_str(),
                "logprobs": Value::Null,
            })
        })
        .collect();
    Ok(Json(json!({
        "id": format!("chatcmpl-{}", uuid::Uuid::new_v4().simple()),
        "object": "chat.completion",
        "created": now_secs(),
        "model": agent,
        "choices": choices,
        "usage": usage(&out),
        "system_fingerprint": format!("policy-v{}", policy_version(&out)),
        "policy_version": policy_version(&out),
    })))
}

/// OpenAI's `prompt`: a string, a list of strings, a list of token ids or a list of lists.
fn prompts_of(prompt: Value) -> Result<Vec<PromptInput>, ApiError> {
    let bad = || ApiError::invalid("prompt", "must be a string, a list of strings, a list of token ids or a list of such lists");
    let ids = |v: &Vec<Value>| -> Result<Vec<u32>, ApiError> {
        v.iter().map(|x| x.as_u64().and_then(|t| u32::try_from(t).ok()).ok_or_else(bad)).collect()
    };
    match prompt {
        Value::String(s) => Ok(vec![PromptInput::Text(s)]),
        Value::Array(items) if items.is_empty() => Err(ApiError::invalid("prompt", "empty prompt")),
        Value::Array(items) if items.iter().all(Value::is_string) => {
            Ok(items.into_iter().map(|s| PromptInput::Text(s.as_str().unwrap_or_default().to_string())).collect())
        }
        Value::Array(items) if items.iter().all(Value::is_number) => Ok(vec![PromptInput::Tokens(ids(&items)?)]),
        Value::Array(items) => items
            .iter()
            .map(|x| match x {
                Value::Array(v) => Ok(PromptInput::Tokens(ids(v)?)),
                _ => Err(bad()),
            })
            .collect(),
        _ => Err(bad()),
    }
}

async fn completions(
    State(worker): State<Arc<Worker>>,
    body: Result<Json<CompletionRequest>, JsonRejection>,
) -> Result<Json<Value>, ApiError> {
    let Json(req) = body?;
    let prompts = prompts_of(req.prompt)?;
    let agent = req.common.model.clone();
    let job = job(&worker, req.common, prompts)?;
    let out = worker.generate(job).await?;
    let mut choices = Vec::new();
    for c in &out.completions {
        for s in &c.samples {
            choices.push(json!({
                "index": choices.len(),
                "text": s.text,
                "finish_reason": s.finish_reason.as_str(),
                "logprobs": Value::Null,
            }));
        }
    }
    Ok(Json(json!({
        "id": format!("cmpl-{}", uuid::Uuid::new_v4().simple()),
        "object": "text_completion",
        "created": now_secs(),
        "model": agent,
        "choices": choices,
        "usage": usage(&out),
        "system_fingerprint": format!("policy-v{}", policy_version(&out)),
        "policy_version": policy_version(&out),
    })))
}

async fn metrics(State(worker): State<Arc<Worker>>) -> impl IntoResponse {
    ([(http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], worker.metrics().render())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_forms_parse() {
        assert_eq!(prompts_of(json!("hi")).ok().unwrap(), vec![PromptInput::Text("hi".into())]);
        assert_eq!(prompts_of(json!([1, 2])).ok().unwrap(), vec![PromptInput::Tokens(vec![1, 2])]);
        assert_eq!(prompts_of(json!([[1], [2, 3]])).ok().unwrap().len(), 2);
        assert!(prompts_of(json!([])).is_err());
        assert!(prompts_of(json!([-1])).is_err());
        assert!(prompts_of(json!({"a": 1})).is_err());
    }

    #[test]
    fn worker_fields_map_to_openai_names() {
        assert_eq!(openai_field("sampling.temperature"), "temperature");
        assert_eq!(openai_field("prompts[2]"), "prompt");
        assert_eq!(openai_field("agent"), "model");
    }
}
