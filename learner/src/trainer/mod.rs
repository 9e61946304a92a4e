//! The trainer: GRPO / MAGRPO end to end, single- and multi-turn (docs/src/trainers/magrpo.md), driving rollout
//! workers and a reward server. It builds on what every trainer shares, one level below it
//! ([`crate::sources`], [`crate::error`], [`crate::prompts::items`], [`crate::seeds`],
//! [`crate::model_options`], [`crate::services`]); MaPoRL ([`crate::maporl`]) is its sibling.
//!
//! - `setup`: the [`Trainer`] and what it runs with; drawing samples at the pushed versions;
//! - `run`: the loop over epochs and steps, evaluations and checkpoints on their schedule;
//! - `step`: one on-policy step (roll out, advantages, update rounds, push, report);
//!   `pipeline`: the asynchronous variant (`rollout.max_off_policy_steps` > 0);
//! - `batch`: what a step carries between its phases (plain data);
//! - [`rollout`]: rolling the forest out depth by depth; [`transition`]: next-turn prompts;
//!   [`rollout_log`]: `rollouts.jsonl`; [`tree`]: the forest (returns, advantages, turn weights);
//! - `reference_kl`: the reference KL of each completion, for `reference_kl.placement: returns`;
//! - [`policy`]: a trainable [`Policy`] and its update through the chunked log-prob kernel;
//!   [`rounds`]: which policies update together;
//! - `ranks`: the learner's ranks (layout, gathering, identical weights);
//! - `evaluate`: evaluation and the code tasks' @k metrics; `step_metrics`: a step's scalars;
//! - `checkpoints`: saving, resuming, final models;
//! - this module: building all of it from a config ([`build`]); `crate::trainers` runs it
//!   (`learner train`, `learner eval`) in the harness ([`crate::harness`]).

mod actor_critic;
mod batch;
mod checkpoints;
pub mod critic;
mod evaluate;
mod pipeline;
pub mod policy;
mod ranks;
mod reference_kl;
pub mod rollout;
pub mod rollout_log;
pub mod rounds;
mod run;
mod setup;
mod step;
mod step_metrics;
pub mod transition;
pub mod tree;

use std::path::PathBuf;

pub use crate::harness::{RunSummary, eval_due};
pub use evaluate::{AtK, code_at_k};
pub use policy::{AgentBatches, Policy, TrainSample, UpdateStats};
pub use setup::{Trainer, TrainerSetup};

// The pieces every trainer builds on live below both trainers; re-exported here for the library's
// users (tests, other tools) that know them under `trainer`.
pub use crate::error::TrainError;
pub use crate::model_options::{
    learner_device, load_options, matmul_kind, rollout_kind, rollout_precision_differs,
    worker_agents,
};
pub use crate::prompts::items::{self, TrainItem, prepare_items};
pub use crate::seeds::derive_seed;
pub use crate::services::connect::{
    ServiceGuard, Services, connect_services, connect_services_ranked,
};
pub use crate::sources::{
    self, CodeOutcome, FeedbackSpec, GenRequest, GenSample, PoolStats, RewardSource, RolloutSource,
    SamplingSpec, Score, ScoreAction, WeightPush,
};

use crate::algo::AdamWConfig;
use crate::config::CheckedConfig;
use crate::data::{DatasetKind, load_split};

/// Seed path tags of the LoRA adapters' initial draws and of their dropout masks.
const TAG_LORA_INIT: u64 = 6;
const TAG_LORA_DROPOUT: u64 = 7;

/// The policies a config asks for and which agent uses which: one per agent (each fine-tunes its own
/// copy, or with LoRA its own adapter, on the same or different base models), or one for all with
/// `shared_parameters`.
pub fn load_policies(cfg: &CheckedConfig) -> Result<(Vec<Policy>, Vec<usize>), TrainError> {
    let opts = load_options(cfg)?;
    let t = &cfg.trainer;
    // A policy's learning rate is its first agent's (shared parameters: validation made them equal).
    let adam = |agent: usize| {
        AdamWConfig::new(
            cfg.agents[agent].learning_rate,
            t.weight_decay,
            t.max_grad_norm,
        )
    };
    let with_ref = t.reference_kl.enabled;
    if t.shared_parameters {
        let first = &cfg.agent_models[0];
        if let Some(other) = cfg.agent_models.iter().find(|m| *m != first) {
            return Err(TrainError::Config(format!(
                "{}: shared_parameters needs one base model, but model.agents names `{first}` and `{other}`",
                cfg.source.display()
            )));
        }
    }
    // LoRA policies share one frozen base per distinct spec (loaded once, dropped with the last
    // policy holding it).
    let mut bases: Vec<(String, cotrain_model::loader::LoadedModel)> = Vec::new();
    let mut policies = Vec::new();
    for (pi, (agent, spec)) in worker_agents(cfg).iter().enumerate() {
        let policy = match &cfg.agents[pi].lora {
            None => Policy::load(agent, spec, &opts, adam(pi), with_ref)?,
            Some(lora) => {
                let base = match bases.iter().position(|(s, _)| s == spec) {
                    Some(i) => &bases[i].1,
                    None => {
                        let mut m = cotrain_model::loader::load(spec, &opts)
                            .map_err(|e| TrainError::Model(format!("loading `{spec}`: {e}")))?;
                        m.vs.freeze();
                        bases.push((spec.clone(), m));
                        &bases[bases.len() - 1].1
                    }
                };
                // Each adapter's A from its own seed: the same on every rank and in every resume.
                tch::manual_seed(crate::seeds::derive_seed(&[
                    cfg.raw.seed,
                    TAG_LORA_INIT,
                    pi as u64,
                ]) as i64);
                let dropout_seed =
                    crate::seeds::derive_seed(&[cfg.raw.seed, TAG_LORA_DROPOUT, pi as u64]);
                Policy::lora(
                    agent,
                    spec,
                    base,
                    lora.clone(),
                    adam(pi),
                    with_ref,
                    dropout_seed,
                )?
            }
        };
        policies.push(policy);
    }
    let agent_policy = if t.shared_parameters {
        vec![0; cfg.num_agents]
    } else {
        (0..cfg.num_agents).collect()
    };
    Ok((policies, agent_policy))
}

/// Where runs live is the run state's business; kept here for the callers that found it here.
pub use crate::run_state::run_dir_for;

/// Refuses configs that ask for a trainer feature that is not built yet, or a run that cannot work
/// (a rollout tree too large for `max_nodes_per_item`, `expert_edits` without an expert), naming the
/// key, so that no run silently does something other than what its config says.
pub fn check_supported(cfg: &CheckedConfig) -> Result<(), TrainError> {
    let t = &cfg.trainer;
    let section = cfg.algorithm.section();
    if cfg.algorithm == crate::config::Algorithm::Maporl {
        if cfg.raw.rollout.max_off_policy_steps > 0 {
            return Err(TrainError::NotBuilt(format!(
                "{}: rollout.max_off_policy_steps is {}: the maporl trainer samples on-policy (asynchronous rollouts are built for \
                 the GRPO/MAGRPO trainer)",
                cfg.source.display(),
                cfg.raw.rollout.max_off_policy_steps
            )));
        }
        return match DatasetKind::resolve(&cfg.raw.dataset) {
            Ok(DatasetKind::Gsm8k | DatasetKind::Anli) => Ok(()),
            _ => Err(TrainError::NotBuilt(format!(
                "{}: the maporl trainer discusses GSM8K and ANLI questions (one answer per agent); dataset `{}` is not one",
                cfg.source.display(),
                cfg.raw.dataset.name
            ))),
        };
    }
    if cfg.algorithm.is_actor_critic() && cfg.raw.rollout.max_off_policy_steps > 0 {
        return Err(TrainError::NotBuilt(format!(
            "{}: rollout.max_off_policy_steps is {}: the {section} trainer samples on-policy, item by item, as upstream",
            cfg.source.display(),
            cfg.raw.rollout.max_off_policy_steps
        )));
    }
    if cfg.is_multi_turn() && t.rollout == crate::config::MultiTurnMode::Tree {
        let nodes =
            tree::max_tree_nodes(t.joint_mode, cfg.num_agents, t.num_generations, t.num_turns);
        if nodes > t.max_nodes_per_item as u128 {
            let growth = match t.joint_mode {
                crate::config::JointMode::Aligned => {
                    format!("G^T = {}^{} leaves", t.num_generations, t.num_turns)
                }
                crate::config::JointMode::Cross => format!(
                    "G^(N*T) = {}^({}*{}) leaves",
                    t.num_generations, cfg.num_agents, t.num_turns
                ),
            };
            return Err(TrainError::Config(format!(
                "{}: a {section} tree rollout grows up to {nodes} nodes per item ({growth} without early stops), more than \
                 {section}.max_nodes_per_item = {}: lower num_generations or num_turns, use joint_mode: aligned or rollout: handoff, \
                 or raise max_nodes_per_item",
                cfg.source.display(),
                t.max_nodes_per_item
            )));
        }
    }
    if cfg.is_multi_turn()
        && let Ok(kind) = DatasetKind::resolve(&cfg.raw.dataset)
        && !kind.is_code()
    {
        return Err(TrainError::NotBuilt(format!(
            "{}: {section}.num_turns is {}: the next-turn feedback (external.mode) exists for the code tasks only; \
             dataset `{}` is not one (discussions on GSM8K/ANLI are the MaPoRL trainer's: use a `maporl` section)",
            cfg.source.display(),
            t.num_turns,
            cfg.raw.dataset.name
        )));
    }
    let ext = &cfg.raw.external;
    if cfg.is_multi_turn() && ext.mode == crate::config::ExternalMode::ExpertEdits {
        for (key, value) in [
            ("expert_model", &ext.expert_model),
            ("expert_base_url", &ext.expert_base_url),
        ] {
            if value.is_none() {
                return Err(TrainError::Config(format!(
                    "{}: external.mode is expert_edits but external.{key} is not set (any OpenAI-compatible chat endpoint works, \
                     e.g. a rollout worker's http://HOST:PORT/v1)",
                    cfg.source.display()
                )));
            }
        }
    }
    let ro = &cfg.raw.rollout;
    if ro.max_off_policy_steps > 0 || rollout_precision_differs(cfg) {
        if cfg.is_multi_turn() && ro.max_off_policy_steps > 0 {
            return Err(TrainError::NotBuilt(format!(
                "{}: rollout.max_off_policy_steps is {} with {section}.num_turns {}: asynchronous rollouts are built for \
                 single-turn training so far (use 0, synchronous on-policy)",
                cfg.source.display(),
                ro.max_off_policy_steps,
                t.num_turns
            )));
        }
        if let Some(cap) = ro.importance_weight_cap
            && !(cap.is_finite() && cap > 0.0)
        {
            return Err(TrainError::Config(format!(
                "{}: rollout.importance_weight_cap must be a positive number (or null for no correction), got {cap}",
                cfg.source.display()
            )));
        }
    }
    Ok(())
}

/// Refuses what data-parallel ranks do not do yet, naming the key: with `world` > 1 ranks, the
/// multi-turn `tree` rollout of MAGRPO (the original's update groups chunk nodes across items,
/// which ranks holding different items cannot reproduce), and agent placement for the
/// actor-critic trainers.
pub fn check_ranks(cfg: &CheckedConfig, world: usize) -> Result<(), TrainError> {
    if world == 1 {
        return Ok(());
    }
    let section = cfg.algorithm.section();
    if cfg.algorithm.is_actor_critic()
        && cfg.raw.learner.placement == crate::config::Placement::Agent
    {
        return Err(TrainError::NotBuilt(format!(
            "{}: learner.placement: agent with {world} ranks: the {section} trainer places data only so far (each rank rolls out \
             its share of the items and trains every actor and critic on its share of each mini-batch); use learner.placement: data",
            cfg.source.display()
        )));
    }
    if cfg.algorithm.is_actor_critic() {
        // Whole items per rank (chains included) and one buffer held by every rank: the limits
        // below are MAGRPO's update groups' (asynchronous rollouts are refused for these trainers
        // on any number of ranks).
        return Ok(());
    }
    if cfg.raw.rollout.max_off_policy_steps > 0 {
        return Err(TrainError::NotBuilt(format!(
            "{}: {world} learner ranks with rollout.max_off_policy_steps > 0: asynchronous rollouts run on one rank so far",
            cfg.source.display()
        )));
    }
    if cfg.raw.learner.placement == crate::config::Placement::Agent {
        let policies = if cfg.trainer.shared_parameters {
            1
        } else {
            cfg.num_agents
        };
        if policies < 2 {
            return Err(TrainError::Config(format!(
                "{}: learner.placement: agent places each agent's policy on its own ranks, but this run trains one policy \
                 ({}); use learner.placement: data",
                cfg.source.display(),
                if cfg.trainer.shared_parameters {
                    "shared_parameters: true"
                } else {
                    "one agent"
                }
            )));
        }
        if !world.is_multiple_of(policies) {
            return Err(TrainError::Config(format!(
                "{}: learner.placement: agent with {policies} policies needs a multiple of {policies} ranks, got {world}",
                cfg.source.display()
            )));
        }
    }
    if cfg.trainer.train_batch_unit == Some(crate::config::BatchUnit::Nodes)
        && cfg
            .trainer
            .train_batch_size
            .is_some_and(|b| b < cfg.trainer.rollout_buffer_size)
    {
        return Err(TrainError::NotBuilt(format!(
            "{}: {world} learner ranks with {section}.train_batch_unit: nodes and train_batch_size ({}) below rollout_buffer_size \
             ({}): one rank steps the optimiser once per mini-batch of nodes, which ranks holding parts of the buffer cannot \
             reproduce; use one rank, or train_batch_size >= rollout_buffer_size",
            cfg.source.display(),
            cfg.trainer.train_batch_size.unwrap_or_default(),
            cfg.trainer.rollout_buffer_size
        )));
    }
    if cfg.is_multi_turn() && cfg.trainer.rollout == crate::config::MultiTurnMode::Tree {
        return Err(TrainError::NotBuilt(format!(
            "{}: {world} learner ranks with a multi-turn `tree` rollout are not built yet (its update groups span items that \
             different ranks hold); use {section}.rollout: handoff, or one rank",
            cfg.source.display()
        )));
    }
    Ok(())
}

/// Everything for a run of `cfg` in `run_dir`: policies, data, prompts, services.
pub fn build(cfg: &CheckedConfig, run_dir: PathBuf) -> Result<(Trainer, ServiceGuard), TrainError> {
    build_ranked(cfg, run_dir, Box::new(crate::dist::SingleRank))
}

/// [`build`] as one rank of `dist`: rank 0 connects to (or starts) the services and tells the other
/// ranks where they are, so that the embedded services are started once per job.
pub fn build_ranked(
    cfg: &CheckedConfig,
    run_dir: PathBuf,
    dist: Box<dyn crate::dist::Collective>,
) -> Result<(Trainer, ServiceGuard), TrainError> {
    check_supported(cfg)?;
    let kind = DatasetKind::resolve(&cfg.raw.dataset)
        .map_err(|e| TrainError::Data(format!("{}: dataset: {e}", cfg.source.display())))?;
    let train = load_split(&cfg.raw.dataset, &cfg.train_split)
        .map_err(|e| TrainError::Data(e.to_string()))?;
    let eval = match &cfg.eval_split {
        Some(s) => {
            Some(load_split(&cfg.raw.dataset, s).map_err(|e| TrainError::Data(e.to_string()))?)
        }
        None => None,
    };
    let (policies, agent_policy) = load_policies(cfg)?;
    let prompter = crate::prompts::Prompter::from_config(cfg)
        .map_err(|e| TrainError::Config(format!("{}: {e}", cfg.source.display())))?;
    let encoding = cfg.prompt_encoding();
    let max_prompt: Vec<usize> = (0..cfg.num_agents)
        .map(|a| cfg.max_prompt_tokens(a))
        .collect();
    let models: Vec<&cotrain_model::loader::LoadedModel> =
        agent_policy.iter().map(|&p| &policies[p].model).collect();
    let train_items = prepare_items(&train, &models, &prompter, &encoding, &max_prompt)?;
    let eval_items = match &eval {
        Some(d) => prepare_items(d, &models, &prompter, &encoding, &max_prompt)?,
        None => Vec::new(),
    };
    let agents: Vec<(String, String)> = policies
        .iter()
        .map(|p| (p.worker_agent.clone(), p.model_spec.clone()))
        .collect();
    let services = if dist.world() == 1 {
        connect_services(cfg, &agents)?
    } else {
        connect_services_ranked(cfg, &agents, dist.as_ref())?
    };
    let Services {
        rollout,
        reward,
        guard,
    } = services;
    let setup = TrainerSetup {
        cfg: cfg.clone(),
        run_dir,
        task: items::reward_task(kind).to_string(),
        is_code: kind.is_code(),
        policies,
        agent_policy,
        rollout,
        reward,
        train_items,
        eval_items,
    };
    let mut trainer = Trainer::new_ranked(setup, dist)?;
    if cfg.is_multi_turn() && cfg.raw.external.mode == crate::config::ExternalMode::ExpertEdits {
        let expert = crate::external::expert::ExpertClient::from_config(
            &cfg.raw.external,
            guard.runtime.clone(),
        )
        .map_err(|e| TrainError::Config(format!("{}: {e}", cfg.source.display())))?;
        trainer = trainer.with_expert(expert);
    }
    Ok((trainer, guard))
}
