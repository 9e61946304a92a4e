//! `serve --engine vllm` on vLLM's CPU build, for real: the engine's greedy tokens and log-probs
//! against cotrain's engine on the same f32 weights, weight pushes reloaded into the running
//! engine, a wrong push caught by the probe check, an engine killed mid-run and restarted with the
//! current weights, and a missing vLLM refused with a message that says what to set.
//!
//! vLLM comes from `COTRAIN_VLLM_PYTHON` (scripts/setup.sh installs vLLM's CPU build for
//! `make test` and writes the variable into .cargo/config.toml).

mod support;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use cotrain_model::loader::{self, LoadOptions};
use cotrain_proto::rollout::rollout_client::RolloutClient;
use cotrain_proto::rollout::{GenerateRequest, ListParametersRequest, SamplingParams, StopConditions, UpdateHeader, WeightProbe};
use cotrain_rollout_client::pool::update_stream;
use cotrain_rollout_client::wire::{UpdatedTensor, WireDType};
use support::*;
use tch::{Device, Kind, Tensor};
use tonic::transport::Channel;

fn vllm_python() -> String {
    std::env::var("COTRAIN_VLLM_PYTHON").unwrap_or_else(|_| {
        panic!("COTRAIN_VLLM_PYTHON is not set: run `COTRAIN_VLLM=cpu make setup` (make test does), which installs vLLM's CPU build and sets it")
    })
}

/// A worker serving `agents` with `--engine vllm` (f32 on the CPU, small KV caches).
async fn vllm_worker(agents: &[(&str, &str)]) -> WorkerProcess {
    let _ = vllm_python();
    WorkerProcess::start(agents, &["--engine", "vllm", "--max-batch-size", "16", "--vllm-kv-cache-gib", "1"]).await
}


fn greedy(agent: &str, prompts: Vec<Vec<u32>>, max_new_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        agent: agent.into(),
        prompts: prompts.into_iter().map(token_prompt).collect(),
        n: 1,
        sampling: Some(SamplingParams { temperature: Some(0.0), top_p: Some(1.0), top_k: 0, max_new_tokens, min_p: None, sampling_logprobs: false }),
        seed: 7,
        stop: Some(StopConditions { stop_strings: vec![], stop_token_ids: vec![], ignore_eos: true }),
        min_policy_version: None,
        request_id: String::new(),
    }
}

/// Per prompt, the first sample's tokens and log-probs, and the version that produced them.
async fn generate(c: &mut RolloutClient<Channel>, req: GenerateRequest) -> (Vec<(Vec<u32>, Vec<f32>)>, u64) {
    let r = c.generate(req).await.expect("generate").into_inner();
    let version = r.completions[0].samples[0].policy_version;
    (r.completions.into_iter().map(|c| (c.samples[0].token_ids.clone(), c.samples[0].logprobs.clone())).collect(), version)
}

fn assert_close(a: &[f32], b: &[f32], tol: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let worst = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
    assert!(worst <= tol, "{what}: largest log-prob difference {worst} > {tol}\n{a:?}\n{b:?}");
}

const PROMPTS: [&[u32]; 3] = [&[72, 101, 108, 108, 111], &[1, 2, 3, 4, 5, 6, 7, 8, 9], &[200, 13, 77]];

/// Greedy tokens through vLLM equal cotrain's engine's on the same f32 weights (two tiny
/// families and the embedded SmolLM2), with log-probs within float noise; sampled completions'
/// log-probs equal cotrain's recomputation of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_generates_what_cotrains_engine_generates() {
    let (llama, qwen2) = (TinyModel::vllm_sized("llama", 1), TinyModel::vllm_sized("qwen2", 2));
    let agents = [("alice", llama.spec()), ("bob", qwen2.spec()), ("carol", "default".to_string())];
    let agents: Vec<(&str, &str)> = agents.iter().map(|(a, s)| (*a, s.as_str())).collect();
    let ours = WorkerProcess::start(&agents, &[]).await;
    let theirs = vllm_worker(&agents).await;
    let (mut a, mut b) = (ours.client().await, theirs.client().await);
    for agent in ["alice", "bob"] {
        let prompts: Vec<Vec<u32>> = PROMPTS.iter().map(|p| p.to_vec()).collect();
        let (want, _) = generate(&mut a, greedy(agent, prompts.clone(), 24)).await;
        let (got, version) = generate(&mut b, greedy(agent, prompts, 24)).await;
        assert_eq!(version, 0);
        for (i, ((wt, wl), (gt, gl))) in want.iter().zip(&got).enumerate() {
            assert_eq!(gt, wt, "{agent}, prompt {i}: vLLM's greedy tokens differ from cotrain's");
            assert_close(gl, wl, 1e-3, &format!("{agent}, prompt {i}"));
        }
    }
    // SmolLM2 on a chat prompt, as the demo asks it.
    let tokenizer = cotrain_model::loader::load("default", &LoadOptions { device: Device::Cpu, kind: Kind::Float }).unwrap();
    let prompt = tokenizer.tokenizer.encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n", false).unwrap();
    let (want, _) = generate(&mut a, greedy("carol", vec![prompt.clone()], 32)).await;
    let (got, _) = generate(&mut b, greedy("carol", vec![prompt.clone()], 32)).await;
    assert_eq!(got[0].0, want[0].0, "SmolLM2: vLLM's greedy tokens differ from cotrain's");
    assert_close(&got[0].1, &want[0].1, 2e-3, "SmolLM2 greedy");

    // Sampled at the seeds' settings: vLLM's reported log-probs are the model's raw ones, as
    // cotrain recomputes them for the learner.
    let mut req = greedy("carol", vec![prompt.clone()], 24);
    req.n = 4;
    req.sampling = Some(SamplingParams { temperature: Some(0.8), top_p: Some(0.95), top_k: 0, max_new_tokens: 24, min_p: None, sampling_logprobs: false });
    let r = b.generate(req).await.expect("sample").into_inner();
    let samples = &r.completions[0].samples;
    assert_eq!(samples.len(), 4);
    let distinct: std::collections::HashSet<_> = samples.iter().map(|s| s.token_ids.clone()).collect();
    assert!(distinct.len() > 1, "four samples at temperature 0.8 were all the same");
    for s in samples {
        let seq: Vec<u32> = prompt.iter().chain(&s.token_ids).copied().collect();
        let all = cotrain_model::logprobs::sequence_logprobs(&tokenizer.model, &seq).unwrap();
        assert_close(&s.logprobs, &all[prompt.len() - 1..], 2e-3, "a sampled completion's log-probs");
    }
}

/// All of a model's parameters replaced by random values (deterministic in `seed`), as an update
/// and as the tensors a local copy loads.
async fn random_weights(c: &mut RolloutClient<Channel>, agent: &str, seed: u32) -> (Arc<Vec<UpdatedTensor>>, HashMap<String, Tensor>) {
    let params = c.list_parameters(ListParametersRequest { agent: agent.into() }).await.unwrap().into_inner().parameters;
    let mut wire = Vec::new();
    let mut local = HashMap::new();
    for (i, p) in params.iter().enumerate() {
        let numel: i64 = p.shape.iter().product();
        let data = random_f32_bytes(numel as usize, seed * 1000 + i as u32);
        let floats: Vec<f32> = data.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
        local.insert(p.name.clone(), Tensor::from_slice(&floats).reshape(p.shape.as_slice()));
        wire.push(UpdatedTensor { name: p.name.clone(), dtype: WireDType::F32, shape: p.shape.clone(), data });
    }
    (Arc::new(wire), local)
}

/// The probe the learner would send with `weights`: a cotrain copy of the model loads them and
/// scores a fixed sequence.
fn probe_of(spec: &str, weights: &HashMap<String, Tensor>) -> WeightProbe {
    let model = loader::load(spec, &LoadOptions { device: Device::Cpu, kind: Kind::Float }).unwrap();
    model.load_named_tensors(weights).unwrap();
    let token_ids: Vec<u32> = (10..40).collect();
    let logprobs = cotrain_model::logprobs::sequence_logprobs(&model.model, &token_ids).unwrap();
    WeightProbe { token_ids, logprobs, tolerance: 0.0 }
}

async fn push(c: &mut RolloutClient<Channel>, agent: &str, version: u64, tensors: Arc<Vec<UpdatedTensor>>, probe: Option<WeightProbe>) -> Result<u64, tonic::Status> {
    let header = UpdateHeader { agent: agent.into(), version, tensor_count: tensors.len() as u32, partial: false, lora_scaling: 0.0, probe };
    c.update_weights(update_stream(header, tensors, 1 << 16)).await.map(|r| r.into_inner().version)
}

/// Pushed weights reach the running engine (its greedy output then equals cotrain's engine's on
/// the same push); a push whose weights do not match its probe is refused and the previous
/// weights stay; an engine killed with SIGKILL is restarted with the current weights before it
/// serves again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushes_reload_the_engine_wrong_ones_are_caught_and_a_killed_engine_comes_back() {
    let model = TinyModel::vllm_sized("llama", 3);
    let spec = model.spec();
    let ours = WorkerProcess::start(&[("alice", &spec)], &[]).await;
    let theirs = vllm_worker(&[("alice", &spec)]).await;
    let (mut a, mut b) = (ours.client().await, theirs.client().await);
    let prompts = || PROMPTS.iter().map(|p| p.to_vec()).collect::<Vec<_>>();
    let (before, _) = generate(&mut b, greedy("alice", prompts(), 16)).await;

    let (v1, v1_local) = random_weights(&mut a, "alice", 1).await;
    push(&mut a, "alice", 1, v1.clone(), None).await.expect("cotrain engine takes v1");
    assert_eq!(push(&mut b, "alice", 1, v1, Some(probe_of(&spec, &v1_local))).await.expect("vllm takes v1"), 1);
    let (want, _) = generate(&mut a, greedy("alice", prompts(), 16)).await;
    let (got, version) = generate(&mut b, greedy("alice", prompts(), 16)).await;
    assert_eq!(version, 1);
    assert_ne!(got, before, "the push changed nothing");
    for (i, (w, g)) in want.iter().zip(&got).enumerate() {
        assert_eq!(g.0, w.0, "prompt {i}: after the push vLLM's greedy tokens differ from cotrain's");
        assert_close(&g.1, &w.1, 1e-3, &format!("prompt {i} after the push"));
    }

    // Weights that are not the ones the probe was computed on: refused, v1 stays in place.
    let (v2, _) = random_weights(&mut a, "alice", 2).await;
    let e = push(&mut b, "alice", 2, v2, Some(probe_of(&spec, &v1_local))).await.expect_err("a wrong push is refused");
    let msg = e.message();
    assert!(msg.contains("alice") && msg.contains("v2") && msg.contains("probe token") && msg.contains("(v1) are back"), "{msg}");
    let (still, version) = generate(&mut b, greedy("alice", prompts(), 16)).await;
    assert_eq!(version, 1);
    assert_eq!(still, got, "after a refused push the engine must serve v1");

    // SIGKILL the engine (the worker's child process and everything it started).
    let pids = std::process::Command::new("pgrep").args(["-P", &theirs.child.id().to_string()]).output().unwrap();
    let pids = String::from_utf8_lossy(&pids.stdout).to_string();
    let engine: i32 = pids.split_whitespace().next().expect("the engine is a child of the worker").parse().unwrap();
    // SAFETY: a signal to the engine's process group.
    assert_eq!(unsafe { libc::killpg(engine, libc::SIGKILL) }, 0);
    let (after, version) = generate(&mut b, greedy("alice", prompts(), 16)).await;
    assert_eq!(version, 1);
    assert_eq!(after, got, "the restarted engine must serve the v1 weights");
    // And it takes the next push.
    let (v3, v3_local) = random_weights(&mut a, "alice", 3).await;
    assert_eq!(push(&mut b, "alice", 3, v3, Some(probe_of(&spec, &v3_local))).await.expect("v3 after the restart"), 3);
    let _ = Duration::from_secs(0);
}

/// `--engine vllm` without a usable vLLM stops at once and says which variable to set.
#[test]
fn a_missing_vllm_is_refused_with_what_to_set() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_rollout-worker"))
        .args(["serve", "--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0", "--agent", "a=default", "--engine", "vllm"])
        .env("COTRAIN_VLLM_PYTHON", "/nonexistent/python3")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent/python3") && err.contains("COTRAIN_VLLM=cpu make setup") && err.contains("COTRAIN_VLLM_PYTHON"), "{err}");
}

/// A model vLLM loads but cannot run (its CPU attention kernels have no head size 16, the committed
/// fixtures' size) stops the worker at start with vLLM's own reason, not at the first request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_vllm_cannot_run_is_refused_at_start_with_its_reason() {
    let _ = vllm_python();
    let model = TinyModel::new("llama");
    std::fs::write(model.path().join("tokenizer_config.json"), r#"{"tokenizer_class": "PreTrainedTokenizerFast"}"#).unwrap();
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_rollout-worker"))
        .args(["serve", "--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0", "--engine", "vllm", "--vllm-kv-cache-gib", "1"])
        .arg("--agent")
        .arg(format!("a={}", model.spec()))
        .env("RUST_LOG", "error")
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot run it") && err.contains("head_dim=16"), "{err}");
}
