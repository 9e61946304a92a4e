//! The critics of the actor-critic trainers (IAC, MAAC): comlrl's `CausalLMWithValueHead` with
//! `ValueHead` (one Linear hidden → 1, or Linear, Tanh, Linear with a hidden width; weights
//! N(0, 0.02), biases 0), read on the final hidden state (after the last norm) at the last token of
//! its input.
//!
//! - [`Critic`]: a separate model of its own with a head, both trained on the critic's loss
//!   (`use_separate_critic: true`, and MAAC's one critic).
//! - [`ValueHead`] alone on an actor's network (`use_separate_critic: false`): the actor's update
//!   adds the value loss's gradient to its own ([`super::Policy::update_with`]).
//!
//! A head has its own var store and AdamW: with the same settings as the backbone's, stepped
//! together, that is one AdamW over both (AdamW acts on each parameter alone, and upstream clips
//! no gradient norm).

use cotrain_model::families::CausalLm;
use cotrain_model::loader::{LoadOptions, LoadedModel};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tch::{Device, Kind, Tensor, nn};

use crate::algo::{AdamW, AdamWConfig};
use crate::config::CheckedConfig;
use crate::dist::Collective;
use crate::error::TrainError;

/// Seed path tag of the critics' and value heads' initial draws.
const TAG_CRITIC_HEAD: u64 = 8;

/// A value head; see the module docs.
pub struct ValueHead {
    pub vs: nn::VarStore,
    layers: Vec<(Tensor, Tensor)>,
    pub optimizer: AdamW,
}

impl ValueHead {
    /// A fresh head for `model`'s hidden size, in its dtype and on its device, its weights drawn
    /// from their own stream of `seed` (not libtorch's one generator, which other threads share);
    /// `hidden` adds the hidden layer.
    pub fn new(model: &CausalLm, hidden: Option<usize>, adam: AdamWConfig, seed: u64) -> Self {
        let width = model.config().hidden_size as i64;
        let mut vs = nn::VarStore::new(model.device());
        let root = vs.root() / "value_head";
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut linear = |path: nn::Path, inp: i64, out: i64| {
            let draws = normal_draws(&mut rng, (inp * out) as usize, 0.02);
            let w = path.var_copy("weight", &Tensor::from_slice(&draws).view([out, inp]));
            let b = path.var("bias", &[out], nn::Init::Const(0.0));
            (w, b)
        };
        let mut layers = Vec::new();
        let last = match hidden {
            Some(h) => {
                layers.push(linear(&root / "pre_projection" / "0", width, h as i64));
                h as i64
            }
            None => width,
        };
        layers.push(linear(&root / "value_projection", last, 1));
        // Drawn in f32, then held in the backbone's dtype as upstream casts its head (in place:
        // the handles above stay the variables).
        if model.kind() != Kind::Float {
            vs.set_kind(model.kind());
        }
        let optimizer = AdamW::new(&vs, adam);
        Self {
            vs,
            layers,
            optimizer,
        }
    }

    /// The value at the last token of each row (B,) on `model` (the critic's backbone, or the
    /// actor's network), with or without autograd.
    pub fn values(
        &self,
        model: &CausalLm,
        rows: &[Vec<u32>],
        with_grad: bool,
    ) -> Result<Tensor, TrainError> {
        let _guard = (!with_grad).then(tch::no_grad_guard);
        if rows.is_empty() || rows.iter().any(Vec::is_empty) {
            return Err(TrainError::Model(
                "critic input: every row needs at least one token".into(),
            ));
        }
        let device = model.device();
        let longest = rows.iter().map(Vec::len).max().unwrap_or(0);
        // Right padding: causal attention keeps it away from every real position.
        let flat: Vec<i64> = rows
            .iter()
            .flat_map(|r| {
                r.iter()
                    .map(|&t| t as i64)
                    .chain(std::iter::repeat_n(0, longest - r.len()))
            })
            .collect();
        let ids = Tensor::from_slice(&flat)
            .view([rows.len() as i64, longest as i64])
            .to_device(device);
        let hidden = model
            .forward_hidden(&ids)
            .map_err(|e| TrainError::Model(format!("critic forward: {e}")))?;
        let last: Vec<i64> = rows.iter().map(|r| r.len() as i64 - 1).collect();
        let index = Tensor::from_slice(&last)
            .to_device(device)
            .view([-1, 1, 1])
            .expand([-1, 1, hidden.size()[2]], false);
        let mut x = hidden.gather(1, &index, false).squeeze_dim(1);
        for (i, (w, b)) in self.layers.iter().enumerate() {
            x = x.linear(w, Some(b));
            if i + 1 < self.layers.len() {
                x = x.tanh();
            }
        }
        Ok(x.squeeze_dim(-1))
    }

    /// Rollout-time values of `rows` on `model`, no gradient, as f64.
    pub fn predict(&self, model: &CausalLm, rows: &[Vec<u32>]) -> Result<Vec<f64>, TrainError> {
        let v = self
            .values(model, rows, false)?
            .to_kind(Kind::Double)
            .to_device(Device::Cpu);
        Vec::<f64>::try_from(&v).map_err(|e| TrainError::Model(format!("critic values: {e}")))
    }
}

/// `n` draws of N(0, std²) (Box–Muller over the stream's uniforms), as f32.
fn normal_draws(rng: &mut ChaCha8Rng, n: usize, std: f64) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let u1: f64 = 1.0 - rng.random::<f64>();
            let u2: f64 = rng.random::<f64>();
            (std * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
        })
        .collect()
}

/// A separate critic: a backbone of its own with a value head.
pub struct Critic {
    /// The model it was loaded from.
    pub spec: String,
    pub model: LoadedModel,
    /// Over the backbone.
    pub optimizer: AdamW,
    pub head: ValueHead,
}

/// What one critic update did.
#[derive(Debug, Clone, Copy, Default)]
pub struct CriticStats {
    /// The value loss before the update (before `value_loss_coef`).
    pub value_loss: f64,
    pub grad_norm: f64,
}

impl Critic {
    /// Loads `spec` as a trainable backbone and adds a fresh value head drawn from `seed`.
    pub fn load(
        spec: &str,
        opts: &LoadOptions,
        hidden: Option<usize>,
        adam: AdamWConfig,
        seed: u64,
    ) -> Result<Self, TrainError> {
        let model = cotrain_model::loader::load(spec, opts)
            .map_err(|e| TrainError::Model(format!("loading critic `{spec}`: {e}")))?;
        let head = ValueHead::new(&model.model, hidden, adam, seed);
        let optimizer = AdamW::new(&model.vs, adam);
        Ok(Self {
            spec: spec.to_string(),
            model,
            optimizer,
            head,
        })
    }

    pub fn predict(&self, rows: &[Vec<u32>]) -> Result<Vec<f64>, TrainError> {
        self.head.predict(&self.model.model, rows)
    }

    /// One AdamW step on `coef`·mean_k (targets[k] − V(rows[k]))² over a mini-batch of `total`
    /// samples split over the ranks of `dist`: this rank's `rows` (possibly none) add their squared
    /// errors divided by `total`, the gradients are summed over the ranks, and every rank steps
    /// alike (one rank: `total` is `rows.len()`). A non-finite loss on any rank, or a non-finite
    /// summed gradient, skips the step everywhere (an [`TrainError::Update`] naming it).
    pub fn update(
        &mut self,
        rows: &[Vec<u32>],
        targets: &[f64],
        coef: f64,
        total: usize,
        dist: &dyn Collective,
    ) -> Result<CriticStats, TrainError> {
        self.optimizer.zero_grad();
        self.head.optimizer.zero_grad();
        let (mut local, mut bad) = (0.0, false);
        if !rows.is_empty() {
            let v = self.head.values(&self.model.model, rows, true)?;
            let y = Tensor::from_slice(targets).to_device(v.device());
            let loss = crate::algo::actor_critic::value_loss(&v, &y, None)
                * (rows.len() as f64 / total.max(1) as f64);
            local = loss.double_value(&[]);
            bad = !local.is_finite();
            if !bad {
                (loss * coef).backward();
            }
        }
        let summed = dist.sum_f64(&[if bad { 0.0 } else { local }, bad as u8 as f64])?;
        if summed[1] > 0.0 {
            self.optimizer.zero_grad();
            self.head.optimizer.zero_grad();
            let what = if bad {
                format!("{local}")
            } else {
                "non-finite on another rank".into()
            };
            return Err(TrainError::Update(format!(
                "critic `{}`: the value loss is {what}; the step is skipped",
                self.spec
            )));
        }
        // The backbone's and the head's gradients summed over the ranks (nothing on one rank).
        let mut params = self.optimizer.parameters();
        params.extend(self.head.optimizer.parameters());
        crate::dist::all_reduce_grads(dist, &params)?;
        let grad_norm = self
            .optimizer
            .grad_norm()
            .hypot(self.head.optimizer.grad_norm());
        if !grad_norm.is_finite() {
            self.optimizer.zero_grad();
            self.head.optimizer.zero_grad();
            return Err(TrainError::Update(format!(
                "critic `{}`: the gradient norm is {grad_norm}; the step is skipped",
                self.spec
            )));
        }
        self.optimizer.step_with_norm(grad_norm);
        self.head.optimizer.step_with_norm(grad_norm);
        Ok(CriticStats {
            value_loss: summed[0],
            grad_norm,
        })
    }
}

/// The value heads on the actors (`use_separate_critic: false`): one per policy, trained by the
/// policy's own AdamW settings, each drawn from its own seed.
pub(super) fn load_heads(cfg: &CheckedConfig, policies: &[super::Policy]) -> Vec<ValueHead> {
    let Some(ac) = cfg
        .actor_critic
        .as_ref()
        .filter(|ac| ac.value_head_on_actor)
    else {
        return Vec::new();
    };
    policies
        .iter()
        .enumerate()
        .map(|(i, p)| {
            ValueHead::new(
                &p.model.model,
                ac.head_hidden,
                p.optimizer.cfg,
                crate::seeds::derive_seed(&[cfg.raw.seed, TAG_CRITIC_HEAD, i as u64]),
            )
        })
        .collect()
}

/// The separate critics a config asks for: one per agent (IAC) or one (MAAC), each value head
/// drawn from its own seed.
pub(super) fn load_critics(
    cfg: &CheckedConfig,
    policies: &[super::Policy],
    agent_policy: &[usize],
) -> Result<Vec<Critic>, TrainError> {
    let Some(ac) = cfg
        .actor_critic
        .as_ref()
        .filter(|ac| !ac.value_head_on_actor)
    else {
        return Ok(Vec::new());
    };
    let opts = super::load_options(cfg)?;
    let adam = AdamWConfig::new(ac.critic_learning_rate, cfg.trainer.weight_decay, None);
    ac.critic_models
        .iter()
        .enumerate()
        .map(|(i, spec)| {
            let critic = Critic::load(spec, &opts, ac.head_hidden, adam, crate::seeds::derive_seed(&[cfg.raw.seed, TAG_CRITIC_HEAD, i as u64]))?;
            // The critic reads its agents' token ids (MAAC: agent 0's tokenizer), as upstream.
            let readers: Vec<usize> = if ac.centralised { vec![0] } else { vec![i] };
            for a in readers {
                let agent_vocab = policies[agent_policy[a]].model.model.config().vocab_size;
                let own = critic.model.model.config().vocab_size;
                if own < agent_vocab {
                    return Err(TrainError::Config(format!(
                        "{}: critic `{spec}` has a vocabulary of {own} tokens, but it reads agent {a}'s token ids (`{}`, {agent_vocab} tokens); give the critic a model with the agent's tokenizer",
                        cfg.source.display(),
                        cfg.agent_models[a]
                    )));
                }
            }
            Ok(critic)
        })
        .collect()
}
