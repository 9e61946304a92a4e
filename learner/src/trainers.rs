//! Which trainer a config runs, and the one `learner train` and `learner eval` path every trainer
//! shares: ranks, the run directory, resume checks, building the trainer with its services, and
//! the run harness ([`crate::harness`]).
//!
//! Adding a trainer: implement [`crate::harness::Algorithm`] for it and add its arm to [`build`]
//! and [`check_launch`].

use std::path::{Path, PathBuf};

use tracing::warn;

use crate::config::{Algorithm as Kind, CheckedConfig};
use crate::dist::Collective;
use crate::error::TrainError;
use crate::harness::{Algorithm, RunSummary, Scalars};
use crate::services::connect::ServiceGuard;

/// A trainer for `cfg` as one rank of `dist`, with the services it talks to (keep the guard until
/// the trainer is dropped: it stops the embedded services).
pub fn build(
    cfg: &CheckedConfig,
    run_dir: PathBuf,
    dist: Box<dyn Collective>,
) -> Result<(Box<dyn Algorithm>, ServiceGuard), TrainError> {
    Ok(match cfg.algorithm {
        Kind::Maporl => {
            let (t, guard) = crate::maporl::build_ranked(cfg, run_dir, dist)?;
            (Box::new(t), guard)
        }
        // GRPO, MAGRPO and the actor-critic trainers (IAC, MAAC).
        _ => {
            let (t, guard) = crate::trainer::build_ranked(cfg, run_dir, dist)?;
            (Box::new(t), guard)
        }
    })
}

/// Refuses, before anything is loaded, what the config's trainer does not do on `world` ranks.
pub fn check_launch(cfg: &CheckedConfig, world: usize, resuming: bool) -> Result<(), TrainError> {
    match cfg.algorithm {
        Kind::Maporl => crate::maporl::check_launch(cfg, world, resuming),
        _ => {
            crate::trainer::check_supported(cfg)?;
            crate::trainer::check_ranks(cfg, world)
        }
    }
}

/// `learner train`: a new run, or with `resume` the run in that directory continued from its
/// latest checkpoint; returns where things are.
///
/// Launched as one of several ranks (see [`crate::dist`]), this process trains its share of every
/// step; rank 0 names the run directory, writes it, and resumes from it (the other ranks receive
/// its state).
pub fn train(cfg: &CheckedConfig, resume: Option<&Path>) -> Result<RunSummary, TrainError> {
    let dist = crate::dist::init_with_timeout(
        cfg.raw.learner.backend,
        crate::model_options::learner_device(cfg)?,
        cfg.collective_timeout(),
    )?;
    crate::dist::run_ranked(dist, |dist| train_ranked(cfg, resume, dist))
}

/// [`train`] as one rank of `dist`.
fn train_ranked(
    cfg: &CheckedConfig,
    resume: Option<&Path>,
    dist: Box<dyn Collective>,
) -> Result<RunSummary, TrainError> {
    check_launch(cfg, dist.world(), resume.is_some())?;
    let root = dist.is_root();
    let run_dir = resume.map_or_else(|| crate::run_state::run_dir_for(cfg), Path::to_path_buf);
    let run_dir = crate::dist::shared_run_dir(dist.as_ref(), run_dir)?;
    if root {
        std::fs::create_dir_all(&run_dir)
            .map_err(|e| TrainError::Io(format!("{}: {e}", run_dir.display())))?;
        if resume.is_some() {
            crate::checkpoint::check_resume_config(cfg, &run_dir)?;
            // A process killed mid-checkpoint left a partial copy of the state behind.
            for stale in crate::checkpoint::remove_stale_temporaries(&run_dir)
                .map_err(|e| TrainError::Checkpoint(e.to_string()))?
            {
                warn!(path = %stale.display(), "removed a partial checkpoint left by an interrupted run");
            }
        }
        std::fs::write(run_dir.join("config.yaml"), cfg.to_yaml())
            .map_err(|e| TrainError::Io(format!("{}: {e}", run_dir.display())))?;
    }
    let (mut alg, services) = build(cfg, run_dir.clone(), dist)?;
    if resume.is_some() && root {
        alg.resume_from(&run_dir)?;
    }
    let summary = crate::harness::drive(alg.as_mut());
    // The trainer before its services.
    drop(alg);
    drop(services);
    summary
}

/// `learner eval`: the weights saved under `path` loaded into a trainer built from `cfg` and
/// evaluated on the eval split; the scalars are returned and written to `eval.json` beside the
/// weights. `ks` are the k of the @k metrics (trainers without them ignore `ks`).
pub fn evaluate(cfg: &CheckedConfig, path: &Path, ks: &[usize]) -> Result<Scalars, TrainError> {
    if cfg.eval_split.is_none() {
        return Err(TrainError::Config(format!(
            "{}: dataset.eval_split is not set",
            cfg.source.display()
        )));
    }
    // What is cheap to check comes before the trainer and its services are built.
    if cfg.algorithm == Kind::Maporl {
        crate::maporl::run::saved::saved_policies_dir(path)?;
    }
    let tmp_run = std::env::temp_dir().join(format!("cotrain-eval-{}", std::process::id()));
    let (mut alg, services) = build(cfg, tmp_run.clone(), Box::new(crate::dist::SingleRank))?;
    let result = (|| {
        let dir = alg.load_saved(path)?;
        let m = alg.evaluate_saved(ks)?;
        let out = dir.join("eval.json");
        std::fs::write(&out, serde_json::to_vec_pretty(&m).unwrap_or_default())
            .map_err(|e| TrainError::Io(format!("{}: {e}", out.display())))?;
        Ok(m)
    })();
    drop(alg);
    drop(services);
    let _ = std::fs::remove_dir_all(&tmp_run);
    result
}
