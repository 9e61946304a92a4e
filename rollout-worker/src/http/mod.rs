//! The OpenAI-compatible HTTP API (`/v1/models`, `/v1/chat/completions`, `/v1/completions`),
//! plus `/metrics` (Prometheus) and `/health`. `model` names an agent.
//!
//! Beside OpenAI's fields, for trainers that roll out through this API: `logprobs` /
//! `top_logprobs` in OpenAI's shapes ([`logprobs`]), `"stream": true` as server-sent events
//! ([`stream`]), the sampled token ids with `"return_token_ids": true` (vLLM's name and shape:
//! `token_ids` per choice, `prompt_token_ids` per prompt) and the policy version that produced each
//! response. A field this server does not implement is refused with a 400 naming it, never
//! ignored: see [`refuse_unsupported`].

mod logprobs;
mod stream;

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::extract::rejection::JsonRejection;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use cotrain_model::chat_template::ChatMessage;
use cotrain_model::engine::{SamplingParams, StopConditions};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::error::WorkerError;
use crate::worker::{GenerateJob, GenerateOutput, PromptInput, Worker};
use logprobs::MAX_TOP_LOGPROBS;

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
        Self {
            status: http::StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: message.into(),
            param: Some(param.into()),
        }
    }

    fn internal(message: impl Into<String>) -> Self {
        Self {
            status: http::StatusCode::INTERNAL_SERVER_ERROR,
            kind: "server_error",
            message: message.into(),
            param: None,
        }
    }

    /// The JSON body: `{"error": {...}}`.
    fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": Value::Null}})
    }
}

impl From<WorkerError> for ApiError {
    fn from(e: WorkerError) -> Self {
        let (status, kind) = e.http_status();
        let param = e.field().map(openai_field);
        Self {
            status,
            kind,
            message: e.to_string(),
            param,
        }
    }
}

impl From<JsonRejection> for ApiError {
    fn from(e: JsonRejection) -> Self {
        Self {
            status: http::StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: e.body_text(),
            param: None,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
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
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    /// Chat: a boolean; completions: how many alternatives per position (0..=20).
    #[serde(default)]
    logprobs: Option<Value>,
    /// Chat only: alternatives per position, with `logprobs: true`.
    #[serde(default)]
    top_logprobs: Option<usize>,
    /// vLLM's: the sampled (and prompt) token ids in the response.
    #[serde(default)]
    return_token_ids: Option<bool>,
    /// vLLM's: token ids that end a sample besides EOS.
    #[serde(default)]
    stop_token_ids: Option<Vec<u32>>,
    /// vLLM's: sample past EOS (until `max_tokens` or a stop).
    #[serde(default)]
    ignore_eos: Option<bool>,
    /// OpenAI fields this server does not implement, refused when set to anything but their
    /// no-op value (see [`refuse_unsupported`]).
    #[serde(flatten)]
    rest: serde_json::Map<String, Value>,
}

#[derive(Deserialize, Default)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// Whether a request field's value is one cotrain can accept as having no effect.
type FieldIsHarmless = fn(&Value) -> bool;

/// OpenAI request fields with an effect this server does not implement, and the value that means
/// "no effect" (accepted). Any other field not named in [`Common`] or the endpoint's request is
/// ignored, as OpenAI-compatible servers do with unknown extensions.
const UNSUPPORTED: &[(&str, FieldIsHarmless)] = &[
    ("logit_bias", |v| {
        v.is_null() || v.as_object().is_some_and(|m| m.is_empty())
    }),
    ("presence_penalty", |v| {
        v.is_null() || v.as_f64() == Some(0.0)
    }),
    ("frequency_penalty", |v| {
        v.is_null() || v.as_f64() == Some(0.0)
    }),
    ("repetition_penalty", |v| {
        v.is_null() || v.as_f64() == Some(1.0)
    }),
    ("tools", |v| {
        v.is_null() || v.as_array().is_some_and(|a| a.is_empty())
    }),
    ("functions", |v| {
        v.is_null() || v.as_array().is_some_and(|a| a.is_empty())
    }),
    ("tool_choice", |v| v.is_null() || v.as_str() == Some("none")),
    ("function_call", |v| {
        v.is_null() || v.as_str() == Some("none")
    }),
    ("response_format", |v| {
        v.is_null() || v.get("type").and_then(Value::as_str) == Some("text")
    }),
    ("echo", |v| v.is_null() || v.as_bool() == Some(false)),
    ("suffix", |v| v.is_null() || v.as_str() == Some("")),
    ("best_of", |v| v.is_null() || v.as_u64() == Some(1)),
    ("audio", Value::is_null),
    ("modalities", |v| {
        v.is_null()
            || v.as_array()
                .is_some_and(|a| a.iter().all(|m| m.as_str() == Some("text")))
    }),
    ("prediction", Value::is_null),
    ("prompt_logprobs", Value::is_null),
    // vLLM's extensions that change the output.
    ("include_stop_str_in_output", |v| {
        v.is_null() || v.as_bool() == Some(false)
    }),
    ("skip_special_tokens", |v| {
        v.is_null() || v.as_bool() == Some(true)
    }),
    ("min_tokens", |v| v.is_null() || v.as_u64() == Some(0)),
    ("return_tokens_as_token_ids", |v| {
        v.is_null() || v.as_bool() == Some(false)
    }),
];

/// A 400 naming the first field set to something this server cannot do.
fn refuse_unsupported(rest: &serde_json::Map<String, Value>) -> Result<(), ApiError> {
    for (name, no_op) in UNSUPPORTED {
        if let Some(v) = rest.get(*name)
            && !no_op(v)
        {
            return Err(ApiError::invalid(
                name,
                format!("`{name}` is not supported by this server (cotrain's rollout worker)"),
            ));
        }
    }
    Ok(())
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
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Alternatives per position for chat's `logprobs` (a boolean) and `top_logprobs`: `None` without
/// log-probs.
fn chat_top_logprobs(c: &Common) -> Result<Option<usize>, ApiError> {
    let on = match &c.logprobs {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::invalid(
                "logprobs",
                "must be a boolean on /v1/chat/completions (top_logprobs gives the alternatives)",
            ));
        }
    };
    match (on, c.top_logprobs) {
        (_, Some(k)) if k > MAX_TOP_LOGPROBS => Err(ApiError::invalid(
            "top_logprobs",
            format!("must be at most {MAX_TOP_LOGPROBS}, got {k}"),
        )),
        (false, Some(k)) if k > 0 => {
            Err(ApiError::invalid("top_logprobs", "needs `logprobs: true`"))
        }
        (false, _) => Ok(None),
        (true, k) => Ok(Some(k.unwrap_or(0))),
    }
}

/// Alternatives per position for the completions endpoint's `logprobs` (an integer).
fn completion_top_logprobs(c: &Common) -> Result<Option<usize>, ApiError> {
    if c.top_logprobs.is_some() {
        return Err(ApiError::invalid(
            "top_logprobs",
            "is a chat field; /v1/completions takes `logprobs: <alternatives>`",
        ));
    }
    match &c.logprobs {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(k) if k as usize <= MAX_TOP_LOGPROBS => Ok(Some(k as usize)),
            _ => Err(ApiError::invalid(
                "logprobs",
                format!("must be an integer from 0 to {MAX_TOP_LOGPROBS} on /v1/completions"),
            )),
        },
    }
}

fn job(
    worker: &Worker,
    c: &Common,
    prompts: Vec<PromptInput>,
    top_logprobs: usize,
) -> Result<GenerateJob, ApiError> {
    refuse_unsupported(&c.rest)?;
    let context = worker.context_length(&c.model)?;
    let max_new_tokens = c
        .max_completion_tokens
        .or(c.max_tokens)
        .unwrap_or(DEFAULT_MAX_TOKENS.min(context));
    let stop_strings = match &c.stop {
        None => Vec::new(),
        Some(StopField::One(s)) => vec![s.clone()],
        Some(StopField::Many(v)) => v.clone(),
    };
    Ok(GenerateJob {
        agent: c.model.clone(),
        prompts,
        n: c.n.unwrap_or(1),
        sampling: SamplingParams {
            temperature: c.temperature.unwrap_or(1.0),
            top_k: c.top_k.unwrap_or(0),
            top_p: c.top_p.unwrap_or(1.0),
            min_p: c.min_p.unwrap_or(0.0),
        },
        stop: StopConditions {
            max_new_tokens,
            stop_token_ids: c.stop_token_ids.clone().unwrap_or_default(),
            stop_strings,
            ignore_eos: c.ignore_eos.unwrap_or(false),
        },
        // Without a seed, every request samples differently, as OpenAI's API does.
        seed: c
            .seed
            .unwrap_or_else(|| uuid::Uuid::new_v4().as_u64_pair().0),
        min_policy_version: None,
        top_logprobs,
        // OpenAI's log-probs are the model's (before the temperature).
        logprobs: cotrain_model::engine::LogprobMode::Raw,
    })
}

/// What a streamed answer of request `c` carries.
fn stream_spec(shape: stream::Shape, c: &Common, id: String, logprobs: bool) -> stream::StreamSpec {
    stream::StreamSpec {
        shape,
        id,
        created: now_secs(),
        agent: c.model.clone(),
        n: c.n.unwrap_or(1),
        logprobs,
        token_ids: c.return_token_ids == Some(true),
        include_usage: c.stream_options.as_ref().is_some_and(|o| o.include_usage),
    }
}

fn usage(out: &GenerateOutput) -> Value {
    let prompt: usize = out
        .completions
        .iter()
        .map(|c| c.prompt_token_ids.len())
        .sum();
    let completion: usize = out
        .completions
        .iter()
        .flat_map(|c| &c.samples)
        .map(|s| s.token_ids.len())
        .sum();
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

fn policy_version(out: &GenerateOutput) -> u64 {
    out.completions
        .iter()
        .flat_map(|c| &c.samples)
        .map(|s| s.policy_version)
        .max()
        .unwrap_or(0)
}

async fn models(State(worker): State<Arc<Worker>>) -> Json<Value> {
    let mut data: Vec<Value> = Vec::new();
    for a in worker.agent_names() {
        let root = worker.model_of(a).unwrap_or_default();
        let version = worker.policy_version(a).unwrap_or(0);
        data.push(json!({"id": a, "object": "model", "created": 0, "owned_by": "cotrain", "root": root, "policy_version": version}));
        // An unmerged adapter is also listed as `BASE:AGENT`, with its base as parent (as vLLM
        // lists LoRA modules).
        if worker.is_adapter(a) {
            // The base's spec (a model id is `SPEC#AGENTS` when the worker holds several copies).
            let base = root.split('#').next().unwrap_or_default();
            data.push(json!({"id": format!("{base}:{a}"), "object": "model", "created": 0, "owned_by": "cotrain",
                "root": root, "parent": base, "policy_version": version}));
        }
    }
    Json(json!({"object": "list", "data": data}))
}

fn text_of(content: Option<Value>, index: usize) -> Result<String, ApiError> {
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s),
        // The content-parts form: concatenate the text parts.
        Some(Value::Array(parts)) => parts
            .iter()
            .map(|p| {
                match (
                    p.get("type").and_then(Value::as_str),
                    p.get("text").and_then(Value::as_str),
                ) {
                    (Some("text"), Some(t)) => Ok(t.to_string()),
                    _ => Err(ApiError::invalid(
                        &format!("messages[{index}].content"),
                        "only text content parts are supported",
                    )),
                }
            })
            .collect(),
        Some(_) => Err(ApiError::invalid(
            &format!("messages[{index}].content"),
            "must be a string or a list of parts",
        )),
    }
}

async fn chat_completions(
    State(worker): State<Arc<Worker>>,
    body: Result<Json<ChatRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(mut req) = body?;
    req.common.model = worker.resolve_agent(&req.common.model);
    if req.messages.is_empty() {
        return Err(ApiError::invalid("messages", "no messages"));
    }
    let messages = req
        .messages
        .into_iter()
        .enumerate()
        .map(|(i, m)| Ok(ChatMessage::new(m.role, text_of(m.content, i)?)))
        .collect::<Result<Vec<_>, ApiError>>()?;
    let c = &req.common;
    let top = chat_top_logprobs(c)?;
    let job = job(
        &worker,
        c,
        vec![PromptInput::Chat(messages)],
        top.unwrap_or(0),
    )?;
    let id = format!("chatcmpl-{}", uuid::Uuid::new_v4().simple());
    if c.stream == Some(true) {
        return stream::respond(
            worker.clone(),
            job,
            stream_spec(stream::Shape::Chat, c, id, top.is_some()),
        )
        .await;
    }
    let out = worker.generate(job).await.map_err(chat_error)?;
    let tok = worker.tokenizer(&c.model)?;
    let token_ids = c.return_token_ids == Some(true);
    let choices: Vec<Value> = out.completions[0]
        .samples
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let mut choice = json!({
                "index": i,
                "message": {"role": "assistant", "content": s.text},
                "finish_reason": s.finish_reason.as_str(),
                "logprobs": if top.is_some() { logprobs::chat_logprobs(tok, &s.token_ids, &s.logprobs, &s.top_logprobs) } else { Value::Null },
                "policy_version": s.policy_version,
            });
            if token_ids {
                choice["token_ids"] = json!(s.token_ids);
            }
            choice
        })
        .collect();
    let mut body = json!({
        "id": id,
        "object": "chat.completion",
        "created": now_secs(),
        "model": c.model,
        "choices": choices,
        "usage": usage(&out),
        "system_fingerprint": format!("policy-v{}", policy_version(&out)),
        "policy_version": policy_version(&out),
    });
    if token_ids {
        body["prompt_token_ids"] = json!(out.completions[0].prompt_token_ids);
    }
    Ok(Json(body).into_response())
}

/// A worker error on the chat endpoint, whose prompt is `messages`.
fn chat_error(e: WorkerError) -> ApiError {
    match e {
        WorkerError::InvalidArgument { field, message } if field.starts_with("prompts") => {
            ApiError::invalid("messages", message)
        }
        e => e.into(),
    }
}

/// OpenAI's `prompt`: a string, a list of strings, a list of token ids or a list of lists.
fn prompts_of(prompt: Value) -> Result<Vec<PromptInput>, ApiError> {
    let bad = || {
        ApiError::invalid(
            "prompt",
            "must be a string, a list of strings, a list of token ids or a list of such lists",
        )
    };
    let ids = |v: &Vec<Value>| -> Result<Vec<u32>, ApiError> {
        v.iter()
            .map(|x| {
                x.as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .ok_or_else(bad)
            })
            .collect()
    };
    match prompt {
        Value::String(s) => Ok(vec![PromptInput::Text(s)]),
        Value::Array(items) if items.is_empty() => Err(ApiError::invalid("prompt", "empty prompt")),
        Value::Array(items) if items.iter().all(Value::is_string) => Ok(items
            .into_iter()
            .map(|s| PromptInput::Text(s.as_str().unwrap_or_default().to_string()))
            .collect()),
        Value::Array(items) if items.iter().all(Value::is_number) => {
            Ok(vec![PromptInput::Tokens(ids(&items)?)])
        }
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
) -> Result<Response, ApiError> {
    let Json(mut req) = body?;
    req.common.model = worker.resolve_agent(&req.common.model);
    let prompts = prompts_of(req.prompt)?;
    let c = &req.common;
    let agent = c.model.clone();
    let top = completion_top_logprobs(c)?;
    let job = job(&worker, c, prompts, top.unwrap_or(0))?;
    let id = format!("cmpl-{}", uuid::Uuid::new_v4().simple());
    if c.stream == Some(true) {
        return stream::respond(
            worker.clone(),
            job,
            stream_spec(stream::Shape::Completion, c, id, top.is_some()),
        )
        .await;
    }
    let out = worker.generate(job).await?;
    let tok = worker.tokenizer(&agent)?;
    let token_ids = c.return_token_ids == Some(true);
    let mut choices = Vec::new();
    for completion in &out.completions {
        for s in &completion.samples {
            let mut choice = json!({
                "index": choices.len(),
                "text": s.text,
                "finish_reason": s.finish_reason.as_str(),
                "logprobs": if top.is_some() { logprobs::completion_logprobs(tok, &s.token_ids, &s.logprobs, &s.top_logprobs, 0) } else { Value::Null },
                "policy_version": s.policy_version,
            });
            if token_ids {
                choice["token_ids"] = json!(s.token_ids);
                choice["prompt_token_ids"] = json!(completion.prompt_token_ids);
            }
            choices.push(choice);
        }
    }
    Ok(Json(json!({
        "id": id,
        "object": "text_completion",
        "created": now_secs(),
        "model": agent,
        "choices": choices,
        "usage": usage(&out),
        "system_fingerprint": format!("policy-v{}", policy_version(&out)),
        "policy_version": policy_version(&out),
    }))
    .into_response())
}

async fn metrics(State(worker): State<Arc<Worker>>) -> impl IntoResponse {
    (
        [(http::header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        worker.metrics().render(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_forms_parse() {
        assert_eq!(
            prompts_of(json!("hi")).ok().unwrap(),
            vec![PromptInput::Text("hi".into())]
        );
        assert_eq!(
            prompts_of(json!([1, 2])).ok().unwrap(),
            vec![PromptInput::Tokens(vec![1, 2])]
        );
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
