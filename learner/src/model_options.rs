//! How a config maps to models: the device and dtypes of the learner's policies and of rollouts
//! (`model.device`, `model.dtype`, `model.matmul_dtype`, `rollout.dtype`), and the agents the rollout
//! workers must serve. Both trainers and the tools share it.

use cotrain_model::loader::LoadOptions;
use tch::{Device, Kind};

use crate::config::{CheckedConfig, Dtype};
use crate::error::TrainError;

/// This process's device for `model.device`, resolved once per request (so `auto` logs its choice
/// once): `cuda` means this rank's GPU, by the launcher's local rank.
pub fn learner_device(cfg: &CheckedConfig) -> Result<Device, TrainError> {
    /// (request, local rank) and what it resolved to.
    type Resolved = Vec<(
        (cotrain_model::cuda::DeviceRequest, usize),
        Result<Device, String>,
    )>;
    static RESOLVED: std::sync::Mutex<Resolved> = std::sync::Mutex::new(Vec::new());
    let request = cfg.raw.model.device;
    // A broken launcher environment is reported by `dist::init`; the device then is rank 0's.
    let local_rank = crate::dist::RankEnv::from_env()
        .map(|e| e.local_rank)
        .unwrap_or(0);
    let mut resolved = RESOLVED.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, d)) = resolved.iter().find(|(k, _)| *k == (request, local_rank)) {
        return d.clone().map_err(TrainError::Config);
    }
    let d = request
        .resolve(local_rank)
        .map_err(|e| format!("model.device: {e}"));
    resolved.push(((request, local_rank), d.clone()));
    d.map_err(TrainError::Config)
}

/// Device and dtype of the learner's models (`model.device`, `model.dtype`).
pub fn load_options(cfg: &CheckedConfig) -> Result<LoadOptions, TrainError> {
    let device = learner_device(cfg)?;
    Ok(LoadOptions {
        device,
        kind: param_kind(cfg.raw.model.dtype, device),
    })
}

fn param_kind(dtype: Dtype, device: Device) -> Kind {
    match (dtype, device) {
        (Dtype::F32, _) | (Dtype::Auto, Device::Cpu) => Kind::Float,
        (Dtype::Bf16, _) | (Dtype::Auto, _) => Kind::BFloat16,
        (Dtype::F16, _) => Kind::Half,
    }
}

/// The policies' parameter dtype. A device that cannot be resolved counts as the CPU here: such a
/// run stops at [`load_options`] before any of these kinds is used.
fn policy_kind(cfg: &CheckedConfig) -> Kind {
    param_kind(
        cfg.raw.model.dtype,
        learner_device(cfg).unwrap_or(Device::Cpu),
    )
}

/// The precision rollouts are drawn in (`rollout.dtype`; `auto`: the policy's own).
pub fn rollout_kind(cfg: &CheckedConfig) -> Kind {
    cfg.raw.rollout.dtype.kind(policy_kind(cfg))
}

/// The dtype of the trained policies' products when it is not their parameters'
/// (`model.matmul_dtype`), for [`cotrain_model::CausalLm::set_matmul_kind`].
pub fn matmul_kind(cfg: &CheckedConfig) -> Option<Kind> {
    let params = policy_kind(cfg);
    let kind = cfg.raw.model.matmul_dtype.kind(params);
    (kind != params).then_some(kind)
}

/// Logs the speed of `kind`'s products against f32's on this CPU when training products run in
/// `kind` (`model.matmul_dtype`), and warns where they are the slower ones: some CPUs with
/// avx512_bf16 but no AMX run libtorch's bf16 products slower than f32, and training would then be
/// slower and less precise than asked for.
pub fn announce_matmul_rate(kind: Kind, device: Device) {
    if device != Device::Cpu {
        return;
    }
    let (ours, f32_rate) = (
        cotrain_model::kernels::dispatch::product_gflops(kind),
        cotrain_model::kernels::dispatch::product_gflops(Kind::Float),
    );
    // One product of one shape, timed five times: within 10% it is too close to call (on Zen 4
    // the probe gave bf16 204 against f32 217 GFLOP/s, and MaPoRL's PPO epochs still took
    // 17% less time in bf16); well below, as on CPUs whose libtorch falls back to scalar bf16, it is not.
    if ours < 0.9 * f32_rate {
        tracing::warn!(
            "model.matmul_dtype: {kind:?} products run at {ours:.0} GFLOP/s on this CPU against {f32_rate:.0} for f32: training will be slower, not faster"
        );
    } else {
        tracing::info!(
            "model.matmul_dtype: {kind:?} products at {ours:.0} GFLOP/s on this CPU, f32 at {f32_rate:.0}"
        );
    }
}

/// Whether rollouts are drawn in another precision than the policy trains in: their dtype is not
/// the parameters', or training's products run in another dtype (then even bf16 rollouts are not
/// bit-identical: they keep f32 activations). The loss then measures the log-prob gap and corrects
/// for it (`rollout.importance_weight_cap`).
pub fn rollout_precision_differs(cfg: &CheckedConfig) -> bool {
    rollout_kind(cfg) != policy_kind(cfg) || matmul_kind(cfg).is_some()
}

/// The worker agents trained as LoRA adapters, grouped by base spec (`rollout-worker serve
/// --adapters`): GRPO/MAGRPO policies with `lora`, MaPoRL's adapter keys unless `full_finetune`.
pub fn adapter_groups(cfg: &CheckedConfig) -> Vec<Vec<String>> {
    let agents = worker_agents(cfg);
    let lora: Vec<bool> = match cfg
        .raw
        .maporl
        .as_ref()
        .filter(|_| cfg.algorithm == crate::config::Algorithm::Maporl)
    {
        Some(m) => vec![!m.full_finetune; agents.len()],
        // Policy i is agent i's (shared parameters: one policy, agent 0's settings for all).
        None => (0..agents.len())
            .map(|i| cfg.agents[i].lora.is_some())
            .collect(),
    };
    let mut groups: Vec<(String, Vec<String>)> = Vec::new();
    for ((name, spec), is_lora) in agents.into_iter().zip(lora) {
        if !is_lora {
            continue;
        }
        match groups.iter_mut().find(|(s, _)| *s == spec) {
            Some((_, g)) => g.push(name),
            None => groups.push((spec, vec![name])),
        }
    }
    groups.into_iter().map(|(_, g)| g).collect()
}

/// The rollout workers' agents a run of `cfg` trains, as `(agent name, model spec)`, each needing
/// weights of its own on every worker: `shared` with shared parameters, `agent{i}` otherwise, and
/// MaPoRL's adapter keys. `learner worker-args` prints them for the deploy scripts.
pub fn worker_agents(cfg: &CheckedConfig) -> Vec<(String, String)> {
    if let Some(m) = cfg
        .raw
        .maporl
        .as_ref()
        .filter(|_| cfg.algorithm == crate::config::Algorithm::Maporl)
    {
        let mut agents: Vec<(String, String)> = Vec::new();
        for (agent, spec) in cfg.agent_models.iter().enumerate().take(cfg.num_agents) {
            for turn in 0..m.round_num {
                let key = m.adapter_layout.adapter_key(agent, turn);
                if !agents.iter().any(|(k, _)| *k == key) {
                    agents.push((key, spec.clone()));
                }
            }
        }
        agents.sort();
        return agents;
    }
    if cfg.trainer.shared_parameters {
        return vec![("shared".into(), cfg.agent_models[0].clone())];
    }
    cfg.agent_models
        .iter()
        .enumerate()
        .map(|(i, spec)| (format!("agent{i}"), spec.clone()))
        .collect()
}
