//! The real `reward-server` binary on ephemeral loopback ports, spoken to over gRPC (generated
//! client) and HTTP (reqwest), including the OpenRLHF and SandboxFusion request shapes.

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use cotrain_proto::reward::reward_client::RewardClient;
use cotrain_proto::reward::{ExecuteRequest, InfoRequest, JointAction, ScoreRequest};
use serde_json::{Value, json};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_reflection::pb::v1::ServerReflectionRequest;
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

const SECRET_VAR: &str = "COTRAIN_SERVER_SECRET";
const SECRET_VALUE: &str = "s3cr3t-api-key-in-server-env";

struct Server {
    child: Child,
    grpc: SocketAddr,
    http: SocketAddr,
    stderr_path: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Server {
    /// Starts the binary, reads the bound addresses from its stdout and waits for gRPC health.
    async fn start(extra: &[&str]) -> Server {
        let dir = tempfile::tempdir().unwrap();
        let stderr_path = dir.path().join("stderr.log");
        let mut child = Command::new(env!("CARGO_BIN_EXE_reward-server"))
            .args(["--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"])
            .args(extra)
            .env(SECRET_VAR, SECRET_VALUE)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr_path).unwrap())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let line = tokio::task::spawn_blocking(move || {
            let mut line = String::new();
            BufReader::new(stdout).read_line(&mut line).unwrap();
            line
        })
        .await
        .unwrap();
        let addr = |key: &str| -> SocketAddr {
            let part = line
                .split_whitespace()
                .find_map(|w| w.strip_prefix(key))
                .unwrap_or_else(|| {
                    panic!(
                        "no {key} in {line:?}: {}",
                        std::fs::read_to_string(&stderr_path).unwrap()
                    )
                });
            part.parse().unwrap()
        };
        let server = Server {
            grpc: addr("grpc="),
            http: addr("http="),
            child,
            stderr_path,
            _dir: dir,
        };
        let mut health = HealthClient::new(server.channel().await);
        let status = health
            .check(tonic_health::pb::HealthCheckRequest {
                service: "cotrain.reward.v1.Reward".into(),
            })
            .await
            .unwrap()
            .into_inner()
            .status;
        assert_eq!(status, ServingStatus::Serving as i32);
        server
    }

    async fn channel(&self) -> tonic::transport::Channel {
        tonic::transport::Endpoint::from_shared(format!("http://{}", self.grpc))
            .unwrap()
            .connect()
            .await
            .unwrap()
    }

    async fn grpc(&self) -> RewardClient<tonic::transport::Channel> {
        RewardClient::new(self.channel().await)
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.http)
    }

    /// SIGTERM, then the process must exit by itself, successfully.
    fn shutdown(mut self) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(
                    status.success(),
                    "exit {status}: {}",
                    std::fs::read_to_string(&self.stderr_path).unwrap()
                );
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "server did not stop after SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A HumanEval-schema row.
fn add_item() -> Value {
    json!({
        "task_id": "Test/0",
        "prompt": "def add_two(a: int, b: int) -> int:\n    \"\"\"Return a + b.\n    >>> add_two(1, 2)\n    3\n    \"\"\"\n",
        "entry_point": "add_two",
        "canonical_solution": "    return a + b\n",
        "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0\n    assert candidate(10, 5) == 15\n",
    })
}

const GOOD_MAIN: &str = "def add_two(a: int, b: int) -> int:\n    return a + b\n";
const BAD_MAIN: &str = "def add_two(a: int, b: int) -> int:\n    return a - b\n";

async fn post(client: &reqwest::Client, url: String, body: Value) -> (u16, Value) {
    let resp = client.post(url).json(&body).send().await.unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn grpc_score_analyze_execute_and_info() {
    let server = Server::start(&[]).await;
    let mut client = server.grpc().await;

    // Verify without --verifier-endpoint: UNAVAILABLE, saying how to configure one.
    let conv = cotrain_proto::reward::VerifyConversation {
        user: "1+1?".into(),
        assistant: "2".into(),
    };
    let err = client
        .verify(cotrain_proto::reward::VerifyRequest {
            verifier: String::new(),
            conversations: vec![conv],
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
    assert!(err.message().contains("--verifier-endpoint"), "{err:?}");

    // Reflection lists the service.
    let mut reflection = ServerReflectionClient::new(server.channel().await);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut replies = reflection
        .server_reflection_info(tokio_stream::iter([request]))
        .await
        .unwrap()
        .into_inner();
    let reply = replies.message().await.unwrap().unwrap();
    match reply.message_response {
        Some(MessageResponse::ListServicesResponse(list)) => {
            assert!(
                list.service
                    .iter()
                    .any(|s| s.name == "cotrain.reward.v1.Reward"),
                "{list:?}"
            );
        }
        other => panic!("{other:?}"),
    }

    let info = client.info(InfoRequest {}).await.unwrap().into_inner();
    assert!(info.sandboxed);
    assert!(info.tasks.contains(&"code".to_string()));

    let item = add_item().to_string();
    let resp = client
        .score(ScoreRequest {
            task: "humaneval".into(),
            actions: vec![
                JointAction {
                    completions: vec![GOOD_MAIN.into()],
                    item_json: item.clone(),
                },
                JointAction {
                    completions: vec![BAD_MAIN.into()],
                    item_json: item.clone(),
                },
            ],
            options_json: String::new(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resp.results.len(), 2);
    // Single agent maximum 2.1; the wrong one passes 1 of 3 tests (only -1+1 == -1-1? no: 0 vs -2).
    assert!(
        (resp.results[0].reward - 2.1).abs() < 1e-9,
        "{:?}",
        resp.results[0]
    );
    assert!(resp.results[1].reward < 2.1);
    assert!(resp.results[0].levels.contains_key("level_1"));
    let details: Value = serde_json::from_str(&resp.results[0].details_json).unwrap();
    assert_eq!(details["passed_tests"], 3);

    let analysis = client
        .analyze(cotrain_proto::reward::AnalyzeRequest {
            task: "code".into(),
            actions: vec![JointAction {
                completions: vec![BAD_MAIN.into()],
                item_json: item.clone(),
            }],
            options_json: r#"{"feedback_mode": "level_feedback"}"#.into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let a: Value = serde_json::from_str(&analysis.results[0].analysis_json).unwrap();
    assert!(a["diagnostics"].is_object(), "{a}");
    assert!(a["feedback"][0].as_str().unwrap().contains("passed"), "{a}");

    let out = client
        .execute(ExecuteRequest {
            code: "print(input() * 2)".into(),
            stdin: "ab\n".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (out.status.as_str(), out.exit_code, out.stdout.as_str()),
        ("finished", Some(0), "abab\n")
    );
    assert!(out.sandboxed);

    // Errors name the field and carry the right code.
    let err = client
        .score(ScoreRequest {
            task: "poetry".into(),
            actions: vec![],
            options_json: String::new(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("task"), "{}", err.message());
    let err = client
        .score(ScoreRequest {
            task: "code".into(),
            actions: vec![JointAction {
                completions: vec![GOOD_MAIN.into()],
                item_json: r#"{"prompt": "x"}"#.into(),
            }],
            options_json: String::new(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(
        err.message().contains("actions[0].item."),
        "{}",
        err.message()
    );
    let err = client
        .score(ScoreRequest {
            task: "code".into(),
            actions: vec![JointAction {
                completions: vec![],
                item_json: "{not json".into(),
            }],
            options_json: String::new(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert!(
        err.message().contains("actions[0].item_json"),
        "{}",
        err.message()
    );
    server.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn http_native_routes_metrics_and_health() {
    let server = Server::start(&[]).await;
    let http = reqwest::Client::new();

    let (status, body) = post(
        &http,
        server.url("/v1/score"),
        json!({"task": "code", "items": [
            {"completions": [GOOD_MAIN], "item": add_item()},
            {"completions": ["def aux(x):\n    return x\n", "def add_two(a, b):\n    return aux(a) + b\n"], "item": add_item()},
        ]}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert!(
        (body["results"][0]["reward"].as_f64().unwrap() - 2.1).abs() < 1e-9,
        "{body}"
    );
    assert!(
        body["results"][1]["reward"].as_f64().unwrap() > 2.1,
        "{body}"
    );
    assert!(body["results"][1]["levels"].is_object());

    let (status, body) = post(
        &http,
        server.url("/v1/score"),
        json!({"task": "gsm8k", "items": [{"completions": ["so \\boxed{42}"], "item": {"question": "q", "answer": "... #### 42"}}]}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["results"][0]["reward"], 1.0);

    let (status, body) = post(
        &http,
        server.url("/v1/execute"),
        json!({"code": "import sys\nprint('hi')\nsys.exit(3)"}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(body["status"], "finished");
    assert_eq!(body["exit_code"], 3);
    assert_eq!(body["stdout"], "hi\n");

    // MaPoRL's /predict: a malformed conversation is a 400 naming it; a good one without a
    // verifier endpoint is a 503 saying how to configure one (both in MaPoRL's error shape).
    let (status, body) = post(
        &http,
        server.url("/predict"),
        json!({"query_responses": [["q", "a"]]}),
    )
    .await;
    assert_eq!(status, 400);
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("query_responses[0][0].role"),
        "{body}"
    );
    let conv = json!([{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "\\boxed{2}"}]);
    let (status, body) = post(
        &http,
        server.url("/predict"),
        json!({"query_responses": [conv]}),
    )
    .await;
    assert_eq!(status, 503);
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("--verifier-endpoint"),
        "{body}"
    );

    let health: Value = http
        .get(server.url("/health"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(health["status"], "serving");
    let metrics = http
        .get(server.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for name in [
        "cotrain_reward_requests_total{endpoint=\"http.score\",outcome=\"ok\"} 2",
        "cotrain_reward_request_duration_seconds_bucket",
        "cotrain_reward_sandbox_runs_total{kind=\"exec\",outcome=\"finished\"} 1",
        "cotrain_reward_sandbox_runs_total{kind=\"tests\"",
        "cotrain_reward_sandbox_queue_depth 0",
    ] {
        assert!(metrics.contains(name), "missing {name} in\n{metrics}");
    }
    server.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn openrlhf_get_reward_exactly_as_openrlhf_sends_it() {
    let server = Server::start(&[]).await;
    let http = reqwest::Client::new();
    let prompt = "<|im_start|>user\nImplement add_two.<|im_end|>\n<|im_start|>assistant\n";
    // OpenRLHF's remote_rm_fn posts {"query": [...], "prompts": [...], "labels": [...]}, with
    // queries being prompt + response and labels the dataset's label column (strings).
    let label = |item: Value| json!({"task": "humaneval", "item": item}).to_string();
    let two_agent_label = json!({
        "task": "code", "item": add_item(),
        "other_completions": ["def aux(x):\n    return x\n"], "agent_index": 1
    })
    .to_string();
    let body = json!({
        "query": [
            format!("{prompt}{GOOD_MAIN}"),
            format!("{prompt}{BAD_MAIN}"),
            format!("{prompt}def add_two(a, b):\n    return aux(a) + b\n"),
        ],
        "prompts": [prompt, prompt, prompt],
        "labels": [label(add_item()), label(add_item()), two_agent_label],
    });
    let (status, resp) = post(&http, server.url("/get_reward"), body).await;
    assert_eq!(status, 200, "{resp}");
    let rewards: Vec<f64> = serde_json::from_value(resp["rewards"].clone()).unwrap();
    assert_eq!(rewards.len(), 3);
    assert!((rewards[0] - 2.1).abs() < 1e-9, "{resp}");
    assert!(rewards[1] < rewards[0]);
    assert!(rewards[2] > 2.1, "{resp}");
    assert_eq!(resp["scores"], resp["rewards"]);
    let level_1: Vec<f64> = serde_json::from_value(resp["extra_logs"]["level_1"].clone()).unwrap();
    assert_eq!(level_1.len(), 3);

    // A label that is not ours names the label.
    let (status, resp) = post(
        &http,
        server.url("/get_reward"),
        json!({"query": ["x"], "prompts": [""], "labels": ["just a reference answer"]}),
    )
    .await;
    assert_eq!(status, 400);
    assert_eq!(resp["error"]["field"], "labels[0]");
    server.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sandbox_fusion_run_code_shape() {
    let server = Server::start(&[]).await;
    let http = reqwest::Client::new();
    // The request SandboxFusion's client sends.
    let req = |code: &str, timeout: f64| {
        json!({"code": code, "language": "python", "compile_timeout": 10, "run_timeout": timeout,
               "memory_limit_MB": -1, "stdin": "", "files": {}, "fetch_files": []})
    };
    let (status, body) = post(&http, server.url("/run_code"), req("print('hello')", 5.0)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["status"], "Success");
    assert_eq!(body["run_result"]["status"], "Finished");
    assert_eq!(body["run_result"]["stdout"], "hello\n");
    assert_eq!(body["run_result"]["return_code"], 0);
    assert!(body["run_result"]["execution_time"].as_f64().unwrap() > 0.0);
    assert!(body["compile_result"].is_null());

    let (_, body) = post(
        &http,
        server.url("/run_code"),
        req("raise SystemExit(2)", 5.0),
    )
    .await;
    assert_eq!(body["status"], "Failed");
    assert_eq!(body["run_result"]["return_code"], 2);

    let (_, body) = post(
        &http,
        server.url("/run_code"),
        req("import time\ntime.sleep(30)", 1.0),
    )
    .await;
    assert_eq!(body["status"], "Failed");
    assert_eq!(body["run_result"]["status"], "TimeLimitExceeded");

    let (status, body) = post(
        &http,
        server.url("/run_code"),
        json!({"code": "puts 1", "language": "ruby"}),
    )
    .await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["field"], "language");
    server.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sandboxed_code_cannot_reach_the_server_or_its_secrets() {
    let server = Server::start(&[]).await;
    let http = reqwest::Client::new();
    let code = format!(
        r#"
import os, socket
print("secret", os.environ.get("{SECRET_VAR}"))
for port in [{grpc}, {http}]:
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=2)
        s.sendall(b"POST /v1/execute HTTP/1.1\r\nHost: x\r\n\r\n")
        print("connected", port)
    except OSError as e:
        print("blocked", port, type(e).__name__)
"#,
        grpc = server.grpc.port(),
        http = server.http.port()
    );
    let (status, body) = post(&http, server.url("/v1/execute"), json!({"code": code})).await;
    assert_eq!(status, 200, "{body}");
    let out = body["stdout"].as_str().unwrap();
    assert!(out.contains("secret None"), "{out}");
    assert!(!out.contains(SECRET_VALUE));
    assert!(!out.contains("connected"), "{out}");
    assert_eq!(out.matches("blocked").count(), 2, "{out}");
    server.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn overload_gets_429_and_resource_exhausted() {
    let server = Server::start(&["--max-concurrency", "1", "--queue-limit", "0"]).await;
    let http = reqwest::Client::new();
    let slow = {
        let (http, url) = (http.clone(), server.url("/v1/execute"));
        tokio::spawn(async move {
            post(
                &http,
                url,
                json!({"code": "import time\ntime.sleep(30)", "timeout_secs": 3}),
            )
            .await
        })
    };
    // Wait until the slow run holds the only slot.
    loop {
        let h: Value = http
            .get(server.url("/health"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if h["in_flight"] == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let resp = http
        .post(server.url("/v1/execute"))
        .json(&json!({"code": "print(1)"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 429);
    assert!(resp.headers().contains_key("retry-after"));
    let err = server
        .grpc()
        .await
        .execute(ExecuteRequest {
            code: "print(1)".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted);
    let (status, body) = slow.await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(body["status"], "timed_out");
    // Served again once the slot is free.
    let (status, body) = post(
        &http,
        server.url("/v1/execute"),
        json!({"code": "print(1)"}),
    )
    .await;
    assert_eq!((status, body["stdout"].as_str()), (200, Some("1\n")));
    server.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_requests_get_400_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("reward.yaml");
    std::fs::File::create(&cfg)
        .unwrap()
        .write_all(b"max_body_bytes: 4096\n")
        .unwrap();
    let server = Server::start(&["--config", cfg.to_str().unwrap()]).await;
    let http = reqwest::Client::new();
    let cases = [
        (json!({"items": []}), "task"),
        (json!({"task": "poetry", "items": []}), "task"),
        (
            json!({"task": "code", "items": [{"completions": [GOOD_MAIN]}]}),
            "item",
        ),
        (
            json!({"task": "code", "items": [{"completions": [GOOD_MAIN], "item": {"prompt": "p", "entry_point": "f"}}]}),
            "items[0].item.test",
        ),
        (json!({"task": "code", "items": [], "extra": 1}), "extra"),
        (
            json!({"task": "code", "items": [{"completions": [GOOD_MAIN], "item": add_item()}], "options": {"max_timeouts": 0}}),
            "options.max_timeouts",
        ),
        (
            json!({"task": "code", "items": [], "options": {"max_timeoutz": 1}}),
            "options",
        ),
        (
            json!({"task": "code", "items": [{"completions": "not a list", "item": {}}]}),
            "items[0].completions",
        ),
    ];
    for (body, field) in cases {
        let (status, resp) = post(&http, server.url("/v1/score"), body.clone()).await;
        assert_eq!(status, 400, "{body} -> {resp}");
        assert_eq!(resp["error"]["field"], field, "{body} -> {resp}");
    }
    // Not JSON at all.
    let resp = http
        .post(server.url("/v1/execute"))
        .header("content-type", "application/json")
        .body("{nope")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 400);
    // Oversized.
    let (status, resp) = post(
        &http,
        server.url("/v1/execute"),
        json!({"code": "#".repeat(10_000)}),
    )
    .await;
    assert_eq!(status, 400, "{resp}");
    assert_eq!(resp["error"]["field"], "body");
    let (status, resp) = post(
        &http,
        server.url("/v1/execute"),
        json!({"code": "1", "timeout_secs": -1}),
    )
    .await;
    assert_eq!(
        (status, resp["error"]["field"].as_str()),
        (400, Some("timeout_secs"))
    );
    // The server is still fine.
    let (status, _) = post(
        &http,
        server.url("/v1/execute"),
        json!({"code": "print(1)"}),
    )
    .await;
    assert_eq!(status, 200);
    server.shutdown();
}

#[test]
fn the_binary_refuses_to_start_without_working_isolation() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("reward.yaml");
    std::fs::write(&cfg, "sandbox:\n  bwrap: /nonexistent/bwrap\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_reward-server"))
        .args([
            "--grpc-addr",
            "127.0.0.1:0",
            "--http-addr",
            "127.0.0.1:0",
            "--config",
            cfg.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("sandbox isolation does not work"),
        "{stderr}"
    );
    assert!(out.stdout.is_empty(), "it must not report listening");

    std::fs::write(&cfg, "sandbox:\n  limitz: {}\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_reward-server"))
        .args(["--config", cfg.to_str().unwrap()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("limitz") && stderr.contains("reward.yaml"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_lets_in_flight_requests_finish() {
    let server = Server::start(&[]).await;
    let http = reqwest::Client::new();
    let in_flight = {
        let (http, url) = (http.clone(), server.url("/v1/execute"));
        tokio::spawn(async move {
            post(
                &http,
                url,
                json!({"code": "import time\ntime.sleep(1)\nprint('done')"}),
            )
            .await
        })
    };
    loop {
        let h: Value = http
            .get(server.url("/health"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if h["in_flight"] == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let stopper = tokio::task::spawn_blocking(move || server.shutdown());
    let (status, body) = in_flight.await.unwrap();
    assert_eq!(
        (status, body["stdout"].as_str()),
        (200, Some("done\n")),
        "{body}"
    );
    stopper.await.unwrap();
}
