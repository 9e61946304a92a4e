//! Shared by the trainer's integration tests: a tiny model directory (the committed tiny Llama
//! fixture plus a byte-level tokenizer built here), configs from YAML text, and token-level reward
//! functions behind the same `RewardSource` trait the reward server implements.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use cotrain_learner::algo::AdamWConfig;
use cotrain_learner::config::{CheckedConfig, LegacyFlags, merged_value};
use cotrain_learner::services::EngineRollout;
use cotrain_learner::trainer::{
    GenRequest, GenSample, Policy, RewardSource, RolloutSource, SamplingSpec, Score, ScoreAction,
    TrainError, TrainItem, Trainer, TrainerSetup,
};
use tch::Tensor;

/// GPT-2's byte ↔ printable-character table (the ByteLevel pre-tokenizer's alphabet).
fn byte_chars() -> Vec<char> {
    let mut keep: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut chars = vec!['\0'; 256];
    let mut extra = 0;
    for b in 0..256u32 {
        if keep.contains(&b) {
            chars[b as usize] = char::from_u32(b).unwrap();
        } else {
            chars[b as usize] = char::from_u32(256 + extra).unwrap();
            extra += 1;
        }
    }
    keep.clear();
    chars
}

/// A byte-level BPE tokenizer with exactly 256 tokens (one per byte, no merges): it fits the tiny
/// fixtures' vocabulary of 256.
pub fn byte_tokenizer_json() -> String {
    let vocab: serde_json::Map<String, serde_json::Value> = byte_chars()
        .into_iter()
        .enumerate()
        .map(|(i, c)| (c.to_string(), serde_json::json!(i)))
        .collect();
    serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": []}
    })
    .to_string()
}

/// Copies the committed tiny Llama (2 layers, hidden 64, vocab 256) into `dir` with a tokenizer.
pub fn tiny_model_dir(dir: &Path) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures/tiny/llama");
    let out = dir.join("tiny-llama");
    std::fs::create_dir_all(&out).unwrap();
    for f in ["config.json", "model.safetensors", "generation_config.json"] {
        std::fs::copy(src.join(f), out.join(f)).unwrap();
    }
    std::fs::write(out.join("tokenizer.json"), byte_tokenizer_json()).unwrap();
    out
}

/// One generate request as the rollout workers saw it, with the token ids of its samples.
#[derive(Debug, Clone)]
pub struct Seen {
    pub sampling: SamplingSpec,
    pub prompt: Vec<u32>,
    pub completions: Vec<Vec<u32>>,
    /// The samples' texts.
    pub texts: Vec<String>,
    /// The worker agent asked.
    pub agent: String,
}

/// The in-process engine, recording every request.
pub struct Recording {
    pub inner: EngineRollout,
    pub seen: Arc<Mutex<Vec<Seen>>>,
}

impl RolloutSource for Recording {
    fn generate(&mut self, requests: &[GenRequest]) -> Result<Vec<Vec<GenSample>>, TrainError> {
        let out = self.inner.generate(requests)?;
        let mut seen = self.seen.lock().unwrap();
        for (r, samples) in requests.iter().zip(&out) {
            let completions = samples.iter().map(|s| s.token_ids.clone()).collect();
            let texts = samples.iter().map(|s| s.text.clone()).collect();
            seen.push(Seen {
                sampling: r.sampling.clone(),
                prompt: r.prompt.clone(),
                completions,
                texts,
                agent: r.agent.clone(),
            });
        }
        Ok(out)
    }
    fn policy_version(&mut self, agent: &str) -> Result<u64, TrainError> {
        self.inner.policy_version(agent)
    }
    fn push_weights(
        &mut self,
        agent: &str,
        version: u64,
        params: &BTreeMap<String, Tensor>,
    ) -> Result<(), TrainError> {
        self.inner.push_weights(agent, version, params)
    }
    fn push_adapter(
        &mut self,
        agent: &str,
        version: u64,
        adapter: &BTreeMap<String, Tensor>,
        scaling: f64,
    ) -> Result<(), TrainError> {
        self.inner.push_adapter(agent, version, adapter, scaling)
    }
    fn describe(&self) -> String {
        "recording engine".into()
    }
}

/// The requests recorded since the last call.
pub fn taken(seen: &Arc<Mutex<Vec<Seen>>>) -> Vec<Seen> {
    std::mem::take(&mut *seen.lock().unwrap())
}

/// A checked config from YAML text (as if read from `source`).
pub fn config(yaml: &str, overrides: &[String]) -> CheckedConfig {
    let v = merged_value(yaml, "test.yaml", overrides, &LegacyFlags::default()).unwrap();
    CheckedConfig::from_value(v, Path::new("test.yaml")).unwrap()
}

/// Reward 1 when the agents' first completion tokens satisfy `rule`, else 0.
pub struct TokenRule {
    pub rule: fn(&[u32]) -> bool,
}

impl RewardSource for TokenRule {
    fn score(&mut self, _task: &str, actions: &[ScoreAction]) -> Result<Vec<Score>, TrainError> {
        Ok(actions
            .iter()
            .map(|a| {
                let firsts: Vec<u32> = a
                    .completion_ids
                    .iter()
                    .map(|c| c.first().copied().unwrap_or(u32::MAX))
                    .collect();
                let ok = (self.rule)(&firsts);
                let mut levels = BTreeMap::new();
                levels.insert("level_1".to_string(), if ok { 1.0 } else { 0.0 });
                Score {
                    reward: if ok { 1.0 } else { 0.0 },
                    levels,
                    details: serde_json::Value::Null,
                    code: None,
                }
            })
            .collect())
    }
    fn describe(&self) -> String {
        "token rule".into()
    }
}

/// `items` rows, each agent's prompt a few distinct byte tokens.
pub fn items(rows: usize, agents: usize) -> Vec<TrainItem> {
    (0..rows)
        .map(|i| TrainItem {
            index: i,
            item: serde_json::json!({"row": i}),
            prompts: (0..agents)
                .map(|a| vec![65 + a as u32, 97 + i as u32, 48 + (i * 7 % 10) as u32])
                .collect(),
            texts: (0..agents)
                .map(|a| {
                    format!(
                        "{}{}{}",
                        (65 + a as u8) as char,
                        (97 + i as u8) as char,
                        (48 + (i * 7 % 10) as u8) as char
                    )
                })
                .collect(),
        })
        .collect()
}

/// A trainer whose policies are what `cfg` asks for, loaded as `learner train` loads them
/// ([`cotrain_learner::trainer::load_policies`]: `model.name` must be the model directory), with
/// one in-process engine per worker agent and `reward`.
pub fn config_trainer(
    cfg: &CheckedConfig,
    run_dir: &Path,
    reward: Box<dyn RewardSource>,
    rows: usize,
) -> Trainer {
    let (policies, agent_policy) = cotrain_learner::trainer::load_policies(cfg).unwrap();
    let rollout_opts = cotrain_model::loader::LoadOptions {
        kind: cotrain_learner::trainer::rollout_kind(cfg),
        ..Default::default()
    };
    let engines = policies
        .iter()
        .map(|p| {
            (
                p.worker_agent.clone(),
                cotrain_model::loader::load(&p.model_spec, &rollout_opts).unwrap(),
            )
        })
        .collect();
    Trainer::new(TrainerSetup {
        cfg: cfg.clone(),
        run_dir: run_dir.to_path_buf(),
        task: "token_rule".into(),
        is_code: false,
        policies,
        agent_policy,
        rollout: Box::new(EngineRollout::new(engines)),
        reward,
        train_items: items(rows, cfg.num_agents),
        eval_items: items(2, cfg.num_agents),
    })
    .unwrap()
}

/// A trainer on the tiny model: one policy per agent, the in-process engine, `reward`.
pub fn tiny_trainer(
    cfg: &CheckedConfig,
    model_dir: &Path,
    run_dir: &Path,
    reward: Box<dyn RewardSource>,
    rows: usize,
) -> Trainer {
    let spec = model_dir.display().to_string();
    let opts = cotrain_model::loader::LoadOptions::default();
    let n = cfg.num_agents;
    let adam = AdamWConfig::new(
        cfg.trainer.learning_rate,
        cfg.trainer.weight_decay,
        cfg.trainer.max_grad_norm,
    );
    let mut policies = Vec::new();
    let mut engines = Vec::new();
    for a in 0..n {
        let name = format!("agent{a}");
        policies.push(Policy::new(
            &name,
            &spec,
            cotrain_model::loader::load(&spec, &opts).unwrap(),
            None,
            adam,
        ));
        // The rollout engines load in the rollout precision, as the embedded worker does.
        let rollout_opts = cotrain_model::loader::LoadOptions {
            kind: cotrain_learner::trainer::rollout_kind(cfg),
            ..opts
        };
        engines.push((
            name,
            cotrain_model::loader::load(&spec, &rollout_opts).unwrap(),
        ));
    }
    Trainer::new(TrainerSetup {
        cfg: cfg.clone(),
        run_dir: run_dir.to_path_buf(),
        task: "token_rule".into(),
        is_code: false,
        policies,
        agent_policy: (0..n).collect(),
        rollout: Box::new(EngineRollout::new(engines)),
        reward,
        train_items: items(rows, n),
        eval_items: items(2, n),
    })
    .unwrap()
}
