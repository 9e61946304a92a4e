//! Evaluating saved MaPoRL policies (`learner eval --checkpoint RUN_DIR`): the policies a run wrote
//! (`adapters/`, `final_model/` or `checkpoints/step-N/`, each with its `maporl_policies.json`) are
//! loaded into a trainer built from the run's config, pushed to the rollout workers, and evaluated
//! as the run evaluates itself.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

use cotrain_model::lora::LoraAdapter;

use super::MaporlTrainer;
use crate::error::TrainError;
use crate::export::{MAPORL_MANIFEST, MaporlManifest};
use crate::maporl::agents::PolicyWeights;

/// The directory of the MaPoRL policies saved under `path` (a run directory, its `adapters/` or
/// `final_model/`, or a `checkpoints/step-N/`), or an error naming what is missing.
pub fn saved_policies_dir(path: &Path) -> Result<std::path::PathBuf, TrainError> {
    crate::export::maporl_dir(path).ok_or_else(|| {
        TrainError::Checkpoint(format!(
            "{}: no saved MaPoRL policies ({} there, or in its adapters/, final_model/ or checkpoints/step-N/)",
            path.display(),
            MAPORL_MANIFEST
        ))
    })
}

impl MaporlTrainer {
    /// Replaces every policy's weights with those saved in `dir` (a directory holding
    /// [`MAPORL_MANIFEST`]). The saved keys and kind (adapters or full models) must be the
    /// config's; an adapter must have the config's shape. Critics are not read: evaluation does not
    /// use them.
    pub fn load_saved_policies(&mut self, dir: &Path) -> Result<(), TrainError> {
        let manifest_path = dir.join(MAPORL_MANIFEST);
        let bad = |message: String| TrainError::Checkpoint(format!("{}: {message}", dir.display()));
        let text = std::fs::read_to_string(&manifest_path)
            .map_err(|e| bad(format!("{MAPORL_MANIFEST}: {e}")))?;
        let manifest: MaporlManifest =
            serde_json::from_str(&text).map_err(|e| bad(format!("{MAPORL_MANIFEST}: {e}")))?;
        if manifest.full_finetune != self.m.full_finetune {
            let kind = |full: bool| {
                if full {
                    "full models (maporl.full_finetune: true)"
                } else {
                    "LoRA adapters"
                }
            };
            return Err(bad(format!(
                "holds {}, the config trains {}",
                kind(manifest.full_finetune),
                kind(self.m.full_finetune)
            )));
        }
        let saved: BTreeSet<&String> = manifest.policies.iter().collect();
        let wanted: BTreeSet<&String> = self.s.adapters.policies.keys().collect();
        if saved != wanted {
            return Err(bad(format!(
                "holds the policies {saved:?}, the config's adapter layout has {wanted:?} (evaluate with the run's own config)"
            )));
        }
        for (key, p) in self.s.adapters.policies.iter_mut() {
            let from = dir.join(key);
            let base = &self.s.bases.models[p.base];
            match &mut p.weights {
                PolicyWeights::Lora(adapter) => {
                    let loaded = LoraAdapter::load_peft(&from, &base.model)
                        .map_err(|e| bad(format!("{key}: {e}")))?;
                    if loaded.config.r != adapter.config.r
                        || loaded.config.alpha != adapter.config.alpha
                    {
                        return Err(bad(format!(
                            "{key}: r {} and lora_alpha {} saved, the config's maporl.lora has r {} and lora_alpha {}",
                            loaded.config.r,
                            loaded.config.alpha,
                            adapter.config.r,
                            adapter.config.alpha
                        )));
                    }
                    let tensors: HashMap<String, tch::Tensor> =
                        loaded.named_tensors().into_iter().collect();
                    adapter
                        .load_tensors(&tensors)
                        .map_err(|e| bad(format!("{key}: {e}")))?;
                }
                PolicyWeights::Full(model) => {
                    let spec = from.display().to_string();
                    let loaded = cotrain_model::loader::load(&spec, &self.s.bases.opts)
                        .map_err(|e| bad(format!("{key}: {e}")))?;
                    if loaded.model.config() != base.model.config() {
                        return Err(bad(format!(
                            "{key}: the saved model's config is not its base's"
                        )));
                    }
                    **model = loaded;
                }
            }
        }
        // The sampling seed the run's own evaluation used at this point: a `checkpoints/step-N`
        // is evaluated at step N, the final policies after the last step.
        self.step = dir
            .file_name()
            .and_then(|n| n.to_str()?.strip_prefix("step-")?.parse().ok())
            .unwrap_or_else(|| self.total_steps());
        Ok(())
    }

    /// Pushes the policies to the rollout workers and evaluates them (see [`Self::evaluate`]).
    pub fn evaluate_loaded(&mut self) -> Result<BTreeMap<String, f64>, TrainError> {
        self.sync_all()?;
        self.evaluate()
    }
}
