//! What MaPoRL trains: LoRA adapters on frozen bases, and critics.
//!
//! - [`Bases`]: one frozen model per distinct base (agents may use different base models). The
//!   reference policy is the base itself with no adapter set, so there is no second copy.
//! - [`PolicyAdapter`]: one per key of the adapter layout (`agent0.turn0`, `agent0.later`, ... or
//!   `shared`), with its AdamW. Its trained weights ([`PolicyWeights`]) are a LoRA adapter set on
//!   the frozen base for each forward, or with `full_finetune` a whole trainable copy of the base.
//!   The rollout workers serve each key as its own agent: with the adapter merged into a copy of
//!   the base (adapter-only weight updates), or with the full weights pushed as MAGRPO pushes them.
//! - [`Critic`]: an adapter of its own plus a value head (hidden → 1, no bias), per agent or per
//!   adapter key (`critic_per_turn`), as MaPoRL's separate value model. With `critic_head:
//!   frozen_random` (MaPoRL's) the head is a fixed random projection and only the adapter learns.

use std::collections::BTreeMap;

use cotrain_model::families::CausalLm;
use cotrain_model::loader::{LoadOptions, LoadedModel};
use cotrain_model::logprobs::{Sequence, sequence_hidden};
use cotrain_model::lora::{LoraAdapter, LoraConfig};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tch::{Kind, Tensor, nn};

use crate::algo::{AdamW, AdamWConfig};
use crate::config::{AdapterLayout, CheckedConfig, CriticHead, MaporlSection};
use crate::error::TrainError;
use crate::seeds::derive_seed;

/// Seed path tag of the frozen value heads' draws.
const TAG_CRITIC_HEAD: u64 = 15;

/// The frozen base models, by spec.
pub struct Bases {
    pub specs: Vec<String>,
    pub models: Vec<LoadedModel>,
    /// `agent_base[i]`: the base of agent `i`.
    pub agent_base: Vec<usize>,
    /// How they were loaded (full fine-tuning loads its trainable copies the same way).
    pub opts: LoadOptions,
}

impl Bases {
    /// Loads each distinct spec of `cfg.agent_models` once and freezes it.
    pub fn load(cfg: &CheckedConfig, opts: &LoadOptions) -> Result<Self, TrainError> {
        let (mut specs, mut models, mut agent_base) =
            (Vec::<String>::new(), Vec::new(), Vec::new());
        for spec in &cfg.agent_models {
            let idx = match specs.iter().position(|s| s == spec) {
                Some(i) => i,
                None => {
                    let mut m = cotrain_model::loader::load(spec, opts)
                        .map_err(|e| TrainError::Model(format!("loading `{spec}`: {e}")))?;
                    m.vs.freeze();
                    specs.push(spec.clone());
                    models.push(m);
                    specs.len() - 1
                }
            };
            agent_base.push(idx);
        }
        Ok(Self {
            specs,
            models,
            agent_base,
            opts: *opts,
        })
    }
}

/// The critic key of agent `agent` at turn `turn`.
pub fn critic_key(m: &MaporlSection, agent: usize, turn: usize) -> String {
    match (m.adapter_layout, m.critic_per_turn) {
        (AdapterLayout::Shared, _) | (AdapterLayout::SharedByTurn, false) => "critic.shared".into(),
        (AdapterLayout::SharedByTurn, true) => format!("critic.turn{turn}"),
        (_, true) => format!("critic.{}", m.adapter_layout.adapter_key(agent, turn)),
        (_, false) => format!("critic.agent{agent}"),
    }
}

/// What a policy trains.
pub enum PolicyWeights {
    /// A LoRA adapter, set on the shared frozen base for the policy's forwards.
    Lora(LoraAdapter),
    /// A whole trainable copy of the base (`maporl.full_finetune`); the base stays the reference.
    Full(Box<LoadedModel>),
}

/// One trainable policy: an adapter key of the layout, its weights and its AdamW.
pub struct PolicyAdapter {
    pub key: String,
    pub base: usize,
    pub weights: PolicyWeights,
    pub optimizer: AdamW,
    /// The version the rollout workers serve it as.
    pub version: u64,
}

impl PolicyAdapter {
    /// Runs `f` on the policy's network: `base` (the network of base `self.base`, or a
    /// [`CausalLm::share_weights`] copy of it) with the adapter set (and unset afterwards, even when
    /// `f` fails), or the policy's own full copy.
    pub fn with_model<R>(
        &self,
        base: &CausalLm,
        f: impl FnOnce(&CausalLm) -> R,
    ) -> Result<R, TrainError> {
        match &self.weights {
            PolicyWeights::Lora(adapter) => {
                base.set_adapter(Some(adapter), false)
                    .map_err(|e| TrainError::Model(format!("adapter `{}`: {e}", self.key)))?;
                let out = f(base);
                base.set_adapter(None, false)
                    .map_err(|e| TrainError::Model(format!("adapter `{}`: {e}", self.key)))?;
                Ok(out)
            }
            PolicyWeights::Full(m) => Ok(f(&m.model)),
        }
    }

    /// Sends the policy to the rollout workers as `version`: the adapter tensors alone, or every
    /// parameter of a fully fine-tuned copy.
    pub fn push(
        &self,
        rollout: &mut dyn crate::sources::RolloutSource,
        version: u64,
    ) -> Result<(), TrainError> {
        match &self.weights {
            PolicyWeights::Lora(a) => {
                rollout.push_adapter(&self.key, version, &a.named_tensors(), a.config.scaling())
            }
            PolicyWeights::Full(m) => {
                rollout.push_weights(&self.key, version, &m.named_parameters())
            }
        }
    }

    /// Writes the policy into `dir`: PEFT's layout for an adapter (naming `base_spec` as its base),
    /// a Hugging Face model directory for a full copy.
    pub fn save(&self, dir: &std::path::Path, base_spec: &str) -> Result<(), TrainError> {
        let written = match &self.weights {
            PolicyWeights::Lora(a) => a.save_peft(dir, base_spec).map_err(|e| e.to_string()),
            PolicyWeights::Full(m) => {
                cotrain_model::export::save_pretrained(m, dir).map_err(|e| e.to_string())
            }
        };
        written
            .map(|_| ())
            .map_err(|e| TrainError::Checkpoint(format!("{}: {e}", dir.display())))
    }
}

/// One critic: adapter plus value head.
pub struct Critic {
    pub key: String,
    pub base: usize,
    pub adapter: LoraAdapter,
    /// The value head's own store (`v_head.weight`, (1, hidden)); frozen with `critic_head:
    /// frozen_random`.
    pub head_vs: nn::VarStore,
    pub head: Tensor,
    pub adapter_opt: AdamW,
    /// Over the head's trainable variables: none (a no-op) when the head is frozen.
    pub head_opt: AdamW,
}

impl Critic {
    /// Values (B, L) of `prompt ++ completion` rows, right-padded to the longest (L), with the
    /// critic adapter set on `base` (the network of base `self.base`, or a
    /// [`CausalLm::share_weights`] copy of it). Rows of the same question (`questions`) whose
    /// prompts begin alike share the common prefix's forward ([`sequence_hidden`]: MaPoRL's
    /// agents value their answers after the same turn-0 prompt). Values of padding positions are
    /// garbage; callers gather real positions.
    pub fn values(
        &self,
        base: &CausalLm,
        rows: &[Sequence],
        questions: &[usize],
        with_grad: bool,
    ) -> Result<Tensor, TrainError> {
        let _guard = (!with_grad).then(tch::no_grad_guard);
        base.set_adapter(Some(&self.adapter), false)
            .map_err(|e| TrainError::Model(e.to_string()))?;
        let hidden = sequence_hidden(base, rows, Some(questions));
        base.set_adapter(None, false)
            .map_err(|e| TrainError::Model(e.to_string()))?;
        let hidden = hidden.map_err(|e| TrainError::Model(format!("critic forward: {e}")))?;
        Ok(hidden
            .to_kind(Kind::Float)
            .matmul(&self.head.to_kind(Kind::Float).transpose(0, 1))
            .squeeze_dim(-1))
    }

    /// Writes the critic into `dir`: its adapter in PEFT's layout (naming `base_spec`) and
    /// `value_head.safetensors` (`v_head.weight`, (1, hidden), f32 as held).
    pub fn save(&self, dir: &std::path::Path, base_spec: &str) -> Result<(), TrainError> {
        let err =
            |e: &dyn std::fmt::Display| TrainError::Checkpoint(format!("{}: {e}", dir.display()));
        self.adapter
            .save_peft(dir, base_spec)
            .map_err(|e| err(&e))?;
        Tensor::write_safetensors(
            &[(
                "v_head.weight",
                self.head.detach().to_device(tch::Device::Cpu),
            )],
            dir.join(VALUE_HEAD_FILE),
        )
        .map_err(|e| err(&e))
    }
}

/// The file a saved critic's value head is in.
pub const VALUE_HEAD_FILE: &str = "value_head.safetensors";

/// A frozen value head's weights (hidden values): PyTorch's default `nn.Linear` init
/// (`kaiming_uniform_(a=√5)`, i.e. U(−1/√hidden, 1/√hidden)), as MaPoRL's
/// `nn.Linear(hidden, 1, bias=False)` draws it, from its own stream of `seed` (so the policy
/// adapters' draws from libtorch's generator are the same with either `critic_head`).
pub fn frozen_head_weights(hidden: usize, seed: u64) -> Vec<f32> {
    let bound = 1.0 / (hidden as f64).sqrt();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..hidden)
        .map(|_| rng.random_range(-bound..bound) as f32)
        .collect()
}

/// Every adapter and critic of a run, by key.
pub struct Adapters {
    pub policies: BTreeMap<String, PolicyAdapter>,
    pub critics: BTreeMap<String, Critic>,
}

impl Adapters {
    /// Runs the products of every forward of the update in `kind` (`None`: the parameters' own
    /// dtype): the frozen bases, which every LoRA policy, the reference policy and every critic run
    /// on, and the whole trainable copies of `full_finetune`.
    fn set_matmul_kind(&self, bases: &Bases, kind: Option<tch::Kind>) {
        for b in &bases.models {
            b.model.set_matmul_kind(kind);
        }
        for p in self.policies.values() {
            if let PolicyWeights::Full(m) = &p.weights {
                m.model.set_matmul_kind(kind);
            }
        }
    }

    /// Fresh adapters (A Kaiming-uniform, B zero: every policy starts as its base) and critics (value
    /// head per `critic_head`: frozen U(±1/√hidden) or trained from zero) for every key the config's
    /// layout uses, seeded from the run's seed. The products of every update forward then run in
    /// `model.matmul_dtype` ([`Adapters::set_matmul_kind`]).
    pub fn new(cfg: &CheckedConfig, m: &MaporlSection, bases: &Bases) -> Result<Self, TrainError> {
        let lora: LoraConfig = m.lora.to_model();
        let adam = AdamWConfig::new(m.learning_rate, m.weight_decay, m.max_grad_norm);
        if matches!(
            m.adapter_layout,
            AdapterLayout::Shared | AdapterLayout::SharedByTurn
        ) && bases.models.len() > 1
        {
            return Err(TrainError::Config(format!(
                "{}: maporl.adapter_layout is {} (adapters shared by the agents) but model.agents names {} different base models",
                cfg.source.display(),
                serde_yaml_ng::to_string(&m.adapter_layout)
                    .unwrap_or_default()
                    .trim(),
                bases.models.len()
            )));
        }
        tch::manual_seed(cfg.raw.seed as i64);
        let (mut policies, mut critics) = (BTreeMap::new(), BTreeMap::new());
        for agent in 0..cfg.num_agents {
            let base = bases.agent_base[agent];
            let model = &bases.models[base].model;
            for turn in 0..m.round_num {
                let key = m.adapter_layout.adapter_key(agent, turn);
                if !policies.contains_key(&key) {
                    let (weights, optimizer) = if m.full_finetune {
                        let spec = &bases.specs[base];
                        let copy = cotrain_model::loader::load(spec, &bases.opts).map_err(|e| {
                            TrainError::Model(format!("loading `{spec}` for `{key}`: {e}"))
                        })?;
                        let optimizer = AdamW::new(&copy.vs, adam);
                        (PolicyWeights::Full(Box::new(copy)), optimizer)
                    } else {
                        let adapter = LoraAdapter::new(model, lora.clone())
                            .map_err(|e| TrainError::Config(format!("maporl.lora: {e}")))?;
                        let optimizer = AdamW::new(&adapter.vs, adam);
                        (PolicyWeights::Lora(adapter), optimizer)
                    };
                    policies.insert(
                        key.clone(),
                        PolicyAdapter {
                            key,
                            base,
                            weights,
                            optimizer,
                            version: 0,
                        },
                    );
                }
                let ckey = critic_key(m, agent, turn);
                // A turn whose answers are not trained (turn 0 without `task_training`) gets no
                // critic of its own: no sample would ever reach it.
                let trained_turn = turn > 0 || m.task_training;
                if trained_turn && !critics.contains_key(&ckey) {
                    let adapter = LoraAdapter::new(model, lora.clone())
                        .map_err(|e| TrainError::Config(format!("maporl.lora: {e}")))?;
                    let mut head_vs = nn::VarStore::new(model.device());
                    let hidden = model.config().hidden_size;
                    let mut head = (head_vs.root() / "v_head").var(
                        "weight",
                        &[1, hidden as i64],
                        nn::Init::Const(0.0),
                    );
                    if m.critic_head == CriticHead::FrozenRandom {
                        let w = frozen_head_weights(
                            hidden,
                            derive_seed(&[cfg.raw.seed, TAG_CRITIC_HEAD, critics.len() as u64]),
                        );
                        tch::no_grad(|| {
                            head.copy_(
                                &Tensor::from_slice(&w)
                                    .view([1, hidden as i64])
                                    .to_device(model.device()),
                            )
                        });
                        // Out of every optimiser: the head gets no gradient and AdamW never sees it.
                        head_vs.freeze();
                    }
                    let adapter_opt = AdamW::new(&adapter.vs, adam);
                    let head_opt = AdamW::new(&head_vs, adam);
                    critics.insert(
                        ckey.clone(),
                        Critic {
                            key: ckey,
                            base,
                            adapter,
                            head_vs,
                            head,
                            adapter_opt,
                            head_opt,
                        },
                    );
                }
            }
        }
        let adapters = Self { policies, critics };
        adapters.set_matmul_kind(bases, crate::model_options::matmul_kind(cfg));
        Ok(adapters)
    }

    /// Sets every optimiser's learning rate.
    pub fn set_lr(&mut self, lr: f64) {
        for p in self.policies.values_mut() {
            p.optimizer.cfg.lr = lr;
        }
        for c in self.critics.values_mut() {
            c.adapter_opt.cfg.lr = lr;
            c.head_opt.cfg.lr = lr;
        }
    }

    /// The rollout workers' agents: (key, base spec) of every policy adapter.
    pub fn worker_agents(&self, bases: &Bases) -> Vec<(String, String)> {
        self.policies
            .values()
            .map(|p| (p.key.clone(), bases.specs[p.base].clone()))
            .collect()
    }
}

/// The linear decay MaPoRL's trainer uses: `lr` at the first update down to `lr·end_factor` at the last.
pub fn scheduled_lr(lr: f64, end_factor: f64, update: u64, total_updates: u64) -> f64 {
    if total_updates <= 1 {
        return lr;
    }
    let frac = (update.min(total_updates - 1)) as f64 / (total_updates - 1) as f64;
    lr * (1.0 - frac * (1.0 - end_factor))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_name_one_adapter_per_turn_group() {
        assert_eq!(
            AdapterLayout::FirstAndLater.adapter_key(1, 0),
            "agent1.turn0"
        );
        assert_eq!(
            AdapterLayout::FirstAndLater.adapter_key(1, 2),
            "agent1.later"
        );
        assert_eq!(
            AdapterLayout::FirstAndLater.adapter_key(1, 1),
            AdapterLayout::FirstAndLater.adapter_key(1, 2)
        );
        assert_eq!(AdapterLayout::PerTurn.adapter_key(0, 2), "agent0.turn2");
        assert_eq!(
            AdapterLayout::Shared.adapter_key(1, 2),
            AdapterLayout::Shared.adapter_key(0, 0)
        );
        // MaPoRL's: the agents share the turn-0 adapter and the later-turn adapter.
        assert_eq!(
            AdapterLayout::SharedByTurn.adapter_key(1, 0),
            "shared.turn0"
        );
        assert_eq!(
            AdapterLayout::SharedByTurn.adapter_key(0, 0),
            "shared.turn0"
        );
        assert_eq!(
            AdapterLayout::SharedByTurn.adapter_key(1, 2),
            "shared.later"
        );
        assert_eq!(
            AdapterLayout::SharedByTurn.adapter_key(0, 1),
            "shared.later"
        );
    }

    #[test]
    fn learning_rate_decays_linearly_to_the_end_factor() {
        assert_eq!(scheduled_lr(1e-5, 0.1, 0, 10), 1e-5);
        assert!((scheduled_lr(1e-5, 0.1, 9, 10) - 1e-6).abs() < 1e-18);
        assert!((scheduled_lr(1e-5, 0.1, 3, 7) - 1e-5 * (1.0 - 0.5 * 0.9)).abs() < 1e-18);
        assert_eq!(scheduled_lr(1e-5, 0.1, 0, 1), 1e-5);
    }
}
