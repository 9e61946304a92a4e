//! Adapter-only weight updates end to end: the real binary on an ephemeral port, LoRA pairs sent
//! through the client pool as gRPC chunks and through a shared-memory file, merged by the worker
//! into its base weights; or, for an adapter group (`serve --adapters`), served unmerged on one
//! base; and `generate --adapter DIR` serving a PEFT directory unmerged.

mod support;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use cotrain_model::engine::{
    Engine, LogprobMode, Request, SamplingParams as EngineSampling, StopConditions as EngineStop,
};
use cotrain_model::loader::{self, LoadOptions};
use cotrain_proto::rollout::rollout_client::RolloutClient;
use cotrain_proto::rollout::{ListParametersRequest, ParameterInfo, Sample, UpdateHeader};
use cotrain_rollout_client::pool::{PoolConfig, RolloutPool, update_stream};
use cotrain_rollout_client::shm::ShmFile;
use cotrain_rollout_client::wire::{UpdatedTensor, WireDType};
use cotrain_rollout_worker::weights::UpdatedTensorExt;
use support::*;
use tch::Tensor;
use tonic::Code;
use tonic::transport::Channel;

const AGENT: &str = "alice";
const RANK: i64 = 2;
const SCALING: f64 = 2.0;
const PROMPT: [u32; 4] = [7, 42, 99, 3];
const NEW_TOKENS: u32 = 16;

/// A rank-[`RANK`] adapter on every attention and MLP projection of the model: `A` random, `B`
/// random or (with `zero_b`) zeros, which makes the merged weights the base's.
fn adapter(params: &[ParameterInfo], seed: u32, zero_b: bool) -> Vec<UpdatedTensor> {
    let mut out = Vec::new();
    for (i, p) in params.iter().enumerate() {
        let Some(stem) = p.name.strip_suffix("_proj.weight") else {
            continue;
        };
        let (rows, cols) = (p.shape[0], p.shape[1]);
        let a = random_f32_bytes((RANK * cols) as usize, seed + 2 * i as u32);
        let b = if zero_b {
            vec![0; (rows * RANK) as usize * 4]
        } else {
            random_f32_bytes((rows * RANK) as usize, seed + 2 * i as u32 + 1)
        };
        out.push(UpdatedTensor {
            name: format!("{stem}_proj.lora_A.weight"),
            dtype: WireDType::F32,
            shape: vec![RANK, cols],
            data: a,
        });
        out.push(UpdatedTensor {
            name: format!("{stem}_proj.lora_B.weight"),
            dtype: WireDType::F32,
            shape: vec![rows, RANK],
            data: b,
        });
    }
    out
}

fn adapter_header(version: u64) -> UpdateHeader {
    // `tensor_count` is set by the pool.
    UpdateHeader {
        agent: AGENT.into(),
        version,
        tensor_count: 0,
        partial: true,
        lora_scaling: SCALING,
        probe: None,
    }
}

/// One greedy sample of [`PROMPT`], with its log-probs.
async fn probe(c: &mut RolloutClient<Channel>) -> Sample {
    let mut req = request(
        AGENT,
        vec![token_prompt(PROMPT.to_vec())],
        1,
        11,
        NEW_TOKENS,
    );
    req.sampling.as_mut().unwrap().temperature = Some(0.0);
    let mut resp = c.generate(req).await.expect("generate").into_inner();
    resp.completions.remove(0).samples.remove(0)
}

/// The same greedy sample from an engine in this process whose weights are the base merged with
/// the adapter by `cotrain_model::lora::merge_into`: what the worker must serve.
fn reference(spec: &str, adapter: &[UpdatedTensor]) -> cotrain_model::engine::Sample {
    let loaded = loader::load(spec, &LoadOptions::default()).unwrap();
    let base = loaded.named_parameters();
    let tensors: BTreeMap<String, Tensor> = adapter
        .iter()
        .map(|t| (t.name.clone(), t.to_tensor()))
        .collect();
    let merged = cotrain_model::lora::merge_into(
        |n| base.get(n).map(Tensor::shallow_clone),
        &tensors,
        SCALING,
    )
    .unwrap();
    loaded
        .load_named_tensors(&merged.into_iter().collect::<HashMap<_, _>>())
        .unwrap();
    let mut engine = Engine::new(loaded);
    let req = Request {
        prompt: PROMPT.to_vec(),
        n: 1,
        params: EngineSampling {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
        },
        seed: 11,
        stop: EngineStop {
            max_new_tokens: NEW_TOKENS as usize,
            stop_token_ids: vec![],
            stop_strings: vec![],
            ignore_eos: true,
        },
        logprobs: LogprobMode::Raw,
        top_logprobs: 0,
    };
    engine.generate(&[req]).unwrap().remove(0).remove(0)
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapter_updates_merge_into_the_pristine_base_over_grpc_and_shm() {
    let model = TinyModel::new("llama");
    let w = WorkerProcess::start(&[(AGENT, &model.spec())], &["--allow-shm-weights"]).await;
    let mut c = w.client().await;
    let params = c
        .list_parameters(ListParametersRequest {
            agent: AGENT.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .parameters;
    let base = probe(&mut c).await;
    assert_eq!(base.policy_version, 0);

    let adapted = adapter(&params, 1, false);
    let pairs = adapted.len() / 2;
    assert_eq!(pairs, 2 * 7, "every projection of both layers");
    let adapter_bytes: usize = adapted.iter().map(|t| t.data.len()).sum();
    let full_bytes: i64 = params
        .iter()
        .map(|p| p.shape.iter().product::<i64>() * 4)
        .sum();
    println!(
        "update bytes for the tiny model (f32): adapter (rank {RANK}, {} tensors) {adapter_bytes}, full ({} tensors) {full_bytes} ({:.1}%)",
        adapted.len(),
        params.len(),
        100.0 * adapter_bytes as f64 / full_bytes as f64
    );

    // v1: the adapter as gRPC chunks through the pool. The worker serves the merged weights.
    let pool = RolloutPool::new(PoolConfig {
        endpoints: vec![w.endpoint()],
        ..PoolConfig::default()
    })
    .await
    .unwrap();
    let adapted = Arc::new(adapted);
    let answers = pool
        .push_update_except(adapter_header(1), adapted.clone(), &HashSet::new())
        .await;
    let ok = answers[0].1.as_ref().expect("adapter update accepted");
    assert_eq!(
        (
            ok.version,
            ok.tensors_updated as usize,
            ok.bytes_received as usize
        ),
        (1, pairs, adapter_bytes)
    );
    let after = probe(&mut c).await;
    assert_eq!(after.policy_version, 1);
    assert!(
        max_abs_diff(&after.logprobs, &base.logprobs) > 1e-2,
        "the adapter did not change the policy"
    );
    assert_ne!(
        after.token_ids, base.token_ids,
        "the adapter did not change the greedy output"
    );
    let want = reference(&model.spec(), &adapted);
    assert_eq!(
        after.token_ids, want.token_ids,
        "the worker's merge differs from merge_into"
    );
    assert!(
        max_abs_diff(&after.logprobs, &want.logprobs) < 1e-4,
        "{:?} vs {:?}",
        after.logprobs,
        want.logprobs
    );
    assert_eq!(w.info().await.agents[0].policy_version, 1);

    // v2: the same A with B = 0, through shared memory. Merged into the pristine base, not into
    // v1's weights, it restores the base exactly.
    let zero = adapter(&params, 1, true);
    let mut file = ShmFile::create(AGENT, 2).expect("create a file in /dev/shm");
    for t in &zero {
        file.write_tensor(&t.name, t.dtype, &t.shape, &t.data)
            .unwrap();
    }
    file.finish().unwrap();
    let answers = pool
        .push_update_shm(adapter_header(2), &file.message())
        .await;
    let ok = answers[0].1.as_ref().expect("shm adapter update accepted");
    assert_eq!((ok.version, ok.tensors_updated as usize), (2, pairs));
    drop(file);
    let restored = probe(&mut c).await;
    assert_eq!(restored.policy_version, 2);
    assert_eq!(restored.token_ids, base.token_ids);
    assert_eq!(
        restored.logprobs, base.logprobs,
        "a zero adapter must give back the base exactly"
    );

    // v3: a malformed adapter (lora_A one column too wide) is refused, naming the tensor, and
    // leaves version and weights alone.
    let mut bad = adapter(&params, 3, false);
    let t = &mut bad[0];
    t.shape[1] += 1;
    t.data = random_f32_bytes((t.shape[0] * t.shape[1]) as usize, 5);
    let bad_name = t.name.clone();
    assert!(bad_name.ends_with(".lora_A.weight"), "{bad_name}");
    let header = UpdateHeader {
        tensor_count: bad.len() as u32,
        ..adapter_header(3)
    };
    let e = c
        .update_weights(update_stream(header, Arc::new(bad), 1 << 16))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(
        e.message().contains(&format!("`{bad_name}`")),
        "{}",
        e.message()
    );
    assert!(e.message().contains("does not fit"), "{}", e.message());
    assert_eq!(w.info().await.agents[0].policy_version, 2);
    let still = probe(&mut c).await;
    assert_eq!(
        (still.policy_version, &still.token_ids, &still.logprobs),
        (2, &base.token_ids, &base.logprobs)
    );
}

/// One greedy sample of [`PROMPT`] from `agent`.
async fn probe_agent(c: &mut RolloutClient<Channel>, agent: &str) -> Sample {
    let mut req = request(
        agent,
        vec![token_prompt(PROMPT.to_vec())],
        1,
        11,
        NEW_TOKENS,
    );
    req.sampling.as_mut().unwrap().temperature = Some(0.0);
    let mut resp = c.generate(req).await.expect("generate").into_inner();
    resp.completions.remove(0).samples.remove(0)
}

/// `serve --adapters alice,bob,carol`: three agents on one loaded base, each served as its own
/// adapter without merging. Requests of all three decode together; each agent's greedy tokens are
/// those of the base with its adapter merged in (or the base itself before its first update), each
/// has its own version, a parameter update is refused for them, and the OpenAI endpoint serves an
/// agent as `BASE:AGENT`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapter_group_serves_each_agent_unmerged_on_one_base() {
    let model = TinyModel::new("llama");
    let spec = model.spec();
    let agents = [
        ("alice", spec.as_str()),
        ("bob", spec.as_str()),
        ("carol", spec.as_str()),
    ];
    let w = WorkerProcess::start(&agents, &["--adapters", "alice,bob,carol"]).await;
    let info = w.info().await;
    assert_eq!(
        info.models.len(),
        1,
        "one base for the three agents: {:?}",
        info.models
    );
    let mut c = w.client().await;
    let params = c
        .list_parameters(ListParametersRequest {
            agent: "alice".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .parameters;
    let base = probe_agent(&mut c, "carol").await;

    let pool = RolloutPool::new(PoolConfig {
        endpoints: vec![w.endpoint()],
        ..PoolConfig::default()
    })
    .await
    .unwrap();
    let adapters = [
        ("alice", Arc::new(adapter(&params, 1, false))),
        ("bob", Arc::new(adapter(&params, 7, false))),
    ];
    for (agent, tensors) in &adapters {
        let header = UpdateHeader {
            agent: agent.to_string(),
            ..adapter_header(1)
        };
        let answers = pool
            .push_update_except(header, tensors.clone(), &HashSet::new())
            .await;
        let ok = answers[0].1.as_ref().expect("adapter update accepted");
        assert_eq!(
            (ok.version, ok.agents.clone()),
            (1, vec![agent.to_string()])
        );
    }
    let info = w.info().await;
    let versions: Vec<(String, u64)> = info
        .agents
        .iter()
        .map(|a| (a.name.clone(), a.policy_version))
        .collect();
    assert_eq!(
        versions,
        vec![("alice".into(), 1), ("bob".into(), 1), ("carol".into(), 0)]
    );

    // The three at once, so that their sequences share the engine's batches.
    let (mut c1, mut c2, mut c3) = (w.client().await, w.client().await, w.client().await);
    let (a, b, plain) = tokio::join!(
        probe_agent(&mut c1, "alice"),
        probe_agent(&mut c2, "bob"),
        probe_agent(&mut c3, "carol")
    );
    for ((agent, tensors), got) in adapters.iter().zip([&a, &b]) {
        let want = reference(&spec, tensors);
        assert_eq!(
            got.token_ids, want.token_ids,
            "{agent}: unmerged adapter vs merged model greedy tokens"
        );
        assert!(
            max_abs_diff(&got.logprobs, &want.logprobs) < 1e-4,
            "{agent}: {:?} vs {:?}",
            got.logprobs,
            want.logprobs
        );
        assert_eq!(got.policy_version, 1);
        assert_ne!(
            got.token_ids, base.token_ids,
            "{agent}: the adapter did not change the greedy output"
        );
    }
    assert_ne!(a.token_ids, b.token_ids);
    // The base agent's sequences may decode beside adapter rows (a batch of another shape): equal up
    // to rounding.
    assert_eq!(
        (plain.token_ids.clone(), plain.policy_version),
        (base.token_ids.clone(), 0)
    );
    assert!(
        max_abs_diff(&plain.logprobs, &base.logprobs) < 1e-4,
        "{:?} vs {:?}",
        plain.logprobs,
        base.logprobs
    );

    // Parameters cannot be pushed to an adapter agent.
    let full: Vec<UpdatedTensor> = params
        .iter()
        .filter(|p| p.name.ends_with("q_proj.weight"))
        .map(|p| UpdatedTensor {
            name: p.name.clone(),
            dtype: WireDType::F32,
            shape: p.shape.clone(),
            data: random_f32_bytes(p.shape.iter().product::<i64>() as usize, 3),
        })
        .collect();
    let header = UpdateHeader {
        agent: "carol".into(),
        version: 1,
        tensor_count: full.len() as u32,
        partial: true,
        lora_scaling: 0.0,
        probe: None,
    };
    let e = c
        .update_weights(update_stream(header, Arc::new(full), 1 << 16))
        .await
        .unwrap_err();
    assert!(
        e.message().contains("takes adapter updates"),
        "{}",
        e.message()
    );

    // OpenAI: `BASE:AGENT` names bob's adapter; /v1/models lists it so.
    let http = format!("http://{}", w.http);
    let models: serde_json::Value = reqwest::get(format!("{http}/v1/models"))
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
    let named = format!("{spec}:bob");
    assert!(
        ids.contains(&named.as_str()) && ids.contains(&"bob"),
        "{ids:?}"
    );
    let body = serde_json::json!({"model": named, "prompt": PROMPT.to_vec(), "max_tokens": NEW_TOKENS, "temperature": 0.0,
        "ignore_eos": true, "return_token_ids": true});
    let r: serde_json::Value = reqwest::Client::new()
        .post(format!("{http}/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ids: Vec<u32> = r["choices"][0]["token_ids"]
        .as_array()
        .unwrap_or_else(|| panic!("{r}"))
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(ids, b.token_ids, "{r}");
}

/// `rollout-worker generate --adapter DIR` serves a PEFT adapter directory unmerged on top of
/// `--model`: the same greedy tokens as the model with that adapter merged in (written as a model
/// directory), and a directory that is not an adapter is refused naming it.
/// A PEFT adapter directory for `model` (B random, naming the model's directory as its base) and the
/// model with it merged in, written as a model directory: `(adapter dir, merged dir)`.
fn peft_adapter(
    model: &TinyModel,
    tmp: &std::path::Path,
) -> (std::path::PathBuf, std::path::PathBuf) {
    let base = loader::load(&model.spec(), &LoadOptions::default()).unwrap();
    tch::manual_seed(5);
    let adapter = cotrain_model::lora::LoraAdapter::new(
        &base.model,
        cotrain_model::lora::LoraConfig {
            dropout: 0.0,
            ..Default::default()
        },
    )
    .unwrap();
    tch::no_grad(|| {
        for (name, mut t) in adapter.named_tensors() {
            if name.contains("lora_B") {
                t.copy_(&(Tensor::randn(t.size(), (tch::Kind::Float, tch::Device::Cpu)) * 0.05));
            }
        }
    });
    let adapter_dir = tmp.join("adapter");
    adapter.save_peft(&adapter_dir, &model.spec()).unwrap();
    let merged: HashMap<String, Tensor> = adapter
        .merged(&base.named_parameters())
        .unwrap()
        .into_iter()
        .collect();
    base.load_named_tensors(&merged).unwrap();
    let merged_dir = tmp.join("merged");
    cotrain_model::export::save_pretrained(&base, &merged_dir).unwrap();
    (adapter_dir, merged_dir)
}

#[test]
fn generate_serves_a_peft_adapter_directory_unmerged() {
    let model = TinyModel::new("llama");
    let tmp = tempfile::tempdir().unwrap();
    let (adapter_dir, merged_dir) = peft_adapter(&model, tmp.path());

    let generate = |extra: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_rollout-worker"))
            .args([
                "generate",
                "--prompt",
                "hello there",
                "--max-new-tokens",
                "12",
                "--ignore-eos",
                "--json",
            ])
            .args(extra)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let tokens = |extra: &[&str]| {
        let (ok, stdout, stderr) = generate(extra);
        assert!(ok, "{stderr}");
        let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        v["samples"][0]["token_ids"].clone()
    };
    let (spec, adapter_path, merged_path) = (
        model.spec(),
        adapter_dir.display().to_string(),
        merged_dir.display().to_string(),
    );
    let unmerged = tokens(&["--model", &spec, "--adapter", &adapter_path]);
    assert_eq!(
        unmerged,
        tokens(&["--model", &merged_path]),
        "unmerged adapter vs merged model"
    );
    assert_ne!(
        unmerged,
        tokens(&["--model", &spec]),
        "the adapter must change the output"
    );
    let (ok, _, stderr) = generate(&["--model", &spec, "--adapter", &spec]);
    assert!(
        !ok && stderr.contains("loading the adapter") && stderr.contains("adapter_config.json"),
        "{stderr}"
    );
}

/// `serve --lora-module bob=DIR`: the PEFT directory is agent `bob` from the start (version 1),
/// unmerged on its base, with the greedy tokens of the merged model; over gRPC and as `BASE:bob`
/// on the OpenAI endpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lora_module_directory_is_served_as_an_agent() {
    let model = TinyModel::new("llama");
    let tmp = tempfile::tempdir().unwrap();
    let (adapter_dir, merged_dir) = peft_adapter(&model, tmp.path());
    let module = format!("bob={}", adapter_dir.display());
    let spec = model.spec();
    let w = WorkerProcess::start(&[("alice", spec.as_str())], &["--lora-module", &module]).await;
    let info = w.info().await;
    let versions: Vec<(String, u64)> = info
        .agents
        .iter()
        .map(|a| (a.name.clone(), a.policy_version))
        .collect();
    assert_eq!(versions, vec![("alice".into(), 0), ("bob".into(), 1)]);
    let bob = info
        .models
        .iter()
        .find(|m| m.agents.contains(&"bob".to_string()))
        .unwrap();
    assert!(bob.unmerged_adapters, "{:?}", info.models);
    let mut c = w.client().await;
    let got = probe_agent(&mut c, "bob").await;
    let merged = WorkerProcess::start(&[("m", merged_dir.to_str().unwrap())], &[]).await;
    let want = probe_agent(&mut merged.client().await, "m").await;
    assert_eq!(
        got.token_ids, want.token_ids,
        "the module unmerged vs the merged model"
    );
    assert!(max_abs_diff(&got.logprobs, &want.logprobs) < 1e-4);
    assert_ne!(got.token_ids, probe_agent(&mut c, "alice").await.token_ids);
    let body = serde_json::json!({"model": format!("{spec}:bob"), "prompt": PROMPT.to_vec(), "max_tokens": NEW_TOKENS, "temperature": 0.0,
        "ignore_eos": true, "return_token_ids": true});
    let r: serde_json::Value = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", w.http))
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ids: Vec<u32> = r["choices"][0]["token_ids"]
        .as_array()
        .unwrap_or_else(|| panic!("{r}"))
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(ids, got.token_ids);
}
