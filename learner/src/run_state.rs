//! Where a run stands on disk, for restarting it without a person (`learner train --resume auto`):
//! a finished run leaves a marker, a run with a complete checkpoint resumes from it, and anything
//! else starts over (a directory a killed run left without a checkpoint is moved aside, not removed).

use std::path::{Path, PathBuf};

use crate::config::CheckedConfig;
use crate::error::TrainError;

/// A new run's directory: `output.base_dir/<logging.run_name>`, or without a name
/// `<config file stem>-<unix seconds>`.
pub fn run_dir_for(cfg: &CheckedConfig) -> PathBuf {
    let name = cfg.raw.logging.run_name.clone().unwrap_or_else(|| {
        let stem = cfg
            .source
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "run".into());
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        format!("{stem}-{secs}")
    });
    PathBuf::from(&cfg.raw.output.base_dir).join(name)
}

/// The marker a run writes into its directory once it has finished (not when stopped on request).
pub const FINISHED: &str = "finished.json";

/// Marks `run_dir` finished after `steps` steps (written by rank 0 at the end of the run).
pub fn mark_finished(run_dir: &Path, steps: u64) -> Result<(), TrainError> {
    let path = run_dir.join(FINISHED);
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let body = serde_json::json!({"steps": steps, "finished_unix_secs": secs});
    std::fs::write(&path, body.to_string())
        .map_err(|e| TrainError::Io(format!("{}: {e}", path.display())))
}

/// What `--resume auto` does with a config's run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AutoResume {
    /// The run finished: nothing to do.
    Finished(PathBuf),
    /// Resume this run directory from its newest complete checkpoint.
    Resume(PathBuf),
    /// Start the run (its directory holds no checkpoint).
    Start,
}

/// Decides `--resume auto` for `cfg`: the run is `output.base_dir/<logging.run_name>`, so a
/// restarted learner finds it again (a name with the time in it would not).
pub fn auto_resume(cfg: &CheckedConfig) -> Result<AutoResume, TrainError> {
    if cfg.raw.logging.run_name.is_none() {
        return Err(TrainError::Config(format!(
            "{}: --resume auto needs logging.run_name (the run's directory must not depend on the start time)",
            cfg.source.display()
        )));
    }
    let dir = run_dir_for(cfg);
    if dir.join(FINISHED).is_file() {
        return Ok(AutoResume::Finished(dir));
    }
    if crate::checkpoint::latest_checkpoint(&dir).is_some() {
        return Ok(AutoResume::Resume(dir));
    }
    // Other ranks of a launch get the run directory from rank 0 ([`crate::dist::shared_run_dir`]).
    let root = crate::dist::RankEnv::from_env().map_or(true, |r| r.rank == 0);
    if dir.exists() && root {
        // Killed before its first checkpoint: keep what it wrote, beside the new start.
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let aside = dir.with_file_name(format!(
            "{}.incomplete-{secs}",
            dir.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        ));
        std::fs::rename(&dir, &aside).map_err(|e| {
            TrainError::Io(format!("{} -> {}: {e}", dir.display(), aside.display()))
        })?;
        tracing::warn!(run_dir = %dir.display(), moved_to = %aside.display(), "the run has no checkpoint to resume from; starting it again");
    }
    Ok(AutoResume::Start)
}
