//! MaPoRL (Park et al. 2025, arXiv 2502.18439; docs/src/trainers/maporl.md): N agents discuss each question
//! over T turns and are trained with PPO, with LoRA adapters on frozen bases and a critic per agent.
//!
//! - [`agents`]: bases, the adapter layout's keys, policy adapters and critics;
//! - [`rollout`]: the discussions of a batch through the rollout workers and the reward server;
//! - [`update`]: the PPO update of a step;
//! - [`run`]: the loop, evaluation, the rollout log, adapters saved in PEFT's layout;
//! - [`plot`]: accuracy per turn;
//! - this module: building a run from a config ([`build`]) and `learner train` on a `maporl` config
//!   ([`train`]).

pub mod agents;
pub mod plot;
pub mod rewrite;
pub mod rollout;
pub mod run;
pub mod targets;
pub mod update;

use std::path::PathBuf;

pub use agents::{Adapters, Bases, adapter_key, critic_key};
pub use run::{MaporlSetup, MaporlSummary, MaporlTrainer};

use crate::config::CheckedConfig;
use crate::prompts::items::{prepare_items, reward_task};
use crate::data::{DatasetKind, load_split};
use crate::error::TrainError;
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

/// `learner train` on a `maporl` config.
///
/// Launched as one of several ranks, each discusses its share of every step's questions and takes
/// its share of every PPO mini-batch (see [`update::ppo_update`]); rank 0 writes the run.
/// `learner eval` on a MaPoRL config: the policies saved under `path` (a run directory, its
/// `adapters/` or `final_model/`, or a `checkpoints/step-N/`) evaluated as the run evaluates
/// itself: accuracy per turn on the eval split's first `eval_num_samples` questions, with the
/// sampling seed the run used at that step (so the final policies give the run's final `eval/`
/// scalars). The scalars are returned and written to `eval.json` beside the policies.
pub fn evaluate_saved(cfg: &CheckedConfig, path: &std::path::Path) -> Result<std::collections::BTreeMap<String, f64>, TrainError> {
    let dir = crate::export::maporl_dir(path).ok_or_else(|| {
        TrainError::Checkpoint(format!(
            "{}: no saved MaPoRL policies ({} there, or in its adapters/, final_model/ or checkpoints/step-N/)",
            path.display(),
            crate::export::MAPORL_MANIFEST
        ))
    })?;
    if cfg.eval_split.is_none() {
        return Err(TrainError::Config(format!("{}: dataset.eval_split is not set", cfg.source.display())));
    }
    let tmp_run = std::env::temp_dir().join(format!("cotrain-eval-{}", std::process::id()));
    let (mut trainer, services) = build(cfg, tmp_run.clone())?;
    trainer.load_saved_policies(&dir)?;
    tracing::info!(policies = %dir.display(), "evaluating saved MaPoRL policies");
    let m = trainer.evaluate_loaded()?;
    let out = dir.join("eval.json");
    std::fs::write(&out, serde_json::to_vec_pretty(&m).unwrap_or_default()).map_err(|e| TrainError::Io(format!("{}: {e}", out.display())))?;
    drop(trainer);
    drop(services);
    let _ = std::fs::remove_dir_all(&tmp_run);
    Ok(m)
}

/// `learner train` on a MaPoRL config: a new run in `run_dir`, or with `resume` the run there
/// continued from its latest checkpoint (one learner rank).
pub fn train(cfg: &CheckedConfig, run_dir: PathBuf, resume: bool) -> Result<MaporlSummary, TrainError> {
    let dist = crate::dist::init_with_timeout(
        cfg.raw.learner.backend,
        crate::model_options::learner_device(cfg)?,
        cfg.collective_timeout(),
    )?;
    crate::dist::run_ranked(dist, |dist| train_ranked(cfg, run_dir, resume, dist))
}

/// [`train`] as one rank of `dist`.
fn train_ranked(
    cfg: &CheckedConfig,
    run_dir: PathBuf,
    resume: bool,
    dist: Box<dyn crate::dist::Collective>,
) -> Result<MaporlSummary, TrainError> {
    if resume && dist.world() > 1 {
        return Err(TrainError::NotBuilt(format!(
            "{}: --resume of a MaPoRL run on several learner ranks is not built (resume it on one rank)",
            cfg.source.display()
        )));
    }
    if dist.world() > 1 && cfg.raw.learner.placement == crate::config::Placement::Agent {
        return Err(TrainError::NotBuilt(format!(
            "{}: learner.placement: agent is built for the GRPO/MAGRPO trainer; the maporl trainer splits data (learner.placement: data)",
            cfg.source.display()
        )));
    }
    let run_dir = crate::dist::shared_run_dir(dist.as_ref(), run_dir)?;
    if dist.is_root() {
        std::fs::create_dir_all(&run_dir)
            .map_err(|e| TrainError::Io(format!("{}: {e}", run_dir.display())))?;
        if resume {
            crate::checkpoint::check_resume_config(cfg, &run_dir)?;
            let _ = crate::checkpoint::remove_stale_temporaries(&run_dir);
        }
        std::fs::write(run_dir.join("config.yaml"), cfg.to_yaml())
            .map_err(|e| TrainError::Io(format!("{}: {e}", run_dir.display())))?;
    }
    let (mut trainer, services) = build_ranked(cfg, run_dir.clone(), dist)?;
    if resume {
        trainer.resume(&run_dir)?;
    }
    let summary = trainer.run();
    drop(trainer);
    drop(services);
    summary
}
