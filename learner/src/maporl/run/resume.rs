//! Checkpoints a MaPoRL run resumes from (`learner train --resume RUN_DIR`).
//!
//! `checkpoints/step-N/` holds, in one atomic directory ([`crate::checkpoint::save_checkpoint_with`]):
//! the policies in PEFT's layout with `maporl_policies.json` (what `learner export` and `learner
//! eval` read), and what a resume needs besides: every trained store with its AdamW moments
//! (`agent-{i}/`: the policies in key order, then each critic's adapter and value head) and
//! `state.json` (step, the PPO generator, the policies' versions). The epoch's question order and
//! every sampling seed are functions of the seed and the step, and the update draws nothing from
//! libtorch's generator (LoRA's dropout is off in PPO, as TRL's trainer turns dropout off), so a
//! resumed run continues as the uninterrupted one.

use std::path::{Path, PathBuf};

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use tch::nn::VarStore;
use tracing::info;

use super::{MaporlTrainer, TAG_PPO};
use crate::algo::AdamW;
use crate::checkpoint::{TrainState, latest_checkpoint, load_checkpoint, save_checkpoint_with};
use crate::error::TrainError;
use crate::maporl::agents::PolicyWeights;
use crate::seeds::derive_seed;

impl MaporlTrainer {
    /// Every trained store and its optimiser, in checkpoint order.
    fn trained(&self) -> Vec<(&VarStore, &AdamW)> {
        let mut out: Vec<(&VarStore, &AdamW)> = Vec::new();
        for p in self.s.adapters.policies.values() {
            let vs = match &p.weights {
                PolicyWeights::Lora(a) => &a.vs,
                PolicyWeights::Full(m) => &m.vs,
            };
            out.push((vs, &p.optimizer));
        }
        for c in self.s.adapters.critics.values() {
            out.push((&c.adapter.vs, &c.adapter_opt));
            out.push((&c.head_vs, &c.head_opt));
        }
        out
    }

    fn trained_mut(&mut self) -> Vec<(&mut VarStore, &mut AdamW)> {
        let mut out: Vec<(&mut VarStore, &mut AdamW)> = Vec::new();
        for p in self.s.adapters.policies.values_mut() {
            let vs = match &mut p.weights {
                PolicyWeights::Lora(a) => &mut a.vs,
                PolicyWeights::Full(m) => &mut m.vs,
            };
            out.push((vs, &mut p.optimizer));
        }
        for c in self.s.adapters.critics.values_mut() {
            out.push((&mut c.adapter.vs, &mut c.adapter_opt));
            out.push((&mut c.head_vs, &mut c.head_opt));
        }
        out
    }

    /// Steps per epoch.
    fn steps_per_epoch(&self) -> u64 {
        (self
            .s
            .train_items
            .len()
            .div_ceil(self.m.questions_per_step()) as u64)
            .max(1)
    }

    /// Writes `checkpoints/step-{step}` (see the module docs) and points `checkpoints/latest` at it.
    pub(super) fn save_checkpoint(&self) -> Result<PathBuf, TrainError> {
        let per_epoch = self.steps_per_epoch();
        let trained = self.trained();
        let state = TrainState {
            step: self.step,
            epoch: self.step / per_epoch,
            data_position: (self.step % per_epoch) * self.m.questions_per_step() as u64,
            rng_seed: derive_seed(&[self.s.cfg.raw.seed, TAG_PPO]),
            rng_word_pos: self.rng.get_word_pos().to_string(),
            optimizer_steps: trained.iter().map(|(_, o)| o.step).collect(),
            served_versions: self.versions(),
            extra: serde_json::json!({"trainer": "maporl"}),
        };
        save_checkpoint_with(&self.s.run_dir, &trained, &state, |tmp| {
            self.save_policies(tmp)
                .map(|_| ())
                .map_err(|e| e.to_string())
        })
        .map_err(|e| TrainError::Checkpoint(e.to_string()))
    }

    /// Loads the latest checkpoint of `run_dir` (every store and its AdamW moments, the step, the
    /// PPO generator, the policies' versions), drops the metrics and rollouts logged after it, and
    /// reads back the evaluations before it (for the accuracy plot).
    pub fn resume(&mut self, run_dir: &Path) -> Result<PathBuf, TrainError> {
        let dir = latest_checkpoint(run_dir).ok_or_else(|| {
            TrainError::Checkpoint(format!(
                "{}: no complete checkpoint to resume from",
                run_dir.display()
            ))
        })?;
        let bad = |m: String| TrainError::Checkpoint(format!("{}: {m}", dir.display()));
        let mut trained = self.trained_mut();
        let st = load_checkpoint(&dir, &mut trained)
            .map_err(|e| TrainError::Checkpoint(e.to_string()))?;
        drop(trained);
        if st.extra.get("trainer").and_then(|t| t.as_str()) != Some("maporl") {
            return Err(bad("not a MaPoRL checkpoint".into()));
        }
        let word: u128 = st
            .rng_word_pos
            .parse()
            .map_err(|_| bad(format!("bad rng_word_pos `{}`", st.rng_word_pos)))?;
        self.rng = ChaCha8Rng::seed_from_u64(st.rng_seed);
        self.rng.set_word_pos(word);
        for (key, p) in self.s.adapters.policies.iter_mut() {
            p.version = *st
                .served_versions
                .get(key)
                .ok_or_else(|| bad(format!("no version of policy `{key}`")))?;
        }
        self.step = st.step;
        if let Some(m) = &mut self.metrics {
            m.truncate_after(self.step)
                .map_err(|e| TrainError::Io(format!("{}: {e}", m.path().display())))?;
            let rollouts = self.s.run_dir.join("rollouts.jsonl");
            crate::metrics::truncate_jsonl_after(&rollouts, self.step)
                .map_err(|e| TrainError::Io(format!("{}: {e}", rollouts.display())))?;
            // An evaluation is logged with the step it preceded.
            let key = "eval/accuracy/turn0";
            let text = std::fs::read_to_string(m.path()).unwrap_or_default();
            self.evals = text
                .lines()
                .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                .filter(|v| v.get(key).is_some())
                .filter_map(|v| {
                    let step = v.get("step")?.as_u64()?.saturating_sub(1);
                    let scalars = v
                        .as_object()?
                        .iter()
                        .filter(|(k, _)| k.starts_with("eval/"))
                        .filter_map(|(k, x)| Some((k.clone(), x.as_f64()?)))
                        .collect();
                    Some((step, scalars))
                })
                .collect();
        }
        info!(checkpoint = %dir.display(), step = self.step, "resumed");
        Ok(dir)
    }
}
