//! The generation engine in this process as a rollout source: one engine (one model copy) per worker
//! agent, versions kept here. An adapter update is merged into the weights the agent's engine had
//! before its first adapter update (its base), as the rollout workers merge them.

use std::collections::{BTreeMap, HashMap};

use cotrain_model::engine::{
    Engine, FinishReason, LogprobMode, Request, SamplingParams, StopConditions,
};
use cotrain_model::loader::LoadedModel;
use tch::Tensor;

use crate::error::TrainError;
use crate::sources::{GenRequest, GenSample, RolloutSource};

/// See the module docs.
pub struct EngineRollout {
    engines: HashMap<String, (Engine, u64)>,
    /// Per agent, copies of the base weights its adapter updates are merged into.
    bases: HashMap<String, BTreeMap<String, Tensor>>,
}

impl EngineRollout {
    /// One engine per `(agent name, model)`.
    pub fn new(models: Vec<(String, LoadedModel)>) -> Self {
        Self {
            engines: models
                .into_iter()
                .map(|(name, m)| (name, (Engine::new(m), 0)))
                .collect(),
            bases: HashMap::new(),
        }
    }

    fn engine(&mut self, agent: &str) -> Result<&mut (Engine, u64), TrainError> {
        self.engines
            .get_mut(agent)
            .ok_or_else(|| TrainError::Rollout(format!("no in-process engine for agent `{agent}`")))
    }
}

impl RolloutSource for EngineRollout {
    fn generate(&mut self, requests: &[GenRequest]) -> Result<Vec<Vec<GenSample>>, TrainError> {
        let mut out: Vec<Vec<GenSample>> = vec![Vec::new(); requests.len()];
        // One batched engine run per agent (requests of one agent share the running batch).
        let mut by_agent: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        for (i, r) in requests.iter().enumerate() {
            by_agent.entry(r.agent.as_str()).or_default().push(i);
        }
        for (agent, idx) in by_agent {
            let (engine, version) = self.engine(agent)?;
            let version = *version;
            let reqs: Vec<Request> = idx
                .iter()
                .map(|&i| {
                    let r = &requests[i];
                    Request {
                        prompt: r.prompt.clone(),
                        n: r.n,
                        params: SamplingParams {
                            temperature: r.sampling.temperature,
                            top_k: r.sampling.top_k as usize,
                            top_p: r.sampling.top_p,
                            min_p: 0.0,
                        },
                        seed: r.seed,
                        stop: StopConditions {
                            max_new_tokens: r.sampling.max_new_tokens,
                            ignore_eos: r.sampling.ignore_eos,
                            stop_strings: r.sampling.stop.clone(),
                            ..Default::default()
                        },
                        logprobs: if r.sampling.sampling_logprobs {
                            LogprobMode::Sampling
                        } else {
                            LogprobMode::Raw
                        },
                        top_logprobs: 0,
                    }
                })
                .collect();
            let results = engine
                .generate(&reqs)
                .map_err(|e| TrainError::Rollout(format!("agent `{agent}`: {e}")))?;
            for (&i, samples) in idx.iter().zip(results) {
                out[i] = samples
                    .into_iter()
                    .map(|s| GenSample {
                        token_ids: s.token_ids,
                        text: s.text,
                        logprobs: s.logprobs,
                        stopped: s.finish_reason == FinishReason::Stop,
                        policy_version: version,
                    })
                    .collect();
            }
        }
        Ok(out)
    }

    fn policy_version(&mut self, agent: &str) -> Result<u64, TrainError> {
        Ok(self.engine(agent)?.1)
    }

    fn push_weights(
        &mut self,
        agent: &str,
        version: u64,
        params: &BTreeMap<String, Tensor>,
    ) -> Result<(), TrainError> {
        let (engine, v) = self.engine(agent)?;
        let map: HashMap<String, Tensor> = params
            .iter()
            .map(|(k, t)| (k.clone(), t.shallow_clone()))
            .collect();
        engine
            .load_named_tensors(&map)
            .map_err(|e| TrainError::Rollout(format!("agent `{agent}`: weight update: {e}")))?;
        *v = version;
        Ok(())
    }

    fn push_adapter(
        &mut self,
        agent: &str,
        version: u64,
        adapter: &BTreeMap<String, Tensor>,
        scaling: f64,
    ) -> Result<(), TrainError> {
        let (engine, _) = self.engine(agent)?;
        let params = engine.loaded().named_parameters();
        let base = self
            .bases
            .entry(agent.to_string())
            .or_insert_with(|| params.iter().map(|(k, t)| (k.clone(), t.copy())).collect());
        let merged = cotrain_model::lora::merge_into(
            |n| base.get(n).map(Tensor::shallow_clone),
            adapter,
            scaling,
        )
        .map_err(|e| TrainError::Rollout(format!("agent `{agent}`: adapter update: {e}")))?;
        let map: HashMap<String, Tensor> = merged.into_iter().collect();
        let (engine, v) = self.engine(agent)?;
        engine
            .load_named_tensors(&map)
            .map_err(|e| TrainError::Rollout(format!("agent `{agent}`: adapter update: {e}")))?;
        *v = version;
        Ok(())
    }

    fn describe(&self) -> String {
        let mut names: Vec<&String> = self.engines.keys().collect();
        names.sort();
        format!("in-process engine ({} agents: {names:?})", names.len())
    }
}
