//! `learner export`: a training checkpoint's policies as Hugging Face model directories, which
//! transformers, vLLM and cotrain's own `--model DIR` load.
//!
//! A checkpoint keeps only the learner's tensors; `state.json`'s `extra.policies[i].model` names
//! the base model each policy was loaded from. Exporting loads that base model (for its config,
//! tokenizer and chat template) in the dtype the checkpoint's tensors have, replaces its
//! parameters by the checkpoint's, and writes it with [`cotrain_model::export::save_pretrained`].
//! The optimiser moments are never read.
//!
//! A policy trained with LoRA (`model.lora`) is an adapter in the checkpoint, marked by
//! `extra.policies[i].lora`: it exports as a PEFT adapter directory (`adapter_config.json` naming
//! the base spec, `adapter_model.safetensors`) that PEFT loads over transformers, and with `merged`
//! also as the base with the adapter merged in (`<dir>-merged`), a Hugging Face model directory.
//!
//! A MaPoRL run keeps its policies as LoRA adapters in PEFT's layout (or, with `full_finetune`, as
//! model directories) beside a manifest ([`MAPORL_MANIFEST`]): [`export_maporl`] copies the policies
//! (not the critics) and, on request, writes each adapter merged into its base as a model directory.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use cotrain_model::loader::{LoadOptions, LoadedModel};
use tch::{Device, Kind};

use crate::checkpoint::{CheckpointError, TrainState, latest_checkpoint, read_state, read_weights};

/// Why a checkpoint could not be exported.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    /// The path is neither a checkpoint directory nor a run directory with a checkpoint.
    #[error("{0}: not a checkpoint (no state.json here, nor a run directory's checkpoints/latest)")]
    NotACheckpoint(PathBuf),
    /// `state.json` does not say which base model a policy was loaded from.
    #[error("{path}: {message}")]
    BadState { path: PathBuf, message: String },
    /// `--policy` names a policy the checkpoint does not have.
    #[error("--policy {index}: the checkpoint has {count} policies (indices 0 to {last})", last = .count.saturating_sub(1))]
    NoSuchPolicy { index: usize, count: usize },
    /// The base model named by the checkpoint cannot be found or loaded.
    #[error("policy {index}: cannot load its base model `{spec}`: {source}")]
    BaseModel {
        index: usize,
        spec: String,
        #[source]
        source: cotrain_model::ModelError,
    },
    /// The checkpoint's tensors do not fit the base model.
    #[error("policy {index}: the checkpoint's weights do not fit base model `{spec}`: {message}")]
    WeightsMismatch {
        index: usize,
        spec: String,
        message: String,
    },
    /// Reading the checkpoint failed.
    #[error("checkpoint: {0}")]
    Checkpoint(#[from] CheckpointError),
    /// Writing a model directory failed.
    #[error("writing the model: {0}")]
    Write(#[from] cotrain_model::export::ExportError),
}

/// One policy of a checkpoint, as `state.json` describes it.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckpointPolicy {
    /// Its index: the checkpoint's `agent-{index}` directory.
    pub index: usize,
    /// The agent name the rollout workers served it under.
    pub worker_agent: String,
    /// The base model spec it was loaded from (`default`, a directory, a `.gguf`, a repo id).
    pub model: String,
    /// Its directory name in an export: see [`policy_dir_name`].
    pub dir_name: String,
    /// The adapter's shape when the policy was trained with LoRA (its tensors are the adapter's).
    pub lora: Option<cotrain_model::lora::LoraConfig>,
}

/// The directory name of policy `policy` in an export and in `RUN_DIR/final_model`: `agent-{i}`
/// for the policy of agent `i` alone, `shared` for one that several agents share.
pub fn policy_dir_name(agent_policy: &[usize], policy: usize) -> String {
    let agents: Vec<usize> = (0..agent_policy.len())
        .filter(|&a| agent_policy[a] == policy)
        .collect();
    match agents.as_slice() {
        [one] => format!("agent-{one}"),
        [] => format!("agent-{policy}"),
        _ => "shared".into(),
    }
}

/// Resolves `path` (a checkpoint directory, or a run directory meaning its latest checkpoint) and
/// reads which policies it holds.
pub fn checkpoint_policies(path: &Path) -> Result<(PathBuf, Vec<CheckpointPolicy>), ExportError> {
    let dir = if path.join("state.json").is_file() {
        path.to_path_buf()
    } else {
        latest_checkpoint(path).ok_or_else(|| ExportError::NotACheckpoint(path.to_path_buf()))?
    };
    let state = read_state(&dir)?;
    Ok((dir.clone(), policies_of(&state, &dir.join("state.json"))?))
}

fn policies_of(state: &TrainState, path: &Path) -> Result<Vec<CheckpointPolicy>, ExportError> {
    let bad = |message: String| ExportError::BadState {
        path: path.to_path_buf(),
        message,
    };
    let list = state.extra["policies"]
        .as_array()
        .ok_or_else(|| bad("no `extra.policies` list naming each policy's base model".into()))?;
    // The actor-critic trainers' critics and value heads follow the policies (`extra.critics`,
    // `extra.value_heads`); export writes the policies.
    let extra_models = state.extra["critics"].as_array().map_or(0, |c| 2 * c.len())
        + state.extra["value_heads"].as_u64().unwrap_or(0) as usize;
    if list.len() + extra_models != state.optimizer_steps.len() {
        return Err(bad(format!(
            "{} policies in `extra.policies` and {extra_models} critic parts, {} models in the checkpoint",
            list.len(),
            state.optimizer_steps.len()
        )));
    }
    let agent_policy: Vec<usize> = state.extra["agent_policy"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_u64().map(|v| v as usize))
                .collect()
        })
        .unwrap_or_default();
    list.iter()
        .enumerate()
        .map(|(index, p)| {
            let model = p["model"]
                .as_str()
                .ok_or_else(|| bad(format!("`extra.policies[{index}].model` is missing")))?;
            let lora = match p.get("lora") {
                Some(v) if !v.is_null() => Some(
                    serde_json::from_value(v.clone())
                        .map_err(|e| bad(format!("`extra.policies[{index}].lora`: {e}")))?,
                ),
                _ => None,
            };
            Ok(CheckpointPolicy {
                lora,
                index,
                worker_agent: p["worker_agent"].as_str().unwrap_or_default().to_string(),
                model: model.to_string(),
                dir_name: policy_dir_name(&agent_policy, index),
            })
        })
        .collect()
}

/// Loads one policy of the checkpoint at `dir`: its base model in the checkpoint's dtype, with the
/// checkpoint's weights (every parameter replaced, bit for bit).
pub fn load_policy(dir: &Path, policy: &CheckpointPolicy) -> Result<LoadedModel, ExportError> {
    let weights = read_weights(dir, policy.index)?;
    let mismatch = |message: String| ExportError::WeightsMismatch {
        index: policy.index,
        spec: policy.model.clone(),
        message,
    };
    let kind = weights
        .values()
        .next()
        .map(|t| t.kind())
        .unwrap_or(Kind::Float);
    if let Some((name, t)) = weights.iter().find(|(_, t)| t.kind() != kind) {
        return Err(mismatch(format!(
            "`{name}` is {:?}, other tensors {kind:?}",
            t.kind()
        )));
    }
    let opts = LoadOptions {
        device: Device::Cpu,
        kind,
    };
    let model = cotrain_model::loader::load(&policy.model, &opts).map_err(|source| {
        ExportError::BaseModel {
            index: policy.index,
            spec: policy.model.clone(),
            source,
        }
    })?;
    let vars = model.vs.variables();
    if let Some(missing) = vars.keys().find(|k| !weights.contains_key(*k)) {
        return Err(mismatch(format!(
            "no tensor `{missing}` ({} tensors in the checkpoint, {} parameters in the model)",
            weights.len(),
            vars.len()
        )));
    }
    let weights: HashMap<String, tch::Tensor> = weights.into_iter().collect();
    model
        .load_named_tensors(&weights)
        .map_err(|e| mismatch(e.to_string()))?;
    Ok(model)
}

/// Loads one LoRA policy of the checkpoint at `dir`: its base (in the adapter's dtype, on the CPU)
/// and the adapter with the checkpoint's tensors.
pub fn load_lora_policy(
    dir: &Path,
    policy: &CheckpointPolicy,
    config: &cotrain_model::lora::LoraConfig,
) -> Result<(LoadedModel, cotrain_model::lora::LoraAdapter), ExportError> {
    let weights = read_weights(dir, policy.index)?;
    let mismatch = |message: String| ExportError::WeightsMismatch {
        index: policy.index,
        spec: policy.model.clone(),
        message,
    };
    let kind = weights
        .values()
        .next()
        .map(|t| t.kind())
        .unwrap_or(Kind::Float);
    let opts = LoadOptions {
        device: Device::Cpu,
        kind,
    };
    let base = cotrain_model::loader::load(&policy.model, &opts).map_err(|source| {
        ExportError::BaseModel {
            index: policy.index,
            spec: policy.model.clone(),
            source,
        }
    })?;
    let adapter = cotrain_model::lora::LoraAdapter::new(&base.model, config.clone())
        .map_err(|e| mismatch(e.to_string()))?;
    let weights: HashMap<String, tch::Tensor> = weights.into_iter().collect();
    adapter
        .load_tensors(&weights)
        .map_err(|e| mismatch(e.to_string()))?;
    Ok((base, adapter))
}

/// What [`export_checkpoint`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Exported {
    /// A Hugging Face model directory.
    Model(PathBuf),
    /// A PEFT adapter directory.
    Adapter(PathBuf),
}

/// `learner export`: writes the checkpoint's policies, `out/agent-{i}` (or `out/shared`) each, or
/// only policy `policy` as `out` itself: model directories, or adapter directories for LoRA
/// policies, each beside its merged model (`<dir>-merged`) when `merged`. Returns what was written.
pub fn export_checkpoint(
    checkpoint: &Path,
    policy: Option<usize>,
    out: &Path,
    merged: bool,
) -> Result<Vec<Exported>, ExportError> {
    let (dir, policies) = checkpoint_policies(checkpoint)?;
    let chosen: Vec<(&CheckpointPolicy, PathBuf)> = match policy {
        Some(index) => {
            let p = policies.get(index).ok_or(ExportError::NoSuchPolicy {
                index,
                count: policies.len(),
            })?;
            vec![(p, out.to_path_buf())]
        }
        None => policies
            .iter()
            .map(|p| (p, out.join(&p.dir_name)))
            .collect(),
    };
    // `--merged` merges the LoRA policies' adapters; fully fine-tuned ones are model directories
    // already. With no adapter among the chosen policies it is a mistake worth saying.
    if merged
        && let Some((p, _)) = chosen
            .iter()
            .find(|(p, _)| p.lora.is_none())
            .filter(|_| chosen.iter().all(|(p, _)| p.lora.is_none()))
    {
        return Err(ExportError::BadState {
            path: dir.join("state.json"),
            message: format!(
                "--merged: policy {} was fully fine-tuned, it has no adapter to merge",
                p.index
            ),
        });
    }
    let mut written = Vec::new();
    for (p, target) in chosen {
        match &p.lora {
            None => {
                let model = load_policy(&dir, p)?;
                written.push(Exported::Model(cotrain_model::export::save_pretrained(
                    &model, &target,
                )?));
            }
            Some(config) => {
                let (base, adapter) = load_lora_policy(&dir, p, config)?;
                let mismatch = |message: String| ExportError::WeightsMismatch {
                    index: p.index,
                    spec: p.model.clone(),
                    message,
                };
                adapter
                    .save_peft(&target, &p.model)
                    .map_err(|e| mismatch(e.to_string()))?;
                written.push(Exported::Adapter(target.clone()));
                if merged {
                    let weights: HashMap<String, tch::Tensor> = adapter
                        .merged(&base.named_parameters())
                        .map_err(|e| mismatch(e.to_string()))?
                        .into_iter()
                        .collect();
                    base.load_named_tensors(&weights)
                        .map_err(|e| mismatch(e.to_string()))?;
                    let mut name = target
                        .file_name()
                        .map(|n| n.to_os_string())
                        .unwrap_or_default();
                    name.push("-merged");
                    written.push(Exported::Model(cotrain_model::export::save_pretrained(
                        &base,
                        &target.with_file_name(name),
                    )?));
                }
            }
        }
    }
    Ok(written)
}

/// The manifest a MaPoRL run writes beside its saved policies (`adapters/`, `final_model/`,
/// `checkpoints/step-N/`): which sub-directories are policies, which critics, and whether the
/// policies are adapters or full models.
pub const MAPORL_MANIFEST: &str = "maporl_policies.json";

/// [`MAPORL_MANIFEST`]'s content.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MaporlManifest {
    /// Policy keys (sub-directories): PEFT adapters, or model directories with `full_finetune`.
    pub policies: Vec<String>,
    /// Critic keys (sub-directories: adapter plus `value_head.safetensors`).
    pub critics: Vec<String>,
    pub full_finetune: bool,
}

/// The MaPoRL policies directory a run or checkpoint path names: the path itself when it holds the
/// manifest, else the run's final `adapters/` or `final_model/`, else its latest `checkpoints/step-N`.
pub fn maporl_dir(path: &Path) -> Option<PathBuf> {
    let holds = |d: &Path| d.join(MAPORL_MANIFEST).is_file();
    for d in [
        path.to_path_buf(),
        path.join("adapters"),
        path.join("final_model"),
    ] {
        if holds(&d) {
            return Some(d);
        }
    }
    std::fs::read_dir(path.join("checkpoints"))
        .ok()?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let n: u64 = e
                .file_name()
                .to_str()?
                .strip_prefix("step-")?
                .parse()
                .ok()?;
            holds(&e.path()).then(|| (n, e.path()))
        })
        .max_by_key(|(n, _)| *n)
        .map(|(_, p)| p)
}

/// `learner export` of a MaPoRL run: every policy (critics are left out) copied to `out/<key>/`
/// (PEFT's layout, or a model directory with `full_finetune`), and with `merged` each adapter also
/// merged into its base (`W + scaling·B·A`) as a Hugging Face model directory `out/<key>-merged/`.
/// Returns what was written.
pub fn export_maporl(dir: &Path, out: &Path, merged: bool) -> Result<Vec<PathBuf>, String> {
    let manifest_path = dir.join(MAPORL_MANIFEST);
    let text = std::fs::read_to_string(&manifest_path)
        .map_err(|e| format!("{}: {e}", manifest_path.display()))?;
    let manifest: MaporlManifest =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", manifest_path.display()))?;
    if merged && manifest.full_finetune {
        return Err(format!(
            "--merged: {} holds fully fine-tuned models, which have no adapter to merge",
            dir.display()
        ));
    }
    let mut written = Vec::new();
    for key in &manifest.policies {
        let src = dir.join(key);
        let dst = out.join(key);
        copy_files(&src, &dst)?;
        written.push(dst);
        if merged {
            let dst = out.join(format!("{key}-merged"));
            merge_adapter(&src, &dst)?;
            written.push(dst);
        }
    }
    if written.is_empty() {
        return Err(format!("{}: the manifest names no policy", dir.display()));
    }
    Ok(written)
}

/// Copies the plain files of `src` into `dst` (created).
fn copy_files(src: &Path, dst: &Path) -> Result<(), String> {
    std::fs::create_dir_all(dst).map_err(|e| format!("{}: {e}", dst.display()))?;
    for entry in std::fs::read_dir(src).map_err(|e| format!("{}: {e}", src.display()))? {
        let path = entry.map_err(|e| format!("{}: {e}", src.display()))?.path();
        if path.is_file() {
            let name = path.file_name().expect("a file has a name");
            std::fs::copy(&path, dst.join(name)).map_err(|e| format!("{}: {e}", path.display()))?;
        }
    }
    Ok(())
}

/// Loads the base an adapter directory names, merges the adapter in and writes the model to `dst`.
fn merge_adapter(src: &Path, dst: &Path) -> Result<(), String> {
    let config_path = src.join("adapter_config.json");
    let text = std::fs::read_to_string(&config_path)
        .map_err(|e| format!("{}: {e}", config_path.display()))?;
    let config: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", config_path.display()))?;
    let spec = config["base_model_name_or_path"].as_str().ok_or_else(|| {
        format!(
            "{}: names no base_model_name_or_path",
            config_path.display()
        )
    })?;
    let base = cotrain_model::loader::load(spec, &LoadOptions::default())
        .map_err(|e| format!("loading `{spec}`: {e}"))?;
    let adapter = cotrain_model::lora::LoraAdapter::load_peft(src, &base.model)
        .map_err(|e| format!("{}: {e}", src.display()))?;
    let weights: HashMap<String, tch::Tensor> = adapter
        .merged(&base.named_parameters())
        .map_err(|e| e.to_string())?
        .into_iter()
        .collect();
    base.load_named_tensors(&weights)
        .map_err(|e| e.to_string())?;
    cotrain_model::export::save_pretrained(&base, dst)
        .map_err(|e| format!("{}: {e}", dst.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_are_named_after_their_agents() {
        assert_eq!(policy_dir_name(&[0, 1, 2], 1), "agent-1");
        assert_eq!(policy_dir_name(&[0, 0, 0], 0), "shared");
        assert_eq!(policy_dir_name(&[], 3), "agent-3");
    }

    #[test]
    fn a_bad_policy_index_names_the_range() {
        let e = ExportError::NoSuchPolicy { index: 4, count: 2 };
        assert_eq!(
            e.to_string(),
            "--policy 4: the checkpoint has 2 policies (indices 0 to 1)"
        );
    }
}
