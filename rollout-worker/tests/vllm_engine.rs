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
use cotrain_proto::rollout::{
    GenerateRequest, ListParametersRequest, SamplingParams, StopConditions, UpdateHeader,
    WeightProbe,
};
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
    WorkerProcess::start(
        agents,
        &[
            "--engine",
            "vllm",
            "--max-batch-size",
            "16",
            "--vllm-kv-cache-gib",
            "1",
        ],
    )
    .await
}

fn greedy(agent: &str, prompts: Vec<Vec<u32>>, max_new_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        agent: agent.into(),
        prompts: prompts.into_iter().map(token_prompt).collect(),
        n: 1,
        sampling: Some(SamplingParams {
            temperature: Some(0.0),
            top_p: Some(1.0),
            top_k: 0,
            max_new_tokens,
            min_p: None,
            sampling_logprobs: false,
        }),
        seed: 7,
        stop: Some(StopConditions {
            stop_strings: vec![],
            stop_token_ids: vec![],
            ignore_eos: true,
        }),
        min_policy_version: None,
        request_id: String::new(),
    }
}

/// Per prompt, the first sample's tokens and log-probs, and the version that produced them.
async fn generate(
    c: &mut RolloutClient<Channel>,
    req: GenerateRequest,
) -> (Vec<(Vec<u32>, Vec<f32>)>, u64) {
    let r = c.generate(req).await.expect("generate").into_inner();
    let version = r.completions[0].samples[0].policy_version;
    (
        r.completions
            .into_iter()
            .map(|c| {
                (
                    c.samples[0].token_ids.clone(),
                    c.samples[0].logprobs.clone(),
                )
            })
            .collect(),
        version,
    )
}

fn assert_close(a: &[f32], b: &[f32], tol: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let worst = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(
        worst <= tol,
        "{what}: largest log-prob difference {worst} > {tol}\n{a:?}\n{b:?}"
    );
}

const PROMPTS: [&[u32]; 3] = [
    &[72, 101, 108, 108, 111],
    &[1, 2, 3, 4, 5, 6, 7, 8, 9],
    &[200, 13, 77],
];

/// Greedy tokens through vLLM equal cotrain's engine's on the same f32 weights (two tiny
/// families and the embedded SmolLM2), with log-probs within float noise; sampled completions'
/// log-probs equal cotrain's recomputation of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_generates_what_cotrains_engine_generates() {
    let (llama, qwen2) = (
        TinyModel::vllm_sized("llama", 1),
        TinyModel::vllm_sized("qwen2", 2),
    );
    let agents = [
        ("alice", llama.spec()),
        ("bob", qwen2.spec()),
        ("carol", "default".to_string()),
    ];
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
            assert_eq!(
                gt, wt,
                "{agent}, prompt {i}: vLLM's greedy tokens differ from cotrain's"
            );
            assert_close(gl, wl, 1e-3, &format!("{agent}, prompt {i}"));
        }
    }
    // SmolLM2 on a chat prompt, as the demo asks it.
    let tokenizer = cotrain_model::loader::load(
        "default",
        &LoadOptions {
            device: Device::Cpu,
            kind: Kind::Float,
        },
    )
    .unwrap();
    let prompt = tokenizer
        .tokenizer
        .encode(
            "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
            false,
        )
        .unwrap();
    let (want, _) = generate(&mut a, greedy("carol", vec![prompt.clone()], 32)).await;
    let (got, _) = generate(&mut b, greedy("carol", vec![prompt.clone()], 32)).await;
    assert_eq!(
        got[0].0, want[0].0,
        "SmolLM2: vLLM's greedy tokens differ from cotrain's"
    );
    assert_close(&got[0].1, &want[0].1, 2e-3, "SmolLM2 greedy");

    // Sampled at the seeds' settings: vLLM's reported log-probs are the model's raw ones, as
    // cotrain recomputes them for the learner.
    let mut req = greedy("carol", vec![prompt.clone()], 24);
    req.n = 4;
    req.sampling = Some(SamplingParams {
        temperature: Some(0.8),
        top_p: Some(0.95),
        top_k: 0,
        max_new_tokens: 24,
        min_p: None,
        sampling_logprobs: false,
    });
    let r = b.generate(req).await.expect("sample").into_inner();
    let samples = &r.completions[0].samples;
    assert_eq!(samples.len(), 4);
    let distinct: std::collections::HashSet<_> =
        samples.iter().map(|s| s.token_ids.clone()).collect();
    assert!(
        distinct.len() > 1,
        "four samples at temperature 0.8 were all the same"
    );
    for s in samples {
        let seq: Vec<u32> = prompt.iter().chain(&s.token_ids).copied().collect();
        let all = cotrain_model::logprobs::sequence_logprobs(&tokenizer.model, &seq).unwrap();
        assert_close(
            &s.logprobs,
            &all[prompt.len() - 1..],
            2e-3,
            "a sampled completion's log-probs",
        );
    }
}

/// All of a model's parameters replaced by random values (deterministic in `seed`), as an update
/// and as the tensors a local copy loads.
async fn random_weights(
    c: &mut RolloutClient<Channel>,
    agent: &str,
    seed: u32,
) -> (Arc<Vec<UpdatedTensor>>, HashMap<String, Tensor>) {
    let params = c
        .list_parameters(ListParametersRequest {
            agent: agent.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .parameters;
    let mut wire = Vec::new();
    let mut local = HashMap::new();
    for (i, p) in params.iter().enumerate() {
        let numel: i64 = p.shape.iter().product();
        let data = random_f32_bytes(numel as usize, seed * 1000 + i as u32);
        let floats: Vec<f32> = data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        local.insert(
            p.name.clone(),
            Tensor::from_slice(&floats).reshape(p.shape.as_slice()),
        );
        wire.push(UpdatedTensor {
            name: p.name.clone(),
            dtype: WireDType::F32,
            shape: p.shape.clone(),
            data,
        });
    }
    (Arc::new(wire), local)
}

/// The probe the learner would send with `weights`: a cotrain copy of the model loads them and
/// scores a fixed sequence.
fn probe_of(spec: &str, weights: &HashMap<String, Tensor>) -> WeightProbe {
    let model = loader::load(
        spec,
        &LoadOptions {
            device: Device::Cpu,
            kind: Kind::Float,
        },
    )
    .unwrap();
    model.load_named_tensors(weights).unwrap();
    let token_ids: Vec<u32> = (10..40).collect();
    let logprobs = cotrain_model::logprobs::sequence_logprobs(&model.model, &token_ids).unwrap();
    WeightProbe {
        token_ids,
        logprobs,
        tolerance: 0.0,
    }
}

async fn push(
    c: &mut RolloutClient<Channel>,
    agent: &str,
    version: u64,
    tensors: Arc<Vec<UpdatedTensor>>,
    probe: Option<WeightProbe>,
) -> Result<u64, tonic::Status> {
    let header = UpdateHeader {
        agent: agent.into(),
        version,
        tensor_count: tensors.len() as u32,
        partial: false,
        lora_scaling: 0.0,
        probe,
    };
    c.update_weights(update_stream(header, tensors, 1 << 16))
        .await
        .map(|r| r.into_inner().version)
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
    push(&mut a, "alice", 1, v1.clone(), None)
        .await
        .expect("cotrain engine takes v1");
    assert_eq!(
        push(&mut b, "alice", 1, v1, Some(probe_of(&spec, &v1_local)))
            .await
            .expect("vllm takes v1"),
        1
    );
    let (want, _) = generate(&mut a, greedy("alice", prompts(), 16)).await;
    let (got, version) = generate(&mut b, greedy("alice", prompts(), 16)).await;
    assert_eq!(version, 1);
    assert_ne!(got, before, "the push changed nothing");
    for (i, (w, g)) in want.iter().zip(&got).enumerate() {
        assert_eq!(
            g.0, w.0,
            "prompt {i}: after the push vLLM's greedy tokens differ from cotrain's"
        );
        assert_close(&g.1, &w.1, 1e-3, &format!("prompt {i} after the push"));
    }

    // Weights that are not the ones the probe was computed on: refused, v1 stays in place.
    let (v2, _) = random_weights(&mut a, "alice", 2).await;
    let e = push(&mut b, "alice", 2, v2, Some(probe_of(&spec, &v1_local)))
        .await
        .expect_err("a wrong push is refused");
    let msg = e.message();
    assert!(
        msg.contains("alice")
            && msg.contains("v2")
            && msg.contains("probe token")
            && msg.contains("(v1) are back"),
        "{msg}"
    );
    let (still, version) = generate(&mut b, greedy("alice", prompts(), 16)).await;
    assert_eq!(version, 1);
    assert_eq!(still, got, "after a refused push the engine must serve v1");

    // SIGKILL the engine (the worker's child process and everything it started).
    let pids = std::process::Command::new("pgrep")
        .args(["-P", &theirs.child.id().to_string()])
        .output()
        .unwrap();
    let pids = String::from_utf8_lossy(&pids.stdout).to_string();
    let engine: i32 = pids
        .split_whitespace()
        .next()
        .expect("the engine is a child of the worker")
        .parse()
        .unwrap();
    // SAFETY: a signal to the engine's process group.
    assert_eq!(unsafe { libc::killpg(engine, libc::SIGKILL) }, 0);
    let (after, version) = generate(&mut b, greedy("alice", prompts(), 16)).await;
    assert_eq!(version, 1);
    assert_eq!(after, got, "the restarted engine must serve the v1 weights");
    // And it takes the next push.
    let (v3, v3_local) = random_weights(&mut a, "alice", 3).await;
    assert_eq!(
        push(&mut b, "alice", 3, v3, Some(probe_of(&spec, &v3_local)))
            .await
            .expect("v3 after the restart"),
        3
    );
    let _ = Duration::from_secs(0);
}

/// `--engine vllm` without a usable vLLM stops at once and says which variable to set.
#[test]
fn a_missing_vllm_is_refused_with_what_to_set() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_rollout-worker"))
        .args([
            "serve",
            "--grpc-addr",
            "127.0.0.1:0",
            "--http-addr",
            "127.0.0.1:0",
            "--agent",
            "a=default",
            "--engine",
            "vllm",
        ])
        .env("COTRAIN_VLLM_PYTHON", "/nonexistent/python3")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("/nonexistent/python3")
            && err.contains("COTRAIN_VLLM=cpu make setup")
            && err.contains("COTRAIN_VLLM_PYTHON"),
        "{err}"
    );
}

/// A model vLLM loads but cannot run (its CPU attention kernels have no head size 16, the committed
/// fixtures' size) stops the worker at start with vLLM's own reason, not at the first request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_vllm_cannot_run_is_refused_at_start_with_its_reason() {
    let _ = vllm_python();
    let model = TinyModel::new("llama");
    std::fs::write(
        model.path().join("tokenizer_config.json"),
        r#"{"tokenizer_class": "PreTrainedTokenizerFast"}"#,
    )
    .unwrap();
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_rollout-worker"))
        .args([
            "serve",
            "--grpc-addr",
            "127.0.0.1:0",
            "--http-addr",
            "127.0.0.1:0",
            "--engine",
            "vllm",
            "--vllm-kv-cache-gib",
            "1",
        ])
        .arg("--agent")
        .arg(format!("a={}", model.spec()))
        .env("RUST_LOG", "error")
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("cannot run it") && err.contains("head_dim=16"),
        "{err}"
    );
}

/// A rank-8 LoRA pair on every projection of the model (A and B random, deterministic in `seed`),
/// as an update and as the tensors `lora::merge_into` reads.
fn lora_pairs(
    params: &[cotrain_proto::rollout::ParameterInfo],
    seed: u32,
) -> (
    Arc<Vec<UpdatedTensor>>,
    std::collections::BTreeMap<String, Tensor>,
) {
    const RANK: i64 = 8;
    let mut wire = Vec::new();
    let mut local = std::collections::BTreeMap::new();
    for (i, p) in params.iter().enumerate() {
        let Some(stem) = p.name.strip_suffix("_proj.weight") else {
            continue;
        };
        let (rows, cols) = (p.shape[0], p.shape[1]);
        for (half, shape) in [("lora_A", vec![RANK, cols]), ("lora_B", vec![rows, RANK])] {
            let numel = (shape[0] * shape[1]) as usize;
            let data = random_f32_bytes(
                numel,
                seed * 1000 + 2 * i as u32 + u32::from(half == "lora_B"),
            );
            let floats: Vec<f32> = data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            let name = format!("{stem}_proj.{half}.weight");
            local.insert(
                name.clone(),
                Tensor::from_slice(&floats).reshape(shape.as_slice()),
            );
            wire.push(UpdatedTensor {
                name,
                dtype: WireDType::F32,
                shape,
                data,
            });
        }
    }
    (Arc::new(wire), local)
}

const LORA_SCALING: f64 = 2.0;

/// The probe the learner sends with an adapter: a cotrain copy of the base with the adapter merged.
fn adapter_probe(spec: &str, pairs: &std::collections::BTreeMap<String, Tensor>) -> WeightProbe {
    let loaded = loader::load(
        spec,
        &LoadOptions {
            device: Device::Cpu,
            kind: Kind::Float,
        },
    )
    .unwrap();
    let base = loaded.named_parameters();
    let merged = cotrain_model::lora::merge_into(
        |n| base.get(n).map(Tensor::shallow_clone),
        pairs,
        LORA_SCALING,
    )
    .unwrap();
    probe_of(spec, &merged.into_iter().collect())
}

async fn push_adapter(
    c: &mut RolloutClient<Channel>,
    agent: &str,
    version: u64,
    pairs: Arc<Vec<UpdatedTensor>>,
    probe: Option<WeightProbe>,
) -> Result<u64, tonic::Status> {
    let header = UpdateHeader {
        agent: agent.into(),
        version,
        tensor_count: pairs.len() as u32,
        partial: true,
        lora_scaling: LORA_SCALING,
        probe,
    };
    c.update_weights(update_stream(header, pairs, 1 << 16))
        .await
        .map(|r| r.into_inner().version)
}

/// `serve --adapters alice,bob --engine vllm`: one engine with vLLM's multi-LoRA serves both agents
/// on one base. An adapter pushed for alice is loaded as her v1 (her greedy output then equals
/// cotrain's engine serving the same adapter, and her samples report v1) while bob, with no adapter
/// yet, gets the base at v0 in the same batches; an adapter whose probe does not match is refused
/// naming the agent and version, and her v1 keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapter_group_is_served_by_vllms_multi_lora() {
    let model = TinyModel::vllm_sized("llama", 5);
    let spec = model.spec();
    let agents = [("alice", spec.as_str()), ("bob", spec.as_str())];
    let ours = WorkerProcess::start(&agents, &["--adapters", "alice,bob"]).await;
    let _ = vllm_python();
    let theirs = WorkerProcess::start(
        &agents,
        &[
            "--engine",
            "vllm",
            "--adapters",
            "alice,bob",
            "--max-batch-size",
            "16",
            "--vllm-kv-cache-gib",
            "1",
        ],
    )
    .await;
    assert_eq!(
        theirs.info().await.models.len(),
        1,
        "one engine for the group"
    );
    let (mut a, mut b) = (ours.client().await, theirs.client().await);
    let prompts: Vec<Vec<u32>> = PROMPTS.iter().map(|p| p.to_vec()).collect();
    let (base, _) = generate(&mut b, greedy("bob", prompts.clone(), 16)).await;

    let params = b
        .list_parameters(ListParametersRequest {
            agent: "alice".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .parameters;
    let (pairs, local) = lora_pairs(&params, 1);
    assert_eq!(
        push_adapter(&mut a, "alice", 1, pairs.clone(), None)
            .await
            .expect("cotrain takes the adapter"),
        1
    );
    assert_eq!(
        push_adapter(
            &mut b,
            "alice",
            1,
            pairs,
            Some(adapter_probe(&spec, &local))
        )
        .await
        .expect("vllm takes the adapter"),
        1
    );

    let (want, _) = generate(&mut a, greedy("alice", prompts.clone(), 16)).await;
    let (mut b2, mut b3) = (theirs.client().await, theirs.client().await);
    let ((got, alice_version), (plain, bob_version)) = tokio::join!(
        generate(&mut b2, greedy("alice", prompts.clone(), 16)),
        generate(&mut b3, greedy("bob", prompts.clone(), 16))
    );
    assert_eq!((alice_version, bob_version), (1, 0));
    for (i, ((wt, wl), (gt, gl))) in want.iter().zip(&got).enumerate() {
        assert_eq!(
            gt, wt,
            "prompt {i}: vLLM's adapter output differs from cotrain's"
        );
        assert_close(gl, wl, 1e-3, &format!("alice's adapter, prompt {i}"));
    }
    assert_ne!(got, base, "the adapter did not change the output");
    for ((pt, pl), (bt, bl)) in plain.iter().zip(&base) {
        assert_eq!(pt, bt, "bob (no adapter) is the base");
        assert_close(pl, bl, 1e-4, "bob beside alice's adapter");
    }

    // A push whose probe belongs to other weights is refused; v1 serves on.
    let (other, other_local) = lora_pairs(&params, 2);
    let wrong_probe = adapter_probe(&spec, &local);
    assert_ne!(other_local.len(), 0);
    let e = push_adapter(&mut b, "alice", 2, other, Some(wrong_probe))
        .await
        .expect_err("a wrong adapter must be refused");
    assert!(
        e.message().contains("agent alice v2") && e.message().contains("v1 keeps serving"),
        "{}",
        e.message()
    );
    let (after, version) = generate(&mut b, greedy("alice", prompts, 16)).await;
    assert_eq!(version, 1);
    assert_eq!(
        after.iter().map(|(t, _)| t).collect::<Vec<_>>(),
        got.iter().map(|(t, _)| t).collect::<Vec<_>>()
    );
    let info = theirs.info().await;
    let versions: Vec<(String, u64)> = info
        .agents
        .iter()
        .map(|a| (a.name.clone(), a.policy_version))
        .collect();
    assert_eq!(versions, vec![("alice".into(), 1), ("bob".into(), 0)]);
}
