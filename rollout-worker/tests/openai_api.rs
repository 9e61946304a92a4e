//! The OpenAI-compatible API as another trainer's agent loop uses it: per-token log-probs and
//! alternatives, the sampled token ids, server-sent-event streaming, and 400s naming the fields
//! this server does not implement. Through raw HTTP and through the official `openai` Python
//! client (installed by scripts/setup.sh; `COTRAIN_OPENAI_PYTHONPATH` says where).

mod support;

use serde_json::{Value, json};
use support::*;

const AGENT: &str = "alice";

/// The `data:` payloads of a server-sent-event body.
fn sse_data(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|d| d.trim_start().to_string())
        .collect()
}

async fn post(base: &str, path: &str, body: &Value) -> (u16, String) {
    let r = reqwest::Client::new()
        .post(format!("{base}{path}"))
        .json(body)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

/// The same sample over gRPC: its token ids and log-probs.
async fn grpc_sample(
    w: &WorkerProcess,
    prompt: Vec<u32>,
    seed: u64,
    temperature: f32,
    max_new_tokens: u32,
) -> (Vec<u32>, Vec<f32>) {
    let mut c = w.client().await;
    let mut req = request(AGENT, vec![token_prompt(prompt)], 1, seed, max_new_tokens);
    req.sampling.as_mut().unwrap().temperature = Some(temperature);
    req.stop.as_mut().unwrap().ignore_eos = false;
    let r = c.generate(req).await.unwrap().into_inner();
    let s = &r.completions[0].samples[0];
    (s.token_ids.clone(), s.logprobs.clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_token_ids_and_streams_match_the_sample_the_worker_trains_on() {
    let model = TinyModel::new("qwen2");
    let w = WorkerProcess::start(&[(AGENT, &model.spec())], &[]).await;
    let base = format!("http://{}", w.http);
    let chat = json!({
        "model": AGENT, "messages": [{"role": "user", "content": "hi"}], "seed": 11, "temperature": 0.8,
        "max_tokens": 16, "logprobs": true, "top_logprobs": 3, "return_token_ids": true,
    });
    let (status, body) = post(&base, "/v1/chat/completions", &chat).await;
    assert_eq!(status, 200, "{body}");
    let r: Value = serde_json::from_str(&body).unwrap();
    let choice = &r["choices"][0];
    let ids: Vec<u32> = serde_json::from_value(choice["token_ids"].clone()).unwrap();
    let content = choice["logprobs"]["content"].as_array().unwrap();
    assert_eq!(
        content.len(),
        ids.len(),
        "one entry per sampled token, the stop token included"
    );
    for e in content {
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        let lps: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
        assert!(
            lps.windows(2).all(|w| w[0] >= w[1]),
            "most likely first: {lps:?}"
        );
        assert!(
            e["logprob"].as_f64().unwrap() <= lps[0] + 1e-4,
            "nothing beats the top alternative: {e}"
        );
        // The tiny model's tokens are single bytes.
        assert_eq!(e["bytes"].as_array().unwrap().len(), 1, "{e}");
    }
    // The same sample over gRPC: same tokens, and the entries sum to its sequence log-prob.
    let prompt: Vec<u32> = serde_json::from_value(r["prompt_token_ids"].clone()).unwrap();
    let (grpc_ids, grpc_lps) = grpc_sample(&w, prompt, 11, 0.8, 16).await;
    assert_eq!(ids, grpc_ids);
    let http_sum: f64 = content.iter().map(|e| e["logprob"].as_f64().unwrap()).sum();
    let grpc_sum: f64 = grpc_lps.iter().map(|&x| x as f64).sum();
    assert!(
        (http_sum - grpc_sum).abs() < 1e-4,
        "HTTP {http_sum} vs gRPC {grpc_sum}"
    );

    // Streamed: the same text, tokens and log-probs, chunk by chunk, then usage and [DONE].
    let mut streamed = chat.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let (status, body) = post(&base, "/v1/chat/completions", &streamed).await;
    assert_eq!(status, 200, "{body}");
    let data = sse_data(&body);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{body}");
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    // The first chunk carries the prompt's ids (vLLM's streamed `prompt_token_ids`), the others not.
    assert_eq!(
        chunks[0]["prompt_token_ids"], r["prompt_token_ids"],
        "{}",
        chunks[0]
    );
    assert!(
        chunks[1..]
            .iter()
            .all(|c| c.get("prompt_token_ids").is_none())
    );
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk")
    );
    let (mut text, mut stream_ids, mut stream_lps) = (String::new(), Vec::new(), Vec::new());
    for c in &chunks {
        for ch in c["choices"].as_array().unwrap() {
            text += ch["delta"]["content"].as_str().unwrap_or_default();
            stream_ids.extend(
                ch["token_ids"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|t| t.as_u64().unwrap() as u32),
            );
            stream_lps.extend(
                ch["logprobs"]["content"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|e| e["logprob"].as_f64().unwrap()),
            );
        }
    }
    assert!(
        chunks.len() >= ids.len() + 2,
        "a chunk per token: {} chunks for {} tokens",
        chunks.len(),
        ids.len()
    );
    assert_eq!(text, choice["message"]["content"].as_str().unwrap());
    assert_eq!(stream_ids, ids);
    let stream_sum: f64 = stream_lps.iter().sum();
    assert!((stream_sum - http_sum).abs() < 1e-4);
    let finish = &chunks[chunks.len() - 2]["choices"][0];
    assert_eq!(finish["finish_reason"], choice["finish_reason"]);
    let usage = &chunks[chunks.len() - 1];
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], ids.len());

    // Stop strings: the stream never sends text the answer cuts. The stop strings are taken from
    // the unstopped answer of the same seed, so that they are met: one character (nothing held
    // back: the token that completes it must not be sent) and three.
    let free = json!({"model": AGENT, "prompt": "abc", "seed": 4, "temperature": 1.0, "max_tokens": 40, "stop": []});
    let (_, free_body) = post(&base, "/v1/completions", &free).await;
    let free_text: Vec<char> =
        serde_json::from_str::<Value>(&free_body).unwrap()["choices"][0]["text"]
            .as_str()
            .unwrap()
            .chars()
            .collect();
    assert!(free_text.len() >= 20, "{free_body}");
    for stop in [
        free_text[12..13].iter().collect::<String>(),
        free_text[15..18].iter().collect::<String>(),
    ] {
        let stopped = json!({"model": AGENT, "prompt": "abc", "seed": 4, "temperature": 1.0, "max_tokens": 40, "stop": [stop]});
        let (_, whole) = post(&base, "/v1/completions", &stopped).await;
        let whole: Value = serde_json::from_str(&whole).unwrap();
        assert_eq!(whole["choices"][0]["finish_reason"], "stop", "{whole}");
        let mut streamed = stopped.clone();
        streamed["stream"] = json!(true);
        let (status, body) = post(&base, "/v1/completions", &streamed).await;
        assert_eq!(status, 200, "{body}");
        let mut text = String::new();
        for d in sse_data(&body).iter().filter(|d| *d != "[DONE]") {
            text += serde_json::from_str::<Value>(d).unwrap()["choices"][0]["text"]
                .as_str()
                .unwrap_or_default();
            let want = whole["choices"][0]["text"].as_str().unwrap();
            assert!(
                want.starts_with(&text),
                "stop {stop:?}: streamed {text:?} is not a prefix of {want:?}"
            );
        }
        assert_eq!(
            text,
            whole["choices"][0]["text"].as_str().unwrap(),
            "stop {stop:?}"
        );
    }

    // The completions endpoint's logprobs: `logprobs: k` alternatives in the legacy lists.
    let comp = json!({"model": AGENT, "prompt": ["ab", "cd"], "max_tokens": 5, "seed": 2, "logprobs": 2, "return_token_ids": true});
    let (status, body) = post(&base, "/v1/completions", &comp).await;
    assert_eq!(status, 200, "{body}");
    let r: Value = serde_json::from_str(&body).unwrap();
    for ch in r["choices"].as_array().unwrap() {
        let lp = &ch["logprobs"];
        let n = ch["token_ids"].as_array().unwrap().len();
        assert_eq!(lp["tokens"].as_array().unwrap().len(), n);
        assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), n);
        // The sampled token beside the 2 most likely: at most 3 entries (fewer where the sampled
        // token is among them, or where tokens that are parts of characters share the key "\u{fffd}").
        let tokens = lp["tokens"].as_array().unwrap();
        for (m, t) in lp["top_logprobs"].as_array().unwrap().iter().zip(tokens) {
            let m = m.as_object().unwrap();
            assert!(
                (1..=3).contains(&m.len()) && m.contains_key(t.as_str().unwrap()),
                "{lp}"
            );
        }
        assert_eq!(ch["prompt_token_ids"].as_array().unwrap().len(), 2);
    }
    // Streamed: each choice's first chunk carries its own prompt's ids.
    let mut streamed = comp.clone();
    streamed["stream"] = json!(true);
    let (status, body) = post(&base, "/v1/completions", &streamed).await;
    assert_eq!(status, 200, "{body}");
    let mut firsts: std::collections::BTreeMap<u64, Value> = std::collections::BTreeMap::new();
    for d in sse_data(&body).iter().filter(|d| *d != "[DONE]") {
        for ch in serde_json::from_str::<Value>(d).unwrap()["choices"]
            .as_array()
            .unwrap()
        {
            let index = ch["index"].as_u64().unwrap();
            match firsts.entry(index) {
                std::collections::btree_map::Entry::Vacant(e) => {
                    e.insert(ch["prompt_token_ids"].clone());
                }
                std::collections::btree_map::Entry::Occupied(_) => {
                    assert!(ch.get("prompt_token_ids").is_none(), "{ch}")
                }
            }
        }
    }
    for (index, ids) in &firsts {
        assert_eq!(
            ids, &r["choices"][*index as usize]["prompt_token_ids"],
            "choice {index}"
        );
    }
    assert_ne!(firsts[&0], firsts[&1], "two prompts, two id lists");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fields_this_server_cannot_honour_are_400s_naming_them() {
    let model = TinyModel::new("llama");
    let w = WorkerProcess::start(&[(AGENT, &model.spec())], &[]).await;
    let base = format!("http://{}", w.http);
    let msg = json!([{"role": "user", "content": "hi"}]);
    let cases = [
        (
            "/v1/chat/completions",
            json!({"model": AGENT, "messages": msg, "logit_bias": {"5": 3}}),
            "logit_bias",
        ),
        (
            "/v1/chat/completions",
            json!({"model": AGENT, "messages": msg, "tools": [{"type": "function"}]}),
            "tools",
        ),
        (
            "/v1/chat/completions",
            json!({"model": AGENT, "messages": msg, "presence_penalty": 0.5}),
            "presence_penalty",
        ),
        (
            "/v1/chat/completions",
            json!({"model": AGENT, "messages": msg, "response_format": {"type": "json_object"}}),
            "response_format",
        ),
        (
            "/v1/chat/completions",
            json!({"model": AGENT, "messages": msg, "top_logprobs": 2}),
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            json!({"model": AGENT, "messages": msg, "logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            json!({"model": AGENT, "messages": msg, "logprobs": 3}),
            "logprobs",
        ),
        (
            "/v1/completions",
            json!({"model": AGENT, "prompt": "x", "logprobs": true}),
            "logprobs",
        ),
        (
            "/v1/completions",
            json!({"model": AGENT, "prompt": "x", "echo": true}),
            "echo",
        ),
        (
            "/v1/completions",
            json!({"model": AGENT, "prompt": "x", "best_of": 3}),
            "best_of",
        ),
        (
            "/v1/completions",
            json!({"model": AGENT, "prompt": "x", "include_stop_str_in_output": true}),
            "include_stop_str_in_output",
        ),
        // Before any token: a plain error, not a stream.
        (
            "/v1/chat/completions",
            json!({"model": "mallory", "messages": msg, "stream": true}),
            "model",
        ),
    ];
    for (path, body, field) in cases {
        let (status, text) = post(&base, path, &body).await;
        assert_eq!(status, 400, "{body}: {text}");
        let e: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(e["error"]["param"], field, "{body}: {text}");
    }
    // Their no-op values are accepted.
    let ok = json!({
        "model": AGENT, "messages": msg, "max_tokens": 2, "logit_bias": {}, "presence_penalty": 0, "tools": [], "response_format": {"type": "text"},
        "skip_special_tokens": true, "ignore_eos": true, "stop_token_ids": [5],
    });
    let (status, text) = post(&base, "/v1/chat/completions", &ok).await;
    assert_eq!(status, 200, "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_openai_python_client_streams_and_reads_logprobs() {
    let Some(pythonpath) = std::env::var_os("COTRAIN_OPENAI_PYTHONPATH") else {
        panic!(
            "COTRAIN_OPENAI_PYTHONPATH is not set: run scripts/setup.sh (make setup), which installs the openai client and sets it"
        );
    };
    let model = TinyModel::new("qwen2");
    let w = WorkerProcess::start(&[(AGENT, &model.spec())], &[]).await;
    let script = workspace_root().join("rollout-worker/tests/openai_client.py");
    let base = format!("http://{}", w.http);
    let out = tokio::process::Command::new("python3")
        .arg(&script)
        .arg(&base)
        .arg(AGENT)
        .env("PYTHONPATH", &pythonpath)
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "openai_client.py failed:\n{stderr}");
    let r: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}\n{stderr}", String::from_utf8_lossy(&out.stdout)));

    // Not streamed: one log-prob per token, summing to the gRPC sample's log-prob.
    let ids: Vec<u32> = serde_json::from_value(r["chat"]["token_ids"].clone()).unwrap();
    let prompt: Vec<u32> = serde_json::from_value(r["chat"]["prompt_token_ids"].clone()).unwrap();
    let lps: Vec<f64> = serde_json::from_value(r["chat"]["logprobs"].clone()).unwrap();
    assert_eq!(lps.len(), ids.len());
    let (grpc_ids, grpc_lps) = grpc_sample(&w, prompt, 7, 0.9, 12).await;
    assert_eq!(ids, grpc_ids);
    let sum: f64 = lps.iter().sum();
    let grpc_sum: f64 = grpc_lps.iter().map(|&x| x as f64).sum();
    assert!(
        (sum - grpc_sum).abs() < 1e-4,
        "client {sum} vs gRPC {grpc_sum}"
    );
    assert!(
        r["chat"]["top_counts"]
            .as_array()
            .unwrap()
            .iter()
            .all(|k| k == 2)
    );

    // Streamed through the client: the same text and log-probs, the usage at the end.
    assert_eq!(r["stream"]["content"], r["chat"]["content"]);
    let stream_sum: f64 = serde_json::from_value::<Vec<f64>>(r["stream"]["logprobs"].clone())
        .unwrap()
        .iter()
        .sum();
    assert!((stream_sum - sum).abs() < 1e-4);
    assert_eq!(r["stream"]["completion_tokens"], ids.len());
    assert_eq!(r["stream"]["finish_reason"], r["chat"]["finish_reason"]);
    // vLLM's streamed extras as the client keeps them: every token's id and the prompt's ids.
    assert_eq!(r["stream"]["token_ids"], r["chat"]["token_ids"]);
    assert_eq!(
        r["stream"]["prompt_token_ids"],
        r["chat"]["prompt_token_ids"]
    );
    assert!(r["stream"]["chunks"].as_u64().unwrap() as usize >= ids.len());
    // The legacy completions endpoint, streamed.
    assert_eq!(r["completion_stream"]["text"], r["completion"]["text"]);
    // What the server cannot do reaches the client as a BadRequestError naming the field.
    assert_eq!(r["refused"]["status"], 400);
    assert_eq!(r["refused"]["param"], "logit_bias");
}
