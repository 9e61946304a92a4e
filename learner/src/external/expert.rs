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
mod tests {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use axum::Router;
    use axum::extract::State;
    use axum::http::{HeaderMap, StatusCode};
    use axum::routing::post;

    use super::*;

    /// A model-written reply that fails to parse is named in the error (and the log) with its
    /// control characters escaped: no raw ESC reaches a terminal or a piped log.
    #[test]
    fn a_reply_in_an_error_has_its_control_characters_escaped() {
        let e = parse_edits("\u{1b}[31mred\u{7}\nno json").unwrap_err();
        assert!(!e.chars().any(|c| c.is_control()), "{e:?}");
        assert!(e.contains("\\u{1b}[31mred\\u{7}\\nno json"), "{e}");
        let long = "x".repeat(BODY_SNIPPET_CHARS + 1);
        assert!(snippet(&long).ends_with("..."));
        assert!(!snippet(&long[1..]).ends_with("..."));
    }

    #[test]
    fn parse_edits_reads_fenced_json() {
        let reply = "```json\n{\"aux\": \"return x + 1\", \"main\": \"call aux(n) once\"}\n```";
        assert_eq!(
            parse_edits(reply),
            Ok(("return x + 1".to_string(), "call aux(n) once".to_string()))
        );
    }

    #[test]
    fn parse_edits_skips_prose_around_the_object() {
        let reply = "Here are my edits {as requested}:\n{\"aux\": \"\", \"main\": \"use >= not >\"}\nHope this helps.";
        assert_eq!(
            parse_edits(reply),
            Ok((String::new(), "use >= not >".to_string()))
        );
    }

    #[test]
    fn parse_edits_tolerates_a_missing_field_and_non_strings() {
        assert_eq!(
            parse_edits("{\"main\": \"fix the loop\"}"),
            Ok((String::new(), "fix the loop".to_string()))
        );
        assert_eq!(
            parse_edits("{\"aux\": [\"a\", 1], \"main\": null}"),
            Ok(("[\"a\",1]".to_string(), String::new()))
        );
    }

    #[test]
    fn parse_edits_tolerates_raw_newlines_in_strings() {
        let reply = "{\"aux\": \"def aux(x):\n\treturn x\", \"main\": \"\"}";
        assert_eq!(
            parse_edits(reply),
            Ok(("def aux(x):\n\treturn x".to_string(), String::new()))
        );
    }

    #[test]
    fn parse_edits_rejects_garbage() {
        assert!(parse_edits("I think the code is fine.").is_err());
        assert!(parse_edits("{\"aux\": \"unterminated").is_err());
        assert!(parse_edits("{\"verdict\": \"ok\"}").is_err());
    }

    #[test]
    fn expert_messages_show_the_agents_code() {
        let two = ExpertRequest {
            problem: "Sum a list.".into(),
            entry_point: "total".into(),
            aux: Some("def aux(x):\n    return x".into()),
            main: "def total(xs):\n    return sum(xs)".into(),
        };
        let m = expert_messages(&two);
        assert_eq!(
            (m.len(), m[0]["role"].as_str(), m[1]["role"].as_str()),
            (2, Some("system"), Some("user"))
        );
        let user = m[1]["content"].as_str().unwrap();
        assert!(
            user.contains("Sum a list.")
                && user.contains("def aux(x)")
                && user.contains("def total(xs)")
        );
        assert!(user.contains("\"aux\"") && user.contains("\"main\""));

        let one = ExpertRequest { aux: None, ..two };
        let user = expert_messages(&one)[1]["content"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(
            user.contains("def total(xs)")
                && user.contains("\"main\"")
                && !user.contains("\"aux\"")
        );
    }

    #[test]
    fn from_config_names_the_missing_key() {
        let rt = runtime();
        let mut ext = ExternalConfig {
            expert_base_url: Some("http://127.0.0.1:1/v1".into()),
            ..Default::default()
        };
        let err = ExpertClient::from_config(&ext, rt.clone()).err().unwrap();
        assert!(err.contains("external.expert_model"), "{err}");
        ext.expert_model = Some("m".into());
        ext.expert_base_url = None;
        let err = ExpertClient::from_config(&ext, rt.clone()).err().unwrap();
        assert!(err.contains("external.expert_base_url"), "{err}");
        ext.expert_base_url = Some("http://127.0.0.1:1/v1/".into());
        assert_eq!(
            ExpertClient::from_config(&ext, rt).unwrap().url,
            "http://127.0.0.1:1/v1/chat/completions"
        );
    }

    /// What the fake expert answers, attempt by attempt (the last one repeats), and what it saw.
    struct Script {
        replies: Vec<(StatusCode, String)>,
        calls: AtomicUsize,
        authorization: Mutex<Option<String>>,
    }

    fn chat_reply(content: &str) -> String {
        json!({"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]})
            .to_string()
    }

    fn runtime() -> Arc<Runtime> {
        Arc::new(
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap(),
        )
    }

    /// Serves `script` on a loopback port; returns the base URL (`http://127.0.0.1:port/v1`).
    fn serve(rt: &Runtime, script: Arc<Script>) -> String {
        async fn chat(State(s): State<Arc<Script>>, headers: HeaderMap) -> (StatusCode, String) {
            let n = s.calls.fetch_add(1, Ordering::SeqCst);
            let auth = headers
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            *s.authorization.lock().unwrap() = auth;
            s.replies[n.min(s.replies.len() - 1)].clone()
        }
        let app = Router::new()
            .route("/v1/chat/completions", post(chat))
            .with_state(script);
        let listener = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let addr = listener.local_addr().unwrap();
        rt.spawn(async move { axum::serve(listener, app).await });
        format!("http://{addr}/v1")
    }

    fn client(rt: &Arc<Runtime>, base_url: String, key_env: &str) -> ExpertClient {
        let ext = ExternalConfig {
            expert_model: Some("expert".into()),
            expert_base_url: Some(base_url),
            expert_api_key_env: key_env.into(),
            expert_timeout_secs: 10,
            ..Default::default()
        };
        ExpertClient::from_config(&ext, rt.clone())
            .unwrap()
            .with_backoff_base(Duration::from_millis(10))
    }

    fn request(aux: Option<&str>) -> ExpertRequest {
        ExpertRequest {
            problem: "Return the double of n.".into(),
            entry_point: "double".into(),
            aux: aux.map(str::to_string),
            main: "def double(n):\n    return n".into(),
        }
    }

    fn script(replies: Vec<(StatusCode, String)>) -> Arc<Script> {
        Arc::new(Script {
            replies,
            calls: AtomicUsize::new(0),
            authorization: Mutex::new(None),
        })
    }

    #[test]
    fn retries_server_errors_and_malformed_replies_until_edits_arrive() {
        let rt = runtime();
        let s = script(vec![
            (StatusCode::INTERNAL_SERVER_ERROR, "overloaded".into()),
            (
                StatusCode::OK,
                chat_reply("the aux is fine but {main is wrong"),
            ),
            (
                StatusCode::OK,
                chat_reply("```json\n{\"aux\": \"\", \"main\": \"return 2 * n\"}\n```"),
            ),
        ]);
        let url = serve(&rt, s.clone());
        let edits = client(&rt, url, "COTRAIN_TEST_EXPERT_KEY_UNSET")
            .edits_batch(&[request(Some("def aux(n):\n    return n"))]);
        let want = ExpertEdits {
            aux: String::new(),
            main: "return 2 * n".into(),
            failure: None,
            attempts: 3,
        };
        assert_eq!(edits, vec![want]);
        assert_eq!(*s.authorization.lock().unwrap(), None);
    }

    #[test]
    fn a_request_that_keeps_failing_yields_empty_edits_and_the_reason() {
        let rt = runtime();
        let s = script(vec![(StatusCode::SERVICE_UNAVAILABLE, "down".into())]);
        let url = serve(&rt, s.clone());
        let edits = client(&rt, url, "COTRAIN_TEST_EXPERT_KEY_UNSET")
            .edits_batch(&[request(None), request(None)]);
        assert_eq!(edits.len(), 2);
        for e in &edits {
            assert_eq!((e.aux.as_str(), e.main.as_str(), e.attempts), ("", "", 3));
            let f = e.failure.as_ref().unwrap();
            assert!(
                f.reason.contains("503") && f.kind == FailureKind::Unreachable,
                "{f:?}"
            );
        }
        assert_eq!(s.calls.load(Ordering::SeqCst), 6);
    }

    #[test]
    fn replies_without_edits_are_unusable_not_unreachable() {
        let rt = runtime();
        let s = script(vec![(StatusCode::OK, chat_reply("I would rather not."))]);
        let url = serve(&rt, s.clone());
        let edits = client(&rt, url, "COTRAIN_TEST_EXPERT_KEY_UNSET").edits_batch(&[request(None)]);
        assert_eq!(edits[0].attempts, 3);
        assert_eq!(
            edits[0].failure.as_ref().map(|f| f.kind),
            Some(FailureKind::Unusable)
        );
    }

    #[test]
    fn a_client_error_is_not_retried() {
        let rt = runtime();
        let s = script(vec![(StatusCode::BAD_REQUEST, "no such model".into())]);
        let url = serve(&rt, s.clone());
        let edits = client(&rt, url, "COTRAIN_TEST_EXPERT_KEY_UNSET").edits_batch(&[request(None)]);
        assert_eq!(edits[0].attempts, 1);
        let f = edits[0].failure.as_ref().unwrap();
        assert!(
            f.reason.contains("no such model") && f.kind == FailureKind::Refused,
            "{f:?}"
        );
        assert_eq!(s.calls.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn an_unreachable_expert_is_retried_then_given_up() {
        let rt = runtime();
        // A port that was just free: connecting to it is refused.
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let edits = client(
            &rt,
            format!("http://{addr}/v1"),
            "COTRAIN_TEST_EXPERT_KEY_UNSET",
        )
        .edits_batch(&[request(None)]);
        assert_eq!(edits[0].attempts, 3);
        assert_eq!(
            edits[0].failure.as_ref().map(|f| f.kind),
            Some(FailureKind::Unreachable)
        );
    }

    #[test]
    fn edits_come_back_in_request_order() {
        let rt = runtime();
        let s = script(vec![(
            StatusCode::OK,
            chat_reply("{\"aux\": \"aux edit\", \"main\": \"main edit\"}"),
        )]);
        let url = serve(&rt, s.clone());
        let requests: Vec<_> = (0..20)
            .map(|i| {
                if i % 2 == 0 {
                    request(Some("def aux(): pass"))
                } else {
                    request(None)
                }
            })
            .collect();
        let edits = client(&rt, url, "COTRAIN_TEST_EXPERT_KEY_UNSET").edits_batch(&requests);
        for (i, e) in edits.iter().enumerate() {
            // One agent has no helper, so its aux edit is dropped.
            let aux = if i % 2 == 0 { "aux edit" } else { "" };
            assert_eq!(
                (e.aux.as_str(), e.main.as_str(), e.attempts, &e.failure),
                (aux, "main edit", 1, &None)
            );
        }
    }

    #[test]
    fn the_api_key_is_sent_as_a_bearer_token() {
        const KEY_ENV: &str = "COTRAIN_TEST_EXPERT_API_KEY_7f3a";
        // SAFETY: the variable's name is unique to this test, and no other code reads or writes it.
        unsafe { std::env::set_var(KEY_ENV, "sk-test") };
        let rt = runtime();
        let s = script(vec![(StatusCode::OK, chat_reply("{\"main\": \"ok\"}"))]);
        let url = serve(&rt, s.clone());
        let edits = client(&rt, url, KEY_ENV).edits_batch(&[request(None)]);
        assert_eq!(edits[0].main, "ok");
        assert_eq!(
            s.authorization.lock().unwrap().as_deref(),
            Some("Bearer sk-test")
        );
    }
}
