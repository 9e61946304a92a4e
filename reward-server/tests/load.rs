//! Load test (bounded, loopback only) and the throughput benchmark, against the real binary.
//!
//! The benchmark is `#[ignore]`d (it takes about a minute); run it with
//! `cargo test -p cotrain-reward-server --test load -- --ignored --nocapture`. It scores every
//! HumanEval canonical solution through the server (single-agent path, one sandboxed interpreter
//! per completion) and does the same tests the naive way (one unsandboxed `python3` process per
//! test), with the same parallelism, and prints completions per second and p50/p99 latency.

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

struct Server {
    child: Child,
    http: SocketAddr,
}

impl Server {
    async fn start(extra: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_reward-server"))
            .args(["--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"])
            .args(extra)
            .env("RUST_LOG", "error")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
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
        let http: SocketAddr = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("http="))
            .unwrap_or_else(|| panic!("no address in {line:?}"))
            .parse()
            .unwrap();
        let server = Server { child, http };
        let client = reqwest::Client::new();
        // Health check, not a sleep: the line above is printed once the listeners are bound.
        let h = client.get(server.url("/health")).send().await.unwrap();
        assert!(h.status().is_success());
        server
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.http)
    }

    fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
            .unwrap()
    }

    fn shutdown(mut self) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let status = self.child.wait().unwrap();
        assert!(status.success(), "{status}");
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn many_concurrent_clients_each_get_a_result_or_a_clear_overload() {
    let server = Server::start(&["--max-concurrency", "2", "--queue-limit", "4"]).await;
    let client = reqwest::Client::new();
    let rss_before = server.rss_kib();
    let clients = 64;
    let started = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|i| {
            let (client, url) = (client.clone(), server.url("/v1/execute"));
            tokio::spawn(async move {
                let resp = client
                    .post(url)
                    .json(
                        &json!({"code": format!("import time\ntime.sleep(0.05)\nprint({i} * 2)")}),
                    )
                    .send()
                    .await
                    .unwrap();
                let status = resp.status().as_u16();
                let body: Value = resp.json().await.unwrap();
                (i, status, body)
            })
        })
        .collect();
    let (mut ok, mut overloaded) = (0, 0);
    for t in tasks {
        let (i, status, body) = t.await.unwrap();
        match status {
            200 => {
                assert_eq!(body["stdout"], format!("{}\n", i * 2), "{body}");
                ok += 1;
            }
            429 => {
                assert_eq!(body["error"]["code"], "overloaded", "{body}");
                overloaded += 1;
            }
            other => panic!("request {i}: unexpected {other}: {body}"),
        }
    }
    assert_eq!(ok + overloaded, clients, "a request was lost");
    assert!(ok >= 6, "at least the running + queued ones succeed ({ok})");
    assert!(started.elapsed() < Duration::from_secs(60));
    let rss_after = server.rss_kib();
    assert!(
        rss_after < rss_before + 100 * 1024,
        "server RSS grew from {rss_before} to {rss_after} KiB"
    );
    let metrics = client
        .get(server.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(metrics.contains(&format!(
        "cotrain_reward_requests_total{{endpoint=\"http.execute\",outcome=\"ok\"}} {ok}"
    )));
    server.shutdown();
}

fn humaneval() -> Vec<Value> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../shared/data/humaneval/HumanEval.jsonl.gz"
    );
    let mut text = String::new();
    flate2::read::GzDecoder::new(std::fs::File::open(path).expect("shared HumanEval data"))
        .read_to_string(&mut text)
        .unwrap();
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "benchmark: run with --ignored --nocapture"]
async fn benchmark_sandboxed_scoring_against_naive_processes() {
    let problems = humaneval();
    let parallelism = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2);
    let par = parallelism.to_string();
    let server = Server::start(&["--max-concurrency", &par, "--queue-limit", "1024"]).await;
    let client = reqwest::Client::new();

    // Through the server: one request per completion, `parallelism` clients at once.
    let gate = Arc::new(tokio::sync::Semaphore::new(parallelism));
    let started = Instant::now();
    let tasks: Vec<_> = problems
        .iter()
        .map(|p| {
            let completion = format!(
                "{}{}",
                p["prompt"].as_str().unwrap(),
                p["canonical_solution"].as_str().unwrap()
            );
            let body =
                json!({"task": "humaneval", "items": [{"completions": [completion], "item": p}]});
            let (client, url, gate) = (client.clone(), server.url("/v1/score"), gate.clone());
            tokio::spawn(async move {
                let _permit = gate.acquire_owned().await.unwrap();
                let t = Instant::now();
                let resp: Value = client
                    .post(url)
                    .json(&body)
                    .send()
                    .await
                    .unwrap()
                    .json()
                    .await
                    .unwrap();
                (
                    t.elapsed(),
                    resp["results"][0]["reward"].as_f64().unwrap_or(-1.0),
                )
            })
        })
        .collect();
    let mut latencies = Vec::new();
    let mut full_marks = 0;
    for t in tasks {
        let (lat, reward) = t.await.unwrap();
        latencies.push(lat);
        if (reward - 2.1).abs() < 1e-9 {
            full_marks += 1;
        }
    }
    let server_secs = started.elapsed().as_secs_f64();
    latencies.sort();

    // The naive way: one unsandboxed python3 process per test, same parallelism, the same
    // interpreter the sandbox uses (not a pyenv shim, whose start-up would flatter the server).
    let python = if std::path::Path::new("/usr/bin/python3").exists() {
        "/usr/bin/python3"
    } else {
        "python3"
    };
    let started = Instant::now();
    let mut naive_tests = 0;
    let tasks: Vec<_> = problems
        .iter()
        .flat_map(|p| {
            let entry = p["entry_point"].as_str().unwrap();
            let test_src = p["test"].as_str().unwrap();
            let defs = format!(
                "{}{}\n{}\n",
                p["prompt"].as_str().unwrap(),
                p["canonical_solution"].as_str().unwrap(),
                test_src
            );
            cotrain_reward_server::rewards::code::extract::extract_tests(test_src, entry)
                .into_iter()
                .map(move |t| format!("{defs}{}\n", t.code))
        })
        .map(|program| {
            naive_tests += 1;
            let gate = gate.clone();
            tokio::spawn(async move {
                let _permit = gate.acquire_owned().await.unwrap();
                let out = tokio::time::timeout(
                    Duration::from_secs(10),
                    tokio::process::Command::new(python)
                        .args(["-c", &program])
                        .output(),
                )
                .await;
                matches!(out, Ok(Ok(o)) if o.status.success())
            })
        })
        .collect();
    let mut naive_passed = 0;
    for t in tasks {
        if t.await.unwrap() {
            naive_passed += 1;
        }
    }
    let naive_secs = started.elapsed().as_secs_f64();

    let n = problems.len() as f64;
    println!(
        "benchmark: {} HumanEval canonical solutions, parallelism {parallelism}",
        problems.len()
    );
    println!(
        "  sandboxed via server: {:.1} completions/s ({server_secs:.1} s), p50 {:?}, p99 {:?}, full marks {full_marks}/{}",
        n / server_secs,
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99),
        problems.len()
    );
    println!(
        "  naive unsandboxed:    {:.1} completions/s ({naive_secs:.1} s), {naive_tests} processes, {naive_passed} tests passed",
        n / naive_secs
    );
    assert!(
        full_marks as f64 >= 0.95 * n,
        "canonical solutions must score full marks"
    );
    server.shutdown();
}
