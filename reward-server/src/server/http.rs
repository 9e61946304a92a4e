//! The HTTP/JSON API (axum): cotrain's own routes plus the shapes other trainers already speak.
//!
//! - `POST /v1/score`   `{"task": T, "items": [{"completions": [..], "item": {..}}], "options": {..}}`
//!   → `{"results": [{"reward", "levels", "details", "elapsed_ms"}], "elapsed_ms"}`
//! - `POST /v1/analyze` same request → `{"results": [{"diagnostics", "feedback", "elapsed_ms"}]}`
//! - `POST /v1/execute` `{"code", "stdin"?, "timeout_secs"?, "memory_mb"?}` → the sandbox outcome
//! - `POST /get_reward` OpenRLHF's remote reward protocol (`--remote_rm_url http://HOST:PORT/get_reward`):
//!   `{"query": [..], "prompts": [..], "labels": [..]}` → `{"rewards", "scores", "extra_logs"}`.
//!   Each label is a JSON string (what OpenRLHF's `--label_key` column holds):
//!   `{"task": "code", "item": {dataset row}, "other_completions": [..]?, "agent_index": n?}`.
//!   The completion scored is the query with its prompt removed (the whole query if it does
//!   not start with the prompt); for a multi-agent task it is inserted at `agent_index`
//!   (default: last) among `other_completions`, the other agents' completions of the joint action.
//! - `POST /run_code`   SandboxFusion's request/response shape (python only)
//! - `POST /predict`    MaPoRL's verifier protocol: `{"query_responses": [[user_msg, assistant_msg], ..]}`
//!   (messages `{"role", "content"}`) → `{"result": [score, ..]}`, scores in [0, 1]; errors in
//!   MaPoRL's shape `{"error": "..."}`: 400 for a bad body, 503 when no verifier is reachable
//!   OpenRLHF's `/get_reward` scores with the verifier when every label is
//!   `{"task": "verifier", "item": {"user": "...", "verifier"?: "name"}}`.
//! - `POST /v1/verify`  the native form: `{"verifier"?, "conversations": [{"user", "assistant"}]}`
//!   → `{"verifier", "scores"}`
//! - `GET /metrics`     Prometheus; `GET /health`
//!
//! Every error is `{"error": {"code", "message", "field"}}` with 400 (naming the field), 429
//! (queue full, with `Retry-After`), 501, 503 or 500.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, FromRequest, Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::{StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};

use super::core::{JointAction, RewardApi, parse_options};
use super::error::ApiError;
use crate::rewards::{ScoreOptions, TaskKind};
use crate::sandbox::ExecStatus;

#[derive(Clone)]
pub struct HttpState {
    pub api: Arc<RewardApi>,
    pub max_body_bytes: usize,
}

/// `Json` whose rejections are our 400s, naming the field serde complained about.
pub struct ApiJson<T>(pub T);

impl<S, T> FromRequest<S> for ApiJson<T>
where
    Json<T>: FromRequest<S, Rejection = JsonRejection>,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(v)) => Ok(ApiJson(v)),
            Err(JsonRejection::BytesRejection(e)) => Err(ApiError::invalid("body", e.body_text())),
            Err(e) => {
                let text = e.body_text();
                let field = field_in_serde_message(&text).unwrap_or_else(|| "body".into());
                Err(ApiError::invalid(field, text))
            }
        }
    }
}

/// The field named in a serde message ("missing field `task`", "unknown field `x`",
/// "items[0].completions: invalid type ..." from axum's path-aware messages).
fn field_in_serde_message(text: &str) -> Option<String> {
    for marker in ["missing field `", "unknown field `"] {
        if let Some(start) = text.find(marker) {
            let rest = &text[start + marker.len()..];
            return rest.find('`').map(|end| rest[..end].to_string());
        }
    }
    let body = text.strip_prefix("Failed to deserialize the JSON body into the target type: ")?;
    let (path, _) = body.split_once(": ")?;
    (!path.contains(' ')).then(|| path.to_string())
}

pub fn router(state: HttpState) -> Router {
    let limit = state.max_body_bytes;
    Router::new()
        .route("/v1/score", post(score))
        .route("/v1/analyze", post(analyze))
        .route("/v1/execute", post(execute))
        .route("/get_reward", post(get_reward))
        .route("/run_code", post(run_code))
        .route("/predict", post(predict))
        .route("/v1/verify", post(verify))
        .route("/metrics", get(metrics))
        .route("/health", get(health))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

fn observe<T>(state: &HttpState, endpoint: &str, started: Instant, r: &Result<T, ApiError>) {
    let outcome = match r {
        Ok(_) => "ok",
        Err(e) => e.kind(),
    };
    state
        .api
        .metrics
        .observe_request(endpoint, outcome, started.elapsed().as_secs_f64());
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct BatchRequest {
    task: String,
    items: Vec<JointAction>,
    #[serde(default)]
    options: Option<serde_json::Value>,
}

async fn score(State(state): State<HttpState>, ApiJson(req): ApiJson<BatchRequest>) -> Response {
    let started = Instant::now();
    let result = state
        .api
        .score(&req.task, req.items, req.options, "items")
        .await;
    observe(&state, "http.score", started, &result);
    match result {
        Ok(results) => Json(serde_json::json!({
            "results": results,
            "elapsed_ms": started.elapsed().as_millis() as u64,
        }))
        .into_response(),
        Err(e) => e.into_response(),
    }
}

async fn analyze(State(state): State<HttpState>, ApiJson(req): ApiJson<BatchRequest>) -> Response {
    let started = Instant::now();
    let result = state
        .api
        .analyze(&req.task, req.items, req.options, "items")
        .await;
    observe(&state, "http.analyze", started, &result);
    match result {
        Ok(results) => Json(serde_json::json!({
            "results": results,
            "elapsed_ms": started.elapsed().as_millis() as u64,
        }))
        .into_response(),
        Err(e) => e.into_response(),
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ExecuteRequest {
    code: String,
    #[serde(default)]
    stdin: Option<String>,
    #[serde(default)]
    timeout_secs: Option<f64>,
    #[serde(default)]
    memory_mb: Option<u64>,
}

async fn execute(
    State(state): State<HttpState>,
    ApiJson(req): ApiJson<ExecuteRequest>,
) -> Response {
    let started = Instant::now();
    let result = state
        .api
        .execute(
            &req.code,
            req.stdin.as_deref(),
            req.timeout_secs,
            req.memory_mb,
        )
        .await;
    observe(&state, "http.execute", started, &result);
    match result {
        Ok(out) => Json(out).into_response(),
        Err(e) => e.into_response(),
    }
}

// ------------------------------------------------------------------------------------ OpenRLHF

#[derive(Debug, Deserialize)]
struct OpenRlhfRequest {
    query: Vec<String>,
    #[serde(default)]
    prompts: Option<Vec<String>>,
    #[serde(default)]
    labels: Option<Vec<serde_json::Value>>,
}

/// What a label carries (see the module docs).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RewardLabel {
    task: String,
    item: serde_json::Value,
    #[serde(default)]
    other_completions: Vec<String>,
    #[serde(default)]
    agent_index: Option<usize>,
    #[serde(default)]
    options: Option<serde_json::Value>,
}

#[derive(Debug, Serialize)]
struct OpenRlhfResponse {
    rewards: Vec<f64>,
    scores: Vec<f64>,
    extra_logs: std::collections::BTreeMap<String, Vec<f64>>,
}

fn parse_label(i: usize, label: &serde_json::Value) -> Result<RewardLabel, ApiError> {
    let field = format!("labels[{i}]");
    let parsed = match label {
        // OpenRLHF passes the dataset's label column through as a string.
        serde_json::Value::String(s) => serde_json::from_str::<RewardLabel>(s),
        other => serde_json::from_value::<RewardLabel>(other.clone()),
    };
    parsed.map_err(|e| {
        ApiError::invalid(
            field,
            format!("{e} (expected a JSON string like {{\"task\": \"code\", \"item\": {{...}}}})"),
        )
    })
}

async fn get_reward(
    State(state): State<HttpState>,
    ApiJson(req): ApiJson<OpenRlhfRequest>,
) -> Response {
    let started = Instant::now();
    let result = openrlhf(&state, req).await;
    observe(&state, "http.get_reward", started, &result);
    match result {
        Ok(r) => Json(r).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn openrlhf(state: &HttpState, req: OpenRlhfRequest) -> Result<OpenRlhfResponse, ApiError> {
    let n = req.query.len();
    let labels = req.labels.clone().ok_or_else(|| {
        ApiError::invalid(
            "labels",
            "required: one label per query carrying the task and dataset item",
        )
    })?;
    if labels.len() != n {
        return Err(ApiError::invalid(
            "labels",
            format!("{} labels for {n} queries", labels.len()),
        ));
    }
    if let Some(p) = &req.prompts
        && p.len() != n
    {
        return Err(ApiError::invalid(
            "prompts",
            format!("{} prompts for {n} queries", p.len()),
        ));
    }
    let parsed: Vec<RewardLabel> = labels
        .iter()
        .enumerate()
        .map(|(i, l)| parse_label(i, l))
        .collect::<Result<_, _>>()?;
    let verifier_labels = parsed.iter().filter(|l| l.task == "verifier").count();
    if verifier_labels > 0 {
        if verifier_labels != n {
            return Err(ApiError::invalid(
                "labels",
                "a batch is either all `verifier` labels or none",
            ));
        }
        return openrlhf_verifier(state, &req, &parsed).await;
    }
    let mut jobs = Vec::with_capacity(n);
    for (i, query) in req.query.iter().enumerate() {
        let label = parse_label(i, &labels[i])?;
        let task: TaskKind = label
            .task
            .parse()
            .map_err(|e: crate::rewards::RewardError| {
                ApiError::invalid(format!("labels[{i}].task"), e.to_string())
            })?;
        let opts: ScoreOptions = parse_options(label.options.clone())
            .map_err(|e| ApiError::invalid(format!("labels[{i}].options"), e.to_string()))?;
        let prompt = req.prompts.as_ref().map(|p| p[i].as_str()).unwrap_or("");
        let response = query.strip_prefix(prompt).unwrap_or(query).to_string();
        let mut completions = label.other_completions.clone();
        let at = label.agent_index.unwrap_or(completions.len());
        if at > completions.len() {
            return Err(ApiError::invalid(
                format!("labels[{i}].agent_index"),
                format!("{at} is past the {} other completions", completions.len()),
            ));
        }
        completions.insert(at, response);
        jobs.push((i, task, completions, label.item, opts));
    }
    let api = &state.api;
    let results: Vec<crate::rewards::ScoreResult> = futures::stream::iter(jobs)
        .map(|(i, task, completions, item, opts)| async move {
            api.score_one(task, &completions, &item, &opts)
                .await
                .map_err(|e| ApiError::from_reward(e, &format!("labels[{i}]")))
        })
        .buffered(api.sandbox.max_concurrency().max(1))
        .try_collect()
        .await?;
    let mut extra_logs: std::collections::BTreeMap<String, Vec<f64>> = Default::default();
    // Every level key seen in the batch gets one value per sample (0.0 where absent), so the
    // lists line up with `rewards`.
    for r in &results {
        for k in r.levels.keys() {
            extra_logs.entry(k.clone()).or_default();
        }
    }
    for (k, v) in extra_logs.iter_mut() {
        *v = results
            .iter()
            .map(|r| r.levels.get(k).copied().unwrap_or(0.0))
            .collect();
    }
    let rewards: Vec<f64> = results.iter().map(|r| r.reward).collect();
    Ok(OpenRlhfResponse {
        scores: rewards.clone(),
        rewards,
        extra_logs,
    })
}

/// OpenRLHF with `{"task": "verifier", "item": {"user": "...", "verifier"?: "name"}}` labels: the
/// learned verifier's probability of each response (the query without its prompt) as the reward.
async fn openrlhf_verifier(
    state: &HttpState,
    req: &OpenRlhfRequest,
    labels: &[RewardLabel],
) -> Result<OpenRlhfResponse, ApiError> {
    let mut conversations = Vec::with_capacity(labels.len());
    let mut name: Option<&str> = None;
    for (i, (query, label)) in req.query.iter().zip(labels).enumerate() {
        let user = label.item.get("user").and_then(|u| u.as_str()).ok_or_else(|| {
            ApiError::invalid(format!("labels[{i}].item.user"), "a verifier label carries the user message: {\"task\": \"verifier\", \"item\": {\"user\": \"...\"}}")
        })?;
        let this = label
            .item
            .get("verifier")
            .and_then(|v| v.as_str())
            .unwrap_or("");
        if name.is_some_and(|n| n != this) {
            return Err(ApiError::invalid(
                format!("labels[{i}].item.verifier"),
                "one batch asks one verifier",
            ));
        }
        name = Some(this);
        let prompt = req.prompts.as_ref().map(|p| p[i].as_str()).unwrap_or("");
        conversations.push((
            user.to_string(),
            query.strip_prefix(prompt).unwrap_or(query).to_string(),
        ));
    }
    let (_, scores) = state.api.verify(name.unwrap_or(""), conversations).await?;
    let rewards: Vec<f64> = scores.iter().map(|s| f64::from(*s)).collect();
    Ok(OpenRlhfResponse {
        scores: rewards.clone(),
        rewards,
        extra_logs: Default::default(),
    })
}

// -------------------------------------------------------------------------------- SandboxFusion

#[derive(Debug, Deserialize)]
struct RunCodeRequest {
    code: String,
    #[serde(default = "default_language")]
    language: String,
    #[serde(default)]
    compile_timeout: Option<f64>,
    #[serde(default)]
    run_timeout: Option<f64>,
    #[serde(default, rename = "memory_limit_MB")]
    memory_limit_mb: Option<i64>,
    #[serde(default)]
    stdin: Option<String>,
    #[serde(default)]
    files: std::collections::HashMap<String, String>,
    #[serde(default)]
    fetch_files: Vec<String>,
}

fn default_language() -> String {
    "python".into()
}

async fn run_code(
    State(state): State<HttpState>,
    ApiJson(req): ApiJson<RunCodeRequest>,
) -> Response {
    let started = Instant::now();
    let result = sandbox_fusion(&state, req).await;
    observe(&state, "http.run_code", started, &result);
    match result {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn sandbox_fusion(
    state: &HttpState,
    req: RunCodeRequest,
) -> Result<serde_json::Value, ApiError> {
    if !matches!(req.language.as_str(), "python" | "python3") {
        return Err(ApiError::invalid(
            "language",
            format!("only python is supported, got {:?}", req.language),
        ));
    }
    if !req.files.is_empty() || !req.fetch_files.is_empty() {
        return Err(ApiError::invalid(
            "files",
            "extra files are not supported by this sandbox",
        ));
    }
    let _ = req.compile_timeout; // python has no separate compile step
    let memory = req.memory_limit_mb.filter(|m| *m > 0).map(|m| m as u64);
    let timeout = req.run_timeout.filter(|t| *t > 0.0);
    let out = state
        .api
        .execute(&req.code, req.stdin.as_deref(), timeout, memory)
        .await?;
    let (run_status, return_code) = match out.status {
        ExecStatus::Finished { exit_code } => ("Finished", Some(exit_code)),
        ExecStatus::Killed { signal } => ("Finished", Some(-signal)),
        ExecStatus::CpuTimeExceeded { .. } | ExecStatus::TimedOut { .. } => {
            ("TimeLimitExceeded", None)
        }
        ExecStatus::OutputLimit { .. } => ("Error", None),
    };
    let success = run_status == "Finished" && return_code == Some(0);
    Ok(serde_json::json!({
        "status": if success { "Success" } else { "Failed" },
        "message": "",
        "compile_result": null,
        "run_result": {
            "status": run_status,
            "execution_time": out.wall_time_ms as f64 / 1000.0,
            "return_code": return_code,
            "stdout": out.stdout,
            "stderr": out.stderr,
        },
        "executor_pod_name": null,
        "files": {},
    }))
}

// ------------------------------------------------------------------------------------- the rest

/// MaPoRL's `/predict`, with its error shape.
async fn predict(State(state): State<HttpState>, body: axum::body::Bytes) -> Response {
    let started = Instant::now();
    let result = match predict_conversations(&body) {
        Ok(c) => state.api.verify("", c).await.map(|(_, s)| s),
        Err(e) => Err(e),
    };
    observe(&state, "http.predict", started, &result);
    match result {
        Ok(scores) => Json(serde_json::json!({ "result": scores })).into_response(),
        Err(e) => {
            let status = match e {
                ApiError::InvalidArgument { .. } => StatusCode::BAD_REQUEST,
                ApiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
                ref other => other.http_status(),
            };
            (status, Json(serde_json::json!({ "error": e.to_string() }))).into_response()
        }
    }
}

/// `query_responses` of a `/predict` body as (user, assistant) pairs: each entry must be exactly
/// `[{"role": "user", ..}, {"role": "assistant", ..}]`, as MaPoRL's trainer sends them.
fn predict_conversations(body: &[u8]) -> Result<Vec<(String, String)>, ApiError> {
    let v: serde_json::Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid("body", format!("not JSON: {e}")))?;
    let list = v
        .get("query_responses")
        .ok_or_else(|| ApiError::invalid("query_responses", "missing from the request body"))?
        .as_array()
        .filter(|a| !a.is_empty())
        .ok_or_else(|| ApiError::invalid("query_responses", "must be a non-empty list"))?;
    list.iter()
        .enumerate()
        .map(|(i, conv)| {
            let field = format!("query_responses[{i}]");
            let msgs = conv
                .as_array()
                .ok_or_else(|| ApiError::invalid(&field, "must be a list of messages"))?;
            let text = |j: usize, role: &str| -> Result<String, ApiError> {
                let m = msgs.get(j).ok_or_else(|| {
                    ApiError::invalid(&field, "must hold a user message and an assistant message")
                })?;
                let got = m.get("role").and_then(|r| r.as_str());
                if got != Some(role) {
                    return Err(ApiError::invalid(
                        format!("{field}[{j}].role"),
                        format!(
                            "must be `{role}`, got {}",
                            got.map_or("nothing".into(), |g| format!("`{g}`"))
                        ),
                    ));
                }
                m.get("content")
                    .and_then(|c| c.as_str())
                    .map(str::to_string)
                    .ok_or_else(|| {
                        ApiError::invalid(format!("{field}[{j}].content"), "must be a string")
                    })
            };
            if msgs.len() != 2 {
                return Err(ApiError::invalid(
                    &field,
                    format!("must be [user, assistant], got {} messages", msgs.len()),
                ));
            }
            Ok((text(0, "user")?, text(1, "assistant")?))
        })
        .collect()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct VerifyRequest {
    #[serde(default)]
    verifier: String,
    conversations: Vec<VerifyConversation>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct VerifyConversation {
    user: String,
    assistant: String,
}

async fn verify(State(state): State<HttpState>, ApiJson(req): ApiJson<VerifyRequest>) -> Response {
    let started = Instant::now();
    let conversations = req
        .conversations
        .into_iter()
        .map(|c| (c.user, c.assistant))
        .collect();
    let result = state.api.verify(&req.verifier, conversations).await;
    observe(&state, "http.verify", started, &result);
    match result {
        Ok((verifier, scores)) => {
            Json(serde_json::json!({ "verifier": verifier, "scores": scores })).into_response()
        }
        Err(e) => e.into_response(),
    }
}

async fn metrics(State(state): State<HttpState>) -> Response {
    (
        [(http::header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.api.metrics.render(&state.api.sandbox),
    )
        .into_response()
}

async fn health(State(state): State<HttpState>) -> Response {
    (
        StatusCode::OK,
        Json(serde_json::json!({
            "status": "serving",
            "sandboxed": state.api.sandbox.is_sandboxed(),
            "queue_depth": state.api.sandbox.queue_depth(),
            "in_flight": state.api.sandbox.in_flight(),
        })),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serde_messages_yield_the_field() {
        assert_eq!(
            field_in_serde_message("Failed to deserialize the JSON body into the target type: missing field `task` at line 1 column 2").as_deref(),
            Some("task")
        );
        assert_eq!(
            field_in_serde_message("Failed to deserialize the JSON body into the target type: items[0].completions: invalid type: string \"x\", expected a sequence at line 1 column 40").as_deref(),
            Some("items[0].completions")
        );
    }
}
