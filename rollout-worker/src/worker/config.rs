//! How to build a worker: its agents and the models they name, where those live, and its bounds.

use tch::{Device, Kind};

use crate::batcher::EngineThreads;
use crate::error::{Result, WorkerError};

/// Upper bound accepted for `temperature`.
pub const MAX_TEMPERATURE: f64 = 100.0;

/// How to build a worker.
#[derive(Clone, Debug)]
pub struct WorkerConfig {
    /// `(agent name, model spec)` pairs; a spec is a HF directory, a `.gguf`, a cached repo id or
    /// `default`. Each agent gets a model of its own, whatever the specs, unless `share` groups it.
    pub agents: Vec<(String, String)>,
    /// Groups of agents that share one model copy (all of a group name the same spec).
    pub share: Vec<Vec<String>>,
    /// Groups of agents served as LoRA adapters on one shared base, unmerged (all of a group
    /// name the same spec; `serve --adapters`).
    pub adapters: Vec<Vec<String>>,
    /// Where the parameters live, for agents `agent_devices` does not place.
    pub device: Device,
    /// `(agent, device)`: agents whose model lives elsewhere than `device` (`--agent-device`), e.g.
    /// one GPU per agent. Agents sharing a model copy must be placed together.
    pub agent_devices: Vec<(String, Device)>,
    /// Parameter dtype.
    pub kind: Kind,
    /// Most sequences one model decodes together.
    pub max_batch_size: usize,
    /// Most generate requests admitted and not answered, all models; beyond it RESOURCE_EXHAUSTED.
    pub max_queued_requests: usize,
    /// CPU threads each model's engine steps on (default: libtorch's, every core). With several
    /// models in one process on a few cores, their engines step at the same time, and one team of
    /// threads per engine spin-waiting on the same cores slows them all: one core each was faster
    /// (MAGRPO's two batch-4 decodes on 2 cores, alternating runs: 3.2–4.2 s, mostly 4.0–4.1,
    /// against 4.3–4.7 s). [`EngineThreads::Shared`] splits the cores between the engines busy at
    /// the time.
    pub engine_threads: EngineThreads,
    /// Thread count of cotrain's decode steps within the engine's ([`cotrain_model::engine::threads`]).
    pub decode_threads: cotrain_model::engine::DecodeThreads,
    /// `(name, directory)` of each learned verifier to load (`serve --verifier NAME=DIR`).
    pub verifiers: Vec<(String, std::path::PathBuf)>,
    /// `(agent, directory)`: PEFT adapter directories loaded at start as those agents' adapters
    /// (agents of an adapter group; `serve --lora-module`), at version 1.
    pub lora_modules: Vec<(String, std::path::PathBuf)>,
    /// What generates: cotrain's own engine, or a vLLM engine per model (`serve --engine vllm`).
    pub engine: EngineKind,
}

/// The engine that generates for a worker's models.
#[derive(Clone, Debug, Default)]
pub enum EngineKind {
    /// cotrain's engine, in this process (the default; no Python).
    #[default]
    Cotrain,
    /// A vLLM engine per model, each its own process (`serve --engine vllm`).
    Vllm(crate::vllm::VllmOptions),
}

impl WorkerConfig {
    /// The device of the model copy serving `agents` (one slot's agents).
    pub(super) fn device_for(&self, agents: &[String]) -> Result<Device> {
        let of = |a: &String| {
            self.agent_devices
                .iter()
                .find(|(n, _)| n == a)
                .map(|(_, d)| *d)
                .unwrap_or(self.device)
        };
        let device = of(&agents[0]);
        if let Some(other) = agents.iter().find(|a| of(a) != device) {
            return Err(WorkerError::invalid(
                "agent-device",
                format!(
                    "agents `{}` and `{other}` share one model copy but are placed on {device:?} and {:?}",
                    agents[0],
                    of(other)
                ),
            ));
        }
        Ok(device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Agents that share one model copy cannot be placed on two devices; the others may be.
    #[test]
    fn a_model_copy_lives_on_its_agents_device() {
        let config = WorkerConfig {
            agents: vec![
                ("a".into(), "m".into()),
                ("b".into(), "m".into()),
                ("c".into(), "m".into()),
            ],
            share: vec![vec!["a".into(), "b".into()]],
            adapters: Vec::new(),
            device: Device::Cpu,
            agent_devices: vec![("b".into(), Device::Cuda(1)), ("c".into(), Device::Cuda(0))],
            kind: Kind::Float,
            max_batch_size: 1,
            max_queued_requests: 1,
            engine_threads: EngineThreads::Default,
            decode_threads: cotrain_model::engine::DecodeThreads::Adaptive,
            verifiers: Vec::new(),
            lora_modules: Vec::new(),
            engine: EngineKind::Cotrain,
        };
        assert_eq!(config.device_for(&["c".into()]).unwrap(), Device::Cuda(0));
        let e = config
            .device_for(&["a".into(), "b".into()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("agents `a` and `b` share one model copy but are placed on Cpu and Cuda(1)"),
            "{e}"
        );
        let placed = WorkerConfig {
            agent_devices: vec![("a".into(), Device::Cuda(1)), ("b".into(), Device::Cuda(1))],
            ..config
        };
        assert_eq!(
            placed.device_for(&["a".into(), "b".into()]).unwrap(),
            Device::Cuda(1)
        );
    }
}
