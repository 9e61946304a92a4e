//! `rollout.weight_transport`: the learner's weight push through /dev/shm to a worker on this
//! host gives the same policy as gRPC chunks, `auto` picks it only where the worker accepts it,
//! and no weight file is left behind.

mod train_common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use cotrain_learner::config::WeightTransport;
use cotrain_learner::services::embedded::EmbeddedRollout;
use cotrain_learner::services::{PoolRollout, runtime};
use cotrain_learner::trainer::{GenRequest, RolloutSource, SamplingSpec, WeightPush};
use tch::Tensor;
use tokio::runtime::Runtime;
use train_common::{config, tiny_model_dir};

const YAML: &str = "model: {name: unused, temperature: 1.0, top_p: 1.0, top_k: 0, max_length: 64}\n\
dataset: {name: gsm8k, train_split: 'train[:2]'}\n\
grpo: {num_generations: 2, max_new_tokens: 2}\n\
logging: {tensorboard: false, plots: false, progress: never}\n";

fn connect(
    rt: &Arc<Runtime>,
    grpc: std::net::SocketAddr,
    transport: WeightTransport,
) -> PoolRollout {
    PoolRollout::connect(
        rt.clone(),
        vec![format!("http://{grpc}")],
        vec![],
        Duration::from_secs(60),
        1,
        Duration::from_secs(5),
        Duration::from_secs(60),
    )
    .unwrap()
    .with_weight_transport(transport)
}

/// The tiny model's parameters, every one scaled by -0.7 (a clearly different policy).
fn changed_params(spec: &str) -> BTreeMap<String, Tensor> {
    let model =
        cotrain_model::loader::load(spec, &cotrain_model::loader::LoadOptions::default()).unwrap();
    model
        .named_parameters()
        .into_iter()
        .map(|(n, t)| (n, t.detach() * -0.7))
        .collect()
}

fn greedy(r: &mut PoolRollout, version: u64) -> Vec<u32> {
    greedy_of(r, "agent0", version)
}

fn greedy_of(r: &mut PoolRollout, agent: &str, version: u64) -> Vec<u32> {
    let req = GenRequest {
        agent: agent.into(),
        prompt: vec![65, 97, 48],
        n: 1,
        sampling: SamplingSpec {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            max_new_tokens: 12,
            ignore_eos: true,
            stop: Vec::new(),
            sampling_logprobs: false,
        },
        seed: 5,
        min_policy_version: version,
    };
    let out = r.generate(&[req]).unwrap();
    assert_eq!(out[0][0].policy_version, version);
    out[0][0].token_ids.clone()
}

/// Held by every test that pushes through /dev/shm: the tests share this process's pid, so one
/// test's live update file would otherwise count as another's leftover.
static SHM_TESTS: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn leftover_weight_files() -> Vec<String> {
    let prefix = format!("cotrain-weights-{}-", std::process::id());
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter(|n| n.starts_with(&prefix))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn the_config_key_parses_and_defaults_to_auto() {
    assert_eq!(
        config(YAML, &[]).raw.rollout.weight_transport,
        WeightTransport::Auto
    );
    let cfg = config(&format!("{YAML}rollout: {{weight_transport: shm}}\n"), &[]);
    assert_eq!(cfg.raw.rollout.weight_transport, WeightTransport::Shm);
    let v = cotrain_learner::config::merged_value(
        &format!("{YAML}rollout: {{weight_transport: carrier_pigeon}}\n"),
        "test.yaml",
        &[],
        &Default::default(),
    );
    let err = match v.and_then(|v| {
        cotrain_learner::config::CheckedConfig::from_value(v, std::path::Path::new("test.yaml"))
    }) {
        Ok(_) => panic!("an unknown transport must be refused"),
        Err(e) => format!("{e:#}"),
    };
    assert!(
        err.contains("carrier_pigeon") || err.contains("weight_transport"),
        "{err}"
    );
}

#[test]
fn shm_push_equals_grpc_push_and_auto_uses_it_only_where_accepted() {
    let _one_at_a_time = SHM_TESTS.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let spec = tiny_model_dir(dir.path()).display().to_string();
    let rt = runtime().unwrap();
    let agents = vec![("agent0".to_string(), spec.clone())];
    let params = changed_params(&spec);

    // The embedded worker accepts shared memory: `auto` and `shm` both go through /dev/shm.
    let shm_worker =
        EmbeddedRollout::start(rt.clone(), &agents, tch::Device::Cpu, tch::Kind::Float).unwrap();
    let mut auto = connect(&rt, shm_worker.grpc, WeightTransport::Auto);
    assert!(rt.block_on(auto.pool().shm_capable()).is_ok());
    let before = greedy(&mut auto, 0);
    auto.push_weights("agent0", 1, &params).unwrap();
    assert_eq!(
        auto.shm_pushes(),
        1,
        "auto did not use shared memory with a willing loopback worker"
    );
    assert_eq!(auto.policy_version("agent0").unwrap(), 1);
    let via_shm = greedy(&mut auto, 1);
    assert_ne!(
        via_shm, before,
        "the pushed weights did not change the policy"
    );
    let mut shm = connect(&rt, shm_worker.grpc, WeightTransport::Shm);
    shm.push_weights("agent0", 2, &params).unwrap();
    assert_eq!(shm.shm_pushes(), 1);
    assert_eq!(greedy(&mut shm, 2), via_shm);
    // The second push overwrites the same file: the worker must see only the new weights.
    let params2: BTreeMap<String, Tensor> =
        params.iter().map(|(n, t)| (n.clone(), t * -1.3)).collect();
    shm.push_weights("agent0", 3, &params2).unwrap();
    assert_eq!(shm.shm_pushes(), 2);
    let via_shm2 = greedy(&mut shm, 3);
    assert_ne!(
        via_shm2, via_shm,
        "the second push did not change the policy"
    );

    // A worker without the opt-in: `shm` fails naming the flag, `auto` and `grpc` use chunks.
    let config = cotrain_rollout_worker::worker::WorkerConfig {
        share: Vec::new(),
        adapters: Vec::new(),
        agents: agents.clone(),
        device: tch::Device::Cpu,
        kind: tch::Kind::Float,
        max_batch_size: 8,
        max_queued_requests: 64,
        engine_threads: Default::default(),
        decode_threads: Default::default(),
        verifiers: Vec::new(),
        lora_modules: Vec::new(),
        engine: Default::default(),
        agent_devices: Vec::new(),
    };
    let loopback = "127.0.0.1:0".parse().unwrap();
    let plain = rt
        .block_on(cotrain_rollout_worker::server::start(
            config, loopback, loopback,
        ))
        .unwrap();
    let mut forced = connect(&rt, plain.grpc_addr, WeightTransport::Shm);
    let err = forced
        .push_weights("agent0", 1, &params)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("--allow-shm-weights") && err.contains("rollout.weight_transport: shm"),
        "{err}"
    );
    assert_eq!(forced.policy_version("agent0").unwrap(), 0);
    let why = rt.block_on(forced.pool().shm_capable()).unwrap_err();
    assert!(why.contains("--allow-shm-weights"), "{why}");
    let mut auto_plain = connect(&rt, plain.grpc_addr, WeightTransport::Auto);
    auto_plain.push_weights("agent0", 1, &params).unwrap();
    assert_eq!(
        auto_plain.shm_pushes(),
        0,
        "auto used shared memory with a worker that refuses it"
    );
    assert_eq!(
        greedy(&mut auto_plain, 1),
        via_shm,
        "the same weights over gRPC give another policy"
    );
    auto_plain.push_weights("agent0", 2, &params2).unwrap();
    assert_eq!(
        greedy(&mut auto_plain, 2),
        via_shm2,
        "a rewritten shm file and gRPC give different policies"
    );

    drop((auto, shm, forced, auto_plain));
    assert_eq!(
        leftover_weight_files(),
        Vec::<String>::new(),
        "weight files left in /dev/shm"
    );
    rt.block_on(plain.shutdown()).unwrap();
    drop(shm_worker);
}

/// The trainer pushes every updated policy at once (`push_weights_all`): through shared memory the
/// agents' files are written and announced together, and each agent serves exactly its own weights,
/// as one gRPC push after another gives them. An agent the worker refuses fails the call by name
/// without holding back the others.
#[test]
fn pushing_several_agents_together_gives_each_its_own_weights() {
    let _one_at_a_time = SHM_TESTS.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let spec = tiny_model_dir(dir.path()).display().to_string();
    let rt = runtime().unwrap();
    let agents = vec![
        ("agent0".to_string(), spec.clone()),
        ("agent1".to_string(), spec.clone()),
    ];
    let worker =
        EmbeddedRollout::start(rt.clone(), &agents, tch::Device::Cpu, tch::Kind::Float).unwrap();
    let first = changed_params(&spec);
    let second: BTreeMap<String, Tensor> =
        first.iter().map(|(n, t)| (n.clone(), t * -1.3)).collect();

    let mut together = connect(&rt, worker.grpc, WeightTransport::Auto);
    let updates = [
        WeightPush {
            agent: "agent0",
            version: 1,
            params: &first,
            lora_scaling: None,
            probe: None,
        },
        WeightPush {
            agent: "agent1",
            version: 1,
            params: &second,
            lora_scaling: None,
            probe: None,
        },
    ];
    together.push_weights_all(&updates).unwrap();
    assert_eq!(
        together.shm_pushes(),
        2,
        "both agents should have gone through shared memory"
    );
    let bytes: u64 = [&first, &second]
        .iter()
        .flat_map(|p| p.values())
        .map(|t| t.numel() as u64 * 4)
        .sum();
    assert_eq!(together.last_push().unwrap().bytes, bytes);
    assert_eq!(together.policy_version("agent0").unwrap(), 1);
    assert_eq!(together.policy_version("agent1").unwrap(), 1);
    let (a0, a1) = (
        greedy_of(&mut together, "agent0", 1),
        greedy_of(&mut together, "agent1", 1),
    );
    assert_ne!(
        a0, a1,
        "the two agents' weights differ, so must their greedy completions"
    );

    // The same weights swapped between the agents, over gRPC one push after another.
    let mut chunks = connect(&rt, worker.grpc, WeightTransport::Grpc);
    let swapped = [
        WeightPush {
            agent: "agent0",
            version: 2,
            params: &second,
            lora_scaling: None,
            probe: None,
        },
        WeightPush {
            agent: "agent1",
            version: 2,
            params: &first,
            lora_scaling: None,
            probe: None,
        },
    ];
    chunks.push_weights_all(&swapped).unwrap();
    assert_eq!(chunks.shm_pushes(), 0);
    assert_eq!(
        greedy_of(&mut chunks, "agent0", 2),
        a1,
        "agent0 with agent1's weights"
    );
    assert_eq!(
        greedy_of(&mut chunks, "agent1", 2),
        a0,
        "agent1 with agent0's weights"
    );

    // An agent the worker does not serve: the call fails naming it, the other agent's push lands.
    // (Through the pool that pushed last: `together` no longer holds the worker's versions of agent1,
    // which `chunks` took past it, so it would not readmit the worker.)
    let mixed = [
        WeightPush {
            agent: "agent0",
            version: 3,
            params: &first,
            lora_scaling: None,
            probe: None,
        },
        WeightPush {
            agent: "nobody",
            version: 1,
            params: &first,
            lora_scaling: None,
            probe: None,
        },
    ];
    let err = chunks.push_weights_all(&mixed).unwrap_err().to_string();
    assert!(err.contains("nobody"), "{err}");
    assert_eq!(chunks.policy_version("agent0").unwrap(), 3);
    assert_eq!(greedy_of(&mut chunks, "agent0", 3), a0);

    drop((together, chunks));
    assert_eq!(
        leftover_weight_files(),
        Vec::<String>::new(),
        "weight files left in /dev/shm"
    );
    drop(worker);
}

/// `rollout.weight_dtype: bf16`: half the bytes per push, over gRPC and shared memory, and the
/// worker serves exactly the learner's weights rounded to bf16 (what an f32 push of the rounded
/// weights gives).
#[test]
fn bf16_on_the_wire_halves_the_bytes_and_serves_the_rounded_weights() {
    use cotrain_learner::config::WeightDtype;
    let _one_at_a_time = SHM_TESTS.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let spec = tiny_model_dir(dir.path()).display().to_string();
    let rt = runtime().unwrap();
    let agents = vec![("agent0".to_string(), spec.clone())];
    let params = changed_params(&spec);
    let rounded: BTreeMap<String, Tensor> = params
        .iter()
        .map(|(n, t)| {
            (
                n.clone(),
                t.to_kind(tch::Kind::BFloat16).to_kind(tch::Kind::Float),
            )
        })
        .collect();
    // The behaviour log-probs of a greedy completion tell the served weights apart to the last bit.
    let served = |r: &mut PoolRollout, version: u64| -> Vec<f32> {
        let req = GenRequest {
            agent: "agent0".into(),
            prompt: vec![65, 97, 48],
            n: 1,
            sampling: SamplingSpec {
                temperature: 0.0,
                top_p: 1.0,
                top_k: 0,
                max_new_tokens: 12,
                ignore_eos: true,
                stop: Vec::new(),
                sampling_logprobs: false,
            },
            seed: 5,
            min_policy_version: version,
        };
        r.generate(&[req]).unwrap()[0][0].logprobs.clone()
    };
    let worker =
        EmbeddedRollout::start(rt.clone(), &agents, tch::Device::Cpu, tch::Kind::Float).unwrap();

    let mut f32_grpc = connect(&rt, worker.grpc, WeightTransport::Grpc);
    f32_grpc.push_weights("agent0", 1, &rounded).unwrap();
    let f32_push = f32_grpc.last_push().unwrap();
    let want = served(&mut f32_grpc, 1);
    f32_grpc.push_weights("agent0", 2, &params).unwrap();
    assert_ne!(
        served(&mut f32_grpc, 2),
        want,
        "rounding to bf16 must change this policy for the test to mean anything"
    );

    for (v, transport) in [(3, WeightTransport::Grpc), (4, WeightTransport::Shm)] {
        let mut bf16 = connect(&rt, worker.grpc, transport).with_weight_dtype(WeightDtype::Bf16);
        bf16.push_weights("agent0", v, &params).unwrap();
        let push = bf16.last_push().unwrap();
        assert_eq!(push.bytes * 2, f32_push.bytes, "{transport:?}");
        assert_eq!(push.workers, 1);
        assert!(push.secs > 0.0);
        assert_eq!(
            served(&mut bf16, v),
            want,
            "{transport:?}: the worker does not serve the bf16-rounded weights"
        );
    }
    assert_eq!(
        leftover_weight_files(),
        Vec::<String>::new(),
        "weight files left in /dev/shm"
    );
}

/// A re-push of the version a worker already serves (what stale-sample recovery sends to every
/// worker) is taken as current, also through shared memory, which stays the transport; a push of a
/// version older than the one a worker serves is an error naming both (the worker holds weights this
/// learner never sent), never a silent success.
#[test]
fn a_repush_is_current_and_a_worker_ahead_is_refused() {
    let _one_at_a_time = SHM_TESTS.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let spec = tiny_model_dir(dir.path()).display().to_string();
    let rt = runtime().unwrap();
    let agents = vec![("agent0".to_string(), spec.clone())];
    let params = changed_params(&spec);
    let worker =
        EmbeddedRollout::start(rt.clone(), &agents, tch::Device::Cpu, tch::Kind::Float).unwrap();
    let mut auto = connect(&rt, worker.grpc, WeightTransport::Auto);
    auto.push_weights("agent0", 1, &params).unwrap();
    auto.push_weights("agent0", 1, &params).unwrap();
    auto.push_weights("agent0", 2, &params).unwrap();
    assert_eq!(
        auto.shm_pushes(),
        3,
        "a re-push must not switch the run from shared memory to gRPC"
    );
    assert_eq!(greedy(&mut auto, 2).len(), 12);

    // Another pool (a second learner, say) pushes version 1 to the worker now at version 2.
    let mut behind = connect(&rt, worker.grpc, WeightTransport::Grpc);
    let err = behind
        .push_weights("agent0", 1, &params)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("v1") && err.contains("refused") && err.contains("current version 2"),
        "{err}"
    );
    drop((auto, behind));
    drop(worker);
}

/// The embedded worker listens on loopback, where any local process could reach it: it requires
/// this process's token (a random one without a cluster token), so a pool without it cannot push.
#[test]
fn the_embedded_worker_refuses_pushes_without_the_process_token() {
    let dir = tempfile::tempdir().unwrap();
    let spec = tiny_model_dir(dir.path()).display().to_string();
    let rt = runtime().unwrap();
    let agents = vec![("agent0".to_string(), spec.clone())];
    let params = changed_params(&spec);
    let worker =
        EmbeddedRollout::start(rt.clone(), &agents, tch::Device::Cpu, tch::Kind::Float).unwrap();
    let stranger = cotrain_rollout_client::pool::PoolConfig {
        endpoints: vec![format!("http://{}", worker.grpc)],
        cluster_token: None,
        ..Default::default()
    };
    let mut stranger =
        PoolRollout::connect_with(rt.clone(), stranger, None, 1, Duration::from_secs(60))
            .unwrap()
            .with_weight_transport(WeightTransport::Grpc);
    let err = stranger
        .push_weights("agent0", 1, &params)
        .unwrap_err()
        .to_string();
    assert!(err.contains("token"), "{err}");
    // The learner's own pool carries the token.
    let mut own = connect(&rt, worker.grpc, WeightTransport::Grpc);
    own.push_weights("agent0", 1, &params).unwrap();
    drop((stranger, own));
    drop(worker);
}
