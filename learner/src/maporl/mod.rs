//! MaPoRL (Park et al. 2025, arXiv 2502.18439; docs/src/trainers/maporl.md): N agents discuss each question
//! over T turns and are trained with PPO, with LoRA adapters on frozen bases and a critic per agent.
//!
//! - [`agents`]: bases, the adapter layout's keys, policy adapters and critics;
//! - [`rollout`]: the discussions of a batch through the rollout workers and the reward server;
//! - [`update`]: the PPO update of a step;
//! - [`run`]: the trainer, its step in the run harness, evaluation, the rollout log, adapters saved
//!   in PEFT's layout;
//! - [`plot`]: accuracy per turn;
//! - this module: building a run from a config ([`build`]) and what MaPoRL refuses
//!   ([`check_launch`]); `crate::trainers` runs it.

pub mod agents;
pub mod plot;
pub mod rewrite;
pub mod rollout;
pub mod run;
pub mod targets;
pub mod update;

use std::path::PathBuf;

pub use agents::{Adapters, Bases, critic_key};
pub use run::{MaporlSetup, MaporlTrainer};

use crate::config::CheckedConfig;
use crate::data::{DatasetKind, load_split};
use crate::error::TrainError;
use crate::prompts::items::{prepare_items, reward_task};
use crate::services::connect::{ServiceGuard, Services, connect_services};

pub use crate::services::EMBEDDED_VERIFIER;

/// The verifier name `score: verifier` asks the workers for, after checking that one will be
/// served: `maporl.verifier_path` is loaded by the embedded worker only, remote workers serve
/// theirs by name.
pub fn verifier_name(
    cfg: &CheckedConfig,
    m: &crate::config::MaporlSection,
) -> Result<Option<String>, TrainError> {
    let remote = !cfg.raw.rollout.endpoints.is_empty() || cfg.raw.rollout.dns_name.is_some();
    let file = cfg.source.display();
    match (m.score, &m.verifier_path, remote) {
        (crate::config::MaporlScore::Correctness, Some(_), _) => Err(TrainError::Config(format!(
            "{file}: maporl.verifier_path is set but maporl.score is correctness (set maporl.score: verifier)"
        ))),
        (crate::config::MaporlScore::Correctness, None, _) => Ok(None),
        (crate::config::MaporlScore::Verifier, Some(_), true) => Err(TrainError::Config(format!(
            "{file}: maporl.verifier_path is loaded by the embedded rollout worker, but rollout.endpoints/dns_name name remote workers: \
             start them with --verifier NAME=DIR and set maporl.verifier_name"
        ))),
        (crate::config::MaporlScore::Verifier, Some(dir), false) => {
            let manifest = std::path::Path::new(dir).join(cotrain_model::verifier::MANIFEST);
            if !manifest.is_file() {
                return Err(TrainError::Config(format!(
                    "{file}: maporl.verifier_path {dir}: no {} (train one with `learner verifier train`)",
                    manifest.display()
                )));
            }
            Ok(Some(
                m.verifier_name
                    .clone()
                    .unwrap_or_else(|| EMBEDDED_VERIFIER.to_string()),
            ))
        }
        (crate::config::MaporlScore::Verifier, None, false) => Err(TrainError::Config(format!(
            "{file}: maporl.score is verifier: set maporl.verifier_path to a directory from `learner verifier train` (or use remote workers serving one)"
        ))),
        (crate::config::MaporlScore::Verifier, None, true) => {
            Ok(Some(m.verifier_name.clone().unwrap_or_default()))
        }
    }
}

/// Refuses what a MaPoRL run on `world` learner ranks does not do yet, naming the key.
pub fn check_launch(cfg: &CheckedConfig, world: usize, resuming: bool) -> Result<(), TrainError> {
    if cfg.raw.rollout.wait_for_registration {
        return Err(TrainError::NotBuilt(format!(
            "{}: rollout.wait_for_registration is not built for maporl runs yet; give the workers as rollout.endpoints or \
             rollout.dns_name",
            cfg.source.display()
        )));
    }
    if resuming && world > 1 {
        return Err(TrainError::NotBuilt(format!(
            "{}: --resume of a MaPoRL run on several learner ranks is not built (resume it on one rank)",
            cfg.source.display()
        )));
    }
    if world > 1 && cfg.raw.learner.placement == crate::config::Placement::Agent {
        return Err(TrainError::NotBuilt(format!(
            "{}: learner.placement: agent is built for the GRPO/MAGRPO trainer; the maporl trainer splits data (learner.placement: data)",
            cfg.source.display()
        )));
    }
    Ok(())
}

/// Everything for a MaPoRL run of `cfg` in `run_dir`: bases, adapters, data, services (the rollout
/// workers serve one agent per adapter key).
pub fn build(
    cfg: &CheckedConfig,
    run_dir: PathBuf,
) -> Result<(MaporlTrainer, ServiceGuard), TrainError> {
    build_ranked(cfg, run_dir, Box::new(crate::dist::SingleRank))
}

/// [`build`] as one rank of `dist` (rank 0 starts or connects to the services and tells the others).
pub fn build_ranked(
    cfg: &CheckedConfig,
    run_dir: PathBuf,
    dist: Box<dyn crate::dist::Collective>,
) -> Result<(MaporlTrainer, ServiceGuard), TrainError> {
    let m = cfg.raw.maporl.as_ref().ok_or_else(|| {
        TrainError::Config(format!("{}: no maporl section", cfg.source.display()))
    })?;
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
    verifier_name(cfg, m)?;
    let bases = Bases::load(cfg, &crate::model_options::load_options(cfg)?)?;
    let adapters = Adapters::new(cfg, m, &bases)?;
    // `model.matmul_dtype` (set on the bases by `Adapters::new`): the adapters, heads and AdamW
    // state stay in `model.dtype`.
    if let (Some(kind), Some(b)) = (crate::model_options::matmul_kind(cfg), bases.models.first()) {
        crate::model_options::announce_matmul_rate(kind, b.model.device());
    }
    let prompter = crate::prompts::Prompter::from_config(cfg)
        .map_err(|e| TrainError::Config(format!("{}: {e}", cfg.source.display())))?;
    let encoding = cfg.prompt_encoding();
    let max_prompt =
        vec![cfg.raw.model.max_length.saturating_sub(m.max_output_length); cfg.num_agents];
    let models: Vec<&cotrain_model::loader::LoadedModel> =
        bases.agent_base.iter().map(|&b| &bases.models[b]).collect();
    let train_items = prepare_items(&train, &models, &prompter, &encoding, &max_prompt)?;
    let eval_items = match &eval {
        Some(d) => prepare_items(d, &models, &prompter, &encoding, &max_prompt)?,
        None => Vec::new(),
    };
    let agents = adapters.worker_agents(&bases);
    let Services {
        rollout,
        reward,
        guard,
    } = if dist.world() == 1 {
        connect_services(cfg, &agents)?
    } else {
        crate::services::connect::connect_services_ranked(cfg, &agents, dist.as_ref())?
    };
    let setup = MaporlSetup {
        cfg: cfg.clone(),
        run_dir,
        task: reward_task(kind).to_string(),
        bases,
        adapters,
        rollout,
        reward,
        train_items,
        eval_items,
    };
    Ok((MaporlTrainer::new_ranked(setup, dist)?, guard))
}
