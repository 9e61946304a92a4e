//! Checkpoints of a run: saving them (and the final models), resuming a run from its latest, and
//! loading a checkpoint's weights for evaluation.

use std::path::{Path, PathBuf};

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use tracing::info;

use super::setup::Trainer;
use crate::checkpoint::{
    TrainState, latest_checkpoint, load_checkpoint, read_weights, save_checkpoint,
};
use crate::error::TrainError;

impl Trainer {
    /// Loads the latest checkpoint of `run_dir` (weights, optimiser moments, step, data position,
    /// RNG) so that the run continues as if it had never stopped.
    pub fn resume(&mut self, run_dir: &Path) -> Result<PathBuf, TrainError> {
        let dir = latest_checkpoint(run_dir).ok_or_else(|| {
            TrainError::Checkpoint(format!(
                "{}: no complete checkpoint to resume from",
                run_dir.display()
            ))
        })?;
        self.restore(&dir)?;
        if let Some(m) = &mut self.metrics {
            let dropped = m
                .truncate_after(self.step)
                .map_err(|e| TrainError::Io(format!("{}: {e}", m.path().display())))?;
            if dropped > 0 {
                info!(
                    dropped,
                    step = self.step,
                    "metrics of steps after the checkpoint dropped; they are logged again"
                );
            }
            let rollouts = self.s.run_dir.join("rollouts.jsonl");
            let dropped = crate::metrics::truncate_jsonl_after(&rollouts, self.step)
                .map_err(|e| TrainError::Io(format!("{}: {e}", rollouts.display())))?;
            if dropped > 0 {
                info!(
                    dropped,
                    step = self.step,
                    "rollouts of steps after the checkpoint dropped; they are logged again"
                );
            }
        }
        Ok(dir)
    }

    /// Loads one checkpoint directory (`RUN_DIR/checkpoints/step-N`) into this trainer.
    pub fn restore(&mut self, dir: &Path) -> Result<(), TrainError> {
        let dir = dir.to_path_buf();
        let mut pairs: Vec<(&mut tch::nn::VarStore, &mut crate::algo::AdamW)> = self
            .s
            .policies
            .iter_mut()
            .map(|p| p.trained_vs_and_optimizer())
            .collect();
        // The actor-critic trainers' critics (backbone, head) and value heads follow the policies.
        for c in self.critics.iter_mut() {
            pairs.push((&mut c.model.vs, &mut c.optimizer));
            pairs.push((&mut c.head.vs, &mut c.head.optimizer));
        }
        pairs.extend(self.heads.iter_mut().map(|h| (&mut h.vs, &mut h.optimizer)));
        let st =
            load_checkpoint(&dir, &mut pairs).map_err(|e| TrainError::Checkpoint(e.to_string()))?;
        self.step = st.step;
        self.epoch = st.epoch;
        self.position = st.data_position;
        let word: u128 = st.rng_word_pos.parse().map_err(|_| {
            TrainError::Checkpoint(format!(
                "{}: bad rng_word_pos `{}`",
                dir.display(),
                st.rng_word_pos
            ))
        })?;
        self.rng_seed = st.rng_seed;
        self.rng = ChaCha8Rng::seed_from_u64(st.rng_seed);
        self.rng.set_word_pos(word);
        // The partial rollout buffer of `train_between_items` (absent from older checkpoints: empty).
        self.buffered = match st.extra.get("buffered_nodes") {
            Some(v) => serde_json::from_value(v.clone()).map_err(|e| {
                TrainError::Checkpoint(format!("{}: buffered_nodes: {e}", dir.display()))
            })?,
            None => Vec::new(),
        };
        self.ac_buffer = match st.extra.get("actor_critic_buffer") {
            Some(v) => serde_json::from_value(v.clone()).map_err(|e| {
                TrainError::Checkpoint(format!("{}: actor_critic_buffer: {e}", dir.display()))
            })?,
            None => Vec::new(),
        };
        info!(checkpoint = %dir.display(), step = st.step, epoch = st.epoch, position = st.data_position, "resumed");
        self.last_checkpoint = Some(dir);
        Ok(())
    }

    /// Loads only the weights of a checkpoint (`agent-{i}/model.safetensors`) into the policies, for
    /// evaluation: optimiser state is neither read nor allocated.
    pub fn restore_weights(&mut self, dir: &Path) -> Result<(), TrainError> {
        for (i, p) in self.s.policies.iter().enumerate() {
            let tensors: std::collections::HashMap<String, tch::Tensor> = read_weights(dir, i)
                .map_err(|e| TrainError::Checkpoint(e.to_string()))?
                .into_iter()
                .collect();
            p.load_trained(&tensors).map_err(|e| {
                TrainError::Checkpoint(format!("{} policy {i}: {e}", dir.display()))
            })?;
        }
        info!(checkpoint = %dir.display(), "weights loaded");
        Ok(())
    }

    /// Writes a checkpoint of the current state (atomically; see [`crate::checkpoint`]).
    pub fn save_checkpoint(&mut self) -> Result<PathBuf, TrainError> {
        let state = TrainState {
            step: self.step,
            epoch: self.epoch,
            data_position: self.position,
            rng_seed: self.rng_seed,
            rng_word_pos: self.rng.get_word_pos().to_string(),
            optimizer_steps: self.optimizers().iter().map(|o| o.step).collect(),
            served_versions: self
                .s
                .policies
                .iter()
                .map(|p| (p.worker_agent.clone(), p.wire_version))
                .collect(),
            extra: serde_json::json!({
                "agent_policy": self.s.agent_policy,
                // `lora` (the adapter's shape) marks a policy whose tensors are an adapter of `model`.
                "policies": self.s.policies.iter().map(|p| {
                    let mut entry = serde_json::json!({"worker_agent": p.worker_agent, "model": p.model_spec});
                    if let Some(a) = &p.adapter {
                        entry["lora"] = serde_json::to_value(&a.config).expect("a lora config serialises");
                    }
                    entry
                }).collect::<Vec<_>>(),
                "buffered_nodes": self.buffered,
                // Each critic is two models (backbone, head); each value head one.
                "critics": self.critics.iter().map(|c| serde_json::json!({"model": c.spec})).collect::<Vec<_>>(),
                "value_heads": self.heads.len(),
                "actor_critic_buffer": self.ac_buffer,
            }),
        };
        let pairs = self.checkpointed();
        let dir = save_checkpoint(&self.s.run_dir, &pairs, &state)
            .map_err(|e| TrainError::Checkpoint(e.to_string()))?;
        self.last_checkpoint = Some(dir.clone());
        crate::checkpoint::apply_save_total_limit(
            &self.s.run_dir,
            self.s.cfg.raw.output.save_total_limit,
        );
        Ok(dir)
    }

    /// What a checkpoint holds, in order: each policy's trained tensors, then the actor-critic
    /// trainers' critics (backbone, then head) and the value heads on the actors, each with its
    /// AdamW (`agent-{i}` in that order).
    fn checkpointed(&self) -> Vec<(&tch::nn::VarStore, &crate::algo::AdamW)> {
        let mut pairs: Vec<(&tch::nn::VarStore, &crate::algo::AdamW)> = self
            .s
            .policies
            .iter()
            .map(|p| (p.trained_vs(), &p.optimizer))
            .collect();
        for c in &self.critics {
            pairs.push((&c.model.vs, &c.optimizer));
            pairs.push((&c.head.vs, &c.head.optimizer));
        }
        pairs.extend(self.heads.iter().map(|h| (&h.vs, &h.optimizer)));
        pairs
    }

    /// Every optimiser, in [`Trainer::checkpointed`]'s order.
    pub(super) fn optimizers(&self) -> Vec<&crate::algo::AdamW> {
        self.checkpointed().into_iter().map(|(_, o)| o).collect()
    }

    /// Every optimiser of these parts, mutable, in [`Trainer::checkpointed`]'s order (keep the two
    /// together). The parts rather than `&mut self`, so that the caller may hold the collective.
    pub(super) fn optimizers_mut<'a>(
        policies: &'a mut [super::policy::Policy],
        critics: &'a mut [super::critic::Critic],
        heads: &'a mut [super::critic::ValueHead],
    ) -> Vec<&'a mut crate::algo::AdamW> {
        let mut all: Vec<&mut crate::algo::AdamW> =
            policies.iter_mut().map(|p| &mut p.optimizer).collect();
        for c in critics.iter_mut() {
            all.push(&mut c.optimizer);
            all.push(&mut c.head.optimizer);
        }
        all.extend(heads.iter_mut().map(|h| &mut h.optimizer));
        all
    }

    /// Writes every policy as a Hugging Face model directory (see [`cotrain_model::export`]), or
    /// with LoRA as a PEFT adapter directory: `RUN_DIR/final_model/agent-{i}`, or one
    /// `final_model/shared` for shared parameters.
    pub fn save_final_models(&self) -> Result<Vec<PathBuf>, TrainError> {
        let root = self.s.run_dir.join("final_model");
        self.s
            .policies
            .iter()
            .enumerate()
            .map(|(pi, p)| {
                let dir = root.join(crate::export::policy_dir_name(&self.s.agent_policy, pi));
                p.save_pretrained(&dir)
                    .map_err(|e| TrainError::Checkpoint(format!("final model: {e}")))
            })
            .collect()
    }

    /// The error of a step that failed before it changed the trainer's state, with a checkpoint of
    /// that state (unless the last one already is) named in the message.
    pub(super) fn checkpoint_before_failing(&mut self, e: TrainError) -> TrainError {
        let saved = match &self.last_checkpoint {
            Some(d) if d.ends_with(format!("step-{}", self.step)) => Ok(d.clone()),
            _ if self.step == 0 => return e,
            _ => self.save_checkpoint(),
        };
        match saved {
            Ok(dir) => TrainError::Reward(format!(
                "{e}\nthe run stopped at step {}; its checkpoint is {}: resume with `learner train --config ... --resume {}`",
                self.step,
                dir.display(),
                self.s.run_dir.display()
            )),
            Err(c) => TrainError::Reward(format!("{e}\n(and no checkpoint could be written: {c})")),
        }
    }
}
