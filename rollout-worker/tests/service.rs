//! Integration tests of the rollout worker: the real binary on ephemeral ports, driven over gRPC,
//! HTTP and through the client pool.

mod support;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use cotrain_model::engine::{
    Engine, LogprobMode, Request, SamplingParams as EngineSampling, StopConditions as EngineStop,
};
use cotrain_model::loader::{self, LoadOptions};
use cotrain_proto::rollout::rollout_client::RolloutClient;
use cotrain_proto::rollout::{
    Dtype, FinishReason, GenerateRequest, GenerateResponse, SamplingParams, TensorChunk,
    UpdateHeader, UpdateWeightsRequest, update_weights_request::Item,
};
use cotrain_rollout_client::pool::{PoolConfig, RolloutPool, update_stream};
use cotrain_rollout_worker::worker::prompt_seed;
use support::*;
use tonic::Code;
use tonic::transport::Channel;

const AGENT: &str = "alice";

fn tokens(r: &GenerateResponse) -> Vec<Vec<Vec<u32>>> {
    r.completions
        .iter()
        .map(|c| c.samples.iter().map(|s| s.token_ids.clone()).collect())
        .collect()
}

async fn generate(c: &mut RolloutClient<Channel>, req: GenerateRequest) -> GenerateResponse {
    c.generate(req).await.expect("generate").into_inner()
}

/// The value of the first sample of a Prometheus metric on the worker's `/metrics`.
async fn metric(w: &WorkerProcess, name: &str) -> f64 {
    let text = reqwest::get(format!("http://{}/metrics", w.http))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

fn header(version: u64, tensor_count: u32, partial: bool) -> UpdateHeader {
    UpdateHeader {
        agent: AGENT.into(),
        version,
        tensor_count,
        partial,
        lora_scaling: 0.0,
        probe: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_generation_equals_the_engine_directly() {
    let model = TinyModel::new("llama");
    let w = WorkerProcess::start(&[(AGENT, &model.spec())], &[]).await;
    let mut c = w.client().await;
    let prompts = vec![
        token_prompt(vec![10, 20, 30, 40]),
        text_prompt("hello world"),
    ];
    let mut req = request(AGENT, prompts, 3, 1234, 24);
    req.sampling = Some(SamplingParams {
        temperature: Some(0.8),
        top_p: Some(0.9),
        top_k: 50,
        max_new_tokens: 24,
        min_p: None,
        sampling_logprobs: false,
    });
    let got = generate(&mut c, req).await;
    assert_eq!(got.completions.len(), 2);
    assert_eq!(
        got.completions[1].prompt_token_ids,
        b"hello world".iter().map(|&b| b as u32).collect::<Vec<_>>()
    );

    let mut engine = Engine::new(loader::load(&model.spec(), &LoadOptions::default()).unwrap());
    let requests: Vec<Request> = got
        .completions
        .iter()
        .enumerate()
        .map(|(i, c)| Request {
            prompt: c.prompt_token_ids.clone(),
            n: 3,
            params: EngineSampling {
                temperature: 0.8,
                top_k: 50,
                top_p: 0.9,
                min_p: 0.0,
            },
            seed: prompt_seed(1234, i),
            stop: EngineStop {
                max_new_tokens: 24,
                stop_token_ids: vec![],
                stop_strings: vec![],
                ignore_eos: true,
            },
            logprobs: LogprobMode::Raw,
            top_logprobs: 0,
        })
        .collect();
    let want = engine.generate(&requests).unwrap();
    for (c, w) in got.completions.iter().zip(&want) {
        assert_eq!(c.samples.len(), w.len());
        for (s, e) in c.samples.iter().zip(w) {
            assert_eq!(s.token_ids, e.token_ids);
            assert_eq!(s.text, e.text);
            assert_eq!(s.finish_reason, FinishReason::Length as i32);
            assert_eq!(s.policy_version, 0);
            assert_eq!(s.logprobs.len(), s.token_ids.len());
            for (a, b) in s.logprobs.iter().zip(&e.logprobs) {
                assert!((a - b).abs() < 1e-4, "logprob {a} vs {b}");
            }
        }
    }
    // Samples of one prompt differ from each other (distinct streams).
    assert_ne!(
        got.completions[0].samples[0].token_ids,
        got.completions[0].samples[1].token_ids
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_clients_get_the_answers_they_would_get_alone() {
    let model = TinyModel::new("llama");
    let w = WorkerProcess::start(&[(AGENT, &model.spec())], &["--max-batch-size", "32"]).await;
    let mut c = w.client().await;
    // Greedy: a sampled token can flip when its uniform lands within float noise of a CDF
    // boundary, and batched matmuls differ from unbatched ones by such noise (the engine's
    // documented limit); the tiny random model's flat distributions make that common. Argmax
    // over its logits has no near-ties, so the comparison is exact.
    let req = |i: u64| {
        let mut r = request(
            AGENT,
            vec![token_prompt(
                (0..1 + i as u32 % 4).map(|t| 1 + i as u32 + t).collect(),
            )],
            1,
            100 + i,
            16 + (i as u32 % 5) * 4,
        );
        r.sampling.as_mut().unwrap().temperature = Some(0.0);
        r
    };
    let mut alone = Vec::new();
    for i in 0..12 {
        alone.push(tokens(&generate(&mut c, req(i)).await));
    }
    let handles: Vec<_> = (0..12)
        .map(|i| {
            let mut c = c.clone();
            tokio::spawn(async move { tokens(&generate(&mut c, req(i)).await) })
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        assert_eq!(
            h.await.unwrap(),
            alone[i],
            "request {i} differs when batched with others"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weight_update_mid_generation_versions_are_consistent() {
    let model = TinyModel::new("llama");
    let w = WorkerProcess::start(
        &[(AGENT, &model.spec()), ("bob", &model.spec())],
        &["--share", "alice,bob"],
    )
    .await;
    let mut c = w.client().await;
    let long = request(AGENT, vec![token_prompt(vec![5, 6, 7])], 16, 7, 480);
    let short = request(AGENT, vec![token_prompt(vec![8, 9])], 2, 8, 12);
    let long_v0 = generate(&mut c, long.clone()).await;
    let short_v0 = generate(&mut c, short.clone()).await;

    // The long request is decoding when the update arrives.
    let in_flight = {
        let mut c = c.clone();
        let long = long.clone();
        tokio::spawn(async move { generate(&mut c, long).await })
    };
    wait_info(&mut c, Duration::from_secs(60), |i| {
        i.models[0].running_sequences > 0
    })
    .await;
    let tensors = lm_head_update(&mut c, AGENT, 1).await;
    let update = {
        let mut c = c.clone();
        let tensors = tensors.clone();
        tokio::spawn(async move {
            c.update_weights(update_stream(header(1, 1, true), tensors, 1000))
                .await
        })
    };
    // A request sent once the update waits in the engine loop runs on the new weights.
    wait_info(&mut c, Duration::from_secs(60), |i| {
        i.models[0].pending_weight_updates == 1
    })
    .await;
    let later = {
        let mut c = c.clone();
        let short = short.clone();
        tokio::spawn(async move { generate(&mut c, short).await })
    };
    let long_during = in_flight.await.unwrap();
    let answer = update.await.unwrap().expect("update accepted").into_inner();
    let short_after = later.await.unwrap();

    assert_eq!(answer.version, 1);
    assert_eq!(answer.tensors_updated, 1);
    assert_eq!(
        answer.agents,
        vec![AGENT.to_string(), "bob".to_string()],
        "agents sharing the model share the update"
    );
    // In flight: finished entirely on version 0, token for token as before the update.
    assert!(
        long_during.completions[0]
            .samples
            .iter()
            .all(|s| s.policy_version == 0)
    );
    assert_eq!(tokens(&long_during), tokens(&long_v0));
    // Later: version 1, and the new weights change the samples.
    assert!(
        short_after.completions[0]
            .samples
            .iter()
            .all(|s| s.policy_version == 1)
    );
    assert_ne!(tokens(&short_after), tokens(&short_v0));
    let again = generate(&mut c, short.clone()).await;
    assert_eq!(tokens(&again), tokens(&short_after));
    let info = w.info().await;
    assert!(
        info.agents.iter().all(|a| a.policy_version == 1),
        "{info:?}"
    );
    let mut bob = short.clone();
    bob.agent = "bob".into();
    assert_eq!(tokens(&generate(&mut c, bob).await), tokens(&short_after));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_updates_are_rejected_and_the_old_weights_stay() {
    let model = TinyModel::new("llama");
    let w = WorkerProcess::start(&[(AGENT, &model.spec())], &[]).await;
    let mut c = w.client().await;
    let probe = request(AGENT, vec![token_prompt(vec![3, 4, 5])], 2, 99, 20);
    let before = tokens(&generate(&mut c, probe.clone()).await);
    let good = lm_head_update(&mut c, AGENT, 2).await;
    let t = &good[0];
    let chunk = |name: &str, dtype: Dtype, shape: Vec<i64>, offset: u64, data: Vec<u8>| {
        UpdateWeightsRequest {
            item: Some(Item::Chunk(TensorChunk {
                name: name.into(),
                dtype: dtype as i32,
                shape,
                offset,
                data,
            })),
        }
    };
    let head = |h: UpdateHeader| UpdateWeightsRequest {
        item: Some(Item::Header(h)),
    };
    let cases: Vec<(&str, Vec<UpdateWeightsRequest>, Code, &str)> = vec![
        (
            "unknown name",
            vec![
                head(header(1, 1, true)),
                chunk("model.nope", Dtype::F32, vec![4], 0, vec![0; 16]),
            ],
            Code::InvalidArgument,
            "no parameter",
        ),
        (
            "wrong shape",
            vec![
                head(header(1, 1, true)),
                chunk(&t.name, Dtype::F32, vec![1, 2], 0, vec![0; 8]),
            ],
            Code::InvalidArgument,
            "shape",
        ),
        (
            "no dtype",
            vec![
                head(header(1, 1, true)),
                chunk(&t.name, Dtype::Unspecified, t.shape.clone(), 0, vec![0; 8]),
            ],
            Code::InvalidArgument,
            "dtype",
        ),
        (
            "truncated",
            vec![
                head(header(1, 1, true)),
                chunk(
                    &t.name,
                    Dtype::F32,
                    t.shape.clone(),
                    0,
                    t.data[..100].to_vec(),
                ),
            ],
            Code::InvalidArgument,
            "incomplete",
        ),
        (
            "missing tensors",
            vec![
                head(header(1, 2, true)),
                chunk(&t.name, Dtype::F32, t.shape.clone(), 0, t.data.clone()),
            ],
            Code::InvalidArgument,
            "after 1 of",
        ),
        (
            "full update of one tensor",
            vec![head(header(1, 1, false))],
            Code::InvalidArgument,
            "must carry all",
        ),
        (
            "no header",
            vec![chunk(
                &t.name,
                Dtype::F32,
                t.shape.clone(),
                0,
                t.data.clone(),
            )],
            Code::InvalidArgument,
            "header",
        ),
        (
            "old version",
            vec![head(header(0, 1, true))],
            Code::FailedPrecondition,
            "not newer",
        ),
    ];
    for (what, msgs, code, needle) in cases {
        let err = c
            .update_weights(futures::stream::iter(msgs))
            .await
            .expect_err(what);
        assert_eq!(err.code(), code, "{what}: {err:?}");
        assert!(
            err.message().contains(needle),
            "{what}: `{}` lacks `{needle}`",
            err.message()
        );
    }
    // A stream that breaks halfway: the client goes away after the first chunk.
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(head(header(1, 1, true))).await.unwrap();
    tx.send(chunk(
        &t.name,
        Dtype::F32,
        t.shape.clone(),
        0,
        t.data[..64].to_vec(),
    ))
    .await
    .unwrap();
    let broken = {
        let mut c = c.clone();
        tokio::spawn(async move {
            c.update_weights(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await
        })
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while metric(&w, "cotrain_rollout_weight_update_bytes_total").await < 64.0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the partial chunk never arrived"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    broken.abort();
    drop(tx);
    let info = w.info().await;
    assert_eq!(info.agents[0].policy_version, 0);
    assert_eq!(
        tokens(&generate(&mut c, probe.clone()).await),
        before,
        "weights changed by a rejected update"
    );
    // And a good update still goes through afterwards.
    let ok = c
        .update_weights(update_stream(header(1, 1, true), good, 4096))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ok.version, 1);
    assert_ne!(tokens(&generate(&mut c, probe).await), before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_invalid_argument_naming_the_field() {
    let model = TinyModel::new("llama");
    let w = WorkerProcess::start(&[(AGENT, &model.spec())], &[]).await;
    let mut c = w.client().await;
    let ok = || request(AGENT, vec![token_prompt(vec![1, 2, 3])], 1, 0, 4);
    let mut cases: Vec<(GenerateRequest, &str)> = Vec::new();
    let mut r = ok();
    r.agent = "mallory".into();
    cases.push((r, "agent"));
    let mut r = ok();
    r.prompts = vec![token_prompt(vec![])];
    cases.push((r, "prompts[0]"));
    let mut r = ok();
    r.prompts = vec![token_prompt(vec![1]), text_prompt("")];
    cases.push((r, "prompts[1]"));
    let mut r = ok();
    r.prompts = vec![token_prompt(vec![65; 600])];
    cases.push((r, "prompts[0]"));
    let mut r = ok();
    r.prompts = vec![token_prompt(vec![300])];
    cases.push((r, "prompts[0]"));
    let mut r = ok();
    r.sampling.as_mut().unwrap().temperature = Some(-0.5);
    cases.push((r, "sampling.temperature"));
    let mut r = ok();
    r.sampling.as_mut().unwrap().top_p = Some(1.5);
    cases.push((r, "sampling.top_p"));
    let mut r = ok();
    r.sampling.as_mut().unwrap().max_new_tokens = 0;
    cases.push((r, "sampling.max_new_tokens"));
    let mut r = ok();
    r.n = 100_000;
    cases.push((r, "n"));
    for (req, field) in cases {
        let err = c.generate(req).await.expect_err(field);
        assert_eq!(err.code(), Code::InvalidArgument, "{field}: {err:?}");
        assert!(
            err.message().contains(field),
            "`{}` does not name {field}",
            err.message()
        );
    }
    let mut r = ok();
    r.min_policy_version = Some(3);
    assert_eq!(
        c.generate(r).await.unwrap_err().code(),
        Code::FailedPrecondition
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_queue_is_resource_exhausted_and_dropped_clients_stop_costing_compute() {
    let model = TinyModel::new("llama");
    let w = WorkerProcess::start(&[(AGENT, &model.spec())], &["--max-queued-requests", "1"]).await;
    let mut c = w.client().await;
    let long = request(AGENT, vec![token_prompt(vec![5, 6, 7])], 32, 1, 500);
    let first = {
        let mut c = c.clone();
        let long = long.clone();
        tokio::spawn(async move { c.generate(long).await })
    };
    wait_info(&mut c, Duration::from_secs(60), |i| {
        i.models[0].running_sequences == 32
    })
    .await;
    let err = c
        .generate(request(AGENT, vec![token_prompt(vec![1])], 1, 0, 2))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");

    // The client goes away: its 32 sequences leave the batch long before 32 × 500 tokens.
    first.abort();
    wait_info(&mut c, Duration::from_secs(30), |i| {
        i.models[0].running_sequences == 0 && i.in_flight_requests == 0
    })
    .await;
    let generated = metric(&w, "cotrain_rollout_generated_tokens_total").await;
    assert!(
        generated < 32.0 * 500.0,
        "cancelled sequences ran to the end ({generated} tokens)"
    );

    // A deadline behaves the same way.
    // (32 × 500 tokens of the tiny model take about 0.3 s here: the deadline must be well inside.)
    let mut timed = tonic::Request::new(long);
    timed.set_timeout(Duration::from_millis(50));
    // tonic's server answers an expired grpc-timeout with CANCELLED ("Timeout expired"), as the
    // gRPC spec has servers do; what matters is that the sequences stop.
    let err = c.generate(timed).await.unwrap_err();
    assert!(
        matches!(err.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{err:?}"
    );
    wait_info(&mut c, Duration::from_secs(30), |i| {
        i.models[0].running_sequences == 0 && i.in_flight_requests == 0
    })
    .await;
}

/// The worker's resident memory, from /proc.
fn rss_kib(w: &WorkerProcess) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", w.child.id())).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_clients_get_answers_or_resource_exhausted_and_memory_stays_bounded() {
    let model = TinyModel::new("llama");
    let w = WorkerProcess::start(
        &[(AGENT, &model.spec())],
        &["--max-queued-requests", "16", "--max-batch-size", "8"],
    )
    .await;
    let mut rss = Vec::new();
    for burst in 0..3u64 {
        let calls: Vec<_> = (0..64u64)
            .map(|i| {
                let endpoint = w.endpoint();
                tokio::spawn(async move {
                    // A connection of its own per client, as 64 separate trainers would have.
                    let mut c = RolloutClient::connect(endpoint).await.unwrap();
                    c.generate(request(
                        AGENT,
                        vec![token_prompt(vec![1 + i as u32, 2])],
                        2,
                        burst * 100 + i,
                        48,
                    ))
                    .await
                })
            })
            .collect();
        let (mut ok, mut exhausted) = (0, 0);
        for (i, call) in calls.into_iter().enumerate() {
            match call.await.unwrap() {
                Ok(r) => {
                    assert_eq!(
                        r.into_inner().completions[0].samples.len(),
                        2,
                        "request {i}"
                    );
                    ok += 1;
                }
                Err(s) if s.code() == Code::ResourceExhausted => exhausted += 1,
                Err(s) => panic!("request {i}: {s:?}"),
            }
        }
        assert_eq!(ok + exhausted, 64, "every client got an answer");
        assert!(ok >= 16, "at least the admitted requests are served ({ok})");
        rss.push(rss_kib(&w));
    }
    // Still serving, nothing left in flight, memory flat across bursts.
    let mut c = w.client().await;
    generate(&mut c, request(AGENT, vec![token_prompt(vec![3])], 1, 7, 4)).await;
    assert_eq!(w.info().await.in_flight_requests, 0);
    assert!(
        rss[2] < rss[0] + 64 * 1024,
        "RSS grew across bursts: {rss:?} KiB"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn info_metrics_http_api_and_graceful_shutdown() {
    let llama = TinyModel::new("llama");
    let qwen = TinyModel::new("qwen2");
    let mut w = WorkerProcess::start(
        &[
            (AGENT, &llama.spec()),
            ("bob", &llama.spec()),
            ("carol", &qwen.spec()),
            ("dave", &llama.spec()),
        ],
        &["--max-batch-size", "8", "--share", "alice,bob"],
    )
    .await;
    let info = w.info().await;
    assert_eq!(info.device, "cpu");
    assert_eq!(info.dtype, "f32");
    // alice and bob share one model (--share); dave names the same model but has a copy of his own.
    assert_eq!(
        info.models.len(),
        3,
        "alice and bob share one model: {info:?}"
    );
    assert_eq!(info.models[2].agents, vec!["dave"]);
    assert_eq!(info.models[2].id, format!("{}#dave", llama.spec()));
    assert_eq!(info.models[0].agents, vec![AGENT, "bob"]);
    assert_eq!(info.models[0].max_batch_size, 8);
    assert!(info.models[0].parameter_count > 0);
    assert_eq!(
        info.agents
            .iter()
            .map(|a| a.name.as_str())
            .collect::<Vec<_>>(),
        vec![AGENT, "bob", "carol", "dave"]
    );

    let http = reqwest::Client::new();
    let base = format!("http://{}", w.http);
    let models: serde_json::Value = http
        .get(format!("{base}/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec![AGENT, "bob", "carol", "dave"]);

    let chat = serde_json::json!({
        "model": "carol", "messages": [{"role": "user", "content": "hi"}],
        "n": 2, "seed": 5, "temperature": 0.7, "top_p": 0.95, "max_tokens": 10, "stop": ["\n"]
    });
    let r1: serde_json::Value = http
        .post(format!("{base}/v1/chat/completions"))
        .json(&chat)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let r2: serde_json::Value = http
        .post(format!("{base}/v1/chat/completions"))
        .json(&chat)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r1["object"], "chat.completion");
    assert_eq!(r1["choices"].as_array().unwrap().len(), 2);
    assert_eq!(r1["choices"], r2["choices"], "same seed, same answer");
    assert_eq!(r1["choices"][0]["message"]["role"], "assistant");
    // "<user>hi\n<assistant>" is 20 bytes, one token each.
    assert_eq!(r1["usage"]["prompt_tokens"], 20);
    let completion_tokens = r1["usage"]["completion_tokens"].as_u64().unwrap();
    assert!((2..=20).contains(&completion_tokens), "{}", r1["usage"]);
    assert_eq!(
        r1["usage"]["total_tokens"].as_u64().unwrap(),
        20 + completion_tokens
    );

    let comp = serde_json::json!({"model": AGENT, "prompt": ["ab", "cd"], "max_tokens": 3, "seed": 1, "temperature": 0});
    let r: serde_json::Value = http
        .post(format!("{base}/v1/completions"))
        .json(&comp)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r["object"], "text_completion");
    assert_eq!(r["choices"].as_array().unwrap().len(), 2);
    assert_eq!(r["usage"]["prompt_tokens"], 4);

    let bad = serde_json::json!({"model": "mallory", "prompt": "x"});
    let resp = http
        .post(format!("{base}/v1/completions"))
        .json(&bad)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let e: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(e["error"]["param"], "model");
    assert_eq!(e["error"]["type"], "invalid_request_error");
    let bad = serde_json::json!({"model": AGENT, "prompt": "x", "temperature": -1});
    let e: serde_json::Value = http
        .post(format!("{base}/v1/completions"))
        .json(&bad)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(e["error"]["param"], "temperature", "{e}");

    let metrics = http
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for needle in [
        "cotrain_rollout_generated_tokens_total",
        "cotrain_rollout_tokens_per_second",
        "cotrain_rollout_batch_occupancy",
        "cotrain_rollout_queue_depth",
        "cotrain_rollout_policy_version{agent=\"carol\"} 0",
    ] {
        assert!(
            metrics.contains(needle),
            "metrics lack {needle}:\n{metrics}"
        );
    }

    let status = w.terminate();
    assert!(status.success(), "sigterm exit: {status:?}");
}

fn pool_config(endpoints: Vec<String>) -> PoolConfig {
    PoolConfig {
        endpoints,
        refresh_interval: Duration::from_millis(200),
        connect_timeout: Duration::from_secs(2),
        wait_for_worker: Duration::from_secs(60),
        ..PoolConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_survives_a_killed_worker_and_uses_a_new_one() {
    let model = TinyModel::new("llama");
    let spec = model.spec();
    let agents = [(AGENT, spec.as_str())];
    // Batch size 1: every sequence decodes alone, so a request's samples are bit-identical on any
    // worker whatever else it is serving, and a retried request must give exactly the samples
    // the first answer would have had (see the note in the concurrency test).
    let flags = ["--max-batch-size", "1"];
    let mut workers = [
        WorkerProcess::start(&agents, &flags).await,
        WorkerProcess::start(&agents, &flags).await,
        WorkerProcess::start(&agents, &flags).await,
    ];
    let pool = Arc::new(
        RolloutPool::new(pool_config(workers.iter().map(|w| w.endpoint()).collect()))
            .await
            .unwrap(),
    );
    pool.wait_for_healthy(3, Duration::from_secs(30))
        .await
        .unwrap();
    let req = |i: u64| {
        request(
            AGENT,
            vec![token_prompt(vec![2 + i as u32, 3])],
            1,
            1000 + i,
            120,
        )
    };

    // Expected answers, from one worker, one at a time.
    let mut c = workers[0].client().await;
    let mut expected = HashMap::new();
    for i in 0..18 {
        expected.insert(i, tokens(&generate(&mut c, req(i)).await));
    }

    let batch: Vec<_> = (0..18)
        .map(|i| {
            let pool = pool.clone();
            tokio::spawn(async move { (i, pool.generate(req(i)).await) })
        })
        .collect();
    // Kill a worker while it has requests in flight.
    let victim = workers[1].endpoint();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while pool
        .workers()
        .iter()
        .find(|s| s.address == victim)
        .map(|s| s.in_flight)
        .unwrap_or(0)
        == 0
    {
        assert!(
            std::time::Instant::now() < deadline,
            "victim never got work"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    workers[1].kill();
    let mut answered = 0;
    for h in batch {
        let (i, r) = h.await.unwrap();
        let r = r.unwrap_or_else(|e| panic!("request {i} lost: {e}"));
        assert_eq!(r.request_id, format!("seed-{}", 1000 + i));
        assert_eq!(
            tokens(&r),
            expected[&i],
            "request {i} answered with other samples"
        );
        answered += 1;
    }
    assert_eq!(answered, 18);
    let snap = pool.workers();
    let dead = snap.iter().find(|s| s.address == victim).unwrap();
    assert!(dead.failed >= 1 && !dead.healthy, "{snap:?}");
    let total: u64 = snap.iter().map(|s| s.completed).sum();
    assert_eq!(total, 18, "each request answered exactly once: {snap:?}");

    // A new worker joins and takes load.
    let fresh = WorkerProcess::start(&agents, &flags).await;
    pool.add_endpoint(&fresh.endpoint()).await.unwrap();
    // Batches of 12 until it has answered some: on a loaded machine the first batch may all go to
    // the warm workers while the new one's connection is still being made.
    for round in 0..10 {
        let batch: Vec<_> = (0..12)
            .map(|i| {
                let pool = pool.clone();
                tokio::spawn(async move { pool.generate(req(i)).await })
            })
            .collect();
        for h in batch {
            h.await.unwrap().unwrap();
        }
        let snap = pool.workers();
        let new = snap.iter().find(|s| s.address == fresh.endpoint()).unwrap();
        if new.completed > 0 {
            break;
        }
        assert!(
            round < 9,
            "the new worker got no load in 10 batches: {snap:?}"
        );
    }

    // Weight push to every healthy worker, then wait for the version everywhere.
    let mut c = fresh.client().await;
    let tensors = lm_head_update(&mut c, AGENT, 3).await;
    let answers = pool.push_weights(AGENT, 1, true, tensors).await;
    assert_eq!(answers.len(), 3, "{answers:?}");
    assert!(
        answers
            .iter()
            .all(|(_, r)| r.as_ref().is_ok_and(|r| r.version == 1)),
        "{answers:?}"
    );
    pool.wait_for_version(AGENT, 1, Duration::from_secs(10))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_finds_workers_through_dns() {
    let model = TinyModel::new("llama");
    let w = WorkerProcess::start(&[(AGENT, &model.spec())], &[]).await;
    let cfg = PoolConfig {
        dns_names: vec![format!("localhost:{}", w.grpc.port())],
        ..pool_config(vec![])
    };
    let pool = RolloutPool::new(cfg).await.unwrap();
    pool.wait_for_healthy(1, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(
        pool.workers()[0].address,
        format!("http://127.0.0.1:{}", w.grpc.port())
    );
    let r = pool
        .generate(request(AGENT, vec![token_prompt(vec![1, 2])], 1, 0, 4))
        .await
        .unwrap();
    assert_eq!(r.completions[0].samples[0].token_ids.len(), 4);
    // Bad input is not retried: it would fail everywhere.
    let mut bad = request(AGENT, vec![token_prompt(vec![1])], 1, 0, 4);
    bad.agent = "mallory".into();
    assert!(matches!(
        pool.generate(bad).await,
        Err(cotrain_rollout_client::PoolError::Rejected { .. })
    ));
}

/// Regression: `serve --verifier` demanded an `--agent`, so a policy nobody asked for was loaded.
/// A worker serving only a verifier scores conversations, reports no agent, and refuses generation
/// (gRPC and HTTP) saying that it serves none; `serve` with neither an agent nor a verifier is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_verifier_is_served_without_any_agent() {
    use cotrain_model::lora::LoraConfig;
    use cotrain_model::verifier::Verifier;
    use cotrain_proto::rollout::{Conversation, ScoreVerifierRequest};

    let model = TinyModel::new("llama");
    let vdir = tempfile::tempdir().unwrap();
    let base = loader::load(&model.spec(), &LoadOptions::default()).unwrap();
    Verifier::new(base, &model.spec(), Some(LoraConfig::default()), 64)
        .unwrap()
        .save(vdir.path())
        .unwrap();
    let w = WorkerProcess::start(
        &[],
        &["--verifier", &format!("judge={}", vdir.path().display())],
    )
    .await;
    let info = w.info().await;
    assert!(info.agents.is_empty() && info.models.is_empty(), "{info:?}");
    assert_eq!(info.verifiers, ["judge"]);

    let mut c = w.client().await;
    let conversation = Conversation {
        user: "what is 2 + 2?".into(),
        assistant: "4".into(),
    };
    let scored = c
        .score_verifier(ScoreVerifierRequest {
            verifier: String::new(),
            conversations: vec![conversation],
        })
        .await
        .expect("score_verifier")
        .into_inner();
    assert_eq!(scored.verifier, "judge");
    assert!(
        scored.scores.len() == 1 && (0.0..=1.0).contains(&scored.scores[0]),
        "{:?}",
        scored.scores
    );

    let err = c
        .generate(request(AGENT, vec![token_prompt(vec![1, 2, 3])], 1, 0, 4))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(
        err.message().contains("serves no agent"),
        "{}",
        err.message()
    );
    let http = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", w.http))
        .json(&serde_json::json!({"model": AGENT, "prompt": "hello", "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(http.status(), reqwest::StatusCode::BAD_REQUEST);
    let body = http.text().await.unwrap();
    assert!(body.contains("serves no agent"), "{body}");

    let neither = std::process::Command::new(env!("CARGO_BIN_EXE_rollout-worker"))
        .args([
            "serve",
            "--grpc-addr",
            "127.0.0.1:0",
            "--http-addr",
            "127.0.0.1:0",
        ])
        .output()
        .expect("the binary runs");
    assert!(!neither.status.success());
    let err = String::from_utf8_lossy(&neither.stderr);
    assert!(err.contains("--agent"), "{err}");
}
