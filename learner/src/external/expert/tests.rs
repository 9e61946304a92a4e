//! The expert client against scripted OpenAI-compatible servers, and the reply parsing.
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
        user.contains("def total(xs)") && user.contains("\"main\"") && !user.contains("\"aux\"")
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
