//! A trainable policy: the learner's own copy of one model (parameters in a `VarStore`), its AdamW
//! optimiser, an optional frozen reference copy, and the policy version the rollout workers serve.
//!
//! One `Policy` per distinct set of weights: one per agent by default (each agent fine-tunes its own
//! copy, on the same or on different base models), a single one for all agents with
//! `shared_parameters`. Learner ranks sum the gradients between the backward passes and
//! [`AdamW::step`] in [`Policy::update_ranked`].
//!
//! With LoRA (`model.lora`, [`Policy::lora`]) a policy trains an adapter on a frozen base instead:
//! its `model` is a handle on the base's tensors shared with the other policies on that base
//! ([`LoadedModel::share_frozen`]), with the adapter set on its own network; the optimiser, the
//! checkpoints and the weight pushes see the adapter's tensors only ([`Policy::trained_vs`]), and
//! the KL reference is another handle on the same base, with no adapter.

mod update;

use std::collections::BTreeMap;

use cotrain_model::loader::{LoadOptions, LoadedModel};
use cotrain_model::logprobs::{LogProbOptions, Sequence, completion_logprobs};
use cotrain_model::lora::{LoraAdapter, LoraConfig};
use tch::nn::VarStore;
use tch::{Kind, Tensor};
use tracing::warn;

use crate::algo::padding::pad_values;
use crate::algo::{AdamW, AdamWConfig, LossOptions, PolicyBatch, policy_loss};
use crate::error::TrainError;

/// One completion with its advantage, ready for the loss.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TrainSample {
    pub prompt: Vec<u32>,
    pub completion: Vec<u32>,
    /// (JSON keeps a non-finite value as `null`, read back as NaN: a checkpoint's buffered samples.)
    #[serde(deserialize_with = "null_as_nan")]
    pub advantage: f64,
    /// Multiplies this sample's loss: the turn weight (and early-termination weight) of its node.
    #[serde(deserialize_with = "null_as_nan")]
    pub weight: f64,
    /// Behaviour log-probs from the rollout worker (for ratio clipping).
    pub old_logprobs: Vec<f32>,
}

/// A number that JSON wrote as `null` (NaN or an infinity) reads back as NaN.
pub(super) fn null_as_nan<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(<Option<f64> as serde::Deserialize>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// One agent's share of an update: its samples in mini-batches, and the factor its loss is scaled
/// by (1 for an agent with its own weights, 1/N for shared parameters).
#[derive(Debug, Clone)]
pub struct AgentBatches {
    pub minibatches: Vec<Vec<TrainSample>>,
    pub scale: f64,
}

/// What one update did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct UpdateStats {
    /// The loss of the whole update (the sum of the scaled mini-batch losses, last epoch).
    pub loss: f64,
    pub kl: f64,
    /// Mean per-token entropy of the policy on the completions.
    pub entropy: f64,
    pub clip_fraction: f64,
    pub grad_norm: f64,
    /// Completion tokens trained on.
    pub tokens: f64,
    /// Optimiser steps taken (0 when skipped).
    pub steps: u64,
    /// Why the update was skipped, if it was.
    pub skipped: Option<String>,
    /// Seconds in the log-prob forward (and the reference's), in backward, and in the optimiser step.
    pub secs_forward: f64,
    pub secs_backward: f64,
    pub secs_optimizer: f64,
    /// Seconds summing gradients over the learner's ranks.
    pub secs_allreduce: f64,
    /// Mini-batches whose loss has no gradient (every sample's advantage or weight is 0, and no KL
    /// term): their log-probs ran without autograd and nothing was back-propagated (last epoch).
    pub minibatches_without_gradient: u64,
    /// Mean |log π_θ − log μ| per token against the behaviour log-probs (see
    /// [`crate::algo::LossTerms::logprob_gap`]), when they were used.
    pub logprob_gap: f64,
    /// Truncated importance sampling: mean weight per token and the fraction cut to the cap.
    pub is_weight_mean: f64,
    pub is_truncated_fraction: f64,
}

/// See the module docs.
/// The sentence every weight push is probed with: any ordinary text shows a wrong tensor, and a
/// fixed one keeps the figures comparable between runs.
pub const PROBE_TEXT: &str = "Before sampling from new weights, each rollout worker scores this sentence and compares \
     its log-probs with the learner's: 1, 2, 3 and done.";

/// Most probe tokens (one short forward).
const PROBE_TOKENS: usize = 32;

pub struct Policy {
    /// The agent name the rollout workers serve this policy under.
    pub worker_agent: String,
    /// The model spec it was loaded from.
    pub model_spec: String,
    /// The network the policy's forwards run: its own trainable copy, or with LoRA a frozen
    /// handle on the shared base whose network has `adapter` set.
    pub model: LoadedModel,
    /// With LoRA: the adapter the policy trains (the optimiser's only variables).
    pub adapter: Option<LoraAdapter>,
    pub optimizer: AdamW,
    /// The KL penalty's reference (when it is on): a frozen copy of the initial weights, or with
    /// LoRA the base itself (a handle, no copy).
    pub reference: Option<LoadedModel>,
    /// The version the workers serve (set by the trainer when it pushes weights).
    pub wire_version: u64,
    /// Completion positions per LM-head chunk in the log-prob kernel.
    pub chunk_size: usize,
    /// With LoRA dropout: the seed its masks are drawn from, with the optimiser's step count (see
    /// [`Policy::update_ranked`]).
    pub dropout_seed: u64,
}

/// A loss added to the policy's on the same forward graph (the value head's loss of `iac` with
/// heads on the actors): called with the policy's model after its forward, returns its value.
pub type ExtraLoss<'a> =
    &'a mut dyn FnMut(&cotrain_model::families::CausalLm) -> Result<f64, TrainError>;

impl std::fmt::Debug for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Policy")
            .field("worker_agent", &self.worker_agent)
            .field("model_spec", &self.model_spec)
            .field("wire_version", &self.wire_version)
            .finish_non_exhaustive()
    }
}

impl Policy {
    /// Loads `spec` for training (and a frozen reference copy when `with_reference`).
    pub fn load(
        worker_agent: &str,
        spec: &str,
        opts: &LoadOptions,
        adam: AdamWConfig,
        with_reference: bool,
    ) -> Result<Self, TrainError> {
        let model = cotrain_model::loader::load(spec, opts)
            .map_err(|e| TrainError::Model(format!("loading `{spec}`: {e}")))?;
        let reference = if with_reference {
            let r = cotrain_model::loader::load(spec, opts)
                .map_err(|e| TrainError::Model(format!("loading `{spec}`: {e}")))?;
            r.vs.variables().values().for_each(|t| {
                let _ = t.shallow_clone().set_requires_grad(false);
            });
            Some(r)
        } else {
            None
        };
        Ok(Self::new(worker_agent, spec, model, reference, adam))
    }

    /// A policy around an already loaded model.
    pub fn new(
        worker_agent: &str,
        spec: &str,
        model: LoadedModel,
        reference: Option<LoadedModel>,
        adam: AdamWConfig,
    ) -> Self {
        let optimizer = AdamW::new(&model.vs, adam);
        Self {
            worker_agent: worker_agent.to_string(),
            model_spec: spec.to_string(),
            model,
            adapter: None,
            optimizer,
            reference,
            wire_version: 0,
            chunk_size: cotrain_model::logprobs::TRAINING_CHUNK,
            dropout_seed: 0,
        }
    }

    /// A LoRA policy on `base` (loaded from `spec` and frozen, see [`LoadedModel::share_frozen`]):
    /// a fresh adapter (A Kaiming-uniform from libtorch's generator, B zero, so the policy starts
    /// as the base; seed libtorch first), AdamW over the adapter alone, and the base as the KL
    /// reference when `with_reference`. `dropout_seed` seeds the dropout masks (with the optimiser's
    /// step count).
    pub fn lora(
        worker_agent: &str,
        spec: &str,
        base: &LoadedModel,
        lora: LoraConfig,
        adam: AdamWConfig,
        with_reference: bool,
        dropout_seed: u64,
    ) -> Result<Self, TrainError> {
        let model = base.share_frozen();
        let adapter = LoraAdapter::new(&model.model, lora)
            .map_err(|e| TrainError::Config(format!("lora of `{worker_agent}`: {e}")))?;
        model
            .model
            .set_adapter(Some(&adapter), false)
            .map_err(|e| TrainError::Model(format!("lora of `{worker_agent}`: {e}")))?;
        let optimizer = AdamW::new(&adapter.vs, adam);
        Ok(Self {
            worker_agent: worker_agent.to_string(),
            model_spec: spec.to_string(),
            reference: with_reference.then(|| base.share_frozen()),
            model,
            adapter: Some(adapter),
            optimizer,
            wire_version: 0,
            chunk_size: cotrain_model::logprobs::TRAINING_CHUNK,
            dropout_seed,
        })
    }

    /// Whether its forwards draw LoRA dropout masks (libtorch's one generator: see
    /// [`Policy::update_ranked`]).
    pub fn draws_dropout(&self) -> bool {
        self.adapter
            .as_ref()
            .is_some_and(|a| a.config.dropout > 0.0)
    }

    /// What the policy trains: the adapter's variables with LoRA, else the model's.
    pub fn trained_vs(&self) -> &VarStore {
        match &self.adapter {
            Some(a) => &a.vs,
            None => &self.model.vs,
        }
    }

    /// [`Policy::trained_vs`] and the optimiser over it, both mutable (a checkpoint's restore).
    pub fn trained_vs_and_optimizer(&mut self) -> (&mut VarStore, &mut AdamW) {
        match &mut self.adapter {
            Some(a) => (&mut a.vs, &mut self.optimizer),
            None => (&mut self.model.vs, &mut self.optimizer),
        }
    }

    /// The trained tensors by name (shallow handles): every parameter, or with LoRA the adapter's
    /// `lora_A`/`lora_B` pairs. What pushes and checkpoints carry.
    pub fn parameters(&self) -> BTreeMap<String, Tensor> {
        self.trained_vs().variables().into_iter().collect()
    }

    /// The policy's log-probs of [`PROBE_TEXT`] under its current weights (with its adapter, if
    /// any): what a worker's engine must reproduce after loading a push of them.
    pub fn weight_probe(&self) -> Result<cotrain_proto::rollout::WeightProbe, TrainError> {
        let mut ids = self
            .model
            .tokenizer
            .encode(PROBE_TEXT, false)
            .map_err(|e| TrainError::Model(format!("probe text: {e}")))?;
        ids.truncate(PROBE_TOKENS);
        let _no_grad = tch::no_grad_guard();
        let logprobs = cotrain_model::logprobs::sequence_logprobs(&self.model.model, &ids)
            .map_err(|e| {
                TrainError::Model(format!("probe log-probs of `{}`: {e}", self.worker_agent))
            })?;
        // Computed in f32 (0: the worker's default for its engine) unless the learner's own
        // products or weights are half precision, whose log-probs differ from an f32 engine's
        // by up to ~0.1 nat.
        let half = self
            .model
            .model
            .matmul_kind()
            .is_some_and(|k| k != tch::Kind::Float)
            || self
                .parameters()
                .values()
                .any(|t| t.kind() != tch::Kind::Float);
        Ok(cotrain_proto::rollout::WeightProbe {
            token_ids: ids,
            logprobs,
            tolerance: if half { 0.25 } else { 0.0 },
        })
    }

    /// The LoRA scale (alpha / r) the workers merge a pushed adapter with; `None` without LoRA.
    pub fn lora_scaling(&self) -> Option<f64> {
        self.adapter.as_ref().map(|a| a.config.scaling())
    }

    /// Replaces the trained tensors by name (all or nothing; see
    /// [`cotrain_model::loader::load_named_tensors`]).
    pub fn load_trained(
        &self,
        tensors: &std::collections::HashMap<String, Tensor>,
    ) -> Result<(), TrainError> {
        cotrain_model::loader::load_named_tensors(self.trained_vs(), tensors)
            .map_err(|e| TrainError::Model(e.to_string()))
    }

    /// Writes the policy as something other tools load: a Hugging Face model directory, or with
    /// LoRA a PEFT adapter directory (`adapter_config.json`, `adapter_model.safetensors`) naming
    /// its base spec.
    pub fn save_pretrained(&self, dir: &std::path::Path) -> Result<std::path::PathBuf, TrainError> {
        let written = match &self.adapter {
            Some(a) => a
                .save_peft(dir, &self.model_spec)
                .map_err(|e| e.to_string()),
            None => {
                cotrain_model::export::save_pretrained(&self.model, dir).map_err(|e| e.to_string())
            }
        };
        written.map_err(|e| TrainError::Checkpoint(format!("{}: {e}", dir.display())))
    }
}
