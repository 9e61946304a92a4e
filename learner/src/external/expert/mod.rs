//! The `expert_edits` transition's expert: between turns, a model behind any OpenAI-compatible chat
//! API (`POST {base_url}/chat/completions`) reads the problem and the agents' code and answers with
//! JSON `{"aux": ..., "main": ...}`, the edits it suggests to each function; each agent's next prompt
//! shows it its edit.
//!
//! The expert is advice, not part of the objective: a request that still fails after its retries
//! comes back as empty edits with the reason in [`ExpertEdits::failure`], so a flaky or slow endpoint
//! never costs a training step.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use serde_json::{Map, Value, json};
use tokio::runtime::Runtime;

use crate::config::ExternalConfig;

/// Requests in flight at once in [`ExpertClient::edits_batch`].
const MAX_IN_FLIGHT: usize = 8;
/// Attempts per request before giving up.
const MAX_ATTEMPTS: u32 = 3;
/// The first retry's wait; each later retry waits twice as long as the one before.
const BACKOFF_BASE: Duration = Duration::from_millis(500);
/// Not greedy: a reply that did not parse is retried, and a greedy expert would write it again.
const EXPERT_TEMPERATURE: f64 = 0.3;
/// How much of an error response's body a failure reason quotes.
const BODY_SNIPPET_CHARS: usize = 200;

/// One joint action to review: the problem and the code the agents wrote this turn.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ExpertRequest {
    /// The problem statement as the agents saw it.
    pub problem: String,
    /// The main function's name (the item's `entry_point`).
    pub entry_point: String,
    /// The helper function `aux` (two agents); `None` with one agent.
    pub aux: Option<String>,
    /// The main function.
    pub main: String,
}

/// The expert's suggested edits for one joint action.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ExpertEdits {
    /// The edit for the helper function (empty: none, or one agent).
    pub aux: String,
    /// The edit for the main function (empty: none).
    pub main: String,
    /// Why no usable edits came back (after retries), if so.
    pub failure: Option<ExpertFailure>,
    /// Requests sent for this joint action.
    pub attempts: u32,
}

/// Why an expert request gave no usable edits, after its retries.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertFailure {
    pub kind: FailureKind,
    pub reason: String,
}

/// What kind of failure: the three call for different answers from the trainer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// No answer: connection errors, timeouts, HTTP 429 and 5xx. The expert is down or overloaded.
    Unreachable,
    /// An HTTP 4xx other than 429: the request itself is wrong (model name, key, URL) and every
    /// other request will be refused the same way.
    Refused,
    /// Answers that do not hold edits (no JSON object, no content): the expert's writing.
    Unusable,
}

/// A blocking client for the expert, driving its requests on the learner's runtime.
pub struct ExpertClient {
    runtime: Arc<Runtime>,
    http: reqwest::Client,
    /// `{base_url}/chat/completions`.
    url: String,
    model: String,
    /// Sent as `Authorization: Bearer <key>` when present.
    api_key: Option<String>,
    max_tokens: u32,
    max_attempts: u32,
    backoff_base: Duration,
}

impl ExpertClient {
    /// The client `external` describes. The API key is read once, here, from the variable named by
    /// `external.expert_api_key_env`; an unset or empty variable sends no key.
    pub fn from_config(ext: &ExternalConfig, runtime: Arc<Runtime>) -> Result<Self, String> {
        let model = ext
            .expert_model
            .clone()
            .filter(|m| !m.trim().is_empty())
            .ok_or("external.expert_model is required for external.mode expert_edits")?;
        let base_url = ext
            .expert_base_url
            .as_deref()
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .ok_or("external.expert_base_url is required for external.mode expert_edits")?;
        let api_key = std::env::var(&ext.expert_api_key_env)
            .ok()
            .filter(|k| !k.is_empty());
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(ext.expert_timeout_secs))
            .build()
            .map_err(|e| {
                format!("external.expert_base_url `{base_url}`: cannot build the http client: {e}")
            })?;
        Ok(Self {
            runtime,
            http,
            url: format!("{}/chat/completions", base_url.trim_end_matches('/')),
            model,
            api_key,
            max_tokens: ext.expert_max_tokens,
            max_attempts: MAX_ATTEMPTS,
            backoff_base: BACKOFF_BASE,
        })
    }

    /// Waits `base`, `2 * base`, `4 * base`, ... between attempts (tests shorten it).
    pub fn with_backoff_base(mut self, base: Duration) -> Self {
        self.backoff_base = base;
        self
    }

    /// Asks for edits for every request, at most [`MAX_IN_FLIGHT`] at a time; one result per request,
    /// in order. Never fails as a whole: a request that fails carries its reason in `failure`.
    pub fn edits_batch(&self, requests: &[ExpertRequest]) -> Vec<ExpertEdits> {
        self.runtime.block_on(
            futures::stream::iter(requests)
                .map(|r| self.edits_one(r))
                .buffered(MAX_IN_FLIGHT)
                .collect(),
        )
    }

    /// One request with its retries; warns and returns empty edits when the last attempt fails.
    async fn edits_one(&self, req: &ExpertRequest) -> ExpertEdits {
        let body = json!({
            "model": self.model,
            "messages": expert_messages(req),
            "max_tokens": self.max_tokens,
            "temperature": EXPERT_TEMPERATURE,
        });
        let mut attempts = 0;
        let failure = loop {
            attempts += 1;
            match self.attempt(&body).await {
                Ok((aux, main)) => {
                    // One agent has no helper to edit, whatever the expert wrote for it.
                    let aux = if req.aux.is_some() {
                        aux
                    } else {
                        String::new()
                    };
                    return ExpertEdits {
                        aux,
                        main,
                        failure: None,
                        attempts,
                    };
                }
                Err(
                    failure @ ExpertFailure {
                        kind: FailureKind::Refused,
                        ..
                    },
                ) => break failure,
                Err(failure) if attempts >= self.max_attempts => break failure,
                Err(ExpertFailure { reason, .. }) => {
                    let delay = self.backoff_base * 2u32.saturating_pow(attempts - 1);
                    tracing::debug!(attempts, reason = %reason, delay_ms = delay.as_millis() as u64, "expert request failed, retrying");
                    tokio::time::sleep(delay).await;
                }
            }
        };
        tracing::warn!(attempts, url = %self.url, reason = %failure.reason, kind = ?failure.kind, "expert gave no usable edits, the agents see none this turn");
        ExpertEdits {
            aux: String::new(),
            main: String::new(),
            failure: Some(failure),
            attempts,
        }
    }

    /// The URL requests go to.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// One chat completion, parsed into `(aux, main)`.
    /// One chat completion, parsed into `(aux, main)`. Refusals are not retried; the rest are.
    async fn attempt(&self, body: &Value) -> Result<(String, String), ExpertFailure> {
        let fail = |kind, reason| ExpertFailure { kind, reason };
        let mut request = self.http.post(&self.url).json(body);
        if let Some(key) = &self.api_key {
            request = request.bearer_auth(key);
        }
        let response = request.send().await.map_err(|e| {
            let reason = format!("request to {} failed: {e}", self.url);
            fail(
                if e.is_builder() {
                    FailureKind::Refused
                } else {
                    FailureKind::Unreachable
                },
                reason,
            )
        })?;
        let status = response.status();
        let text = response.text().await.map_err(|e| {
            fail(
                FailureKind::Unreachable,
                format!("reading the reply failed: {e}"),
            )
        })?;
        if !status.is_success() {
            let reason = format!("http {status}: {}", snippet(&text));
            let transient =
                status == reqwest::StatusCode::TOO_MANY_REQUESTS || status.is_server_error();
            return Err(fail(
                if transient {
                    FailureKind::Unreachable
                } else {
                    FailureKind::Refused
                },
                reason,
            ));
        }
        let content = serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|v| {
                v.pointer("/choices/0/message/content")
                    .and_then(Value::as_str)
                    .map(str::to_string)
            })
            .ok_or_else(|| {
                fail(
                    FailureKind::Unusable,
                    format!(
                        "no choices[0].message.content in the reply: {}",
                        snippet(&text)
                    ),
                )
            })?;
        parse_edits(&content).map_err(|why| fail(FailureKind::Unusable, why))
    }
}

/// The first characters of `text`, for error messages.
fn snippet(text: &str) -> String {
    // The reply is model-written: control characters (an ESC starting a terminal escape sequence,
    // say) are shown escaped, so that a logged reply cannot drive the reader's terminal.
    let mut s = String::new();
    for c in text.chars().take(BODY_SNIPPET_CHARS) {
        if c.is_control() {
            s.extend(c.escape_default());
        } else {
            s.push(c);
        }
    }
    if text.chars().nth(BODY_SNIPPET_CHARS).is_some() {
        s.push_str("...");
    }
    s
}

/// Parses the expert's reply into `(aux, main)`: the first JSON object carrying `"aux"` or `"main"`,
/// bare, inside ```json fences or surrounded by prose. A missing or null field is an empty string, a
/// non-string value its JSON text; strings are trimmed. Raw newlines and tabs inside strings (a common
/// slip when a model writes code into JSON) are tolerated. Errs when no such object is found.
pub fn parse_edits(reply: &str) -> Result<(String, String), String> {
    let object = find_edits_object(reply)
        .or_else(|| find_edits_object(&escape_raw_controls(reply)))
        .ok_or_else(|| {
            format!(
                "no JSON object with \"aux\" or \"main\" in the expert's reply: {}",
                snippet(reply)
            )
        })?;
    Ok((field(&object, "aux"), field(&object, "main")))
}

/// The first object starting at some `{` of `text` that has an `aux` or `main` key; nested objects are
/// found too, so `{"edits": {"aux": ..}}` works.
fn find_edits_object(text: &str) -> Option<Map<String, Value>> {
    text.match_indices('{').find_map(|(i, _)| {
        // The stream stops after the first value, so whatever follows the object is ignored.
        match serde_json::Deserializer::from_str(&text[i..])
            .into_iter::<Value>()
            .next()
        {
            Some(Ok(Value::Object(map))) if map.contains_key("aux") || map.contains_key("main") => {
                Some(map)
            }
            _ => None,
        }
    })
}

/// `text` with raw newlines, carriage returns and tabs inside JSON strings escaped.
fn escape_raw_controls(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let (mut in_string, mut escaped) = (false, false);
    for c in text.chars() {
        match c {
            _ if escaped => {
                escaped = false;
                out.push(c);
            }
            '\\' if in_string => {
                escaped = true;
                out.push(c);
            }
            '"' => {
                in_string = !in_string;
                out.push(c);
            }
            '\n' if in_string => out.push_str("\\n"),
            '\r' if in_string => out.push_str("\\r"),
            '\t' if in_string => out.push_str("\\t"),
            _ => out.push(c),
        }
    }
    out
}

fn field(object: &Map<String, Value>, key: &str) -> String {
    match object.get(key) {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.trim().to_string(),
        Some(other) => other.to_string(),
    }
}

/// The expert's chat: a system message setting the reviewer's role and a user message with the problem,
/// the code, and the JSON shape to answer in (`aux` and `main` with two agents, `main` alone with one).
pub fn expert_messages(req: &ExpertRequest) -> Vec<serde_json::Value> {
    let system = "You are a senior Python developer reviewing code that junior developers wrote for a \
                  programming problem. You do not rewrite their solutions: you point out the smallest \
                  concrete changes that make the code correct, and you answer with one JSON object and \
                  nothing else.";
    let entry = &req.entry_point;
    let user = match &req.aux {
        Some(aux) => format!(
            "Problem:\n{problem}\n\n\
             The solution is split into two functions written by two developers: a helper function `aux` \
             and the main function `{entry}`, which may call `aux`.\n\n\
             Helper function `aux`:\n```python\n{aux}\n```\n\n\
             Main function `{entry}`:\n```python\n{main}\n```\n\n\
             For each function, list the minimal concrete edits it needs: which lines to change and the code \
             to put in their place. Write an empty string for a function that needs no change. Answer with \
             only this JSON object:\n\
             {{\"aux\": \"<edits for aux>\", \"main\": \"<edits for {entry}>\"}}",
            problem = req.problem.trim(),
            aux = shown_code(aux),
            main = shown_code(&req.main),
        ),
        None => format!(
            "Problem:\n{problem}\n\n\
             Function `{entry}`:\n```python\n{main}\n```\n\n\
             List the minimal concrete edits this function needs: which lines to change and the code to put \
             in their place. Write an empty string if it needs no change. Answer with only this JSON \
             object:\n\
             {{\"main\": \"<edits for {entry}>\"}}",
            problem = req.problem.trim(),
            main = shown_code(&req.main),
        ),
    };
    vec![
        json!({"role": "system", "content": system}),
        json!({"role": "user", "content": user}),
    ]
}

/// Code as shown to the expert; an agent that wrote nothing is said to have done so.
fn shown_code(code: &str) -> &str {
    let code = code.trim_matches('\n');
    if code.trim().is_empty() {
        "# (no code was written)"
    } else {
        code
    }
}

#[cfg(test)]
mod tests;
