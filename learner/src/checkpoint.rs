//! Atomic checkpoints: everything is written to a temporary directory next to the target, fsynced,
//! then renamed into place, so a kill mid-write leaves the previous checkpoint usable.
//!
//! Layout of `RUN_DIR/checkpoints/step-{N}/`: `agent-{i}/model.safetensors` (weights),
//! `agent-{i}/optimizer.safetensors` (AdamW moments), `state.json` ([`TrainState`]: step, data
//! position, RNG state, optimiser steps). `RUN_DIR/checkpoints/latest` names the newest one.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tch::{Tensor, nn};

use crate::algo::AdamW;
use crate::config::CheckedConfig;
use crate::error::TrainError;

/// Why a checkpoint could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A filesystem operation failed.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A tensor file could not be written or read.
    #[error("{path}: {source}")]
    Torch {
        path: PathBuf,
        source: tch::TchError,
    },
    /// The checkpoint does not match what it is loaded into.
    #[error("{path}: {message}")]
    Mismatch { path: PathBuf, message: String },
}

/// The non-tensor state needed to continue a run exactly.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainState {
    /// Optimiser rounds done.
    pub step: u64,
    pub epoch: u64,
    /// Items of the current epoch already consumed.
    pub data_position: u64,
    /// The run's RNG: ChaCha seed and word position (as a decimal string: it is a u128).
    pub rng_seed: u64,
    pub rng_word_pos: String,
    /// Per-agent optimiser step counts (bias correction of AdamW).
    pub optimizer_steps: Vec<u64>,
    /// The policy version each worker agent was last pushed (its weights' version on the rollout
    /// workers). Checkpoints written before this field carried a `policy_version` that held the step;
    /// it is ignored when read.
    #[serde(default)]
    pub served_versions: std::collections::BTreeMap<String, u64>,
    /// Anything else the trainer wants to keep (e.g. the data order of the epoch).
    #[serde(default)]
    pub extra: serde_json::Value,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn sync_dir(path: &Path) -> Result<(), CheckpointError> {
    File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(io(path))
}

fn sync_file(path: &Path) -> Result<(), CheckpointError> {
    File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(io(path))
}

fn write_tensors(path: &Path, tensors: &BTreeMap<String, Tensor>) -> Result<(), CheckpointError> {
    let list: Vec<(&str, Tensor)> = tensors
        .iter()
        .map(|(k, t)| {
            (
                k.as_str(),
                t.detach().to_device(tch::Device::Cpu).contiguous(),
            )
        })
        .collect();
    Tensor::write_safetensors(&list, path).map_err(|source| CheckpointError::Torch {
        path: path.to_path_buf(),
        source,
    })?;
    sync_file(path)
}

fn read_tensors(path: &Path) -> Result<BTreeMap<String, Tensor>, CheckpointError> {
    Ok(Tensor::read_safetensors(path)
        .map_err(|source| CheckpointError::Torch {
            path: path.to_path_buf(),
            source,
        })?
        .into_iter()
        .collect())
}

/// Writes `checkpoints/step-{state.step}` atomically and points `checkpoints/latest` at it.
/// `agents` holds one (weights, optimiser) pair per distinct model (one for shared parameters).
pub fn save_checkpoint(
    run_dir: &Path,
    agents: &[(&nn::VarStore, &AdamW)],
    state: &TrainState,
) -> Result<PathBuf, CheckpointError> {
    save_checkpoint_with(run_dir, agents, state, |_| Ok(()))
}

/// [`save_checkpoint`], with `extra` writing more files into the checkpoint's temporary directory
/// before it is renamed into place (so that they are part of the same atomic step): MaPoRL's
/// policies in PEFT's layout.
pub fn save_checkpoint_with(
    run_dir: &Path,
    agents: &[(&nn::VarStore, &AdamW)],
    state: &TrainState,
    extra: impl FnOnce(&Path) -> Result<(), String>,
) -> Result<PathBuf, CheckpointError> {
    let root = run_dir.join("checkpoints");
    std::fs::create_dir_all(&root).map_err(io(&root))?;
    let name = format!("step-{}", state.step);
    let final_dir = root.join(&name);
    let tmp = root.join(format!(".tmp-{name}-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
    }
    std::fs::create_dir_all(&tmp).map_err(io(&tmp))?;
    for (i, (vs, opt)) in agents.iter().enumerate() {
        let dir = tmp.join(format!("agent-{i}"));
        std::fs::create_dir_all(&dir).map_err(io(&dir))?;
        let weights: BTreeMap<String, Tensor> = vs.variables().into_iter().collect();
        write_tensors(&dir.join("model.safetensors"), &weights)?;
        write_tensors(&dir.join("optimizer.safetensors"), &opt.state_tensors())?;
        sync_dir(&dir)?;
    }
    extra(&tmp).map_err(|message| CheckpointError::Mismatch {
        path: tmp.clone(),
        message,
    })?;
    let state_path = tmp.join("state.json");
    let json = serde_json::to_vec_pretty(state).map_err(|e| CheckpointError::Io {
        path: state_path.clone(),
        source: e.into(),
    })?;
    let mut f = File::create(&state_path).map_err(io(&state_path))?;
    f.write_all(&json)
        .and_then(|_| f.sync_all())
        .map_err(io(&state_path))?;
    sync_dir(&tmp)?;
    if final_dir.exists() {
        // Re-saving the same step: move the old one aside first so the rename stays atomic.
        let old = root.join(format!(".old-{name}-{}", std::process::id()));
        std::fs::rename(&final_dir, &old).map_err(io(&final_dir))?;
        std::fs::rename(&tmp, &final_dir).map_err(io(&final_dir))?;
        std::fs::remove_dir_all(&old).map_err(io(&old))?;
    } else {
        std::fs::rename(&tmp, &final_dir).map_err(io(&final_dir))?;
    }
    let latest_tmp = root.join(format!(".latest-{}", std::process::id()));
    std::fs::write(&latest_tmp, &name).map_err(io(&latest_tmp))?;
    sync_file(&latest_tmp)?;
    let latest = root.join("latest");
    std::fs::rename(&latest_tmp, &latest).map_err(io(&latest))?;
    sync_dir(&root)?;
    Ok(final_dir)
}

/// The `step-N` checkpoints of a run, oldest first.
fn step_dirs(root: &Path) -> Result<Vec<(u64, PathBuf)>, CheckpointError> {
    let mut out = Vec::new();
    let entries = match std::fs::read_dir(root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => {
            return Err(CheckpointError::Io {
                path: root.to_path_buf(),
                source: e,
            });
        }
    };
    for entry in entries {
        let entry = entry.map_err(io(root))?;
        let name = entry.file_name();
        if let Some(step) = name
            .to_str()
            .and_then(|n| n.strip_prefix("step-"))
            .and_then(|n| n.parse::<u64>().ok())
        {
            out.push((step, entry.path()));
        }
    }
    out.sort();
    Ok(out)
}

/// `output.save_total_limit` (Hugging Face's meaning): keeps the newest `keep` checkpoints of
/// `run_dir` and removes the older ones, never the one `latest` names. Returns what it removed.
pub fn prune_checkpoints(run_dir: &Path, keep: usize) -> Result<Vec<PathBuf>, CheckpointError> {
    let root = run_dir.join("checkpoints");
    let dirs = step_dirs(&root)?;
    let latest = latest_checkpoint(run_dir);
    let excess = dirs.len().saturating_sub(keep.max(1));
    let mut removed = Vec::new();
    for (_, dir) in dirs.into_iter().take(excess) {
        if latest.as_ref() == Some(&dir) {
            continue;
        }
        std::fs::remove_dir_all(&dir).map_err(io(&dir))?;
        removed.push(dir);
    }
    Ok(removed)
}

/// Applies `output.save_total_limit` after a checkpoint was written: prunes with
/// [`prune_checkpoints`] and logs what went. A failure is a warning: the new checkpoint is written,
/// and failing to remove an old one is no reason to stop the run.
pub fn apply_save_total_limit(run_dir: &Path, limit: Option<usize>) {
    let Some(keep) = limit else { return };
    match prune_checkpoints(run_dir, keep) {
        Ok(removed) => removed.iter().for_each(|old| tracing::info!(checkpoint = %old.display(), keep, "older checkpoint removed (output.save_total_limit)")),
        Err(e) => tracing::warn!(error = %e, "an older checkpoint could not be removed (output.save_total_limit)"),
    }
}

/// Removes what a process killed mid-checkpoint left in `run_dir/checkpoints` (`.tmp-step-*`,
/// `.old-step-*`, `.latest-*`): only one process writes a run's checkpoints, so at its start none
/// of these is in use. Nothing is removed while `latest` names no complete checkpoint: a kill in the
/// middle of re-saving a step can leave its only copy in `.old-step-*` or `.tmp-step-*`. Returns
/// what it removed.
pub fn remove_stale_temporaries(run_dir: &Path) -> Result<Vec<PathBuf>, CheckpointError> {
    let root = run_dir.join("checkpoints");
    let mut removed = Vec::new();
    if root.join("latest").exists() && latest_checkpoint(run_dir).is_none() {
        return Ok(removed);
    }
    let Ok(entries) = std::fs::read_dir(&root) else {
        return Ok(removed);
    };
    for entry in entries {
        let entry = entry.map_err(io(&root))?;
        let stale = entry.file_name().to_str().is_some_and(|n| {
            [".tmp-step-", ".old-step-", ".latest-"]
                .iter()
                .any(|p| n.starts_with(p))
        });
        if stale {
            let path = entry.path();
            if path.is_dir() {
                std::fs::remove_dir_all(&path)
            } else {
                std::fs::remove_file(&path)
            }
            .map_err(io(&path))?;
            removed.push(path);
        }
    }
    Ok(removed)
}

/// The newest complete checkpoint of a run, if any.
pub fn latest_checkpoint(run_dir: &Path) -> Option<PathBuf> {
    let root = run_dir.join("checkpoints");
    let name = std::fs::read_to_string(root.join("latest")).ok()?;
    let dir = root.join(name.trim());
    dir.join("state.json").is_file().then_some(dir)
}

/// Loads a checkpoint into the given models and optimisers (same order as saved) and returns its state.
pub fn load_checkpoint(
    dir: &Path,
    agents: &mut [(&mut nn::VarStore, &mut AdamW)],
) -> Result<TrainState, CheckpointError> {
    let state_path = dir.join("state.json");
    let text = std::fs::read_to_string(&state_path).map_err(io(&state_path))?;
    let state: TrainState = serde_json::from_str(&text).map_err(|e| CheckpointError::Mismatch {
        path: state_path.clone(),
        message: e.to_string(),
    })?;
    if state.optimizer_steps.len() != agents.len() {
        return Err(CheckpointError::Mismatch {
            path: state_path,
            message: format!(
                "checkpoint has {} optimisers, the run {}",
                state.optimizer_steps.len(),
                agents.len()
            ),
        });
    }
    for (i, (vs, opt)) in agents.iter_mut().enumerate() {
        let adir = dir.join(format!("agent-{i}"));
        let weights_path = adir.join("model.safetensors");
        let weights = read_tensors(&weights_path)?;
        let mut vars = vs.variables();
        if vars.len() != weights.len() {
            return Err(CheckpointError::Mismatch {
                path: weights_path,
                message: format!(
                    "{} tensors in the file, {} in the model",
                    weights.len(),
                    vars.len()
                ),
            });
        }
        tch::no_grad(|| -> Result<(), CheckpointError> {
            for (name, var) in vars.iter_mut() {
                let src = weights.get(name).ok_or_else(|| CheckpointError::Mismatch {
                    path: weights_path.clone(),
                    message: format!("no tensor `{name}`"),
                })?;
                var.f_copy_(src).map_err(|source| CheckpointError::Torch {
                    path: weights_path.clone(),
                    source,
                })?;
            }
            Ok(())
        })?;
        let opt_path = adir.join("optimizer.safetensors");
        let opt_state = read_tensors(&opt_path)?;
        opt.load_state(&opt_state, state.optimizer_steps[i])
            .map_err(|message| CheckpointError::Mismatch {
                path: opt_path,
                message,
            })?;
    }
    Ok(state)
}

/// The non-tensor state of a checkpoint directory (its `state.json`).
pub fn read_state(dir: &Path) -> Result<TrainState, CheckpointError> {
    let state_path = dir.join("state.json");
    let text = std::fs::read_to_string(&state_path).map_err(io(&state_path))?;
    serde_json::from_str(&text).map_err(|e| CheckpointError::Mismatch {
        path: state_path,
        message: e.to_string(),
    })
}

/// The weights of the `index`-th model of a checkpoint (`agent-{index}/model.safetensors`), by
/// parameter name, without reading or allocating any optimiser state: what `learner export` needs.
pub fn read_weights(dir: &Path, index: usize) -> Result<BTreeMap<String, Tensor>, CheckpointError> {
    read_tensors(&dir.join(format!("agent-{index}")).join("model.safetensors"))
}

/// Refuses to resume `run_dir` with a config that would change the run (see
/// [`crate::config::resume`]), naming every key that differs from the run's `config.yaml`.
pub(crate) fn check_resume_config(cfg: &CheckedConfig, run_dir: &Path) -> Result<(), TrainError> {
    let path = run_dir.join("config.yaml");
    let text = std::fs::read_to_string(&path).map_err(|e| {
        TrainError::Checkpoint(format!(
            "{}: cannot read the run's config to compare with: {e}",
            path.display()
        ))
    })?;
    // Through the schema, so that keys added since the run started compare as their defaults.
    let value = serde_yaml_ng::from_str(&text)
        .map_err(|e| TrainError::Checkpoint(format!("{}: {e}", path.display())))?;
    let was = CheckedConfig::from_value(value, &path)
        .map_err(|e| TrainError::Checkpoint(e.to_string()))?;
    let to_value =
        |c: &CheckedConfig| serde_yaml_ng::to_value(&c.raw).unwrap_or(serde_yaml_ng::Value::Null);
    let changes = crate::config::resume::forbidden_changes(&to_value(&was), &to_value(cfg));
    if changes.is_empty() {
        return Ok(());
    }
    let list: Vec<String> = changes
        .iter()
        .map(|c| format!("  {}: {} (run) -> {} (given)", c.key, c.was, c.now))
        .collect();
    Err(TrainError::Config(format!(
        "--resume {}: the given config changes the run:\n{}\nresume with the run's own config ({}); keys that may change on resume: {}",
        run_dir.display(),
        list.join("\n"),
        path.display(),
        crate::config::resume::RESUMABLE_KEYS.join(", ")
    )))
}
